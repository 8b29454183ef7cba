"""Sliding-window softmax attention, chunked: O(N·W) time and memory, forward and backward.

Per (batch, head), the N queries are cut into blocks of C rows; p = ⌈(W − 1)/C⌉. Block n's queries
see at most the keys of blocks n − p … n (the earliest key of the window of its first query,
nC − W + 1, lies in block n − p), a *span* of S = (p + 1)·C keys. So each block is one dense
C×S problem

    s = Q_n K_spanᵀ·scale,  s_ij = −∞ where j ∉ window(i) (`torch.masked_fill`, before the softmax),
    P = exp(s − m),  O_n = P V_span / (P 1),  lse_n = m + log(P 1),

and nothing of size N×N exists. Layout: q, k, v are copied once (and widened to the compute dtype)
into a flat tensor of (B·H·(nb + p)) blocks of C rows, p zero blocks before each (batch, head) row and
the tail padded to whole blocks; the spans are then an overlapping strided view of the keys
(`as_strided`, no copy), and all spans of all rows are one batched matmul. The windows that start in
a row's last p blocks pair zero "queries" of the next row's front padding with keys of two rows:
they are computed (p of nb + p windows) and dropped. Blocks are walked in groups of about
BLOCK_ELEMENTS scores, so temporaries stay bounded whatever N.

The mask of every block comes from one table (B', nb + p, C, S) of "blocked" entries built per call:
j ∉ [max(s(i), i − W + 1), i] (s(i) the query's sequence start: 0, or its cu_seqlens start), and with
a key-padding mask, padded keys for real queries. Without cu_seqlens and padding every block after
the first p has the same mask, and a group of such blocks uses that one C×S mask.

Backward (FlashAttention-2's, Dao 2023), with D_i = Σ_e dO_ie O_ie: recompute P = exp(s − lse),

    dV_span = Pᵀ dO,   dP = dO V_spanᵀ,   dS = P ⊙ (dP − D)·scale,   dQ_n = dS K_span,   dK_span = dSᵀ Q_n,

and the span gradients are folded back onto the key blocks (p + 1 shifted adds). Saved: the padded
q, k, v, the output and lse (N floats per head): O(N·D), no score matrix. The backward is first order
only (linattn.ops.autodiff): with create_graph=True it refuses by name.
"""

from __future__ import annotations

import torch

from ..autodiff import first_order

