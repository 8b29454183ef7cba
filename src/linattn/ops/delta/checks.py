"""Argument checks of the delta-rule operators, on top of linattn._checks: every error names the
argument, what was expected and what came."""

from __future__ import annotations

import math

import torch

from ..._checks import check_per_token, check_qkv, check_sizes, check_tensor
from ..linear.chunked import state_dtype


def check_arguments(q, k, v, beta, g, scale, qk_l2norm, state, state_name: str = "initial_state") -> None:
    """Shapes, dtypes and devices: q, k (B, H, N, D), v (B, H, N, E), beta (B, H, N) and g (B, H, N)
    (one decay per head) or (B, H, N, D) (one per key channel, KDA) floating, scale None or a finite
    real number, qk_l2norm a bool, state None or S (B, H, D, E) in the state dtype."""
    check_qkv(q, k, v)
    check_sizes(q, v)  # B, H, D, E >= 1: the fused kernels would read uninitialized work buffers
    b, h, n, d = q.shape
    if k.shape[2] != n:
        raise ValueError(f"the delta rule is causal: q and k must have the same length, got {n} and {k.shape[2]}")
    if n < 1:
        raise ValueError("q, k and v must hold at least one token, got length 0")
    check_per_token("beta", beta, q, (b, h, n), "(B, H, N)")
    if g is not None:
        per_channel = isinstance(g, torch.Tensor) and g.dim() == 4
        check_per_token("g", g, q, (b, h, n, d) if per_channel else (b, h, n),
                        "(B, H, N, D)" if per_channel else "(B, H, N) or (B, H, N, D)")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    if scale is not None and not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    if not isinstance(qk_l2norm, bool):
        raise TypeError(f"qk_l2norm must be a bool, got {type(qk_l2norm).__name__}")
    if state is not None:
        check_state(state, (b, h, d, v.shape[-1]), state_dtype(q.dtype), q.device, state_name)


def check_state(state, shape: tuple, dtype: torch.dtype, device: torch.device, name: str) -> None:
    """The delta rule's state: one tensor S (B, H, D, E) (no normalizer z) of the state dtype."""
    if isinstance(state, (tuple, list)):
        raise TypeError(f"{name} must be one tensor S (B, H, D, E) (the delta rule keeps no normalizer z), "
                        f"got a {type(state).__name__} of {len(state)}")
    check_tensor(name, state)
    if tuple(state.shape) != shape:
        raise ValueError(f"{name} must have shape (B, H, D, E) = {shape}, got {tuple(state.shape)}")
    if state.dtype != dtype:
        raise TypeError(f"{name} must be {dtype} (the state dtype for these inputs), got {state.dtype}")
    if state.device != device:
        raise ValueError(f"{name} must be on q's device ({device}), got {state.device}")


#: The largest β the delta family takes: β ∈ [0, 2] keeps the eigenvalue 1 − β‖k̂‖² of I − β k̂k̂ᵀ in
#: [−1, 1] for unit keys (β > 1: negative eigenvalues, Grazzi et al. 2024; design §13.2). β = 0 writes
#: nothing (a masked token).
BETA_MAX = 2.0


def check_values(beta: torch.Tensor, g: torch.Tensor | None, *, g_in_kernel: bool = False) -> None:
    """beta in [0, BETA_MAX] and g ≤ 0, all finite (a NaN fails every comparison, so it is caught too).
    g_in_kernel: g is left to the kernel that reads it (KDA's chunked kernel checks a per-channel g as it
    reads it, with the same message: no second pass over B·H·N·D values)."""
    lo, hi = (float(x) for x in torch.aminmax(beta.detach()))
    if not (lo >= 0 and hi <= BETA_MAX):
        raise ValueError(f"beta must lie in [0, 2] (finite), got values from {lo} to {hi}")
    if g is not None and not g_in_kernel:
        lo, hi = (float(x) for x in torch.aminmax(g.detach()))
        if not (hi <= 0 and math.isfinite(lo)):
            raise ValueError(f"g must be a finite log-decay ≤ 0 (α = e^g in (0, 1]), got values from {lo} to {hi}")


def per_channel(g) -> bool:
    """g holds one log-decay per key channel (B, H, N, D): KDA's gate."""
    return g is not None and g.dim() == 4


def op_name(g) -> str:
    """The operator's name in errors: the delta rule, or KDA for a per-channel g."""
    return "delta_rule (KDA: a per-channel g)" if per_channel(g) else "delta_rule"
