"""transformers' hybrid causal LMs (Gated DeltaNet + gated softmax attention) as linattn models,
losslessly (docs/design.md §22). Supported: Qwen3.5's text model (model_type qwen3_5_text,
Qwen3_5ForCausalLM; the language model of a qwen3_5 Qwen3_5ForConditionalGeneration), Qwen3.5-MoE's
(qwen3_5_moe_text, qwen3_5_moe), Qwen3-Next (qwen3_next) and OLMo-Hybrid (olmo_hybrid).

What maps to what (a layer of `config.layer_types`):

    linear_attention  → kind gated_deltanet: in_proj_qkv → attn.qkv ([q | k | v] rows, as linattn's),
                        conv1d (C, 1, K) → attn.conv.weight (C, K) (the same causal sum; SiLU after it
                        is the delta kinds' own SiLU on q, k, v), in_proj_b → attn.beta_proj (β =
                        sigmoid), in_proj_a, A_log, dt_bias → attn.decay (g = −e^{A_log}·softplus(a +
                        dt_bias)), norm + in_proj_z → attn.output_gate (RMSNorm(o)·w ⊙ silu(z)),
                        out_proj → attn.out; q, k L2-normalized (ε = 1e-6 inside the norm, as
                        transformers' l2norm), scale linear_key_head_dim^{−1/2}, no RoPE (rope_dim 0)
    full_attention    → kind softmax: q_proj's per-head [q_h | gate_h] rows split into attn.qkv's q
                        and attn.output_gate.proj (output_gate "sigmoid": o ⊙ sigmoid(W_g x)),
                        q_norm / k_norm → attn.q_norm / k_norm (qk_norm), RoPE on the first
                        head_dim·partial_rotary_factor features (rope_dim), rotate-half pairing
    mlp               → ffn (SwiGLU; gate_proj and up_proj stacked as linattn's `up`)
    sparse MoE mlp    → ffn, a linattn.nn.moe.MoEFeedForward (ModelConfig.moe): gate → router,
                        experts.gate_up_proj / down_proj → gate_up / down (transformers' stacked
                        layout, shared), shared_expert → shared (a SwiGLU FFN), shared_expert_gate →
                        shared_gate; Qwen3.5-MoE renormalizes the top-k weights, Qwen3-Next as its
                        norm_topk_prob says; Qwen3-Next's dense layers (mlp_only_layers,
                        decoder_sparse_step) keep the dense FFN (moe["layers"])

OLMo-Hybrid differs from Qwen3.5 in: its softmax layers are post-norm (OLMo2's x ← x + Norm(Attn(x)),
x ← x + Norm(FFN(x)): post_norm, post_attention_layernorm → norm1, post_feedforward_layernorm →
norm2), their q_norm / k_norm run over all heads' features at once (qk_norm "all"; k_norm's gain
expanded with k's heads — the mean square over repeated groups is the groups'), no output gate, RoPE
only when rope_parameters names a rope_theta (the released checkpoints: none, positions "none");
its delta layers have separate q/k/v/a/b/g projections, β = 2·sigmoid(b) with
linear_allow_neg_eigval (allow_neg_eigval), and a gated output norm with eps 1e-5 whatever
rms_norm_eps is (output_gate_eps); its RMSNorms are plain (w, shared).

Qwen3-Next fuses the delta layers' projections: in_proj_qkvz's rows are grouped per key head,
[q_g | k_g | v_g (r heads) | z_g (r heads)], in_proj_ba's [b_g (r) | a_g (r)] (r value heads per
key head); they are regrouped into Qwen3.5's [q; k; v], z, b, a (copies) before the mapping above.

Grouped heads are expanded to one per value head: the softmax layers' k and v (num_key_value_heads
< num_attention_heads) and the delta layers' q and k (linear_num_key_heads < linear_num_value_heads),
each group's rows (and, for the delta layers, their convolution taps) repeated for its consecutive
heads — transformers' repeat_kv and repeat_interleave(dim=heads) order. The convolution is per
channel, the L2 norm per head, so repeating before them computes the same values.

Qwen3.5's RMSNorms (decoder norms, final norm, q_norm, k_norm) are zero-centred: the stored weight
w is applied as (1 + w), computed in float32. The linattn model stores 1 + w: for float32 (or float64)
weights that is the same float32 (float64) number transformers multiplies by, so the logits agree
to float rounding; for bfloat16 weights 1 + w is rounded to bfloat16 (transformers keeps it in
float32), a rounding of the gain's last bit. The gated norm of the delta layers is a plain one (w).

Weights: the tensors whose layout linattn shares — embeddings, lm_head, o_proj, out_proj, down_proj,
in_proj_b, in_proj_a, A_log, dt_bias, in_proj_z, the gated norm, the router, the experts and the
shared expert's gate and down_proj — are the same Parameters in both
models when share=True (training one trains the other); the others (the stacked or split
projections, the expanded heads, the convolution's (C, K) view and the 1 + w gains) are copies,
the matrices among them row-major like the shared ones.

Positions: text-only, so the three mrope sections see the same position ids and the rotation is
plain RoPE whatever mrope_section says. Refused by name: rope types other than default,
attention_bias, an odd rotary dim, hidden_act other than silu, layer types other than the two,
num_*_heads that do not divide.
"""

