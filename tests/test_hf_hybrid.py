"""linattn.hf.hybrid: transformers' Qwen3.5 as a linattn model, against transformers' eager forward."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
qwen3_5 = pytest.importorskip("transformers.models.qwen3_5")

import linattn.hf as H  # noqa: E402
from linattn.hf.hybrid import from_transformers_hybrid, hybrid_config  # noqa: E402
from linattn.models import LinearTransformerLM, ModelConfig  # noqa: E402

LAYERS = ["linear_attention", "full_attention", "linear_attention", "full_attention"]


def qwen35_config(**over):
    kw = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, linear_key_head_dim=8, linear_value_head_dim=16,
              linear_num_key_heads=2, linear_num_value_heads=4, linear_conv_kernel_dim=4, layer_types=LAYERS,
              tie_word_embeddings=False, rms_norm_eps=1e-6, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    kw.update(over)
    c = qwen3_5.Qwen3_5TextConfig(**kw)
    c._attn_implementation = "eager"
    return c


def qwen35(dtype=torch.float32, seed=0, **over):
    """A tiny random Qwen3.5 whose zero-initialized parameters (the zero-centred norms' w) are drawn too."""
    torch.manual_seed(seed)
    m = qwen3_5.Qwen3_5ForCausalLM(qwen35_config(**over)).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name or "A_log" in name or "dt_bias" in name:
                p.add_(torch.randn_like(p) * 0.2)
    return m.to(dtype)


def ids(b=2, n=13, seed=0):
    return torch.randint(3, 97, (b, n), generator=torch.Generator().manual_seed(seed))


def greedy_left_padded(m, fast, new_tokens: int = 8):
    """transformers' model `m` and its accelerated form `fast` generate greedily from one batch of two
    8-token rows, the first left-padded by 3: (m's sequences, fast's, the input ids)."""
    x = ids(b=2, n=8, seed=4)
    mask = torch.ones_like(x)
    mask[0, :3] = 0
    x[0, :3] = 0
    a = m.generate(x, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False)
    b = fast.generate(x, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False)
    return a, b, x


def logits(lm, x, mask=None):
    out = lm(x, mask)
    return out[0] if isinstance(out, tuple) else out


@pytest.mark.parametrize("over", [{}, dict(linear_num_value_heads=2), dict(tie_word_embeddings=True),
                                  dict(num_key_value_heads=4, partial_rotary_factor=0.5)],
                         ids=["gva2", "gva1", "tied", "mha_half_rope"])
def test_logits_equal_transformers_eager_float32(over):
    m = qwen35(**over)
    lm = from_transformers_hybrid(m)
    x = ids()
    with torch.no_grad():
        ref, mine = m(x).logits, logits(lm, x)
    assert ref.abs().max() > 0.1  # not a degenerate model
    torch.testing.assert_close(mine, ref, atol=2e-5 * ref.abs().max().item(), rtol=0)


def test_logits_equal_float64():
    """transformers' Qwen3.5 runs its RMSNorms, gated norm, delta rule and RoPE angles in float32 even for a
    float64 model (x.float(), .to(torch.float32)): the reference itself carries float32 rounding (~1e-7)."""
    m = qwen35(torch.float64)
    lm = from_transformers_hybrid(m)
    assert lm.tok_emb.weight.dtype == torch.float64
    x = ids(n=21)
    with torch.no_grad():
        ref = m(x).logits
        torch.testing.assert_close(logits(lm, x), ref, atol=1e-6 * ref.abs().max().item(), rtol=0)


def test_left_padding_gives_each_row_alone():
    m = qwen35()
    lm = from_transformers_hybrid(m)
    x = ids(b=2, n=9)
    mask = torch.ones_like(x, dtype=torch.bool)
    mask[0, :3] = False
    with torch.no_grad():
        ref = m(x, attention_mask=mask.long()).logits
        mine = logits(lm, x, mask)
        alone = logits(lm, x[:1, 3:])
    torch.testing.assert_close(mine[mask], ref[mask], atol=2e-5 * ref.abs().max().item(), rtol=0)
    torch.testing.assert_close(mine[0, 3:], alone[0], atol=1e-5, rtol=0)


def test_gradients_equal_transformers():
    m = qwen35()
    m.train()  # dropout is 0: train mode only turns on autograd-friendly paths
    lm = from_transformers_hybrid(m).train()
    x, y = ids(), ids(seed=1)

    def grads(out):
        m.zero_grad(set_to_none=True)
        lm.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(out.flatten(0, 1), y.flatten()).backward()

    grads(m(x).logits)
    base = m.model
    ref = {n: p.grad.clone() for n, p in m.named_parameters()}
    grads(logits(lm, x))
    got = {n: p.grad.clone() for n, p in lm.named_parameters()}
    # shared Parameters: one tensor, the gradient of each model's loss in turn
    shared = [("model.embed_tokens.weight", "tok_emb.weight"), ("lm_head.weight", "lm_head.weight"),
              ("model.layers.0.linear_attn.A_log", "blocks.0.attn.decay.A_log"),
              ("model.layers.0.linear_attn.in_proj_z.weight", "blocks.0.attn.output_gate.proj.weight"),
              ("model.layers.1.self_attn.o_proj.weight", "blocks.1.attn.out.weight"),
              ("model.layers.3.mlp.down_proj.weight", "blocks.3.ffn.down.weight")]
    assert lm.blocks[0].attn.decay.A_log is base.layers[0].linear_attn.A_log
    for theirs, mine in shared:
        torch.testing.assert_close(got[mine], ref[theirs], atol=1e-6, rtol=1e-4)
    # copies: the gradient of the stacked / gained tensor is the stack of theirs
    mlp = "model.layers.2.mlp."
    torch.testing.assert_close(got["blocks.2.ffn.up.weight"],
                               torch.cat([ref[mlp + "gate_proj.weight"], ref[mlp + "up_proj.weight"]]),
                               atol=1e-6, rtol=1e-4)
    torch.testing.assert_close(got["blocks.1.norm1.weight"], ref["model.layers.1.input_layernorm.weight"],
                               atol=1e-6, rtol=1e-4)
    torch.testing.assert_close(got["blocks.1.attn.q_norm.weight"], ref["model.layers.1.self_attn.q_norm.weight"],
                               atol=1e-6, rtol=1e-4)


def test_share_false_copies_and_config_round_trips(tmp_path):
    m = qwen35()
    lm = from_transformers_hybrid(m, share=False)
    assert lm.tok_emb.weight is not m.model.embed_tokens.weight
    cfg = lm.config
    assert ModelConfig.from_json(cfg.to_json()) == cfg
    assert cfg.kind_options["softmax"]["output_gate"] == "sigmoid" and cfg.kind_options["softmax"]["rope_dim"] == 4
    lm.save_pretrained(tmp_path)
    back = LinearTransformerLM.from_pretrained(tmp_path)
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(logits(back, x), logits(lm, x), atol=0, rtol=0)


def test_converted_matrices_are_row_major_and_train():
    """The matrices the conversion builds (stacked q|k|v, gate|up, split gates) keep nn.Linear's (out, in)
    row-major layout, as the shared ones do (the fused decoder's one-stream products; design §15.1), and
    stay trainable Parameters."""
    lm = from_transformers_hybrid(qwen35())
    built = {n: p for n, p in lm.named_parameters() if n.endswith(("qkv.weight", "ffn.up.weight"))}
    assert len(built) == 8
    for name, p in built.items():
        assert p.is_contiguous() and p.requires_grad, name
    logits(lm, ids()).sum().backward()
    assert all(p.grad is not None and torch.count_nonzero(p.grad) > 0 for p in built.values())


@pytest.mark.parametrize("over, option", [
    (dict(attention_bias=True), "attention_bias"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0,
                           "partial_rotary_factor": 0.25}), "rope_type"),
    (dict(partial_rotary_factor=0.1875), "partial_rotary_factor"),
    (dict(linear_num_value_heads=3), "linear_num_value_heads"),
])
def test_refusals_name_the_option(over, option):
    with pytest.raises(ValueError, match=option):
        hybrid_config(qwen35_config(**over))


