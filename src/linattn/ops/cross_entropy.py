"""The output projection and cross-entropy in one pass over row blocks, without the (M, V) logits.

For rows h (M, d) of the last hidden states, the head W (V, d) (bias b (V) optional) and targets t (M):

    z_m = W h_m + b,    loss = Σ_{m: t_m ≠ ignore} (logsumexp(z_m) − z_m[t_m]),
    correct = #{m : t_m ≠ ignore, argmax z_m = t_m}

computed over blocks of rows so that a block's logits (rows × V) stay in cache: each block's
product, maximum (and its index: the prediction), one exp(z − max) pass for the log-sum-exp and the
gradient, and the target logit are read from the same few MB. The loss is a plain sum,
so its gradient is known up to the upstream scalar g before backward runs: when a gradient is wanted,
the forward turns each block's logits in place into

    ∂loss/∂z_m = softmax(z_m) − e_{t_m}  (0 for ignored rows),
    ∂h_m = Wᵀ ∂z_m,   ∂W = Σ_m ∂z_m h_mᵀ,   ∂b = Σ_m ∂z_m,

and keeps ∂h, ∂W, ∂b (h's and the head's sizes, not the logits'); backward multiplies them by g.
Three products in all, as on the plain path, each over a block in cache. The plain path — z = h Wᵀ (M, V) in memory, then
F.cross_entropy — writes and reads the logits several times (product, log-softmax and its backward,
the zero-filled gradient, the argmax): with the recall preset's V = 8,192 and M = 1,024 query rows
that is 34 MB a pass, and those passes were about half of a training step (profile in design §16).

The arithmetic is in h's dtype promoted to at least float32 (float64 stays float64: the test oracle).

On CPUs where the fused kernels' tiled gemm runs (`native.tile_gemm`), float32 / float64 blocks of at
least TILE_ROWS rows form the transposed logits zᵀ = W h_blockᵀ (V, rows) instead, so that all three
products read W in its own row-major layout: zᵀ by the gemm with h's small block transposed,
∂h = (zᵀ)ᵀ W and ∂W += zᵀ h (the gemm's transposed-A form); the elementwise passes run on the view
z = (zᵀ)ᵀ. On the AMD EPYC of this project's runs the tiles ran these products ~2× faster than MKL.
"""

from __future__ import annotations

import torch

from . import native
from .autodiff import first_order, refuse_forward_ad

#: logits of a row block: about this many bytes (rows × V in float32: 32 rows of V = 8,192 were the
#: fastest of 16…256 on one AMD EPYC core for the recall preset's M = 1,024, d = 64)
BLOCK_BYTES = 1 << 20

#: blocks with fewer rows than this keep torch's products (the tiles' gains are in wide products)
TILE_ROWS = 16


#: rows per block at least: each block reads all of W (three times with gradients), so a large
#: vocabulary's blocks cannot shrink to the cache (Qwen3.5's V = 248,320 gave one row per block: a
#: training step of 256 tokens read its 1 GB head 768 times)
MIN_BLOCK_ROWS = 32


def block_rows(vocab: int) -> int:
    """Rows per block for a vocabulary of `vocab` entries: logits of about BLOCK_BYTES, at least
    MIN_BLOCK_ROWS rows."""
    return max(MIN_BLOCK_ROWS, BLOCK_BYTES // (4 * vocab))


def _logits(h, weight, bias, acc):
    z = h @ weight.t() if bias is None else torch.addmm(bias, h, weight.t())
    return z.to(acc)


def _tiled(h, weight, bias, rows: int) -> bool:
    """The blocks' products go to the kernels' tiled gemm (module docstring)."""
    return rows >= TILE_ROWS and h.is_contiguous() and weight.is_contiguous() and native.tile_operands(h, weight, bias)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, bias, targets, ignore_index: int, rows: int):
        acc = torch.promote_types(h.dtype, torch.float32)
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        keep = targets != ignore_index
        safe = torch.where(keep, targets, 0)
        loss = torch.zeros((), dtype=acc, device=h.device)
        correct = torch.zeros((), dtype=torch.long, device=h.device)
        dh = torch.empty_like(h) if need_h else None
        dw = torch.zeros(weight.shape, dtype=acc, device=h.device) if need_w else None
        db = torch.zeros(weight.shape[0], dtype=acc, device=h.device) if need_b else None
        tiled = _tiled(h, weight, bias, rows)
        for s in range(0, h.shape[0], rows):
            e = min(s + rows, h.shape[0])
            if tiled:
                zt = native.gemm(weight, h[s:e], tb=True)  # (V, rows)
                if bias is not None:
                    zt += bias[:, None]
                z = zt.t()
            else:
                z = _logits(h[s:e], weight, bias, acc)
            picked = z.gather(1, safe[s:e, None])[:, 0]
            top = z.amax(-1)
            correct += _argmax_hits(z, top, picked, safe[s:e], keep[s:e])
            total = z.sub_(top[:, None]).exp_().sum(-1)  # z ← exp(z − max): one exp pass for the loss and its gradient
            loss += torch.where(keep[s:e], top + total.log() - picked, 0).sum()
            if need_h or need_w or need_b:
                every = bool(keep[s:e].all())
                _softmax_gradient_(z, total, safe[s:e], None if every else keep[s:e])
                if need_h and tiled:
                    native.gemm(zt, weight, ta=True, out=dh[s:e])
                elif need_h:
                    dh[s:e] = (z.to(weight.dtype) @ weight).to(h.dtype)
                if need_w:
                    rows_h = h[s:e] if every else h[s:e].masked_fill(~keep[s:e, None], 0.0)
                    if tiled:
                        native.gemm(zt, rows_h, out=dw, beta=1.0)
                    else:
                        dw.addmm_(z.t(), rows_h.to(acc))
                if need_b:
                    db += z.sum(0)
        ctx.mark_non_differentiable(correct)
        ctx.save_for_backward(dh, None if dw is None else dw.to(weight.dtype),
                              None if db is None else db.to(bias.dtype))
        return loss, correct

    @staticmethod
    @first_order("linear_cross_entropy")
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss, _grad_correct):
        grads = [None if g is None else g * grad_loss.to(g.dtype) for g in ctx.saved_tensors]
        return (*grads, None, None, None)


