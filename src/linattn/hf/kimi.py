"""transformers' Kimi Linear (model_type kimi_linear, KimiLinearForCausalLM) as a linattn model,
losslessly (docs/design.md §22).

What maps to what (a layer of `config.layer_types`, its FFN of `config.mlp_layer_types`):

    linear_attention  → kind kda (linattn.nn.kda): q_proj, k_proj, v_proj → attn.qkv ([q | k | v]
                        rows), conv1d (C, 1, K) → attn.conv.weight (C, K) (SiLU after it: the kind's
                        own), b_proj → attn.beta_proj (β = sigmoid), forget_gate.f_a_proj / f_b_proj,
                        A_log (1, 1, H, 1), dt_bias → attn.forget_gate.f_a / f_b, A_log (H,), dt_bias
                        (g = −e^{A_log}·softplus(F_b F_a x + dt_bias) per key channel), g_a_proj /
                        g_b_proj, o_norm → attn.kda_gate.g_a / g_b, norm (RMSNorm(o)·w ⊙ sigmoid(G_b G_a
                        x), eps rms_norm_eps), o_proj → attn.out; q, k L2-normalized (ε = 1e-6 inside
                        the norm), scale linear_head_dim^{−1/2}
    full_attention    → kind softmax with MLA's projections (linattn.nn.mla.LatentQKV; kind options
                        kv_lora_rank, q_lora_rank, shared_k_dim = qk_rope_head_dim, latent_eps 1e-6:
                        transformers' q_a_layernorm / kv_a_layernorm keep their default eps whatever
                        rms_norm_eps is): q_proj (or q_a_proj, q_a_layernorm, q_b_proj) → attn.qkv.q
                        (q_a, q_a_norm, q_b), kv_a_proj_with_mqa → attn.qkv.kv_a, kv_a_layernorm →
                        attn.qkv.kv_a_norm, kv_b_proj → attn.qkv.kv_b, o_proj → attn.out; qk_dim =
                        qk_nope_head_dim + qk_rope_head_dim, v_dim = v_head_dim, scale qk_dim^{−1/2};
                        no rotation (transformers' KimiLinearModel has no rotary embedding: the
                        qk_rope_head_dim features are shared by the heads but not rotated), positions
                        "none"
    dense mlp         → ffn (SwiGLU; gate_proj and up_proj stacked as linattn's `up`)
    sparse mlp        → ffn, linattn.nn.moe.MoEFeedForward with router "sigmoid": gate.weight →
                        router.weight, gate.e_score_correction_bias → score_bias, n_group,
                        topk_group, routed_scaling_factor, norm_topk_prob as configured;
                        experts.gate_up_proj / down_proj → gate_up / down; shared_experts (width
                        moe_intermediate_size·n_shared_experts, ungated: shared_gate False) → shared

RMSNorms are plain (w). lm_head is its own matrix whatever tie_word_embeddings says:
KimiLinearForCausalLM declares no tied weights (_tied_weights_keys = {}), so transformers never ties it;
the linattn model has tie_embeddings False and lm_head = transformers' lm_head. Weights: every tensor whose layout linattn shares is the same Parameter in
both models when share=True; the stacked projections ([q | k | v], [gate | up]), the convolution's
(C, K) view, A_log's (H,) view and the router's score bias (a buffer) are copies. Refused by name:
hidden_act other than silu, attention_bias, attention_dropout, num_key_value_heads other than
num_attention_heads (transformers' expand_kv gives every head its own k and v already; its
repeat_kv would then mismatch), layer and mlp types other than the two each, topk_group None.
Padding: transformers zeroes the padded tokens' inputs to the KDA layers; linattn's leave the state
untouched at them; the real tokens' outputs agree.
"""

from __future__ import annotations

import torch
from torch import nn

from ..models.config import ModelConfig
from ..models.lm import LinearTransformerLM
from .hybrid import assemble, refuse_common
from .teacher import _refuse

__all__ = ["KIMI_SUPPORTED", "from_transformers_kimi", "kimi_config"]