def test_refuses_other_model_types():
    with pytest.raises(ValueError, match="model_type 'llama'"):
        hybrid_config(transformers.LlamaConfig())


# ---- linattn.hf.accelerate: transformers' generate and pipelines on the converted model

def accelerated(**over):
    m = qwen35(**over)
    return m, H.accelerate(m)


def test_accelerate_carries_generation_config_and_ids():
    m, fast = accelerated()
    assert isinstance(fast, H.LinattnForCausalLM)
    assert (fast.config.pad_token_id, fast.config.bos_token_id, fast.config.eos_token_id) == (0, 2, 1)
    assert fast.generation_config.eos_token_id == m.generation_config.eos_token_id == 1
    assert fast.generation_config.pad_token_id == 0


def test_greedy_tokens_and_logits_equal_transformers():
    m, fast = accelerated()
    x = ids(b=1, n=7)
    kw = dict(max_new_tokens=12, do_sample=False, output_logits=True, return_dict_in_generate=True)
    a, b = m.generate(x, **kw), fast.generate(x, **kw)
    assert b.sequences.tolist() == a.sequences.tolist()
    assert len(b.logits) == len(a.logits) == 12
    for ref, mine in zip(a.logits, b.logits):
        torch.testing.assert_close(mine, ref, atol=2e-5 * ref.abs().max().item(), rtol=0)


