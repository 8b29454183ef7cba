"""Argument checks of the gated operators: the log-decay g and the state, whose form follows
`normalize` (the tensor kv, or the tuple (kv, z)). q, k, v and the feature options are checked by
`linattn.ops.linear.check_arguments`, as for linear_attention."""

from __future__ import annotations

import torch

from ..._checks import check_state, check_tensor


def check_gate(g, b: int, h: int, n: int, feat: int, device: torch.device) -> None:
    """g: (B, H, N) (one log-decay per head and token) or (B, H, N, F) (one per feature), floating,
    on the inputs' device."""
    check_tensor("g", g)
    if not g.is_floating_point():
        raise TypeError(f"g (the log of the decay) must be a floating tensor, got dtype {g.dtype}")
    if tuple(g.shape) not in ((b, h, n), (b, h, n, feat)):
        raise ValueError(
            f"g must have shape (B, H, N) = {(b, h, n)} (one log-decay per head and token) or (B, H, N, F) = "
            f"{(b, h, n, feat)} (one per feature of φ(k)), got {tuple(g.shape)}"
        )
    if g.device != device:
        raise ValueError(f"g must be on q's device ({device}), got {g.device}")


def check_gate_values(g: torch.Tensor) -> None:
    """g ≤ 0 and finite (a decay e^g in (0, 1]). One reduction over g. The fused kernels check the
    values as they read them, with the same message (naming the first value out of range; here the
    maximum, or the minimum when it is −∞)."""
    lo, hi = torch.aminmax(g.detach())
    lo, hi = lo.item(), hi.item()
    if not hi <= 0:  # NaN fails here too
        raise ValueError(f"g (the log of the decay) must be ≤ 0 and finite, got {hi}")
    if not lo > float("-inf"):
        raise ValueError(f"g (the log of the decay) must be ≤ 0 and finite, got {lo}")


def check_gated_state(state, normalize: bool, b: int, h: int, feat: int, value: int, device: torch.device,
                      name: str = "initial_state") -> None:
    """normalize=False: the tensor kv (B, H, F, E); normalize=True: the tuple (kv, z (B, H, F))."""
    if normalize:
        if isinstance(state, torch.Tensor):
            raise TypeError(f"{name} must be the tuple (kv, z) with normalize=True, got a tensor "
                            "(the state of normalize=False)")
        check_state(state, b, h, feat, value, device)
        return
    if isinstance(state, (tuple, list)):
        raise TypeError(f"{name} must be the tensor kv (B, H, F, E) with normalize=False, got a "
                        f"{type(state).__name__} (the (kv, z) state of normalize=True)")
    check_tensor(name, state)
    if tuple(state.shape) != (b, h, feat, value):
        raise ValueError(f"{name} must have shape (B, H, F, E) = {(b, h, feat, value)}, got {tuple(state.shape)}")
    if not state.is_floating_point():
        raise TypeError(f"{name} must be floating, got {state.dtype}")
    if state.device != device:
        raise ValueError(f"{name} must be on {device}, got {state.device}")
