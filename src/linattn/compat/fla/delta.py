"""FLA's delta rule and gated delta rule (`fla.ops.delta_rule`, `fla.ops.gated_delta_rule`) on
`linattn.delta_rule` / `linattn.delta_rule_step` (design §13).

Per (batch, value head), with n(x) = x / √(‖x‖² + 1e-6) when use_qk_l2norm_in_kernel (else the
identity), q̂_t = scale · n(q_t) (scale default K^−1/2, applied after the norm), k̂_t = n(k_t) and
α_t = e^{g_t} (1 for the plain delta rule):

    S_t = α_t (I − β_t k̂_t k̂_tᵀ) S_{t−1} + β_t k̂_t v_tᵀ        o_t = S_tᵀ q̂_t

q, k: [B, T, H, K]; v: [B, T, HV, V]; beta, g: [B, T, HV] (HV a multiple of H: q/k head h serves
value heads h·G … h·G+G−1) -> o [B, T, HV, V]; states S [N, HV, K, V] ([N, HV, V, K] with
state_v_first). use_gate_in_kernel: g is the raw gate input and the log-decay is
g ← −exp(A_log) · softplus(g + dt_bias) (A_log, dt_bias [HV]; Gated DeltaNet / Mamba2's
discretisation, computed here in float32 or wider); use_beta_sigmoid_in_kernel: β ← sigmoid(β), with
allow_neg_eigval β ← 2·sigmoid(β) (negative eigenvalues; any β ∈ [0, 2] may also be passed as it is).
"""

from __future__ import annotations

import torch

from ...ops import delta_rule, delta_rule_step
from ...ops.delta.gate import mamba2_gate
from ._edge import (
    beta_in,
    check_bools,
    check_head_vector,
    check_per_head,
    fla_inputs,
    hands_over,
    heads_first,
    layout_hint,
    packed,
    refuse,
    state_layout_alias,
    state_out,
    take_kwargs,
)


@hands_over("fla.ops.delta_rule", "chunk_delta_rule")
def chunk_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    cu_seqlens_cpu: torch.LongTensor | None = None,
    **kwargs,
):
    """DeltaNet over whole sequences (module docstring; α = 1). kwargs: chunk_size. Unlike FLA's
    kernel, float32 inputs are accepted. Returns (o, final state or None)."""
    extra = take_kwargs("chunk_delta_rule", kwargs, ("chunk_size",))
    return run_delta(q, k, v, beta, None, scale=scale, initial_state=initial_state,
                     output_final_state=output_final_state, l2norm=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens,
                     **extra)


@hands_over("fla.ops.delta_rule", "fused_recurrent_delta_rule")
def fused_recurrent_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
):
    """The recurrent form of chunk_delta_rule (beta None: β = 1). T = 1 without cu_seqlens is one
    decoding step (`linattn.delta_rule_step`)."""
    return run_delta(q, k, v, beta, None, scale=scale, initial_state=initial_state,
                     output_final_state=output_final_state, l2norm=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens,
                     step=True, o_like_q=True)


