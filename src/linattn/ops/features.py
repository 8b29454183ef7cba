"""How an operator turns raw q/k into the features it multiplies: scale, φ, key mask, RoPE.

Shared by the chunked, non-causal and recurrent paths so they see exactly the same numbers, and
re-run inside the chunked backward (block by block) so no N-sized feature tensor is kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from torch.autograd.function import once_differentiable

from .nonfinite import all_finite


def zero_masked(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """x with the entries where `keep` (a bool tensor broadcastable to x) is False set to 0, whatever
    they hold (0·NaN would be NaN). On the CPU a multiply, and masked_fill only if the product holds a
    NaN or Inf: masked_fill with a broadcast mask is ~8× slower there (29 vs 250 µs for 8×512×64)."""
    if x.device.type == "cpu":
        y = x * keep
        if all_finite(y):
            return y
    return x.masked_fill(~keep, 0)


@dataclass
class Featurizer:
    """Turns a slice [start, end) of q or k into (numerator features, denominator features).

    The denominator features are None when they equal the numerator ones (no RoPE).
    q: (B, H, n, D) -> (B, H, n, F).
    """

    feature_map: object = None  # nn.Module (x, *, is_query, positions) -> features, or None
    rope: object = None  # RotaryEmbedding or None
    scale: float | None = None  # multiplies q before φ
    positions: torch.Tensor | None = None  # (N,) or (B, N) absolute indices
    key_padding_mask: torch.Tensor | None = None  # (B, N) bool, True = keep
    _angles: tuple | None = None  # RoPE (start, end, dtype, cos, sin), shared by q and k of a slice

    def __call__(self, x: torch.Tensor, start: int, end: int, is_query: bool):
        pos = None if self.positions is None else self.positions[..., start:end]
        if is_query and self.scale is not None:
            x = x * self.scale
        if not is_query and self.key_padding_mask is not None:
            f = self._masked_keys(x, start, end, pos)
        else:
            f = x if self.feature_map is None else self.feature_map(x, is_query=is_query, positions=pos)
        if self.rope is None:
            return f, None
        if self._angles is None or self._angles[:3] != (start, end, f.dtype):
            self._angles = (start, end, f.dtype, *self.rope.angles(pos, f.dtype))
        return self.rope.rotate(f, angles=self._angles[3:]), f

    def _masked_keys(self, x: torch.Tensor, start: int, end: int, pos) -> torch.Tensor:
        """φ of the keys x of slice [start, end), 0 on the masked slots whatever they hold. On the CPU
        φ(x) times the mask, if that is finite (masked_fill with a broadcast mask is ~8× slower there);
        else, and on other devices, selected: x zeroed before φ (no NaN, Inf or overflow comes out of a
        masked slot, and no gradient flows into it or φ's parameters) and φ zeroed after."""
        keep = self.key_padding_mask[:, None, start:end, None]
        phi = (lambda t: t) if self.feature_map is None else (
            lambda t: self.feature_map(t, is_query=False, positions=pos))
        if x.device.type == "cpu":
            f = phi(x) * keep
            if all_finite(f):
                return f
        return phi(x.masked_fill(~keep, 0)).masked_fill(~keep, 0)

    def values(self, v: torch.Tensor) -> torch.Tensor:
        """v (B, H, N, E) with the masked key slots set to 0 (a NaN or Inf there would reach the state
        as 0·NaN through the zeroed key features), or v itself without a mask. For the step and the
        non-causal op; the chunked causal op leaves such a value to its exact pass (ops.chunked)."""
        if self.key_padding_mask is None:
            return v
        return zero_masked(v, self.key_padding_mask[:, None, :, None])

    @property
    def local_grad(self) -> bool:
        """True when ∂L/∂x follows elementwise from the features and ∂L/∂(features) alone, so the
        chunked backward needs no autograd graph: no RoPE, and φ the identity or a map without
        trainable parameters that gives its derivative from its output (`derivative_from_output_`)."""
        fm = self.feature_map
        return self.rope is None and (fm is None or (hasattr(fm, "derivative_from_output_") and not self.parameters))

    def input_grad(self, f: torch.Tensor, grad: torch.Tensor, start: int, end: int, is_query: bool, out=None):
        """∂L/∂x of the slice [start, end) of q or k from its features f = self(x, …)[0] and grad = ∂L/∂f,
        written into `out` when given. Only when `local_grad`. Overwrites f (when φ is not the identity).

        φ: φ'(x) from f (a masked key has f = 0, so elu+1's min(f, 1) gives it 0). Identity: the mask."""
        d = None
        if self.feature_map is not None:
            d = self.feature_map.derivative_from_output_(f)
        elif not is_query and self.key_padding_mask is not None:
            d = self.key_padding_mask[:, None, start:end, None]
        if is_query and self.scale is not None:
            d = self.scale if d is None else d.mul_(self.scale)
        if d is None:
            return grad if out is None else out.copy_(grad)
        return torch.mul(grad, d, out=out)

    @property
    def parameters(self) -> tuple:
        if self.feature_map is None:
            return ()
        return tuple(p for p in self.feature_map.parameters() if p.requires_grad)


def elu_plus_one_derivative_(y: torch.Tensor) -> torch.Tensor:
    """φ'(x) = min(φ(x), 1) for φ = elu + 1, from y = φ(x), computed in y's memory (y is overwritten)."""
    return y.clamp_(max=1)


class _EluPlusOneFunction(torch.autograd.Function):
    """elu(x) + 1 = exp(min(x, 0)) + max(x, 0), with derivative min(φ(x), 1).

    Two cheap vectorized passes instead of torch's elu followed by an add (about 2× faster on
    CPU); saves only its output."""

    @staticmethod
    def compute(x):
        return x.clamp(max=0).exp_().add_(x.clamp(min=0))

    @staticmethod
    def forward(ctx, x):
        y = _EluPlusOneFunction.compute(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return grad * elu_plus_one_derivative_(y.clone())


def elu_plus_one(x: torch.Tensor) -> torch.Tensor:
    """φ(x) = elu(x) + 1 (code 1 of the fused kernels), with autograd only when a gradient is wanted."""
    if x.requires_grad and torch.is_grad_enabled():
        return _EluPlusOneFunction.apply(x)
    return _EluPlusOneFunction.compute(x)  # no autograd bookkeeping when decoding


class KernelPhi:
    """φ as the fused kernels compute it from its code (0 identity, 1 elu+1), for the torch-op passes
    that re-run a fused call (the exact pass after a NaN or Inf): a feature map without parameters."""

    symmetric = True

    def __init__(self, code: int):
        if code != 1:
            raise ValueError(f"the chunked kernels know φ codes 0 and 1, got {code}")
        self.native_code = code
        self.derivative_from_output_ = elu_plus_one_derivative_

    def __call__(self, x: torch.Tensor, *, is_query: bool = True, positions=None) -> torch.Tensor:
        return elu_plus_one(x)

    def parameters(self):
        return iter(())


def kernel_featurizer(phi: int) -> "Featurizer":
    """The Featurizer of a fused call with φ code `phi` (0: the identity)."""
    return Featurizer(KernelPhi(phi) if phi else None)


def native_code(feature_map) -> int | None:
    """The fused kernels' code of `feature_map` (0 for None, the identity), read from its own class
    (`native_code` in the class body, not inherited: a subclass that changes φ has none)."""
    if feature_map is None:
        return 0
    return vars(type(feature_map)).get("native_code")
