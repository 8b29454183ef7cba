"""The CPU path of sliding-window attention: torch's fused flash-attention kernel for the CPU
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

from .chunked import Layout, MaskTable, compute_dtype

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


class FusedSlidingWindowAttention(torch.autograd.Function):
    """forward(q, k, v, window, scale, chunk, cu_seqlens, key_padding_mask) -> o (B, H, N, E)."""

    @staticmethod
    def forward(ctx, q, k, v, window: int, scale: float, chunk: int, cu_seqlens, key_padding_mask):
        b, h, n, _ = q.shape
        cdt = compute_dtype(q.dtype)
        lay = Layout(b, h, n, chunk, window)
        blocked = MaskTable(lay, window, cu_seqlens, key_padding_mask, q.device).blocked[:, lay.p:]
        bias = torch.zeros(blocked.shape, dtype=cdt, device=q.device).masked_fill_(blocked, float("-inf"))
        qb = _blocks(q, lay, cdt)
        kp, vp = (lay.pad(x, cdt).view(b, h, lay.rows * lay.c, -1) for x in (k, v))
        outs, lses = [], []
        for i in range(b):
            o, lse = _FORWARD(qb[i], _spans(kp[i], lay), _spans(vp[i], lay), 0.0, False,
                              attn_mask=bias[i if bias.shape[0] > 1 else 0][None], scale=scale)
            outs.append(o)
            lses.append(lse)
        o, lse = _stack(outs), _stack(lses)                                    # (B, H, nb, C, E), (B, H, nb, C)
        ctx.save_for_backward(qb, kp, vp, o, lse, bias)
        ctx.lay, ctx.scale, ctx.dtype = lay, scale, q.dtype
        return o.flatten(2, 3)[:, :, :n].to(q.dtype)

    @staticmethod
    def backward(ctx, do):
        qb, kp, vp, o, lse, bias = ctx.saved_tensors
        lay, scale = ctx.lay, ctx.scale
        b, n = lay.b, lay.n
        dop = _blocks(do, lay, o.dtype)
        dqs, dks, dvs = [], [], []
        for i in range(b):
            dq, dk_span, dv_span = _BACKWARD(dop[i], qb[i], _spans(kp[i], lay), _spans(vp[i], lay),
                                             o[i], lse[i], 0.0, False,
                                             attn_mask=bias[i if bias.shape[0] > 1 else 0][None], scale=scale)
            dqs.append(dq)
            dks.append(_fold(dk_span, lay))
            dvs.append(_fold(dv_span, lay))
        dq, dk, dv = _stack(dqs), _stack(dks), _stack(dvs)
        dt = ctx.dtype
        return (dq.flatten(2, 3)[:, :, :n].to(dt), dk.flatten(2, 3)[:, :, :n].to(dt),
                dv.flatten(2, 3)[:, :, :n].to(dt), None, None, None, None, None)


def _stack(xs: list[torch.Tensor]) -> torch.Tensor:
    return xs[0][None] if len(xs) == 1 else torch.stack(xs)


def _fold(span_grad: torch.Tensor, lay: Layout) -> torch.Tensor:
    """(H, nb, S, D) span gradients -> (H, nb, C, D) gradients of the key blocks 0 … nb − 1: entries
    t·C … (t+1)·C − 1 of span n belong to block n + t − p (blocks before 0 are the front padding)."""
    c, p, nb = lay.c, lay.p, lay.nb
    out = span_grad[:, :, p * c:].clone()                      # t = p: the query block itself
    for t in range(p):
        shift = p - t                                          # span n, piece t -> block n − shift
        if shift < nb:
            out[:, :nb - shift].add_(span_grad[:, shift:, t * c:(t + 1) * c])
    return out