def test_seeded_sampling_and_beam_search_equal_transformers():
    m, fast = accelerated()
    x = ids(b=1, n=7, seed=2)
    out = []
    for model in (m, fast):
        torch.manual_seed(3)
        out.append(model.generate(x, max_new_tokens=12, do_sample=True, top_k=0, temperature=1.3).tolist())
    assert out[0] == out[1]
    beams = [model.generate(x, max_new_tokens=8, num_beams=3, do_sample=False, num_return_sequences=2).tolist()
             for model in (m, fast)]
    assert beams[0] == beams[1] and len(beams[0]) == 2


def test_left_padded_batch_equals_transformers():
    m, fast = accelerated()
    a, b, x = greedy_left_padded(m, fast)
    assert b.tolist() == a.tolist()
    alone = fast.generate(x[:1, 3:], max_new_tokens=8, do_sample=False)
    assert b[0, 3:3 + alone.shape[1]].tolist() == alone[0].tolist()


class Collect(transformers.generation.streamers.BaseStreamer):
    def __init__(self):
        self.tokens = []

    def put(self, value):
        self.tokens.extend(value.reshape(-1).tolist())

    def end(self):
        self.tokens.append("end")


def test_streamer_sees_the_generated_tokens():
    m, fast = accelerated()
    x = ids(b=1, n=5)
    s = Collect()
    out = fast.generate(x, max_new_tokens=6, do_sample=False, streamer=s)
    assert s.tokens == [*out[0].tolist(), "end"]  # the prompt first, then each new token
    assert out.tolist() == m.generate(x, max_new_tokens=6, do_sample=False).tolist()


def test_text_generation_pipeline_equals_transformers():
    m, fast = accelerated(vocab_size=256, pad_token_id=0, eos_token_id=None, bos_token_id=None)
    tok = H.ByteTokenizer()
    kw = dict(max_new_tokens=10, do_sample=False, return_full_text=False)
    texts = [transformers.pipeline("text-generation", model=model, tokenizer=tok, device="cpu")("Once upon", **kw)
             for model in (m, fast)]
    assert texts[0] == texts[1] and texts[0][0]["generated_text"]


@pytest.mark.parametrize("model_type, message", [("mamba", "accelerate converts qwen3_5_text.*kimi_linear")])
def test_accelerate_refuses_what_is_not_converted_yet(model_type, message):
    fake = torch.nn.Linear(1, 1)
    fake.config = type("C", (), {"model_type": model_type})()
    with pytest.raises(ValueError, match=message):
        H.accelerate(fake)


# ---- the ModelConfig layer options the conversion uses

