"""What a layer keeps between decoding calls: token positions and the caches of every operator family
(design §8).

Positions are absolute token indices counted from each sequence's first *real* token, so a
left-padded prompt sees the same positions (RoPE, cosFormer) as the same prompt alone. Every cache
counts them (`PositionCounter`) and holds the tail of the layer's short convolution (`LayerCache`);
each family adds its state (linattn.nn.families: its `new_state` makes one, its `step` advances it):

    LinearAttentionCache  (kv (B, H, F, E), z (B, H, F))               linear family    O(1) per token
    RecurrentCache        S (B, H, D, E)                               gated, delta     O(1)
    KVCache               K (B, H, T, D), V (B, H, T, E) (+ mask)      softmax          O(T)
    SlidingWindowCache    ring buffer of the last W keys and values    window           O(W)
    LoLCATsCache          the window's ring buffer + a linear state    window + linear  O(W)
    LigerCache            the window's ring buffer + a gated state     window + gated   O(W)

States are float32 (float64 for float64 models), None before the first call.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, is_dataclass

import torch

from ..ops.swa import HybridState, WindowState


def token_positions(n: int, mask: torch.Tensor | None = None, offset: int = 0, seen: torch.Tensor | None = None,
                    device=None) -> torch.Tensor:
    """Absolute positions of n new tokens.

    Without padding (mask and seen None): arange(offset, offset + n), shape (n,).
    With padding: (B, n), p_bj = seen_b + #{real tokens among the new ones up to j} − 1, clamped at 0,
    where seen_b (B,) counts the real tokens before (default: offset for every row). Pads before a
    sequence's first real token get position 0; they are masked out as keys anyway.
    """
    if mask is None and seen is None:
        return torch.arange(offset, offset + n, device=device)
    if seen is None:
        seen = torch.full((mask.shape[0],), offset, dtype=torch.long, device=mask.device)
    if mask is None:
        return seen[:, None] + torch.arange(n, device=seen.device)
    return (seen[:, None] + mask.long().cumsum(1) - 1).clamp_min(0)


@dataclass
class PositionCounter:
    """How far a cached sequence has got: `length` tokens fed (pads included) and, once padding
    was seen, `seen` (B,) long, the number of real tokens per row (the next position of each row)."""

    length: int = 0
    seen: torch.Tensor | None = None

    def next_positions(self, n: int, mask: torch.Tensor | None, device) -> torch.Tensor:
        return token_positions(n, mask, self.length, self.seen, device)

    def advance(self, n: int, mask: torch.Tensor | None) -> None:
        if mask is not None or self.seen is not None:
            b = mask.shape[0] if mask is not None else self.seen.shape[0]
            dev = mask.device if mask is not None else self.seen.device
            seen = self.seen if self.seen is not None else torch.full((b,), self.length, dtype=torch.long, device=dev)
            self.seen = seen + (mask.sum(1) if mask is not None else n)
        self.length += n


def nbytes(*parts) -> int:
    """Bytes held by tensors, by states that say their own size (`.nbytes`) and by tuples of them
    (None skipped)."""
    total = 0
    for p in parts:
        if isinstance(p, torch.Tensor):
            total += p.numel() * p.element_size()
        elif hasattr(p, "nbytes"):
            total += p.nbytes
        elif isinstance(p, tuple):
            total += nbytes(*p)
    return total


@dataclass
class LayerCache(PositionCounter):
    """What every attention layer's cache holds besides its mixer's context: `conv`, the last K−1
    inputs of the layer's short convolution (B, K−1, C) (None without one, or before the first call).
    `nbytes`: the bytes of the convolution's tail and of the family's state fields."""

    conv: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return nbytes(*(getattr(self, f.name) for f in fields(self) if f.name not in ("length", "seen")))


@dataclass
class LinearAttentionCache(LayerCache):
    """Recurrent state of one LinearAttention layer: (kv (B, H, F, E), z (B, H, F)), float32
    (float64 for float64 models), None before the first call. Its size does not depend on length."""

    state: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass
class RecurrentCache(LayerCache):
    """The decoding cache of a gated or delta-rule layer: the state S (B, H, D, E) (None before the
    first call) and the short convolution's tail. Its size does not depend on the context length."""

    state: torch.Tensor | None = None


