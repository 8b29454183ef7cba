"""Causal linear attention, chunked, with an explicit memory-efficient backward (DESIGN §3).

Per (batch, head), features Q̃ = φ(Q) (N×F), K̃ = φ(K) (N×F), values V (N×E), chunks of C rows,
M the C×C lower-triangular mask (diagonal included), S_n / z_n the state before chunk n:

    U_n = Q̃_n S_n + (M ⊙ Q̃_n K̃_nᵀ) V_n          numerator    (C×E)
    d_n = Q̃_n z_n + (M ⊙ Q̃_n K̃_nᵀ) 1            denominator  (C)
    O_n = U_n / (d_n + ε)                          (or O_n = U_n when normalize=False)

With RoPE the numerator uses rotated features and the denominator plain ones (DESIGN §6).

The sequence is walked in *blocks* of many chunks: inside a block every chunk product is one
batched matmul and the chunk states are a prefix sum; between blocks only the state (F×E + F) is
carried. Temporaries are therefore bounded by the block, not by N, and features are recomputed
block by block in the backward, so nothing of size N·F·E, and no N-sized feature tensor, is kept.
Saved for backward: q, k, v, the output, the denominators (N floats) and one state per block.

Backward, with G = ∂L/∂U, g = ∂L/∂d, P = M ⊙ (G Vᵀ + g 1ᵀ) and R_n, r_n the gradients flowing into
the state after chunk n (a reverse prefix sum of Q̃_mᵀ G_m, Q̃_mᵀ g_m plus the final-state gradient):

    ∂Q̃_n = G_n S_nᵀ + g_n z_nᵀ + P K̃_n
    ∂K̃_n = V_n R_nᵀ + 1 r_nᵀ + Pᵀ Q̃_n
    ∂V_n = K̃_n R_n + (M ⊙ Q̃_n K̃_nᵀ)ᵀ G_n
    ∂S_init = R_{−1},  ∂z_init = r_{−1}

and the feature gradients are chained to q, k (and φ's parameters) with autograd on the recomputed
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


def _chunks(x: torch.Tensor, chunk: int, dtype: torch.dtype) -> torch.Tensor:
    """(B, H, n, D) -> (B·H·nc, C, D), zero-padding the tail; contiguous, in `dtype`."""
    b, h, n, d = x.shape
    pad = (-n) % chunk
    x = x.to(dtype)
    if pad:
        x = F.pad(x, (0, 0, 0, pad))
    return x.reshape(b * h * ((n + pad) // chunk), chunk, d)


def _unchunk(x: torch.Tensor, b: int, h: int, n: int) -> torch.Tensor:
    """(B·H·nc, C, D) -> (B, H, n, D) view (drops padding)."""
    return x.reshape(b, h, -1, x.shape[-1])[:, :, :n]


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


class ChunkedCausalLinearAttention(torch.autograd.Function):
    """apply(featurize, chunk, normalize, eps, q, k, v, kv0, z0, *params) -> (o, kv, z)."""

    @staticmethod
    def forward(ctx, featurize: Featurizer, chunk: int, normalize: bool, eps: float, q, k, v, kv0, z0, *params):
        b, h, n, _ = q.shape
        e = v.shape[-1]
        cdt, sdt = compute_dtype(q.dtype), state_dtype(q.dtype)
        bh = b * h
        o = torch.empty(b, h, n, e, dtype=q.dtype, device=q.device)
        den_all = torch.empty(b, h, n, dtype=sdt, device=q.device) if normalize else None
        S = kv0.to(sdt).reshape(bh, *kv0.shape[2:])
        z = z0.to(sdt).reshape(bh, z0.shape[-1])
        feat = S.shape[1]
        L = block_tokens(bh, max(feat, e, chunk), chunk)
        starts = list(range(0, n, L))
        block_S, block_z = [], []
        with torch.no_grad():
            for s in starts:
                t = min(s + L, n)
                block_S.append(S)
                block_z.append(z)
                qr, qd = featurize(q[:, :, s:t], s, t, True)
                kr, kd = featurize(k[:, :, s:t], s, t, False)
                U, den, S, z = _block_forward(qr, kr, v[:, :, s:t], qd, kd, S, z, chunk, cdt, normalize)
                Uv = _unchunk(U, b, h, t - s)
                if normalize:
                    denv = _unchunk(den, b, h, t - s)
                    den_all[:, :, s:t] = denv[..., 0]
                    torch.div(Uv, denv + eps, out=o[:, :, s:t])
                else:
                    o[:, :, s:t] = Uv
        ctx.featurize, ctx.chunk, ctx.normalize, ctx.eps = featurize, chunk, normalize, eps
        ctx.starts, ctx.L, ctx.kv0_dtype, ctx.z0_dtype = starts, L, kv0.dtype, z0.dtype
        ctx.n_params = len(params)
        ctx.save_for_backward(q, k, v, o, den_all, torch.stack(block_S), torch.stack(block_z), *params)
        return o, S.reshape(b, h, feat, e), z.reshape(b, h, feat)

    @staticmethod
    def backward(ctx, do, dkv, dz):
        q, k, v, o, den_all, block_S, block_z, *params = ctx.saved_tensors
        featurize, chunk, normalize, eps = ctx.featurize, ctx.chunk, ctx.normalize, ctx.eps
        b, h, n, _ = q.shape
        e = v.shape[-1]
        bh = b * h
        feat = block_S.shape[-2]
        cdt, sdt = compute_dtype(q.dtype), state_dtype(q.dtype)
        R = torch.zeros(bh, feat, e, dtype=sdt, device=q.device) if dkv is None else dkv.to(sdt).reshape(bh, feat, e).clone()
        r = torch.zeros(bh, feat, dtype=sdt, device=q.device) if dz is None else dz.to(sdt).reshape(bh, feat).clone()
        if do is None:
            do = torch.zeros_like(o)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        dparams = [torch.zeros_like(p) for p in params]
        for i in reversed(range(len(ctx.starts))):
            s = ctx.starts[i]
            t = min(s + ctx.L, n)
            with torch.enable_grad():
                qb = q[:, :, s:t].detach().requires_grad_(ctx.needs_input_grad[4])
                kb = k[:, :, s:t].detach().requires_grad_(ctx.needs_input_grad[5])
                qr, qd = featurize(qb, s, t, True)
                kr, kd = featurize(kb, s, t, False)
            G = do[:, :, s:t]
            g = None
            if normalize:
                inv = 1.0 / (den_all[:, :, s:t] + eps)
                g = -(do[:, :, s:t].to(sdt) * o[:, :, s:t].to(sdt)).sum(-1) * inv
                G = G * inv[..., None].to(G.dtype)
            grads, R, r, dvb = _block_backward(
                qr.detach(), kr.detach(), v[:, :, s:t], None if qd is None else qd.detach(),
                None if kd is None else kd.detach(), block_S[i], block_z[i], G, g, R, r, chunk, cdt,
            )
            dv[:, :, s:t] = dvb
            outs = [qr, kr] if qd is None else [qr, kr, qd, kd]
            want = [x for x in (qb, kb) if x.requires_grad] + list(params)
            if not want:
                continue
            pairs = [(t_, g_) for t_, g_ in zip(outs, grads) if t_.requires_grad]
            if pairs:
                res = torch.autograd.grad([p[0] for p in pairs], want, [p[1] for p in pairs], allow_unused=True)
            else:
                res = [None] * len(want)
            it = iter(res)
            for x, dst in ((qb, dq), (kb, dk)):
                if x.requires_grad:
                    gx = next(it)
                    dst[:, :, s:t] = 0 if gx is None else gx
            for j in range(len(params)):
                gp = next(it)
                if gp is not None:
                    dparams[j] += gp
        dkv0 = R.reshape(b, h, feat, e).to(ctx.kv0_dtype)
        dz0 = r.reshape(b, h, feat).to(ctx.z0_dtype)
        return (None, None, None, None, dq if ctx.needs_input_grad[4] else None,
                dk if ctx.needs_input_grad[5] else None, dv, dkv0, dz0, *dparams)


def _block_forward(qr, kr, v, qd, kd, S, z, chunk, cdt, normalize):
    """One block: features (B, H, n, F), v (B, H, n, E), state S (BH, F, E), z (BH, F).

    Returns U (BH·nc, C, E), den (BH·nc, C, 1) or None, and the state after the block.
    """
    bh = S.shape[0]
    Q, K, V = _chunks(qr, chunk, cdt), _chunks(kr, chunk, cdt), _chunks(v, chunk, cdt)
    nc = Q.shape[0] // bh
    feat, e = Q.shape[-1], V.shape[-1]
    Kt = K.transpose(1, 2)
    S_before, S_after = _exclusive_prefix(S, torch.bmm(Kt, V).view(bh, nc, feat, e))
    A = torch.bmm(Q, Kt).tril_()
    U = torch.bmm(A, V).baddbmm_(Q, S_before.view(-1, feat, e).to(cdt))
    if qd is None:
        Qd, Kd, Ad = Q, K, A
    else:
        Qd, Kd = _chunks(qd, chunk, cdt), _chunks(kd, chunk, cdt)
        Ad = torch.bmm(Qd, Kd.transpose(1, 2)).tril_() if normalize else None
    z_before, z_after = _exclusive_prefix(z, Kd.view(bh, nc, chunk, feat).sum(2))
    den = None
    if normalize:
        sdt = S.dtype
        den = torch.baddbmm(Ad.sum(-1, keepdim=True, dtype=sdt), Qd.to(sdt), z_before.view(-1, feat, 1))
    return U, den, S_after, z_after


def _block_backward(qr, kr, v, qd, kd, S, z, G, g, R, r, chunk, cdt):
    """Gradients of one block (see the module docstring).

    qr, kr, qd, kd: block features (B, H, n, F) (qd, kd None when shared); v, G: (B, H, n, E);
    g: (B, H, n) denominator gradient or None; S (BH, F, E), z (BH, F): state before the block;
    R (BH, F, E), r (BH, F): gradient flowing into the state after the block.
    Returns (feature grads [dqr, dkr(, dqd, dkd)] as (B, H, n, F), R and r before the block, dv).
    """
    b, h, n, _ = qr.shape
    bh = b * h
    Q, K, V, Gc = (_chunks(x, chunk, cdt) for x in (qr, kr, v, G))
    nc = Q.shape[0] // bh
    feat, e = Q.shape[-1], V.shape[-1]
    shared = qd is None
    Qd, Kd = (Q, K) if shared else (_chunks(qd, chunk, cdt), _chunks(kd, chunk, cdt))
    Kt = K.transpose(1, 2)
    S_before, _ = _exclusive_prefix(S, torch.bmm(Kt, V).view(bh, nc, feat, e))
    R_after, R_before = _reverse_exclusive_prefix(R, torch.bmm(Q.transpose(1, 2), Gc).view(bh, nc, feat, e))
    R_after_c = R_after.view(-1, feat, e).to(cdt)
    gc = None if g is None else _chunks(g.unsqueeze(-1), chunk, cdt)  # (BH·nc, C, 1)

    A = torch.bmm(Q, Kt).tril_()
    P = torch.bmm(Gc, V.transpose(1, 2)) if (gc is None or not shared) else torch.baddbmm(gc, Gc, V.transpose(1, 2))
    P.tril_()
    dQ = torch.bmm(P, K).baddbmm_(Gc, S_before.view(-1, feat, e).to(cdt).transpose(1, 2))
    dK = torch.bmm(P.transpose(1, 2), Q).baddbmm_(V, R_after_c.transpose(1, 2))
    dV = torch.bmm(A.transpose(1, 2), Gc).baddbmm_(K, R_after_c)

    dQd = dKd = None
    if shared:
        dQd, dKd = dQ, dK
    else:
        dQd = torch.zeros_like(Qd)
        dKd = torch.zeros_like(Kd)
    if gc is not None:
        z_before, _ = _exclusive_prefix(z, Kd.view(bh, nc, chunk, feat).sum(2))
        r_after, r_before = _reverse_exclusive_prefix(
            r, torch.bmm(Qd.transpose(1, 2), gc).view(bh, nc, feat)
        )
        dQd.baddbmm_(gc, z_before.view(-1, 1, feat).to(cdt))
        if not shared:
            Pd = torch.ones(chunk, chunk, dtype=cdt, device=Q.device).tril_() * gc
            dQd.baddbmm_(Pd, Kd)
            dKd.baddbmm_(Pd.transpose(1, 2), Qd)
    else:
        r_after = r.unsqueeze(1).expand(bh, nc, feat)
        r_before = r
    dKd += r_after.reshape(-1, 1, feat).to(cdt)
    grads = [_unchunk(dQ, b, h, n), _unchunk(dK, b, h, n)]
    if not shared:
        grads += [_unchunk(dQd, b, h, n), _unchunk(dKd, b, h, n)]
    return grads, R_before, r_before, _unchunk(dV, b, h, n)
