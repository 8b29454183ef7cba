"""Norms (design §8): RMSNorm, and `make_norm`, the norm a config names."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..ops import native


class RMSNorm(nn.Module):
    """y = x / √(mean(x²) + eps) · g, computed in float32, returned in x's dtype. x (…, d)."""

    def __init__(self, d: int, eps: float = 1e-5):
        super().__init__()
        self.eps = float(eps)
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype in (torch.float16, torch.bfloat16):
            y = F.rms_norm(x.float(), self.weight.shape, None, self.eps)
            return y.to(x.dtype) * self.weight.to(x.dtype)
        if native.rms_norm_fusable(x, self.weight):  # CPU inference: one fused operator
            return native.rms_norm(x, self.weight, self.eps)
        w = self.weight if self.weight.dtype == x.dtype else self.weight.to(x.dtype)
        return F.rms_norm(x, self.weight.shape, w, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps:g}"


NORMS = ("rmsnorm", "layernorm")


def native_norm_code(norm: nn.Module | None) -> int | None:
    """The norm's code in the fused decoding kernels (csrc/model_ops.h): 0 none, 1 RMSNorm, 2
    LayerNorm; None for a norm they do not know (read from the exact class, as `native_code` of
    feature maps, so a subclass that changes the norm is not taken for its parent)."""
    if norm is None:
        return 0
    return {RMSNorm: 1, nn.LayerNorm: 2}.get(type(norm))


def make_norm(kind: str, d: int, eps: float = 1e-5) -> nn.Module:
    """'rmsnorm' -> RMSNorm(d), 'layernorm' -> nn.LayerNorm(d)."""
    if kind == "rmsnorm":
        return RMSNorm(d, eps)
    if kind == "layernorm":
        return nn.LayerNorm(d, eps=eps)
    raise ValueError(f"norm must be one of {NORMS}, got {kind!r}")


__all__ = ["NORMS", "RMSNorm", "make_norm", "native_norm_code"]
