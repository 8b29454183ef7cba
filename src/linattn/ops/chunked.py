"""Causal linear attention, chunked, with an explicit memory-efficient backward (DESIGN §3).

Per (batch, head), numerator features Q̃, K̃ (N×F), denominator features Q̃_d, K̃_d (the same
tensors without RoPE; with RoPE the numerator ones are rotated, DESIGN §6), values V (N×E), chunks
of C rows, M the C×C lower-triangular mask (diagonal included), S_n, z_n the states before chunk n:

    A_n = M ⊙ Q̃_n K̃_nᵀ,   U_n = A_n V_n + Q̃_n S_n,          S_{n+1} = S_n + K̃_nᵀ V_n
    d_n = (M ⊙ Q̃_{d,n} K̃_{d,n}ᵀ) 1 + Q̃_{d,n} z_n,           z_{n+1} = z_n + K̃_{d,n}ᵀ 1

and O = U / (d + ε), or O = U with normalize=False. Without RoPE the denominator reuses A_n (its
row sums). The denominator is kept out of the value matmuls: appending a column of ones to V would
make every matmul E+1 = 65 wide, which costs ~20% on 16-wide AVX-512 tiles and a packing copy.

The sequence is walked in *blocks* of many chunks (all heads, a range of tokens): inside a block
every chunk product is one batched matmul and the chunk states are a prefix sum (a triangular
matmul); between blocks only the state is carried. A tail of N mod C tokens is its own block whose
chunk is the tail (no padding). Temporaries are bounded by the block, not by N, and features are
recomputed block by block in the backward, so nothing of size N·F·E, and no N-sized feature tensor,
is kept. Saved for backward: q, k, v, the output, the denominators d + ε (N floats) and the states
entering each block; plus the last block's tensors, which the backward (walking blocks in reverse)
uses first instead of recomputing them.

Backward, with G = ∂L/∂U = ∂L/∂O / (d+ε), g = ∂L/∂d = −Σ_e (∂L/∂O ⊙ O) / (d+ε), R_n and r_n the
gradients flowing into S and z after chunk n (reverse prefix sums of Q̃_mᵀ G_m and Q̃_{d,m}ᵀ g_m,
m > n, plus the final-state gradients), P = M ⊙ (G Vᵀ), P_d = M ⊙ (g 1ᵀ):

    ∂Q̃_n = P K̃_n + G_n S_nᵀ,    ∂K̃_n = Pᵀ Q̃_n + V_n R_nᵀ,    ∂V_n = A_nᵀ G_n + K̃_n R_n,
    ∂Q̃_{d,n} = P_d K̃_{d,n} + g_n z_nᵀ,    ∂K̃_{d,n} = P_dᵀ Q̃_{d,n} + 1 r_nᵀ,
    ∂(S, z)_init = (R, r)_{−1}.

Without RoPE the two feature gradients add up, and so P + P_d = M ⊙ (G Vᵀ + g 1ᵀ) is formed once.
The feature gradients are chained to q, k elementwise when φ allows it (identity, elu+1: see
`Featurizer.local_grad`), else with autograd on the recomputed block features (φ's parameters too).
"""

from __future__ import annotations

import functools

import torch

from ._features import Featurizer

#: Target number of elements of one block temporary of shape (B·H, tokens, max(F, E, C)).
BLOCK_ELEMENTS = 1 << 18


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


def _blocks(n: int, chunk: int, bh: int, width: int) -> list[tuple[int, int, int]]:
    """(start, end, chunk size) of each block: the whole chunks in blocks of `block_tokens`, then the
    tail of n mod chunk tokens as one block of one chunk."""
    main = n - n % chunk
    per = block_tokens(bh, width, chunk)
    blocks = [(s, min(s + per, main), chunk) for s in range(0, main, per)]
    if main < n:
        blocks.append((main, n, n - main))
    return blocks