@hands_over("fla.ops.gated_delta_rule", "chunk_gated_delta_rule")
def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    cu_seqlens_cpu: torch.LongTensor | None = None,
    chunk_indices: torch.LongTensor | None = None,
    cp_context=None,
    **kwargs,
):
    """Gated DeltaNet over whole sequences (module docstring). kwargs: use_gate_in_kernel, A_log,
    dt_bias (FLA passes them as keywords here), chunk_size and FLA's deprecated transpose_state_layout
    (= state_v_first). chunk_indices and cp_context (FLA's
    context parallelism) are refused. Returns (o, final state or None)."""
    refuse("chunk_gated_delta_rule", chunk_indices=chunk_indices, cp_context=cp_context)
    extra = take_kwargs("chunk_gated_delta_rule", kwargs, ("use_gate_in_kernel", "A_log", "dt_bias", "chunk_size",
                                                           "transpose_state_layout"))
    state_v_first = state_layout_alias(state_v_first, extra)
    g = _gate(g, q, v, extra.pop("use_gate_in_kernel", False), extra.pop("A_log", None), extra.pop("dt_bias", None))
    if g is None:
        raise TypeError("chunk_gated_delta_rule needs g, the log-decays [B, T, HV] (chunk_delta_rule takes none)")
    beta = beta_in("chunk_gated_delta_rule", beta, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    return run_delta(q, k, v, beta, g, scale=scale, initial_state=initial_state,
                     output_final_state=output_final_state, l2norm=use_qk_l2norm_in_kernel,
                     state_v_first=state_v_first, cu_seqlens=cu_seqlens, **extra)


@hands_over("fla.ops.gated_delta_rule", "fused_recurrent_gated_delta_rule")
def fused_recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    gk: torch.Tensor | None = None,
    gv: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    **kwargs,
):
    """The recurrent form of chunk_gated_delta_rule (g None: no decay; beta None: β = 1). T = 1
    without cu_seqlens is one decoding step (`linattn.delta_rule_step`, one fused operator on the
    CPU when no gradient is wanted). The per-channel gates gk, gv (KDA-style) are refused."""
    refuse("fused_recurrent_gated_delta_rule", gk=gk, gv=gv)
    state_v_first = state_layout_alias(state_v_first, take_kwargs("fused_recurrent_gated_delta_rule", kwargs,
                                                                  ("transpose_state_layout",)))
    g = _gate(g, q, v, use_gate_in_kernel, A_log, dt_bias)
    beta = beta_in("fused_recurrent_gated_delta_rule", beta, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    return run_delta(q, k, v, beta, g, scale=scale, initial_state=initial_state,
                     output_final_state=output_final_state, l2norm=use_qk_l2norm_in_kernel,
                     state_v_first=state_v_first, cu_seqlens=cu_seqlens, step=True)


def _gate(g, q, v, use_gate_in_kernel, A_log, dt_bias):
    """g as the operator takes it: FLA's log-decay, or with use_gate_in_kernel Mamba2's gate of the raw
    input, −exp(A_log) · softplus(g + dt_bias) (linattn.ops.delta.gate.mamba2_gate; A_log required);
    A_log and dt_bias mean nothing without it, as in FLA."""
    check_bools(use_gate_in_kernel=use_gate_in_kernel)
    if not use_gate_in_kernel or g is None:
        if use_gate_in_kernel:
            raise ValueError("use_gate_in_kernel=True needs g, the raw gate input [B, T, HV]")
        return g
    if A_log is None:
        raise ValueError("use_gate_in_kernel=True needs A_log [HV]")
    hv = v.shape[2] if isinstance(v, torch.Tensor) and v.dim() == 4 else None
    if hv is not None and isinstance(q, torch.Tensor):
        check_head_vector("A_log", A_log, q, hv)
        if dt_bias is not None:
            check_head_vector("dt_bias", dt_bias, q, hv)
        check_per_head("g", g, q, hv)
    return mamba2_gate(g, A_log, dt_bias)


def run_delta(q, k, v, beta, g, *, scale, initial_state, output_final_state: bool, l2norm: bool,
              cu_seqlens, state_v_first: bool = False, step: bool = False, chunk_size: int = 64,
              per_channel: bool = False, chunk_states: bool = False, o_like_q: bool = False):
    """Every delta-family name on linattn's operators: checks in FLA's layout, GVA, β = 1 when None,
    states in and out. per_channel: g is [B, T, HV, K] (KDA). chunk_states: also h, the states entering
    every chunk (`with_chunk_states`); returns (o, final state or None, h) then. Mixed dtypes (q/k
    float32, v and the gates in half precision) run in their promotion, and o comes back in FLA's
    dtype: v's (its kernels allocate o like v), q's where o_like_q (fused_recurrent_delta_rule's
    kernel allocates it like q)."""
    h_dtype = k.dtype
    x = fla_inputs(q, k, v, cu_seqlens, o_like_q=o_like_q, use_qk_l2norm_in_kernel=l2norm,
                   state_v_first=state_v_first)
    b, t, _, kd = x.q.shape
    if g is not None or per_channel:
        check_per_head("g", g, x.q, x.hv, last=kd if per_channel else None)
    if beta is None:
        beta = x.q.new_ones(b, t, x.hv)
    check_per_head("beta", beta, x.q, x.hv)
    S0 = x.state(initial_state, state_v_first)
    args = (*x.heads_first(), heads_first(beta))
    opts = dict(g=heads_first(g), scale=x.scale(scale), qk_l2norm=l2norm)
    with layout_hint():
        if chunk_states:
            o, S, h = with_chunk_states(*args, S0, cu_seqlens, chunk_size, **opts)
        elif step and t == 1 and cu_seqlens is None:
            o, S = delta_rule_step(S0, *args, **opts)
        else:
            o, S = delta_rule(*args, initial_state=S0, return_state=True, chunk_size=chunk_size, **opts,
                              **packed(cu_seqlens))
    if chunk_states:
        h = h.transpose(-1, -2) if state_v_first else h
        return x.output(o), state_out(S, output_final_state, state_v_first), h.to(h_dtype)
    return x.output(o), state_out(S, output_final_state, state_v_first)


def with_chunk_states(q, k, v, beta, S0, cu_seqlens, chunk: int, **opts):
    """(o, final states, h (B, NT, HV, K, V)): the operator run chunk by chunk (each sequence of a packed
    row from its own start), h[:, i] the state entering chunk i, as FLA's chunk_kda returns it with
    return_intermediate_states (NT counts the chunks of every sequence; B = 1 when packed)."""
    b, hv, t, kd = q.shape
    e, sdt = v.shape[-1], torch.promote_types(q.dtype, torch.float32)
    bounds = [(0, t)] if cu_seqlens is None else list(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()))
    outs, finals, hs = [], [], []
    for n, (s, end) in enumerate(bounds):
        S = S0 if cu_seqlens is None or S0 is None else S0[n:n + 1]
        if S is None:
            S = torch.zeros(b if cu_seqlens is None else 1, hv, kd, e, dtype=sdt, device=q.device)
        for c0 in range(s, end, chunk):
            hs.append(S)
            part = [None if x is None else x[:, :, c0:min(c0 + chunk, end)] for x in (q, k, v, beta, opts["g"])]
            o, S = delta_rule(*part[:4], **dict(opts, g=part[4]), initial_state=S, return_state=True,
                              chunk_size=chunk)
            outs.append(o)
        finals.append(S)
    o = torch.cat(outs, 2) if outs else v.new_zeros(b, hv, 0, e)
    h = torch.stack(hs, 1) if hs else torch.zeros(b, 0, hv, kd, e, dtype=sdt, device=q.device)
    return o, torch.cat(finals, 0), h
