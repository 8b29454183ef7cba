"""Pure functions on (B, H, N, D) tensors: linear attention (causal chunked, non-causal, recurrent
step), gated linear attention (`gated`), the delta rule (DeltaNet, Gated DeltaNet, and KDA's names for
its per-channel gate), softmax attention, sliding-window attention and the LoLCATs hybrid, and the
quadratic `reference` oracles. Every operator family's public entry points are here (its record in
linattn.nn.families runs them; tests/test_families.py)."""

from .linear import reference
from . import packed
from .delta import delta_rule, delta_rule_step
from .gated import gated_linear_attention, gated_linear_attention_step
from .kda import kda, kda_step
from .linear.api import State, linear_attention, linear_attention_step
from .softmax import softmax_attention
from .swa import lolcats_attention, lolcats_attention_step, sliding_window_attention, sliding_window_attention_step

__all__ = ["State", "delta_rule", "delta_rule_step", "gated_linear_attention", "gated_linear_attention_step",
           "kda", "kda_step", "linear_attention", "linear_attention_step", "lolcats_attention",
           "lolcats_attention_step", "packed", "reference", "sliding_window_attention",
           "sliding_window_attention_step", "softmax_attention"]
