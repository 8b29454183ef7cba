"""The linear family (design §3–6): o_i = Σ_j (R_i φ(q_i))ᵀ(R_j φ(k_j)) v_j / (Σ_j φ(q_i)ᵀφ(k_j) + ε), j ≤ i
when causal, on linattn.ops.linear_attention and its step, linattn.parallel's sharded form; the state
is (kv, z) (LinearAttentionCache)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...ops import linear_attention, linear_attention_step
from ...parallel import sequence_parallel_linear_attention
from ..caches import LinearAttentionCache
from .record import Family


@dataclass
class LinearMix:
    """q, k (B, H, N, D) before φ, v (B, H, N, E); φ (feature_map), normalize, ε, RoPE on the features
    (rope, numerator only) at `positions` ((N,) or (B, N) or None: the operator counts them), causal,
    the chunk of the chunked operator."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    feature_map: object
    normalize: bool
    eps: float
    rope: object
    causal: bool
    chunk_size: int
    positions: torch.Tensor | None = None

    def options(self) -> dict:
        return dict(feature_map=self.feature_map, normalize=self.normalize, eps=self.eps, rope=self.rope)


def _full(m: LinearMix, mask, cu_seqlens=None):
    return linear_attention(m.q, m.k, m.v, causal=m.causal, key_padding_mask=mask, positions=m.positions,
                            chunk_size=m.chunk_size, cu_seqlens=cu_seqlens, **m.options())


def _sequence_parallel(m: LinearMix, group):
    opts = m.options()
    if m.positions is not None:  # global indices of this shard (default: the shard's offset + arange)
        opts["positions"] = m.positions
    return sequence_parallel_linear_attention(m.q, m.k, m.v, group=group, causal=m.causal, scale=None,
                                              chunk_size=m.chunk_size, **opts)


def _step(cache: LinearAttentionCache, m: LinearMix, mask):
    if m.q.shape[2] == 1:
        o, cache.state = linear_attention_step(cache.state, m.q, m.k, m.v, key_padding_mask=mask,
                                               positions=m.positions, **m.options())
    else:
        o, cache.state = linear_attention(m.q, m.k, m.v, causal=True, key_padding_mask=mask, positions=m.positions,
                                          initial_state=cache.state, return_state=True, chunk_size=m.chunk_size,
                                          **m.options())
    return o


LINEAR = Family("linear", LinearAttentionCache, full=_full, packed=_full, step=_step,
                sequence_parallel=_sequence_parallel, counts_positions=True)

__all__ = ["LINEAR", "LinearMix"]
