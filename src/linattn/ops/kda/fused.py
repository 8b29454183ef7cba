"""The fused CPU kernel of KDA's one-token step (csrc/kda.cpp, built with the rest of
linattn.ops.native): `linattn_cpu::kda_step`. It takes fp32, fp64 and bf16 q, k, v (bf16 widened to
the float32 state as read), β and g in the state dtype, and checks their values itself. Where the
extension cannot be built, or with LINATTN_NATIVE=0, `linattn.ops.kda.api._step` runs instead (same
numbers up to rounding). The chunked form has no fused kernel yet: it runs `linattn.ops.kda.chunked`.
"""

from __future__ import annotations

import torch

from .. import native

_DTYPES = (torch.float32, torch.float64, torch.bfloat16)


def usable(q: torch.Tensor) -> bool:
    """The fused step can take inputs like q (CPU, fp32/fp64/bf16, the extension built with kda.cpp)."""
    return (q.dtype in _DTYPES and q.device.type == "cpu" and native._ready()
            and hasattr(torch.ops.linattn_cpu, "kda_step"))


def step(S, q, k, v, beta, g, *, scale: float | None, l2norm: bool):
    """One token (q, k (B, H, 1, D), v (B, H, 1, E), beta (B, H, 1), g (B, H, 1, D) in S's dtype).
    Returns (o (B, H, 1, E), S')."""
    return torch.ops.linattn_cpu.kda_step.default(S, q, k, v, beta, g, 1.0 if scale is None else scale, l2norm)
