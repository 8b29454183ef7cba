"""Causal linear attention, chunked, with an explicit memory-efficient backward (DESIGN §3).

Per (batch, head), features Q̃ = φ(Q) (N×F), K̃ = φ(K) (N×F), values V (N×E), chunks of C rows,
M the C×C lower-triangular mask (diagonal included), S_n the state before chunk n:

    U_n = Q̃_n S_n + (M ⊙ Q̃_n K̃_nᵀ) V_n,        S_{n+1} = S_n + K̃_nᵀ V_n

This "scan" is the only kernel. Appending a column of ones to V makes the denominator the last
column of U and z the last column of S, so normalized attention is one scan over [V, 1] with the
state [kv, z] (F×(E+1)); the matmuls cost the same at E+1 columns. With RoPE the numerator uses
rotated features and the denominator plain ones (DESIGN §6): two scans, (Q̃ᵣ, K̃ᵣ, V, kv) and
(Q̃, K̃, 1, z). O = U / (d + ε), or O = U with normalize=False.

The sequence is walked in *blocks* of many chunks: inside a block every chunk product is one
batched matmul and the chunk states are a prefix sum (a triangular matmul); between blocks only the
state is carried. Temporaries are bounded by the block, not by N, and features are recomputed block
by block in the backward, so nothing of size N·F·E, and no N-sized feature tensor, is kept.
Saved for backward: q, k, v, the output, the denominators (N floats) and one state per block.

Backward of a scan, with G = ∂L/∂U, P = M ⊙ (G Vᵀ) and R_n the gradient flowing into the state
after chunk n (a reverse prefix sum of Q̃_mᵀ G_m, m > n, plus the final-state gradient):

    ∂Q̃_n = G_n S_nᵀ + P K̃_n,    ∂K̃_n = V_n R_nᵀ + Pᵀ Q̃_n,    ∂V_n = K̃_n R_n + (M ⊙ Q̃_n K̃_nᵀ)ᵀ G_n,
    ∂S_init = R_{−1}.

Normalization enters through G = [∂L/∂O / (d+ε), −Σ_e (∂L/∂O ⊙ O) / (d+ε)] on the [V, 1] columns.
The feature gradients are chained to q, k (and φ's parameters) with autograd on the recomputed
block features.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._features import Featurizer

#: Target number of elements of one block temporary of shape (B·H, tokens, max(F, E, C)).
BLOCK_ELEMENTS = 1 << 19


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Matmul dtype: bf16 stays bf16 (fast on AMX / tensor cores), fp16 is upcast to fp32 because
    its range cannot hold states that grow like N; fp64 stays fp64 (used by the tests)."""
    if dtype in (torch.bfloat16, torch.float64):
        return dtype
    return torch.float32


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """States and normalizers accumulate in float32 (float64 for float64 inputs)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def block_tokens(bh: int, width: int, chunk: int) -> int:
    """Tokens per block: a multiple of the chunk size with about BLOCK_ELEMENTS per temporary."""
    per = max(chunk, (BLOCK_ELEMENTS // max(1, bh * width)) // chunk * chunk)
    return per


def _pack(parts, chunk: int, dtype: torch.dtype, n: int) -> torch.Tensor:
    """Stacks (B, H, n, w_i) tensors (or a float, for a constant column) along the last dim into
    (B·H·nc, C, Σw_i) chunks in `dtype`, zero-padding the tail rows. Contiguous, one copy."""
    first = next(p for p in parts if isinstance(p, torch.Tensor))
    b, h = first.shape[:2]
    widths = [1 if not isinstance(p, torch.Tensor) else p.shape[-1] for p in parts]
    pad = (-n) % chunk
    if len(parts) == 1 and not pad and first.dtype == dtype and first.is_contiguous():
        return first.view(-1, chunk, widths[0])
    out = torch.empty(b, h, n + pad, sum(widths), dtype=dtype, device=first.device)
    col = 0
    for p, w in zip(parts, widths):
        out[:, :, :n, col:col + w] = p
        col += w
    if pad:
        out[:, :, n:] = 0
    return out.view(-1, chunk, out.shape[-1])


def _unchunk(x: torch.Tensor, b: int, h: int, n: int) -> torch.Tensor:
    """(B·H·nc, C, D) -> (B, H, n, D) view (drops padding)."""
    return x.view(b, h, -1, x.shape[-1])[:, :, :n]


def _strict_triangle(n: int, upper: bool, like: torch.Tensor) -> torch.Tensor:
    """(n, n) strictly lower (or upper) triangular matrix of ones."""
    ones = torch.ones(n, n, dtype=like.dtype, device=like.device)
    return ones.triu(1) if upper else ones.tril(-1)


def _exclusive_prefix(init: torch.Tensor, parts: torch.Tensor):
    """init (BH, *s), parts (BH, nc, *s) -> (before (BH, nc, *s), total (BH, *s)).

    before[:, n] = init + Σ_{m<n} parts[:, m], computed in init's dtype as one matmul with a strictly
    lower-triangular matrix (a strided cumsum over the chunk axis is several times slower on CPU).
    """
    bh, nc = parts.shape[:2]
    flat = parts.reshape(bh, nc, -1).to(init.dtype)
    before = torch.matmul(_strict_triangle(nc, False, flat), flat)
    before += init.reshape(bh, 1, -1)
    total = before[:, -1] + flat[:, -1]
    return before.view(parts.shape), total.view(init.shape)


def _reverse_exclusive_prefix(after: torch.Tensor, parts: torch.Tensor):
    """after (BH, *s), parts (BH, nc, *s) -> (after_n (BH, nc, *s), before (BH, *s)).

    after_n[:, n] = after + Σ_{m>n} parts[:, m]; before = after + Σ_m parts[:, m].
    """
    bh, nc = parts.shape[:2]
    flat = parts.reshape(bh, nc, -1).to(after.dtype)
    after_n = torch.matmul(_strict_triangle(nc, True, flat), flat)
    after_n += after.reshape(bh, 1, -1)
    before = after_n[:, 0] + flat[:, 0]
    return after_n.view(parts.shape), before.view(after.shape)


def _scan_forward(Q, K, V, S):
    """Q, K: (BH·nc, C, F), V: (BH·nc, C, W) chunks; S: (BH, F, W) state before the block.

    Returns U (BH·nc, C, W) and the state after the block (S's dtype)."""
    bh = S.shape[0]
    nc = Q.shape[0] // bh
    feat, w = S.shape[1:]
    Kt = K.transpose(1, 2)
    S_before, S_after = _exclusive_prefix(S, torch.bmm(Kt, V).view(bh, nc, feat, w))
    A = torch.bmm(Q, Kt).tril_()
    U = torch.bmm(A, V).baddbmm_(Q, S_before.view(-1, feat, w).to(Q.dtype))
    return U, S_after


def _scan_backward(Q, K, V, S, G, R, need_dv: bool = True):
    """Gradients of `_scan_forward` for one block: G = ∂L/∂U (BH·nc, C, W), R = ∂L/∂(state after
    the block) (BH, F, W). Returns (∂Q, ∂K, ∂V or None, ∂(state before the block))."""
    bh = S.shape[0]
    nc = Q.shape[0] // bh
    feat, w = S.shape[1:]
    Kt = K.transpose(1, 2)
    S_before, _ = _exclusive_prefix(S, torch.bmm(Kt, V).view(bh, nc, feat, w))
    R_after, R_before = _reverse_exclusive_prefix(R, torch.bmm(Q.transpose(1, 2), G).view(bh, nc, feat, w))
    R_after = R_after.view(-1, feat, w).to(Q.dtype)
    P = torch.bmm(G, V.transpose(1, 2)).tril_()
    dQ = torch.bmm(P, K).baddbmm_(G, S_before.view(-1, feat, w).to(Q.dtype).transpose(1, 2))
    dK = torch.bmm(P.transpose(1, 2), Q).baddbmm_(V, R_after.transpose(1, 2))
    dV = None
    if need_dv:
        A = torch.bmm(Q, Kt).tril_()
        dV = torch.bmm(A.transpose(1, 2), G).baddbmm_(K, R_after)
    return dQ, dK, dV, R_before


class ChunkedCausalLinearAttention(torch.autograd.Function):
    """apply(featurize, chunk, normalize, eps, q, k, v, kv0, z0, *params) -> (o, kv, z).

    States inside are "streams" of shape (B·H, F, W): one stream [kv, z] (W = E+1) when numerator
    and denominator share features, two streams kv (W = E) and z (W = 1) with RoPE.
    """

    @staticmethod
    def forward(ctx, featurize: Featurizer, chunk: int, normalize: bool, eps: float, q, k, v, kv0, z0, *params):
        b, h, n, _ = q.shape
        e = v.shape[-1]
        bh, feat = b * h, kv0.shape[2]
        cdt, sdt = compute_dtype(q.dtype), state_dtype(q.dtype)
        shared = featurize.rope is None
        if shared:
            streams = [torch.cat((kv0.to(sdt), z0.to(sdt).unsqueeze(-1)), -1).reshape(bh, feat, e + 1)]
        else:
            streams = [kv0.to(sdt).reshape(bh, feat, e), z0.to(sdt).reshape(bh, feat, 1)]
        L = block_tokens(bh, max(feat, e, chunk), chunk)
        starts = list(range(0, n, L))
        o = torch.empty(b, h, n, e, dtype=q.dtype, device=q.device)
        den_all = torch.empty(b, h, n, dtype=sdt, device=q.device) if normalize else None
        saved_streams = [[] for _ in streams]
        with torch.no_grad():
            for s in starts:
                t = min(s + L, n)
                for keep, st in zip(saved_streams, streams):
                    keep.append(st)
                qr, qd = featurize(q[:, :, s:t], s, t, True)
                kr, kd = featurize(k[:, :, s:t], s, t, False)
                Qr, Kr = _pack([qr], chunk, cdt, t - s), _pack([kr], chunk, cdt, t - s)
                if shared:
                    U, S1 = _scan_forward(Qr, Kr, _pack([v[:, :, s:t], 1.0], chunk, cdt, t - s), streams[0])
                    streams = [S1]
                    num, den = _unchunk(U, b, h, t - s).split([e, 1], -1)
                else:
                    U, S = _scan_forward(Qr, Kr, _pack([v[:, :, s:t]], chunk, cdt, t - s), streams[0])
                    Qd, Kd = _pack([qd], chunk, cdt, t - s), _pack([kd], chunk, cdt, t - s)
                    Ud, z = _scan_forward(Qd, Kd, torch.ones(Kd.shape[0], chunk, 1, dtype=cdt, device=q.device), streams[1])
                    streams = [S, z]
                    num, den = _unchunk(U, b, h, t - s), _unchunk(Ud, b, h, t - s)
                if normalize:
                    den = den.to(sdt)
                    den_all[:, :, s:t] = den[..., 0]
                    torch.div(num, den + eps, out=o[:, :, s:t])
                else:
                    o[:, :, s:t] = num
        ctx.featurize, ctx.chunk, ctx.normalize, ctx.eps = featurize, chunk, normalize, eps
        ctx.starts, ctx.L, ctx.kv0_dtype, ctx.z0_dtype = starts, L, kv0.dtype, z0.dtype
        ctx.save_for_backward(q, k, v, o, den_all, *[torch.stack(x) for x in saved_streams], *params)
        ctx.n_streams = len(streams)
        if shared:
            kv, z = streams[0].split([e, 1], -1)
        else:
            kv, z = streams
        return o, kv.reshape(b, h, feat, e), z.reshape(b, h, feat)

    @staticmethod
    def backward(ctx, do, dkv, dz):
        q, k, v, o, den_all, *rest = ctx.saved_tensors
        block_streams, params = rest[:ctx.n_streams], rest[ctx.n_streams:]
        featurize, chunk, normalize, eps = ctx.featurize, ctx.chunk, ctx.normalize, ctx.eps
        b, h, n, _ = q.shape
        e = v.shape[-1]
        bh, feat = b * h, block_streams[0].shape[-2]
        cdt, sdt = compute_dtype(q.dtype), state_dtype(q.dtype)
        shared = len(block_streams) == 1
        dkv = torch.zeros(b, h, feat, e, dtype=sdt, device=q.device) if dkv is None else dkv.to(sdt)
        dz = torch.zeros(b, h, feat, dtype=sdt, device=q.device) if dz is None else dz.to(sdt)
        if shared:
            R = [torch.cat((dkv, dz.unsqueeze(-1)), -1).reshape(bh, feat, e + 1)]
        else:
            R = [dkv.reshape(bh, feat, e).clone(), dz.reshape(bh, feat, 1).clone()]
        if do is None:
            do = torch.zeros_like(o)
        want_q, want_k = ctx.needs_input_grad[4], ctx.needs_input_grad[5]
        dq = torch.empty_like(q) if want_q else None
        dk = torch.empty_like(k) if want_k else None
        dv = torch.empty_like(v)
        dparams = [torch.zeros_like(p) for p in params]
        for i in reversed(range(len(ctx.starts))):
            s = ctx.starts[i]
            t = min(s + ctx.L, n)
            m = t - s
            with torch.enable_grad():
                qb = q[:, :, s:t].detach().requires_grad_(want_q)
                kb = k[:, :, s:t].detach().requires_grad_(want_k)
                qr, qd = featurize(qb, s, t, True)
                kr, kd = featurize(kb, s, t, False)
            G = do[:, :, s:t]
            if normalize:
                inv = 1.0 / (den_all[:, :, s:t] + eps)
                g = (-(G.to(sdt) * o[:, :, s:t].to(sdt)).sum(-1) * inv).unsqueeze(-1)
                G = G * inv.unsqueeze(-1).to(G.dtype)
            else:
                g = 0.0
            Qr, Kr = _pack([qr.detach()], chunk, cdt, m), _pack([kr.detach()], chunk, cdt, m)
            if shared:
                dQr, dKr, dV, R0 = _scan_backward(Qr, Kr, _pack([v[:, :, s:t], 1.0], chunk, cdt, m),
                                                  block_streams[0][i], _pack([G, g], chunk, cdt, m), R[0])
                R = [R0]
                feats, grads = [qr, kr], [dQr, dKr]
                dv[:, :, s:t] = _unchunk(dV, b, h, m)[..., :e]
            else:
                dQr, dKr, dV, R0 = _scan_backward(Qr, Kr, _pack([v[:, :, s:t]], chunk, cdt, m),
                                                  block_streams[0][i], _pack([G], chunk, cdt, m), R[0])
                Qd, Kd = _pack([qd.detach()], chunk, cdt, m), _pack([kd.detach()], chunk, cdt, m)
                gz = _pack([g], chunk, cdt, m) if normalize else torch.zeros(Qd.shape[0], chunk, 1, dtype=cdt, device=q.device)
                ones = torch.ones(Kd.shape[0], chunk, 1, dtype=cdt, device=q.device)
                dQd, dKd, _, R1 = _scan_backward(Qd, Kd, ones, block_streams[1][i], gz, R[1], need_dv=False)
                R = [R0, R1]
                feats, grads = [qr, kr, qd, kd], [dQr, dKr, dQd, dKd]
                dv[:, :, s:t] = _unchunk(dV, b, h, m)
            want = [x for x in (qb, kb) if x.requires_grad] + list(params)
            pairs = [(f, _unchunk(gr, b, h, m)) for f, gr in zip(feats, grads) if f.requires_grad]
            if not want or not pairs:
                for x, dst in ((qb, dq), (kb, dk)):
                    if x.requires_grad:
                        dst[:, :, s:t] = 0
                continue
            res = iter(torch.autograd.grad([p[0] for p in pairs], want, [p[1] for p in pairs], allow_unused=True))
            for x, dst in ((qb, dq), (kb, dk)):
                if x.requires_grad:
                    gx = next(res)
                    dst[:, :, s:t] = 0 if gx is None else gx
            for j in range(len(params)):
                gp = next(res)
                if gp is not None:
                    dparams[j] += gp
        if shared:
            dkv0, dz0 = R[0].split([e, 1], -1)
        else:
            dkv0, dz0 = R
        return (None, None, None, None, dq, dk, dv, dkv0.reshape(b, h, feat, e).to(ctx.kv0_dtype),
                dz0.reshape(b, h, feat).to(ctx.z0_dtype), *dparams)
