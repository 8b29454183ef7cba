"""Attention kinds with a decaying or corrected recurrent state (design §8, §12–14): RetNet, simple
GLA and GLA (gated linear attention) and DeltaNet, Gated DeltaNet (the delta rule).

They share LinearAttention's interface, `forward(x, mask=None, cache=None, positions=None) -> (y,
cache)`, and its projections and forward (linattn.nn.base.Attention): q, k, v from one fused matmul, optionally
a short causal convolution on them, and by default the per-head output norm and swish gate. Per
head, with x (B, N, d) the layer's input, D the q/k head dim and E the value head dim:

    retnet          S_t = γ_h S_{t−1} + k_t v_tᵀ,             γ_h = 1 − 2^{−5−h}          (RetNet)
    simple_gla      S_t = e^{g_t} S_{t−1} + k_t v_tᵀ,         g_t = −e^{A_log}·softplus(W_α x_t + dt_bias)
    gla             S_t = diag(e^{g_t}) S_{t−1} + k_t v_tᵀ,   g_t = logsigmoid(W₂W₁ x_t + b)/16  (GLA)
                    o_t = S_tᵀ q_t · D^{−1/2}
    deltanet        S_t = (I − β_t k̂_t k̂_tᵀ) S_{t−1} + β_t k̂_t v_tᵀ,     β_t = sigmoid(W_β x_t)
    gated_deltanet  S_t = e^{g_t} (I − β_t k̂_t k̂_tᵀ) S_{t−1} + β_t k̂_t v_tᵀ,  g_t as simple_gla's
                    o_t = S_tᵀ q̂_t · D^{−1/2},   q̂, k̂ = L2-normalized SiLU(q), SiLU(k); v ← SiLU(v)

The gates come from linattn.nn.decay. No normalizer z: the output norm takes its place. The state S
(B, H, D, E) is float32 (float64 for float64 models) and is the decoding cache (`RecurrentCache`),
with the short convolution's tail; a token costs O(D·E) per head whatever the context.

Sequence parallelism (design §9): with `sequence_parallel_group` set (LinearTransformerLM.
set_sequence_parallel_group) and no cache, each rank passes its shard of the sequence and the layer
runs linattn.parallel's gated or delta-rule operator; the short convolution takes the K−1 inputs
before the shard from the previous ranks (linattn.parallel.sequence_halo).

Padding: a masked token leaves the state as it was (the gated operator's key_padding_mask; for the
delta rule its key and log-decay are set to 0, so S_t = S_{t−1}), and enters the short convolution as
zeros, so a left-padded row gives, at its real tokens, the output of the row alone. With
positions="rope", q and k are rotated (after the activation, before the normalization) as in softmax
layers; RetNet rotates them too (its xPos), the GLA and DeltaNet papers use no positions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .._checks import check_positive_int
from ..ops.linear.chunked import DEFAULT_CHUNK_SIZE, state_dtype
from .base import Attention
from .caches import RecurrentCache
from .decay import DT_INIT_RANGE, FeatureDecay, FixedDecay, ScalarDecay, plan_decay
from .families import DELTA, GATED, DeltaMix, GatedMix
from .positional import RotaryEmbedding
from .linear import Linear


class RecurrentAttention(Attention):
    """What the gated and delta-rule kinds share: causal only, q·D^{−1/2}, optional RoPE on q and k, a
    recurrent state as cache (RecurrentCache), the output norm and gate on by default. Subclasses set
    `kind` and `family` and implement `mix` (linattn.nn.base.Attention)."""

    def __init__(self, d_model: int, n_heads: int, *, qk_dim: int | None = None, v_dim: int | None = None,
                 rope: bool = False, rope_base: float = 10_000.0, short_conv: int = 0, output_gate: bool | str = True,
                 dropout: float = 0.0, bias: bool = False, chunk_size: int = DEFAULT_CHUNK_SIZE, norm_eps: float = 1e-5):
        super().__init__(d_model, n_heads, qk_dim, True, dropout, bias, short_conv=short_conv,
                         output_gate=output_gate, norm_eps=norm_eps, v_dim=v_dim)
        check_positive_int("chunk_size", chunk_size)
        self.chunk_size = chunk_size
        self.scale = self.qk_dim ** -0.5
        self.rope = RotaryEmbedding(self.qk_dim, rope_base) if rope else None
        #: the log-decay module (linattn.nn.decay) of kinds that have one; None: none
        self.decay = None

    def plan_state(self, plan, cache, tensors: dict, ints: dict, floats: dict) -> None:
        """What the gated and delta mixers share in the fused step: the state S, the scale, the RoPE
        tables of q and k, the decay's code and tensors."""
        self.plan_qk_rope(plan, tensors)
        tensors["state"] = plan.state(cache)
        floats["scale"] = float(self.scale)
        plan_decay(self.decay, plan, tensors, ints, floats)


class GatedAttention(RecurrentAttention):
    """Gated linear attention on q, k directly (no feature map, no normalizer): S_t = diag(e^{g_t})
    S_{t−1} + k_t v_tᵀ, o_t = S_tᵀ q_t · D^{−1/2}, with g = `self.decay(x)` (linattn.nn.decay). The scale is
    applied to q here rather than by the operator, whose fused CPU kernels take no scale."""

    family = GATED

    def mix(self, x, q, k, v, positions) -> GatedMix:
        q, k = self.rotate(q, k, positions)
        return GatedMix(q * self.scale, k, v, self.decay(x), chunk_size=self.chunk_size)

    plan_mixer = RecurrentAttention.plan_state