from __future__ import annotations

import torch
from torch import nn

from ..models.config import ModelConfig
from ..models.lm import LinearTransformerLM
from .teacher import _expand, _refuse, _rope_base

__all__ = ["HYBRID_SUPPORTED", "assemble", "from_transformers_hybrid", "hybrid_config"]

#: the model_types converted here (qwen3_5, qwen3_5_moe: their language model)
HYBRID_SUPPORTED = ("qwen3_5_text", "qwen3_5", "qwen3_5_moe_text", "qwen3_5_moe", "qwen3_next", "olmo_hybrid")
_MULTIMODAL = ("qwen3_5", "qwen3_5_moe")
_KINDS = {"linear_attention": "gated_deltanet", "full_attention": "softmax"}
#: the eps of OLMo-Hybrid's gated output norm (FLA's FusedRMSNormGated default), whatever rms_norm_eps is
OLMO_GATE_EPS = 1e-5


def text_config(c):
    """The text model's config of `c` (a qwen3_5 or qwen3_5_moe config holds it as text_config)."""
    return c.get_text_config() if getattr(c, "model_type", None) in _MULTIMODAL else c


def _moe(c, mt: str) -> dict:
    """ModelConfig.moe of a Qwen3.5-MoE (every layer, top-k weights renormalized) or Qwen3-Next
    (the layers not in mlp_only_layers whose index + 1 is a multiple of decoder_sparse_step;
    norm_topk_prob as configured) config; {} for dense Qwen3.5."""
    if not mt.startswith(("qwen3_5_moe", "qwen3_next")):
        return {}
    n = c.num_hidden_layers
    if mt == "qwen3_next":
        layers = [i for i in range(n) if i not in c.mlp_only_layers and c.num_experts > 0
                  and (i + 1) % c.decoder_sparse_step == 0]
        if not layers:
            return {}
        norm = bool(c.norm_topk_prob)
    else:
        layers, norm = list(range(n)), True  # Qwen3_5MoeTopKRouter always renormalizes
    return dict(num_experts=c.num_experts, top_k=c.num_experts_per_tok, d_expert=c.moe_intermediate_size,
                shared_d_ff=c.shared_expert_intermediate_size, norm_topk_prob=norm,
                layers=None if len(layers) == n else layers)


def _divides(mt: str, a_name: str, a: int, b_name: str, b: int) -> None:
    if a % b:
        raise _refuse(mt, f"{a_name}={a} not a multiple of {b_name}={b}")


def _head_dim(c) -> int:
    return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads


def _rope_dim(c, mt: str) -> int:
    params = getattr(c, "rope_parameters", None) or {}
    factor = float(params.get("partial_rotary_factor", getattr(c, "partial_rotary_factor", 1.0)))
    dim = int(_head_dim(c) * factor)
    if dim % 2 or dim <= 0:
        raise _refuse(mt, f"partial_rotary_factor={factor} (a rotary dim of {dim}; linattn rotates an even number "
                          "of features)")
    return dim


def refuse_common(c, mt: str) -> None:
    """What no converted hybrid expresses: an activation other than SiLU (SwiGLU and the short
    convolution's), biases on the attention projections, attention dropout."""
    if c.hidden_act != "silu":
        raise _refuse(mt, f"hidden_act {c.hidden_act!r} (SwiGLU and the SiLU of the short convolution)")
    if getattr(c, "attention_bias", False):
        raise _refuse(mt, "attention_bias=True")
    if getattr(c, "attention_dropout", 0.0):
        raise _refuse(mt, f"attention_dropout={c.attention_dropout}")


