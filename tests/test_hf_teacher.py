"""linattn.hf.teacher: transformers' Llama, Mistral, Qwen2, Qwen3 and GPT-2 as linattn models with the
same logits (tiny random configs, nothing downloaded), and what is refused by name."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from linattn.hf.teacher import from_transformers, is_transformers_folder, load_teacher, teacher_config  # noqa: E402

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=128, tie_word_embeddings=False)


def build(model_type: str, **over):
    torch.manual_seed(0)
    if model_type == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=128, **over)
    else:
        cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
               "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}[model_type]
        kw = dict(SMALL, num_key_value_heads=2, head_dim=8, **over)
        if model_type == "mistral":
            kw.setdefault("sliding_window", None)
        cfg = cls(**kw)
    model = transformers.AutoModelForCausalLM.from_config(cfg).double().eval()
    with torch.no_grad():  # biases and norm gains away from their initial 0 / 1
        for n, p in model.named_parameters():
            if n.endswith("bias") or "norm" in n or "ln_" in n:
                p.add_(torch.randn_like(p) * 0.1)
    return model


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3", "gpt2"])
def test_same_logits_as_transformers(model_type):
    model = build(model_type)
    lm = from_transformers(model)
    ids = torch.randint(0, 64, (2, 23), generator=torch.Generator().manual_seed(1))
    theirs = model(ids).logits
    ours, _ = lm(ids)
    # transformers computes RoPE's cos/sin in float32 even in a float64 model: float32 rounding of the
    # angles (~4e-8 here) is their part; GPT-2 (no RoPE) must agree to float64 rounding
    tol = 1e-10 if model_type == "gpt2" else 1e-6
    torch.testing.assert_close(ours, theirs, atol=tol, rtol=tol)
    cache, steps = lm.new_cache(), []  # and it decodes token by token to the same logits
    for t in range(ids.shape[1]):
        logits, cache = lm(ids[:, t:t + 1], cache=cache)
        steps.append(logits)
    torch.testing.assert_close(torch.cat(steps, 1), ours, atol=1e-10, rtol=1e-10)
    assert lm.config.layer_kinds == ["softmax", "softmax"]


def test_tied_embeddings_and_the_folder_loader(tmp_path):
    model = build("llama", tie_word_embeddings=True).float()
    model.save_pretrained(tmp_path)
    assert is_transformers_folder(tmp_path) and not is_transformers_folder(tmp_path / "nothing")
    lm = load_teacher(tmp_path)
    assert lm.config.tie_embeddings and lm.lm_head.weight.data_ptr() == lm.tok_emb.weight.data_ptr()
    ids = torch.randint(0, 64, (1, 9))
    torch.testing.assert_close(lm(ids)[0], model(ids).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("model_type, over, name", [
    ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope"),
    ("mistral", {"sliding_window": 16}, "sliding_window"),
    ("llama", {"head_dim": 16}, "head_dim"),
    ("llama", {"hidden_act": "gelu"}, "hidden_act"),
    ("llama", {"attention_bias": True}, "attention_bias"),
    ("gpt2", {"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
])
def test_what_linattn_cannot_express_is_refused_by_name(model_type, over, name):
    if model_type == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, **over)
    else:
        cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig}[model_type]
        cfg = cls(**{**SMALL, "num_key_value_heads": 2, "head_dim": 8, **over})
    with pytest.raises(ValueError, match=name):
        teacher_config(cfg)
    with pytest.raises(ValueError, match="model_type"):
        teacher_config(transformers.BertConfig())
