"""Kimi Delta Attention written from its definition, token by token: the oracle of the tests.

Per (batch, head), with α_t = e^{g_t} ∈ (0, 1]^D one decay per key channel and keys and queries as
the operator uses them (q̂_t = scale · n(q_t), k̂_t = n(k_t), n the L2 normalization with qk_l2norm,
else n(x) = x):

    S_t = (I − β_t k̂_t k̂_tᵀ) Diag(α_t) S_{t−1} + β_t k̂_t v_tᵀ        o_t = S_tᵀ q̂_t

S is (D, E). Plain torch ops on the whole (B, H) batch, one token at a time, so autograd gives the
reference gradients. Run it in float64: it is slow (N steps) and meant for tests only.
"""

from __future__ import annotations

import torch

from ..delta.reference import l2_normalize


def kda_recurrent(q, k, v, beta, g, *, scale=None, qk_l2norm=False, initial_state=None):
    """q, k (B, H, N, D), v (B, H, N, E), beta (B, H, N), g (B, H, N, D), initial_state (B, H, D, E)
    or None (zeros). Returns (o (B, H, N, E), S_N (B, H, D, E)), in q's dtype."""
    b, h, n, d = q.shape
    e = v.shape[-1]
    if qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    if scale is not None:
        q = q * scale
    dt = q.dtype
    S = torch.zeros(b, h, d, e, dtype=dt, device=q.device) if initial_state is None else initial_state.to(dt)
    eye = torch.eye(d, dtype=dt, device=q.device)
    outs = []
    for t in range(n):
        kt, vt, bt = k[:, :, t], v[:, :, t], beta[:, :, t, None, None].to(dt)
        erase = eye - bt * kt[..., :, None] * kt[..., None, :]  # I − β k kᵀ (B, H, D, D)
        decay = g[:, :, t].to(dt).exp()  # Diag(α_t) as a vector over the D rows of S
        S = erase @ (decay[..., :, None] * S) + bt * kt[..., :, None] * vt[..., None, :]
        outs.append((q[:, :, t, :, None] * S).sum(-2))  # Sᵀ q
    return torch.stack(outs, 2), S
