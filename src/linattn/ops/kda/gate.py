"""KDA's forget gates from raw projections, as Kimi Linear (transformers' `KimiLinearForgetGate`) and
FLA (`use_gate_in_kernel`, `safe_gate`) compute them; both give g ≤ 0 for every input.

    kda_gate:             g = −e^{A_log_h} · softplus(x + dt_bias)                (Mamba2's form per channel)
    kda_lowerbound_gate:  g = lower_bound · sigmoid(e^{A_log_h} · (x + dt_bias))   (g ∈ (lower_bound, 0))

x (..., H, D) the raw gate (e.g. f_b(f_a(x)) viewed per head), A_log (H,) (or None in the bounded
form: no e^{A_log} factor), dt_bias (H·D,) or None. Computed in float32 (float64 for float64 x);
returns that dtype. Differentiable in every argument.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..linear.chunked import state_dtype


def _biased(x: torch.Tensor, dt_bias: torch.Tensor | None) -> torch.Tensor:
    if x.dim() < 2:
        raise ValueError(f"x must have shape (..., H, D), got {tuple(x.shape)}")
    h, d = x.shape[-2:]
    x = x.to(state_dtype(x.dtype))
    if dt_bias is None:
        return x
    if dt_bias.numel() != h * d:
        raise ValueError(f"dt_bias must hold H·D = {h * d} values, got shape {tuple(dt_bias.shape)}")
    return x + dt_bias.to(x.dtype).reshape(h, d)


def _rate(A_log: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-2]
    if A_log.numel() != h:
        raise ValueError(f"A_log must hold H = {h} values, got shape {tuple(A_log.shape)}")
    return A_log.to(x.dtype).reshape(h, 1).exp()


def kda_gate(x: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None = None) -> torch.Tensor:
    """g = −e^{A_log} · softplus(x + dt_bias) per head and channel (module doc)."""
    x = _biased(x, dt_bias)
    return -_rate(A_log, x) * F.softplus(x)


def kda_lowerbound_gate(x: torch.Tensor, A_log: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
                        lower_bound: float = -5.0) -> torch.Tensor:
    """g = lower_bound · sigmoid(e^{A_log} · (x + dt_bias)) (module doc); lower_bound < 0."""
    if isinstance(lower_bound, bool) or not isinstance(lower_bound, (int, float)) or not lower_bound < 0:
        raise ValueError(f"lower_bound must be a negative number, got {lower_bound!r}")
    x = _biased(x, dt_bias)
    if A_log is not None:
        x = _rate(A_log, x) * x
    return float(lower_bound) * torch.sigmoid(x)