def hybrid_config(c) -> ModelConfig:
    """The ModelConfig of a config `c` of HYBRID_SUPPORTED (for qwen3_5 / qwen3_5_moe, of its text_config);
    what it cannot express is refused by name (module docstring)."""
    mt = getattr(c, "model_type", None)
    if mt not in HYBRID_SUPPORTED:
        raise ValueError(f"model_type {mt!r}: linattn.hf.hybrid converts {', '.join(HYBRID_SUPPORTED)}")
    c = text_config(c)
    refuse_common(c, mt)
    unknown = sorted(set(c.layer_types) - set(_KINDS))
    if unknown:
        raise _refuse(mt, f"layer_types {unknown} (only {', '.join(_KINDS)})")
    _divides(mt, "num_attention_heads", c.num_attention_heads, "num_key_value_heads", c.num_key_value_heads)
    _divides(mt, "linear_num_value_heads", c.linear_num_value_heads, "linear_num_key_heads", c.linear_num_key_heads)
    hd = _head_dim(c)
    softmax = dict(n_heads=c.num_attention_heads, qk_dim=hd, v_dim=hd, qk_norm=True, output_gate="sigmoid",
                   short_conv=0)
    delta = dict(n_heads=c.linear_num_value_heads, qk_dim=c.linear_key_head_dim, v_dim=c.linear_value_head_dim,
                 qk_norm=False, output_gate=True, rope_dim=0, short_conv=c.linear_conv_kernel_dim)
    rope = mt != "olmo_hybrid" or (getattr(c, "rope_parameters", None) or {}).get("rope_theta") is not None
    if rope:
        softmax["rope_dim"] = _rope_dim(c, mt)
    if mt == "olmo_hybrid":  # post-norm softmax layers with one q/k norm across the heads, no gate; β ≤ 2
        softmax.update(qk_norm="all", output_gate=False, post_norm=True)
        delta.update(output_gate_eps=OLMO_GATE_EPS, allow_neg_eigval=bool(c.linear_allow_neg_eigval))
    kinds = [_KINDS[t] for t in c.layer_types[:c.num_hidden_layers]]
    moe = _moe(c, mt)
    d_ff = getattr(c, "intermediate_size", None) if not moe or moe["layers"] is not None else None
    return ModelConfig(vocab_size=c.vocab_size, d_model=c.hidden_size, n_layers=c.num_hidden_layers,
                       n_heads=c.num_attention_heads, qk_dim=hd, v_dim=hd, d_ff=d_ff, moe=moe,
                       attention=kinds, positions="rope" if rope else "none",
                       rope_base=_rope_base(c, mt) if rope else 10_000.0,
                       max_len=c.max_position_embeddings, norm="rmsnorm", norm_eps=c.rms_norm_eps, activation="swiglu",
                       bias=False, tie_embeddings=bool(c.tie_word_embeddings), dropout=0.0,
                       kind_options={"softmax": softmax, "gated_deltanet": delta})


def _gain(norm: nn.Module) -> torch.Tensor:
    """1 + w of a zero-centred RMSNorm, in its weight's dtype (module docstring)."""
    return 1.0 + norm.weight.detach()


def _olmo_softmax_state(a, c, p: str, shared: dict, copied: dict) -> None:
    """OLMo-Hybrid's attention: plain q_proj, q_norm / k_norm over all heads' features (k's expanded with
    its heads: the mean square over repeated groups is the group's), no gate."""
    h, kv = c.num_attention_heads, c.num_key_value_heads
    copied[p + "qkv.weight"] = torch.cat([a.q_proj.weight.detach(), _expand(a.k_proj.weight.detach(), h, kv),
                                          _expand(a.v_proj.weight.detach(), h, kv)])
    shared[p + "q_norm.weight"] = a.q_norm.weight
    copied[p + "k_norm.weight"] = _expand(a.k_norm.weight.detach(), h, kv)
    shared[p + "out.weight"] = a.o_proj.weight


def _softmax_state(a, c, p: str, shared: dict, copied: dict) -> None:
    if c.model_type == "olmo_hybrid":
        return _olmo_softmax_state(a, c, p, shared, copied)
    h, kv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    qg = a.q_proj.weight.detach().view(h, 2, d, -1)  # per head [q_h | gate_h] (transformers' chunk of 2·head_dim)
    copied[p + "qkv.weight"] = torch.cat([qg[:, 0].reshape(h * d, -1), _expand(a.k_proj.weight.detach(), h, kv),
                                          _expand(a.v_proj.weight.detach(), h, kv)])
    copied[p + "output_gate.proj.weight"] = qg[:, 1].reshape(h * d, -1)
    copied[p + "q_norm.weight"], copied[p + "k_norm.weight"] = _gain(a.q_norm), _gain(a.k_norm)
    shared[p + "out.weight"] = a.o_proj.weight


