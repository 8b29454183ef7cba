"""FLA's KDA functions on linattn's operator (design §17, §18): `chunk_kda` and `fused_recurrent_kda`
with flash-linear-attention's names, signatures, defaults and [B, T, H, K] layout, returning
(o, final_state or None).

q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV, K] (natural-log decays, or the raw gate with
use_gate_in_kernel); beta [B, T, HV] (or logits with use_beta_sigmoid_in_kernel); grouped value heads
when HV = G·H (q/k head h serves value heads h·G … h·G + G − 1); scale defaults to K^−1/2 and
multiplies q after any L2 norm; states [N, HV, K, V] in float32 (float64 for float64 inputs), N the
batch or the number of packed sequences (cu_seqlens, batch 1). The gate inside the op:
−e^{A_log}·softplus(g + dt_bias), or with safe_gate / a lower_bound lower_bound·sigmoid(e^{A_log}·(g +
dt_bias)) (A_log may then be None). use_beta_sigmoid_in_kernel: β = sigmoid(beta), with allow_neg_eigval
2·sigmoid(beta) (β ∈ [0, 2]). Options linattn lacks (intermediate states, V-first states, context
parallelism, graphs) raise a ValueError naming them.
"""

from __future__ import annotations

import torch

from ...ops.kda import kda, kda_gate, kda_lowerbound_gate
from ...ops.linear.chunked import state_dtype
from ._edge import (
    beta_in,
    check_per_head,
    check_qkv,
    expand_heads,
    heads_first,
    refuse,
    resolve_scale,
    state_count,
    state_in,
    state_out,
)


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


def _run(fn, q, k, v, g, beta, scale, initial_state, output_final_state, l2norm, cu_seqlens, beta_sigmoid,
         allow_neg_eigval, chunk_size=64):
    """The checks and the crossing of linattn.compat.fla (_edge), then linattn.ops.kda.kda;
    beta_sigmoid, allow_neg_eigval: β from logits (_edge.beta_in)."""
    _, hv = check_qkv(q, k, v)
    check_per_head("g", g, q, hv, last=q.shape[3])
    check_per_head("beta", beta, q, hv)
    beta = beta_in(fn, beta, beta_sigmoid, allow_neg_eigval)
    q, k = expand_heads(q, k, hv)
    S0 = state_in("initial_state", initial_state, q, state_count(q, cu_seqlens), hv, q.shape[3], v.shape[3])
    sdt = state_dtype(q.dtype)
    o, S = kda(heads_first(q), heads_first(k), heads_first(v), heads_first(beta).to(sdt), heads_first(g).to(sdt),
               scale=resolve_scale(scale, k), qk_l2norm=l2norm, initial_state=S0, return_state=True,
               chunk_size=chunk_size, cu_seqlens=cu_seqlens)
    return o.transpose(1, 2), state_out(S, output_final_state)


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
              allow_neg_eigval=False, safe_gate=False, lower_bound=None, disable_recompute=False,
              return_intermediate_states=False, state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None,
              cp_context=None, use_graph=False, max_num_seqs=None, **kwargs):
    """FLA's `chunk_kda` (module doc); A_log [HV] and dt_bias [HV·K] come as keyword arguments with
    use_gate_in_kernel, as in FLA; chunk_size (default 64) may be given too."""
    fn = "chunk_kda"
    refuse(fn, return_intermediate_states=return_intermediate_states, state_v_first=state_v_first,
           cp_context=cp_context)
    A_log, dt_bias = kwargs.pop("A_log", None), kwargs.pop("dt_bias", None)
    chunk_size = kwargs.pop("chunk_size", 64)
    if kwargs:
        raise TypeError(f"{fn}: unexpected keyword arguments {sorted(kwargs)}")
    g = _gate(fn, g, A_log, dt_bias, use_gate_in_kernel, safe_gate, lower_bound)
    return _run(fn, q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens,
                use_beta_sigmoid_in_kernel, allow_neg_eigval, chunk_size)


def fused_recurrent_kda(q, k, v, g, beta, A_log=None, dt_bias=None, scale=None, initial_state=None,
                        output_final_state=False, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                        use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, lower_bound=None,
                        state_v_first=False, cu_seqlens=None, **kwargs):
    """FLA's `fused_recurrent_kda` (module doc): the same recurrence, run by linattn's chunked operator
    (the same numbers as a token-by-token loop up to rounding)."""
    fn = "fused_recurrent_kda"
    refuse(fn, state_v_first=state_v_first)
    for name in ("ssm_state_indices", "num_accepted_tokens", "out"):
        if kwargs.pop(name, None) is not None:
            raise ValueError(f"{fn}: {name} is not supported by linattn's KDA")
    kwargs.pop("inplace_final_state", None)
    if kwargs:
        raise TypeError(f"{fn}: unexpected keyword arguments {sorted(kwargs)}")
    g = _gate(fn, g, A_log, dt_bias, use_gate_in_kernel, lower_bound is not None, lower_bound)
    return _run(fn, q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens,
                use_beta_sigmoid_in_kernel, allow_neg_eigval)


__all__ = ["chunk_kda", "fused_recurrent_kda"]
