"""Pure functions on (B, H, N, D) tensors: linear attention (causal chunked, non-causal, recurrent
step), softmax attention, and the quadratic `reference` oracles."""

from . import reference
from .linear import State, linear_attention, linear_attention_step
from .softmax import softmax_attention

__all__ = ["State", "linear_attention", "linear_attention_step", "reference", "softmax_attention"]
