"""Decay gates from raw projections, as Mamba2, Gated DeltaNet, Kimi Linear (transformers'
`KimiLinearForgetGate`) and FLA (`use_gate_in_kernel`, `safe_gate`) compute them; every one gives
g ≤ 0 for every input.

    mamba2_gate:          g = −e^{A_log} · softplus(x + dt_bias)   (Mamba2's discretized decay; A_log and
                          dt_bias broadcast against x: one per head for simple GLA and Gated DeltaNet)
    kda_gate:             the same per head and key channel: x (..., H, D), A_log (H,), dt_bias (H·D,)
    kda_lowerbound_gate:  g = lower_bound · sigmoid(e^{A_log_h} · (x + dt_bias))   (g ∈ (lower_bound, 0))

Computed in float32 (float64 for float64 x); return that dtype. Differentiable in every argument.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def mamba2_gate(x: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None = None) -> torch.Tensor:
    """g = −e^{A_log} · softplus(x + dt_bias) in float32 or wider, A_log and dt_bias broadcast against x
    (e.g. x (B, N, H) with A_log and dt_bias (H,))."""
    dt = torch.promote_types(x.dtype, torch.float32)
    x = x.to(dt) if dt_bias is None else x.to(dt) + dt_bias.to(dt)
    return -A_log.to(dt).exp() * F.softplus(x)


def _per_channel(x: torch.Tensor, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None):
    """A_log (H,) and dt_bias (H·D,) checked against x (..., H, D) and shaped to broadcast: (H, 1), (H, D)."""
    if x.dim() < 2:
        raise ValueError(f"x must have shape (..., H, D), got {tuple(x.shape)}")
    h, d = x.shape[-2:]
    if A_log is not None and A_log.numel() != h:
        raise ValueError(f"A_log must hold H = {h} values, got shape {tuple(A_log.shape)}")
    if dt_bias is not None and dt_bias.numel() != h * d:
        raise ValueError(f"dt_bias must hold H·D = {h * d} values, got shape {tuple(dt_bias.shape)}")
    return (None if A_log is None else A_log.reshape(h, 1)), (None if dt_bias is None else dt_bias.reshape(h, d))


def kda_gate(x: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None = None) -> torch.Tensor:
    """g = −e^{A_log} · softplus(x + dt_bias) per head and key channel (module doc)."""
    return mamba2_gate(x, *_per_channel(x, A_log, dt_bias))


def kda_lowerbound_gate(x: torch.Tensor, A_log: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
                        lower_bound: float = -5.0) -> torch.Tensor:
    """g = lower_bound · sigmoid(e^{A_log} · (x + dt_bias)) (module doc); lower_bound < 0."""
    if isinstance(lower_bound, bool) or not isinstance(lower_bound, (int, float)) or not lower_bound < 0:
        raise ValueError(f"lower_bound must be a negative number, got {lower_bound!r}")
    A_log, dt_bias = _per_channel(x, A_log, dt_bias)
    x = x.to(torch.promote_types(x.dtype, torch.float32))
    x = x if dt_bias is None else x + dt_bias.to(x.dtype)
    if A_log is not None:
        x = A_log.to(x.dtype).exp() * x
    return float(lower_bound) * torch.sigmoid(x)
