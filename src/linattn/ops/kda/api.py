"""The public KDA operators: `kda` (causal, chunked), `kda_step` (recurrent) and `kda_affine_form`.

Kimi Delta Attention (Kimi Linear, Moonshot AI 2025; design §18): the delta rule with one forget
gate per key channel. Per (batch, head), with q̂_t = scale · n(q_t), k̂_t = n(k_t) (n the L2
normalization x / √(‖x‖² + ε), ε = 1e-6, with qk_l2norm=True, else the identity) and
α_t = e^{g_t} ∈ (0, 1]^D:

    S_t = (I − β_t k̂_t k̂_tᵀ) Diag(α_t) S_{t−1} + β_t k̂_t v_tᵀ        o_t = S_tᵀ q̂_t

Gated DeltaNet is the case of g_t equal across the D channels. The state S is (B, H, D, E), float32
(float64 for float64 inputs) whatever the input dtype. As for the delta rule keep β_t ‖k̂_t‖² ≤ 2
(e.g. qk_l2norm=True) for a recurrence that never amplifies the state.
"""

from __future__ import annotations

import torch

from ..precision import without_autocast
from ..._checks import check_positive_int
from ..affine import AffineForm
from ..linear.chunked import DEFAULT_CHUNK_SIZE, state_dtype
from ..delta.chunked import normalize_rows
from ..nonfinite import all_finite
from .checks import check_arguments, check_values
from .chunked import ChunkedKDA
from .exact import exact_kda


@without_autocast
def kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor,
    *,
    scale: float | None = None,
    qk_l2norm: bool = False,
    initial_state: torch.Tensor | None = None,
    return_state: bool = False,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    cu_seqlens: torch.Tensor | None = None,
):
    """KDA over a whole sequence (causal), in the chunked WY/UT form (`linattn.ops.kda.chunked`).

    q, k: (B, H, N, D); v: (B, H, N, E); beta: (B, H, N) in (0, 1]; g: (B, H, N, D) log-decays ≤ 0,
    one per key channel (finite; any strength: −1e30 resets the channel exactly). Returns o
    (B, H, N, E) in q's dtype, or (o, S) with return_state, S (B, H, D, E) the state after the last
    token.

    scale: multiplies q (after the L2 normalization; None: no scaling).
    qk_l2norm: L2-normalize q and k inside the op (the gradient flows through the normalization).
    initial_state: S (B, H, D, E) in the state dtype (float32; float64 for float64 inputs) carried from
        the tokens before; a sequence split in two and resumed from the state gives the same output.
    chunk_size: tokens per chunk (any positive int; N need not be a multiple).
    cu_seqlens: packed sequences (design §16): B = 1 and a LongTensor [S+1] of cumulative lengths from 0
        to N; every sequence starts from zeros (or initial_state[i], initial_state then (S, H, D, E)) and
        the states come back one per sequence, (S, H, D, E). Each sequence runs on its own.

    Gradients reach q, k, v, beta, g and initial_state (the backward recomputes one block of chunks at a
    time). NaN and Inf respect causality: one at token j changes no output before j and no gradient of
    a loss over those outputs (an exact, slower pass: `linattn.ops.kda.exact`).
    """
    check_positive_int("chunk_size", chunk_size)
    if cu_seqlens is not None:
        return _packed(q, k, v, beta, g, scale, qk_l2norm, initial_state, return_state, chunk_size, cu_seqlens)
    check_arguments(q, k, v, beta, g, scale, qk_l2norm, initial_state)
    check_values(beta, g)
    o, S = _run(q, k, v, beta, g, scale, qk_l2norm, initial_state, chunk_size)
    return (o, S) if return_state else o


def _run(q, k, v, beta, g, scale, qk_l2norm, initial_state, chunk_size):
    """(o, S) of checked arguments, with the exact pass where a value is not finite."""
    sdt = state_dtype(q.dtype)
    b, h, _, d = q.shape
    S0 = torch.zeros(b, h, d, v.shape[-1], dtype=sdt, device=q.device) if initial_state is None else initial_state
    scale = None if scale is None else float(scale)

    def run(q, k, v, beta, g, S0):
        return ChunkedKDA.apply(chunk_size, scale, qk_l2norm, q, k, v, beta, g, S0)

    o, S = run(q, k, v, beta, g, S0)
    grads = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v, beta, g, S0))
    if not all_finite(S) or (grads and not all_finite(q)):  # a NaN or Inf: the exact pass (ops.kda.exact)
        o, S = exact_kda(run, q, k, v, beta, g, S0)
    return o, S


def _packed(q, k, v, beta, g, scale, qk_l2norm, initial_state, return_state, chunk_size, cu_seqlens):
    """`kda` with cu_seqlens: each packed sequence on its own (design §16)."""
    check_arguments(q, k, v, beta, g, scale, qk_l2norm, None)
    bounds = _check_cu_seqlens(cu_seqlens, q.shape[0], q.shape[2])
    b, h, n, d = q.shape
    e, sdt = v.shape[-1], state_dtype(q.dtype)
    count = len(bounds) - 1
    if initial_state is not None:
        from ..delta.checks import check_state
        check_state(initial_state, (count, h, d, e), sdt, q.device, "initial_state")
    check_values(beta, g)
    outs, states = [], []
    for i in range(count):
        s, t = bounds[i], bounds[i + 1]
        S0 = None if initial_state is None else initial_state[i:i + 1]
        if t == s:
            states.append(torch.zeros(1, h, d, e, dtype=sdt, device=q.device) if S0 is None else S0)
            continue
        o, S = _run(q[:, :, s:t], k[:, :, s:t], v[:, :, s:t], beta[:, :, s:t], g[:, :, s:t], scale, qk_l2norm, S0,
                    chunk_size)
        outs.append(o)
        states.append(S)
    o = torch.cat(outs, 2) if outs else q.new_zeros(b, h, 0, e)
    return (o, torch.cat(states, 0)) if return_state else o


