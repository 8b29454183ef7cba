"""Causal linear attention, chunked, with an explicit memory-efficient backward (design §3).

Per (batch, head), numerator features Q̃, K̃ (N×F), denominator features Q̃_d, K̃_d (the same
tensors without RoPE; with RoPE the numerator ones are rotated, design §6), values V (N×E), chunks
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

NaN and Inf: causality holds for them too. Under IEEE arithmetic the zeros of M, of the prefix
matrix and of the cotangent of an output the loss does not use turn a later token's NaN or Inf
into 0·NaN = NaN in earlier rows and gradients. Every non-finite k, v or initial state reaches the
final state (S, z), and every non-finite factor of the backward's products (a feature row of q, G,
g, the final-state gradients) reaches the initial state's gradient (R, r); both are checked after
a pass (`nonfinite.all_finite`, ~65k instructions against ~180M for a fused forward at N=4096), and
only then is the pass run again exact: the same algorithm with products in which those zeros absorb
a NaN or Inf (`nonfinite.strong_bmm`), zero cotangents giving G = g = 0, masked keys' feature
gradients 0 (their features are the constant 0; a NaN v there is left to this pass), and rows whose
feature gradients are 0 chained from zero inputs (their φ' may be NaN). A non-finite value then reaches
exactly the outputs and gradients that depend on it, and the gradients of tokens that no output in
the loss depends on are exactly 0. The fused CPU kernels (linattn.ops.native) take the same exact
pass of these torch ops in that case.
"""

from __future__ import annotations

import functools

import torch

from ..features import Featurizer
from ..nonfinite import Products, all_finite, strong_bmm
from ..precision import compute_dtype_cpu
from ..autodiff import first_order

#: Target number of elements of one block temporary of shape (B·H, tokens, max(F, E, C)).
BLOCK_ELEMENTS = 1 << 18
#: Rows per chunk C when the caller does not choose (the ops, the layers, ModelConfig.chunk_size).
DEFAULT_CHUNK_SIZE = 64


