"""Scores of a chunk under one decay per key channel (KDA's gate, design §13.8), with every
exponential bounded.

In a chunk of c rows with the in-chunk cumulative log-decays b (c×D), the delta family's WY/UT form
needs, for j ≤ i,

    (K K̂ᵀ ⊙ Γ)_ij = Σ_d k_id k_jd e^{b_id − b_jd},      (Q K̂ᵀ ⊙ Γ)_ij = Σ_d q_id k_jd e^{b_id − b_jd}.

FLA's and transformers' chunk forms write them as (K ⊙ e^b)(K ⊙ e^{−b})ᵀ, and e^{−b} overflows after
a strong gate (NaN gradients at g = −1e4). Here the chunk is cut into sub-chunks of s = SUB_CHUNK
rows: for i and j in different sub-chunks e^{b_i − b_j} is a product of three factors e^{x ≤ 0} split at
the sub-chunks' boundaries (nothing overflows, and a factor that underflows stands for a product
smaller still); inside one, e^{b_i − b_f} · e^{b_f − b_j} about its first row f, in float64, where the
gate floor (CHANNEL_GATE_FLOOR = −80, applied before b is summed) keeps e^{b_f − b_j} ≤ e^{7·80} finite.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

#: Rows per sub-chunk: (SUB_CHUNK − 1)·|CHANNEL_GATE_FLOOR| must stay below 709 (e^x finite in float64).
SUB_CHUNK = 8
#: Per-channel log-decays are clamped at this floor before their cumulative sums (e^{−80} ≈ 2e-35,
#: below the rounding of any O(1) term in float32 and float64).
CHANNEL_GATE_FLOOR = -80.0


@functools.lru_cache(maxsize=16)
def _masks(n: int, s: int, device: torch.device):
    """(later (n, n): sub-chunk J is not before I; above (s, s): j > i), cached (never written to; made
    outside inference mode, so that autograd may save them whichever mode first asked)."""
    with torch.inference_mode(False):
        later = torch.ones(n, n, dtype=torch.bool, device=device).triu_()
        above = torch.ones(s, s, dtype=torch.bool, device=device).triu_(1)
    return later, above


@functools.lru_cache(maxsize=16)
def eye(c: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The (c, c) identity, cached as `_masks` (the chunked solves' right-hand side too)."""
    with torch.inference_mode(False):
        return torch.eye(c, dtype=dtype, device=device)


def pair_products(Q: torch.Tensor, K: torch.Tensor, b: torch.Tensor, sub: int = SUB_CHUNK):
    """(KK, QK), each (..., c, c): X_ij = Σ_d x_id k_jd e^{b_id − b_jd} for j ≤ i, 0 above the diagonal.
    Q, K (..., c, D) in the compute dtype, b (..., c, D) the in-chunk cumulative log-decays in float64
    (of g ≥ CHANNEL_GATE_FLOOR). Differentiable.

    Sub-chunk I, rows [Is, Is + s), s = min(sub, c) (the chunk padded with rows k = 0 to a multiple
    of s), has b_f (its first row), b_< (the row before it; 0 for I = 0) and b_> (its last row). Below
    the diagonal blocks, i in I and j in J < I: e^{b_i − b_j} = e^{b_i − b_<(I)} · e^{b_<(I) − b_>(J)} ·
    e^{b_>(J) − b_j}, three factors ≤ 1. Inside a block, in float64: e^{b_i − b_f} ≤ 1 times
    e^{b_f − b_j} ≤ e^{(s−1)·|CHANNEL_GATE_FLOOR|} (finite), the entries above the diagonal masked before
    they are rounded to the compute dtype."""
    *lead, c, d = K.shape
    s = min(sub, c)
    pad = -c % s
    Q, K, b = (x.reshape(-1, c, d) for x in (Q, K, b))
    if pad:  # rows with k = 0 and no decay (b repeats its last row): they add nothing and are cut off
        Q, K = F.pad(Q, (0, 0, 0, pad)), F.pad(K, (0, 0, 0, pad))
        b = torch.cat((b, b[:, -1:].expand(-1, pad, -1)), 1)
    m, cp = K.shape[0], c + pad
    n, dt, f64 = cp // s, K.dtype, torch.float64
    later, above = _masks(n, s, K.device)
    bs = b.view(m, n, s, d)
    Kv, Qv = K.view(m, n, s, d), Q.view(m, n, s, d)
    lo, hi = (bs - bs[:, :, :1]).exp(), (bs[:, :, :1] - bs).exp()
    rows = torch.cat((Kv, Qv), 2)  # [K; Q] of each sub-chunk (M, n, 2s, D): one product for both
    inner = ((rows.to(f64) * lo.repeat(1, 1, 2, 1)) @ (Kv.to(f64) * hi).mT).masked_fill_(above.repeat(2, 1), 0)
    before = torch.cat((torch.zeros_like(bs[:, :1, 0]), bs[:, :-1, -1]), 1)  # b_<(I) (M, n, D)
    left = rows * (bs - before[:, :, None]).to(dt).exp().repeat(1, 1, 2, 1)
    Kr = Kv * (bs[:, :, -1:] - bs).to(dt).exp()  # k_j e^{b_>(J) − b_j}
    G = (before[:, :, None] - bs[:, None, :, -1]).masked_fill_(later[..., None], float("-inf")).to(dt).exp()
    Kp = (Kr[:, None] * G[:, :, :, None]).view(m, n, cp, d)  # k_j e^{b_<(I) − b_j} for j before sub-chunk I, else 0
    outer = left @ Kp.mT  # (M, n, 2s, c): the blocks below the diagonal
    diag = eye(n, dt, K.device)[None, :, None, :, None]  # places (M, n, 2s, s) on the diagonal blocks
    both = outer.view(m, n, 2 * s, n, s) + inner.to(dt)[:, :, :, None, :] * diag
    KK, QK = (x.reshape(m, cp, cp)[:, :c, :c].reshape(*lead, c, c) for x in (both[:, :, :s], both[:, :, s:]))
    return KK, QK