@pytest.mark.parametrize("options, message", [
    ({"softmax": {"output_gate": "tanh"}}, r"kind_options\['softmax'\]\['output_gate'\]"),
    ({"softmax": {"rope_dim": 3}}, r"\['rope_dim'\] must be even"),
    ({"linear": {"rope_dim": 4}}, r"linear kind's RoPE rotates φ's features"),
    ({"swa": {"v_dim": 8}}, r"the swa layer takes no v_dim"),
    ({"softmax": {"n_heads": 0}}, r"\['n_heads'\]"),
    ({"softmax": {"qk_norm": 1}}, r"\['qk_norm'\]"),
    ({"softmax": {"windw": 1}}, r"unknown option 'windw'"),
    ({"softmax": {"allow_neg_eigval": True}}, r"the softmax layer takes no allow_neg_eigval"),
    ({"softmax": {"qk_norm": "heads"}}, r"\['qk_norm'\]"),
    ({"softmax": {"output_gate_eps": 0}}, r"\['output_gate_eps'\]"),
])
def test_layer_options_are_checked_by_name(options, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(d_model=32, n_heads=2, attention=list(options), kind_options=options)


def test_layer_options_refused_where_the_layer_has_no_use_for_them():
    with pytest.raises(ValueError, match=r"\['output_gate_eps'\]: its layers have no normalizing output gate"):
        LinearTransformerLM(ModelConfig(d_model=32, n_heads=2, attention=["softmax"],
                                        kind_options={"softmax": {"output_gate_eps": 1e-5}}))
    with pytest.raises(ValueError, match=r"\['post_norm'\]: conv_mixer blocks are pre-norm"):
        LinearTransformerLM(ModelConfig(d_model=32, n_heads=2, attention=["softmax"], block="conv_mixer",
                                        kind_options={"softmax": {"post_norm": True}}))


def test_rope_dim_larger_than_qk_dim_is_refused():
    cfg = ModelConfig(d_model=32, n_heads=2, attention=["softmax"], kind_options={"softmax": {"rope_dim": 18}})
    with pytest.raises(ValueError, match="rope_dim=18"):
        LinearTransformerLM(cfg)


def test_layer_options_shape_the_layers():
    cfg = ModelConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=2, attention=["gated_deltanet", "softmax"],
                      kind_options={"softmax": {"n_heads": 3, "qk_dim": 8, "v_dim": 12, "qk_norm": True,
                                                "output_gate": "sigmoid", "rope_dim": 4},
                                    "gated_deltanet": {"n_heads": 4, "v_dim": 6, "short_conv": 2, "rope_dim": 0}})
    lm = LinearTransformerLM(cfg)
    soft, delta = lm.blocks[1].attn, lm.blocks[0].attn
    assert (soft.n_heads, soft.qk_dim, soft.head_dim, soft.rope.dim) == (3, 8, 12, 4)
    assert soft.q_norm is not None and type(soft.output_gate).__name__ == "SigmoidGate"
    assert soft.out.in_features == 36 and soft.output_gate.proj.out_features == 36
    # qk_dim: the value head dim by default
    assert (delta.n_heads, delta.qk_dim, delta.head_dim, delta.conv.kernel_size, delta.rope) == (4, 6, 6, 2, None)
    assert soft.step_obstacle() is None and delta.step_obstacle() is None  # all planned in the fused step
    with torch.no_grad():
        assert lm(torch.randint(0, 50, (2, 5)))[0].shape == (2, 5, 50)


# ---- the fused decoding step on the converted model

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_step_equals_eager_step_on_converted_qwen35(dtype):
    """qk_norm, the sigmoid gate, partial RoPE, GVA (expanded), v_dim ≠ d/H and the 1 + w gains all
    run in the fused step; from one left-padded prefill, its logits and caches equal the eager step's."""
    from linattn.models.decoding import FusedDecoder, fused_decoding_obstacle

    m = qwen35()
    lm = from_transformers_hybrid(m, share=False).to(dtype)
    assert fused_decoding_obstacle(lm) is None
    x = ids(b=3, n=7)
    mask = torch.ones_like(x, dtype=torch.bool)
    mask[1, :2] = mask[2, :4] = False
    with torch.no_grad():
        logits_, eager = lm(x, mask, cache=lm.new_cache(), last_only=True)
        _, fused = lm(x, mask, cache=lm.new_cache(), last_only=True)
        decoder = FusedDecoder(lm, fused, reserve=6)
        tok = logits_[:, -1].argmax(-1)
        for _ in range(6):
            le, eager = lm(tok[:, None], cache=eager, last_only=True)
            lf = decoder.step(tok).clone()
            scale = le.abs().max().item()
            if dtype == torch.float32:
                torch.testing.assert_close(lf, le[:, -1], atol=2e-6 * scale, rtol=1e-5)
            else:  # bf16 logits of size ~1: one bf16 rounding is 2^-8 relative; allow two (as tests/test_decoding)
                torch.testing.assert_close(lf.float(), le[:, -1].float(), atol=1e-2, rtol=1e-2)
            tok = le[:, -1].argmax(-1)


# ---- Qwen3-Next and Qwen3.5-MoE: the mixture-of-experts FFN, Qwen3-Next's fused projections