def _next_projections(a, c) -> tuple[torch.Tensor, ...]:
    """Qwen3-Next's fused in_proj_qkvz / in_proj_ba as Qwen3.5's separate ones ([q; k; v], z, b, a rows):
    their rows are grouped per key head g, [q_g (dk) | k_g (dk) | v_g (r·dv) | z_g (r·dv)] and
    [b_g (r) | a_g (r)] with r = value heads per key head (transformers' fix_query_key_value_ordering)."""
    nk, nv, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
    r = nv // nk
    w = a.in_proj_qkvz.weight.detach()
    q, k, v, z = w.view(nk, 2 * dk + 2 * r * dv, -1).split((dk, dk, r * dv, r * dv), dim=1)
    b, a_ = a.in_proj_ba.weight.detach().view(nk, 2 * r, -1).split((r, r), dim=1)
    flat = [t.reshape(-1, w.shape[1]) for t in (q, k, v, z, b, a_)]
    return torch.cat(flat[:3]), flat[3], flat[4], flat[5]


def _delta_state(a, c, p: str, shared: dict, copied: dict) -> None:
    nk, nv, dk = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim
    key = nk * dk

    def heads(w):  # [q | k | v] rows (or channels) with q and k expanded to one head per value head
        q, k, v = w.split((key, key, w.shape[0] - 2 * key))
        return torch.cat([_expand(q, nv, nk), _expand(k, nv, nk), v])

    if hasattr(a, "in_proj_qkvz"):  # Qwen3-Next: the fused projections, regrouped (copies)
        qkv, z, b, a_ = _next_projections(a, c)
        copied.update({p + "beta_proj.weight": b, p + "decay.proj.weight": a_, p + "output_gate.proj.weight": z})
    elif hasattr(a, "g_proj"):  # OLMo-Hybrid: separate q, k, v, a, b, g projections, o_norm, o_proj
        qkv = torch.cat([a.q_proj.weight.detach(), a.k_proj.weight.detach(), a.v_proj.weight.detach()])
        shared.update({p + "beta_proj.weight": a.b_proj.weight, p + "decay.proj.weight": a.a_proj.weight,
                       p + "output_gate.proj.weight": a.g_proj.weight, p + "decay.A_log": a.A_log,
                       p + "decay.dt_bias": a.dt_bias, p + "output_gate.norm.weight": a.o_norm.weight,
                       p + "out.weight": a.o_proj.weight})
        copied[p + "qkv.weight"] = heads(qkv)
        copied[p + "conv.weight"] = heads(a.conv1d.weight.detach()[:, 0])
        return
    else:
        qkv = a.in_proj_qkv.weight.detach()
        shared.update({p + "beta_proj.weight": a.in_proj_b.weight, p + "decay.proj.weight": a.in_proj_a.weight,
                       p + "output_gate.proj.weight": a.in_proj_z.weight})
    copied[p + "qkv.weight"] = heads(qkv)
    copied[p + "conv.weight"] = heads(a.conv1d.weight.detach()[:, 0])
    shared.update({p + "decay.A_log": a.A_log, p + "decay.dt_bias": a.dt_bias,
                   p + "output_gate.norm.weight": a.norm.weight, p + "out.weight": a.out_proj.weight})


def _mlp_state(m, p: str, shared: dict, copied: dict) -> None:
    """A dense SwiGLU MLP, or a sparse MoE block (router, stacked experts, gated shared expert)."""
    if hasattr(m, "experts"):
        shared.update({p + "router.weight": m.gate.weight, p + "gate_up": m.experts.gate_up_proj,
                       p + "down": m.experts.down_proj, p + "shared_gate.weight": m.shared_expert_gate.weight})
        p, m = p + "shared.", m.shared_expert
    copied[p + "up.weight"] = torch.cat([m.gate_proj.weight.detach(), m.up_proj.weight.detach()])
    shared[p + "down.weight"] = m.down_proj.weight


def _parts(model):
    """(text config, text model (embed_tokens, layers, norm), lm_head) of a Qwen3.5 causal LM."""
    c = text_config(model.config)
    base = model.model
    base = getattr(base, "language_model", base)
    return c, base, model.lm_head


