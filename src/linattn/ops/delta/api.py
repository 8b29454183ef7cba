"""The public delta-rule operators: `delta_rule` (causal, chunked) and `delta_rule_step` (recurrent).

Per (batch, head), with q̂_t = scale · n(q_t), k̂_t = n(k_t) (n the L2 normalization x / √(‖x‖² + ε),
ε = 1e-6, with qk_l2norm=True, else the identity) and α_t = e^{g_t} (1 without g):

    S_t = (I − β_t k̂_t k̂_tᵀ) Diag(α_t) S_{t−1} + β_t k̂_t v_tᵀ        o_t = S_tᵀ q̂_t

DeltaNet (Schlag et al. 2021; Yang et al. 2024) has no g; Gated DeltaNet (Yang et al. 2024b) one
decay per head and token, g (B, H, N), where the transition is α_t (I − β_t k̂_t k̂_tᵀ); Kimi Delta
Attention (KDA; Kimi Linear, Moonshot AI 2025) one per key channel, g (B, H, N, D), Diag(α_t) scaling
the D rows of S. The state S is (B, H, D, E), float32 (float64 for float64 inputs) whatever the input
dtype.
β_t ∈ [0, 2]: above 1 the transition has a negative eigenvalue 1 − β_t (negative eigenvalues, Grazzi
et al. 2024; OLMo-Hybrid's allow_neg_eigval), β_t = 0 writes nothing. For a stable recurrence keep
β_t ‖k̂_t‖² ≤ 2, e.g. with qk_l2norm=True: I − β k̂k̂ᵀ then has spectral norm 1 and never amplifies
the state (unnormalized keys can make it grow exponentially; not checked).
"""

from __future__ import annotations

import torch

from ..precision import without_autocast
from ..._checks import check_positive_int, narrowed_gates
from .. import packed, stepcheck
from ..affine import AffineForm
from ..linear.chunked import DEFAULT_CHUNK_SIZE, state_dtype
from ..autodiff import has_tangent, refuse_forward_ad
from ..nonfinite import all_finite
from . import fused
from .checks import check_arguments, check_state, check_values, op_name, per_channel
from .chunked import ChunkedDeltaRule, normalize_rows
from .exact import exact_delta_rule


