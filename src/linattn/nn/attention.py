"""Attention layers, feed-forward networks, norms and the pre-norm block (design §6–8, §14).

Both attention layers share one interface, so the same module serves training and decoding:

    forward(x, mask=None, cache=None, positions=None) -> (y, cache)

x: (B, N, d_model); mask: (B, N) bool key-padding mask, True = real token; y: (B, N, d_model).
With cache=None the whole sequence runs in parallel (chunked causal or non-causal) and the
returned cache is None. With a cache (an empty one from `new_cache()` for the prefill, or the one
returned by the previous call) the new tokens continue the cached context and the cache is
updated in place and returned:

    LinearAttention:  cache = (kv (B, H, F, E), z (B, H, F)) + position; O(1) per new token.
    SoftmaxAttention: cache = growing K (B, H, T, D), V (B, H, T, E) (+ padding mask); O(T).

Every attention layer can put a short causal convolution on q, k and v after their projection
(`short_conv`, linattn.nn.convolution; its cache is the last K−1 projected inputs) and normalize and
gate its per-head output before the output projection (`output_gate`, `OutputGate`); design §14.
The gated and delta-rule kinds build on the same base in linattn.nn.recurrent.

Positions are absolute token indices counted from each sequence's first *real* token, so a
left-padded prompt sees the same positions (RoPE, cosFormer) as the same prompt alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .._checks import check_bool, check_int, check_number, check_positive_int
from .convolution import ShortConvolution
from .feature_maps import make_feature_map
from ..ops import linear_attention, linear_attention_step, native, packed, softmax_attention
from ..ops.linear.chunked import DEFAULT_CHUNK_SIZE
from ..parallel import sequence_halo, sequence_parallel_linear_attention, sequence_parallel_softmax_attention
from .positional import RotaryEmbedding

# --------------------------------------------------------------------------------------------
# positions and caches


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


def _nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@dataclass
class LayerCache(PositionCounter):
    """What every attention layer's cache holds besides its mixer's context: `conv`, the last K−1
    inputs of the layer's short convolution (B, K−1, C) (None without one, or before the first call)."""

    conv: torch.Tensor | None = None


@dataclass
class LinearAttentionCache(LayerCache):
    """Recurrent state of one LinearAttention layer: (kv (B, H, F, E), z (B, H, F)), float32
    (float64 for float64 models), None before the first call. Its size does not depend on length."""

    state: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def nbytes(self) -> int:
        return _nbytes(self.conv, *(self.state or ()))


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
            return _nbytes(self.conv)
        per_token = self.k[:, :, 0].numel() * self.k.element_size() + self.v[:, :, 0].numel() * self.v.element_size()
        return self.length * per_token + _nbytes(self.conv)

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


# --------------------------------------------------------------------------------------------
# attention layers


def shard_halo(x: torch.Tensor, kernel_size: int, group) -> torch.Tensor | None:
    """The tail a causal convolution of `kernel_size` needs before this rank's shard x (B, n, C) under
    sequence parallelism (its K−1 inputs from the earlier ranks, linattn.parallel.sequence_halo);
    None without a group or for K = 1 (the convolution then starts from zeros, as a whole sequence
    does)."""
    if group is None or kernel_size == 1:
        return None
    return sequence_halo(x, kernel_size - 1, group=group)


def column_major(linear: nn.Linear) -> nn.Linear:
    """Stores linear.weight (out, in) as the transpose of a contiguous (in, out) tensor. x·Wᵀ for one
    token is then a plain (1, in)·(in, out) product, which CPU BLAS runs about 1.7× faster than the
    row-major layout's (decoding is bound by these matrix-vector products); batched products cost
    the same. Values, shapes, state_dict names and checkpoints are unchanged."""
    linear.weight = nn.Parameter(linear.weight.detach().t().contiguous().t(), requires_grad=linear.weight.requires_grad)
    return linear


def _check_heads(d_model: int, n_heads: int, qk_dim: int | None) -> tuple[int, int]:
    check_positive_int("d_model", d_model)
    check_positive_int("n_heads", n_heads)
    if d_model % n_heads:
        raise ValueError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads})")
    head_dim = d_model // n_heads
    if qk_dim is None:
        return head_dim, head_dim
    check_positive_int("qk_dim", qk_dim, allow_none=True)
    return head_dim, qk_dim