def _state(model, cfg: ModelConfig) -> tuple[dict, dict]:
    """({name: Parameter} shared as they are, {name: tensor} copied) of the linattn model."""
    c, base, head = _parts(model)
    shared = {"tok_emb.weight": base.embed_tokens.weight}
    olmo = c.model_type == "olmo_hybrid"  # plain RMSNorms (w), shared; Qwen's are zero-centred (1 + w), copied

    def norm(name: str, module: nn.Module) -> None:
        (shared if olmo else copied)[name] = module.weight if olmo else _gain(module)

    copied: dict = {}
    norm("norm.weight", base.norm)
    if not cfg.tie_embeddings:
        shared["lm_head.weight"] = head.weight
    for i, layer in enumerate(base.layers):
        p = f"blocks.{i}."
        if hasattr(layer, "post_feedforward_layernorm"):  # OLMo's post-norm attention layer
            norm(p + "norm1.weight", layer.post_attention_layernorm)
            norm(p + "norm2.weight", layer.post_feedforward_layernorm)
        else:
            norm(p + "norm1.weight", layer.input_layernorm)
            norm(p + "norm2.weight", layer.post_attention_layernorm)
        _mlp_state(layer.mlp, p + "ffn.", shared, copied)
        if hasattr(layer, "linear_attn"):  # a linear_attention layer
            _delta_state(layer.linear_attn, c, p + "attn.", shared, copied)
        else:
            _softmax_state(layer.self_attn, c, p + "attn.", shared, copied)
    return shared, copied


def _put(lm: nn.Module, name: str, param: nn.Parameter) -> None:
    owner, _, attr = name.rpartition(".")
    setattr(lm.get_submodule(owner), attr, param)


def from_transformers_hybrid(model: nn.Module, *, share: bool = True) -> LinearTransformerLM:
    """The linattn LM equal to transformers' Qwen3.5 causal LM `model` (module docstring), in its dtype;
    share: the Parameters whose layout agrees are the model's own (else copies)."""
    cfg = hybrid_config(model.config)
    return assemble(model, cfg, *_state(model, cfg), share=share)


def _tensor(lm: nn.Module, name: str) -> torch.Tensor:
    """lm's parameter or buffer `name`."""
    owner, _, attr = name.rpartition(".")
    return getattr(lm.get_submodule(owner), attr)


def assemble(model: nn.Module, cfg: ModelConfig, shared: dict, copied: dict, *, share: bool = True
             ) -> LinearTransformerLM:
    """A LinearTransformerLM of `cfg` in `model`'s dtype holding `shared` ({name: Parameter}, the
    model's own when share, else copied) and `copied` ({name: tensor}, parameters or buffers); every
    tensor of the LM must be named once, with its shape (else ValueError naming them). Copied matrices
    keep nn.Linear's row-major (out, in) layout, as the shared ones have it (not linattn's column_major):
    the fused decoder streams a row-major weight one row at a time, and torchao's int8 of it stays
    row-major, the layout its VNNI products read fastest (design §15.1)."""
    mt = model.config.model_type
    lm = LinearTransformerLM(cfg)
    mine = lm.state_dict()
    missing = sorted(set(mine) - set(shared) - set(copied) - ({"lm_head.weight"} if cfg.tie_embeddings else set()))
    extra = sorted((set(shared) | set(copied)) - set(mine))
    if missing or extra:
        raise ValueError(f"transformers {mt} model: tensors not mapped {missing}, unexpected {extra}")
    lm = lm.to(dtype=next(model.parameters()).dtype)
    for k, v in {**shared, **copied}.items():
        if mine[k].shape != v.shape:
            raise ValueError(f"transformers {mt} model: {k} has shape {tuple(v.shape)}, linattn expects "
                             f"{tuple(mine[k].shape)}")
    with torch.no_grad():
        for k, v in copied.items():
            mine_k = _tensor(lm, k)
            if isinstance(mine_k, nn.Parameter) and mine_k.dim() == 2:  # nn.Linear's (out, in) row-major layout
                own = v.to(dtype=mine_k.dtype, memory_format=torch.contiguous_format, copy=True)  # one copy
                _put(lm, k, nn.Parameter(own, requires_grad=mine_k.requires_grad))
            else:
                mine_k.copy_(v)
        for k, v in shared.items():
            if share:
                _put(lm, k, v)
            else:
                lm.get_parameter(k).copy_(v)
    if cfg.tie_embeddings:
        lm.lm_head.weight = lm.tok_emb.weight
    return lm.eval()
