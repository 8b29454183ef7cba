"""The delta rule, chunked, with torch ops and an explicit backward (design §13): the path of every
device and dtype the fused CPU kernels do not take (and the fallback when they cannot be built).

Per (batch, head), a chunk of c rows with keys K, queries Q (already normalized and scaled), values
V (c×E), β, the log-decays g and b = their inclusive cumulative sum inside the chunk, the state S
(D×E) entering the chunk; Γ_ij = e^{b_i − b_j} for i ≥ j, 0 above (all ones below without g):

    A   = strict_tril(diag(β) (K Kᵀ ⊙ Γ))          L = I + A   (unit lower triangular)
    X   = V − diag(e^b) K S                          V' = L⁻¹ diag(β) X      (the corrected values)
    O   = diag(e^b) Q S + (Q Kᵀ ⊙ Γ) V'
    S  ← e^{b_c} S + (diag(e^{b_c − b}) K)ᵀ V'

Backward, with dO and R = ∂L/∂S after the chunk; Z = L⁻ᵀ dV' (a transposed triangular solve):

    dV' = (QKᵀ ⊙ Γ)ᵀ dO + diag(e^{b_c − b}) K R      dX = diag(β) Z = dV
    dβ  = rowsum(Z ⊙ X) + rowsum(dA ⊙ K Kᵀ ⊙ Γ)      dA = −strict_tril(Z V'ᵀ)
    dP  = tril(dO V'ᵀ),   H = diag(β) dA ⊙ Γ
    dQ  = (dP ⊙ Γ) K + diag(e^b) dO Sᵀ
    dK  = (H + Hᵀ) K + (dP ⊙ Γ)ᵀ Q − diag(e^b) dX Sᵀ + diag(e^{b_c − b}) V' Rᵀ
    R  ← e^{b_c} R + (diag(e^b) Q)ᵀ dO − (diag(e^b) K)ᵀ dX        (the gradient entering the chunk)

and the gate: every factor e^{±b} adds "value · its gradient" to ∂L/∂b (rows scaled by e^{b_i} add
Σ_d x_id ∂L/∂x_id to b_i; rows scaled by e^{b_c − b_i} subtract it from b_i and add it to b_c; e^{b_c} S
adds e^{b_c} Σ S ⊙ R to b_c), and Γ adds the row sums of G = dP ⊙ P + dA ⊙ A to b_i and subtracts its
column sums from b_j; ∂L/∂g is the reverse cumulative sum of ∂L/∂b in the chunk.

The sequence is walked in blocks of whole chunks (`linattn.ops.linear.chunked.chunk_blocks`): inside a block the
chunk-local products and the triangular inverses are batched over its chunks; only the state update
V'_n = U_n − W_n S, S ← e^{b_c} S + K_lᵀ V'_n (U = L⁻¹ diag(β) V, W = L⁻¹ diag(β e^b) K) is a loop over
them. Saved for backward: q, k, v, β, g and the state entering each block; the backward recomputes a
block's chunk states and products, so temporaries are bounded by the block and nothing of size
N·D·E or N·c is kept. Everything is computed in the state dtype (float32, float64 for float64),
except b: each g is first clamped at GATE_FLOOR and b is summed in float64, and the differences
b_i − b_j, b_c − b_i are taken in float64 before they are rounded to the state dtype (design §13,
numerics of b: after one strong gate, g = −1e8 say, b_i and b_j both carry it and a float32 or even
a float64 difference of the two loses the small gates between them). Clamping changes nothing that
can be seen: e^{GATE_FLOOR} ≈ 3.7e-44 is zero to fp32 and below any fp64 rounding of the state;
the gradient of a clamped g is 0 (as that of e^g, ≤ 3.7e-44, would be after rounding).

One decay per key channel (KDA, g (B, H, N, D)): the same form with the decays applied channel by
channel — K ⊙ e^b, K ⊙ e^{b_c − b}, Q ⊙ e^b, S ← Diag(e^{b_c}) S + …, and K Kᵀ ⊙ Γ, Q Kᵀ ⊙ Γ replaced
by Σ_d x_id k_jd e^{b_id − b_jd}, formed by sub-chunks so that no exponential overflows
(`linattn.ops.delta.subchunk`; b from g clamped at CHANNEL_GATE_FLOOR). Its backward recomputes a
block with autograd from the block's saved state and the gradient R after it (the same blocks, the
same memory bound).
"""

