"""linattn.hf.kimi: transformers' Kimi Linear (KDA + MLA layers, grouped sigmoid MoE router) as a linattn
model, against transformers' eager forward, gradients, routing and generate."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
kimi = pytest.importorskip("transformers.models.kimi_linear")

import linattn.hf as H  # noqa: E402
from linattn.hf.kimi import from_transformers_kimi, kimi_config  # noqa: E402
from linattn.models import LinearTransformerLM, ModelConfig  # noqa: E402
from linattn.models.decoding import fused_decoding_obstacle  # noqa: E402
from linattn.nn.mla import LatentQKV  # noqa: E402
from linattn.nn.moe import MoEFeedForward  # noqa: E402

from .test_hf_hybrid import greedy_left_padded  # noqa: E402

LAYERS = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
MLPS = ["dense", "sparse", "sparse", "dense"]


def kimi_cfg(**over):
    kw = dict(vocab_size=97, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=4,
              num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=12, q_lora_rank=None, qk_rope_head_dim=4,
              qk_nope_head_dim=8, v_head_dim=10, n_group=2, topk_group=1, num_experts_per_tok=2,
              num_local_experts=8, n_shared_experts=2, routed_scaling_factor=2.5, layer_types=LAYERS,
              mlp_layer_types=MLPS, rms_norm_eps=1e-5, initializer_range=0.1, tie_word_embeddings=False,
              linear_attn_config={"head_dim": 8, "num_heads": 3, "short_conv_kernel_size": 4},
              pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kw.update(over)
    c = kimi.KimiLinearConfig(**kw)
    c._attn_implementation = "eager"
    return c


def kimi_model(seed=0, **over):
    """A tiny random Kimi Linear whose constant-initialized tensors (norm gains, the router's score bias)
    are drawn too, so that a swapped or dropped one shows."""
    torch.manual_seed(seed)
    m = kimi.KimiLinearForCausalLM(kimi_cfg(**over)).float().eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
        for mod in m.modules():
            if hasattr(mod, "e_score_correction_bias"):
                mod.e_score_correction_bias.normal_(0, 0.05)
    return m


def ids(b=2, n=13, seed=0):
    return torch.randint(3, 97, (b, n), generator=torch.Generator().manual_seed(seed))


def logits(lm, x, mask=None):
    out = lm(x, mask)
    return out[0] if isinstance(out, tuple) else out


def close(mine, ref, scale=2e-5):
    torch.testing.assert_close(mine, ref, atol=scale * ref.abs().max().item(), rtol=0)


@pytest.mark.parametrize("over", [{}, dict(q_lora_rank=6), dict(tie_word_embeddings=True, n_group=1),
                                  dict(mlp_layer_types=["sparse"] * 4, n_shared_experts=0, norm_topk_prob=False)],
                         ids=["base", "q_lora", "tied_one_group", "all_sparse_unshared"])
def test_logits_equal_transformers_eager_float32(over):
    m = kimi_model(**over)
    lm = from_transformers_kimi(m)
    assert lm.config.layer_kinds == ["kda", "softmax", "kda", "softmax"]
    assert isinstance(lm.blocks[1].attn.qkv, LatentQKV)
    theirs = m.model.layers[1].self_attn  # the latent norms keep KimiLinearRMSNorm's default eps
    assert lm.blocks[1].attn.qkv.kv_a_norm.eps == theirs.kv_a_layernorm.variance_epsilon == 1e-6 != m.config.rms_norm_eps
    x = ids(n=70)  # longer than one chunk of transformers' chunked KDA (64)
    with torch.no_grad():
        ref = m(x).logits
        close(logits(lm, x), ref)
    assert ref.std() > 0.05  # the tiny model is not a near-constant function
    # transformers' KimiLinearForCausalLM ties nothing, whatever tie_word_embeddings says
    assert not lm.config.tie_embeddings and lm.lm_head.weight is m.lm_head.weight


def test_left_padding_gives_each_row_alone():
    m = kimi_model()
    lm = from_transformers_kimi(m)
    x = ids(b=2, n=9)
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[0, :3] = False
    with torch.no_grad():
        padded = logits(lm, x, mask)
        alone = m(x[:1, 3:]).logits
    close(padded[0, 3:], alone[0])


def test_routing_equals_transformers():
    m = kimi_model()
    lm = from_transformers_kimi(m)
    moe = lm.config.moe
    assert (moe["router"], moe["n_group"], moe["topk_group"], moe["shared_gate"]) == ("sigmoid", 2, 1, False)
    assert moe["layers"] == [1, 2] and moe["shared_d_ff"] == 32 and moe["routed_scaling_factor"] == 2.5
    h = torch.randn(64, 32, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        _, w_ref, i_ref = m.model.layers[2].mlp.gate(h)
        i_mine, w_mine = lm.blocks[2].ffn.route(h)
    order_ref, order_mine = i_ref.sort(-1), i_mine.sort(-1)  # torch.topk(sorted=False): compare as sets
    assert order_mine.values.tolist() == order_ref.values.tolist()
    torch.testing.assert_close(w_mine.gather(1, order_mine.indices), w_ref.gather(1, order_ref.indices),
                               atol=1e-7, rtol=1e-6)
    groups = (i_ref // 4).tolist()  # topk_group=1: each token's experts lie in one group of 4
    assert all(len(set(g)) == 1 for g in groups) and len({g[0] for g in groups}) == 2
    torch.testing.assert_close(w_ref.sum(-1), torch.full((64,), 2.5))  # renormalized, then scaled


def test_gradients_equal_transformers():
    m = kimi_model().train()
    lm = from_transformers_kimi(m, share=False).train()
    x, y = ids(n=20), ids(n=20, seed=1)

    def backward(out):
        torch.nn.functional.cross_entropy(out.flatten(0, 1), y.flatten()).backward()

    backward(m(x).logits)
    backward(logits(lm, x))
    ref = {n: p.grad for n, p in m.named_parameters()}
    got = {n: p.grad for n, p in lm.named_parameters()}
    L = "model.layers."
    pairs = [("model.embed_tokens.weight", "tok_emb.weight"), ("lm_head.weight", "lm_head.weight"),
             (L + "0.self_attn.forget_gate.f_a_proj.weight", "blocks.0.attn.forget_gate.f_a.weight"),
             (L + "0.self_attn.forget_gate.dt_bias", "blocks.0.attn.forget_gate.dt_bias"),
             (L + "0.self_attn.b_proj.weight", "blocks.0.attn.beta_proj.weight"),
             (L + "0.self_attn.g_b_proj.weight", "blocks.0.attn.kda_gate.g_b.weight"),
             (L + "0.self_attn.o_norm.weight", "blocks.0.attn.kda_gate.norm.weight"),
             (L + "1.self_attn.kv_a_proj_with_mqa.weight", "blocks.1.attn.qkv.kv_a.weight"),
             (L + "1.self_attn.kv_a_layernorm.weight", "blocks.1.attn.qkv.kv_a_norm.weight"),
             (L + "1.self_attn.kv_b_proj.weight", "blocks.1.attn.qkv.kv_b.weight"),
             (L + "1.self_attn.q_proj.weight", "blocks.1.attn.qkv.q.weight"),
             (L + "2.mlp.gate.weight", "blocks.2.ffn.router.weight"),
             (L + "2.mlp.experts.gate_up_proj", "blocks.2.ffn.gate_up"),
             (L + "2.mlp.shared_experts.down_proj.weight", "blocks.2.ffn.shared.down.weight"),
             (L + "3.post_attention_layernorm.weight", "blocks.3.norm2.weight")]
    def same(mine, theirs, what):
        assert theirs.abs().max() > 0, what
        torch.testing.assert_close(mine, theirs, atol=1e-4 * theirs.abs().max().item(), rtol=0, msg=lambda s: f"{what}: {s}")

    for theirs, mine in pairs:
        same(got[mine], ref[theirs], theirs)
    a = L + "0.self_attn."
    same(got["blocks.0.attn.forget_gate.A_log"], ref[a + "forget_gate.A_log"].reshape(-1), "A_log")
    same(got["blocks.0.attn.qkv.weight"], torch.cat([ref[a + f"{p}_proj.weight"] for p in "qkv"]), "q|k|v")
    same(got["blocks.0.attn.conv.weight"], ref[a + "conv1d.weight"][:, 0], "conv1d")


def test_share_true_shares_and_config_round_trips(tmp_path):
    m = kimi_model(q_lora_rank=6)
    lm = from_transformers_kimi(m)
    attn = m.model.layers[1].self_attn
    assert lm.blocks[1].attn.qkv.q_b.weight is attn.q_b_proj.weight
    assert lm.blocks[2].ffn.gate_up is m.model.layers[2].mlp.experts.gate_up_proj
    cfg = ModelConfig.from_json(lm.config.to_json())
    assert cfg == lm.config and cfg.kind_options["softmax"]["q_lora_rank"] == 6
    lm = from_transformers_kimi(m, share=False)  # linattn's own layouts: the reloaded model's, bit for bit
    assert lm.blocks[1].attn.qkv.q_b.weight is not attn.q_b_proj.weight
    lm.save_pretrained(tmp_path)
    back = LinearTransformerLM.from_pretrained(tmp_path)
    torch.testing.assert_close(back.blocks[1].ffn.score_bias, m.model.layers[1].mlp.gate.e_score_correction_bias)
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(logits(back, x), logits(lm, x), atol=0, rtol=0)


def test_accelerate_greedy_generation_equals_transformers(tmp_path):
    m = kimi_model()
    fast = H.accelerate(m)
    assert fused_decoding_obstacle(fast.model) is None  # KDA and MLA layers, MoE FFNs: the fused step
    x = ids(b=1, n=6)
    kw = dict(max_new_tokens=10, do_sample=False, output_logits=True, return_dict_in_generate=True)
    a, b = m.generate(x, **kw), fast.generate(x, **kw)
    assert b.sequences.tolist() == a.sequences.tolist()
    for ref, mine in zip(a.logits, b.logits):
        close(mine, ref)
    fast.save_pretrained(tmp_path)  # the transformers wrapper's own round trip (config.json, safetensors)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert back.model.config.moe == fast.model.config.moe
    assert back.generate(x, **kw).sequences.tolist() == a.sequences.tolist()


def test_accelerate_left_padded_batch_and_sampling_equal_transformers():
    m = kimi_model()
    fast = H.accelerate(m)
    a, b, x = greedy_left_padded(m, fast)
    assert b.tolist() == a.tolist()
    alone = fast.generate(x[:1, 3:], max_new_tokens=8, do_sample=False)
    assert b[0, 3:3 + alone.shape[1]].tolist() == alone[0].tolist()
    kw = dict(max_new_tokens=8, do_sample=True, top_k=20, temperature=1.5)
    torch.manual_seed(7)
    a = m.generate(x[1:], **kw)
    torch.manual_seed(7)
    assert fast.generate(x[1:], **kw).tolist() == a.tolist()


def test_mla_softmax_model_steps_equal_the_full_forward():
    opts = {"softmax": dict(kv_lora_rank=8, q_lora_rank=6, shared_k_dim=4, qk_dim=12, v_dim=10)}
    lm = LinearTransformerLM(ModelConfig(vocab_size=50, d_model=32, n_heads=2, n_layers=2, attention=["softmax"],
                                         positions="none", kind_options=opts)).eval()
    x = torch.randint(0, 50, (2, 9))
    with torch.no_grad():
        full = logits(lm, x)
        cache = lm.new_cache()
        out, cache = lm(x[:, :5], cache=cache)
        steps = [out]
        for t in range(5, 9):
            out, cache = lm(x[:, t:t + 1], cache=cache)
            steps.append(out)
    close(torch.cat(steps, 1), full, 1e-5)


@pytest.mark.parametrize("over, message", [
    (dict(attention_bias=True), "attention_bias=True"),
    (dict(num_key_value_heads=1), "num_key_value_heads=1"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    (dict(mlp_layer_types=["dense", "moe", "dense", "dense"]), r"mlp_layer_types \['moe'\]"),
])
def test_conversion_refuses_by_name(over, message):
    c = kimi_cfg()
    for name, value in over.items():  # set after construction: transformers validates some itself
        object.__setattr__(c, name, value)
    with pytest.raises(ValueError, match=message):
        kimi_config(c)


@pytest.mark.parametrize("moe, message", [
    (dict(router="top2"), r"moe\['router'\]"),
    (dict(router="sigmoid", n_group=3), r"moe\['n_group'\]=3"),
    (dict(router="sigmoid", n_group=4), r"groups of at least 2"),
    (dict(router="sigmoid", n_group=2, topk_group=3), r"moe\['topk_group'\]=3"),
    (dict(router="sigmoid", routed_scaling_factor=0), r"moe\['routed_scaling_factor'\]"),
    (dict(n_group=2), "the sigmoid router's"),
    (dict(shared_gate=1), r"moe\['shared_gate'\]"),
])
def test_moe_router_options_refused_by_name(moe, message):
    good = dict(num_experts=4, top_k=2, d_expert=8, shared_d_ff=0, norm_topk_prob=True, layers=None)
    with pytest.raises(ValueError, match=message):
        ModelConfig(d_model=32, n_heads=2, moe={**good, **moe})


@pytest.mark.parametrize("options, message", [
    (dict(q_lora_rank=4), "need kv_lora_rank"),
    (dict(shared_k_dim=2), "need kv_lora_rank"),
    (dict(kv_lora_rank=0), "kv_lora_rank"),
    (dict(kv_lora_rank=8, shared_k_dim=16), "shared_k_dim=16 must be below qk_dim=16"),
    (dict(kv_lora_rank=8, latent_eps=0), "latent_eps"),
])
def test_mla_options_refused_by_name(options, message):
    with pytest.raises(ValueError, match=message):
        LinearTransformerLM(ModelConfig(d_model=32, n_heads=2, attention=["softmax"], kind_options={"softmax": options}))


def test_moe_module_router_kinds_differ():
    x = torch.randn(5, 16)
    soft = MoEFeedForward(16, 4, 2, 8)
    sig = MoEFeedForward(16, 4, 2, 8, router="sigmoid", routed_scaling_factor=2.0)
    assert soft.score_bias is None and "score_bias" in dict(sig.named_buffers())
    sig.router.weight.data.copy_(soft.router.weight.data)
    _, w = sig.route(x)
    torch.testing.assert_close(w.sum(-1), torch.full((5,), 2.0))
