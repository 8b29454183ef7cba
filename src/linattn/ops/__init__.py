"""Pure functions on (B, H, N, D) tensors: linear attention (causal chunked, non-causal, recurrent
step), gated linear attention (`gated`), the delta rule (DeltaNet, Gated DeltaNet), softmax attention,
and the quadratic `reference` oracles."""

from .linear import reference
from . import packed
from .delta import delta_rule, delta_rule_step
from .gated import gated_linear_attention, gated_linear_attention_step
from .linear.api import State, linear_attention, linear_attention_step
from .softmax import softmax_attention
from .swa import sliding_window_attention, sliding_window_attention_step

__all__ = ["State", "delta_rule", "delta_rule_step", "gated_linear_attention", "gated_linear_attention_step",
           "linear_attention", "linear_attention_step", "packed", "reference",
           "sliding_window_attention", "sliding_window_attention_step", "softmax_attention"]
