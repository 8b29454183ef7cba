"""flash-linear-attention's API on linattn's kernels (design §18).

The names, signatures, defaults and [B, T, H, D] layout of FLA's `fla.ops` functions, returning
(o, final_state) as FLA does, so that code written against FLA runs on a CPU (FLA needs Triton and
a GPU), and code written here moves to FLA by changing one import:

    from linattn.compat.fla import chunk_gated_delta_rule      # instead of fla.ops.gated_delta_rule
    o, S = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=S0, output_final_state=True,
                                  use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens)

One module per family:

    linear.py     chunk_linear_attn, fused_recurrent_linear_attn           (normalize, (S, z) states)
    retention.py  chunk_retention, fused_recurrent_retention               (fixed decays 1 − 2^(−5−h))
    gla.py        chunk_simple_gla, fused_recurrent_simple_gla (g or g_gamma), chunk_gla, fused_recurrent_gla
    delta.py      chunk_delta_rule, fused_recurrent_delta_rule, chunk_gated_delta_rule,
                  fused_recurrent_gated_delta_rule (use_qk_l2norm_in_kernel, use_gate_in_kernel with
                  A_log / dt_bias, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    kda.py        chunk_kda, fused_recurrent_kda (the delta family with a per-channel gate)
    conv.py       causal_conv1d_fn, causal_conv1d_update (Dao's causal-conv1d, as transformers calls it)
    _edge.py      the shared edge: checks in FLA's layout, GVA, scale, states, refusals, handover

Conventions (checked against FLA's `fla.ops.<family>.naive` and transformers' torch fallbacks by
tests/test_compat_fla*.py): scale defaults to K^−1/2 and multiplies q after any L2 norm; g is a
natural-log decay; grouped value heads (v and its gates with HV = G·H heads, q/k head h serving
value heads h·G … h·G + G − 1) in every family; states [N, HV, K, V] in float32 (float64 for
float64 inputs), N the batch or the number of packed sequences (cu_seqlens, batch 1). Options that
linattn's operators lack (reverse, gv, FLA's context parallelism, …) raise a
ValueError naming them; unknown keyword arguments a TypeError.

On CUDA with the `fla` package installed every name hands over to FLA's own kernel (set
LINATTN_COMPAT_FLA=0 to keep linattn's); elsewhere linattn's operators run (fused CPU kernels where
they apply).
"""

from .conv import causal_conv1d_fn, causal_conv1d_update
from .delta import (
    chunk_delta_rule,
    chunk_gated_delta_rule,
    fused_recurrent_delta_rule,
    fused_recurrent_gated_delta_rule,
)
from .gla import chunk_gla, chunk_simple_gla, fused_recurrent_gla, fused_recurrent_simple_gla
from .kda import chunk_kda, fused_recurrent_kda
from .linear import chunk_linear_attn, fused_recurrent_linear_attn
from .retention import chunk_retention, fused_recurrent_retention

__all__ = [
    "causal_conv1d_fn",
    "causal_conv1d_update",
    "chunk_delta_rule",
    "chunk_gated_delta_rule",
    "chunk_gla",
    "chunk_kda",
    "chunk_linear_attn",
    "chunk_retention",
    "chunk_simple_gla",
    "fused_recurrent_delta_rule",
    "fused_recurrent_gated_delta_rule",
    "fused_recurrent_gla",
    "fused_recurrent_kda",
    "fused_recurrent_linear_attn",
    "fused_recurrent_retention",
    "fused_recurrent_simple_gla",
]
