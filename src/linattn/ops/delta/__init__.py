"""The delta rule (DeltaNet, Gated DeltaNet; design §13): the public operators (`rule`, with
`delta_rule_affine_form`, the op as a function of its initial state, for linattn.parallel), the
chunked torch-op path with its explicit backward (`chunked`), the wrappers of the fused CPU kernels
(`fused`, csrc/delta.cpp), and the float64 token-by-token recurrence the tests hold them to
(`reference`)."""

from . import reference
from .api import delta_rule, delta_rule_affine_form, delta_rule_step

__all__ = ["delta_rule", "delta_rule_affine_form", "delta_rule_step", "reference"]
