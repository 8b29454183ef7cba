"""FLA's gated linear attention (`fla.ops.simple_gla`, `fla.ops.gla`) on
`linattn.gated_linear_attention` (design §12).

Per (batch, value head), with q̂_t = scale · q_t (scale default K^−1/2) and g_t the natural log of
the decay (≤ 0):

    S_t = diag(e^{g_t}) S_{t−1} + k_t v_tᵀ        o_t = S_tᵀ q̂_t

simple GLA: one g per head and token, g [B, T, HV] (data-dependent, Mamba2/SSD-style), or a fixed
g_gamma [HV] (RetNet-style, `chunk_retention`), or neither (plain linear attention, no normalizer).
GLA: one g per key channel, g [B, T, HV, K]. q, k: [B, T, H, K]; v: [B, T, HV, V] -> o
[B, T, HV, V]; states S [N, HV, K, V] ([N, HV, V, K] with state_v_first).
"""

from __future__ import annotations

import torch

from ...ops import gated_linear_attention, gated_linear_attention_step, linear_attention
from ...ops.linear.chunked import state_dtype
from ._edge import (
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


@hands_over("fla.ops.simple_gla", "chunk_simple_gla")
def chunk_simple_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    g_gamma: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    cu_seqlens_cpu: torch.LongTensor | None = None,
    **kwargs,
):
    """Simple GLA over whole sequences (module docstring). g [B, T, HV] or g_gamma [HV] (not both).
    kwargs: chunk_size (rows per chunk of linattn's chunked op). cu_seqlens_cpu is FLA's
    synchronisation hint and changes nothing here. Returns (o, final state or None)."""
    extra = take_kwargs("chunk_simple_gla", kwargs, ("chunk_size",))
    return run_gated(q, k, v, g, g_gamma, scale=scale, initial_state=initial_state,
                     output_final_state=output_final_state, state_v_first=state_v_first, cu_seqlens=cu_seqlens,
                     per_key=False, **extra)


@hands_over("fla.ops.simple_gla", "fused_recurrent_simple_gla")
def fused_recurrent_simple_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    g_gamma: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    reverse: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    **kwargs,
):
    """The recurrent form of chunk_simple_gla (same maths; T = 1 without cu_seqlens is one decoding
    step). reverse=True is refused."""
    refuse("fused_recurrent_simple_gla", reverse=reverse)
    state_v_first = _state_layout_alias("fused_recurrent_simple_gla", state_v_first, kwargs)
    return run_gated(q, k, v, g, g_gamma, scale=scale, initial_state=initial_state,
                     output_final_state=output_final_state, state_v_first=state_v_first, cu_seqlens=cu_seqlens,
                     per_key=False, step=True)


@hands_over("fla.ops.gla", "chunk_gla")
def chunk_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    cu_seqlens_cpu: torch.LongTensor | None = None,
):
    """GLA over whole sequences: one log-decay per key channel, g [B, T, HV, K] (module docstring).
    Returns (o, final state or None)."""
    if g is None:
        raise TypeError("chunk_gla needs g, the log-decays [B, T, HV, K] (chunk_simple_gla takes none)")
    return run_gated(q, k, v, g, None, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                     state_v_first=state_v_first, cu_seqlens=cu_seqlens, per_key=True)


@hands_over("fla.ops.gla", "fused_recurrent_gla")
def fused_recurrent_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gk: torch.Tensor | None = None,
    gv: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    reverse: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    **kwargs,
):
    """The recurrent form of chunk_gla with the key-side gate gk [B, T, HV, K] (None: no decay).
    The value-side gate gv and reverse=True are refused (linattn's operators decay keys only)."""
    refuse("fused_recurrent_gla", gv=gv, reverse=reverse)
    state_v_first = _state_layout_alias("fused_recurrent_gla", state_v_first, kwargs)
    return run_gated(q, k, v, gk, None, scale=scale, initial_state=initial_state,
                     output_final_state=output_final_state, state_v_first=state_v_first, cu_seqlens=cu_seqlens,
                     per_key=True, step=True, gate_name="gk")


def _state_layout_alias(fn: str, state_v_first: bool, kwargs: dict) -> bool:
    """FLA's deprecated `transpose_state_layout` (= state_v_first, _edge.state_layout_alias); every other
    kwarg is refused."""
    return state_layout_alias(state_v_first, take_kwargs(fn, kwargs, ("transpose_state_layout",)))


def run_gated(q, k, v, g, g_gamma, *, scale, initial_state, output_final_state: bool, state_v_first: bool,
              cu_seqlens, per_key: bool, step: bool = False, chunk_size: int | None = None, gate_name: str = "g"):
    """Every gated name on linattn's operators. g: None, [B, T, HV] or (per_key) [B, T, HV, K];
    g_gamma [HV] (a fixed decay per head) or None. No gate at all is linear attention without a
    normalizer. q is scaled before the op (so that the fused kernels take it). Mixed dtypes run in
    their promotion; o comes back in FLA's dtype (`fla_output_dtype`; step: the fused_recurrent names)."""
    x = fla_inputs(q, k, v, cu_seqlens, o_like_q=step, state_v_first=state_v_first)
    b, t, _, kd = x.q.shape
    if g is not None and g_gamma is not None:
        raise ValueError(f"pass one of {gate_name} (per token) and g_gamma (fixed per head), not both")
    if g is not None:
        check_per_head(gate_name, g, x.q, x.hv, kd if per_key else None)
        g = heads_first(g)
    elif g_gamma is not None:
        check_head_vector("g_gamma", g_gamma, x.q, x.hv)
        g = g_gamma.to(state_dtype(x.q.dtype)).reshape(1, x.hv, 1).expand(b, x.hv, t)
    S0 = x.state(initial_state, state_v_first)
    q, k, v = x.heads_first()
    qs = q * x.scale(scale)
    chunk = {} if chunk_size is None else {"chunk_size": chunk_size}
    with layout_hint():
        if g is None:
            state = None if S0 is None else (S0, S0.new_zeros(S0.shape[:-1]))
            o, (S, _) = linear_attention(qs, k, v, causal=True, normalize=False, initial_state=state,
                                         return_state=True, **chunk, **packed(cu_seqlens))
        elif step and t == 1 and cu_seqlens is None:
            o, S = gated_linear_attention_step(S0, qs, k, v, g)
        else:
            o, S = gated_linear_attention(qs, k, v, g, initial_state=S0, return_state=True, **chunk,
                                          **packed(cu_seqlens))
    return x.output(o), state_out(S, output_final_state, state_v_first)