def moe_model(model_type, seed=0, **over):
    """A tiny Qwen3-Next (layer 0 dense by mlp_only_layers, top-k weights not renormalized) or Qwen3.5-MoE
    text model, its zero-initialized parameters and its router drawn."""
    from transformers.models.qwen3_5_moe import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    kw = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, linear_key_head_dim=8, linear_value_head_dim=16,
              linear_num_key_heads=2, linear_num_value_heads=4, layer_types=LAYERS, tie_word_embeddings=False,
              num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=40,
              pad_token_id=0, eos_token_id=1, bos_token_id=2)
    if model_type == "qwen3_next":
        config, cls = transformers.Qwen3NextConfig(**kw, mlp_only_layers=[0], norm_topk_prob=False, **over), \
            transformers.Qwen3NextForCausalLM
    else:
        config, cls = Qwen3_5MoeTextConfig(**kw, **over), Qwen3_5MoeForCausalLM
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    m = cls(config).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if any(s in name for s in ("norm", "A_log", "dt_bias", "mlp.gate.weight")):
                p.add_(torch.randn_like(p) * 0.3)
    return m


MOE_TYPES = ["qwen3_next", "qwen3_5_moe"]


@pytest.mark.parametrize("model_type", MOE_TYPES)
def test_moe_models_logits_and_routing_equal_transformers(model_type):
    m = moe_model(model_type)
    lm = from_transformers_hybrid(m)
    moe = lm.config.moe
    assert moe["norm_topk_prob"] == (model_type == "qwen3_5_moe")
    assert moe["layers"] == ([1, 2, 3] if model_type == "qwen3_next" else None)
    x = ids(n=17)
    with torch.no_grad():
        ref = m(x).logits
        torch.testing.assert_close(logits(lm, x), ref, atol=2e-5 * ref.abs().max().item(), rtol=0)
        # routing: the experts and weights each token gets at layer 2, from the same normed input
        h = torch.randn(34, 64)
        _, w_ref, i_ref = m.model.layers[2].mlp.gate(h)
        i_mine, w_mine = lm.blocks[2].ffn.route(h)
    assert i_mine.tolist() == i_ref.tolist()
    torch.testing.assert_close(w_mine, w_ref, atol=1e-7, rtol=1e-6)
    assert len(set(i_ref.flatten().tolist())) > 3  # the tokens spread over the experts