def _check_dropout(p) -> float:
    check_number("dropout", p, minimum=0, maximum=1, high_open=True)
    return float(p)


class _Attention(nn.Module):
    """Projections shared by every kind: x (B, N, d) -> q, k (B, H, N, qk_dim), v (B, H, N, d/H),
    one fused input matmul, then (short_conv = K > 0) a causal depthwise convolution of kernel K over
    the projected channels; output o (B, H, N, d/H) -> (B, N, d) through (output_gate) the per-head
    RMSNorm and swish gate, then `out` and dropout."""

    kind = ""

    def __init__(self, d_model: int, n_heads: int, qk_dim: int | None, causal: bool, dropout: float, bias: bool,
                 *, short_conv: int = 0, output_gate: bool = False, norm_eps: float = 1e-5):
        super().__init__()
        self.head_dim, self.qk_dim = _check_heads(d_model, n_heads, qk_dim)
        self.d_model, self.n_heads, self.causal = d_model, n_heads, bool(causal)
        self.dropout_p = _check_dropout(dropout)
        check_int("short_conv", short_conv, minimum=0)
        check_bool("output_gate", output_gate)
        width = n_heads * (2 * self.qk_dim + self.head_dim)
        self.qkv = column_major(nn.Linear(d_model, width, bias=bias))
        self.conv = ShortConvolution(width, short_conv) if short_conv else None
        self.output_gate = OutputGate(d_model, n_heads, self.head_dim, norm_eps, bias) if output_gate else None
        self.out = column_major(nn.Linear(n_heads * self.head_dim, d_model, bias=bias))
        self.dropout = nn.Dropout(self.dropout_p)
        #: set by LinearTransformerLM.set_sequence_parallel_group; used when no cache is given.
        self.sequence_parallel_group = None
        #: per-head RMSNorms of q and k (Qwen3's), set by `set_qk_norm`; None: none
        self.q_norm = self.k_norm = None

    def set_qk_norm(self, eps: float = 1e-6) -> None:
        """Normalizes q and k per head (RMSNorm over the q/k head dim, one gain shared by the heads)
        right after the projection: Qwen3's q_norm / k_norm."""
        self.q_norm, self.k_norm = RMSNorm(self.qk_dim, eps), RMSNorm(self.qk_dim, eps)

    def set_qkv_bias(self, bias: bool) -> None:
        """Gives the fused q/k/v projection a bias (zeros) or takes it away, whatever `bias` the
        layer was built with (Qwen2: biases on q, k, v only)."""
        if (self.qkv.bias is not None) == bool(bias):
            return
        old = self.qkv
        new = column_major(nn.Linear(old.in_features, old.out_features, bias=bool(bias)))
        new.to(device=old.weight.device, dtype=old.weight.dtype)
        with torch.no_grad():
            new.weight.copy_(old.weight)
            if new.bias is not None:
                new.bias.zero_()
        self.qkv = new

    def _project(self, x: torch.Tensor, mask: torch.Tensor | None = None, cache: LayerCache | None = None,
                 cu_seqlens: torch.Tensor | None = None):
        """q, k, v of x; with a short convolution, padded tokens enter it as zeros and the cache's
        tail (the last K−1 projected inputs) continues the sequence and is updated; under sequence
        parallelism the tail is the K−1 inputs before the shard, from the earlier ranks. With
        cu_seqlens (packed sequences, x (1, T, d)) no tap of the convolution crosses a boundary."""
        if x.dim() != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"x must have shape (B, N, d_model={self.d_model}), got {tuple(x.shape)}")
        b, n, _ = x.shape
        if cu_seqlens is not None and (cache is not None or self.sequence_parallel_group is not None):
            raise ValueError("cu_seqlens (packed sequences) takes neither a cache nor sequence parallelism")
        y = self.qkv(x)
        if self.conv is not None:
            if cu_seqlens is not None:
                y = self.conv(y, mask, cu_seqlens=cu_seqlens)
            elif cache is None:
                y = self.conv(y, mask, shard_halo(y, self.conv.kernel_size, self.sequence_parallel_group))
            else:
                y, cache.conv = self.conv(y, mask, cache.conv, return_tail=True)
        if self.qk_dim == self.head_dim:  # [q | k | v] as (3, B, H, N, D) views: three ops, not seven
            q, k, v = y.view(b, n, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        else:
            hq = self.n_heads * self.qk_dim
            q, k, v = y.split((hq, hq, self.n_heads * self.head_dim), dim=-1)
            q = q.view(b, n, self.n_heads, self.qk_dim).transpose(1, 2)
            k = k.view(b, n, self.n_heads, self.qk_dim).transpose(1, 2)
            v = v.view(b, n, self.n_heads, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def _merge(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """o (B, H, N, E) -> (B, N, d); x (B, N, d), the layer's input, feeds the output gate."""
        b, _, n, _ = o.shape
        o = o.transpose(1, 2)
        if self.output_gate is not None:
            o = self.output_gate(o, x)
        y = self.out(o.reshape(b, n, self.n_heads * self.head_dim))
        return self.dropout(y) if self.dropout_p and self.training else y

    @staticmethod
    def _check_mask(mask, x):
        if mask is None:
            return
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or tuple(mask.shape) != tuple(x.shape[:2]):
            got = f"{tuple(mask.shape)} {mask.dtype}" if isinstance(mask, torch.Tensor) else type(mask).__name__
            raise ValueError(f"mask must be a bool tensor of shape (B, N) = {tuple(x.shape[:2])} (True = real token), "
                             f"got {got}")


class LinearAttention(_Attention):
    """Multi-head linear attention (Katharopoulos et al. 2020) with a feature map φ:

        y_i = W_o · concat_h [ Σ_j (R_i φ(q_i))ᵀ (R_j φ(k_j)) v_j / (Σ_j φ(q_i)ᵀ φ(k_j) + ε) ],  j ≤ i if causal,

    R_i the RoPE rotation of the *features* (numerator only, design §6) when rope=True, identity
    otherwise. q, k: (B, H, N, qk_dim) (default qk_dim = d_model / n_heads; use a small one, e.g. 16,
    for Taylor features, F = 1 + D + D²), v: (B, H, N, d_model / n_heads). One φ per layer, shared
    by the heads. Dropout applies to the output projection (there is no attention matrix to drop).

    Training: forward(x, mask) runs the chunked causal (or non-causal) operator.
    Decoding: forward(x, cache=layer.new_cache()) for the prefill, then forward(x_t, cache=cache)
    per token, O(F·E) per head whatever the context length.
    """

    kind = "linear"

    def __init__(self, d_model: int, n_heads: int, *, feature_map="elu", feature_map_options: dict | None = None,
                 causal: bool = True, rope: bool = False, rope_base: float = 10_000.0, qk_dim: int | None = None,
                 normalize: bool = True, eps: float = 1e-6, dropout: float = 0.0, bias: bool = False,
                 chunk_size: int = DEFAULT_CHUNK_SIZE, short_conv: int = 0, output_gate: bool = False,
                 norm_eps: float = 1e-5):
        super().__init__(d_model, n_heads, qk_dim, causal, dropout, bias, short_conv=short_conv,
                         output_gate=output_gate, norm_eps=norm_eps)
        if isinstance(feature_map, str):
            self.feature_map = make_feature_map(feature_map, self.qk_dim, **(feature_map_options or {}))
        elif isinstance(feature_map, nn.Module) and hasattr(feature_map, "feature_dim"):
            if feature_map_options:
                raise ValueError("feature_map_options only apply when feature_map is a name")
            if getattr(feature_map, "head_dim", self.qk_dim) != self.qk_dim:
                raise ValueError(f"feature_map head_dim {feature_map.head_dim} != qk_dim {self.qk_dim}")
            self.feature_map = feature_map
        else:
            raise ValueError(f"feature_map must be a name or a linattn feature map module, got {feature_map!r}")
        self.rope = RotaryEmbedding(self.feature_map.feature_dim, rope_base) if rope else None
        check_positive_int("chunk_size", chunk_size)
        self.normalize, self.eps, self.chunk_size = bool(normalize), float(eps), chunk_size
        self._needs_positions = rope or getattr(self.feature_map, "needs_positions", False)

    def new_cache(self) -> LinearAttentionCache:
        return LinearAttentionCache()

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, cache: LinearAttentionCache | None = None,
                positions: torch.Tensor | None = None, *, cu_seqlens: torch.Tensor | None = None):
        """x (B, N, d), mask (B, N) bool or None, positions (N,) or (B, N) or None (derived from the
        mask and the cache). cu_seqlens: packed sequences in x (1, T, d) (linattn.ops.packed; causal
        only; positions then default to each token's index in its sequence, counting real tokens only
        when a mask is given). Returns (y (B, N, d), cache)."""
        self._check_mask(mask, x)
        q, k, v = self._project(x, mask, cache, cu_seqlens)
        if cu_seqlens is not None:
            if positions is None and self._needs_positions and mask is not None:  # real tokens only, as unpacked
                positions = packed.positions(cu_seqlens, x.shape[1], mask).to(x.device)
            o = linear_attention(q, k, v, causal=self.causal, key_padding_mask=mask, positions=positions,
                                 chunk_size=self.chunk_size, cu_seqlens=cu_seqlens, feature_map=self.feature_map,
                                 normalize=self.normalize, eps=self.eps, rope=self.rope)
            return self._merge(o, x), None
        n = x.shape[1]
        if positions is None and self._needs_positions and (cache is not None or mask is not None):
            positions = (cache.next_positions(n, mask, x.device) if cache is not None
                         else token_positions(n, mask, device=x.device))
        opts = dict(feature_map=self.feature_map, normalize=self.normalize, eps=self.eps, rope=self.rope)
        if cache is None:
            if self.sequence_parallel_group is not None:
                if mask is not None:
                    raise ValueError("sequence parallelism does not take a padding mask")
                if positions is not None:  # global indices of this shard (default: the shard's offset + arange)
                    opts["positions"] = positions
                o = sequence_parallel_linear_attention(q, k, v, group=self.sequence_parallel_group, causal=self.causal,
                                                       scale=None, chunk_size=self.chunk_size, **opts)
            else:
                o = linear_attention(q, k, v, causal=self.causal, key_padding_mask=mask, positions=positions,
                                     chunk_size=self.chunk_size, **opts)
            return self._merge(o, x), None
        if not self.causal:
            raise ValueError("a cache (recurrent decoding) needs a causal LinearAttention")
        if n == 1:
            o, state = linear_attention_step(cache.state, q, k, v, key_padding_mask=mask, positions=positions, **opts)
        else:
            o, state = linear_attention(q, k, v, causal=True, key_padding_mask=mask, positions=positions,
                                        initial_state=cache.state, return_state=True, chunk_size=self.chunk_size,
                                        **opts)
        cache.state = state
        cache.advance(n, mask)
        return self._merge(o, x), cache

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, n_heads={self.n_heads}, qk_dim={self.qk_dim}, causal={self.causal}, "
                f"rope={self.rope is not None}, normalize={self.normalize}")


class SoftmaxAttention(_Attention):
    """Multi-head softmax attention with the same interface as LinearAttention:

        y_i = W_o · concat_h [ Σ_j softmax_j(q̂_iᵀ k̂_j / √qk_dim) v_j ],  j ≤ i if causal,

    q̂, k̂ = RoPE-rotated q, k (standard RoPE on the head dim) when rope=True. Dropout applies to the
    attention weights (training only) and to the output projection. Decoding keeps a KV cache.
    """

    kind = "softmax"

    def __init__(self, d_model: int, n_heads: int, *, causal: bool = True, rope: bool = False,
                 rope_base: float = 10_000.0, qk_dim: int | None = None, dropout: float = 0.0, bias: bool = False,
                 short_conv: int = 0, output_gate: bool = False, norm_eps: float = 1e-5):
        super().__init__(d_model, n_heads, qk_dim, causal, dropout, bias, short_conv=short_conv,
                         output_gate=output_gate, norm_eps=norm_eps)
        self.rope = RotaryEmbedding(self.qk_dim, rope_base) if rope else None

    def new_cache(self) -> KVCache:
        return KVCache()

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, cache: KVCache | None = None,
                positions: torch.Tensor | None = None, *, cu_seqlens: torch.Tensor | None = None):
        """x (B, N, d), mask (B, N) bool or None, positions (N,) or (B, N) or None. cu_seqlens: packed
        sequences in x (1, T, d): a block-diagonal mask keeps them apart (positions default to each
        token's index in its sequence, counting real tokens only when a mask is given). Returns (y, cache)."""
        self._check_mask(mask, x)
        q, k, v = self._project(x, mask, cache, cu_seqlens)
        n = x.shape[1]
        if cu_seqlens is not None and positions is None:
            positions = packed.positions(cu_seqlens, n, mask).to(x.device)
        if self.rope is not None:
            if positions is None:
                positions = (cache.next_positions(n, mask, x.device) if cache is not None
                             else token_positions(n, mask, device=x.device))
            q, k = self.rope.rotate(q, positions), self.rope.rotate(k, positions)
        p = self.dropout_p if self.training else 0.0
        if cu_seqlens is not None:
            return self._merge(_packed_softmax_attention(q, k, v, cu_seqlens, mask, self.causal, p), x), None
        if cache is not None:
            if not self.causal:
                raise ValueError("a cache (recurrent decoding) needs a causal SoftmaxAttention")
            k, v, key_mask = cache.append(k, v, mask)
            cache.advance(n, mask)
            mask = key_mask
        elif self.sequence_parallel_group is not None:
            if mask is not None:
                raise ValueError("sequence parallelism does not take a padding mask")
            o = sequence_parallel_softmax_attention(q, k, v, group=self.sequence_parallel_group, causal=self.causal,
                                                    scale=None)
            return self._merge(o, x), None
        if mask is None:
            # a single new query sees every cached key: no mask to build
            o = softmax_attention(q, k, v, causal=self.causal and n > 1, dropout_p=p)
        else:
            o = _padded_softmax_attention(q, k, v, mask, self.causal, p)
        return self._merge(o, x), cache

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, n_heads={self.n_heads}, qk_dim={self.qk_dim}, causal={self.causal}, "
                f"rope={self.rope is not None}")


