"""The delta family (design §13): S_t = (I − β_t k̂_t k̂_tᵀ) Diag(e^{g_t}) S_{t−1} + β_t k̂_t v_tᵀ,
o_t = S_tᵀ (scale·q̂_t), with g None (DeltaNet), per head (Gated DeltaNet) or per key channel (KDA,
§13.8), on linattn.ops.delta_rule and its step, linattn.parallel's sharded form; the state is S
(RecurrentCache). A padded token writes nothing (k = 0) and does not decay the state (g = 0)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...ops import delta_rule, delta_rule_step
from ...parallel import sequence_parallel_delta_rule
from ..caches import RecurrentCache
from .record import Family


@dataclass
class DeltaMix:
    """q, k (B, H, N, D) (L2-normalized inside the operator when qk_l2norm), v (B, H, N, E), β (B, H, N) in
    the state dtype, g (B, H, N), (B, H, N, D) or None; scale multiplies q̂; the chunk of the chunked
    operator."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    beta: torch.Tensor
    g: torch.Tensor | None
    scale: float
    chunk_size: int
    qk_l2norm: bool = True

    def masked(self, mask) -> "DeltaMix":
        """The operands with the padded tokens (mask False) turned into no-ops: k = 0, g = 0."""
        if mask is None:
            return self
        keep = mask[:, None, :]
        g = self.g
        if g is not None:
            g = g.masked_fill(~(keep if g.dim() == 3 else keep[..., None]), 0.0)
        k = self.k * keep[..., None].to(self.k.dtype)
        return DeltaMix(self.q, k, self.v, self.beta, g, self.scale, self.chunk_size, self.qk_l2norm)

    def options(self) -> dict:
        return dict(g=self.g, scale=self.scale, qk_l2norm=self.qk_l2norm)


def _full(m: DeltaMix, mask, cu_seqlens=None):
    m = m.masked(mask)
    return delta_rule(m.q, m.k, m.v, m.beta, chunk_size=m.chunk_size, cu_seqlens=cu_seqlens, **m.options())


def _sequence_parallel(m: DeltaMix, group):
    return sequence_parallel_delta_rule(m.q, m.k, m.v, m.beta, group=group, chunk_size=m.chunk_size, **m.options())


def _step(cache: RecurrentCache, m: DeltaMix, mask):
    m = m.masked(mask)
    if m.q.shape[2] == 1:
        o, cache.state = delta_rule_step(cache.state, m.q, m.k, m.v, m.beta, **m.options())
    else:
        o, cache.state = delta_rule(m.q, m.k, m.v, m.beta, initial_state=cache.state, return_state=True,
                                    chunk_size=m.chunk_size, **m.options())
    return o


DELTA = Family("delta", RecurrentCache, full=_full, packed=_full, step=_step, sequence_parallel=_sequence_parallel)

__all__ = ["DELTA", "DeltaMix"]