def _check_cu_seqlens(cu_seqlens, batch: int, n: int) -> list[int]:
    """cu_seqlens as a list of ints: an integer tensor [S+1], 0 first, n last, non-decreasing; B = 1."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.is_floating_point() \
            or cu_seqlens.numel() < 2:
        raise TypeError("cu_seqlens must be an integer tensor [S+1] of cumulative lengths, got "
                        f"{cu_seqlens.dtype if isinstance(cu_seqlens, torch.Tensor) else type(cu_seqlens).__name__}")
    if batch != 1:
        raise ValueError(f"with cu_seqlens the batch must be 1 (sequences packed along N), got B = {batch}")
    bounds = [int(x) for x in cu_seqlens.tolist()]
    if bounds[0] != 0 or bounds[-1] != n or any(a > b for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens must rise from 0 to N = {n}, got {bounds}")
    return bounds


def kda_affine_form(q, k, v, beta, g, *, scale: float | None = None, qk_l2norm: bool = False,
                    chunk_size: int = DEFAULT_CHUNK_SIZE) -> AffineForm:
    """`kda` on a span as an affine function of its initial state (`linattn.ops.affine`):

        o_t = o⁰_t + S_0ᵀ P_tᵀ q̂_t,     S_n = A S_0 + ΔS,     A = P_n,
        P_t = T_t ⋯ T_1,   T_t = (I − β_t k̂_t k̂_tᵀ) Diag(α_t),

    from one run of the op on D + E value columns [0 | v] from the initial state [I | 0]: by
    linearity its state after token t is [P_t | S⁰_t] and its output [P_tᵀ q̂_t | o⁰_t]. Returns the
    AffineForm (out0 (B, H, n, E) and query (B, H, n, D) in q's dtype, transition A (B, H, D, D) and
    state ΔS (B, H, D, E) in the state dtype); gradients flow to q, k, v, beta and g."""
    check_arguments(q, k, v, beta, g, scale, qk_l2norm, None)
    b, h, n, d = q.shape
    sdt = state_dtype(q.dtype)
    S0 = torch.zeros(b, h, d, d + v.shape[-1], dtype=sdt, device=q.device)
    S0[..., :d] = torch.eye(d, dtype=sdt, device=q.device)
    values = torch.cat((v.new_zeros(b, h, n, d), v), -1)
    o, S = kda(q, k, values, beta, g, scale=scale, qk_l2norm=qk_l2norm, initial_state=S0, return_state=True,
               chunk_size=chunk_size)
    return AffineForm(o[..., d:], o[..., :d], S[..., :d], S[..., d:])


def kda_step(
    state: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor,
    *,
    scale: float | None = None,
    qk_l2norm: bool = False,
):
    """The recurrent form: returns (o, new_state); `state` is not modified.

        S_α = Diag(α) S,   u = S_αᵀ k̂,   S' = S_α + k̂ (β (v − u))ᵀ   (= (I − β k̂k̂ᵀ) Diag(α) S + β k̂ vᵀ),
        o = S'ᵀ q̂

    state: S (B, H, D, E) in the state dtype, or None to start from zeros. q, k (B, H, T, D), v
    (B, H, T, E), beta (B, H, T), g (B, H, T, D): T = 1 is the decoding path (one fused operator on
    the CPU for fp32, fp64 and bf16 when no gradient is wanted and the kernels are built); a block of
    T > 1 tokens runs `kda` from the state.
    """
    if q.dim() == 4 and q.shape[2] != 1:
        return kda(q, k, v, beta, g, scale=scale, qk_l2norm=qk_l2norm, initial_state=state, return_state=True)
    check_arguments(q, k, v, beta, g, scale, qk_l2norm, state, state_name="state")
    sdt = state_dtype(q.dtype)
    if state is None:
        state = torch.zeros(*q.shape[:2], q.shape[3], v.shape[3], dtype=sdt, device=q.device)
    from . import fused  # the C++ step, where built
    if fused.usable(q) and not (torch.is_grad_enabled() and any(
            t.requires_grad for t in (state, q, k, v, beta, g))):
        return fused.step(state, q, k, v, beta.to(sdt), g.to(sdt), scale=scale, l2norm=qk_l2norm)
    check_values(beta, g)
    return _step(state, q, k, v, beta, g, scale, qk_l2norm)


def _step(S, q, k, v, beta, g, scale, l2norm):
    """One token with torch ops (autograd-friendly). Shapes as in `kda_step`, T = 1."""
    out_dtype, sdt = q.dtype, S.dtype
    q, k, v = q[:, :, 0].to(sdt), k[:, :, 0].to(sdt), v[:, :, 0].to(sdt)  # (B, H, D), (B, H, E)
    if l2norm:
        q, k = normalize_rows(q)[0], normalize_rows(k)[0]
    if scale is not None:
        q = q * scale
    S = g[:, :, 0].to(sdt).exp().unsqueeze(-1) * S  # Diag(α) S
    u = (k.unsqueeze(-2) @ S).squeeze(-2)  # S_αᵀ k̂ (B, H, E)
    S_new = S + k.unsqueeze(-1) * (beta.to(sdt) * (v - u)).unsqueeze(-2)
    o = q.unsqueeze(-2) @ S_new  # (B, H, 1, E)
    return o.to(out_dtype), S_new
