"""Gated linear attention (design §12): linear attention whose state decays by e^{g_t} per token, with
g one log-decay per head and token (RetNet, Mamba2/SSD-style) or one per feature (GLA).

    api.py        the public operators: gated_linear_attention, gated_linear_attention_step; and
                  gated_affine_form (the op as a function of its initial state, for linattn.parallel)
    chunked.py    the chunked algorithm in torch ops, with its memory-bounded backward
    fused.py      the fused CPU kernels (csrc/gated*.cpp) in Python and autograd
    checks.py     argument checks (g, the state's form)
    reference.py  the oracle: the float64 recurrence, token by token
"""

from . import reference
from .api import gated_affine_form, gated_linear_attention, gated_linear_attention_step

__all__ = ["gated_affine_form", "gated_linear_attention", "gated_linear_attention_step", "reference"]
