"""`Linear`: nn.Linear whose products run on the fused kernels' own gemm (csrc/gemm.h) where that is faster.

In float32 the tiles take a layer's products only where a timing made once per process found them clearly
faster than torch's BLAS (`native.linear_gemm`; LINATTN_LINEAR_GEMM=tiles|blas forces either); float64
always takes them.

y = x Wᵀ + b with x (..., K), W (N, K), b (N). On the CPU, in float32 / float64, with the fused kernels
built on a CPU with AVX-512 (`linattn_cpu::uses_tile_gemm`), and at least `MIN_ROWS` rows of x, the
forward and both backward products go to `linattn_cpu::gemm` (register tiles, no packing; the columns
split between threads): on the AMD EPYC of this project's runs, one core, MKL's sgemm ran (2048 × 1024)
· (1024 × 3072) at 103–106 GFLOP/s and the tiles at 194–212, either layout of W (design §23). Everything
else (decoding's few rows, bf16, CUDA, tensor subclasses such as torchao's quantized weights, autocast,
torch.compile tracing, forward-mode AD) takes F.linear, and so does a backward asked for second order
(`create_graph=True`: the products are then differentiable torch ops).

Either layout of W runs without a copy: row-major (N, K) — nn.Linear's, and transformers' weights
shared by linattn.hf — and column-major (the transpose of a contiguous (K, N), `base.column_major`):

    row-major W:     y = x · Wᵀ  (gemm tb),  ∂x = ∂y · W,   ∂W = ∂yᵀ · x      (gemm ta)
    column-major W:  y = x · S   (S = Wᵀ),   ∂x = ∂y · Sᵀ (gemm tb),  ∂S = xᵀ · ∂y (gemm ta), ∂W = ∂Sᵀ

The parameters, state_dict names and values are nn.Linear's: `Linear` is a drop-in subclass.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..ops import native
from ..ops.autodiff import has_tangent

__all__ = ["Linear", "linear", "MIN_ROWS"]

#: fewer rows of x than this (decoding) take F.linear: the tiles' gains are in the large products
MIN_ROWS = 16


def _layout(w: torch.Tensor) -> str | None:
    """"row" (contiguous (N, K)), "column" (transpose of a contiguous (K, N)) or None."""
    if w.is_contiguous():
        return "row"
    if w.t().is_contiguous():
        return "column"
    return None


def _usable(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> bool:
    if w.dim() != 2 or 0 in w.shape or x.dim() == 0 or x.numel() < MIN_ROWS * w.shape[1] or _layout(w) is None:
        return False
    if torch.is_autocast_enabled("cpu") or torch.compiler.is_compiling() or has_tangent(x, w, b):
        return False
    if not native.tile_operands(x, w, b):
        return False
    return x.dtype is not torch.float32 or native.linear_gemm() == "tiles"


class _TiledLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b):
        n, k = w.shape
        x2 = x.reshape(-1, k).contiguous()
        column = _layout(w) == "column"
        y = native.gemm(x2, w.t() if column else w, tb=not column)
        if b is not None:
            y += b
        ctx.save_for_backward(x2, w)
        ctx.x_shape, ctx.has_bias, ctx.column = x.shape, b is not None, column
        return y.view(*x.shape[:-1], n)

    @staticmethod
    def backward(ctx, dy):
        x2, w = ctx.saved_tensors
        n, k = w.shape
        dy2 = dy.reshape(-1, n)
        dx = dw = db = None
        if torch.is_grad_enabled():  # create_graph: differentiable torch ops
            if ctx.needs_input_grad[0]:
                dx = (dy2 @ w).view(ctx.x_shape)
            if ctx.needs_input_grad[1]:
                dw = dy2.t() @ x2
        else:
            dy2, column = dy2.contiguous(), ctx.column
            if ctx.needs_input_grad[0]:
                s = w.t() if column else w
                dx = native.gemm(dy2, s, tb=column).view(ctx.x_shape)
            if ctx.needs_input_grad[1]:
                dw = native.gemm(x2, dy2, ta=True).t() if column else native.gemm(dy2, x2, ta=True)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2.sum(0)
        return dx, dw, db


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), by the tiled gemm where it runs (see the module's docstring)."""
    if _usable(x, weight, bias):
        return _TiledLinear.apply(x, weight, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear whose forward is `linear` (the tiled gemm on AVX-512 CPUs for float32 / float64 and
    at least MIN_ROWS rows; F.linear otherwise)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