def compute_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """Matmul dtype of the torch-op paths: fp16 is upcast to fp32 because its range cannot hold states
    that grow like N; fp64 stays fp64 (used by the tests); bf16 stays bf16 on CUDA (tensor cores) and
    on the CPU is what `precision.torch_choice` found faster here: bf16, or fp32 on each block widened
    as it is cut into chunks (`chunk_view`), only the outputs rounded to bf16."""
    if dtype == torch.bfloat16:
        return compute_dtype_cpu(dtype) if device.type == "cpu" else dtype
    if dtype == torch.float64:
        return dtype
    return torch.float32


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """States and normalizers accumulate in float32 (float64 for float64 inputs)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def block_tokens(bh: int, width: int, chunk: int) -> int:
    """Tokens per block: a multiple of the chunk size with about BLOCK_ELEMENTS per temporary."""
    per = max(chunk, (BLOCK_ELEMENTS // max(1, bh * width)) // chunk * chunk)
    return per


def chunk_blocks(n: int, chunk: int, bh: int, width: int) -> list[tuple[int, int, int]]:
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


def chunk_view(x: torch.Tensor, c: int, dtype: torch.dtype) -> torch.Tensor:
    """(B, H, m, w) -> (B·H·m/c, c, w) in `dtype`: a view when x is contiguous in that dtype."""
    return x.to(dtype).reshape(-1, c, x.shape[-1])


def _prefix(init: torch.Tensor, parts: torch.Tensor, reverse: bool = False, exact: bool = False):
    """init (BH, *s), parts (BH·nc, *s) -> (per chunk (BH·nc, *s), total (BH, *s)), in init's dtype.

    Forward: per[n] = init + Σ_{m<n} parts[m] (the state before chunk n), total = init + Σ parts.
    Reverse: per[n] = init + Σ_{m>n} parts[m] (the gradient after chunk n), total likewise.
    One batched matmul with a strictly triangular matrix (a strided cumsum over the chunk axis is
    several times slower on CPU); exact: its zeros absorb a non-finite part (`strong_bmm`)."""
    bh = init.shape[0]
    flat = parts.reshape(bh, -1, init[0].numel()).to(init.dtype)
    nc = flat.shape[1]
    tri = (lambda t: t.mT if reverse else t)(_strict_lower(nc, flat.dtype, flat.device)).expand(bh, nc, nc)
    if exact:
        per = init.reshape(bh, 1, -1) + strong_bmm(tri, flat)
    else:
        per = torch.baddbmm(init.reshape(bh, 1, -1), tri, flat)
    end = 0 if reverse else -1
    return per.view(parts.shape), (per[:, end] + flat[:, end]).view(init.shape)


def _block_states(Q, K, V, Kd, S, z, exact: bool = False):
    """What both passes need of one block beyond its features: the states before every chunk
    S_before (BH·nc, F, E), z_before (BH·nc, F) (state dtype), the states after the block, and the
    masked scores A = M ⊙ Q̃ K̃ᵀ (BH·nc, c, c)."""
    Kt = K.mT
    S_before, S_after = _prefix(S, (strong_bmm if exact else torch.bmm)(Kt, V), exact=exact)
    z_before, z_after = _prefix(z, Kd.sum(1), exact=exact)  # bf16 sums accumulate in fp32 (sum(dtype=) is 3× slower)
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


def block_target(dst: torch.Tensor, c: int, dtype: torch.dtype) -> torch.Tensor:
    """A (B·H·m/c, c, w) buffer to compute a (B, H, m, w) result into: dst's own memory when it can."""
    if dst.is_contiguous() and dst.dtype == dtype:
        return dst.view(-1, c, dst.shape[-1])
    w = dst.shape[-1]
    return torch.empty(dst.numel() // w, w, dtype=dtype, device=dst.device).view(-1, c, w)


def store_block(dst: torch.Tensor, buf: torch.Tensor, den: torch.Tensor | None = None) -> None:
    """Copies a `block_target` buffer into dst (B, H, m, E) unless it is dst's memory; with `den`
    (B·H·m/c, c, 1), the buffer divided by it (in place when it is dst's memory)."""
    if den is None:
        if buf.data_ptr() != dst.data_ptr():
            dst.copy_(buf.view(dst.shape))
    elif buf.data_ptr() == dst.data_ptr():
        buf.div_(den)
    else:
        b, h, m, e = dst.shape
        torch.div(buf.view(b, h, m, e), den.view(b, h, m, 1), out=dst)


def output_grads(do_blk, o_blk, den, c: int, cdt, sdt, exact: bool):
    """G = ∂L/∂U = dO / (d+ε) (BH·nc, c, E) in cdt and g = ∂L/∂d = −Σ_e dO ⊙ O / (d+ε) (BH·nc, c, 1)
    in sdt, from dO and O (B, H, m, E) and the saved d + ε (B, H, m, 1). Exact pass: an entry with
    dO = 0 contributes 0 to both, also against a NaN or Inf in O or d (an output the loss does not
    use), and a row without a nonzero dO gets g = 0."""
    b, h, m, e = do_blk.shape
    G = torch.empty(b, h, m, e, dtype=cdt, device=do_blk.device)
    torch.div(do_blk, den, out=G)
    prod = do_blk.to(sdt) * o_blk.to(sdt)
    if exact:
        unused = do_blk == 0
        G.masked_fill_(unused, 0)
        prod.masked_fill_(unused, 0)
    g = prod.sum(-1, keepdim=True).div_(den).neg_()
    if exact:
        g.masked_fill_(unused.all(-1, keepdim=True), 0)
    return G.view(-1, c, e), g.view(-1, c, 1)


def _feature_grads(mm: Products, Q, K, V, Qd, Kd, A, G, g, S_before, z_before, R_after, r_after, dV):
    """The module doc's ∂Q̃, ∂Q̃_d, ∂K̃, ∂K̃_d of one block, and ∂V written into dV; ∂Q̃_d, ∂K̃_d are
    None without RoPE (they add to ∂Q̃, ∂K̃). All (BH·nc, c, ·) in the compute dtype; g None without
    normalization."""
    c, feat, cdt = Q.shape[1], Q.shape[2], Q.dtype
    shared = Qd is Q
    mm.addmm_(mm.mm(A.mT, G, out=dV), K, R_after)  # dV = Aᵀ G + K̃ R_after
    P = mm.mm(G, V.mT)
    if shared and g is not None:
        P += g.to(cdt)
    P.tril_()
    dQ = mm.addmm_(mm.mm(P, K), G, S_before.to(cdt).mT)
    dK = mm.addmm_(mm.mm(P.mT, Q), V, R_after.mT)
    del P
    if shared:
        dQd, dKd = dQ, dK
    elif g is not None:
        Pd = g.to(cdt).expand(-1, c, c).tril()
        dQd, dKd = mm.mm(Pd, Kd), mm.mm(Pd.mT, Qd)
        del Pd
    else:
        dQd, dKd = None, torch.zeros_like(Kd)
    if g is not None:
        mm.addmm_(dQd, g.to(cdt), z_before.to(cdt).unsqueeze(1))
    dKd += r_after.reshape(-1, 1, feat).to(cdt)
    return dQ, None if shared else dQd, dK, None if shared else dKd


def _dead_rows(*grads) -> torch.Tensor:
    """(B·H·nc, c) True where every given feature gradient (None: skipped) is 0 in the whole row."""
    rows = [(gr == 0).all(-1) for gr in grads if gr is not None]
    return functools.reduce(torch.logical_and, rows)


class ChunkedCausalLinearAttention(torch.autograd.Function):
    """apply(featurize, chunk, normalize, eps, exact, q, k, v, kv0, z0, *params) -> (o, kv, z).

    exact=False is the fast pass. exact=True is the exact pass for inputs where a NaN or Inf reached
    the state (`linear_attention` checks the final state and reruns the op exact): every product where
    a masked entry, a chunk outside a prefix, or a zero cotangent meets a non-finite factor treats the
    zero as absorbing (ops.nonfinite), so a non-finite value reaches exactly the outputs and gradients
    that depend on it; gradients of tokens that no output in the loss depends on are 0. The backward
    of a fast pass reruns exact when the gradient of the initial state comes out non-finite: every
    non-finite factor of its products (a feature row of q, G, g, the final-state gradients) reaches
    it, as every non-finite k, v or initial state reaches the forward's final state.
    """

    @staticmethod
    def forward(ctx, featurize: Featurizer, chunk: int, normalize: bool, eps: float, exact: bool, q, k, v, kv0, z0,
                *params):
        b, h, n, _ = q.shape
        e = v.shape[-1]
        bh, feat = b * h, kv0.shape[2]
        cdt, sdt = compute_dtype(q.dtype, q.device), state_dtype(q.dtype)
        S = kv0.to(sdt).reshape(bh, feat, e)
        z = z0.to(sdt).reshape(bh, feat)
        blocks = chunk_blocks(n, chunk, bh, max(feat, e, chunk))
        o = torch.empty(b, h, n, e, dtype=q.dtype, device=q.device)
        dens, S_in, z_in = [], [], []
        last = None
        mm = Products(exact)
        with torch.no_grad():
            for i, (s, t, c) in enumerate(blocks):
                S_in.append(S)
                z_in.append(z)
                qr, qd = featurize(q[:, :, s:t], s, t, True)
                kr, kd = featurize(k[:, :, s:t], s, t, False)
                Q, K, V = chunk_view(qr, c, cdt), chunk_view(kr, c, cdt), chunk_view(v[:, :, s:t], c, cdt)
                Qd, Kd = (Q, K) if qd is None else (chunk_view(qd, c, cdt), chunk_view(kd, c, cdt))
                S_before, S, z_before, z, A = _block_states(Q, K, V, Kd, S, z, exact)
                o_blk = o[:, :, s:t]
                U = block_target(o_blk, c, cdt)
                mm.mm(A, V, out=U).baddbmm_(Q, S_before.to(cdt))
                if normalize:
                    Ad = A if qd is None else torch.bmm(Qd, Kd.mT).tril_()
                    den = _denominator(Ad, Qd, z_before, eps)
                    dens.append(den)
                store_block(o_blk, U, den if normalize else None)
                if i == len(blocks) - 1 and featurize.local_grad:
                    # the backward starts with this block: keep its tensors (bounded by the block size)
                    last = (Q, K, V, Qd, Kd, S_before, z_before, A)
        ctx.featurize, ctx.chunk, ctx.normalize, ctx.eps, ctx.exact = featurize, chunk, normalize, eps, exact
        ctx.blocks, ctx.kv0_dtype, ctx.z0_dtype = blocks, kv0.dtype, z0.dtype
        ctx.n_blocks, ctx.n_dens = len(blocks), len(dens)
        ctx.save_for_backward(q, k, v, o, *dens, *S_in, *z_in, *params)
        ctx.last = last
        ctx.set_materialize_grads(False)  # unused outputs get None, not zero tensors
        return o, S.reshape(b, h, feat, e), z.reshape(b, h, feat)

    @staticmethod
    @first_order("linear_attention")
    def backward(ctx, do, dkv, dz):
        saved = ctx.saved_tensors  # unpacked once (activation checkpointing allows no more)
        dq, dk, dv, R, r, dparams = _backward(ctx, saved, do, dkv, dz, ctx.exact)
        if not ctx.exact and not all_finite(R, r):  # a NaN or Inf among the factors: the exact pass
            dq, dk, dv, R, r, dparams = _backward(ctx, saved, do, dkv, dz, True)
        b, h = saved[0].shape[:2]
        return (None, None, None, None, None, dq, dk, dv, R.reshape(b, h, *R.shape[1:]).to(ctx.kv0_dtype),
                r.reshape(b, h, -1).to(ctx.z0_dtype), *dparams)


def _backward(ctx, saved, do, dkv, dz, exact: bool):
    """The backward pass (fast or exact) of ChunkedCausalLinearAttention from its saved tensors:
    returns (dq, dk, dv, R (BH, F, E), r (BH, F), [d of each parameter])."""
    q, k, v, o, *rest = saved
    nb, nd = ctx.n_blocks, ctx.n_dens
    dens, S_in, z_in, params = rest[:nd], rest[nd:nd + nb], rest[nd + nb:nd + 2 * nb], rest[nd + 2 * nb:]
    featurize, normalize = ctx.featurize, ctx.normalize
    b, h, n, _ = q.shape
    e = v.shape[-1]
    bh, feat = b * h, S_in[0].shape[-2]
    cdt, sdt = compute_dtype(q.dtype, q.device), state_dtype(q.dtype)
    R = torch.zeros(bh, feat, e, dtype=sdt, device=q.device) if dkv is None else dkv.to(sdt).reshape(bh, feat, e)
    r = torch.zeros(bh, feat, dtype=sdt, device=q.device) if dz is None else dz.to(sdt).reshape(bh, feat)
    want_q, want_k = ctx.needs_input_grad[5], ctx.needs_input_grad[6]
    dq = torch.empty_like(q) if want_q else None
    dk = torch.empty_like(k) if want_k else None
    dv = torch.empty_like(v)
    dparams = [torch.zeros_like(p) for p in params]
    local = featurize.local_grad
    last, ctx.last = ctx.last, None  # a rerun recomputes it (the first pass overwrote its features)
    mm = Products(exact)
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
            Q, K, V = chunk_view(qr, c, cdt), chunk_view(kr, c, cdt), chunk_view(v[:, :, s:t], c, cdt)
            Qd, Kd = (Q, K) if qd is None else (chunk_view(qd, c, cdt), chunk_view(kd, c, cdt))
            S_before, _, z_before, _, A = _block_states(Q, K, V, Kd, S_in[i], z_in[i], exact)
        do_blk = do[:, :, s:t] if do is not None else torch.zeros(b, h, m, e, dtype=q.dtype, device=q.device)
        g = None
        if normalize:
            G, g = output_grads(do_blk, o[:, :, s:t], dens[i].view(b, h, m, 1), c, cdt, sdt, exact)
        else:
            G = chunk_view(do_blk, c, cdt)
        R_after, R = _prefix(R, mm.mm(Q.mT, G), reverse=True, exact=exact)
        R_after = R_after.to(cdt)
        if g is not None:
            r_after, r = _prefix(r, mm.mm(Qd.mT, g.to(cdt)).squeeze(-1), reverse=True, exact=exact)
        else:
            r_after = r.view(bh, 1, feat).expand(bh, m // c, feat)
        dV = block_target(dv[:, :, s:t], c, cdt)
        grads = _feature_grads(mm, Q, K, V, Qd, Kd, A, G, g, S_before, z_before, R_after, r_after, dV)
        store_block(dv[:, :, s:t], dV)
        del A
        if exact and featurize.key_padding_mask is not None:
            # a masked key's features are the constant 0: their gradient is 0 (a NaN v there made it NaN)
            masked = ~featurize.key_padding_mask[:, None, s:t].expand(b, h, m).reshape(-1, c, 1)
            for gr in (grads[2], grads[3]):
                if gr is not None:
                    gr.masked_fill_(masked, 0)
        chain_feature_grads(featurize, (b, h, s, t), None if local else (qb, kb), (Q, K) if local else feats, grads,
                            (dq, dk), params, dparams, exact)
    return dq, dk, dv, R, r, dparams


def chain_feature_grads(featurize: Featurizer, span, inputs, feats, grads, outs, params, dparams,
                        exact: bool = False) -> None:
    """Writes ∂L/∂q, ∂L/∂k of the tokens [s, t) into outs = (dq, dk) (either None when not wanted) and
    adds the gradients of φ's trainable parameters `params` to dparams, from grads = (∂Q̃, ∂Q̃_d, ∂K̃,
    ∂K̃_d) (the numerator and denominator feature gradients, None where absent), span = (B, H, s, t).

    `featurize.local_grad`: elementwise; inputs is None and feats = (Q̃, K̃) (any shape holding
    (B, H, t − s, F)). Otherwise autograd through the block's graph: inputs = (qb, kb) the block's q, k
    (requiring grad where wanted) and feats = (q̃, q̃_d, k̃, k̃_d) made from them.

    Exact pass: a zero feature gradient gives exactly 0 against a NaN or Inf in φ', and with autograd
    rows whose feature gradients are all 0 are featurized again from zeros (their φ' may be NaN: q or k
    held a NaN there), so they give exactly 0 to q, k and the parameters."""
    b, h, s, t = span
    m = t - s
    dq, dk = outs
    if inputs is None:
        for dst, f, gr, is_q in ((dq, feats[0], grads[0], True), (dk, feats[1], grads[2], False)):
            if dst is not None:
                featurize.input_grad(f.view(b, h, m, -1), gr.view(b, h, m, -1), s, t, is_q, out=dst[:, :, s:t])
                if exact:
                    dst[:, :, s:t].masked_fill_(gr.view(b, h, m, -1) == 0, 0)
        return
    qb, kb = inputs
    if exact:
        dead_q = _dead_rows(grads[0], grads[1]).view(b, h, m, 1)
        dead_k = _dead_rows(grads[2], grads[3]).view(b, h, m, 1)
        with torch.enable_grad():
            feats = (*featurize(qb.masked_fill(dead_q, 0), s, t, True),
                     *featurize(kb.masked_fill(dead_k, 0), s, t, False))
    want = [x for x in (qb, kb) if x.requires_grad] + list(params)
    pairs = [(f, gr.view(b, h, m, -1)) for f, gr in zip(feats, grads)
             if f is not None and gr is not None and f.requires_grad]
    if not want or not pairs:
        for dst in (dq, dk):
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
