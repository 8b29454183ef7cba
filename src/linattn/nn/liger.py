"""Liger attention (Lan et al. 2025, "Liger: Linearizing LLMs to gated recurrent structures"): a
softmax attention's own q, k, v, o projections turned into a gated linear recurrence plus a sliding
window, with no new parameter, so that a pretrained Transformer converts without a stage of
feature-map training (design §19):

    g_t   = logsigmoid(k_t) / 16                     (per key channel: the gate is built from the key)
    φ(x)  = softmax(x) over the head dim             (for q and k)
    S_t   = diag(e^{g_t}) S_{t−1} + φ(k_t) v_tᵀ,      o_lin,t = S_tᵀ φ(q_t)        (GLA, unnormalized)
    o_win = sliding-window softmax attention over the last W tokens, q and k RoPE-rotated
    y     = W_o · concat_h [ (o_win + o_lin) / 2 ]

q, k are the projections before RoPE in the gate and the linear part (the recurrence needs no
positions), after it in the window (the teacher's softmax read them rotated). The Liger paper's
GLA variant pools the key projection to the gate's width (identity here: the gate has one value per
key channel) and mixes the two outputs with equal weights; 1/16 is GLA's gate normalizer.

Training runs linattn.ops.gated_linear_attention and linattn.ops.sliding_window_attention (both
chunked; packed sequences through cu_seqlens); decoding keeps the GLA state and the window's ring
buffer (LigerCache): memory flat in the context length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..ops import gated_linear_attention, gated_linear_attention_step, sliding_window_attention
from ..ops.swa import sliding_window_attention_step
from .swa import SlidingWindowAttention, SlidingWindowCache

#: GLA's gate normalizer (Yang et al. 2023, §4.4), which Liger keeps
GATE_NORMALIZER = 16.0


@dataclass
class LigerCache(SlidingWindowCache):
    """Decoding cache of one LigerAttention layer: the window's ring buffer (SlidingWindowCache) and
    `state`, the gated recurrence's kv (B, H, D, E) in float32 (None before the first call)."""

    state: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        extra = 0 if self.state is None else self.state.numel() * self.state.element_size()
        return super().nbytes + extra


class LigerAttention(SlidingWindowAttention):
    """Multi-head causal Liger attention (see the module docstring); the arguments are
    SlidingWindowAttention's (window W, default 64 as in Liger)."""

    kind = "liger"

    def new_cache(self) -> LigerCache:
        return LigerCache()

    @staticmethod
    def gate(k: torch.Tensor) -> torch.Tensor:
        """g = logsigmoid(k) / 16 in float32 (float64 for float64 k): (B, H, N, D) -> same shape."""
        return F.logsigmoid(k.to(torch.float64 if k.dtype == torch.float64 else torch.float32)) / GATE_NORMALIZER

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, cache: LigerCache | None = None,
                positions: torch.Tensor | None = None, *, cu_seqlens: torch.Tensor | None = None):
        """x (B, N, d), mask (B, N) bool or None, positions (N,) or (B, N) or None; cu_seqlens: packed
        sequences in x (1, T, d). Returns (y, cache)."""
        self._check_mask(mask, x)
        if self.sequence_parallel_group is not None and cache is None:
            raise ValueError("LigerAttention does not run sequence-parallel yet")
        if cu_seqlens is not None and cache is not None:
            raise ValueError("cu_seqlens (packed sequences) takes no cache")
        q, k, v = self._project(x, mask, cache, cu_seqlens)
        g = self.gate(k)
        fq, fk = torch.softmax(q, dim=-1), torch.softmax(k, dim=-1)
        if cu_seqlens is not None and positions is None and self.rope is not None:
            from ..ops import packed

            positions = packed.positions(cu_seqlens, x.shape[1]).to(x.device)
        rq, rk = self._rotate(q, k, x, mask, cache, positions)
        if cache is None:
            o_lin = gated_linear_attention(fq, fk, v, g, scale=1.0, chunk_size=self.chunk_size, key_padding_mask=mask,
                                           cu_seqlens=cu_seqlens)
            o_win = sliding_window_attention(rq, rk, v, window=self.window, key_padding_mask=mask,
                                             chunk_size=self.chunk_size, cu_seqlens=cu_seqlens)
            return self._merge(0.5 * (o_win + o_lin), x), None
        if mask is not None:  # a padded token neither writes nor decays the recurrent state
            g = g.masked_fill(~mask[:, None, :, None], 0.0)
            fk = fk * mask[:, None, :, None].to(fk.dtype)
        if x.shape[1] == 1:
            o_lin, cache.state = gated_linear_attention_step(cache.state, fq, fk, v, g, scale=1.0)
        else:
            o_lin, cache.state = gated_linear_attention(fq, fk, v, g, scale=1.0, chunk_size=self.chunk_size,
                                                        initial_state=cache.state, return_state=True)
        o_win, cache.window = sliding_window_attention_step(cache.window, rq, rk, v, window=self.window,
                                                            key_padding_mask=mask, chunk_size=self.chunk_size)
        cache.advance(x.shape[1], mask)
        return self._merge(0.5 * (o_win + o_lin.to(o_win.dtype)), x), cache


__all__ = ["GATE_NORMALIZER", "LigerAttention", "LigerCache"]