#: the model_types converted here
KIMI_SUPPORTED = ("kimi_linear",)
_KINDS = {"linear_attention": "kda", "full_attention": "softmax"}
_MLPS = ("dense", "sparse")
#: the eps of transformers' q_a_layernorm / kv_a_layernorm (KimiLinearRMSNorm's default)
MLA_NORM_EPS = 1e-6


def _check(c, mt: str) -> None:
    """Refuses what the linattn model cannot express (module docstring)."""
    refuse_common(c, mt)
    if c.num_key_value_heads != c.num_attention_heads:
        raise _refuse(mt, f"num_key_value_heads={c.num_key_value_heads} other than num_attention_heads="
                          f"{c.num_attention_heads} (MLA's kv_b_proj makes every head's k and v)")
    n = c.num_hidden_layers
    unknown = sorted(set(c.layer_types[:n]) - set(_KINDS))
    if unknown:
        raise _refuse(mt, f"layer_types {unknown} (only {', '.join(_KINDS)})")
    unknown = sorted(set(c.mlp_layer_types[:n]) - set(_MLPS))
    if unknown:
        raise _refuse(mt, f"mlp_layer_types {unknown} (only {', '.join(_MLPS)})")
    if "sparse" in c.mlp_layer_types[:n] and c.topk_group is None:
        raise _refuse(mt, "topk_group=None")


def _moe(c) -> dict:
    """ModelConfig.moe of the sparse layers ({} when none): the grouped sigmoid router, ungated shared experts."""
    n = c.num_hidden_layers
    layers = [i for i in range(n) if c.mlp_layer_types[i] == "sparse"]
    if not layers:
        return {}
    return dict(num_experts=c.num_local_experts, top_k=c.num_experts_per_tok, d_expert=c.moe_intermediate_size,
                shared_d_ff=c.moe_intermediate_size * c.n_shared_experts, norm_topk_prob=bool(c.norm_topk_prob),
                layers=None if len(layers) == n else layers, router="sigmoid", n_group=c.n_group,
                topk_group=c.topk_group, routed_scaling_factor=float(c.routed_scaling_factor), shared_gate=False)


def kimi_config(c) -> ModelConfig:
    """The ModelConfig of a kimi_linear config `c`; what it cannot express is refused by name."""
    mt = getattr(c, "model_type", None)
    if mt not in KIMI_SUPPORTED:
        raise ValueError(f"model_type {mt!r}: linattn.hf.kimi converts {', '.join(KIMI_SUPPORTED)}")
    _check(c, mt)
    qk = c.qk_nope_head_dim + c.qk_rope_head_dim
    softmax = dict(n_heads=c.num_attention_heads, qk_dim=qk, v_dim=c.v_head_dim, qk_norm=False, output_gate=False,
                   short_conv=0, kv_lora_rank=c.kv_lora_rank, q_lora_rank=c.q_lora_rank,
                   shared_k_dim=c.qk_rope_head_dim, latent_eps=MLA_NORM_EPS)
    kda = dict(n_heads=c.linear_num_heads, qk_dim=c.linear_head_dim, v_dim=c.linear_head_dim, qk_norm=False,
               output_gate=True, short_conv=c.linear_conv_kernel_dim)
    moe = _moe(c)
    n = c.num_hidden_layers
    return ModelConfig(vocab_size=c.vocab_size, d_model=c.hidden_size, n_layers=n, n_heads=c.num_attention_heads,
                       qk_dim=qk, v_dim=c.v_head_dim, d_ff=c.intermediate_size, moe=moe,
                       attention=[_KINDS[t] for t in c.layer_types[:n]], positions="none",
                       max_len=c.max_position_embeddings, norm="rmsnorm", norm_eps=c.rms_norm_eps,
                       activation="swiglu", bias=False, tie_embeddings=False, dropout=0.0,
                       kind_options={"softmax": softmax, "kda": kda})