from __future__ import annotations

import functools

import torch

from ..linear.chunked import chunk_blocks, state_dtype
from ..autodiff import first_order
from .checks import op_name, per_channel
from .reference import L2_EPS
from .subchunk import CHANNEL_GATE_FLOOR, eye, pair_products

#: Every log-decay g is clamped at this floor before its chunk's cumulative sum b is formed (also in
#: csrc/delta.cpp, kGateFloor): e^{−100} ≈ 3.7e-44, so a stronger gate forgets just as completely.
GATE_FLOOR = -100.0


def normalize_rows(x: torch.Tensor):
    """(x / √(‖x‖² + ε), 1 / √(‖x‖² + ε)) over the last dim. A row whose ‖x‖² could overflow (max|x| above
    √(max float / D) / 2, ≈ 1.8e19 / (2√D) in float32) is summed as x / m, m = max|x|:
    √(‖x‖² + ε) = m √(‖x/m‖² + ε/m²); other rows take exactly the plain formula (divided by s = 1)."""
    m = x.abs().amax(-1, keepdim=True)
    big = (m > (torch.finfo(x.dtype).max / max(1, x.shape[-1])) ** 0.5 / 2) & torch.isfinite(m)
    s = torch.where(big, m, torch.ones_like(m))
    y = x / s
    r = torch.rsqrt((y * y).sum(-1, keepdim=True) + L2_EPS / (s * s)) / s
    return x * r, r


def normalize_rows_grad(n: torch.Tensor, r: torch.Tensor, dn: torch.Tensor) -> torch.Tensor:
    """∂L/∂x of n = x·r, r = (‖x‖² + ε)^{-1/2}, from ∂L/∂n: r (dn − n (n · dn))."""
    return r * (dn - n * (n * dn).sum(-1, keepdim=True))


@functools.lru_cache(maxsize=16)
def _upper(c: int, device: torch.device) -> torch.Tensor:
    """(c, c) bool, True strictly above the diagonal (cached: never written to; made outside inference
    mode, as subchunk's)."""
    with torch.inference_mode(False):
        return torch.ones(c, c, dtype=torch.bool, device=device).triu_(1)


class _Features:
    """q̂ = scale · n(q), k̂ = n(k) of one block, in the state dtype, with what the backward needs to
    chain their gradients to q and k."""

    def __init__(self, q, k, scale, l2norm, sdt):
        q, k = q.to(sdt), k.to(sdt)
        self.scale, self.l2norm = scale, l2norm
        self.rq = self.rk = None
        if l2norm:
            q, self.rq = normalize_rows(q)
            k, self.rk = normalize_rows(k)
        self.nq = q  # n(q), before the scale
        self.q = q if scale is None else q * scale
        self.k = k

    def grads(self, dq, dk):
        """∂L/∂(q, k) from ∂L/∂(q̂, k̂)."""
        if self.scale is not None:
            dq = dq * self.scale
        if self.l2norm:
            dq = normalize_rows_grad(self.nq, self.rq, dq)
            dk = normalize_rows_grad(self.k, self.rk, dk)
        return dq, dk


def _gates(g):
    """b = cumsum(max(g, GATE_FLOOR)) per chunk in float64, then in g's dtype Γ (lower incl. diagonal),
    e^b, e^{b_c − b}, e^{b_c}; None without g. g: (BH, nc, c). The differences of b are taken in float64
    (module doc); Γ is masked before the exponential (e^{−b} alone would overflow)."""
    if g is None:
        return None
    c, sdt = g.shape[-1], g.dtype
    b = g.to(torch.float64).clamp_min(GATE_FLOOR).cumsum(-1)
    gam = (b[..., :, None] - b[..., None, :]).to(sdt).masked_fill_(_upper(c, g.device), float("-inf")).exp_()
    last = b[..., -1:]
    return gam, b.exp().to(sdt), (last - b).exp().to(sdt), last.exp().to(sdt)


