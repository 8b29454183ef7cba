"""The `hgrn2` kind: HGRN2 (Qin et al. 2024, "HGRN2: Gated Linear RNNs with State Expansion"), a gated
linear RNN whose input gate is the complement of its forget gate, on the gated family (design §12).

Per head, with x (B, N, d) the layer's input, D the q/k head dim and E the value head dim, the fused
projection's three blocks are the output gate q, the forget logits f and the input v (HGRN2's q_proj,
f_proj, i_proj; the state dict keeps the names `qkv`, `out`):

    q, f, v = W_qkv x                      (then the short convolution, when one is set)
    g_t = logsigmoid(f_t) ∈ (−∞, 0]^D      the log forget gate, per key channel, in the state dtype
    k_t = 1 − e^{g_t}                      the input gate, tied to the forget gate
    S_t = Diag(e^{g_t}) S_{t−1} + k_t v_tᵀ,    o_t = S_tᵀ SiLU(q_t) · D^{−1/2}

so each channel of S is a moving average of the inputs at its own rate (HGRN2's state expansion of
HGRN's element-wise recurrence). As flash-linear-attention's `HGRN2Attention`: SiLU on q, the GLA
operator's D^{−1/2}, no positions; unlike it, the output goes through linattn's per-head RMSNorm and
swish gate (the kinds table's default; FLA normalizes the whole width and has no gate), and every layer
is HGRN2's first (no learned lower bound on the forget gate, which HGRN2 raises layer by layer).
Padding, decoding, packing and sequence parallelism are the gated family's (linattn.nn.families.GATED).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..ops.linear.chunked import state_dtype
from .decay import plan_key_decay
from .families import GATED, GatedMix
from .recurrent import RecurrentAttention


class HGRN2Attention(RecurrentAttention):
    """HGRN2 (module docstring); the arguments are the other recurrent kinds' (linattn.nn.recurrent)."""

    kind = "hgrn2"
    family = GATED

    def mix(self, x, q, k, v, positions) -> GatedMix:
        g = F.logsigmoid(k.to(state_dtype(x.dtype)))  # the k block holds the forget logits f
        q, k = self.rotate(F.silu(q), (-torch.expm1(g)).to(v.dtype), positions)
        return GatedMix(q * self.scale, k, v, g, chunk_size=self.chunk_size)

    def plan_mixer(self, plan, cache, tensors: dict, ints: dict, floats: dict) -> None:
        """The gated mixer's arguments (`plan_state`) with the key decay g = logsigmoid(k) and the tied
        input gate k ← 1 − e^g, SiLU(q) (csrc/model_mixers.h's GatedMixOp)."""
        self.plan_state(plan, cache, tensors, ints, floats)
        plan_key_decay(ints, floats, 1.0)
        ints["tied_input"] = 1


__all__ = ["HGRN2Attention"]