@pytest.mark.parametrize("model_type", MOE_TYPES)
def test_moe_gradients_equal_transformers(model_type):
    m = moe_model(model_type).train()
    lm = from_transformers_hybrid(m).train()
    x, y = ids(), ids(seed=1)
    ref, got = {}, {}
    for model, out, store in ((m, lambda: m(x).logits, ref), (lm, lambda: logits(lm, x), got)):
        m.zero_grad(set_to_none=True)
        lm.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(out().flatten(0, 1), y.flatten()).backward()
        store.update({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    mlp = "model.layers.3.mlp."
    pairs = [(mlp + "gate.weight", "blocks.3.ffn.router.weight"),
             (mlp + "experts.gate_up_proj", "blocks.3.ffn.gate_up"),
             (mlp + "experts.down_proj", "blocks.3.ffn.down"),
             (mlp + "shared_expert_gate.weight", "blocks.3.ffn.shared_gate.weight")]
    for theirs, mine in pairs:
        torch.testing.assert_close(got[mine], ref[theirs], atol=1e-6, rtol=1e-4)
    assert ref[mlp + "gate.weight"].abs().max() > 0  # the router learns through the routing weights
    if model_type == "qwen3_next":  # the fused projections' gradients, regrouped, are those of the copies
        from types import SimpleNamespace

        from linattn.hf.hybrid import _next_projections

        grads = SimpleNamespace(**{name: SimpleNamespace(weight=ref[f"model.layers.0.linear_attn.{name}.weight"])
                                   for name in ("in_proj_qkvz", "in_proj_ba")})
        _, z, b, a = _next_projections(grads, m.config)
        for mine, theirs in (("output_gate.proj", z), ("beta_proj", b), ("decay.proj", a)):
            torch.testing.assert_close(got[f"blocks.0.attn.{mine}.weight"], theirs, atol=1e-6, rtol=1e-4)


def test_qwen3_next_dense_layer_and_accelerate_generate():
    m = moe_model("qwen3_next")
    fast = H.accelerate(m)
    assert type(fast.model.blocks[0].ffn).__name__ == "FeedForward"
    from linattn.models.decoding import fused_decoding_obstacle

    assert fused_decoding_obstacle(fast.model) is None  # the MoE FFN decodes fused too
    x = ids(b=1, n=6)
    kw = dict(max_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True)
    a, b = m.generate(x, **kw), fast.generate(x, **kw)
    assert b.sequences.tolist() == a.sequences.tolist()
    for ref, mine in zip(a.logits, b.logits):
        torch.testing.assert_close(mine, ref, atol=2e-5 * ref.abs().max().item(), rtol=0)


def test_moe_config_round_trips_and_refuses_by_name(tmp_path):
    m = moe_model("qwen3_next")
    lm = from_transformers_hybrid(m, share=False)
    assert ModelConfig.from_json(lm.config.to_json()) == lm.config
    lm.save_pretrained(tmp_path)
    back = LinearTransformerLM.from_pretrained(tmp_path)
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(logits(back, x), logits(lm, x), atol=0, rtol=0)
    good = dict(num_experts=4, top_k=2, d_expert=8, shared_d_ff=0, norm_topk_prob=True, layers=None)
    for bad, name in ((dict(good, top_k=5), "top_k"), (dict(good, layers=[7]), "layers"),
                      ({k: v for k, v in good.items() if k != "d_expert"}, "missing keys \\['d_expert'\\]"),
                      (dict(good, experts=3), "unknown keys \\['experts'\\]")):
        with pytest.raises(ValueError, match=name):
            ModelConfig(d_model=32, n_heads=2, moe=bad)
    with pytest.raises(ValueError, match="moe: the experts are SwiGLU"):
        ModelConfig(d_model=32, n_heads=2, moe=good, activation="gelu")


# ---- OLMo-Hybrid: post-norm softmax layers, q/k norm across heads, β ∈ (0, 2), NoPE

def olmo_model(nope=False, seed=0, **over):
    kw = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=16, linear_num_key_heads=2,
              linear_num_value_heads=4, layer_types=LAYERS, tie_word_embeddings=False, pad_token_id=0,
              eos_token_id=1, bos_token_id=2)
    kw.update(over)
    c = transformers.OlmoHybridConfig(**kw)
    if nope:  # the released checkpoints' NoPE: no rotary embedding at all
        c.rope_parameters = None
    c._attn_implementation = "eager"
    torch.manual_seed(seed)
    m = transformers.OlmoHybridForCausalLM(c).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if any(s in name for s in ("norm", "A_log", "dt_bias")):
                p.add_(torch.randn_like(p) * 0.2)
    return m


@pytest.mark.parametrize("nope, over", [(False, {}), (True, {}), (False, dict(linear_allow_neg_eigval=False)),
                                        (False, dict(num_key_value_heads=4, rms_norm_eps=1e-5))],
                         ids=["rope", "nope", "beta_le_1", "mha_eps"])
def test_olmo_hybrid_logits_equal_transformers(nope, over):
    m = olmo_model(nope, **over)
    assert (m.model.rotary_emb is None) == nope
    lm = from_transformers_hybrid(m)
    cfg = lm.config
    assert cfg.positions == ("none" if nope else "rope")
    assert cfg.kind_options["gated_deltanet"]["allow_neg_eigval"] == over.get("linear_allow_neg_eigval", True)
    assert lm.blocks[1].post_norm and not lm.blocks[0].post_norm
    x = ids(n=15)
    mask = torch.ones_like(x, dtype=torch.bool)
    mask[1, :4] = False
    with torch.no_grad():
        ref = m(x, attention_mask=mask.long()).logits
        mine = logits(lm, x, mask)
    torch.testing.assert_close(mine[mask], ref[mask], atol=2e-5 * ref.abs().max().item(), rtol=0)


def test_olmo_hybrid_gradients_and_generate_equal_transformers():
    m = olmo_model().train()
    lm = from_transformers_hybrid(m).train()
    x, y = ids(), ids(seed=1)
    grads = []
    for model, out in ((m, lambda: m(x).logits), (lm, lambda: logits(lm, x))):
        m.zero_grad(set_to_none=True)
        lm.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(out().flatten(0, 1), y.flatten()).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    ref, got = grads
    for theirs, mine in (("model.layers.1.post_feedforward_layernorm.weight", "blocks.1.norm2.weight"),
                         ("model.layers.1.self_attn.q_norm.weight", "blocks.1.attn.q_norm.weight"),
                         ("model.layers.0.linear_attn.b_proj.weight", "blocks.0.attn.beta_proj.weight"),
                         ("model.layers.2.linear_attn.o_norm.weight", "blocks.2.attn.output_gate.norm.weight")):
        torch.testing.assert_close(got[mine], ref[theirs], atol=1e-6, rtol=1e-4)
    m.eval()
    fast = H.accelerate(m)
    from linattn.models.decoding import fused_decoding_obstacle

    assert fused_decoding_obstacle(fast.model) is None  # post-norm blocks, qk_norm 'all' decode fused
    p = ids(b=1, n=6)
    kw = dict(max_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True)
    a, b = m.generate(p, **kw), fast.generate(p, **kw)
    assert b.sequences.tolist() == a.sequences.tolist()
    for r, mine in zip(a.logits, b.logits):
        torch.testing.assert_close(mine, r, atol=2e-5 * r.abs().max().item(), rtol=0)


def test_fused_step_takes_beta_up_to_two_and_the_gate_eps():
    """allow_neg_eigval (β = 2·sigmoid) and output_gate_eps in the fused delta mixer: its logits equal the
    eager step's; the β projection is scaled so that β > 1 occurs."""
    from linattn.models.decoding import FusedDecoder, fused_decoding_obstacle

    cfg = ModelConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=2, attention=["gated_deltanet"], seed=1,
                      kind_options={"gated_deltanet": {"allow_neg_eigval": True, "output_gate_eps": 1e-2,
                                                       "n_heads": 4, "v_dim": 12, "qk_dim": 8}})
    lm = LinearTransformerLM(cfg).eval()
    with torch.no_grad():
        for block in lm.blocks:
            block.attn.beta_proj.weight.mul_(40)
    assert fused_decoding_obstacle(lm) is None
    x = torch.randint(0, 50, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        beta = torch.sigmoid(lm.blocks[0].attn.beta_proj(lm.blocks[0].norm1(lm.tok_emb(x)))) * 2
        assert beta.max() > 1.5 and beta.min() < 0.5
        first, eager = lm(x, cache=lm.new_cache(), last_only=True)
        _, fused = lm(x, cache=lm.new_cache(), last_only=True)
        decoder = FusedDecoder(lm, fused, reserve=5)
        tok = first[:, -1].argmax(-1)
        for _ in range(5):
            le, eager = lm(tok[:, None], cache=eager, last_only=True)
            lf = decoder.step(tok).clone()
            torch.testing.assert_close(lf, le[:, -1], atol=2e-6, rtol=1e-5)
            tok = le[:, -1].argmax(-1)


def test_qwen35_conditional_generation_language_model():
    """A qwen3_5 checkpoint (Qwen3_5ForConditionalGeneration): its language model converts, text-only logits equal."""
    from transformers.models.qwen3_5 import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    text = qwen35_config().to_dict()
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                  temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16)
    c = Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=False)
    c._attn_implementation = "eager"
    c.get_text_config()._attn_implementation = "eager"
    torch.manual_seed(0)
    m = Qwen3_5ForConditionalGeneration(c).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name or "A_log" in name or "dt_bias" in name:
                p.add_(torch.randn_like(p) * 0.2)
    lm = from_transformers_hybrid(m)
    x = ids()
    with torch.no_grad():
        ref = m(input_ids=x).logits
        torch.testing.assert_close(logits(lm, x), ref, atol=2e-5 * ref.abs().max().item(), rtol=0)


def test_accelerate_takes_the_softmax_teachers_too():
    """A Qwen3 (linattn.hf.teacher's route): same greedy tokens as transformers' generate."""
    c = transformers.Qwen3Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=8, pad_token_id=0,
                                 eos_token_id=1, bos_token_id=2, tie_word_embeddings=False)
    c._attn_implementation = "eager"
    torch.manual_seed(0)
    m = transformers.Qwen3ForCausalLM(c).eval()
    fast = H.accelerate(m)
    assert fast.config.eos_token_id == 1 and fast.model.config.qk_norm
    x = ids(b=1, n=6)
    assert fast.generate(x, max_new_tokens=8, do_sample=False).tolist() == \
        m.generate(x, max_new_tokens=8, do_sample=False).tolist()