def _channel_gates(g):
    """One decay per key channel: b = cumsum(max(g, CHANNEL_GATE_FLOOR)) per chunk in float64, then in g's
    dtype e^b, e^{b_c − b} and e^{b_c}. g: (BH, nc, c, D)."""
    b = g.to(torch.float64).clamp_min(CHANNEL_GATE_FLOOR).cumsum(-2)
    last, dt = b[..., -1:, :], g.dtype
    return b, b.to(dt).exp(), (last - b).to(dt).exp(), last.to(dt).exp()


def _scores(Q, K, g):
    """The gate terms of a block: (KKG = strict_tril(K Kᵀ ⊙ Γ), P = tril(Q Kᵀ ⊙ Γ), Kb = diag(e^b) K,
    Kl = diag(e^{b_c − b}) K, Qb = diag(e^b) Q, the state's decay per chunk (None; (BH, nc, 1, 1); or
    (BH, nc, D, 1) per channel), the scalar gates (`_gates`) or None). Differentiable where g is per
    channel (that backward runs autograd over it)."""
    if per_channel(g):
        b, eb, el, elast = _channel_gates(g)
        KK, P = pair_products(Q, K, b)
        return KK.tril(-1), P, K * eb, K * el, Q * eb, elast[..., 0, :, None], None
    KK, QK = K @ K.mT, Q @ K.mT
    gates = _gates(g)
    if gates is None:
        return KK.tril(-1), QK.tril(), K, K, Q, None, None
    gam, eb, el, elast = gates
    return (KK * gam).tril_(-1), QK * gam, K * eb[..., None], K * el[..., None], Q * eb[..., None], \
        elast[..., None], gates


def _block_forward(Q, K, V, beta, g, S):
    """The forward of one block of nc chunks. Q, K (BH, nc, c, D), V (BH, nc, c, E), beta (BH, nc, c),
    g (BH, nc, c), (BH, nc, c, D) or None, S (BH, D, E) entering the block. Returns (O, S after the block,
    everything the backward needs)."""
    c = Q.shape[-2]
    KKG, P, Kb, Kl, Qb, decay, gates = _scores(Q, K, g)
    A = beta[..., :, None] * KKG
    Linv = torch.linalg.solve_triangular(A, eye(c, A.dtype, A.device), upper=False, unitriangular=True)
    T = Linv * beta[..., None, :]  # L⁻¹ diag(β)
    U, W = T @ V, T @ Kb
    S_before, Vp = [], []
    for n in range(Q.shape[1]):
        S_before.append(S)
        vp = torch.baddbmm(U[:, n], W[:, n], S, alpha=-1)
        Vp.append(vp)
        S = torch.baddbmm(S if decay is None else S * decay[:, n], Kl[:, n].mT, vp)
    S_before, Vp = torch.stack(S_before, 1), torch.stack(Vp, 1)
    O = Qb @ S_before + P @ Vp
    saved = dict(gates=gates, KKG=KKG, P=P, A=A, Linv=Linv, T=T, Kb=Kb, Kl=Kl, Qb=Qb, S_before=S_before, Vp=Vp)
    return O, S, saved