def _packed_softmax_attention(q, k, v, cu_seqlens, key_mask, causal: bool, dropout_p: float):
    """softmax attention on packed sequences (q, k, v (1, H, T, ·)): query i sees key j only in its
    own sequence. Without a key mask the sequences of each length run as the rows of one SDPA call
    (O(Σ L²) work, not O(T²)); with one (1, T), a block-diagonal boolean mask of real keys, a query
    that would see no key at all (padding) seeing itself."""
    n = q.shape[2]
    if key_mask is None:
        bounds = packed.boundaries(cu_seqlens, batch=q.shape[0], length=n)
        by_length: dict[int, list[tuple[int, int]]] = {}
        for s, e in bounds:
            if e > s:
                by_length.setdefault(e - s, []).append((s, e))
        o = q.new_empty(*q.shape[:3], v.shape[-1])
        for spans in by_length.values():
            part = F.scaled_dot_product_attention(*(packed.gather(x, spans, 2) for x in (q, k, v)),
                                                  is_causal=causal and spans[0][1] - spans[0][0] > 1,
                                                  dropout_p=dropout_p)
            for i, (s, e) in enumerate(spans):
                o[:, :, s:e] = part[i:i + 1]
        return o
    seq = packed.sequence_ids(cu_seqlens, n).to(q.device)
    allowed = seq[:, None] == seq[None, :]
    if causal:
        allowed = allowed & torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    allowed = (allowed & key_mask[0][None, :]) | torch.eye(n, dtype=torch.bool, device=q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=dropout_p)


