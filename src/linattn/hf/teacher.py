"""transformers' softmax causal LMs as linattn models, losslessly: the teachers of `linattn linearize`
(design §19). Supported: Llama, Mistral, Qwen2, Qwen3 and GPT-2 — the same logits, up to float
rounding, from the same weights:

    Llama / Mistral   RMSNorm, SwiGLU (gate and up fused as linattn's `up` = [gate; up]), RoPE on q and k
                      (the rotate-half pairing of linattn's RotaryEmbedding), no biases
    Qwen2             the same with biases on q, k and v only (ModelConfig.qkv_bias)
    Qwen3             the same with per-head RMSNorms of q and k before RoPE (ModelConfig.qk_norm)
    GPT-2             LayerNorm, learned positions, GELU's tanh form, biases everywhere, Conv1D weights
                      (stored in × out: transposed here), tied embeddings

Grouped key/value heads (num_key_value_heads < num_attention_heads) are expanded into one key and
value head per query head (each group's rows repeated): the attention computes the same thing with
more weights. What linattn's model cannot express is refused by name (rope_scaling, a sliding
window, head_dim ≠ hidden_size / num_attention_heads, mixed attention/MLP biases, …).

    from linattn.hf.teacher import from_transformers, load_teacher
    lm = from_transformers(AutoModelForCausalLM.from_pretrained(path))   # or load_teacher(path)
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from ..models.config import ModelConfig
from ..models.lm import LinearTransformerLM

__all__ = ["SUPPORTED", "from_transformers", "is_transformers_folder", "load_teacher", "teacher_config"]

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "gpt2")


def _refuse(model_type: str, what: str) -> ValueError:
    return ValueError(f"transformers {model_type} model: {what} is not converted to a linattn model")


def _rope_base(c, model_type: str) -> float:
    """rope_theta of plain RoPE; anything else (linear, dynamic, yarn, llama3 scaling) is refused.
    (transformers 5 keeps them in rope_parameters; rope_scaling is its older name.)"""
    params = getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {}
    kind = params.get("rope_type", params.get("type", "default")) if isinstance(params, dict) else "default"
    if kind != "default":
        raise _refuse(model_type, f"rope_scaling / rope_type {kind!r} (only plain RoPE)")
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    return float(theta if theta is not None else getattr(c, "rope_theta", None) or 10_000.0)


def teacher_config(c) -> ModelConfig:
    """The ModelConfig of a transformers config `c` (one of SUPPORTED), every layer softmax."""
    mt = getattr(c, "model_type", None)
    if mt not in SUPPORTED:
        raise ValueError(f"model_type {mt!r}: linattn converts {', '.join(SUPPORTED)} causal LMs")
    common = dict(vocab_size=c.vocab_size, attention=["softmax"], tie_embeddings=bool(c.tie_word_embeddings),
                  dropout=0.0, feature_map="elu")
    if mt == "gpt2":
        if c.activation_function not in ("gelu_new", "gelu_pytorch_tanh", "gelu"):
            raise _refuse(mt, f"activation_function {c.activation_function!r}")
        for flag in ("scale_attn_by_inverse_layer_idx", "add_cross_attention"):
            if getattr(c, flag, False):
                raise _refuse(mt, flag)
        return ModelConfig(d_model=c.n_embd, n_layers=c.n_layer, n_heads=c.n_head, d_ff=c.n_inner or 4 * c.n_embd,
                           positions="learned", max_len=c.n_positions, norm="layernorm", norm_eps=c.layer_norm_epsilon,
                           activation="gelu" if c.activation_function == "gelu" else "gelu_tanh", bias=True, **common)
    heads = c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    if head_dim * heads != c.hidden_size:
        raise _refuse(mt, f"head_dim={head_dim} with hidden_size={c.hidden_size} and num_attention_heads={heads} "
                          "(linattn's values have hidden_size / num_attention_heads features per head)")
    if c.hidden_act != "silu":
        raise _refuse(mt, f"hidden_act {c.hidden_act!r} (SwiGLU with silu only)")
    # Mistral windows whenever sliding_window is set; Qwen2/3 only with use_sliding_window
    window = getattr(c, "sliding_window", None) if mt == "mistral" or getattr(c, "use_sliding_window", False) else None
    if window is not None:
        raise _refuse(mt, f"sliding_window={window} (a windowed teacher; set it to null if its sequences never "
                          "exceed the window)")
    attn_bias, mlp_bias = bool(getattr(c, "attention_bias", False)), bool(getattr(c, "mlp_bias", False))
    if attn_bias != mlp_bias:
        raise _refuse(mt, f"attention_bias={attn_bias} with mlp_bias={mlp_bias}")
    return ModelConfig(d_model=c.hidden_size, n_layers=c.num_hidden_layers, n_heads=heads, d_ff=c.intermediate_size,
                       positions="rope", rope_base=_rope_base(c, mt), max_len=c.max_position_embeddings,
                       norm="rmsnorm", norm_eps=c.rms_norm_eps, activation="swiglu", bias=attn_bias,
                       qkv_bias=True if mt == "qwen2" else None, qk_norm=mt == "qwen3", **common)


def _expand(w: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
    """Rows of kv_heads heads (kv_heads·D, …) repeated to one per query head (heads·D, …)."""
    d = w.shape[0] // kv_heads
    return w.reshape(kv_heads, d, *w.shape[1:]).repeat_interleave(heads // kv_heads, dim=0).reshape(heads * d,
                                                                                                    *w.shape[1:])


def _llama_state(model, cfg: ModelConfig) -> dict:
    c = model.config
    base = model.model
    heads, kv = c.num_attention_heads, getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    out = {"tok_emb.weight": base.embed_tokens.weight, "norm.weight": base.norm.weight}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = model.lm_head.weight
    for i, layer in enumerate(base.layers):
        a, m, p = layer.self_attn, layer.mlp, f"blocks.{i}."
        out[p + "attn.qkv.weight"] = torch.cat([a.q_proj.weight, _expand(a.k_proj.weight, heads, kv),
                                                _expand(a.v_proj.weight, heads, kv)])
        if a.q_proj.bias is not None:
            out[p + "attn.qkv.bias"] = torch.cat([a.q_proj.bias, _expand(a.k_proj.bias, heads, kv),
                                                  _expand(a.v_proj.bias, heads, kv)])
        out[p + "attn.out.weight"] = a.o_proj.weight
        if a.o_proj.bias is not None:
            out[p + "attn.out.bias"] = a.o_proj.bias
        if cfg.qk_norm:
            out[p + "attn.q_norm.weight"], out[p + "attn.k_norm.weight"] = a.q_norm.weight, a.k_norm.weight
        out[p + "norm1.weight"], out[p + "norm2.weight"] = layer.input_layernorm.weight, layer.post_attention_layernorm.weight
        out[p + "ffn.up.weight"] = torch.cat([m.gate_proj.weight, m.up_proj.weight])
        out[p + "ffn.down.weight"] = m.down_proj.weight
        if m.gate_proj.bias is not None:
            out[p + "ffn.up.bias"] = torch.cat([m.gate_proj.bias, m.up_proj.bias])
            out[p + "ffn.down.bias"] = m.down_proj.bias
    return out


def _gpt2_state(model, cfg: ModelConfig) -> dict:
    t = model.transformer
    out = {"tok_emb.weight": t.wte.weight, "pos_emb.weight": t.wpe.weight, "norm.weight": t.ln_f.weight,
           "norm.bias": t.ln_f.bias}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = model.lm_head.weight
    for i, h in enumerate(t.h):
        p = f"blocks.{i}."
        out[p + "norm1.weight"], out[p + "norm1.bias"] = h.ln_1.weight, h.ln_1.bias
        out[p + "norm2.weight"], out[p + "norm2.bias"] = h.ln_2.weight, h.ln_2.bias
        for mine, conv in (("attn.qkv", h.attn.c_attn), ("attn.out", h.attn.c_proj), ("ffn.up", h.mlp.c_fc),
                           ("ffn.down", h.mlp.c_proj)):
            out[p + mine + ".weight"], out[p + mine + ".bias"] = conv.weight.t(), conv.bias  # Conv1D: (in, out)
    return out


def from_transformers(model: nn.Module) -> LinearTransformerLM:
    """The linattn LM equal to transformers' causal LM `model` (module docstring), in its dtype."""
    cfg = teacher_config(model.config)
    lm = LinearTransformerLM(cfg)
    state = (_gpt2_state if cfg.positions == "learned" else _llama_state)(model, cfg)
    mine = lm.state_dict()
    missing = sorted(set(mine) - set(state) - ({"lm_head.weight"} if cfg.tie_embeddings else set()))
    extra = sorted(set(state) - set(mine))
    if missing or extra:
        raise ValueError(f"transformers {model.config.model_type} model: tensors not mapped {missing}, unexpected {extra}")
    ref = next(model.parameters())
    lm = lm.to(dtype=ref.dtype)
    with torch.no_grad():
        for k, v in state.items():
            if mine[k].shape != v.shape:
                raise ValueError(f"transformers {model.config.model_type} model: {k} has shape {tuple(v.shape)}, "
                                 f"linattn expects {tuple(mine[k].shape)}")
            lm.state_dict()[k].copy_(v)
    return lm.eval()


def is_transformers_folder(path) -> bool:
    """A folder whose config.json is a transformers config (it names a model_type)."""
    f = Path(path) / "config.json"
    if not f.is_file():
        return False
    try:
        return "model_type" in json.loads(f.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False


def load_teacher(path) -> LinearTransformerLM:
    """from_transformers of the causal LM saved in the local folder `path` (nothing is downloaded)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    teacher_config(config)  # refuse before loading the weights
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    return from_transformers(model)