@dataclass
class KVCache(LayerCache):
    """Keys and values of one SoftmaxAttention layer, in preallocated buffers of `capacity` tokens
    that grow geometrically (amortized O(1) append, no O(T) copy per token): k (B, H, cap, D),
    v (B, H, cap, E), mask (B, cap) bool or None (no padding so far). Valid entries: [:length]."""

    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    mask: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        if self.k is None:
            return nbytes(self.conv)
        per_token = self.k[:, :, 0].numel() * self.k.element_size() + self.v[:, :, 0].numel() * self.v.element_size()
        return self.length * per_token + nbytes(self.conv)

    def append(self, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None):
        """Writes n new keys/values after the first `length` ones; returns views (K, V, mask) of all
        length + n entries. Does not advance `length` (the layer does, after)."""
        b, h, n, _ = k.shape
        start, end = self.length, self.length + n
        cap = 0 if self.k is None else self.k.shape[2]
        if self.k is not None and (self.k.shape[:2] != (b, h) or self.k.dtype != k.dtype):
            raise ValueError(f"KVCache holds keys of shape (B, H) = {tuple(self.k.shape[:2])} and dtype {self.k.dtype}, "
                             f"got {(b, h)} and {k.dtype}")
        if end > cap:
            new_cap = max(end + end // 4 + 16, 2 * cap)
            self.k = _grow(self.k, (b, h, new_cap, k.shape[-1]), start, k)
            self.v = _grow(self.v, (b, h, new_cap, v.shape[-1]), start, v)
            if self.mask is not None:
                m = torch.ones(b, new_cap, dtype=torch.bool, device=k.device)
                m[:, :start] = self.mask[:, :start]
                self.mask = m
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        if mask is not None and self.mask is None:
            self.mask = torch.ones(b, self.k.shape[2], dtype=torch.bool, device=k.device)
        if self.mask is not None:
            self.mask[:, start:end] = True if mask is None else mask
        keep = None if self.mask is None else self.mask[:, :end]
        return self.k[:, :, :end], self.v[:, :, :end], keep


def _grow(buf: torch.Tensor | None, shape, keep: int, like: torch.Tensor) -> torch.Tensor:
    new = torch.empty(shape, dtype=like.dtype, device=like.device)
    if buf is not None and keep:
        new[:, :, :keep] = buf[:, :, :keep]
    return new


@dataclass
class SlidingWindowCache(LayerCache):
    """Decoding cache of one SlidingWindowAttention layer: `window`, a WindowState ring buffer of the
    last W keys (B, H, W, qk_dim) and values (B, H, W, E) (None before the first call). Its size does
    not depend on the context length."""

    window: WindowState | None = None


@dataclass
class LoLCATsCache(LayerCache):
    """Decoding cache of one LoLCATsAttention layer: `state`, a HybridState (ring buffer of the last
    W keys, key features and values; the linear state of the tokens before them), None before the
    first call. Its size does not depend on the context length."""

    state: HybridState | None = None


@dataclass
class LigerCache(SlidingWindowCache):
    """Decoding cache of one LigerAttention layer: the window's ring buffer (SlidingWindowCache) and
    `state`, the gated recurrence's kv (B, H, D, E) in float32 (None before the first call)."""

    state: torch.Tensor | None = None


def first_tensor(obj) -> torch.Tensor | None:
    """The first tensor of at least one dimension that `obj` holds (dataclass fields, lists, tuples, nested,
    as linattn.models.session.select_rows walks it), or None: of a cache's layers, one whose dim 0 is the
    batch (every linattn cache tensor is batch-first)."""
    if isinstance(obj, torch.Tensor):
        return obj if obj.dim() else None
    if isinstance(obj, (tuple, list)):
        items = obj
    elif is_dataclass(obj) and not isinstance(obj, type):
        items = [getattr(obj, f.name) for f in fields(obj)]
    else:
        return None
    for item in items:
        t = first_tensor(item)
        if t is not None:
            return t
    return None


__all__ = [
    "KVCache",
    "LayerCache",
    "LigerCache",
    "LinearAttentionCache",
    "LoLCATsCache",
    "PositionCounter",
    "RecurrentCache",
    "SlidingWindowCache",
    "first_tensor",
    "nbytes",
    "token_positions",
]