@functools.lru_cache(maxsize=32)
def _strict_lower(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """(n, n) strictly lower-triangular matrix of ones (cached: never written to)."""
    return torch.ones(n, n, dtype=dtype, device=device).tril_(-1)


def _chunks(x: torch.Tensor, c: int, dtype: torch.dtype) -> torch.Tensor:
    """(B, H, m, w) -> (B·H·m/c, c, w) in `dtype`: a view when x is contiguous in that dtype."""
    return x.to(dtype).reshape(-1, c, x.shape[-1])


def _prefix(init: torch.Tensor, parts: torch.Tensor, reverse: bool = False):
    """init (BH, *s), parts (BH·nc, *s) -> (per chunk (BH·nc, *s), total (BH, *s)), in init's dtype.

    Forward: per[n] = init + Σ_{m<n} parts[m] (the state before chunk n), total = init + Σ parts.
    Reverse: per[n] = init + Σ_{m>n} parts[m] (the gradient after chunk n), total likewise.
    One batched matmul with a strictly triangular matrix (a strided cumsum over the chunk axis is
    several times slower on CPU)."""
    bh = init.shape[0]
    flat = parts.reshape(bh, -1, init[0].numel()).to(init.dtype)
    nc = flat.shape[1]
    tri = _strict_lower(nc, flat.dtype, flat.device)
    per = torch.baddbmm(init.reshape(bh, 1, -1), (tri.mT if reverse else tri).expand(bh, nc, nc), flat)
    end = 0 if reverse else -1
    return per.view(parts.shape), (per[:, end] + flat[:, end]).view(init.shape)


def _block_states(Q, K, V, Kd, S, z):
    """What both passes need of one block beyond its features: the states before every chunk
    S_before (BH·nc, F, E), z_before (BH·nc, F) (state dtype), the states after the block, and the
    masked scores A = M ⊙ Q̃ K̃ᵀ (BH·nc, c, c)."""
    Kt = K.mT
    S_before, S_after = _prefix(S, torch.bmm(Kt, V))
    z_before, z_after = _prefix(z, Kd.sum(1))  # bf16 sums accumulate in fp32 (sum(dtype=) is 3× slower)
    A = torch.bmm(Q, Kt).tril_()
    return S_before, S_after, z_before, z_after, A


def _denominator(Ad, Qd, z_before, eps: float):
    """d + ε = (M ⊙ Q̃_d K̃_dᵀ) 1 + Q̃_d z_before + ε, (BH·nc, c, 1) in the state dtype."""
    den = Ad.sum(-1, keepdim=True).to(z_before.dtype)
    zq = z_before.to(Qd.dtype).unsqueeze(-1)
    if den.dtype == Qd.dtype:
        den.baddbmm_(Qd, zq)
    else:
        den += torch.bmm(Qd, zq)
    return den.add_(eps)


def _target(dst: torch.Tensor, c: int, dtype: torch.dtype) -> torch.Tensor:
    """A (B·H·m/c, c, w) buffer to compute a (B, H, m, w) result into: dst's own memory when it can."""
    if dst.is_contiguous() and dst.dtype == dtype:
        return dst.view(-1, c, dst.shape[-1])
    w = dst.shape[-1]
    return torch.empty(dst.numel() // w, w, dtype=dtype, device=dst.device).view(-1, c, w)


def _store(dst: torch.Tensor, buf: torch.Tensor) -> None:
    """Copies a `_target` buffer into dst unless it is dst's memory."""
    if buf.data_ptr() != dst.data_ptr():
        dst.copy_(buf.view(dst.shape))


def chain_feature_grads(featurize: Featurizer, span, inputs, feats, grads, outs, dparams) -> None:
    """Writes ∂L/∂q, ∂L/∂k of the tokens [s, t) into outs = (dq, dk) (either None when not wanted) and
    adds φ's parameter gradients to dparams, from grads = (∂Q̃, ∂Q̃_d, ∂K̃, ∂K̃_d) (the numerator and
    denominator feature gradients, None where absent), span = (B, H, s, t).

    `featurize.local_grad`: elementwise; inputs is None and feats = (Q̃, K̃) (any shape holding
    (B, H, t − s, F); overwritten). Otherwise autograd through the block's graph: inputs = (qb, kb) the
    block's q, k (requiring grad where wanted) and feats = (q̃, q̃_d, k̃, k̃_d) made from them."""
    b, h, s, t = span
    m = t - s
    dq, dk = outs
    if inputs is None:
        for dst, f, gr, is_q in ((dq, feats[0], grads[0], True), (dk, feats[1], grads[2], False)):
            if dst is not None:
                featurize.input_grad(f.view(b, h, m, -1), gr.view(b, h, m, -1), s, t, is_q, out=dst[:, :, s:t])
        return
    qb, kb = inputs
    params = featurize.parameters
    want = [x for x in (qb, kb) if x.requires_grad] + list(params)
    pairs = [(f, gr.view(b, h, m, -1)) for f, gr in zip(feats, grads)
             if f is not None and gr is not None and f.requires_grad]
    if not want or not pairs:
        for x, dst in ((qb, dq), (kb, dk)):
            if dst is not None:
                dst[:, :, s:t] = 0
        return
    res = iter(torch.autograd.grad([p[0] for p in pairs], want, [p[1] for p in pairs], allow_unused=True))
    for x, dst in ((qb, dq), (kb, dk)):
        if x.requires_grad:
            gx = next(res)
            dst[:, :, s:t] = 0 if gx is None else gx
    for j in range(len(params)):
        gp = next(res)
        if gp is not None:
            dparams[j] += gp


class ChunkedCausalLinearAttention(torch.autograd.Function):
    """apply(featurize, chunk, normalize, eps, q, k, v, kv0, z0, *params) -> (o, kv, z)."""

    @staticmethod
    def forward(ctx, featurize: Featurizer, chunk: int, normalize: bool, eps: float, q, k, v, kv0, z0, *params):
        b, h, n, _ = q.shape
        e = v.shape[-1]
        bh, feat = b * h, kv0.shape[2]
        cdt, sdt = compute_dtype(q.dtype), state_dtype(q.dtype)
        S = kv0.to(sdt).reshape(bh, feat, e)
        z = z0.to(sdt).reshape(bh, feat)
        blocks = _blocks(n, chunk, bh, max(feat, e, chunk))
        o = torch.empty(b, h, n, e, dtype=q.dtype, device=q.device)
        dens, S_in, z_in = [], [], []
        last = None
        with torch.no_grad():
            for i, (s, t, c) in enumerate(blocks):
                S_in.append(S)
                z_in.append(z)
                qr, qd = featurize(q[:, :, s:t], s, t, True)
                kr, kd = featurize(k[:, :, s:t], s, t, False)
                Q, K, V = _chunks(qr, c, cdt), _chunks(kr, c, cdt), _chunks(v[:, :, s:t], c, cdt)
                Qd, Kd = (Q, K) if qd is None else (_chunks(qd, c, cdt), _chunks(kd, c, cdt))
                S_before, S, z_before, z, A = _block_states(Q, K, V, Kd, S, z)
                o_blk = o[:, :, s:t]
                U = _target(o_blk, c, cdt)
                torch.bmm(A, V, out=U).baddbmm_(Q, S_before.to(cdt))
                if normalize:
                    Ad = A if qd is None else torch.bmm(Qd, Kd.mT).tril_()
                    den = _denominator(Ad, Qd, z_before, eps)
                    dens.append(den)
                    if U.data_ptr() == o_blk.data_ptr():
                        U.div_(den)
                    else:
                        torch.div(U.view(b, h, t - s, e), den.view(b, h, t - s, 1), out=o_blk)
                else:
                    _store(o_blk, U)
                if i == len(blocks) - 1 and featurize.local_grad:
                    # the backward starts with this block: keep its tensors (bounded by the block size)
                    last = (Q, K, V, Qd, Kd, S_before, z_before, A)
        ctx.featurize, ctx.chunk, ctx.normalize, ctx.eps = featurize, chunk, normalize, eps
        ctx.blocks, ctx.kv0_dtype, ctx.z0_dtype = blocks, kv0.dtype, z0.dtype
        ctx.n_blocks, ctx.n_dens = len(blocks), len(dens)
        ctx.save_for_backward(q, k, v, o, *dens, *S_in, *z_in, *params)
        ctx.last = last
        ctx.set_materialize_grads(False)  # unused outputs get None, not zero tensors
        return o, S.reshape(b, h, feat, e), z.reshape(b, h, feat)

    @staticmethod
    def backward(ctx, do, dkv, dz):
        q, k, v, o, *rest = ctx.saved_tensors
        nb, nd = ctx.n_blocks, ctx.n_dens
        dens, S_in, z_in, params = rest[:nd], rest[nd:nd + nb], rest[nd + nb:nd + 2 * nb], rest[nd + 2 * nb:]
        featurize, normalize = ctx.featurize, ctx.normalize
        b, h, n, _ = q.shape
        e = v.shape[-1]
        bh, feat = b * h, S_in[0].shape[-2]
        cdt, sdt = compute_dtype(q.dtype), state_dtype(q.dtype)
        R = torch.zeros(bh, feat, e, dtype=sdt, device=q.device) if dkv is None else dkv.to(sdt).reshape(bh, feat, e)
        r = torch.zeros(bh, feat, dtype=sdt, device=q.device) if dz is None else dz.to(sdt).reshape(bh, feat)
        want_q, want_k = ctx.needs_input_grad[4], ctx.needs_input_grad[5]
        dq = torch.empty_like(q) if want_q else None
        dk = torch.empty_like(k) if want_k else None
        dv = torch.empty_like(v)
        dparams = [torch.zeros_like(p) for p in params]
        local = featurize.local_grad
        last, ctx.last = ctx.last, None
        for i in reversed(range(nb)):
            s, t, c = ctx.blocks[i]
            m = t - s
            if last is not None:
                Q, K, V, Qd, Kd, S_before, z_before, A = last
                last = None
                feats = ()
            else:
                with torch.enable_grad():
                    qb = q[:, :, s:t].detach().requires_grad_(want_q and not local)
                    kb = k[:, :, s:t].detach().requires_grad_(want_k and not local)
                    feats = (*featurize(qb, s, t, True), *featurize(kb, s, t, False))
                qr, qd, kr, kd = (None if f is None else f.detach() for f in feats)
                Q, K, V = _chunks(qr, c, cdt), _chunks(kr, c, cdt), _chunks(v[:, :, s:t], c, cdt)
                Qd, Kd = (Q, K) if qd is None else (_chunks(qd, c, cdt), _chunks(kd, c, cdt))
                S_before, _, z_before, _, A = _block_states(Q, K, V, Kd, S_in[i], z_in[i])
            shared = Qd is Q
            do_blk = do[:, :, s:t] if do is not None else torch.zeros(b, h, m, e, dtype=q.dtype, device=q.device)
            g = None
            if normalize:
                den = dens[i].view(b, h, m, 1)
                G = torch.empty(b, h, m, e, dtype=cdt, device=q.device)
                torch.div(do_blk, den, out=G)
                g = (do_blk.to(sdt) * o[:, :, s:t].to(sdt)).sum(-1, keepdim=True).div_(den).neg_()
                g = g.view(-1, c, 1)
                G = G.view(-1, c, e)
            else:
                G = _chunks(do_blk, c, cdt)
            R_after, R = _prefix(R, torch.bmm(Q.mT, G), reverse=True)
            R_after = R_after.to(cdt)
            if g is not None:
                r_after, r = _prefix(r, torch.bmm(Qd.mT, g.to(cdt)).squeeze(-1), reverse=True)
            else:
                r_after = r.view(bh, 1, feat).expand(bh, m // c, feat)
            # dV = Aᵀ G + K̃ R_after
            dV = _target(dv[:, :, s:t], c, cdt)
            torch.bmm(A.mT, G, out=dV).baddbmm_(K, R_after)
            _store(dv[:, :, s:t], dV)
            del A
            P = torch.bmm(G, V.mT)
            if shared and g is not None:
                P += g.to(cdt)
            P.tril_()
            dQ = torch.bmm(P, K).baddbmm_(G, S_before.to(cdt).mT)
            dK = torch.bmm(P.mT, Q).baddbmm_(V, R_after.mT)
            del P
            if shared:
                dQd, dKd = dQ, dK
            elif g is not None:
                Pd = g.to(cdt).expand(-1, c, c).tril()
                dQd, dKd = torch.bmm(Pd, Kd), torch.bmm(Pd.mT, Qd)
                del Pd
            else:
                dQd, dKd = None, torch.zeros_like(Kd)
            if g is not None:
                dQd.baddbmm_(g.to(cdt), z_before.to(cdt).unsqueeze(1))
            dKd += r_after.reshape(-1, 1, feat).to(cdt)
            grads = (dQ, dQd if not shared else None, dK, dKd if not shared else None)
            chain_feature_grads(featurize, (b, h, s, t), (qb, kb) if not local else None, (Q, K) if local else feats,
                                grads, (dq, dk), dparams)
        return (None, None, None, None, dq, dk, dv, R.reshape(b, h, feat, e).to(ctx.kv0_dtype),
                r.reshape(b, h, feat).to(ctx.z0_dtype), *dparams)
