"""Dao's causal-conv1d (`causal_conv1d.causal_conv1d_fn`, `causal_conv1d_update`), the short
convolution that transformers' linear-attention models (Qwen3.5, Qwen3-Next, …) call, on linattn's
depthwise causal convolution (`linattn.nn.convolution.depthwise_causal`, design §14).

Channel-first, as Dao's kernels and transformers pass it: x (B, C, L), weight (C, W), bias (C,):

    y_t[c] = act(Σ_{j=0}^{W−1} weight[c, j] · x_{t−W+1+j}[c] + bias[c])      x_s = initial_states
             (or 0) for s < 0; act = SiLU for "silu"/"swish", the identity for None

computed in weight's dtype and returned in x's (as Dao's reference does). The inputs cross as
transposed views (B, L, C); one copy builds [tail; x].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..._checks import check_floating
from ...nn.convolution import ShortConvolution, depthwise_causal
from ._edge import hands_over, refuse

ACTIVATIONS = (None, "silu", "swish")


def _check(x, weight, bias, activation) -> None:
    """x (B, C, L), weight (C, W), bias (C,) or None, activation None / "silu" / "swish"."""
    for name, t, dims in (("x", x, 3), ("weight", weight, 2)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != dims or not t.is_floating_point():
            form = "(batch, dim, seqlen)" if name == "x" else "(dim, width)"
            raise ValueError(f"{name} must be a floating tensor {form}, got {t.dtype} of shape {tuple(t.shape)}")
    if weight.shape[0] != x.shape[1] or weight.shape[1] < 1:
        raise ValueError(f"weight must have shape (dim, width) with dim = x.shape[1] = {x.shape[1]} and width ≥ 1, "
                         f"got {tuple(weight.shape)}")
    if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (x.shape[1],)):
        got = tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__
        raise ValueError(f"bias must be None or a tensor (dim,) = ({x.shape[1]},), got {got}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be None, 'silu' or 'swish', got {activation!r}")
    if weight.device != x.device:
        raise ValueError(f"weight must be on x's device ({x.device}), got {weight.device}")


def _finish(y, bias, activation, dtype):
    """Bias, activation, and the (B, L, C) result as (B, C, L) in `dtype` (a view when it fits)."""
    if bias is not None:
        y = y + bias.to(y.dtype)
    if activation is not None:
        y = F.silu(y)
    return y.transpose(1, 2).to(dtype)


@hands_over("causal_conv1d", "causal_conv1d_fn")
def causal_conv1d_fn(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
    initial_states: torch.Tensor | None = None,
    return_final_states: bool = False,
    final_states_out: torch.Tensor | None = None,
    activation: str | None = None,
):
    """The parallel form (module docstring). x (B, C, L) -> out (B, C, L), or (out, final_states)
    with return_final_states: the last W−1 inputs (B, C, W−1), zeros where the sequence was shorter,
    written into final_states_out when given. initial_states (B, C, W−1): the inputs before x.
    Gradients reach x, weight, bias and initial_states.

    seq_idx (B, L) integer: packed sequences, each row's runs of equal ids one sequence (ids must
    not decrease along a row); no tap crosses from one run to the next (the packed path of
    `linattn.nn.ShortConvolution`, row by row). As in Dao's kernel it excludes initial_states and
    return_final_states."""
    _check(x, weight, bias, activation)
    if seq_idx is not None:
        refuse("causal_conv1d_fn (with seq_idx)", initial_states=initial_states,
               return_final_states=return_final_states)
        return _finish(_packed_rows(x, weight, seq_idx), bias, activation, x.dtype)
    b, c, n = x.shape
    w = weight.shape[1]
    cdt = weight.dtype
    xs = x.transpose(1, 2).to(cdt)  # (B, L, C), a view when x already has weight's dtype
    if initial_states is None:
        xp = F.pad(xs, (0, 0, w - 1, 0))
    else:
        if not isinstance(initial_states, torch.Tensor) or tuple(initial_states.shape) != (b, c, w - 1):
            got = tuple(initial_states.shape) if isinstance(initial_states, torch.Tensor) else type(initial_states).__name__
            raise ValueError(f"initial_states must have shape (batch, dim, width − 1) = {(b, c, w - 1)}, got {got}")
        xp = torch.cat((initial_states.transpose(1, 2).to(cdt), xs), 1)
    if return_final_states and final_states_out is not None:  # floating: an integer one would truncate
        check_floating("final_states_out", final_states_out, (b, c, w - 1), "(batch, dim, width − 1)", x.device, "x")
    out = _finish(depthwise_causal(xp, weight, n), bias, activation, x.dtype)
    if not return_final_states:
        return out
    final = xp[:, xp.shape[1] - (w - 1):].transpose(1, 2).to(x.dtype)
    if final_states_out is None:
        return out, final.contiguous()
    final_states_out.copy_(final)
    return out, final_states_out





def seq_idx_to_cu_seqlens(ids: torch.Tensor) -> torch.Tensor:
    """One row of seq_idx (L,) -> cu_seqlens [N+1] of its runs of equal ids (ids non-decreasing)."""
    step = ids[1:] - ids[:-1]
    if bool((step < 0).any()):
        raise ValueError("seq_idx must not decrease along a row (each sequence one run of equal ids)")
    starts = torch.nonzero(step).flatten() + 1
    ends = torch.tensor([0, ids.numel()], dtype=torch.long, device=ids.device)
    return torch.cat((ends[:1], starts.long(), ends[1:]))


def _packed_rows(x, weight, seq_idx):
    """The convolution without bias and activation, (B, L, C) in weight's dtype, each row by its
    sequences (ShortConvolution's packed path with `weight` as its parameter)."""
    b, c, n = x.shape
    if not isinstance(seq_idx, torch.Tensor) or tuple(seq_idx.shape) != (b, n) or seq_idx.is_floating_point():
        got = tuple(seq_idx.shape) if isinstance(seq_idx, torch.Tensor) else type(seq_idx).__name__
        raise ValueError(f"seq_idx must be an integer tensor (batch, seqlen) = {(b, n)}, got {got}")
    conv = ShortConvolution(c, weight.shape[1]).to(device=x.device, dtype=weight.dtype)
    xs = x.transpose(1, 2).to(weight.dtype)
    rows = [torch.func.functional_call(conv, {"weight": weight}, (xs[r:r + 1],),
                                       {"cu_seqlens": seq_idx_to_cu_seqlens(seq_idx[r])}) for r in range(b)]
    return torch.cat(rows, 0)


@hands_over("causal_conv1d", "causal_conv1d_update")
def causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    cache_seqlens: torch.Tensor | None = None,
    conv_state_indices: torch.Tensor | None = None,
):
    """The decoding form: x (B, C) or (B, C, L) new inputs, conv_state (B, C, S) with S ≥ W−1 the
    inputs before them (the last S), updated in place to the last S inputs of [conv_state; x].
    Returns out of x's shape. cache_seqlens (circular buffer) and conv_state_indices (continuous
    batching) are refused."""
    refuse("causal_conv1d_update", cache_seqlens=cache_seqlens, conv_state_indices=conv_state_indices)
    one = isinstance(x, torch.Tensor) and x.dim() == 2
    x3 = x.unsqueeze(-1) if one else x
    _check(x3, weight, bias, activation)
    b, c, n = x3.shape
    w = weight.shape[1]
    if (not isinstance(conv_state, torch.Tensor) or conv_state.dim() != 3 or tuple(conv_state.shape[:2]) != (b, c)
            or conv_state.shape[2] < w - 1):
        got = tuple(conv_state.shape) if isinstance(conv_state, torch.Tensor) else type(conv_state).__name__
        raise ValueError(f"conv_state must have shape (batch, dim, state_len) = ({b}, {c}, ≥ {w - 1}), got {got}")
    check_floating("conv_state", conv_state, conv_state.shape, "(batch, dim, state_len)", x3.device, "x")
    cdt, s = weight.dtype, conv_state.shape[2]
    tail = conv_state[:, :, s - (w - 1):].transpose(1, 2).to(cdt)
    xp = torch.cat((tail, x3.transpose(1, 2).to(cdt)), 1)  # a copy: conv_state can change below
    new_state = torch.cat((conv_state, x3.to(conv_state.dtype)), 2)[:, :, n:] if s > 0 else conv_state
    out = _finish(depthwise_causal(xp, weight, n), bias, activation, x.dtype)
    conv_state.copy_(new_state)
    return out[:, :, 0] if one else out
