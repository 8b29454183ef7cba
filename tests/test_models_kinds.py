"""linattn.models with the gated and delta-rule kinds, short convolutions, output gates, conv_mixer
blocks and logits at chosen positions: decoding == parallel, generation, save/load, training,
config checks."""

import pytest
import torch

from linattn.nn.recurrent import RecurrentCache
from linattn.nn.blocks import Block, ConvMixerBlock, ConvMixerCache
from linattn.nn.caches import KVCache
from linattn.models import (
    KINDS,
    ATTENTION_KINDS,
    RECURRENT_KINDS,
    LinearTransformerEncoder,
    LinearTransformerLM,
    ModelConfig,
    load_pretrained,
)

from .conftest import spread, tiny_config


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


tiny = tiny_config
#: the kinds with a RecurrentCache (gated and delta-rule families)
NEW_KINDS = [k for k in RECURRENT_KINDS if KINDS[k].family in ("gated", "delta")]


def lm(dtype=torch.float64, **kw):
    return spread(LinearTransformerLM(tiny(**kw))).to(dtype).eval()


def _decode_all(model, ids, splits):
    cache, out = model.new_cache(), []
    for lo, hi in splits:
        logits, cache = model(ids[:, lo:hi], cache=cache)
        out.append(logits)
    return torch.cat(out, 1), cache


SPLITS = [(0, 1), (1, 2), (2, 7), (7, 8), (8, 9), (9, 13), (13, 14), (14, 15)]


