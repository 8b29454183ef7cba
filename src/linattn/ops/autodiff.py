"""What the operators' autograd support is beyond first-order reverse mode: none, and said so.

The chunked operators (`linear_attention`, `gated_linear_attention`, `delta_rule` with KDA,
`sliding_window_attention`) have hand-written backward passes, fused (C++) or in torch ops, that give
∂L/∂inputs and nothing more:

- forward mode (`torch.autograd.forward_ad`, `torch.func.jvp`, `jacfwd`): the fused kernels have no
  tangent rule, so a dual input used to come back with a zero tangent (or none). `refuse_forward_ad`
  raises NotImplementedError naming the operator whenever an input carries a tangent, on every path.
  The one-token steps are plain torch ops on their non-fused path and take that path instead, so
  forward mode works there.
- second order (a gradient penalty, Hessian-vector products: a backward run with
  `create_graph=True`): the backward passes are not themselves differentiable, so the gradient of a
  gradient used to be silently dropped. `first_order` wraps a backward so that it raises
  RuntimeError naming the operator when autograd runs it with `create_graph=True` (grad mode is on
  inside a backward exactly then).
"""

from __future__ import annotations

import functools

import torch
from torch.autograd import forward_ad


def _tensors(values):
    for x in values:
        if isinstance(x, torch.Tensor):
            yield x
        elif isinstance(x, (tuple, list)):
            yield from _tensors(x)


def has_tangent(*values) -> bool:
    """True when a tensor among values (tuples and lists searched too) is a forward-mode dual tensor
    of the current forward-AD level (`forward_ad.dual_level`, or inside `torch.func.jvp`)."""
    if getattr(forward_ad, "_current_level", 0) < 0:  # no dual level open: one comparison
        return False
    return any(forward_ad.unpack_dual(x).tangent is not None for x in _tensors(values))


def refuse_forward_ad(op: str, *values) -> None:
    """NotImplementedError naming op when an input carries a forward-mode tangent."""
    if has_tangent(*values):
        raise NotImplementedError(
            f"{op} does not support forward-mode AD (torch.autograd.forward_ad, torch.func.jvp/jacfwd): its chunked "
            "kernels have a reverse-mode backward only; use reverse mode (torch.autograd.grad, torch.func.vjp/jacrev)")


def first_order(op: str):
    """Decorator for an autograd Function's backward (put it above once_differentiable, under
    staticmethod): RuntimeError naming op (or ctx.op_name, where the forward set one) when the backward
    runs with create_graph=True."""

    def wrap(backward):
        @functools.wraps(backward)
        def checked(ctx, *grads):
            if torch.is_grad_enabled():
                name = getattr(ctx, "op_name", op)
                raise RuntimeError(
                    f"{name} is not twice differentiable: its backward ran with create_graph=True (a gradient penalty, "
                    "a Hessian-vector product), and the gradient of its gradient would be silently wrong; "
                    "differentiate it once only")
            return backward(ctx, *grads)

        return checked

    return wrap
