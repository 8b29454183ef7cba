"""KDA, chunked, with torch ops: the WY/UT form of the delta rule (design §13) with one decay per key
channel (design §18), exact after strong gates, and a backward that recomputes one block at a time.

Per (batch, head), a chunk of c rows with keys K, queries Q (already normalized and scaled), values V
(c×E), β, the per-channel log-decays g (c×D) and b = their inclusive cumulative sum inside the chunk,
the state S (D×E) entering it. Writing u_t = β_t (v_t − k_tᵀ Diag(α_t) S_{t−1}) (the corrected
value), the recurrence unrolls to S_t = Diag(e^{b_t}) S + Σ_{j≤t} Diag(e^{b_t − b_j}) k_j u_jᵀ, so

    A_ij = β_i Σ_d k_id k_jd e^{b_id − b_jd}   (j < i)        L = I + A   (unit lower triangular)
    P_ij =     Σ_d q_id k_jd e^{b_id − b_jd}   (j ≤ i)
    U    = L⁻¹ diag(β) (V − (K ⊙ e^b) S)                       (the corrected values)
    O    = (Q ⊙ e^b) S + P U
    S   ← Diag(e^{b_c}) S + (K ⊙ e^{b_c − b})ᵀ U

Every factor of the last three lines is e^{x} with x ≤ 0. A and P need e^{b_i − b_j} per channel,
which FLA's and transformers' chunk forms write as (K ⊙ e^b)(K ⊙ e^{−b})ᵀ: e^{−b} overflows after
a strong gate (NaN gradients at g = −1e4). Here the chunk is cut into sub-chunks of s = 8 rows
(`pair_products`): for i and j in different sub-chunks e^{b_i − b_j} is a product of three factors
e^{x ≤ 0} split at the sub-chunks' boundaries (nothing overflows, and a factor that underflows stands
for a product smaller still); inside one, e^{b_i − b_f} · e^{b_f − b_j} about its first row f, in
float64, where the floor keeps e^{b_f − b_j} ≤ e^{7·80} finite. The cumulative sums b are taken in
float64 from g clamped at FLOOR = −80 (e^{−80} ≈ 2e-35 underflows anyway in float32 and is far below
rounding in float64): after one g = −1e30 the differences of a float64 b without the floor
lose the small gates (design §13).

Autograd: `ChunkedKDA` runs the blocks of whole chunks (`linattn.ops.linear.chunked.chunk_blocks`) without a graph
and saves q, k, v, β, g and the state entering each block; its backward recomputes one block at a
time with autograd from that state and the gradient R = ∂L/∂S after the block, so temporaries are
bounded by the block (nothing of size N·c or N·s·D is kept). Computed in the state dtype (float32;
float64 for float64 inputs).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ..linear.chunked import chunk_blocks, state_dtype
from ..delta.chunked import normalize_rows

#: g is clamped at this floor before the cumulative sums (e^{−80} ≈ 2e-35: below every rounding).
FLOOR = -80.0
#: Rows per sub-chunk: (SUB_CHUNK − 1)·|FLOOR| must stay below 709 (e^x finite in float64).
SUB_CHUNK = 8


@functools.lru_cache(maxsize=16)
def _masks(n: int, s: int, device: torch.device):
    """(later (n, n): sub-chunk J is not before I; above (s, s): j > i), cached."""
    later = torch.ones(n, n, dtype=torch.bool, device=device).triu_()
    above = torch.ones(s, s, dtype=torch.bool, device=device).triu_(1)
    return later, above


@functools.lru_cache(maxsize=16)
def _eye(c: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.eye(c, dtype=dtype, device=device)


def pair_products(Q: torch.Tensor, K: torch.Tensor, b: torch.Tensor, s: int):
    """(KK, QK), each (M, c, c): X_ij = Σ_d x_id k_jd e^{b_id − b_jd} for j ≤ i, 0 above the diagonal.
    Q, K (M, c, D) in the compute dtype, b (M, c, D) the in-chunk cumulative log-decays in float64 (of
    g ≥ FLOOR), s a divisor of c.

    Sub-chunk I, rows [Is, Is + s), has b_f (its first row), b_< (the row before it; 0 for I = 0) and
    b_> (its last row). Below the diagonal blocks, i in I and j in J < I:
    e^{b_i − b_j} = e^{b_i − b_<(I)} · e^{b_<(I) − b_>(J)} · e^{b_>(J) − b_j}, three factors ≤ 1. Inside a
    block, in float64: e^{b_i − b_f} ≤ 1 times e^{b_f − b_j} ≤ e^{(s−1)·|FLOOR|} (finite), the entries
    above the diagonal masked before they are rounded to the compute dtype."""
    m, c, d = K.shape
    n, dt, f64 = c // s, K.dtype, torch.float64
    later, above = _masks(n, s, K.device)
    bs = b.view(m, n, s, d)
    Kv, Qv = K.view(m, n, s, d), Q.view(m, n, s, d)
    lo, hi = (bs - bs[:, :, :1]).exp(), (bs[:, :, :1] - bs).exp()
    rows = torch.cat((Kv, Qv), 2)  # [K; Q] of each sub-chunk (M, n, 2s, D): one product for both
    inner = ((rows.to(f64) * lo.repeat(1, 1, 2, 1)) @ (Kv.to(f64) * hi).mT).masked_fill_(above.repeat(2, 1), 0)
    before = torch.cat((torch.zeros_like(bs[:, :1, 0]), bs[:, :-1, -1]), 1)  # b_<(I) (M, n, D)
    left = rows * (bs - before[:, :, None]).to(dt).exp().repeat(1, 1, 2, 1)
    Kr = Kv * (bs[:, :, -1:] - bs).to(dt).exp()  # k_j e^{b_>(J) − b_j}
    G = (before[:, :, None] - bs[:, None, :, -1]).masked_fill_(later[..., None], float("-inf")).to(dt).exp()
    Kp = (Kr[:, None] * G[:, :, :, None]).view(m, n, c, d)  # k_j e^{b_<(I) − b_j} for j before sub-chunk I, else 0
    outer = left @ Kp.mT  # (M, n, 2s, c): the blocks below the diagonal
    diag = _eye(n, dt, K.device)[None, :, None, :, None]  # places (M, n, 2s, s) on the diagonal blocks
    both = outer.view(m, n, 2 * s, n, s) + inner.to(dt)[:, :, :, None, :] * diag
    KK, QK = both[:, :, :s], both[:, :, s:]
    return KK.reshape(m, c, c), QK.reshape(m, c, c)


def chunk_forward(Q, K, V, beta, g, S, sub: int = SUB_CHUNK):
    """The forward of one block of nc chunks of c rows: Q, K (BH, nc, c, D), V (BH, nc, c, E), beta
    (BH, nc, c), g (BH, nc, c, D), S (BH, D, E) entering the block, all in the compute dtype. Returns
    (O (BH, nc, c, E), S after the block). Differentiable (the backward of `ChunkedKDA` runs it under
    autograd)."""
    bh, nc, c, d = Q.shape
    s = min(sub, c)
    pad = -c % s
    if pad:  # rows with k = 0, g = 0 change nothing; their outputs are dropped
        Q, K, V, g = (F.pad(x, (0, 0, 0, pad)) for x in (Q, K, V, g))
        beta = F.pad(beta, (0, pad))
    cp = c + pad
    b = g.to(torch.float64).clamp_min(FLOOR).cumsum(-2)  # (BH, nc, cp, D)
    KK, QK = pair_products(Q.reshape(-1, cp, d), K.reshape(-1, cp, d), b.reshape(-1, cp, d), s)
    A = (KK.view(bh, nc, cp, cp) * beta[..., :, None]).tril(-1)
    P = QK.view(bh, nc, cp, cp)
    Linv = torch.linalg.solve_triangular(A, _eye(cp, A.dtype, A.device), upper=False, unitriangular=True)
    T = Linv * beta[..., None, :]  # L⁻¹ diag(β)
    last = b[..., -1:, :]
    dt = Q.dtype
    eb, el, elast = b.to(dt).exp(), (last - b).to(dt).exp(), last.to(dt).exp()
    Kb, Kl = K * eb, K * el
    U, W = T @ V, T @ Kb
    S_before, Vp = [], []
    for n in range(nc):
        S_before.append(S)
        vp = torch.baddbmm(U[:, n], W[:, n], S, alpha=-1)
        Vp.append(vp)
        S = torch.baddbmm(S * elast[:, n, 0, :, None], Kl[:, n].mT, vp)
    S_before, Vp = torch.stack(S_before, 1), torch.stack(Vp, 1)
    O = (Q * eb) @ S_before + P @ Vp
    return (O[:, :, :c] if pad else O), S


def block_forward(q, k, v, beta, g, S, c: int, scale, l2norm: bool, sub: int = SUB_CHUNK):
    """One block of whole chunks of c rows: q, k (B, H, m, D), v (B, H, m, E), beta (B, H, m), g
    (B, H, m, D) as given (normalized, scaled and cast to S's dtype here), S (B·H, D, E). Returns
    (O (B, H, m, E) in S's dtype, S after the block)."""
    b, h, m, d = q.shape
    sdt = S.dtype
    q, k = q.to(sdt), k.to(sdt)
    if l2norm:
        q, k = normalize_rows(q)[0], normalize_rows(k)[0]
    if scale is not None:
        q = q * scale
    per = (b * h, m // c, c)
    O, S = chunk_forward(q.reshape(*per, d), k.reshape(*per, d), v.to(sdt).reshape(*per, -1),
                         beta.to(sdt).reshape(per), g.to(sdt).reshape(*per, d), S, sub)
    return O.reshape(b, h, m, -1), S


class ChunkedKDA(torch.autograd.Function):
    """apply(chunk, scale, l2norm, q, k, v, beta, g, S0) -> (o, S): KDA over (B, H, N, ·) tensors
    from the state S0 (B, H, D, E) in the state dtype (module doc). Not twice differentiable."""

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
                O, S = block_forward(q[:, :, s:t], k[:, :, s:t], v[:, :, s:t], beta[:, :, s:t], g[:, :, s:t], S, c,
                                     scale, l2norm)
                o[:, :, s:t] = O
        ctx.scale, ctx.l2norm, ctx.blocks, ctx.S0_dtype = scale, l2norm, blocks, S0.dtype
        ctx.save_for_backward(q, k, v, beta, g, *S_in)
        ctx.set_materialize_grads(False)
        return o, S.reshape(b, h, d, e)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do, dS):
        q, k, v, beta, g, *S_in = ctx.saved_tensors
        b, h, n, d = q.shape
        e, sdt = v.shape[-1], state_dtype(q.dtype)
        R = torch.zeros(b * h, d, e, dtype=sdt, device=q.device) if dS is None else dS.to(sdt).reshape(b * h, d, e)
        grads = [torch.empty_like(x) for x in (q, k, v, beta, g)]
        for i in reversed(range(len(ctx.blocks))):
            s, t, c = ctx.blocks[i]
            with torch.enable_grad():
                xs = [x[:, :, s:t].detach().requires_grad_() for x in (q, k, v, beta, g)]
                S = S_in[i].detach().requires_grad_()
                O, S_out = block_forward(*xs, S, c, ctx.scale, ctx.l2norm)
                dO = torch.zeros_like(O) if do is None else do[:, :, s:t].to(sdt)
                *got, R = torch.autograd.grad((O, S_out), (*xs, S), (dO, R), allow_unused=True)
            for full, part in zip(grads, got):
                full[:, :, s:t] = 0 if part is None else part
        return (None, None, None, *grads, R.reshape(b, h, d, e).to(ctx.S0_dtype))
