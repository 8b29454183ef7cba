"""Kimi Delta Attention (KDA; Kimi Linear, Moonshot AI 2025): the delta family with one forget gate
per key channel, under its own names. Per (batch, head), with α_t = e^{g_t} ∈ (0, 1]^D:

    S_t = (I − β_t k̂_t k̂_tᵀ) Diag(α_t) S_{t−1} + β_t k̂_t v_tᵀ        o_t = S_tᵀ q̂_t

These are entry points of linattn.ops.delta (design §13), which takes g (B, H, N, D) as it takes
Gated DeltaNet's g (B, H, N): `kda` is `delta_rule(..., g=g)`, `kda_step` is `delta_rule_step`,
`kda_affine_form` is `delta_rule_affine_form`, each requiring the per-channel g; the gates of Kimi
Linear and FLA come from linattn.ops.delta.gate.
"""

from __future__ import annotations

import torch

from .delta.api import delta_rule, delta_rule_affine_form, delta_rule_step
from .._checks import check_per_token
from .delta.gate import kda_gate, kda_lowerbound_gate
from .linear.chunked import DEFAULT_CHUNK_SIZE


def _channel_gate(q, g) -> None:
    """g must be (B, H, N, D), one log-decay per key channel (the other checks are delta_rule's)."""
    if isinstance(q, torch.Tensor) and q.dim() == 4:
        check_per_token("g", g, q, tuple(q.shape), "(B, H, N, D) (one log-decay per key channel)")


def kda(q, k, v, beta, g, *, scale: float | None = None, qk_l2norm: bool = False, initial_state=None,
        return_state: bool = False, chunk_size: int = DEFAULT_CHUNK_SIZE, cu_seqlens=None):
    """KDA over a whole sequence (causal): `delta_rule(q, k, v, beta, g=g, ...)` with g (B, H, N, D)
    log-decays ≤ 0, one per key channel (finite; −1e30 resets a channel exactly). Arguments, returns,
    gradients and packing (cu_seqlens) as delta_rule's."""
    _channel_gate(q, g)
    return delta_rule(q, k, v, beta, g=g, scale=scale, qk_l2norm=qk_l2norm, initial_state=initial_state,
                      return_state=return_state, chunk_size=chunk_size, cu_seqlens=cu_seqlens)


def kda_step(state, q, k, v, beta, g, *, scale: float | None = None, qk_l2norm: bool = False,
             inplace: bool = False):
    """The recurrent form, `delta_rule_step(state, q, k, v, beta, g=g, ...)` with g (B, H, T, D):
    S_α = Diag(α) S, u = S_αᵀ k̂, S' = S_α + k̂ (β (v − u))ᵀ, o = S'ᵀ q̂. Returns (o, new_state);
    inplace: S' written into `state` (delta_rule_step's)."""
    if not (isinstance(g, torch.Tensor) and g.dim() == 4):  # a 4-D g's shape: delta_rule_step's checks
        _channel_gate(q, g)
    return delta_rule_step(state, q, k, v, beta, g=g, scale=scale, qk_l2norm=qk_l2norm, inplace=inplace)


def kda_affine_form(q, k, v, beta, g, *, scale: float | None = None, qk_l2norm: bool = False,
                    chunk_size: int = DEFAULT_CHUNK_SIZE):
    """`kda` on a span as an affine function of its initial state (`delta_rule_affine_form`; the
    transition is the D×D product of (I − β_t k̂_t k̂_tᵀ) Diag(α_t))."""
    _channel_gate(q, g)
    return delta_rule_affine_form(q, k, v, beta, g=g, scale=scale, qk_l2norm=qk_l2norm, chunk_size=chunk_size)


__all__ = ["kda", "kda_affine_form", "kda_gate", "kda_lowerbound_gate", "kda_step"]