@without_autocast
def delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    *,
    g: torch.Tensor | None = None,
    scale: float | None = None,
    qk_l2norm: bool = False,
    initial_state: torch.Tensor | None = None,
    return_state: bool = False,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    cu_seqlens: torch.Tensor | None = None,
):
    """The delta rule over a whole sequence (causal), in the chunked WY/UT form (design §13).

    q, k: (B, H, N, D); v: (B, H, N, E); beta: (B, H, N) in [0, 2]; g: log-decays ≤ 0, (B, H, N)
    (Gated DeltaNet), (B, H, N, D) (KDA: one per key channel) or None (DeltaNet); finite, of any
    strength (−1e30 resets exactly). Returns o (B, H, N, E) in q's dtype, or (o, S) with return_state,
    S (B, H, D, E) the state after the last token.

    scale: multiplies q (after the L2 normalization; None: no scaling).
    qk_l2norm: L2-normalize q and k inside the op (the gradient flows through the normalization).
    initial_state: S (B, H, D, E) in the state dtype (float32; float64 for float64 inputs) carried from
        the tokens before; a sequence split in two and resumed from the state gives the same output.
        Gradients flow into it.
    chunk_size: tokens per chunk (any positive int; N need not be a multiple).
    cu_seqlens: packed sequences (design §17, linattn.ops.packed): a 1-D integer tensor [N+1] of
        cumulative lengths (0 … T) of N sequences laid end to end in a batch of 1; each runs as its own
        call (the state resets at every boundary); initial_state and the returned state are per
        sequence, S (N, H, D, E).

    Gradients reach q, k, v, beta, g and initial_state. On the CPU, fp32, fp64 and bf16 inputs run as
    fused operators forward and backward (csrc/delta.cpp; a per-channel g csrc/kda.cpp); other devices
    and dtypes (and LINATTN_NATIVE=0) run the torch-op path of `linattn.ops.delta.chunked` (same numbers
    up to rounding). First-order reverse mode only (`linattn.ops.autodiff`).

    NaN and Inf respect causality: one at token j changes no output before j and no gradient of a loss
    over those outputs (such a call runs an exact, slower pass: `linattn.ops.delta.exact`).
    """
    check_positive_int("chunk_size", chunk_size)
    if cu_seqlens is not None:
        return _packed(q, k, v, beta, cu_seqlens, g=g, scale=scale, qk_l2norm=qk_l2norm, initial_state=initial_state,
                       return_state=return_state, chunk_size=chunk_size)
    check_arguments(q, k, v, beta, g, scale, qk_l2norm, initial_state)
    check_values(beta, g, g_in_kernel=per_channel(g) and fused.usable(q))
    refuse_forward_ad(op_name(g), q, k, v, beta, g, initial_state)
    chunk_size = min(chunk_size, q.shape[2])  # one chunk at most: no C² work buffer beyond N²
    sdt = state_dtype(q.dtype)
    b, h, _, d = q.shape
    S0 = torch.zeros(b, h, d, v.shape[-1], dtype=sdt, device=q.device) if initial_state is None else initial_state
    scale = None if scale is None else float(scale)

    def run(q, k, v, beta, g, S0):
        if fused.usable(q):
            g = None if g is None else narrowed_gates(g, sdt, lambda x: check_values(beta, x))
            return fused.chunked(q, k, v, beta.to(sdt), g, S0, scale=scale,
                                 l2norm=qk_l2norm, chunk=chunk_size)
        return ChunkedDeltaRule.apply(chunk_size, scale, qk_l2norm, q, k, v, beta, g, S0)

    o, S = run(q, k, v, beta, g, S0)
    grads = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, v, beta, g, S0))
    if not all_finite(S) or (grads and not all_finite(q)):  # a NaN or Inf: the exact pass (ops.delta.exact)
        o, S = exact_delta_rule(run, q, k, v, beta, g, S0)
    return (o, S) if return_state else o


def _packed(q, k, v, beta, cu_seqlens, *, g, scale, qk_l2norm, initial_state, return_state, chunk_size):
    """delta_rule on N packed sequences (cu_seqlens), each one by itself (linattn.ops.packed)."""
    check_arguments(q, k, v, beta, g, scale, qk_l2norm, None)
    bounds = packed.boundaries(cu_seqlens, batch=q.shape[0], length=q.shape[2])
    if initial_state is not None:
        packed.check_state_count(initial_state, len(bounds))
    check_values(beta, g, g_in_kernel=per_channel(g))  # KDA's kernel, or delta_rule per sequence, checks g
    out = _packed_fused(q, k, v, beta, g, cu_seqlens, len(bounds), initial_state, scale=scale, l2norm=qk_l2norm,
                        chunk_size=chunk_size)
    if out is not None:
        return out if return_state else out[0]
    b, h, _, d = q.shape
    e = v.shape[-1]

    def one(spans, state):
        return delta_rule(*(packed.gather(x, spans, 2) for x in (q, k, v, beta)), g=packed.gather(g, spans, 2),
                          scale=scale, qk_l2norm=qk_l2norm, initial_state=state, return_state=True,
                          chunk_size=chunk_size)

    def empty(state):
        return state if state is not None else q.new_zeros(1, h, d, e, dtype=state_dtype(q.dtype))

    o, S = packed.run(one, bounds, initial_state, empty, lambda: q.new_zeros(b, h, 0, e))
    return (o, S) if return_state else o


