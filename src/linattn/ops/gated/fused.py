"""The fused CPU kernels of gated linear attention (csrc/gated.h, gated.cpp, gated_backward.cpp, in the
linattn_cpu extension that `linattn.ops.native` builds), wired into Python and autograd.

    linattn_cpu::gated_chunked           the chunked forward, one (batch, head) row per task; for
                                         training it also saves the denominators and the state
                                         entering every block of 512 tokens
    linattn_cpu::gated_chunked_backward  walks each row back block by block: q, k, v, g and the
                                         initial state's gradients (g's from the identity of §12)
    linattn_cpu::gated_step              one recurrent step (checks g ≤ 0 and finite itself)
    linattn_cpu::gated_step_             the same, the state updated in place

The state is kv, or (kv, z) when a z is given (normalize=True); g (B, H, N) or (B, H, N, F) in the
state's dtype (converted here). φ is elu+1 (phi=1) or the identity (phi=0). bf16 q, k, v take the
path `native.bf16_choice()` chose for this machine (bf16 gemms, or blocks widened to fp32 in cache);
the step widens them. A backward whose initial state's gradient comes out non-finite (a NaN or Inf
among its factors) is run again by the torch ops' exact pass, as the ungated kernels' is
(linattn.ops.native).
"""

from __future__ import annotations

import torch

from .. import native
from ..features import kernel_featurizer
from ..autodiff import first_order
from ..nonfinite import all_finite
from .chunked import ChunkedGatedLinearAttention


def ready(dtype: torch.dtype) -> bool:
    """The chunked kernels can run on inputs of `dtype` (torch's BLAS has the gemm they need)."""
    return native.chunked_ready(dtype)


def chunked(q, k, v, g, kv0, z0, *, phi: int, eps: float, chunk: int, cu_seqlens=None):
    """The gated chunked forward, through `FusedGatedChunked` when a gradient is wanted; cu_seqlens
    (checked by the caller): packed sequences in one call (batch 1, a state per sequence).
    Returns (o, kv, z) with z None when z0 is None."""
    wide = native.wide(q)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, g, kv0, z0)):
        out = FusedGatedChunked.apply(q, k, v, g, kv0, z0, phi, eps, chunk, wide, cu_seqlens)
        return out if z0 is not None else (*out, None)
    o, kv, z, *_ = torch.ops.linattn_cpu.gated_chunked.default(q, k, v, g.to(kv0.dtype), kv0, z0, phi, eps, chunk,
                                                              False, wide, cu_seqlens)
    return o, kv, (z if z0 is not None else None)


class FusedGatedChunked(torch.autograd.Function):
    """apply(q, k, v, g, kv0, z0, phi, eps, chunk, wide, cu_seqlens) -> (o, kv[, z]), fused forward and
    backward (wide: bf16 inputs on the fp32 path; the backward takes the forward's, and always the fp32
    path for bf16 with vector gates; cu_seqlens: packed sequences, or None).

    Saved: q, k, v, g (in the state dtype), o, the final state, the denominators (B·H·N floats, with
    normalize) and the state entering every block of 512 tokens. Not twice differentiable."""

    @staticmethod
    def forward(ctx, q, k, v, g, kv0, z0, phi, eps, chunk, wide, cu_seqlens=None):
        gk = g.to(kv0.dtype)
        o, kv, z, den, S_blocks, z_blocks = torch.ops.linattn_cpu.gated_chunked.default(q, k, v, gk, kv0, z0, phi, eps,
                                                                                       chunk, True, wide, cu_seqlens)
        normalize = z0 is not None
        ctx.save_for_backward(q, k, v, gk, o, den, S_blocks, z_blocks, kv, z if normalize else None, kv0, z0)
        ctx.phi, ctx.eps, ctx.chunk, ctx.wide, ctx.cu = phi, eps, chunk, wide, cu_seqlens
        ctx.dtypes = (g.dtype, kv0.dtype, None if z0 is None else z0.dtype)
        ctx.set_materialize_grads(False)
        return (o, kv, z) if normalize else (o, kv)

    @staticmethod
    @first_order("gated_linear_attention")
    @torch.autograd.function.once_differentiable
    def backward(ctx, do, dkv, dz=None):
        q, k, v, gk, o, den, S_blocks, z_blocks, kv, z, kv0, z0 = ctx.saved_tensors
        # vector gates multiply bf16 inputs in fp32 in the backward (chunked.BF16_VECTOR_BACKWARD says why)
        wide = ctx.wide or (q.dtype == torch.bfloat16 and gk.dim() == 4)
        dq, dk, dv, dg, dkv0, dz0 = torch.ops.linattn_cpu.gated_chunked_backward.default(
            q, k, v, gk, o, torch.zeros_like(o) if do is None else do, den, S_blocks, z_blocks, kv, z, dkv, dz,
            ctx.phi, ctx.chunk, wide, ctx.cu)
        if not all_finite(dkv0, dz0):  # a NaN or Inf among the factors: the torch ops' exact pass
            dq, dk, dv, dg, dkv0, dz0 = _exact_backward(ctx, (q, k, v, gk, kv0, z0), (do, dkv, dz))
        g_dtype, kv_dtype, z_dtype = ctx.dtypes
        return (dq, dk, dv, dg.to(g_dtype), dkv0.to(kv_dtype), None if z is None else dz0.to(z_dtype), None, None,
                None, None, None)


def _exact_backward(ctx, inputs, grads):
    """Gradients of (q, k, v, g, kv0, z0) from the torch-op Function's exact pass (run again here; sequence
    by sequence when packed), for a backward whose products met a NaN or Inf (linattn.ops.gated.chunked)."""
    fz = kernel_featurizer(ctx.phi)
    normalize = inputs[-1] is not None

    def exact(*xs):
        return ChunkedGatedLinearAttention.apply(fz, ctx.chunk, normalize, ctx.eps, True, *xs)

    with torch.enable_grad():
        xs = [None if x is None else x.detach().requires_grad_() for x in inputs]
        outs = exact(*xs) if ctx.cu is None else native.packed_exact(exact, ctx.cu, xs[:4], xs[4:])
        used = [(out, gr) for out, gr in zip(outs, grads) if gr is not None]
        wrt = [x for x in xs if x is not None]
        res = torch.autograd.grad([u[0] for u in used], wrt, [u[1] for u in used], allow_unused=True)
    res = [torch.zeros_like(x) if r is None else r for x, r in zip(wrt, res)]
    return (*res, None) if not normalize else res


def step(kv, z, q, k, v, g, *, phi: int, eps: float, inplace: bool = False):
    """One fused step from (kv, z) (z None without normalize); returns (o, kv', z' or None). With
    inplace (kv and z contiguous) kv' and z' are kv and z, updated in place (linattn_cpu::gated_step_)."""
    if inplace:
        return torch.ops.linattn_cpu.gated_step_.default(kv, z, q, k, v, g, phi, eps), kv, z
    o, kv_new, z_new = torch.ops.linattn_cpu.gated_step.default(kv, z, q, k, v, g, phi, eps)
    return o, kv_new, (z_new if z is not None else None)