def _block_backward(Q, K, V, beta, dO, R, t):
    """Gradients of one block from dO (BH, nc, c, E) and R = ∂L/∂S after the block, with t the
    `_block_forward` terms. Returns (dQ, dK, dV, dbeta, db, R entering the block); db = ∂L/∂b (None
    without g)."""
    gates, P, Kb, Kl, Qb, S_before, Vp = (t[x] for x in ("gates", "P", "Kb", "Kl", "Qb", "S_before", "Vp"))
    dVp_local, QbdO = P.mT @ dO, Qb.mT @ dO
    R_after, dVp, dX = [], [], []
    for n in reversed(range(Q.shape[1])):
        R_after.append(R)
        dvp = torch.baddbmm(dVp_local[:, n], Kl[:, n], R)
        dx = t["T"][:, n].mT @ dvp
        dVp.append(dvp)
        dX.append(dx)
        R = torch.baddbmm((R if gates is None else R * gates[3][:, n, :, None]) + QbdO[:, n], Kb[:, n].mT, dx, alpha=-1)
    R_after, dVp, dX = (torch.stack(x[::-1], 1) for x in (R_after, dVp, dX))
    Z = t["Linv"].mT @ dVp  # dX = diag(β) Z
    X = V - Kb @ S_before
    dA = (Z @ Vp.mT).tril_(-1).neg_()
    dbeta = (Z * X).sum(-1) + (dA * t["KKG"]).sum(-1)
    dP = (dO @ Vp.mT).tril_()
    H = dA * beta[..., :, None]
    dQb, dKb, dKl = dO @ S_before.mT, -(dX @ S_before.mT), Vp @ R_after.mT
    if gates is None:
        dPG = dP
        dQ = torch.matmul(dPG, K).add_(dQb)
        dK = (H + H.mT) @ K + dPG.mT @ Q + dKb + dKl
        return dQ, dK, dX, dbeta, None, R
    gam, eb, el, elast = gates
    dPG, H = dP * gam, H * gam
    dQ = dPG @ K + dQb * eb[..., None]
    dK = (H + H.mT) @ K + dPG.mT @ Q + dKb * eb[..., None] + dKl * el[..., None]
    from_l = (dKl * Kl).sum(-1)
    db = (dQb * Qb).sum(-1) + (dKb * Kb).sum(-1) - from_l
    db[..., -1] += from_l.sum(-1) + elast[..., 0] * (S_before * R_after).sum((-1, -2))
    G = dP * P + dA * t["A"]
    db += G.sum(-1) - G.sum(-2)
    return dQ, dK, dX, dbeta, db, R


