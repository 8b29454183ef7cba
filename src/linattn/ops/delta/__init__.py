"""The delta family (DeltaNet, Gated DeltaNet, KDA; design §13): the public operators (`api`, with
`delta_rule_affine_form`, the op as a function of its initial state, for linattn.parallel) taking
g None, one decay per head, or one per key channel; the argument checks (`checks`); the chunked
torch-op path with its explicit backward (`chunked`, and `subchunk` for per-channel gates); the
exact pass for non-finite inputs (`exact`); the wrappers of the fused CPU kernels (`fused`,
csrc/delta.cpp); the gates from raw projections (`gate`: Mamba2's, KDA's); and the float64
token-by-token recurrence the tests hold them to (`reference`). linattn.ops.kda gives KDA's names."""

from . import reference
from .api import delta_rule, delta_rule_affine_form, delta_rule_step
from .gate import mamba2_gate

__all__ = ["delta_rule", "delta_rule_affine_form", "delta_rule_step", "mamba2_gate", "reference"]
