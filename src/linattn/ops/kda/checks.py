"""Argument checks of the KDA operators: every error names the argument, what was expected and what
came. As the delta rule's (linattn.ops.delta.checks), with g one log-decay per key channel."""

from __future__ import annotations

import math

import torch

from ..._checks import check_qkv
from ..linear.chunked import state_dtype
from ..delta.checks import BETA_MAX, check_state


def check_arguments(q, k, v, beta, g, scale, qk_l2norm, state, state_name: str = "initial_state") -> None:
    """Shapes, dtypes and devices: q, k (B, H, N, D), v (B, H, N, E), beta (B, H, N) and g (B, H, N, D)
    floating, scale None or a real number, qk_l2norm a bool, state None or S (B, H, D, E) in the state
    dtype."""
    check_qkv(q, k, v)
    b, h, n, d = q.shape
    if k.shape[2] != n:
        raise ValueError(f"KDA is causal: q and k must have the same length, got {n} and {k.shape[2]}")
    if n < 1:
        raise ValueError("q, k and v must hold at least one token, got length 0")
    for name, x, shape, text in (("beta", beta, (b, h, n), "(B, H, N)"), ("g", g, (b, h, n, d), "(B, H, N, D)")):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor of shape {text}, got {type(x).__name__}")
        if tuple(x.shape) != shape:
            raise ValueError(f"{name} must have shape {text} = {shape}, got {tuple(x.shape)}")
        if not x.is_floating_point():
            raise TypeError(f"{name} must be a floating tensor, got dtype {x.dtype}")
        if x.device != q.device:
            raise ValueError(f"{name} must be on q's device ({q.device}), got {x.device}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    if not isinstance(qk_l2norm, bool):
        raise TypeError(f"qk_l2norm must be a bool, got {type(qk_l2norm).__name__}")
    if state is not None:
        check_state(state, (b, h, d, v.shape[-1]), state_dtype(q.dtype), q.device, state_name)


def check_values(beta: torch.Tensor, g: torch.Tensor) -> None:
    """beta in [0, 2] and g ≤ 0, all finite (a NaN fails every comparison, so it is caught too)."""
    lo, hi = (float(x) for x in torch.aminmax(beta.detach()))
    if not (lo >= 0 and hi <= BETA_MAX):
        raise ValueError(f"beta must lie in [0, 2] (finite), got values from {lo} to {hi}")
    lo, hi = (float(x) for x in torch.aminmax(g.detach()))
    if not (hi <= 0 and math.isfinite(lo)):
        raise ValueError(f"g must be a finite log-decay ≤ 0 (α = e^g in (0, 1]^D), got values from {lo} to {hi}")
