"""Attention kinds with a decaying or corrected recurrent state (design §8, §12–14): RetNet, simple
GLA and GLA (gated linear attention) and DeltaNet, Gated DeltaNet (the delta rule).

They share LinearAttention's interface, `forward(x, mask=None, cache=None, positions=None) -> (y,
cache)`, and its projections (linattn.nn.attention._Attention): q, k, v from one fused matmul, optionally
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

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .._checks import check_positive_int
from .decay import DT_INIT_RANGE, FeatureDecay, FixedDecay, ScalarDecay
from .attention import LayerCache, _Attention, token_positions
from ..ops import delta_rule, delta_rule_step, gated_linear_attention, gated_linear_attention_step, packed
from ..ops.linear.chunked import DEFAULT_CHUNK_SIZE, state_dtype
from ..parallel import sequence_parallel_delta_rule, sequence_parallel_gated_linear_attention
from .positional import RotaryEmbedding


@dataclass
class RecurrentCache(LayerCache):
    """The decoding cache of a gated or delta-rule layer: the state S (B, H, D, E) (None before the
    first call) and the short convolution's tail. Its size does not depend on the context length."""

    state: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.state, self.conv) if t is not None)


class _RecurrentAttention(_Attention):
    """What the gated and delta-rule kinds share: causal only, q·D^{−1/2}, optional RoPE on q and k, a
    recurrent state as cache, the output norm and gate on by default. Subclasses set `kind` and
    implement `_mix(x, q, k, v, mask, state, stateful) -> (o, state)`; `_activate` maps q, k, v
    after the projection (identity here)."""

    def __init__(self, d_model: int, n_heads: int, *, qk_dim: int | None = None, rope: bool = False,
                 rope_base: float = 10_000.0, short_conv: int = 0, output_gate: bool = True, dropout: float = 0.0,
                 bias: bool = False, chunk_size: int = DEFAULT_CHUNK_SIZE, norm_eps: float = 1e-5):
        super().__init__(d_model, n_heads, qk_dim, True, dropout, bias, short_conv=short_conv,
                         output_gate=output_gate, norm_eps=norm_eps)
        check_positive_int("chunk_size", chunk_size)
        self.chunk_size = chunk_size
        self.scale = self.qk_dim ** -0.5
        self.rope = RotaryEmbedding(self.qk_dim, rope_base) if rope else None

    def new_cache(self) -> RecurrentCache:
        return RecurrentCache()

    def _activate(self, q, k, v):
        return q, k, v

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, cache: RecurrentCache | None = None,
                positions: torch.Tensor | None = None, *, cu_seqlens: torch.Tensor | None = None):
        """x (B, N, d), mask (B, N) bool or None, positions (N,) or (B, N) or None (derived from the
        mask and the cache). cu_seqlens: packed sequences in x (1, T, d) (linattn.ops.packed; the
        state resets at each boundary, positions default to each token's index in its sequence, real
        tokens only when a mask is given).
        Returns (y (B, N, d), cache)."""
        self._check_mask(mask, x)
        if cache is None and self.sequence_parallel_group is not None and mask is not None:
            raise ValueError("sequence parallelism does not take a padding mask")
        q, k, v = self._activate(*self._project(x, mask, cache, cu_seqlens))
        n = x.shape[1]
        if cu_seqlens is not None:
            if self.rope is not None:
                if positions is None:
                    positions = packed.positions(cu_seqlens, n, mask).to(x.device)
                q, k = self.rope.rotate(q, positions), self.rope.rotate(k, positions)
            o, _ = self._mix(x, q, k, v, mask, None, False, cu_seqlens=cu_seqlens)
            return self._merge(o, x), None
        if self.rope is not None:
            if positions is None:
                positions = (cache.next_positions(n, mask, x.device) if cache is not None
                             else token_positions(n, mask, device=x.device))
            q, k = self.rope.rotate(q, positions), self.rope.rotate(k, positions)
        o, state = self._mix(x, q, k, v, mask, None if cache is None else cache.state, cache is not None)
        if cache is not None:
            cache.state = state
            cache.advance(n, mask)
        return self._merge(o, x), cache

    def _mix(self, x, q, k, v, mask, state, stateful: bool, *, cu_seqlens=None):
        """(o (B, H, N, E), state after x or None); runs sequence-parallel over
        `sequence_parallel_group` when one is set and there is no cache (not stateful); cu_seqlens
        (not stateful): packed sequences, passed to the operator."""
        raise NotImplementedError

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, n_heads={self.n_heads}, qk_dim={self.qk_dim}, "
                f"short_conv={0 if self.conv is None else self.conv.kernel_size}, "
                f"output_gate={self.output_gate is not None}, rope={self.rope is not None}")


class _GatedAttention(_RecurrentAttention):
    """Gated linear attention on q, k directly (no feature map, no normalizer): S_t = diag(e^{g_t})
    S_{t−1} + k_t v_tᵀ, o_t = S_tᵀ q_t · D^{−1/2}, with g = `self.decay(x)` (linattn.nn.decay). The scale is
    applied to q here rather than by the operator, whose fused CPU kernels take no scale. Decoding:
    `linattn.ops.gated_linear_attention_step` per token."""

    decay: nn.Module

    def _mix(self, x, q, k, v, mask, state, stateful: bool, *, cu_seqlens=None):
        g = self.decay(x)
        q = q * self.scale
        if cu_seqlens is not None:
            return gated_linear_attention(q, k, v, g, key_padding_mask=mask, chunk_size=self.chunk_size,
                                          cu_seqlens=cu_seqlens), None
        if not stateful and self.sequence_parallel_group is not None:
            return sequence_parallel_gated_linear_attention(q, k, v, g, group=self.sequence_parallel_group,
                                                            chunk_size=self.chunk_size), None
        if not stateful:
            return gated_linear_attention(q, k, v, g, key_padding_mask=mask, chunk_size=self.chunk_size), None
        if q.shape[2] == 1 and mask is None:
            return gated_linear_attention_step(state, q, k, v, g)
        return gated_linear_attention(q, k, v, g, key_padding_mask=mask, initial_state=state, return_state=True,
                                      chunk_size=self.chunk_size)


