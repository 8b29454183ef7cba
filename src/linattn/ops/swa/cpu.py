"""The CPU paths of sliding-window attention.

linattn's own kernels (`NativeSlidingWindowAttention`: csrc/swa.cpp, linattn_cpu::swa_forward and
swa_backward, built with the other fused kernels by linattn.ops.native) take fp32, fp64 and bf16 inputs
without a key-padding mask (bf16: blocks widened to fp32 as they are read, fp32 scores, sums and lse,
o and the gradients rounded to bf16 once): per (batch, head) row — with cu_seqlens per (sequence, head) row — the
query blocks of C rows walk once over their key span [i0 − W + 1, i0 + C) read in place from k and v
(no padded copy, no span tensor, no mask tensor: each query's window is a range of the span), the
forward with 2 gemms per block and the backward with 5, dK and dV accumulated over the overlapping
spans of the row. Saved: o and lse. Where they do not apply (fp16, a key-padding mask, no
compiler) torch's flash kernel runs as below.

torch's fused flash-attention kernel for the CPU
(`aten::_scaled_dot_product_flash_attention_for_cpu` and its backward) run on the query blocks and
their key spans of linattn.ops.swa.chunked, one call per batch row.

Per batch row b the H·nb blocks are the kernel's (batch, heads) = (H, nb): queries (H, nb, C, D)
are a view of q (a copy padded to whole blocks when C does not divide N); key and value spans
(H, nb, S, D) are an overlapping strided view of the padded k, v (span n = blocks n … n + p of the
row, no copy); the additive mask (1, nb, C, S) (0 where j ∈ window(i), −∞ elsewhere, from MaskTable)
is shared by the heads. The kernel keeps scores in cache block by block (never the C×S matrices of
all blocks) and returns the log-sum-exp that its backward needs; the span gradients it returns are
folded onto the key blocks (p + 1 shifted adds), as in the torch-op path. Same numbers as that path
up to rounding; it needs D = E (the kernel's rule), else the torch-op path runs. About twice as fast
here as the torch-op path for the forward (benchmarks/swa.py).
"""

from __future__ import annotations

import torch

from .. import native
from ..autodiff import first_order
from .chunked import Layout, blocked_problem

#: Whether fp32/fp64/bf16 CPU calls without a key-padding mask take linattn's kernels (csrc/swa.cpp) rather
#: than torch's flash kernel on padded spans (same numbers up to rounding; tests and benchmarks switch).
NATIVE = True

#: Query tokens per kernel call (per batch row, all heads).
GROUP_TOKENS = 2048
_FORWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def available(q: torch.Tensor, v: torch.Tensor) -> bool:
    """The fused CPU kernel applies: CPU tensors, one head dim for q, k and v (the kernel's
    requirement; E ≠ D takes the torch-op path), and a torch that has it."""
    return q.device.type == "cpu" and q.shape[-1] == v.shape[-1] and _FORWARD is not None and _BACKWARD is not None


def _spans(rows: torch.Tensor, lay: Layout) -> torch.Tensor:
    """(H, L·C, D) padded rows -> the (H, nb, S, D) overlapping spans (a view)."""
    d = rows.shape[-1]
    return rows.as_strided((rows.shape[0], lay.nb, lay.s, d), (rows.stride(0), lay.c * d, d, 1),
                           rows.storage_offset())


def _blocks(x: torch.Tensor, lay: Layout, dtype: torch.dtype) -> torch.Tensor:
    """(B, H, N, D) -> (B, H, nb, C, D) query blocks in dtype: a view when N is a multiple of C and x
    is contiguous in dtype, else a copy with the tail padded with zeros."""
    if lay.n == lay.nb * lay.c and x.dtype == dtype:
        return x.contiguous().view(lay.b, lay.h, lay.nb, lay.c, x.shape[-1])
    out = x.new_zeros(lay.b, lay.h, lay.nb * lay.c, x.shape[-1], dtype=dtype)
    out[:, :, :lay.n] = x
    return out.view(lay.b, lay.h, lay.nb, lay.c, x.shape[-1])


def native_chunk(window: int) -> int:
    """linattn's kernels' query block when the caller does not choose: 16 rows for W ≤ 64, else 32. A
    block of C reads C + W − 1 keys for C·W useful scores; fwd+bwd at N = 4096, W = 64 (fp32, 1 thread,
    benchmarks/swa.py) took 0.87–0.91× linear attention's time with C = 16, 0.92–0.93× with 32, 1.07× with
    64; at W = 256, 32 and 16 were alike and 7% under 64."""
    return 16 if window <= 64 else 32


_NATIVE_DTYPES = (torch.float32, torch.float64, torch.bfloat16)


def native_usable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_padding_mask) -> bool:
    """linattn's kernels take the call: NATIVE, CPU fp32, fp64 or bf16 q, k, v of one dtype, no key-padding
    mask, the extension built (and not tracing)."""
    return (NATIVE and key_padding_mask is None and q.device.type == "cpu" and q.dtype in _NATIVE_DTYPES
            and k.dtype is q.dtype and v.dtype is q.dtype and native._ready())