def _packed_fused(q, k, v, beta, g, cu_seqlens, count: int, initial_state, *, scale, l2norm, chunk_size):
    """The packed call as one fused kernel call given cu_seqlens (linattn.ops.packed.IN_KERNELS) when the
    fused kernels take it: (o, S) with the states of the N sequences; None otherwise, and where a NaN or
    Inf needs the exact pass (the per-sequence path then runs it sequence by sequence)."""
    if not packed.IN_KERNELS or q.shape[2] == 0 or not fused.usable(q):
        return None
    h, d, e, sdt = q.shape[1], q.shape[3], v.shape[-1], state_dtype(q.dtype)
    if initial_state is None:
        S0 = q.new_zeros(count, h, d, e, dtype=sdt)
    else:
        check_state(initial_state, (count, h, d, e), sdt, q.device, "initial_state")
        S0 = initial_state
    refuse_forward_ad(op_name(g), q, k, v, beta, g, S0)
    g = None if g is None else narrowed_gates(g, sdt, lambda x: check_values(beta, x))
    o, S = fused.chunked(q, k, v, beta.to(sdt), g, S0,
                         scale=None if scale is None else float(scale), l2norm=l2norm,
                         chunk=min(chunk_size, q.shape[2]), cu_seqlens=cu_seqlens)
    grads = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, v, beta, g, S0))
    return None if not all_finite(S) or (grads and not all_finite(q)) else (o, S)


def delta_rule_affine_form(q, k, v, beta, *, g=None, scale: float | None = None, qk_l2norm: bool = False,
                           chunk_size: int = DEFAULT_CHUNK_SIZE) -> AffineForm:
    """`delta_rule` on a span as an affine function of its initial state (`linattn.ops.affine`):

        o_t = o⁰_t + S_0ᵀ P_tᵀ q̂_t,     S_n = A S_0 + ΔS,     A = P_n,
        P_t = T_t ⋯ T_1,   T_t = α_t (I − β_t k̂_t k̂_tᵀ),

    all from one run of the op on D + E value columns, [0 | v], from the initial state [I | 0]
    (D×(D+E) per head): by linearity its state after token t is [P_t | S⁰_t] and its output
    [P_tᵀ q̂_t | o⁰_t]. The op's chunk update S ← (e^{b_C} I − K_lᵀ W) S + K_lᵀ U (design §13.3) gives
    the identity columns the chunk transition e^{b_C} I − K_lᵀ W with W = L⁻¹ diag(β e^b) K̂,
    K_l = diag(e^{b_C − b}) K̂, so A is the product of the chunks' WY transitions, in the fused
    kernels where they run, at about the cost of the op on D + E columns. Arguments as for
    delta_rule. Returns the AffineForm (out0 o⁰, query P_tᵀ q̂_t (B, H, n, D) in q's dtype,
    transition A (B, H, D, D) and state ΔS (B, H, D, E) in the state dtype); gradients flow to q, k,
    v, beta and g through every term.
    """
    check_arguments(q, k, v, beta, g, scale, qk_l2norm, None)
    b, h, n, d = q.shape
    sdt = state_dtype(q.dtype)
    S0 = torch.zeros(b, h, d, d + v.shape[-1], dtype=sdt, device=q.device)
    S0[..., :d] = torch.eye(d, dtype=sdt, device=q.device)
    values = torch.cat((v.new_zeros(b, h, n, d), v), -1)
    o, S = delta_rule(q, k, values, beta, g=g, scale=scale, qk_l2norm=qk_l2norm, initial_state=S0, return_state=True,
                      chunk_size=chunk_size)
    return AffineForm(o[..., d:], o[..., :d], S[..., :d], S[..., d:])