class RetNetAttention(GatedAttention):
    """RetNet's retention (Sun et al. 2023) in its recurrent form: a fixed decay per head, γ_h = 1 −
    2^{−5−h} (linattn.nn.decay.FixedDecay), so heads remember over ~32 … 2^{4+H} tokens. RetNet rotates q
    and k (xPos) and normalizes and gates its output: positions="rope" and the output gate."""

    kind = "retnet"

    def __init__(self, d_model: int, n_heads: int, **kw):
        super().__init__(d_model, n_heads, **kw)
        self.decay = FixedDecay(n_heads)


class SimpleGLAAttention(GatedAttention):
    """Gated linear attention with one data-dependent decay per head and token, Mamba2's form
    g_t = −exp(A_log)·softplus(W_α x_t + dt_bias) (linattn.nn.decay.ScalarDecay): the SSD / "simple GLA"
    recurrence of Mamba2 (Dao & Gu 2024), with q, k, v as attention names them."""

    kind = "simple_gla"

    def __init__(self, d_model: int, n_heads: int, *, dt_init_range=DT_INIT_RANGE, **kw):
        super().__init__(d_model, n_heads, **kw)
        self.decay = ScalarDecay(d_model, n_heads, dt_init_range)


class GLAAttention(GatedAttention):
    """GLA (Yang et al. 2023): a data-dependent decay per head, token and key feature from a rank-16
    projection, g_t = logsigmoid(W₂W₁ x_t + b)/16 (linattn.nn.decay.FeatureDecay)."""

    kind = "gla"

    def __init__(self, d_model: int, n_heads: int, **kw):
        super().__init__(d_model, n_heads, **kw)
        self.decay = FeatureDecay(d_model, n_heads, self.qk_dim)


class DeltaNetAttention(RecurrentAttention):
    """DeltaNet (Schlag et al. 2021; Yang et al. 2024): the delta rule with β_t = sigmoid(W_β x_t) per
    head and token, q, k, v through SiLU, q and k L2-normalized (inside the operator), q scaled by
    D^{−1/2} (see the module docstring). Short convolution kernel 4 and the output gate in the
    models' defaults. `decay`: None here, Gated DeltaNet's Mamba2 gate in the subclass."""

    kind = "deltanet"
    family = DELTA

    def __init__(self, d_model: int, n_heads: int, *, allow_neg_eigval: bool = False, **kw):
        """allow_neg_eigval: β = 2·sigmoid(W_β x) ∈ (0, 2), so I − β k̂k̂ᵀ may have the eigenvalue
        1 − β < 0 (Grazzi et al. 2024; OLMo-Hybrid's linear_allow_neg_eigval)."""
        super().__init__(d_model, n_heads, **kw)
        self.beta_proj = Linear(d_model, n_heads, bias=False)
        self.allow_neg_eigval = bool(allow_neg_eigval)

    def mix(self, x, q, k, v, positions) -> DeltaMix:
        # SiLU on q, k and v after the projection and convolution: Gated DeltaNet's block (Yang et al. 2024b, Fig. 1)
        q, k = self.rotate(F.silu(q), F.silu(k), positions)
        sdt = state_dtype(x.dtype)
        # β in the state dtype, kept above the smallest normal number (a β that small writes nothing either way)
        beta = torch.sigmoid(self.beta_proj(x).to(sdt)).clamp_min(torch.finfo(sdt).tiny).transpose(1, 2)
        if self.allow_neg_eigval:
            beta = 2.0 * beta
        g = None if self.decay is None else self.decay(x)
        return DeltaMix(q, k, F.silu(v), beta, g, scale=self.scale, chunk_size=self.chunk_size)

    def step_obstacle(self) -> str | None:
        if self.decay is not None and self.decay.native_code != ScalarDecay.native_code:
            return f"decay {type(self.decay).__name__} takes the eager path"
        return super().step_obstacle()

    def plan_mixer(self, plan, cache, tensors: dict, ints: dict, floats: dict) -> None:
        """The gated mixer's arguments (`plan_state`) and β's product (and its factor 2 with
        allow_neg_eigval)."""
        self.plan_state(plan, cache, tensors, ints, floats)
        tensors["beta"] = plan.project(self.beta_proj)
        if self.allow_neg_eigval:
            floats["beta_scale"] = 2.0


class GatedDeltaNetAttention(DeltaNetAttention):
    """Gated DeltaNet (Yang et al. 2024b): DeltaNet with the decay g_t = −exp(A_log)·softplus(W_α x_t +
    dt_bias) per head and token (linattn.nn.decay.ScalarDecay, Mamba2's form)."""

    kind = "gated_deltanet"

    def __init__(self, d_model: int, n_heads: int, *, dt_init_range=DT_INIT_RANGE, **kw):
        super().__init__(d_model, n_heads, **kw)
        self.decay = ScalarDecay(d_model, n_heads, dt_init_range)


__all__ = [
    "DeltaNetAttention",
    "GLAAttention",
    "GatedAttention",
    "GatedDeltaNetAttention",
    "RecurrentAttention",
    "RecurrentCache",
    "RetNetAttention",
    "SimpleGLAAttention",
]
