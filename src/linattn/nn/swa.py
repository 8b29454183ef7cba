"""Sliding-window softmax attention as a layer (the `swa` kind), with the interface of
linattn.nn.attention.SoftmaxAttention:

    forward(x, mask=None, cache=None, positions=None) -> (y, cache)

    y_i = W_o · concat_h [ Σ_{j ∈ window(i)} softmax_j(q̂_iᵀ k̂_j / √qk_dim) v_j ],
    window(i) = the last W tokens up to i (itself included),

q̂, k̂ the RoPE-rotated q, k when rope=True. Training runs linattn.ops.swa.sliding_window_attention
(chunked, O(N·W)); decoding keeps a ring buffer of the last W rotated keys and values
(SlidingWindowCache), so its memory is flat in the context length, unlike SoftmaxAttention's KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._checks import check_int
from .attention import LayerCache, _Attention, token_positions
from ..ops import packed
from ..ops.linear.chunked import DEFAULT_CHUNK_SIZE
from ..ops.swa import WindowState, sliding_window_attention, sliding_window_attention_step
from .positional import RotaryEmbedding

#: The window of LoLCATs and of the `swa` kind when the config does not choose one.
DEFAULT_WINDOW = 64


@dataclass
class SlidingWindowCache(LayerCache):
    """Decoding cache of one SlidingWindowAttention layer: `window`, a WindowState ring buffer of the
    last W keys (B, H, W, qk_dim) and values (B, H, W, E) (None before the first call). Its size does
    not depend on the context length."""

    window: WindowState | None = None

    @property
    def nbytes(self) -> int:
        conv = 0 if self.conv is None else self.conv.numel() * self.conv.element_size()
        return conv + (0 if self.window is None else self.window.nbytes)


def _check_window(window) -> int:
    check_int("window", window, minimum=1)
    return window


class SlidingWindowAttention(_Attention):
    """Multi-head causal sliding-window softmax attention (Mistral, Longformer's causal band).

    window: W, the tokens each query sees (itself and the W − 1 before). chunk_size: the query block
    of the chunked operator. The other arguments are SoftmaxAttention's; causal must stay True, and
    dropout applies to the output projection only (the operator has no attention-weight dropout).
    """

    kind = "swa"

    def __init__(self, d_model: int, n_heads: int, *, window: int = DEFAULT_WINDOW, causal: bool = True,
                 rope: bool = False, rope_base: float = 10_000.0, qk_dim: int | None = None, dropout: float = 0.0,
                 bias: bool = False, chunk_size: int = DEFAULT_CHUNK_SIZE, short_conv: int = 0,
                 output_gate: bool = False, norm_eps: float = 1e-5):
        if causal is not True:
            raise ValueError(f"causal must be True: sliding-window attention is causal, got {causal!r}")
        super().__init__(d_model, n_heads, qk_dim, causal, dropout, bias, short_conv=short_conv,
                         output_gate=output_gate, norm_eps=norm_eps)
        self.window = _check_window(window)
        check_int("chunk_size", chunk_size, minimum=1)
        self.chunk_size = chunk_size
        self.rope = RotaryEmbedding(self.qk_dim, rope_base) if rope else None

    def new_cache(self) -> SlidingWindowCache:
        return SlidingWindowCache()

    def _rotate(self, q, k, x, mask, cache, positions):
        if self.rope is None:
            return q, k
        n = x.shape[1]
        if positions is None:
            positions = (cache.next_positions(n, mask, x.device) if cache is not None
                         else token_positions(n, mask, device=x.device))
        return self.rope.rotate(q, positions), self.rope.rotate(k, positions)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, cache: SlidingWindowCache | None = None,
                positions: torch.Tensor | None = None, *, cu_seqlens: torch.Tensor | None = None):
        """x (B, N, d), mask (B, N) bool or None, positions (N,) or (B, N) or None. cu_seqlens: packed
        sequences in x (1, T, d): no query sees a key of another sequence, positions restart at 0 in
        each (counting real tokens only when a mask is given). Returns (y, cache)."""
        self._check_mask(mask, x)
        if self.sequence_parallel_group is not None and cache is None:
            raise ValueError("SlidingWindowAttention does not run sequence-parallel yet")
        if cu_seqlens is not None and cache is not None:
            raise ValueError("cu_seqlens (packed sequences) takes no cache")
        q, k, v = self._project(x, mask, cache, cu_seqlens)
        if cu_seqlens is not None and positions is None and self.rope is not None:
            positions = packed.positions(cu_seqlens, x.shape[1], mask).to(x.device)
        q, k = self._rotate(q, k, x, mask, cache, positions)
        if cache is None:
            o = sliding_window_attention(q, k, v, window=self.window, key_padding_mask=mask,
                                         chunk_size=self.chunk_size, cu_seqlens=cu_seqlens)
            return self._merge(o, x), None
        o, cache.window = sliding_window_attention_step(cache.window, q, k, v, window=self.window,
                                                        key_padding_mask=mask, chunk_size=self.chunk_size)
        cache.advance(x.shape[1], mask)
        return self._merge(o, x), cache

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, n_heads={self.n_heads}, qk_dim={self.qk_dim}, window={self.window}, "
                f"rope={self.rope is not None}")


__all__ = ["DEFAULT_WINDOW", "SlidingWindowAttention", "SlidingWindowCache"]