class RetNetAttention(_GatedAttention):
    """RetNet's retention (Sun et al. 2023) in its recurrent form: a fixed decay per head, γ_h = 1 −
    2^{−5−h} (linattn.nn.decay.FixedDecay), so heads remember over ~32 … 2^{4+H} tokens. RetNet rotates q
    and k (xPos) and normalizes and gates its output: positions="rope" and the output gate."""

    kind = "retnet"

    def __init__(self, d_model: int, n_heads: int, **kw):
        super().__init__(d_model, n_heads, **kw)
        self.decay = FixedDecay(n_heads)


class SimpleGLAAttention(_GatedAttention):
    """Gated linear attention with one data-dependent decay per head and token, Mamba2's form
    g_t = −exp(A_log)·softplus(W_α x_t + dt_bias) (linattn.nn.decay.ScalarDecay): the SSD / "simple GLA"
    recurrence of Mamba2 (Dao & Gu 2024), with q, k, v as attention names them."""

    kind = "simple_gla"

    def __init__(self, d_model: int, n_heads: int, *, dt_init_range=DT_INIT_RANGE, **kw):
        super().__init__(d_model, n_heads, **kw)
        self.decay = ScalarDecay(d_model, n_heads, dt_init_range)


class GLAAttention(_GatedAttention):
    """GLA (Yang et al. 2023): a data-dependent decay per head, token and key feature from a rank-16
    projection, g_t = logsigmoid(W₂W₁ x_t + b)/16 (linattn.nn.decay.FeatureDecay)."""

    kind = "gla"

    def __init__(self, d_model: int, n_heads: int, **kw):
        super().__init__(d_model, n_heads, **kw)
        self.decay = FeatureDecay(d_model, n_heads, self.qk_dim)


class DeltaNetAttention(_RecurrentAttention):
    """DeltaNet (Schlag et al. 2021; Yang et al. 2024): the delta rule with β_t = sigmoid(W_β x_t) per
    head and token, q, k, v through SiLU, q and k L2-normalized (inside the operator), q scaled by
    D^{−1/2} (see the module docstring). Short convolution kernel 4 and the output gate in the
    models' defaults. Decoding: `linattn.ops.delta_rule_step` per token."""

    kind = "deltanet"

    def __init__(self, d_model: int, n_heads: int, **kw):
        super().__init__(d_model, n_heads, **kw)
        self.beta_proj = nn.Linear(d_model, n_heads, bias=False)

    def _activate(self, q, k, v):
        # SiLU on q, k and v after the projection and convolution: Gated DeltaNet's block (Yang et al. 2024b, Fig. 1)
        return F.silu(q), F.silu(k), F.silu(v)

    def _log_decay(self, x):
        return None

    def _mix(self, x, q, k, v, mask, state, stateful: bool, *, cu_seqlens=None):
        sdt = state_dtype(x.dtype)
        # β in the state dtype, kept above the smallest normal number: a sigmoid that underflows to 0 would
        # fail the operator's (0, 1] check, and β that small writes nothing either way
        beta = torch.sigmoid(self.beta_proj(x).to(sdt)).clamp_min(torch.finfo(sdt).tiny).transpose(1, 2)
        g = self._log_decay(x)
        if mask is not None:  # a padded token writes nothing (k = 0) and does not decay the state (g = 0)
            keep = mask[:, None, :]
            k = k * keep[..., None].to(k.dtype)
            g = None if g is None else g.masked_fill(~keep, 0.0)
        opts = dict(g=g, scale=self.scale, qk_l2norm=True)
        if cu_seqlens is not None:
            return delta_rule(q, k, v, beta, chunk_size=self.chunk_size, cu_seqlens=cu_seqlens, **opts), None
        if not stateful and self.sequence_parallel_group is not None:
            return sequence_parallel_delta_rule(q, k, v, beta, group=self.sequence_parallel_group,
                                                chunk_size=self.chunk_size, **opts), None
        if not stateful:
            return delta_rule(q, k, v, beta, chunk_size=self.chunk_size, **opts), None
        if q.shape[2] == 1:
            return delta_rule_step(state, q, k, v, beta, **opts)
        return delta_rule(q, k, v, beta, initial_state=state, return_state=True, chunk_size=self.chunk_size, **opts)


class GatedDeltaNetAttention(DeltaNetAttention):
    """Gated DeltaNet (Yang et al. 2024b): DeltaNet with the decay g_t = −exp(A_log)·softplus(W_α x_t +
    dt_bias) per head and token (linattn.nn.decay.ScalarDecay, Mamba2's form)."""

    kind = "gated_deltanet"

    def __init__(self, d_model: int, n_heads: int, *, dt_init_range=DT_INIT_RANGE, **kw):
        super().__init__(d_model, n_heads, **kw)
        self.decay = ScalarDecay(d_model, n_heads, dt_init_range)

    def _log_decay(self, x):
        return self.decay(x)


__all__ = [
    "DeltaNetAttention",
    "GLAAttention",
    "GatedDeltaNetAttention",
    "RecurrentCache",
    "RetNetAttention",
    "SimpleGLAAttention",
]