def _argmax_hits(z, top, picked, t, keep) -> torch.Tensor:
    """#{rows m of the block: keep_m, argmax z_m = t_m} as torch.argmax decides it (the first maximum; a
    NaN counts as the maximum), from top = amax(z) and picked = z[m, t_m]: a row whose target holds the
    maximum counts unless an earlier class ties with it; the rows with ties or a NaN take argmax itself.
    (torch.max with indices costs 10× amax on a (32, 8192) block; this is an equality pass.)"""
    hit = (picked == top) & keep
    odd = torch.isnan(top) & keep
    if not bool(hit.any()) and not bool(odd.any()):
        return hit.sum()
    ties = (z == top[:, None]).sum(-1) > 1
    exact = (hit & ties) | odd
    n = (hit & ~ties & ~odd).sum()
    if bool(exact.any()):
        n = n + (z[exact].argmax(-1) == t[exact]).sum()
    return n


def _softmax_gradient_(e, total, safe, keep) -> None:
    """e (rows, V) = exp(z − max z) with row sums `total` ← ∂loss/∂z = softmax(z) − e_t per row (0 on
    the rows keep marks False; keep None: every row scored), in place."""
    e.mul_(total.reciprocal()[:, None])
    e[torch.arange(e.shape[0], device=e.device), safe] -= 1.0
    if keep is not None:  # an ignored row's non-finite logits must not reach the gradients
        e.masked_fill_(~keep[:, None], 0.0)


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                         *, ignore_index: int = -100, rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ cross-entropy, number correct) of the logits h Wᵀ + b against targets (module docstring),
    without materializing them. h (…, d), weight (V, d), bias (V) or None, targets (…) integer ids in
    [0, V) or ignore_index; rows: rows per block (default block_rows(V)). The loss is a scalar in h's
    dtype promoted to float32, differentiable in h, weight and bias (first order, reverse mode); the
    count is an int64 scalar."""
    if h.dim() < 1 or weight.dim() != 2 or h.shape[-1] != weight.shape[1]:
        raise ValueError(f"h (…, d) and weight (V, d) must share d, got {tuple(h.shape)} and {tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias must have shape (V,) = ({weight.shape[0]},), got {tuple(bias.shape)}")
    if not isinstance(targets, torch.Tensor) or tuple(targets.shape) != tuple(h.shape[:-1]) \
            or targets.dtype.is_floating_point or targets.dtype == torch.bool:
        got = f"{tuple(targets.shape)} {targets.dtype}" if isinstance(targets, torch.Tensor) else type(targets).__name__
        raise ValueError(f"targets must be an integer tensor of h's shape without d, {tuple(h.shape[:-1])}, got {got}")
    if rows is not None and (isinstance(rows, bool) or not isinstance(rows, int) or rows < 1):
        raise ValueError(f"rows must be a positive integer, got {rows!r}")
    refuse_forward_ad("linear_cross_entropy", h, weight, bias)
    flat_t = targets.reshape(-1).long()
    scored = flat_t[flat_t != ignore_index]
    if scored.numel() and (int(scored.min()) < 0 or int(scored.max()) >= weight.shape[0]):
        raise ValueError(f"targets must lie in [0, {weight.shape[0]}) or be ignore_index ({ignore_index})")
    return _LinearCrossEntropy.apply(h.reshape(-1, h.shape[-1]), weight, bias, flat_t, ignore_index,
                                     rows or block_rows(weight.shape[0]))


__all__ = ["BLOCK_BYTES", "MIN_BLOCK_ROWS", "TILE_ROWS", "block_rows", "linear_cross_entropy"]
