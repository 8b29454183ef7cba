"""The linear and softmax kinds (design §3–8): `linear` (Katharopoulos et al. 2020) and `softmax`.

Their interface and everything they share with the other kinds is linattn.nn.base.Attention's; a
kind here supplies its parameters, its family (linattn.nn.families) and its operands (`mix`):

    LinearAttention:  o = feature-mapped linear attention; cache (kv (B, H, F, E), z (B, H, F)) +
                      position; O(1) per new token.
    SoftmaxAttention: o = softmax attention through SDPA; cache: growing K (B, H, T, D), V (B, H, T, E)
                      (+ padding mask); O(T) per new token.
"""

from __future__ import annotations

from torch import nn

from .._checks import check_positive_int
from ..ops.features import native_code
from ..ops.linear.chunked import DEFAULT_CHUNK_SIZE
from .base import Attention
from .families import LINEAR, SOFTMAX, LinearMix, SoftmaxMix
from .feature_maps import make_feature_map, plan_feature_map
from .mla import LatentQKV
from .positional import RotaryEmbedding


class LinearAttention(Attention):
    """Multi-head linear attention (Katharopoulos et al. 2020) with a feature map φ:

        y_i = W_o · concat_h [ Σ_j (R_i φ(q_i))ᵀ (R_j φ(k_j)) v_j / (Σ_j φ(q_i)ᵀ φ(k_j) + ε) ],  j ≤ i if causal,

    R_i the RoPE rotation of the *features* (numerator only, design §6) when rope=True, identity
    otherwise. q, k: (B, H, N, qk_dim) (default qk_dim = d_model / n_heads; use a small one, e.g. 16,
    for Taylor features, F = 1 + D + D²), v: (B, H, N, d_model / n_heads). One φ per layer, shared
    by the heads. Dropout applies to the output projection (there is no attention matrix to drop).

    Training: forward(x, mask) runs the chunked causal (or non-causal) operator.
    Decoding: forward(x, cache=layer.new_cache()) for the prefill, then forward(x_t, cache=cache)
    per token, O(F·E) per head whatever the context length. Packed sequences: causal only.
    """

    kind = "linear"
    family = LINEAR

    def __init__(self, d_model: int, n_heads: int, *, feature_map="elu", feature_map_options: dict | None = None,
                 causal: bool = True, rope: bool = False, rope_base: float = 10_000.0, qk_dim: int | None = None,
                 v_dim: int | None = None,
                 normalize: bool = True, eps: float = 1e-6, dropout: float = 0.0, bias: bool = False,
                 chunk_size: int = DEFAULT_CHUNK_SIZE, short_conv: int = 0, output_gate: bool = False,
                 norm_eps: float = 1e-5):
        super().__init__(d_model, n_heads, qk_dim, causal, dropout, bias, short_conv=short_conv,
                         output_gate=output_gate, norm_eps=norm_eps, v_dim=v_dim)
        if isinstance(feature_map, str):
            self.feature_map = make_feature_map(feature_map, self.qk_dim, **(feature_map_options or {}))
        elif isinstance(feature_map, nn.Module) and hasattr(feature_map, "feature_dim"):
            if feature_map_options:
                raise ValueError("feature_map_options only apply when feature_map is a name")
            if getattr(feature_map, "head_dim", self.qk_dim) != self.qk_dim:
                raise ValueError(f"feature_map head_dim {feature_map.head_dim} != qk_dim {self.qk_dim}")
            self.feature_map = feature_map
        else:
            raise ValueError(f"feature_map must be a name or a linattn feature map module, got {feature_map!r}")
        self.rope = RotaryEmbedding(self.feature_map.feature_dim, rope_base) if rope else None
        check_positive_int("chunk_size", chunk_size)
        self.normalize, self.eps, self.chunk_size = bool(normalize), float(eps), chunk_size

    def mix(self, x, q, k, v, positions) -> LinearMix:
        return LinearMix(q, k, v, feature_map=self.feature_map, normalize=self.normalize, eps=self.eps, rope=self.rope,
                         causal=self.causal, chunk_size=self.chunk_size, positions=positions)

    def step_obstacle(self) -> str | None:
        if native_code(self.feature_map) is None:
            return f"feature map {type(self.feature_map).__name__} takes the eager path"
        return super().step_obstacle()

    def plan_mixer(self, plan, cache, tensors: dict, ints: dict, floats: dict) -> None:
        """(kv, z), φ's code and tensors; RoPE on φ's features, in the dtype the eager path holds them."""
        kv, z = plan.state(cache)
        tensors.update(kv=kv, z=z)
        features_bf16 = plan_feature_map(self.feature_map, plan, tensors, ints, floats)
        ints["normalize"] = int(self.normalize)
        floats["eps"] = self.eps
        if self.rope is not None:
            tensors["feature_rope_cos"], tensors["feature_rope_sin"] = plan.rope(self.rope.dim, self.rope.base,
                                                                                 features_bf16)

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, n_heads={self.n_heads}, qk_dim={self.qk_dim}, causal={self.causal}, "
                f"rope={self.rope is not None}, normalize={self.normalize}")