@pytest.mark.parametrize("kind", NEW_KINDS)
@pytest.mark.parametrize("block", ["transformer", "conv_mixer"])
def test_decoding_equals_the_parallel_forward_in_hybrids_fp64(kind, block):
    model = lm(attention=[kind, "softmax"], block=block, positions="rope")
    ids = torch.randint(0, 40, (2, 15), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full, _ = model(ids)
        rec, cache = _decode_all(model, ids, SPLITS)
    torch.testing.assert_close(rec, full, rtol=1e-10, atol=1e-10)
    first, second = cache.layers
    if block == "conv_mixer":
        assert isinstance(first, ConvMixerCache) and first.conv.shape == (2, 2, 32)
        first, second = first.attn, second.attn
    assert isinstance(first, RecurrentCache) and isinstance(second, KVCache)
    if kind in ("deltanet", "gated_deltanet", "kda"):  # their default short convolution, K = 4
        assert first.conv.shape == (2, 3, 3 * 32)
    else:  # RetNet and GLA have none
        assert first.conv is None and model.blocks[0].attn.conv is None


@pytest.mark.parametrize("kind", NEW_KINDS)
def test_fp32_decoding_logits_and_greedy_tokens(kind):
    """fp32 (the fused kernels): logits of prefill + steps within float tolerance of the parallel
    forward, and greedy generation gives the tokens of repeated argmax over the full forward."""
    model = lm(torch.float32, attention=[kind], positions="none")
    ids = torch.randint(0, 40, (2, 15), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full, _ = model(ids)
        rec, _ = _decode_all(model, ids, SPLITS)
    torch.testing.assert_close(rec, full, rtol=0, atol=2e-5 * float(full.abs().max()))
    prompt, seq = [5, 6, 7, 8], [5, 6, 7, 8]
    with torch.no_grad():
        for _ in range(10):
            seq.append(int(model(torch.tensor([seq]))[0][0, -1].argmax()))
    assert model.generate(prompt, 10, temperature=0) == [seq[4:]]


@pytest.mark.parametrize("kind", NEW_KINDS)
def test_batch_of_left_padded_prompts_generates_what_each_prompt_does_alone(kind):
    model = lm(attention=[kind, "linear"], positions="rope")
    prompts = [[5, 6, 7, 8, 9, 10, 11], [3, 1], [9, 9, 2, 4]]
    alone = [model.generate(p, 8, temperature=0)[0] for p in prompts]
    assert model.generate(prompts, 8, temperature=0) == alone
    assert len({tuple(a) for a in alone}) == 3


@pytest.mark.parametrize("kind, block", [("deltanet", "transformer"), ("gated_deltanet", "conv_mixer"),
                                         ("gla", "transformer"), ("retnet", "conv_mixer"), ("simple_gla", "transformer")])
def test_save_and_load_round_trip(tmp_path, kind, block):
    model = lm(attention=[kind, "softmax"], block=block, short_conv=2, tie_embeddings=False)
    model.save_pretrained(tmp_path / "m")
    back = LinearTransformerLM.from_pretrained(tmp_path / "m")
    assert back.config == model.config
    back = back.double().eval()
    for (name, a), b in zip(model.state_dict().items(), back.state_dict().values()):
        assert torch.equal(a, b), name
    ids = torch.randint(0, 40, (2, 9))
    torch.testing.assert_close(back(ids)[0], model(ids)[0], rtol=0, atol=0)
    assert isinstance(load_pretrained(tmp_path / "m"), LinearTransformerLM)


def test_configs_written_before_the_new_fields_load_with_the_old_behaviour():
    d = tiny(attention=["linear", "softmax"]).to_dict()
    for key in ("short_conv", "output_gate", "block", "conv_mixer_kernel"):
        del d[key]
    cfg = ModelConfig.from_dict(d)
    model = LinearTransformerLM(cfg)
    assert all(isinstance(b, Block) and b.attn.conv is None and b.attn.output_gate is None for b in model.blocks)


def test_kind_defaults_and_overrides():
    cfg = tiny(attention="gated_deltanet,softmax")
    assert cfg.layer_kinds == ["gated_deltanet", "softmax"]
    kinds = ["linear", "softmax", "retnet", "simple_gla", "gla", "deltanet", "gated_deltanet"]
    assert [cfg.short_conv_for(k) for k in kinds] == [0, 0, 0, 0, 0, 4, 4]
    assert [cfg.output_gate_for(k) for k in kinds] == [False, False, True, True, True, True, True]
    model = LinearTransformerLM(tiny(attention="deltanet,softmax", short_conv=0, output_gate=True))
    assert [b.attn.conv for b in model.blocks] == [None, None]
    assert all(b.attn.output_gate is not None for b in model.blocks)
    model = LinearTransformerLM(tiny(attention="linear", short_conv=2, output_gate=False))
    assert all(b.attn.conv.kernel_size == 2 and b.attn.output_gate is None for b in model.blocks)


def test_conv_mixer_blocks_alternate_gated_convolution_and_mixer_without_ffn():
    model = LinearTransformerLM(tiny(attention="gated_deltanet", block="conv_mixer", conv_mixer_kernel=5))
    assert all(isinstance(b, ConvMixerBlock) and not hasattr(b, "ffn") for b in model.blocks)
    assert [b.conv.conv.kernel_size for b in model.blocks] == [5, 5]
    names = [n for n, _ in model.named_parameters()]
    assert not any(".ffn." in n for n in names)
    transformer = LinearTransformerLM(tiny(attention="gated_deltanet"))
    d = 32
    ffn = sum(p.numel() for n, p in transformer.named_parameters() if ".ffn." in n or ".norm2." in n)
    gated_conv = 2 * (d * 5 + d + d * d + d + d)  # per block: conv weight and bias, projection and bias, norm2
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in transformer.parameters()) - ffn + gated_conv


@pytest.mark.parametrize("kind", ["deltanet", "softmax"])
def test_logits_at_equal_the_full_logits_at_those_positions(kind):
    model = lm(attention=[kind, "linear"])
    ids = torch.randint(0, 40, (3, 12))
    full, _ = model(ids)
    at = torch.tensor([[0, 5, 11], [3, 3, 7], [11, 10, 2]])
    got, _ = model(ids, logits_at=at)
    assert got.shape == (3, 3, 40)
    torch.testing.assert_close(got, full.gather(1, at[..., None].expand(-1, -1, 40)), rtol=1e-12, atol=1e-12)
    shared, _ = model(ids, logits_at=torch.tensor([1, 4]))
    torch.testing.assert_close(shared, full[:, [1, 4]], rtol=1e-12, atol=1e-12)
    cache = model.new_cache()
    model(ids[:, :6], cache=cache)
    cont, _ = model(ids[:, 6:], cache=cache, logits_at=torch.tensor([0, 5]))  # indices into the new tokens
    torch.testing.assert_close(cont, full[:, [6, 11]], rtol=1e-10, atol=1e-10)


def test_logits_at_rejects_bad_indices():
    model = lm(attention=["deltanet"])
    ids = torch.randint(0, 40, (2, 6))
    for bad, match in ((torch.tensor([[0, 6], [1, 2]]), r"\[0, 6\)"), (torch.tensor([-1]), r"\[0, 6\)"),
                       (torch.tensor([[1.0]]), "integer"), (torch.zeros(3, 2, dtype=torch.long), r"B=2"),
                       ([1, 2], "integer"), (torch.zeros(1, 1, 1, dtype=torch.long), "integer")):
        with pytest.raises(ValueError, match=match):
            model(ids, logits_at=bad)
    with pytest.raises(ValueError, match="last_only or logits_at"):
        model(ids, last_only=True, logits_at=torch.tensor([1]))


@pytest.mark.parametrize("attention, block", [("gated_deltanet,softmax", "transformer"), ("deltanet", "conv_mixer"),
                                              ("gla,simple_gla", "transformer"), ("retnet", "conv_mixer")])
def test_a_few_training_steps_lower_the_loss(attention, block):
    torch.manual_seed(0)
    model = LinearTransformerLM(tiny(attention=attention, block=block))
    ids = torch.randint(0, 40, (8, 24), generator=torch.Generator().manual_seed(2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(12):
        loss = model.loss(ids)
        opt.zero_grad()
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses
    assert all(p.grad.abs().sum() > 0 for p in model.parameters()), [n for n, p in model.named_parameters()
                                                                      if not p.grad.abs().sum() > 0]


@pytest.mark.parametrize("kind", NEW_KINDS)
def test_autocast_bf16_cpu(kind):
    torch.manual_seed(3)
    model = spread(LinearTransformerLM(tiny(attention=[kind, "softmax"])), scale=0.1)
    ids = torch.randint(0, 40, (2, 16))
    ref, _ = model(ids)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = model(ids)
        loss = model.loss(ids)
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    err = (out.float() - ref).abs().max() / ref.abs().max()
    assert err < 0.05, err


def test_init_is_seeded_including_decays_and_convolutions():
    a = LinearTransformerLM(tiny(attention="gated_deltanet", block="conv_mixer", seed=5))
    b = LinearTransformerLM(tiny(attention="gated_deltanet", block="conv_mixer", seed=5))
    c = LinearTransformerLM(tiny(attention="gated_deltanet", block="conv_mixer", seed=6))
    for (k, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), k
    for name in ("blocks.0.attn.decay.A_log", "blocks.0.attn.conv.weight", "blocks.1.conv.conv.weight"):
        assert not torch.equal(a.state_dict()[name], c.state_dict()[name]), name
    assert not torch.equal(a.blocks[0].attn.decay.A_log, a.blocks[1].attn.decay.A_log)


@pytest.mark.parametrize("kw, match", [
    (dict(attention="gdn"), "attention"),
    (dict(attention=["deltanet", "mamba"]), "attention"),
    (dict(short_conv=-1), "short_conv"),
    (dict(short_conv="4"), "short_conv"),
    (dict(short_conv=True), "short_conv"),
    (dict(output_gate="yes"), "output_gate"),
    (dict(block="mamba"), "block"),
    (dict(conv_mixer_kernel=0), "conv_mixer_kernel"),
])
def test_config_rejects_bad_values(kw, match):
    with pytest.raises(ValueError, match=match):
        tiny(**kw)


def test_the_error_for_an_unknown_kind_lists_every_kind():
    with pytest.raises(ValueError) as err:
        tiny(attention="gdn")
    assert all(k in str(err.value) for k in ATTENTION_KINDS)


@pytest.mark.parametrize("kind", NEW_KINDS)
def test_encoder_refuses_causal_only_kinds(kind):
    with pytest.raises(ValueError, match=f"{kind}.*causal only"):
        LinearTransformerEncoder(tiny(attention=[kind, "linear"], num_classes=3))


@pytest.mark.parametrize("kw", [dict(attention="deltanet,softmax"), dict(attention="gla,linear", short_conv=3),
                                dict(attention="retnet", block="conv_mixer")], ids=["delta", "gla-conv", "conv_mixer"])
def test_set_sequence_parallel_group_reaches_every_layer_and_convolution(kw):
    """Every kind, short convolution and conv_mixer block runs sequence-parallel (tests/parallel/
    compare the sharded models with one process): the group reaches each attention layer and each
    conv_mixer block's gated convolution, and None switches it off."""
    model = LinearTransformerLM(tiny(**kw))
    model.set_sequence_parallel_group("G")
    assert all(b.attn.sequence_parallel_group == "G" for b in model.blocks)
    assert all(b.sequence_parallel_group == "G" for b in model.blocks if isinstance(b, ConvMixerBlock))
    model.set_sequence_parallel_group(None)
    assert all(b.attn.sequence_parallel_group is None for b in model.blocks)
    assert all(b.sequence_parallel_group is None for b in model.blocks if isinstance(b, ConvMixerBlock))
