"""The window family: causal softmax attention over the last W tokens (linattn.ops.swa), alone (the
`swa` kind) or with a recurrence for the tokens beyond the window — one normalizer with linear
attention (LoLCATs, linattn.ops.swa.lolcats_attention) or the mean with a gated recurrence (Liger,
`WINDOW_GATED`). Decoding keeps a ring buffer of the last W keys and values (plus the recurrence's
state): memory flat in the context length. None of them runs sequence-parallel yet."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...ops import lolcats_attention, lolcats_attention_step, sliding_window_attention, sliding_window_attention_step
from ..caches import LigerCache, LoLCATsCache, SlidingWindowCache
from .gated import GATED
from .record import Family, mean_of


@dataclass
class WindowMix:
    """q, k (B, H, N, D) (rotated already, if at all), v (B, H, N, E); the window W; the query block of
    the chunked operator."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    window: int
    chunk_size: int


def _full(m: WindowMix, mask, cu_seqlens=None):
    return sliding_window_attention(m.q, m.k, m.v, window=m.window, key_padding_mask=mask, chunk_size=m.chunk_size,
                                    cu_seqlens=cu_seqlens)


def _step(cache: SlidingWindowCache, m: WindowMix, mask):
    o, cache.window = sliding_window_attention_step(cache.window, m.q, m.k, m.v, window=m.window,
                                                    key_padding_mask=mask, chunk_size=m.chunk_size)
    return o


WINDOW = Family("window", SlidingWindowCache, full=_full, packed=_full, step=_step)


@dataclass
class HybridMix:
    """LoLCATs' operands: q, k (B, H, N, D) for the window's scores, qf, kf (B, H, N, F) their features
    for the linear part, v (B, H, N, E); the window W, its factor γ (H,), the query block."""

    q: torch.Tensor
    k: torch.Tensor
    qf: torch.Tensor
    kf: torch.Tensor
    v: torch.Tensor
    window: int
    window_factor: torch.Tensor
    chunk_size: int

    def options(self, mask) -> dict:
        return dict(window=self.window, window_factor=self.window_factor, key_padding_mask=mask,
                    chunk_size=self.chunk_size)


def _hybrid_full(m: HybridMix, mask, cu_seqlens=None):
    return lolcats_attention(m.q, m.k, m.qf, m.kf, m.v, cu_seqlens=cu_seqlens, **m.options(mask))


def _hybrid_step(cache: LoLCATsCache, m: HybridMix, mask):
    o, cache.state = lolcats_attention_step(cache.state, m.q, m.k, m.qf, m.kf, m.v, **m.options(mask))
    return o


#: LoLCATs: the window and linear attention beyond it under one normalizer
WINDOW_LINEAR = Family("window", LoLCATsCache, full=_hybrid_full, packed=_hybrid_full, step=_hybrid_step)

#: Liger: the mean of the window (operands WindowMix) and a gated recurrence (GatedMix)
WINDOW_GATED = mean_of("window", WINDOW, GATED, LigerCache)

__all__ = ["HybridMix", "WINDOW", "WINDOW_GATED", "WINDOW_LINEAR", "WindowMix"]
