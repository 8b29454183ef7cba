"""The gated family (design §12): S_t = diag(e^{g_t}) S_{t−1} + k_t v_tᵀ, o_t = S_tᵀ (scale·q_t), with g
per head (B, H, N) or per key feature (B, H, N, D), on linattn.ops.gated_linear_attention and its step,
linattn.parallel's sharded form; the state is S (RecurrentCache). A padded token adds no key and
does not decay the state (the operator's key_padding_mask)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...ops import gated_linear_attention, gated_linear_attention_step
from ...parallel import sequence_parallel_gated_linear_attention
from ..caches import RecurrentCache
from .record import Family


@dataclass
class GatedMix:
    """q, k (B, H, N, D), v (B, H, N, E), g log-decays ≤ 0 in the state dtype, (B, H, N) or (B, H, N, D);
    the chunk of the chunked operator; scale multiplies q (None: q comes scaled)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    chunk_size: int
    scale: float | None = None


def _full(m: GatedMix, mask, cu_seqlens=None):
    return gated_linear_attention(m.q, m.k, m.v, m.g, scale=m.scale, key_padding_mask=mask, chunk_size=m.chunk_size,
                                  cu_seqlens=cu_seqlens)


def _sequence_parallel(m: GatedMix, group):
    return sequence_parallel_gated_linear_attention(m.q, m.k, m.v, m.g, group=group, scale=m.scale,
                                                    chunk_size=m.chunk_size)


def _step(cache: RecurrentCache, m: GatedMix, mask):
    if m.q.shape[2] == 1 and mask is None:
        o, cache.state = gated_linear_attention_step(cache.state, m.q, m.k, m.v, m.g, scale=m.scale)
    else:
        o, cache.state = gated_linear_attention(m.q, m.k, m.v, m.g, scale=m.scale, key_padding_mask=mask,
                                                initial_state=cache.state, return_state=True,
                                                chunk_size=m.chunk_size)
    return o


GATED = Family("gated", RecurrentCache, full=_full, packed=_full, step=_step, sequence_parallel=_sequence_parallel)

__all__ = ["GATED", "GatedMix"]
