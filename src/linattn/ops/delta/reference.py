"""The delta family written from its definition, token by token: the oracle of the tests.

Per (batch, head), keys and queries as the operator uses them (q̂_t = scale · n(q_t), k̂_t = n(k_t),
n the L2 normalization with qk_l2norm, else n(x) = x) and α_t = e^{g_t} — one decay per head
(Gated DeltaNet, g (B, H, N)), one per key channel (KDA, g (B, H, N, D)), or 1 without g (DeltaNet):

    S_t = (I − β_t k̂_t k̂_tᵀ) Diag(α_t) S_{t−1} + β_t k̂_t v_tᵀ        o_t = S_tᵀ q̂_t

(for a scalar α_t this is α_t (I − β_t k̂_t k̂_tᵀ) S_{t−1} + β_t k̂_t v_tᵀ). S is (D, E). Plain torch ops on
the whole (B, H) batch, one token at a time, so autograd gives the reference gradients. Run it in
float64: it is slow (N steps) and meant for tests only, never the chunk form.
"""

from __future__ import annotations

import torch

#: ε of the L2 normalization inside the operators: n(x) = x / √(‖x‖² + ε).
L2_EPS = 1e-6


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    """x / √(Σ x² + ε) over the last dim."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def delta_rule_recurrent(q, k, v, beta, *, g=None, scale=None, qk_l2norm=False, initial_state=None):
    """q, k (B, H, N, D), v (B, H, N, E), beta (B, H, N), g (B, H, N), (B, H, N, D) or None,
    initial_state (B, H, D, E) or None (zeros). Returns (o (B, H, N, E), S_N (B, H, D, E)), in q's dtype."""
    b, h, n, d = q.shape
    e = v.shape[-1]
    if qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    if scale is not None:
        q = q * scale
    S = torch.zeros(b, h, d, e, dtype=q.dtype, device=q.device) if initial_state is None else initial_state.to(q.dtype)
    eye = torch.eye(d, dtype=q.dtype, device=q.device)
    outs = []
    for t in range(n):
        kt, vt, bt = k[:, :, t], v[:, :, t], beta[:, :, t, None, None].to(q.dtype)
        erase = eye - bt * kt[..., :, None] * kt[..., None, :]  # I − β k kᵀ (B, H, D, D)
        if g is None:
            S = erase @ S
        elif g.dim() == 3:
            S = g[:, :, t, None, None].to(q.dtype).exp() * (erase @ S)
        else:
            S = erase @ (g[:, :, t, :, None].to(q.dtype).exp() * S)  # Diag(α_t) scales the D rows of S
        S = S + bt * kt[..., :, None] * vt[..., None, :]
        outs.append((q[:, :, t, :, None] * S).sum(-2))  # Sᵀ q
    return torch.stack(outs, 2), S
