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
a strong gate (NaN gradients at g = −1e4). Here the chunk is cut into sub-chunks of s rows; for i
in sub-chunk I and j in an earlier one, e^{b_i − b_j} = e^{b_i − b_r} · e^{b_r − b_j} with r the
row just before I (both exponents ≤ 0, so nothing overflows and a factor that underflows stands for
a product that is smaller still), and inside a sub-chunk the s×s×D factors e^{b_i − b_j} (j ≤ i) are
formed one by one. The cumulative sums b are taken in float64 from g clamped at FLOOR = −100 (e^{−100}
≈ 4e-44 underflows anyway): after one g = −1e30 the differences of a float64 b without the floor
lose the small gates (design §13).

Autograd: `ChunkedKDA` runs the blocks of whole chunks (`linattn.ops.chunked._blocks`) without a graph
and saves q, k, v, β, g and the state entering each block; its backward recomputes one block at a
time with autograd from that state and the gradient R = ∂L/∂S after the block, so temporaries are
bounded by the block (nothing of size N·c or N·s·D is kept). Computed in the state dtype (float32;
float64 for float64 inputs).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ..chunked import _blocks, state_dtype
from ..delta.chunked import normalize_rows

#: g is clamped at this floor before the cumulative sums (e^{−100} ≈ 4e-44: below every rounding).
FLOOR = -100.0
#: Rows per sub-chunk: pairs inside one are formed channel by channel (s·D factors per row).
SUB_CHUNK = 16


@functools.lru_cache(maxsize=16)
def _masks(n: int, s: int, device: torch.device):
    """(before (n, n·s): column j lies in a sub-chunk before I; above (s, s): j > i), cached."""
    c = n * s
    before = torch.arange(c, device=device)[None, :] < (torch.arange(n, device=device)[:, None] * s)
    above = torch.ones(s, s, dtype=torch.bool, device=device).triu_(1)
    return before, above


@functools.lru_cache(maxsize=16)
def _eye(c: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.eye(c, dtype=dtype, device=device)


def pair_products(Q: torch.Tensor, K: torch.Tensor, b: torch.Tensor, s: int):
    """(KK, QK), each (M, c, c): X_ij = Σ_d x_id k_jd e^{b_id − b_jd} for j ≤ i, 0 above the diagonal.
    Q, K (M, c, D) in the compute dtype, b (M, c, D) the in-chunk cumulative log-decays in float64,
    s a divisor of c (module doc: sub-chunk references below the diagonal blocks, channel-wise factors
    inside them)."""
    m, c, d = K.shape
    n, dt = c // s, K.dtype
    before, above = _masks(n, s, K.device)
    bs = b.view(m, n, s, d)
    ref = torch.cat((torch.zeros_like(bs[:, :1, 0]), bs[:, :-1, -1]), 1)  # b at the row before each sub-chunk
    rel = (bs - ref[:, :, None]).to(dt).exp()  # e^{b_i − b_r(I)} ≤ 1 (M, n, s, D)
    Ks, Qs = K.view(m, n, s, d) * rel, Q.view(m, n, s, d) * rel
    expo = (ref[:, :, None, :] - b[:, None, :, :]).masked_fill_(~before[None, :, :, None], float("-inf"))
    Kp = K[:, None] * expo.to(dt).exp()  # k_j e^{b_r(I) − b_j} for j before sub-chunk I, else 0 (M, n, c, D)
    KK, QK = Ks @ Kp.mT, Qs @ Kp.mT  # (M, n, s, c): the blocks below the diagonal
    diff = (bs[:, :, :, None, :] - bs[:, :, None, :, :]).masked_fill_(above[None, None, :, :, None], float("-inf"))
    EK = diff.to(dt).exp() * K.view(m, n, 1, s, d)  # e^{b_i − b_j} k_j for j ≤ i in the sub-chunk (M, n, s, s, D)
    KKd = (EK @ K.view(m, n, s, d, 1)).squeeze(-1)  # (M, n, s, s): Σ_d e^{…} k_jd k_id
    QKd = (EK @ Q.view(m, n, s, d, 1)).squeeze(-1)
    diag = _eye(n, dt, K.device)[None, :, None, :, None]  # places (M, n, s, s) on the diagonal blocks
    KK = KK.view(m, n, s, n, s) + KKd[:, :, :, None, :] * diag
    QK = QK.view(m, n, s, n, s) + QKd[:, :, :, None, :] * diag
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
        blocks = _blocks(n, chunk, bh, max(d, e, chunk, d * e // chunk))
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