def _padded_softmax_attention(q, k, v, key_mask, causal: bool, dropout_p: float):
    """softmax attention with a key-padding mask (B, Nk) whose last Nq entries describe the queries.

    A padded query whose every visible key is padding (left padding + causal) would give a row of
    −∞ and NaN; such query rows (padding anyway) are let see every key instead, so all values stay
    finite and real tokens are unaffected.
    """
    n_q, n_k = q.shape[2], k.shape[2]
    allowed = key_mask[:, None, None, :]
    if causal:
        allowed = allowed & torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril(n_k - n_q)
    allowed = allowed | ~key_mask[:, None, -n_q:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=dropout_p)


# --------------------------------------------------------------------------------------------
# norms, feed-forward, block


class RMSNorm(nn.Module):
    """y = x / √(mean(x²) + eps) · g, computed in float32, returned in x's dtype. x (…, d)."""

    def __init__(self, d: int, eps: float = 1e-5):
        super().__init__()
        self.eps = float(eps)
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype in (torch.float16, torch.bfloat16):
            y = F.rms_norm(x.float(), self.weight.shape, None, self.eps)
            return y.to(x.dtype) * self.weight.to(x.dtype)
        if native.rms_norm_fusable(x, self.weight):  # CPU inference: one fused operator
            return native.rms_norm(x, self.weight, self.eps)
        w = self.weight if self.weight.dtype == x.dtype else self.weight.to(x.dtype)
        return F.rms_norm(x, self.weight.shape, w, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps:g}"