class SoftmaxAttention(Attention):
    """Multi-head softmax attention with the same interface as LinearAttention:

        y_i = W_o · concat_h [ Σ_j softmax_j(q̂_iᵀ k̂_j / √qk_dim) v_j ],  j ≤ i if causal,

    q̂, k̂ = RoPE-rotated q, k (standard RoPE on the head dim) when rope=True. Dropout applies to the
    attention weights (training only) and to the output projection. Decoding keeps a KV cache.

    kv_lora_rank (an int; None: the fused q|k|v projection): multi-head latent attention's
    projections (linattn.nn.mla.LatentQKV, Kimi Linear's and DeepSeek-V2's MLA) in place of the fused
    one — k and v from a rank-kv_lora_rank latent with an RMSNorm, q full rank or (q_lora_rank)
    through its own normalized latent, shared_k_dim key features shared by every head, latent_eps
    the latent norms' eps. The fused step plans them as products, norm groups and a gather
    (LatentQKV.plan_step).
    """

    kind = "softmax"
    family = SOFTMAX

    def __init__(self, d_model: int, n_heads: int, *, causal: bool = True, rope: bool = False,
                 rope_base: float = 10_000.0, qk_dim: int | None = None, v_dim: int | None = None, dropout: float = 0.0,
                 bias: bool = False, short_conv: int = 0, output_gate: bool | str = False, norm_eps: float = 1e-5,
                 q_lora_rank: int | None = None, kv_lora_rank: int | None = None, shared_k_dim: int = 0,
                 latent_eps: float = 1e-6):
        super().__init__(d_model, n_heads, qk_dim, causal, dropout, bias, short_conv=short_conv,
                         output_gate=output_gate, norm_eps=norm_eps, v_dim=v_dim)
        self.rope = RotaryEmbedding(self.qk_dim, rope_base) if rope else None
        if kv_lora_rank is not None:
            self.qkv = LatentQKV(d_model, n_heads, self.qk_dim, self.head_dim, kv_lora_rank, q_lora_rank,
                                 shared_k_dim, latent_eps, bias)
        elif q_lora_rank is not None or shared_k_dim:
            raise ValueError(f"q_lora_rank={q_lora_rank}, shared_k_dim={shared_k_dim}: multi-head latent "
                             "attention's options need kv_lora_rank (the k/v latent)")

    @property
    def latent(self) -> bool:
        """Whether q, k, v come from MLA's latent projections (kv_lora_rank)."""
        return isinstance(self.qkv, LatentQKV)

    def set_qkv_bias(self, bias: bool) -> None:
        if self.latent:
            raise ValueError("qkv_bias: the MLA projections (kv_lora_rank) take their biases from `bias`")
        super().set_qkv_bias(bias)

    def mix(self, x, q, k, v, positions) -> SoftmaxMix:
        q, k = self.rotate(q, k, positions)
        return SoftmaxMix(q, k, v, causal=self.causal, dropout_p=self.dropout_p if self.training else 0.0)

    def plan_mixer(self, plan, cache, tensors: dict, ints: dict, floats: dict) -> None:
        """The KV cache (grown to hold the tokens the plan reserves) and its padding mask."""
        plan.reserve_kv(cache)
        tensors.update(k_cache=cache.k, v_cache=cache.v)
        if cache.mask is not None:
            tensors["key_mask"] = cache.mask
        self.plan_qk_rope(plan, tensors)

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, n_heads={self.n_heads}, qk_dim={self.qk_dim}, causal={self.causal}, "
                f"rope={self.rope is not None}")


__all__ = ["LinearAttention", "SoftmaxAttention"]