class ChunkedDeltaRule(torch.autograd.Function):
    """apply(chunk, scale, l2norm, q, k, v, beta, g, S0) -> (o, S): the delta rule over (B, H, N, ·)
    tensors from the state S0 (B, H, D, E) in the state dtype; g (B, H, N), (B, H, N, D) or None."""

    @staticmethod
    def forward(ctx, chunk, scale, l2norm, q, k, v, beta, g, S0):
        b, h, n, d = q.shape
        e, bh, sdt = v.shape[-1], b * h, state_dtype(q.dtype)
        blocks = chunk_blocks(n, chunk, bh, max(d, e, chunk, d * e // chunk))
        o = torch.empty(b, h, n, e, dtype=q.dtype, device=q.device)
        S = S0.to(sdt).reshape(bh, d, e)
        S_in = []
        with torch.no_grad():
            for s, t, c in blocks:
                S_in.append(S)
                Q, K, V, bt, gt = _block_inputs(q, k, v, beta, g, s, t, c, scale, l2norm, sdt)[1:]
                O, S, _ = _block_forward(Q, K, V, bt, gt, S)
                o[:, :, s:t] = O.reshape(b, h, t - s, e)
        ctx.chunk, ctx.scale, ctx.l2norm, ctx.blocks, ctx.S0_dtype = chunk, scale, l2norm, blocks, S0.dtype
        ctx.has_g, ctx.op_name = g is not None, op_name(g)
        ctx.save_for_backward(q, k, v, beta, *([g] if g is not None else []), *S_in)
        ctx.set_materialize_grads(False)
        return o, S.reshape(b, h, d, e)

    @staticmethod
    @first_order("delta_rule")  # named by ctx.op_name
    @torch.autograd.function.once_differentiable
    def backward(ctx, do, dS):
        q, k, v, beta, *rest = ctx.saved_tensors
        g, S_in = (rest[0], rest[1:]) if ctx.has_g else (None, rest)
        b, h, n, d = q.shape
        e, bh, sdt = v.shape[-1], b * h, state_dtype(q.dtype)
        R = torch.zeros(bh, d, e, dtype=sdt, device=q.device) if dS is None else dS.to(sdt).reshape(bh, d, e)
        if per_channel(g):
            return (None, None, None, *_channel_backward(ctx, (q, k, v, beta, g), S_in, do, R))
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        dbeta = torch.empty(b, h, n, dtype=sdt, device=q.device)
        dg = None if g is None else torch.empty(b, h, n, dtype=sdt, device=q.device)
        for i in reversed(range(len(ctx.blocks))):
            s, t, c = ctx.blocks[i]
            m = t - s
            feats, Q, K, V, bt, gt = _block_inputs(q, k, v, beta, g, s, t, c, ctx.scale, ctx.l2norm, sdt)
            _, _, terms = _block_forward(Q, K, V, bt, gt, S_in[i])
            dO = (torch.zeros(bh, m // c, c, e, dtype=sdt, device=q.device) if do is None
                  else do[:, :, s:t].to(sdt).reshape(bh, m // c, c, e))
            dQ, dK, dV, dbt, db, R = _block_backward(Q, K, V, bt, dO, R, terms)
            dQ, dK = feats.grads(dQ.reshape(b, h, m, d), dK.reshape(b, h, m, d))
            dq[:, :, s:t], dk[:, :, s:t], dv[:, :, s:t] = dQ, dK, dV.reshape(b, h, m, e)
            dbeta[:, :, s:t] = dbt.reshape(b, h, m)
            if db is not None:  # ∂L/∂g_s = Σ_{t ≥ s in the chunk} ∂L/∂b_t (0 where g was clamped)
                dgt = db.flip(-1).cumsum(-1).flip(-1).reshape(b, h, m)
                dg[:, :, s:t] = dgt.masked_fill_(g[:, :, s:t] < GATE_FLOOR, 0)
        return (None, None, None, dq, dk, dv, dbeta.to(beta.dtype), None if g is None else dg.to(g.dtype),
                R.reshape(b, h, d, e).to(ctx.S0_dtype))


def _channel_backward(ctx, inputs, S_in, do, R):
    """The gradients of q, k, v, beta, g (per channel) and S0: each block recomputed with autograd from
    its saved state, in reverse, R = ∂L/∂S carried from block to block."""
    q, v = inputs[0], inputs[2]
    b, h, _, d = q.shape
    e, sdt = v.shape[-1], state_dtype(q.dtype)
    grads = [torch.empty_like(x) for x in inputs]
    for i in reversed(range(len(ctx.blocks))):
        s, t, c = ctx.blocks[i]
        with torch.enable_grad():
            xs = [x[:, :, s:t].detach().requires_grad_() for x in inputs]
            S = S_in[i].detach().requires_grad_()
            _, Q, K, V, bt, gt = _block_inputs(*xs, 0, t - s, c, ctx.scale, ctx.l2norm, sdt)
            O, S_out, _ = _block_forward(Q, K, V, bt, gt, S)
            O = O.reshape(b, h, t - s, e)
            dO = torch.zeros_like(O) if do is None else do[:, :, s:t].to(sdt)
            *got, R = torch.autograd.grad((O, S_out), (*xs, S), (dO, R), allow_unused=True)
        for full, part in zip(grads, got):
            full[:, :, s:t] = 0 if part is None else part
    return (*grads, R.reshape(b, h, d, e).to(ctx.S0_dtype))


def _block_inputs(q, k, v, beta, g, s, t, c, scale, l2norm, sdt):
    """The block [s, t) as (features, Q, K (BH, nc, c, D), V (BH, nc, c, E), β (BH, nc, c), g (BH, nc, c)
    or (BH, nc, c, D)) in sdt."""
    b, h = q.shape[:2]
    feats = _Features(q[:, :, s:t], k[:, :, s:t], scale, l2norm, sdt)
    per = (b * h, (t - s) // c, c)
    Q, K = feats.q.reshape(*per, -1), feats.k.reshape(*per, -1)
    V = v[:, :, s:t].to(sdt).reshape(*per, -1)
    bt = beta[:, :, s:t].to(sdt).reshape(per)
    gt = None if g is None else g[:, :, s:t].to(sdt).reshape(*per, *g.shape[3:])
    return feats, Q, K, V, bt, gt
