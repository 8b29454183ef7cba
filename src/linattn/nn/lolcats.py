"""The LoLCATs attention layer (Zhang et al. 2024): softmax over a sliding window of W tokens and
linear attention with learned feature maps beyond it, one normalizer over both (design §19;
linattn.ops.swa.hybrid has the maths):

    y_i = W_o · concat_h [ (Σ_{window} γ_h e^{s_ij − m_i} v_j + Σ_{beyond} φ_q(q̂_i)ᵀφ_k(k̂_j) v_j)
                           / (Σ_{window} γ_h e^{s_ij − m_i} + Σ_{beyond} φ_q(q̂_i)ᵀφ_k(k̂_j)) ],

s_ij = q̂_iᵀk̂_j/√qk_dim, m_i its maximum over the window, q̂, k̂ the RoPE-rotated q, k (the feature
maps read the rotated vectors, as in LoLCATs, so a teacher's q/k/v/o and positions carry over), and
γ_h = sigmoid(θ_h) a learned per-head weight of the window (LoLCATs' `window_factors`, initialised at
θ = −2.1972, γ = 0.1; the linear part's factor is 1). φ_q and φ_k are separate feature maps of
linattn.nn.feature_maps (Hedgehog by default, initialised to the identity map), shared by the heads.

Training runs the chunked hybrid; decoding keeps the window in a ring buffer and the tokens that
left it in a linear state (LoLCATsCache): memory flat in the context length.
"""

from __future__ import annotations

import torch
from torch import nn

from .._checks import check_int, check_number
from ..ops.features import native_code
from ..ops.linear.chunked import DEFAULT_CHUNK_SIZE
from .base import Attention
from .caches import LoLCATsCache
from .families import WINDOW_LINEAR, HybridMix
from .feature_maps import make_feature_map, plan_feature_map
from .positional import RotaryEmbedding
from .swa import DEFAULT_WINDOW, SlidingWindowAttention

#: LoLCATs' initial window-factor logit: sigmoid(−2.1972) = 0.1.
DEFAULT_WINDOW_FACTOR_LOGIT = -2.1972245773362196


def _feature_map(name_or_module, options, qk_dim: int, which: str) -> nn.Module:
    if isinstance(name_or_module, str):
        return make_feature_map(name_or_module, qk_dim, **(options or {}))
    if isinstance(name_or_module, nn.Module) and hasattr(name_or_module, "feature_dim"):
        if getattr(name_or_module, "head_dim", qk_dim) != qk_dim:
            raise ValueError(f"{which} head_dim {name_or_module.head_dim} != qk_dim {qk_dim}")
        return name_or_module
    raise ValueError(f"{which} must be a name or a linattn feature map module, got {name_or_module!r}")


class LoLCATsAttention(Attention):
    """Multi-head causal LoLCATs attention (see the module docstring).

    window: W. feature_map / feature_map_options: φ_q and φ_k (two instances of one kind, or give
    feature_map_k to make φ_k differ; a module is used as is). window_factor_logit: θ's initial value.
    chunk_size: the query block of the chunked form. The rest as SoftmaxAttention; causal only.
    """

    kind = "lolcats"
    family = WINDOW_LINEAR

    def __init__(self, d_model: int, n_heads: int, *, window: int = DEFAULT_WINDOW, feature_map="hedgehog",
                 feature_map_options: dict | None = None, feature_map_k=None, causal: bool = True,
                 rope: bool = False, rope_base: float = 10_000.0, qk_dim: int | None = None, dropout: float = 0.0,
                 bias: bool = False, chunk_size: int = DEFAULT_CHUNK_SIZE, short_conv: int = 0,
                 output_gate: bool = False, norm_eps: float = 1e-5,
                 window_factor_logit: float = DEFAULT_WINDOW_FACTOR_LOGIT):
        if causal is not True:
            raise ValueError(f"causal must be True: LoLCATs attention is causal, got {causal!r}")
        super().__init__(d_model, n_heads, qk_dim, causal, dropout, bias, short_conv=short_conv,
                         output_gate=output_gate, norm_eps=norm_eps)
        check_int("window", window, minimum=1)
        check_int("chunk_size", chunk_size, minimum=1)
        check_number("window_factor_logit", window_factor_logit)
        self.window, self.chunk_size = window, chunk_size
        self.feature_map_q = _feature_map(feature_map, feature_map_options, self.qk_dim, "feature_map")
        self.feature_map_k = _feature_map(feature_map if feature_map_k is None else feature_map_k,
                                          feature_map_options, self.qk_dim, "feature_map_k")
        if self.feature_map_q.feature_dim != self.feature_map_k.feature_dim:
            raise ValueError(f"φ_q and φ_k must have one feature dim, got {self.feature_map_q.feature_dim} "
                             f"and {self.feature_map_k.feature_dim}")
        self.window_factor_logit = nn.Parameter(torch.full((n_heads,), float(window_factor_logit)))
        self.rope = RotaryEmbedding(self.qk_dim, rope_base) if rope else None

    @property
    def window_factor(self) -> torch.Tensor:
        """γ_h = sigmoid(θ_h), (H,)."""
        return torch.sigmoid(self.window_factor_logit)

    def mix(self, x, q, k, v, positions) -> HybridMix:
        q, k = self.rotate(q, k, positions)
        qf = self.feature_map_q(q, is_query=True, positions=positions)
        kf = self.feature_map_k(k, is_query=False, positions=positions)
        return HybridMix(q, k, qf, kf, v, self.window, self.window_factor.to(q.dtype), self.chunk_size)

    def step_obstacle(self) -> str | None:
        for fm in (self.feature_map_q, self.feature_map_k):
            if native_code(fm) is None:
                return f"feature map {type(fm).__name__} takes the eager path"
        return super().step_obstacle()

    def plan_mixer(self, plan, cache, tensors: dict, ints: dict, floats: dict) -> None:
        """The window mixer's arguments (csrc/model_window.h): the ring buffer (SlidingWindowAttention's
        `plan_window`) with its key features, the linear state (kv, z), φ_q and φ_k, the window factors γ
        (in the model's dtype, as the eager step rounds them)."""
        SlidingWindowAttention.plan_window(self, plan, cache, tensors, ints)
        state = cache.state
        if any(t.dtype != torch.float32 or not t.is_contiguous() for t in (state.kv, state.z)) \
                or not state.kf.is_contiguous():
            raise ValueError("fused decoding: LoLCATs' linear state must be contiguous float32")
        tensors.update(window_kf=state.kf, kv=state.kv, z=state.z,
                       window_factor=self.window_factor.detach().to(plan.dtype))
        plan_feature_map(self.feature_map_q, plan, tensors, ints, floats, "q_")
        plan_feature_map(self.feature_map_k, plan, tensors, ints, floats, "k_")
        ints["beyond"] = 1  # a linear state (model_window.h's kBeyondLinear)

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, n_heads={self.n_heads}, qk_dim={self.qk_dim}, window={self.window}, "
                f"rope={self.rope is not None}")


__all__ = ["DEFAULT_WINDOW_FACTOR_LOGIT", "LoLCATsAttention", "LoLCATsCache"]