class OutputGate(nn.Module):
    """Per-head output normalization and swish output gate (RetNet, GLA, DeltaNet; design §14):

        o_h ← RMSNorm(o_h) ⊙ swish(W_g x)_h

    o_h (E) is head h's output at one token, normalized by its own root mean square with a gain (E)
    shared by the heads; W_g (d -> H·E) projects the layer's input x. swish(a) = a·sigmoid(a).
    forward(o (B, N, H, E), x (B, N, d)) -> (B, N, H, E).
    """

    def __init__(self, d_model: int, n_heads: int, head_dim: int, eps: float = 1e-5, bias: bool = False):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, head_dim
        self.norm = RMSNorm(head_dim, eps)
        self.proj = column_major(nn.Linear(d_model, n_heads * head_dim, bias=bias))

    def forward(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        gate = F.silu(self.proj(x)).unflatten(-1, (self.n_heads, self.head_dim))
        return self.norm(o) * gate


NORMS = ("rmsnorm", "layernorm")
ACTIVATIONS = ("gelu", "swiglu", "gelu_tanh")


def make_norm(kind: str, d: int, eps: float = 1e-5) -> nn.Module:
    """'rmsnorm' -> RMSNorm(d), 'layernorm' -> nn.LayerNorm(d)."""
    if kind == "rmsnorm":
        return RMSNorm(d, eps)
    if kind == "layernorm":
        return nn.LayerNorm(d, eps=eps)
    raise ValueError(f"norm must be one of {NORMS}, got {kind!r}")


class FeedForward(nn.Module):
    """Position-wise FFN, x (…, d) -> (…, d):

        gelu:      W_down · gelu(W_up x)
        gelu_tanh: W_down · gelu_tanh(W_up x)             (GPT-2's tanh approximation of GELU)
        swiglu:    W_down · (silu(W_gate x) ⊙ W_up x)     (Shazeer 2020; W_gate, W_up fused in `up`)
    """

    def __init__(self, d_model: int, d_ff: int, activation: str = "swiglu", dropout: float = 0.0, bias: bool = False):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        check_positive_int("d_ff", d_ff)
        self.activation = activation
        self.up = column_major(nn.Linear(d_model, d_ff * (2 if activation == "swiglu" else 1), bias=bias))
        self.down = column_major(nn.Linear(d_ff, d_model, bias=bias))
        self.dropout = nn.Dropout(_check_dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        if self.activation == "swiglu":
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h, approximate="tanh" if self.activation == "gelu_tanh" else "none")
        y = self.down(h)
        return self.dropout(y) if self.dropout.p and self.training else y


class Block(nn.Module):
    """Pre-norm Transformer block (design §8):

        x ← x + Attn(Norm₁(x)),   x ← x + FFN(Norm₂(x)).

    forward(x (B, N, d), mask, cache, positions) -> (x, cache), the attention's cache passed through.
    """

    def __init__(self, attn: _Attention, d_ff: int, *, activation: str = "swiglu", norm: str = "rmsnorm",
                 norm_eps: float = 1e-5, dropout: float = 0.0, bias: bool = False):
        super().__init__()
        d = attn.d_model
        self.norm1 = make_norm(norm, d, norm_eps)
        self.attn = attn
        self.norm2 = make_norm(norm, d, norm_eps)
        self.ffn = FeedForward(d, d_ff, activation, dropout, bias)

    def new_cache(self):
        """The attention layer's empty cache."""
        return self.attn.new_cache()

    def forward(self, x, mask=None, cache=None, positions=None, *, cu_seqlens=None):
        if cu_seqlens is not None:
            a, cache = self.attn(self.norm1(x), mask, cache, positions, cu_seqlens=cu_seqlens)
        else:
            a, cache = self.attn(self.norm1(x), mask, cache, positions)
        x = x + a
        x = x + self.ffn(self.norm2(x))
        return x, cache


class GatedConvolution(nn.Module):
    """Zoology's BaseConv (Arora et al. 2023): a causal depthwise convolution of kernel K (3 by default)
    gated by a linear map of the same input, plus the input,

        y = conv(u) ⊙ (W u + b) + u,         u (B, N, d),

    with biases on both, as in Zoology. forward(u, mask=None, tail=None, return_tail=False) -> y, or
    (y, tail') with return_tail (the convolution's cache, see linattn.nn.convolution.ShortConvolution).
    """

    def __init__(self, d_model: int, kernel_size: int = 3):
        super().__init__()
        self.conv = ShortConvolution(d_model, kernel_size, bias=True)
        self.proj = column_major(nn.Linear(d_model, d_model, bias=True))

    def forward(self, u: torch.Tensor, mask: torch.Tensor | None = None, tail: torch.Tensor | None = None,
                return_tail: bool = False, *, cu_seqlens: torch.Tensor | None = None):
        c = self.conv(u, mask, tail, return_tail, cu_seqlens=cu_seqlens)
        if return_tail:
            c, tail = c
        y = torch.addcmul(u, c, self.proj(u))
        return (y, tail) if return_tail else y


@dataclass
class ConvMixerCache:
    """The decoding cache of a ConvMixerBlock: its attention layer's cache and the gated convolution's
    tail (B, K−1, d) (None before the first call)."""

    attn: PositionCounter
    conv: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return self.attn.nbytes + _nbytes(self.conv)


class ConvMixerBlock(nn.Module):
    """A block without feed-forward network that alternates a gated short convolution with the
    attention layer (the layout of Zoology's and Based's MQAR models; design §14, §16):

        x ← x + GatedConv(Norm₁(x)),   x ← x + Attn(Norm₂(x)).

    forward(x (B, N, d), mask, cache, positions) -> (x, cache); cache a ConvMixerCache or None.
    """

    def __init__(self, attn: _Attention, kernel_size: int = 3, *, norm: str = "rmsnorm", norm_eps: float = 1e-5):
        super().__init__()
        d = attn.d_model
        self.norm1 = make_norm(norm, d, norm_eps)
        self.conv = GatedConvolution(d, kernel_size)
        self.norm2 = make_norm(norm, d, norm_eps)
        self.attn = attn
        #: set by LinearTransformerLM.set_sequence_parallel_group: the convolution's halo comes from there
        self.sequence_parallel_group = None

    def new_cache(self) -> ConvMixerCache:
        return ConvMixerCache(attn=self.attn.new_cache())

    def forward(self, x, mask=None, cache=None, positions=None, *, cu_seqlens=None):
        if cu_seqlens is not None:
            if cache is not None or self.sequence_parallel_group is not None:
                raise ValueError("cu_seqlens (packed sequences) takes neither a cache nor sequence parallelism")
            x = x + self.conv(self.norm1(x), mask, cu_seqlens=cu_seqlens)
            a, _ = self.attn(self.norm2(x), mask, None, positions, cu_seqlens=cu_seqlens)
            return x + a, None
        if cache is None:
            u = self.norm1(x)
            x = x + self.conv(u, mask, shard_halo(u, self.conv.conv.kernel_size, self.sequence_parallel_group))
            a, _ = self.attn(self.norm2(x), mask, None, positions)
            return x + a, None
        c, cache.conv = self.conv(self.norm1(x), mask, cache.conv, return_tail=True)
        x = x + c
        a, _ = self.attn(self.norm2(x), mask, cache.attn, positions)
        return x + a, cache


__all__ = [
    "ACTIVATIONS",
    "NORMS",
    "Block",
    "ConvMixerBlock",
    "ConvMixerCache",
    "FeedForward",
    "GatedConvolution",
    "KVCache",
    "LayerCache",
    "LinearAttention",
    "LinearAttentionCache",
    "OutputGate",
    "PositionCounter",
    "RMSNorm",
    "SoftmaxAttention",
    "make_norm",
    "token_positions",
]
