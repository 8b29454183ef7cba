"""Liger attention (Lan et al. 2025, "Liger: Linearizing LLMs to gated recurrent structures"): a
softmax attention's own q, k, v, o projections turned into a gated linear recurrence plus a sliding
window, with no new parameter, so that a pretrained Transformer converts without a stage of
feature-map training (design §19):

    g_t   = logsigmoid(k_t) / 16                     (per key channel: the gate is built from the key)
    φ(x)  = softmax(x) over the head dim             (for q and k)
    S_t   = diag(e^{g_t}) S_{t−1} + φ(k_t) v_tᵀ,      o_lin,t = S_tᵀ φ(q_t)        (GLA, unnormalized)
    o_win = sliding-window softmax attention over the last W tokens, q and k RoPE-rotated
    y     = W_o · concat_h [ (o_win + o_lin) / 2 ]

q, k are the projections before RoPE in the gate and the linear part (the recurrence needs no
positions), after it in the window (the teacher's softmax read them rotated). The Liger paper's
GLA variant pools the key projection to the gate's width (identity here: the gate has one value per
key channel) and mixes the two outputs with equal weights; 1/16 is GLA's gate normalizer.

Training runs linattn.ops.gated_linear_attention and linattn.ops.sliding_window_attention (both
chunked; packed sequences through cu_seqlens); decoding keeps the GLA state and the window's ring
buffer (LigerCache): memory flat in the context length.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .caches import LigerCache
from .decay import plan_key_decay
from .families import WINDOW_GATED, GatedMix, WindowMix
from .swa import SlidingWindowAttention

#: GLA's gate normalizer (Yang et al. 2023, §4.4), which Liger keeps
GATE_NORMALIZER = 16.0


class LigerAttention(SlidingWindowAttention):
    """Multi-head causal Liger attention (see the module docstring); the arguments are
    SlidingWindowAttention's (window W, default 64 as in Liger)."""

    kind = "liger"
    family = WINDOW_GATED

    @staticmethod
    def gate(k: torch.Tensor) -> torch.Tensor:
        """g = logsigmoid(k) / 16 in float32 (float64 for float64 k): (B, H, N, D) -> same shape."""
        return F.logsigmoid(k.to(torch.float64 if k.dtype == torch.float64 else torch.float32)) / GATE_NORMALIZER

    def mix(self, x, q, k, v, positions) -> tuple[WindowMix, GatedMix]:
        g = self.gate(k)
        fq, fk = torch.softmax(q, dim=-1), torch.softmax(k, dim=-1)
        rq, rk = self.rotate(q, k, positions)
        return (WindowMix(rq, rk, v, self.window, self.chunk_size),
                GatedMix(fq, fk, v, g, chunk_size=self.chunk_size, scale=1.0))

    def plan_mixer(self, plan, cache, tensors: dict, ints: dict, floats: dict) -> None:
        """The window mixer's arguments: the ring buffer (`plan_window`), the gated state S and its key
        decay g = logsigmoid(k) / 16 (csrc/model_window.h)."""
        self.plan_window(plan, cache, tensors, ints)
        tensors["state"] = plan.state(cache)
        ints["beyond"] = 2  # a gated state (model_window.h's kBeyondGated)
        plan_key_decay(ints, floats, GATE_NORMALIZER)


__all__ = ["GATE_NORMALIZER", "LigerAttention", "LigerCache"]