def delta_rule_step(
    state: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    *,
    g: torch.Tensor | None = None,
    scale: float | None = None,
    qk_l2norm: bool = False,
    inplace: bool = False,
):
    """The recurrent form: returns (o, new_state); `state` is not modified unless inplace.

        S_α = Diag(α) S,  u = S_αᵀ k̂,  S' = S_α + k̂ (β (v − u))ᵀ  (= (I − β k̂k̂ᵀ) Diag(α) S + β k̂ vᵀ),
        o = S'ᵀ q̂                                  (a scalar α: u = α Sᵀk̂, S' = α S + k̂ (β (v − u))ᵀ)

    state: S (B, H, D, E) in the state dtype, or None to start from zeros. q, k (B, H, T, D), v
    (B, H, T, E), beta (B, H, T), g (B, H, T), (B, H, T, D) or None: T = 1 is the decoding path (on the
    CPU with fp32, fp64 or bf16 inputs and neither a gradient nor a forward-mode tangent wanted, one
    fused operator; else torch ops); a short block of T > 1 tokens runs `delta_rule` from the state.
    inplace: write S' into `state` (given, no gradient wanted) and return it as the new state, so that
    decoding allocates no (B, H, D, E) tensor per token (the fused step updates a contiguous state
    itself, `linattn_cpu::delta_step_`; other paths copy their result into it). The argument checks
    run once per call signature (`linattn.ops.stepcheck`); the values of beta and g at every call.
    """
    if inplace:
        stepcheck.check_inplace(state, q, k, v, beta, g)
    if q.dim() == 4 and q.shape[2] != 1:
        o, S = delta_rule(q, k, v, beta, g=g, scale=scale, qk_l2norm=qk_l2norm, initial_state=state,
                          return_state=True)
        return (o, stepcheck.write_into(state, S)) if inplace else (o, S)
    key = stepcheck.signature("delta_step", state, q, k, v, beta, g, scale, qk_l2norm)
    if not (stepcheck.seen(key) and state is not None):  # checked once per signature (linattn.ops.stepcheck)
        check_arguments(q, k, v, beta, g, scale, qk_l2norm, state, state_name="state")
        stepcheck.remember(key)
    sdt = state_dtype(q.dtype)
    if state is None:
        state = torch.zeros(*q.shape[:2], q.shape[3], v.shape[3], dtype=sdt, device=q.device)
    if fused.usable(q) and not (torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (state, q, k, v, beta, g))) and not has_tangent(
            state, q, k, v, beta, g):
        beta = beta if beta.dtype is sdt else beta.to(sdt)
        g = g if g is None or g.dtype is sdt else g.to(sdt)
        o, S = fused.step(state, q, k, v, beta, g, scale=scale, l2norm=qk_l2norm,
                          inplace=inplace and state.is_contiguous())  # checks β, g itself
    else:
        check_values(beta, g)
        o, S = _step(state, q, k, v, beta, g, scale, qk_l2norm)
    return (o, stepcheck.write_into(state, S)) if inplace else (o, S)


def _step(S, q, k, v, beta, g, scale, l2norm):
    """One token with torch ops (autograd-friendly). Shapes as in `delta_rule_step`, T = 1."""
    out_dtype, sdt = q.dtype, S.dtype
    q, k, v = q[:, :, 0].to(sdt), k[:, :, 0].to(sdt), v[:, :, 0].to(sdt)  # (B, H, D), (B, H, E)
    if l2norm:
        q, k = normalize_rows(q)[0], normalize_rows(k)[0]
    if scale is not None:
        q = q * scale
    beta = beta.to(sdt)  # (B, H, 1)
    if per_channel(g):
        S = g[:, :, 0].to(sdt).exp().unsqueeze(-1) * S  # Diag(α) S
    u = (k.unsqueeze(-2) @ S).squeeze(-2)  # Sᵀk̂ (B, H, E)
    if g is None or per_channel(g):
        S_new = S + k.unsqueeze(-1) * (beta * (v - u)).unsqueeze(-2)
    else:
        alpha = g.to(sdt).exp()
        S_new = alpha.unsqueeze(-1) * S + k.unsqueeze(-1) * (beta * (v - alpha * u)).unsqueeze(-2)
    o = q.unsqueeze(-2) @ S_new  # (B, H, 1, E)
    return o.to(out_dtype), S_new
