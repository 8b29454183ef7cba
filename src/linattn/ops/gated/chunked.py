"""Gated causal linear attention, chunked, in torch ops, with an explicit memory-bounded backward
(design §12). The path for every device, feature map and dtype; the CPU fast path is `fused.py`.

Per (batch, head) and chunk of c rows, features Q, K (c×F), values V (c×E), log-decays g (c, or
c×F), β = the inclusive cumulative sum of g inside the chunk (float64, each g clamped at GATE_FLOOR),
λ = β_c (the chunk's total),
S, z the state entering the chunk:

    D_ij = e^{β_i − β_j} (i ≥ j, else 0; masked before the exponential)             scalar gates
    A = M ⊙ (Q Kᵀ) ⊙ D                                                               scalar gates
    A = M ⊙ (Q ⊙ e^{β − λ}) (K ⊙ e^{λ − β})ᵀ                                         vector gates
    U = (Q ⊙ e^{β}) S + A V,       den = A 1 + (Q ⊙ e^{β}) z + ε,       O = U / den  (or U)
    S ← e^{λ} ⊙ S + (K ⊙ e^{λ − β})ᵀ V,      z ← e^{λ} ⊙ z + (K ⊙ e^{λ − β})ᵀ 1

Every factor is an exponential of a non-positive number except e^{β − λ} of the vector form, which
is at most e^{SPAN_LIMIT}: a block whose chunks would decay more than SPAN_LIMIT (in log) over rows
2…c of some feature runs with chunks halved until none does (c = 1 always qualifies), so nothing
overflows, and each score is the sum of the true terms q_f k_f e^{β_if − β_jf} (no cancellation).
Scalar gates need no such limit.

The states entering the chunks of a block are a decayed prefix sum (`decay_scan`): one triangular
matmul with weights e^{Λ_{n−1} − Λ_m} (Λ the cumulative chunk decays, masked before exp).

Backward, with G = ∂L/∂U, γ = ∂L/∂den (normalize), R, r the gradients flowing into S, z after the
chunk (a reverse decayed scan of (Q ⊙ e^{β})ᵀ G and (Q ⊙ e^{β})ᵀ γ), P = M ⊙ (G Vᵀ + γ 1ᵀ):

    ∂V = Aᵀ G + (K ⊙ e^{λ−β}) R
    scalar: ∂Q = (P ⊙ D) K + (G Sᵀ + γ zᵀ) ⊙ e^{β},    ∂K = (P ⊙ D)ᵀ Q + (V Rᵀ + 1 rᵀ) ⊙ e^{λ−β}
    vector: ∂Q = (P (K ⊙ e^{λ−β})) ⊙ e^{β−λ} + (G Sᵀ + γ zᵀ) ⊙ e^{β},
            ∂K = (Pᵀ (Q ⊙ e^{β−λ}) + V Rᵀ + 1 rᵀ) ⊙ e^{λ−β}
    ∂(S, z)_entering = (Q ⊙ e^{β})ᵀ (G, γ) + e^{λ} ⊙ (R, r)

and the gates' gradient from the identity of design §12 applied to each chunk with its entering state
held fixed: for s in the chunk,

    ∂L/∂g_s = Σ_{t ≥ s in the chunk} (q_t ⊙ ∂q_t − k_t ⊙ ∂k_t) + Σ_e S_out ⊙ R_out (+ z_out ⊙ r_out)

(summed over F for scalar gates; S_out, R_out the state after the chunk and its gradient), in float64.
It equals the whole-sequence form (the chunk's end term is what the later tokens' terms and the final
state's add up to) but sums c terms instead of N, which keeps it accurate where strong decay makes
the long sum cancel: at N = 65,536, g = −5, fp32, 1e-7 instead of 2e-4 relative error. Saved: q, k,
v, g, o, the denominators and the state entering each block; features and chunk states are
recomputed block by block (nothing of size N·F·E, nothing N·C beyond a block).

NaN and Inf respect causality as in `linattn.ops.linear.chunked`: a pass whose final state (forward) or
initial-state gradient (backward) comes out non-finite runs again exact. The exact pass takes the
products where a structural zero meets a factor (a masked score, a zero cotangent, a masked key) with
0·NaN = 0 (`nonfinite.Products`), masks the scores and P by selection, and carries the chunk states
one chunk at a time instead of through the triangular matmul, whose zero weights would meet a later
chunk's NaN; with zero feature gradients from zero cotangents, the gate-gradient identity's terms of
unused tokens are then exactly 0 too.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

from ..features import Featurizer
from ..autodiff import first_order
from ..linear.chunked import (
    BLOCK_ELEMENTS,
    block_target,
    chain_feature_grads,
    chunk_blocks,
    chunk_view,
    compute_dtype,
    output_grads,
    state_dtype,
    store_block,
)
from ..nonfinite import Products, all_finite

#: Largest log-decay of a vector-gated chunk over its rows 2…c (any feature): e^{β−λ} ≤ e^40 ≈ 2e17.
SPAN_LIMIT = 40.0
#: Every log-decay is clamped at this floor before the cumulative sums (csrc/gated.h: kGatedFloor):
#: e^{−100} ≈ 3.7e-44 is zero to fp32 and below any float64 rounding of a later term, while a g of
#: −1e16 in a float64 sum would swallow the small gates summed with it (issue 37 item 1). The gradient
#: of a clamped g is 0 (that of e^g, ≤ 3.7e-44, would be after rounding).
GATE_FLOOR = -100.0


@functools.lru_cache(maxsize=32)
def _strict_lower_mask(n: int, device: torch.device) -> torch.Tensor:
    """(n, n) bool, True strictly below the diagonal (cached: never written to)."""
    return torch.ones(n, n, dtype=torch.bool, device=device).tril_(-1)


def _span(g: torch.Tensor, c: int) -> float:
    """Largest −Σ_{rows 2…c} g over the chunks of c rows of g (BH, m, F), m a multiple of c."""
    if c < 2 or g.shape[1] == 0:
        return 0.0
    return -g.reshape(g.shape[0], -1, c, g.shape[-1])[:, :, 1:].sum(2).min().item()


def _max_chunks(bh: int, width: int) -> int:
    """Chunks per segment such that the decay scan's weights (BH, nc, nc, width) hold at most
    BLOCK_ELEMENTS numbers (width = F for vector gates, else 1)."""
    return max(1, math.isqrt(BLOCK_ELEMENTS // (bh * width)))


def gated_blocks(n: int, chunk: int, bh: int, feat: int, value: int, vector: bool) -> list[tuple[int, int, int]]:
    """The blocks of `ops.linear.chunked.chunk_blocks`, with at most `_max_chunks` chunks each."""
    nc = _max_chunks(bh, feat if vector else 1)
    return chunk_blocks(n, chunk, bh, max(feat, value, chunk, -(-BLOCK_ELEMENTS // (bh * nc * chunk))))


def split_block(g: torch.Tensor | None, s: int, t: int, c: int) -> list[tuple[int, int, int]]:
    """Segments (start, end, chunk) covering the block [s, t): runs of whole chunks, then a tail of
    fewer rows. g: the block's vector gates (BH, t − s, F) in float64 (None for scalar gates: the block
    itself). With vector gates the chunk is halved until every chunk, the tail included, spans ≤
    SPAN_LIMIT, and the runs hold at most `_max_chunks` chunks."""
    m = t - s
    if g is None:
        return [(s, t, c)]
    while c > 1:
        main = m // c * c
        if _span(g[:, :main], c) <= SPAN_LIMIT and (main == m or _span(g[:, main:], m - main) <= SPAN_LIMIT):
            break
        c = (c + 1) // 2
    main, run = m // c * c, _max_chunks(g.shape[0], g.shape[-1]) * c
    segments = [(s + a, s + min(a + run, main), c) for a in range(0, main, run)]
    return segments + ([(s + main, t, m - main)] if main < m else [])


def decay_scan(init: torch.Tensor, parts: torch.Tensor, lam: torch.Tensor, reverse: bool = False,
               exact: bool = False):
    """The decayed prefix sum over the chunks of a segment, in init's dtype.

    init (BH, F, E) or (BH, F); parts (BH·nc, F, E) or (BH·nc, F); lam (BH·nc, 1) or (BH·nc, 1, F)
    float64, each chunk's total log-decay. Forward, S_{n+1} = e^{λ_n} ⊙ S_n + parts_n from S_0 = init:
    returns (S_n for every chunk n, S_nc). Reverse, R_{n−1} = parts_n + e^{λ_n} ⊙ R_n from
    R_{nc−1} = init: returns (R_n for every n, R_{−1}). With Λ = the cumulative sum of λ and
    Λ⁻ = Λ − λ, weights e^{Λ⁻_n − Λ_m} (m < n; reverse: the transpose), masked before exp.
    exact: that recurrence chunk by chunk (no zero weight meets a later part's NaN or Inf)."""
    bh, dt = init.shape[0], init.dtype
    lam = lam.reshape(bh, -1, lam.shape[-1])  # (BH, nc, 1 or F)
    if exact:
        return _decay_steps(init, parts, lam, reverse)
    nc = lam.shape[1]
    big = lam.cumsum(1)
    ex, last = big - lam, big[:, -1:]
    keep = _strict_lower_mask(nc, lam.device)
    if reverse:
        expo = (ex[:, None] - big[:, :, None]).masked_fill(~keep.mT[..., None], float("-inf"))
        c_init, c_parts = last - big, ex
    else:
        expo = (ex[:, :, None] - big[:, None]).masked_fill(~keep[..., None], float("-inf"))
        c_init, c_parts = ex, last - big
    w = expo.exp_().to(dt)  # (BH, nc, nc, 1 or F)
    p = parts.reshape(bh, nc, *init.shape[1:]).to(dt)
    if lam.shape[-1] == 1:
        per = torch.bmm(w[..., 0], p.flatten(2)).view(p.shape)
    else:
        per = torch.einsum("bnmf,bmf...->bnf...", w, p)
    tail = (1,) * (init.dim() - 2)
    c_init, c_parts = (x.exp_().to(dt).view(*x.shape, *tail) for x in (c_init, c_parts))
    per += c_init * init[:, None]
    total = (c_parts * p).sum(1) + torch.exp(last[:, 0]).to(dt).view(bh, -1, *tail) * init
    return per.reshape(parts.shape), total


def _decay_steps(init: torch.Tensor, parts: torch.Tensor, lam: torch.Tensor, reverse: bool):
    """`decay_scan`'s recurrence one chunk at a time; lam (BH, nc, 1 or F)."""
    bh, nc, dt = init.shape[0], lam.shape[1], init.dtype
    p = parts.reshape(bh, nc, *init.shape[1:]).to(dt)
    decay = lam.exp().to(dt).view(bh, nc, -1, *(1,) * (init.dim() - 2))
    per = torch.empty_like(p)
    state = init
    for n in (reversed(range(nc)) if reverse else range(nc)):
        per[:, n] = state
        state = decay[:, n] * state + p[:, n]
    return per.reshape(parts.shape), state


class ChunkTerms(NamedTuple):
    """What one segment's chunks need beyond their features (X = BH·nc chunks of c rows)."""

    A: torch.Tensor  # (X, c, c) decayed masked scores
    D: torch.Tensor | None  # (X, c, c) scalar gates: e^{β_i − β_j} below the diagonal, 0 above
    Qe: torch.Tensor  # Q ⊙ e^{β}
    Kw: torch.Tensor  # K ⊙ e^{λ − β}
    Qc: torch.Tensor | None  # vector gates: Q ⊙ e^{β − λ}
    eb: torch.Tensor  # e^{β} (X, c, 1 or F)
    w: torch.Tensor  # e^{λ − β}
    wq: torch.Tensor | None  # vector gates: e^{β − λ}
    lam: torch.Tensor  # λ (X, 1) or (X, 1, F), float64


def chunk_terms(Q: torch.Tensor, K: torch.Tensor, gs: torch.Tensor, exact: bool = False) -> ChunkTerms:
    """Q, K (X, c, F) features in the compute dtype; gs (X, c) or (X, c, F) log-decays in float64.
    exact: A's upper triangle is 0 by selection also where Q Kᵀ is not finite there."""
    cdt = Q.dtype
    beta = gs.cumsum(1)
    lam = beta[:, -1:]
    vector = gs.dim() == 3
    if not vector:
        beta, lam3 = beta[..., None], lam[..., None]
    else:
        lam3 = lam
    eb = beta.exp().to(cdt)
    w = (lam3 - beta).exp_().to(cdt)
    Qe, Kw = Q * eb, K * w
    if vector:
        wq = (beta - lam3).exp_().to(cdt)
        Qc = Q * wq
        return ChunkTerms(torch.bmm(Qc, Kw.mT).tril_(), None, Qe, Kw, Qc, eb, w, wq, lam)
    c = Q.shape[1]
    diff = beta - beta.mT  # (X, c, c): β_i − β_j
    D = diff.masked_fill_(_strict_lower_mask(c, Q.device).mT, float("-inf")).exp_().to(cdt)
    A = torch.bmm(Q, K.mT).mul_(D)
    return ChunkTerms(A.tril_() if exact else A, D, Qe, Kw, None, eb, w, None, lam)


#: Why the backward of vector gates multiplies bf16 inputs in fp32 (here and in the fused kernels):
#: the gated features Q ⊙ e^{β−λ}, K ⊙ e^{λ−β} are not bf16 numbers, and rounding them to bf16
#: operands left the gate gradient, a sum of q·dq − k·dk that cancels, at 4–7× bf16 rounding (relative
#: norm 0.016 against 0.0024; issue 37 item 17). Scalar gates multiply the inputs themselves.
BF16_VECTOR_BACKWARD = torch.float32


def _gates(g: torch.Tensor, s: int, t: int, c: int) -> torch.Tensor:
    """The log-decays of tokens [s, t), clamped at GATE_FLOOR, as (BH·(t−s)/c, c[, F]) float64."""
    gs = g[:, :, s:t].to(torch.float64).clamp_min(GATE_FLOOR)
    return gs.reshape(-1, c, *gs.shape[3:])


class ChunkedGatedLinearAttention(torch.autograd.Function):
    """apply(featurize, chunk, normalize, eps, exact, q, k, v, g, kv0, z0, *params) -> (o, kv[, z]).

    g (B, H, N) or (B, H, N, F) ≤ 0; z0 None unless normalize; (kv, z) float32 (float64 for float64).
    exact=False is the fast pass; exact=True the exact pass for inputs where a NaN or Inf reached the
    final state (the module doc; `gated_linear_attention` checks and reruns). The backward of a fast
    pass reruns exact when the initial state's gradient comes out non-finite."""

    @staticmethod
    def forward(ctx, featurize: Featurizer, chunk: int, normalize: bool, eps: float, exact: bool, q, k, v, g, kv0, z0,
                *params):
        b, h, n, _ = q.shape
        e = v.shape[-1]
        bh, feat = b * h, kv0.shape[2]
        vector = g.dim() == 4
        cdt, sdt = compute_dtype(q.dtype, q.device), state_dtype(q.dtype)
        S = kv0.to(sdt).reshape(bh, feat, e)
        z = z0.to(sdt).reshape(bh, feat) if normalize else None
        o = torch.empty(b, h, n, e, dtype=q.dtype, device=q.device)
        segments, dens, S_in, z_in = [], [], [], []
        mm = Products(exact)
        with torch.no_grad():
            for s0, t0, c0 in gated_blocks(n, chunk, bh, feat, e, vector):
                gv = g[:, :, s0:t0].to(torch.float64).reshape(bh, t0 - s0, feat) if vector else None
                for s, t, c in split_block(gv, s0, t0, c0):
                    segments.append((s, t, c))
                    S_in.append(S)
                    z_in.append(z)
                    Q = chunk_view(featurize(q[:, :, s:t], s, t, True)[0], c, cdt)
                    K = chunk_view(featurize(k[:, :, s:t], s, t, False)[0], c, cdt)
                    V = chunk_view(v[:, :, s:t], c, cdt)
                    terms = chunk_terms(Q, K, _gates(g, s, t, c), exact)
                    S_before, S = decay_scan(S, mm.mm(terms.Kw.mT, V), terms.lam, exact=exact)
                    o_blk = o[:, :, s:t]
                    U = block_target(o_blk, c, cdt)
                    mm.addmm_(torch.bmm(terms.Qe, S_before.to(cdt), out=U), terms.A, V)
                    if normalize:
                        z_before, z = decay_scan(z, terms.Kw.sum(1, dtype=sdt), terms.lam, exact=exact)
                        den = terms.A.sum(-1, keepdim=True, dtype=sdt)
                        den += torch.bmm(terms.Qe.to(sdt), z_before.unsqueeze(-1)).add_(eps)
                        dens.append(den)
                    store_block(o_blk, U, den if normalize else None)
        kv = S.reshape(b, h, feat, e)
        z_out = z.reshape(b, h, feat) if normalize else None
        ctx.featurize, ctx.normalize, ctx.segments, ctx.exact = featurize, normalize, segments, exact
        ctx.state_dtypes = (kv0.dtype, None if z0 is None else z0.dtype)
        ctx.n_seg = len(segments)
        ctx.save_for_backward(q, k, v, g, o, *dens, *S_in, *(z_in if normalize else ()), *params)
        ctx.set_materialize_grads(False)
        return (o, kv, z_out) if normalize else (o, kv)

    @staticmethod
    @first_order("gated_linear_attention")
    def backward(ctx, do, dkv, dz=None):
        saved = ctx.saved_tensors  # unpacked once (activation checkpointing allows no more)
        grads, R, r = _backward(ctx, saved, do, dkv, dz, ctx.exact)
        if not ctx.exact and not all_finite(R, *(() if r is None else (r,))):  # a NaN or Inf: the exact pass
            grads, R, r = _backward(ctx, saved, do, dkv, dz, True)
        dq, dk, dv, dg, dparams = grads
        b, h, _, _ = saved[0].shape
        dkv0 = R.reshape(b, h, *R.shape[1:]).to(ctx.state_dtypes[0])
        dz0 = r.reshape(b, h, -1).to(ctx.state_dtypes[1]) if r is not None else None
        return (None, None, None, None, None, dq, dk, dv, dg, dkv0, dz0, *dparams)


class _Outputs(NamedTuple):
    """Where the backward writes the gradients of q, k (None when not wanted), v and g (float64,
    (BH, N, 1 or F)), and φ's parameters (added to)."""

    dq: torch.Tensor | None
    dk: torch.Tensor | None
    dv: torch.Tensor
    dg: torch.Tensor
    dparams: list


def _backward(ctx, saved, do, dkv, dz, exact: bool):
    """The backward pass (fast or exact) of ChunkedGatedLinearAttention from its saved tensors: returns
    ((dq, dk, dv, dg, [d of each parameter]), R (BH, F, E), r (BH, F) or None), R, r the gradients of the
    initial state."""
    q, k, v, g, o, *rest = saved
    ns, normalize = ctx.n_seg, ctx.normalize
    nd = ns if normalize else 0
    dens, S_in = rest[:nd], rest[nd:nd + ns]
    z_in = rest[nd + ns:nd + 2 * ns] if normalize else (None,) * ns
    params = rest[nd + 2 * ns:] if normalize else rest[nd + ns:]
    b, h, n, _ = q.shape
    e, feat = v.shape[-1], S_in[0].shape[-2]
    bh, sdt = b * h, state_dtype(q.dtype)
    R = torch.zeros(bh, feat, e, dtype=sdt, device=q.device) if dkv is None else dkv.to(sdt).reshape(bh, feat, e)
    r = None
    if normalize:
        r = torch.zeros(bh, feat, dtype=sdt, device=q.device) if dz is None else dz.to(sdt).reshape(bh, feat)
    want_q, want_k = ctx.needs_input_grad[5], ctx.needs_input_grad[6]
    out = _Outputs(torch.empty_like(q) if want_q else None, torch.empty_like(k) if want_k else None,
                   torch.empty_like(v), torch.empty(g.shape, dtype=torch.float64, device=g.device).view(bh, n, -1),
                   [torch.zeros_like(p) for p in params])
    for i in reversed(range(ns)):
        s, t = ctx.segments[i][:2]
        den = dens[i] if normalize else None
        do_blk = do[:, :, s:t] if do is not None else torch.zeros(b, h, t - s, e, dtype=q.dtype, device=q.device)
        R, r = _segment_backward(ctx, ctx.segments[i], (q, k, v, g, o), do_blk, den, S_in[i], z_in[i], R, r, params,
                                 out, exact)
    dg = out.dg.view(g.shape).to(g.dtype)
    return (out.dq, out.dk, out.dv, dg, out.dparams), R, r


def _segment_backward(ctx, segment, inputs, do_blk, den, S0, z0, R, r, params, out: _Outputs, exact: bool):
    """One segment's share of the backward (the module doc's formulas), written into `out`; R, r the
    gradients flowing into the state after the segment, returned as those entering it."""
    s, t, c = segment
    q, k, v, g, o = inputs
    featurize, normalize = ctx.featurize, ctx.normalize
    b, h, m, e = do_blk.shape
    bh, feat, vector = b * h, S0.shape[-2], g.dim() == 4
    cdt, sdt = compute_dtype(q.dtype, q.device), state_dtype(q.dtype)
    if vector and cdt == torch.bfloat16:
        cdt = BF16_VECTOR_BACKWARD
    mm = Products(exact)
    local = featurize.local_grad
    with torch.enable_grad():
        qb = q[:, :, s:t].detach().requires_grad_(out.dq is not None and not local)
        kb = k[:, :, s:t].detach().requires_grad_(out.dk is not None and not local)
        feats = (*featurize(qb, s, t, True), *featurize(kb, s, t, False))
    Q, K = (chunk_view(f.detach(), c, cdt) for f in (feats[0], feats[2]))
    V = chunk_view(v[:, :, s:t], c, cdt)
    tm = chunk_terms(Q, K, _gates(g, s, t, c), exact)
    S_before, S_after = decay_scan(S0, mm.mm(tm.Kw.mT, V), tm.lam, exact=exact)
    gam = None
    if normalize:
        G, gam = output_grads(do_blk, o[:, :, s:t], den.view(b, h, m, 1), c, cdt, sdt, exact)
        z_before, z_after = decay_scan(z0, tm.Kw.sum(1, dtype=sdt), tm.lam, exact=exact)
    else:
        G = chunk_view(do_blk, c, cdt)
    R_after, R = decay_scan(R, mm.mm(tm.Qe.mT, G), tm.lam, reverse=True, exact=exact)
    # each chunk's final-state term of the identity: Σ_e S_out ⊙ R_out (+ z_out ⊙ r_out)
    S_out = torch.cat([S_before.view(bh, -1, feat, e)[:, 1:], S_after[:, None]], 1).view(S_before.shape)
    ends = mm.mul(S_out.double(), R_after).sum(-1)  # (X, F)
    R_after = R_after.to(cdt)
    # ∂V = Aᵀ G + (K ⊙ e^{λ−β}) R
    dV = block_target(out.dv[:, :, s:t], c, cdt)
    mm.addmm_(mm.mm(tm.A.mT, G, out=dV), tm.Kw, R_after)
    store_block(out.dv[:, :, s:t], dV)
    P = mm.mm(G, V.mT)
    inter_q = mm.mm(G, S_before.to(cdt).mT)  # G Sᵀ (+ γ zᵀ)
    inter_k = mm.mm(V, R_after.mT)  # V Rᵀ (+ 1 rᵀ)
    if normalize:
        r_after, r = decay_scan(r, mm.mm(tm.Qe.mT.to(sdt), gam).squeeze(-1), tm.lam, reverse=True, exact=exact)
        P += gam.to(cdt)
        mm.addmm_(inter_q, gam.to(cdt), z_before.to(cdt).unsqueeze(1))
        inter_k += r_after.to(cdt).unsqueeze(1)
        z_out = torch.cat([z_before.view(bh, -1, feat)[:, 1:], z_after[:, None]], 1).view(z_before.shape)
        ends += mm.mul(z_out.double(), r_after)
    if vector:
        P.tril_()
        dQ = mm.mm(P, tm.Kw).mul_(tm.wq).addcmul_(inter_q, tm.eb)
        dK = mm.mm(P.mT, tm.Qc).add_(inter_k).mul_(tm.w)
    else:
        P.mul_(tm.D)
        if exact:
            P.tril_()
        dQ = mm.mm(P, K).addcmul_(inter_q, tm.eb)
        dK = mm.mm(P.mT, Q).addcmul_(inter_k, tm.w)
    del P, inter_q, inter_k
    if exact and featurize.key_padding_mask is not None:
        # a masked key's features are the constant 0: their gradient is 0 (a NaN v there made it NaN)
        dK.masked_fill_(~featurize.key_padding_mask[:, None, s:t].expand(b, h, m).reshape(-1, c, 1), 0)
    # ∂L/∂B = q ⊙ ∂q − k ⊙ ∂k per token, summed over t ≥ s inside the chunk, plus the chunk's end
    dB = mm.mul(Q.double(), dQ).sub_(mm.mul(K.double(), dK))  # Q, K may be views of q, k
    if not vector:
        dB, ends = dB.sum(-1, keepdim=True), ends.sum(-1, keepdim=True)
    dg = dB.flip(1).cumsum_(1).flip(1).add_(ends[:, None]).view(bh, m, -1)
    out.dg[:, s:t] = dg.masked_fill_(g[:, :, s:t].reshape(bh, m, -1) < GATE_FLOOR, 0)  # clamped: 0
    chain_feature_grads(featurize, (b, h, s, t), None if local else (qb, kb), (Q, K) if local else feats,
                        (dQ, None, dK, None), (out.dq, out.dk), params, out.dparams, exact)
    return R, r