class NativeSlidingWindowAttention(torch.autograd.Function):
    """forward(q, k, v, window, scale, chunk, cu_seqlens) -> o (B, H, N, E): linattn_cpu::swa_forward,
    and swa_backward for the gradients of q, k, v (first order only)."""

    @staticmethod
    def forward(ctx, q, k, v, window: int, scale: float, chunk: int, cu_seqlens):
        o, lse = torch.ops.linattn_cpu.swa_forward.default(q, k, v, window, scale, chunk, cu_seqlens)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.window, ctx.scale, ctx.chunk, ctx.cu = window, scale, chunk, cu_seqlens
        return o

    @staticmethod
    @first_order("sliding_window_attention")
    @torch.autograd.function.once_differentiable
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = torch.ops.linattn_cpu.swa_backward.default(q, k, v, o, lse, do, ctx.window, ctx.scale, ctx.chunk,
                                                                ctx.cu)
        return dq, dk, dv, None, None, None, None


class FusedSlidingWindowAttention(torch.autograd.Function):
    """forward(q, k, v, window, scale, chunk, cu_seqlens, key_padding_mask) -> o (B, H, N, E)."""

    @staticmethod
    def forward(ctx, q, k, v, window: int, scale: float, chunk: int, cu_seqlens, key_padding_mask):
        lay, table, cdt = blocked_problem(q, window, chunk, cu_seqlens, key_padding_mask)
        b, h, n = lay.b, lay.h, lay.n
        blocked = table.blocked[:, lay.p:]
        bias = torch.zeros(blocked.shape, dtype=cdt, device=q.device).masked_fill_(blocked, float("-inf"))
        qb = _blocks(q, lay, cdt)
        kp, vp = (lay.pad(x, cdt).view(b, h, lay.rows * lay.c, -1) for x in (k, v))
        o = qb.new_empty(b, h, lay.nb, lay.c, v.shape[-1])
        lse = qb.new_empty(b, h, lay.nb, lay.c)
        for i in range(b):
            ks, vs, mask = _spans(kp[i], lay), _spans(vp[i], lay), bias[i if bias.shape[0] > 1 else 0][None]
            for n0, n1 in _groups(lay):
                o[i, :, n0:n1], lse[i, :, n0:n1] = _FORWARD(qb[i, :, n0:n1], ks[:, n0:n1], vs[:, n0:n1], 0.0, False,
                                                            attn_mask=mask[:, n0:n1], scale=scale)
        ctx.save_for_backward(qb, kp, vp, o, lse, bias)
        ctx.lay, ctx.scale, ctx.dtype = lay, scale, q.dtype
        return o.flatten(2, 3)[:, :, :n].to(q.dtype)

    @staticmethod
    @first_order("sliding_window_attention")
    def backward(ctx, do):
        qb, kp, vp, o, lse, bias = ctx.saved_tensors
        lay, scale = ctx.lay, ctx.scale
        b, n = lay.b, lay.n
        dop = _blocks(do, lay, o.dtype)
        c = lay.c
        dq = torch.empty_like(qb)
        dk = kp.new_empty(b, lay.h, lay.nb, c, kp.shape[-1])
        dv = vp.new_empty(b, lay.h, lay.nb, c, vp.shape[-1])
        for i in range(b):
            ks, vs, mask = _spans(kp[i], lay), _spans(vp[i], lay), bias[i if bias.shape[0] > 1 else 0][None]
            for n0, n1 in _groups(lay):
                dq[i, :, n0:n1], dks, dvs = _BACKWARD(dop[i, :, n0:n1], qb[i, :, n0:n1], ks[:, n0:n1], vs[:, n0:n1],
                                                      o[i, :, n0:n1], lse[i, :, n0:n1], 0.0, False,
                                                      attn_mask=mask[:, n0:n1], scale=scale)
                _fold(dk[i], dks, n0, n1, lay)
                _fold(dv[i], dvs, n0, n1, lay)
        dt = ctx.dtype
        return (dq.flatten(2, 3)[:, :, :n].to(dt), dk.flatten(2, 3)[:, :, :n].to(dt),
                dv.flatten(2, 3)[:, :, :n].to(dt), None, None, None, None, None)


def _fold(out: torch.Tensor, span_grad: torch.Tensor, n0: int, n1: int, lay: Layout) -> None:
    """Adds the span gradients (H, n1 − n0, S, D) of query blocks n0 … n1 − 1 onto the key-block
    gradients out (H, nb, C, D), in place: entries t·C … (t+1)·C − 1 of span n belong to key block
    n + t − p. Groups come in order, so block n's own entry (t = p) is written first (no zero fill)
    and the earlier pieces add onto blocks written already."""
    c, p = lay.c, lay.p
    out[:, n0:n1] = span_grad[:, :, p * c:]
    for t in range(p):
        first, hi = n0 + t - p, n1 + t - p                       # key blocks of piece t, before clipping
        lo = max(0, first)
        if hi > lo:
            out[:, lo:hi].add_(span_grad[:, lo - first:, t * c:(t + 1) * c])


def _groups(lay: Layout) -> list[tuple[int, int]]:
    """Ranges of query blocks per kernel call: about GROUP_TOKENS queries, so that one call's spans,
    scores and gradients stay in cache (one call for all of N=16384 ran 1.5× slower per token)."""
    per = max(1, GROUP_TOKENS // lay.c)
    return [(n0, min(n0 + per, lay.nb)) for n0 in range(0, lay.nb, per)]
