"""The fused CPU kernels of the delta family (csrc/delta.cpp and csrc/kda.cpp, built with the rest of
linattn.ops.native): `linattn_cpu::delta_chunked` (the chunked forward, one (batch, head) row per task;
g None or one decay per head) and its backward `linattn_cpu::delta_chunked_backward`;
`linattn_cpu::kda_chunked` and `linattn_cpu::kda_chunked_backward`, the same with one decay per key
channel (KDA's g (B, H, N, D); the scores by row blocks, design §13.8); and `linattn_cpu::delta_step`
(one token, for decoding; g None, one decay per head, or one per key channel), with `delta_step_` its
in-place form.

They take fp32, fp64 and bf16 q, k, v (bf16 rows are widened to fp32 as they are read: fp32 products,
triangular solves and state), β and g in the state dtype. Where the extension cannot be built, or with
LINATTN_NATIVE=0, the torch-op paths run instead (same numbers up to rounding).
"""

from __future__ import annotations

import torch

from .. import native
from ..autodiff import first_order
from .checks import op_name, per_channel

_DTYPES = (torch.float32, torch.float64, torch.bfloat16)
_blas: list = []  # [bool] once the kernels were asked whether torch's BLAS has gemm and trsm


def _kernels_ready() -> bool:
    """Not tracing, the extension enabled and built, and torch's BLAS found (checked once)."""
    if not native._ready():
        return False
    if not _blas:
        _blas.append(bool(torch.ops.linattn_cpu.delta_has_blas()))
    return _blas[0]


def usable(q: torch.Tensor) -> bool:
    """The fused kernels can take inputs like q (CPU, fp32/fp64/bf16)."""
    return q.is_cpu and q.dtype in _DTYPES and _kernels_ready()


def _ops(g):
    """(forward, backward) kernels for this gate form: KDA's for a per-channel g, else delta.cpp's."""
    if per_channel(g):
        return torch.ops.linattn_cpu.kda_chunked.default, torch.ops.linattn_cpu.kda_chunked_backward.default
    return torch.ops.linattn_cpu.delta_chunked.default, torch.ops.linattn_cpu.delta_chunked_backward.default


def chunked(q, k, v, beta, g, S0, *, scale: float | None, l2norm: bool, chunk: int, cu_seqlens=None):
    """The chunked forward (and, when a gradient is wanted, `FusedDeltaRule`'s backward). beta (B, H, N),
    g (B, H, N), (B, H, N, D) or None, and S0 (B, H, D, E) in the state dtype; cu_seqlens (checked by the
    caller): packed sequences in one call (batch 1, S0 (N, H, D, E) a state per sequence). Returns (o, S)."""
    scale = 1.0 if scale is None else scale
    tensors = (q, k, v, beta, S0) + (() if g is None else (g,))
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return FusedDeltaRule.apply(q, k, v, beta, g, S0, scale, l2norm, chunk, cu_seqlens)
    o, S, _ = _ops(g)[0](q, k, v, beta, g, S0, scale, l2norm, chunk, False, cu_seqlens)
    return o, S


def step(S, q, k, v, beta, g, *, scale: float | None, l2norm: bool, inplace: bool = False):
    """One token (q, k (B, H, 1, D), v (B, H, 1, E), beta (B, H, 1), g (B, H, 1), (B, H, 1, D) or None,
    in S's dtype); the kernel itself checks the values of beta and g. Returns (o (B, H, 1, E), S'); with
    inplace (S contiguous) S' is S, updated in place (linattn_cpu::delta_step_)."""
    scale = 1.0 if scale is None else scale
    if inplace:
        return torch.ops.linattn_cpu.delta_step_.default(S, q, k, v, beta, g, scale, l2norm), S
    return torch.ops.linattn_cpu.delta_step.default(S, q, k, v, beta, g, scale, l2norm)


class FusedDeltaRule(torch.autograd.Function):
    """apply(q, k, v, beta, g, S0, scale, l2norm, chunk, cu_seqlens) -> (o, S), fused forward and backward
    (cu_seqlens: packed sequences, or None).

    Saved for the backward: q, k, v, beta, g and the state entering every block of 256 tokens
    (B·H·⌈N/256⌉·D·E values); the backward recomputes one block's chunks at a time. Any gate form
    (`_ops`). Not twice differentiable."""

    @staticmethod
    def forward(ctx, q, k, v, beta, g, S0, scale, l2norm, chunk, cu_seqlens=None):
        o, S, S_blocks = _ops(g)[0](q, k, v, beta, g, S0, scale, l2norm, chunk, True, cu_seqlens)
        ctx.save_for_backward(q, k, v, beta, g, S_blocks)
        ctx.scale, ctx.l2norm, ctx.chunk, ctx.S0_dtype, ctx.cu = scale, l2norm, chunk, S0.dtype, cu_seqlens
        ctx.op_name = op_name(g)  # named by first_order's error
        ctx.set_materialize_grads(False)
        return o, S

    @staticmethod
    @first_order("delta_rule")
    @torch.autograd.function.once_differentiable
    def backward(ctx, do, dS):
        q, k, v, beta, g, S_blocks = ctx.saved_tensors
        if do is None:
            do = torch.zeros_like(v)
        dq, dk, dv, dbeta, dg, dS0 = _ops(g)[1](q, k, v, beta, g, S_blocks, do, dS, ctx.scale, ctx.l2norm, ctx.chunk,
                                                ctx.cu)
        return dq, dk, dv, dbeta, None if g is None else dg, dS0.to(ctx.S0_dtype), None, None, None, None