#: Whether CPU tensors take torch's fused flash-attention kernel (linattn.ops.swa.cpu) rather than
#: the torch-op path below (same numbers up to rounding; tests set it to check both).
FUSED_CPU = True
#: Target number of score entries (C·S per block) of one group of blocks.
BLOCK_ELEMENTS = 1 << 18


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Scores, softmax and products run in float64 for float64 inputs, float32 for every other dtype
    (bf16/fp16 inputs are widened block by block as they are laid out; outputs come back narrow)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def span_blocks(window: int, chunk: int) -> int:
    """p = ⌈(W − 1)/C⌉, the number of blocks before a query block that its windows reach into."""
    return -(-(window - 1) // chunk)


class Layout:
    """Geometry of one call: B, H, N, chunk C, p, nb = ⌈N/C⌉ query blocks, L = nb + p blocks per
    (batch, head) row, U = B·H·L − p windows, S = (p + 1)·C keys per span."""

    def __init__(self, b: int, h: int, n: int, chunk: int, window: int):
        self.b, self.h, self.n, self.c = b, h, n, chunk
        self.p = span_blocks(window, chunk)
        self.nb = -(-n // chunk)
        self.rows = self.nb + self.p
        self.u = b * h * self.rows - self.p
        self.s = (self.p + 1) * chunk

    def pad(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """(B, H, N, D) -> flat (B·H·L, C, D) in dtype: p zero blocks, x, zeros to whole blocks."""
        d, start = x.shape[-1], self.p * self.c
        out = x.new_empty(self.b * self.h, self.rows * self.c, d, dtype=dtype)
        out[:, :start] = 0
        out[:, start:start + self.n] = x.reshape(self.b * self.h, self.n, d)
        out[:, start + self.n:] = 0
        return out.view(-1, self.c, d)

    def unpad(self, flat: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        d = flat.shape[-1]
        rows = flat.view(self.b * self.h, self.rows * self.c, d)[:, self.p * self.c:self.p * self.c + self.n]
        return rows.reshape(self.b, self.h, self.n, d).to(dtype)

    def spans(self, flat: torch.Tensor) -> torch.Tensor:
        """The U overlapping spans (U, S, D) of a flat key/value tensor: span u = blocks u … u + p."""
        d = flat.shape[-1]
        return flat.as_strided((self.u, self.s, d), (self.c * d, d, 1), flat.storage_offset())

    def groups(self) -> list[tuple[int, int]]:
        per = max(1, BLOCK_ELEMENTS // (self.c * self.s))
        return [(u, min(u + per, self.u)) for u in range(0, self.u, per)]


class MaskTable:
    """The blocked entries of every query block: table (B', L, C, S) bool, True = masked out; the
    window u (its queries at flat block u + p) uses table[b, (u + p) mod L]. Rows (u + p) mod L < p
    are the dropped windows: nothing masked there (their zero queries stay finite)."""

    def __init__(self, lay: Layout, window: int, cu_seqlens, key_padding_mask, device):
        c, p, rows = lay.c, lay.p, lay.rows
        blk = torch.arange(rows, device=device)[:, None]
        i = (blk - p) * c + torch.arange(c, device=device)              # (L, C) query positions
        j = (blk - 2 * p) * c + torch.arange(lay.s, device=device)      # (L, S) key positions
        start = torch.zeros_like(i)
        if cu_seqlens is not None:
            cu = cu_seqlens.to(device=device, dtype=torch.long)
            seq = torch.searchsorted(cu, i.clamp(0, lay.n - 1).flatten(), right=True) - 1
            start = cu[seq].view_as(i)
        lo = torch.maximum(i - window + 1, start)
        ok = (j[:, None, :] <= i[:, :, None]) & (j[:, None, :] >= lo[:, :, None])   # (L, C, S)
        if key_padding_mask is not None:
            km = torch.zeros(lay.b, rows * c + p * c, dtype=torch.bool, device=device)
            km[:, 2 * p * c:2 * p * c + lay.n] = key_padding_mask
            qreal = km[:, p * c:p * c + rows * c].view(lay.b, rows, c)        # query at block q, row r
            keys = km.unfold(1, lay.s, c)[:, :rows]                            # (B, L, S)
            ok = ok & (keys[:, :, None, :] | ~qreal[..., None])
        else:
            ok = ok[None]
        ok[:, :p] = True
        self.blocked = ~ok
        self.rows, self.p, self.per_batch = rows, p, lay.h * rows
        # without packing or padding every block from 2p on (its first query's window starts at ≥ 0)
        # has one mask: groups of such blocks share it
        self.static = 2 * p if (cu_seqlens is None and key_padding_mask is None and rows > 2 * p) else None

    def group(self, u0: int, u1: int) -> torch.Tensor:
        """The masks (g or 1, C, S) of the windows u0 … u1 − 1."""
        first = (u0 + self.p) % self.rows
        if self.static is not None and first >= self.static and first + (u1 - u0) <= self.rows:
            return self.blocked[0, self.static][None]
        flat = torch.arange(u0 + self.p, u1 + self.p, device=self.blocked.device)
        b = flat // self.per_batch if self.blocked.shape[0] > 1 else torch.zeros_like(flat)
        return self.blocked[b, flat % self.rows]


def blocked_problem(q: torch.Tensor, window: int, chunk: int, cu_seqlens, key_padding_mask):
    """(layout, mask table, compute dtype) of a call with q (B, H, N, D): the blocking of its rows into
    query blocks of C = chunk rows and their key spans, the blocked entries of the window, and the
    dtype the blocks are computed in: what every CPU forward of this package starts from."""
    b, h, n, _ = q.shape
    lay = Layout(b, h, n, chunk, window)
    return lay, MaskTable(lay, window, cu_seqlens, key_padding_mask, q.device), compute_dtype(q.dtype)


def _scores(qg, kg, mask, scale):
    s = torch.bmm(qg, kg.transpose(1, 2)).mul_(scale)
    return s.masked_fill_(mask, float("-inf"))


class SlidingWindowAttentionFunction(torch.autograd.Function):
    """forward(q, k, v, window, scale, chunk, cu_seqlens, key_padding_mask) -> o (B, H, N, E)."""

    @staticmethod
    def forward(ctx, q, k, v, window: int, scale: float, chunk: int, cu_seqlens, key_padding_mask):
        lay, table, cdt = blocked_problem(q, window, chunk, cu_seqlens, key_padding_mask)
        qf, kf, vf = lay.pad(q, cdt), lay.pad(k, cdt), lay.pad(v, cdt)
        ks, vs = lay.spans(kf), lay.spans(vf)
        of = torch.zeros_like(vf)
        lse = torch.zeros(qf.shape[:2], dtype=cdt, device=q.device)
        p = lay.p
        for u0, u1 in lay.groups():
            s = _scores(qf[p + u0:p + u1], ks[u0:u1], table.group(u0, u1), scale)
            m = s.amax(-1, keepdim=True)
            s.sub_(m).exp_()
            den = s.sum(-1, keepdim=True)
            torch.bmm(s, vs[u0:u1], out=of[p + u0:p + u1])
            of[p + u0:p + u1].div_(den)
            lse[p + u0:p + u1] = (m + den.log()).squeeze(-1)
        ctx.save_for_backward(qf, kf, vf, of, lse)
        ctx.lay, ctx.table, ctx.scale, ctx.dtype = lay, table, scale, q.dtype
        return lay.unpad(of, q.dtype)

    @staticmethod
    @first_order("sliding_window_attention")
    def backward(ctx, do):
        qf, kf, vf, of, lse = ctx.saved_tensors
        lay, table, scale, p = ctx.lay, ctx.table, ctx.scale, ctx.lay.p
        dof = lay.pad(do, qf.dtype)
        dsum = (dof * of).sum(-1)                                        # D_i, (B·H·L, C)
        dq, dk, dv = torch.zeros_like(qf), torch.zeros_like(kf), torch.zeros_like(vf)
        ks, vs = lay.spans(kf), lay.spans(vf)
        c = lay.c
        for u0, u1 in lay.groups():
            qg, dog = qf[p + u0:p + u1], dof[p + u0:p + u1]
            pr = _scores(qg, ks[u0:u1], table.group(u0, u1), scale)
            pr.sub_(lse[p + u0:p + u1, :, None]).exp_()                  # P
            dv_span = torch.bmm(pr.transpose(1, 2), dog)                 # (g, S, E)
            ds = torch.bmm(dog, vs[u0:u1].transpose(1, 2))               # dP
            ds.sub_(dsum[p + u0:p + u1, :, None]).mul_(pr).mul_(scale)   # dS
            torch.bmm(ds, ks[u0:u1], out=dq[p + u0:p + u1])
            dk_span = torch.bmm(ds.transpose(1, 2), qg)                  # (g, S, D)
            for t in range(p + 1):
                dk[u0 + t:u1 + t].add_(dk_span[:, t * c:(t + 1) * c])
                dv[u0 + t:u1 + t].add_(dv_span[:, t * c:(t + 1) * c])
        return (lay.unpad(dq, ctx.dtype), lay.unpad(dk, ctx.dtype), lay.unpad(dv, ctx.dtype),
                None, None, None, None, None)
