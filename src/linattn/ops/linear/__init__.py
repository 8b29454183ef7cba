"""Linear attention (design §3–5): the public ops (`api`), the chunked torch path (`chunked`), the
quadratic float64 oracles (`reference`); the fused kernels are loaded by `linattn.ops.native`."""

from .api import State, linear_attention, linear_attention_step

__all__ = ["State", "linear_attention", "linear_attention_step"]
