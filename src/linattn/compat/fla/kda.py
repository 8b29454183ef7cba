"""FLA's KDA functions (`fla.ops.kda`) on linattn's delta family (design §13, §18): `chunk_kda` and
`fused_recurrent_kda` with flash-linear-attention's names, signatures, defaults and [B, T, H, K]
layout, returning (o, final_state or None).

Per (batch, value head), with n(x) = x / √(‖x‖² + 1e-6) when use_qk_l2norm_in_kernel (else the
identity), q̂_t = scale · n(q_t) (scale default K^−1/2), k̂_t = n(k_t) and α_t = e^{g_t} ∈ (0, 1]^K:

    S_t = (I − β_t k̂_t k̂_tᵀ) Diag(α_t) S_{t−1} + β_t k̂_t v_tᵀ        o_t = S_tᵀ q̂_t

q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV, K] (natural-log decays, or the raw gate with
use_gate_in_kernel); beta [B, T, HV] (or logits with use_beta_sigmoid_in_kernel: β = sigmoid, with
allow_neg_eigval 2·sigmoid); grouped value heads when HV = G·H; states [N, HV, K, V] ([N, HV, V, K]
with state_v_first or FLA's deprecated transpose_state_layout) in float32 (float64 for float64
inputs), N the batch or the number of packed sequences (cu_seqlens, batch 1). The gate inside the op:
−e^{A_log}·softplus(g + dt_bias), or with safe_gate / a lower_bound lower_bound·sigmoid(e^{A_log}·(g +
dt_bias)) (A_log may then be None). chunk_kda's return_intermediate_states (under
torch.inference_mode(), as FLA requires) adds h, the state entering every chunk. FLA's context
parallelism and graph options raise a ValueError naming them. On CUDA with `fla` importable every
call goes to FLA's own kernels (linattn.compat.fla._edge.hands_over).
"""

from __future__ import annotations

import torch

from ...ops.delta.gate import kda_gate, kda_lowerbound_gate
from ._edge import beta_in, hands_over, refuse, state_layout_alias, take_kwargs
from .delta import run_delta


def _gate(fn, g, A_log, dt_bias, use_gate_in_kernel, safe_gate, lower_bound):
    if not use_gate_in_kernel:
        return g
    if lower_bound is not None or safe_gate:
        if lower_bound is None:
            raise ValueError(f"{fn}: safe_gate with use_gate_in_kernel needs a lower_bound (e.g. -5)")
        return kda_lowerbound_gate(g, A_log, dt_bias, lower_bound=lower_bound)
    if A_log is None:
        raise ValueError(f"{fn}: use_gate_in_kernel needs A_log (shape [HV]) or a lower_bound")
    return kda_gate(g, A_log, dt_bias)


@hands_over("fla.ops.kda", "chunk_kda")
def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
              allow_neg_eigval=False, safe_gate=False, lower_bound=None, disable_recompute=False,
              return_intermediate_states=False, state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None,
              cp_context=None, use_graph=False, max_num_seqs=None, **kwargs):
    """FLA's `chunk_kda` (module doc); A_log [HV] and dt_bias [HV·K] come as keyword arguments with
    use_gate_in_kernel, as in FLA; chunk_size (default 64) and transpose_state_layout may be given
    too. disable_recompute changes nothing here (linattn's backward always recomputes by blocks).
    return_intermediate_states: (o, final state or None, h) with h [B, NT, HV, K, V] ([…, V, K] with
    state_v_first) in k's dtype, the state entering each of the NT chunks (packed: every sequence's
    chunks in order, B = 1); only under torch.inference_mode(), as FLA."""
    fn = "chunk_kda"
    refuse(fn, cp_context=cp_context, use_graph=use_graph, max_num_seqs=max_num_seqs)
    extra = take_kwargs(fn, kwargs, ("A_log", "dt_bias", "chunk_size", "transpose_state_layout"))
    state_v_first = state_layout_alias(state_v_first, extra)
    if return_intermediate_states and not torch.is_inference_mode_enabled():
        raise ValueError(f"linattn.compat.fla.{fn}: return_intermediate_states=True is for inference: call it "
                         "under torch.inference_mode(), as FLA requires")
    g = _gate(fn, g, extra.get("A_log"), extra.get("dt_bias"), use_gate_in_kernel, safe_gate, lower_bound)
    beta = beta_in(fn, beta, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    return run_delta(q, k, v, beta, g, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                     l2norm=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens, state_v_first=state_v_first,
                     chunk_size=extra.get("chunk_size", 64), per_channel=True,
                     chunk_states=bool(return_intermediate_states))


@hands_over("fla.ops.kda", "fused_recurrent_kda")
def fused_recurrent_kda(q, k, v, g, beta, A_log=None, dt_bias=None, scale=None, initial_state=None,
                        output_final_state=False, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                        use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, lower_bound=None,
                        state_v_first=False, cu_seqlens=None, **kwargs):
    """FLA's `fused_recurrent_kda` (module doc): the same recurrence (T = 1 without cu_seqlens is one
    decoding step, `delta_rule_step`; else the chunked operator, the same numbers as a token-by-token
    loop up to rounding). transpose_state_layout may be given; vLLM's continuous-batching arguments
    (ssm_state_indices, num_accepted_tokens, out) are refused."""
    fn = "fused_recurrent_kda"
    refuse(fn, **{name: kwargs.pop(name, None) for name in ("ssm_state_indices", "num_accepted_tokens", "out")})
    kwargs.pop("inplace_final_state", None)
    state_v_first = state_layout_alias(state_v_first, take_kwargs(fn, kwargs, ("transpose_state_layout",)))
    g = _gate(fn, g, A_log, dt_bias, use_gate_in_kernel, lower_bound is not None, lower_bound)
    beta = beta_in(fn, beta, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    return run_delta(q, k, v, beta, g, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                     l2norm=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens, state_v_first=state_v_first, step=True,
                     per_channel=True)


__all__ = ["chunk_kda", "fused_recurrent_kda"]