def _mla_state(a, p: str, shared: dict) -> None:
    """transformers' KimiLinearAttention: every weight keeps its layout (shared)."""
    q = p + "qkv."
    if a.q_proj is not None:
        shared[q + "q.weight"] = a.q_proj.weight
    else:
        shared.update({q + "q_a.weight": a.q_a_proj.weight, q + "q_a_norm.weight": a.q_a_layernorm.weight,
                       q + "q_b.weight": a.q_b_proj.weight})
    shared.update({q + "kv_a.weight": a.kv_a_proj_with_mqa.weight, q + "kv_a_norm.weight": a.kv_a_layernorm.weight,
                   q + "kv_b.weight": a.kv_b_proj.weight, p + "out.weight": a.o_proj.weight})


def _kda_state(a, p: str, shared: dict, copied: dict) -> None:
    """transformers' KimiLinearDeltaAttention (module docstring)."""
    f = a.forget_gate
    copied[p + "qkv.weight"] = torch.cat([a.q_proj.weight.detach(), a.k_proj.weight.detach(),
                                          a.v_proj.weight.detach()])
    copied[p + "conv.weight"] = a.conv1d.weight.detach()[:, 0]
    copied[p + "forget_gate.A_log"] = f.A_log.detach().reshape(-1)
    shared.update({p + "beta_proj.weight": a.b_proj.weight, p + "forget_gate.f_a.weight": f.f_a_proj.weight,
                   p + "forget_gate.f_b.weight": f.f_b_proj.weight, p + "forget_gate.dt_bias": f.dt_bias,
                   p + "kda_gate.g_a.weight": a.g_a_proj.weight, p + "kda_gate.g_b.weight": a.g_b_proj.weight,
                   p + "kda_gate.norm.weight": a.o_norm.weight, p + "out.weight": a.o_proj.weight})


def _mlp_state(m, p: str, shared: dict, copied: dict) -> None:
    """A dense SwiGLU MLP, or the MoE block (router and its bias, stacked experts, ungated shared experts;
    with n_shared_experts 0 transformers' shared MLP is 0 wide, adds 0, and linattn has none)."""
    if hasattr(m, "experts"):
        shared.update({p + "router.weight": m.gate.weight, p + "gate_up": m.experts.gate_up_proj,
                       p + "down": m.experts.down_proj})
        copied[p + "score_bias"] = m.gate.e_score_correction_bias.detach()
        p, m = p + "shared.", m.shared_experts
        if m.down_proj.in_features == 0:
            return
    copied[p + "up.weight"] = torch.cat([m.gate_proj.weight.detach(), m.up_proj.weight.detach()])
    shared[p + "down.weight"] = m.down_proj.weight


def _state(model, cfg: ModelConfig) -> tuple[dict, dict]:
    """({name: Parameter} shared as they are, {name: tensor} copied) of the linattn model."""
    base = model.model
    shared = {"tok_emb.weight": base.embed_tokens.weight, "norm.weight": base.norm.weight}
    copied: dict = {}
    if not cfg.tie_embeddings:
        shared["lm_head.weight"] = model.lm_head.weight
    for i, layer in enumerate(base.layers):
        p = f"blocks.{i}."
        shared[p + "norm1.weight"] = layer.input_layernorm.weight
        shared[p + "norm2.weight"] = layer.post_attention_layernorm.weight
        _mlp_state(layer.mlp, p + "ffn.", shared, copied)
        if cfg.layer_kinds[i] == "kda":
            _kda_state(layer.self_attn, p + "attn.", shared, copied)
        else:
            _mla_state(layer.self_attn, p + "attn.", shared)
    return shared, copied


def from_transformers_kimi(model: nn.Module, *, share: bool = True) -> LinearTransformerLM:
    """The linattn LM equal to transformers' KimiLinearForCausalLM `model` (module docstring), in its
    dtype; share: the Parameters whose layout agrees are the model's own (else copies)."""
    cfg = kimi_config(model.config)
    return assemble(model, cfg, *_state(model, cfg), share=share)
