"""linattn.hf: LinattnConfig / LinattnForCausalLM — conversion, save/load, errors (transformers extra)."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

import linattn.hf as H  # noqa: E402
from linattn.models import KINDS, LinearTransformerLM, ModelConfig  # noqa: E402

#: one tiny config per attention kind, plus a hybrid, a conv_mixer model, learned positions, untied head
CASES = {kind: dict(attention=[kind]) for kind in KINDS}  # every kind of the kinds table
CASES.update({
    "hybrid": dict(attention="gated_deltanet,softmax", n_layers=2),
    "conv_mixer": dict(attention="linear,softmax", block="conv_mixer", n_layers=2),
    "learned_untied": dict(attention="deltanet", positions="learned", max_len=64, tie_embeddings=False),
    "favor": dict(attention="linear", feature_map="favor", feature_map_options={"num_features": 8}),
})


def tiny(name: str, **over) -> ModelConfig:
    kw = {**dict(vocab_size=64, d_model=16, n_layers=1, n_heads=2, seed=3, chunk_size=4), **CASES[name]}
    kw.update(over)
    return ModelConfig(**kw)


def ids(b=2, n=11, vocab=64, seed=0):
    return torch.randint(0, vocab, (b, n), generator=torch.Generator().manual_seed(seed))


def test_config_round_trip_and_mirrors(tmp_path):
    mc = tiny("hybrid")
    c = H.LinattnConfig(linattn=mc, pad_token_id=0)
    assert (c.vocab_size, c.hidden_size, c.num_hidden_layers, c.num_attention_heads) == (64, 16, 2, 2)
    assert c.layer_types == ["linear_attention", "full_attention"]
    assert c.model_config == mc
    c.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "linattn" and saved["linattn"]["attention"] == ["gated_deltanet", "softmax"]
    back = transformers.AutoConfig.from_pretrained(tmp_path)
    assert isinstance(back, H.LinattnConfig) and back.model_config == mc and back.pad_token_id == 0
    # ModelConfig fields as keywords, and a mirror set later wins
    c2 = H.LinattnConfig(d_model=32, n_heads=4, attention="retnet")
    assert c2.model_config.d_model == 32 and c2.hidden_size == 32 and c2.model_config.attention == ["retnet"]
    c2.vocab_size = 300
    assert c2.model_config.vocab_size == 300


def test_config_refuses_bad_values():
    with pytest.raises(ValueError, match="attention"):
        H.LinattnConfig(attention="nope")
    with pytest.raises(TypeError, match="linattn"):
        H.LinattnConfig(linattn=3)
    with pytest.raises(ValueError, match="num_classes"):
        H.LinattnConfig(num_classes=3)


@pytest.mark.parametrize("name", sorted(CASES))
def test_conversion_is_bit_exact_both_ways(name):
    lm = LinearTransformerLM(tiny(name)).eval()
    x = ids()
    ref, _ = lm(x)
    hf = H.LinattnForCausalLM.from_linattn(lm)
    assert hf.to_linattn() is lm
    assert torch.equal(hf(x).logits, ref)
    # a copy converts back to an equal, separate LinearTransformerLM
    back = H.LinattnForCausalLM.from_linattn(lm, copy_model=True).to_linattn(copy_model=True)
    assert back is not lm and back.config == lm.config
    assert torch.equal(back(x)[0], ref)
    # parameter names are linattn's under "model."
    assert {f"model.{k}" for k in lm.state_dict()} == set(hf.state_dict())


@pytest.mark.parametrize("name", ["gated_deltanet", "hybrid", "learned_untied"])
def test_new_model_is_linattns_seeded_init(name):
    """Building from a LinattnConfig gives LinearTransformerLM's own initialization (transformers does
    not re-initialize it)."""
    mc = tiny(name)
    hf = H.LinattnForCausalLM(H.LinattnConfig(linattn=mc))
    lm = LinearTransformerLM(mc)
    for (k, a), (_, b) in zip(hf.model.state_dict().items(), lm.state_dict().items()):
        assert torch.equal(a, b), k
    assert (hf.model.lm_head.weight is hf.model.tok_emb.weight) == mc.tie_embeddings


@pytest.mark.parametrize("name", ["hybrid", "learned_untied", "favor", "conv_mixer"])
def test_save_load_round_trip_safetensors_only(tmp_path, name):
    lm = LinearTransformerLM(tiny(name)).eval()
    hf = H.LinattnForCausalLM.from_linattn(lm, eos_token_id=5)
    hf.save_pretrained(tmp_path)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert "config.json" in files and "model.safetensors" in files
    assert not any(f.endswith((".bin", ".pt", ".pkl", ".pth")) for f in files)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert isinstance(back, H.LinattnForCausalLM) and back.config.eos_token_id == 5
    assert back.model.config == lm.config
    assert (back.model.lm_head.weight is back.model.tok_emb.weight) == lm.config.tie_embeddings
    for k, v in lm.state_dict().items():
        assert torch.equal(back.model.state_dict()[k], v), k
    x = ids()
    assert torch.equal(back.eval()(x).logits, lm(x)[0])


def test_save_load_bfloat16(tmp_path):
    lm = LinearTransformerLM(tiny("gated_deltanet")).to(torch.bfloat16).eval()
    H.LinattnForCausalLM.from_linattn(lm).save_pretrained(tmp_path)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert back.dtype == torch.bfloat16
    x = ids()
    assert torch.equal(back.eval()(x).logits, lm(x)[0])


def test_labels_give_linattns_loss_and_logits_to_keep():
    lm = LinearTransformerLM(tiny("hybrid")).eval()
    hf = H.LinattnForCausalLM.from_linattn(lm)
    x = ids(n=12)
    out = hf(x, labels=x)
    assert torch.allclose(out.loss, lm.loss(x), rtol=1e-6, atol=1e-6)
    full = hf(x).logits
    assert torch.equal(hf(x, logits_to_keep=1).logits, lm(x, last_only=True)[0])  # linattn's last_only
    assert torch.allclose(hf(x, logits_to_keep=1).logits, full[:, -1:], atol=1e-6, rtol=1e-5)
    assert torch.equal(hf(x, logits_to_keep=3).logits, full[:, -3:])
    assert torch.equal(hf(x, logits_to_keep=torch.tensor([0, 5])).logits, full[:, [0, 5]])


def test_left_padding_mask_matches_unpadded_rows():
    lm = LinearTransformerLM(tiny("hybrid")).eval()
    hf = H.LinattnForCausalLM.from_linattn(lm)
    short, long = ids(1, 5, seed=1), ids(1, 9, seed=2)
    batch = torch.cat([torch.cat([torch.zeros(1, 4, dtype=torch.long), short], 1), long])
    mask = torch.ones_like(batch)
    mask[0, :4] = 0
    out = hf(batch, attention_mask=mask).logits
    assert torch.allclose(out[0, 4:], hf(short).logits[0], atol=1e-5, rtol=1e-5)
    assert torch.allclose(out[1], hf(long).logits[0], atol=1e-5, rtol=1e-5)


def test_errors_name_the_argument():
    hf = H.LinattnForCausalLM.from_linattn(LinearTransformerLM(tiny("deltanet")))
    x = ids()
    with pytest.raises(TypeError, match="cache"):
        hf(x, cache=transformers.DynamicCache())
    with pytest.raises(ValueError, match="inputs_embeds"):
        hf(inputs_embeds=torch.zeros(1, 2, 16))
    with pytest.raises(ValueError, match="attention_mask"):
        hf(x, attention_mask=torch.ones(2, 3))
    with pytest.raises(ValueError, match="packed"):
        hf(x, position_ids=torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6]]))
    for bad in (torch.tensor([0, 11]), torch.tensor([-12]), torch.tensor([0.5])):  # issue 37 item 19: IndexError
        with pytest.raises(ValueError, match="logits_to_keep"):
            hf(x, logits_to_keep=bad)
    assert hf(x, logits_to_keep=torch.tensor([-11, 10])).logits.shape == (2, 2, 64)
    with pytest.raises(TypeError, match="model"):
        H.LinattnForCausalLM.from_linattn(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="model"):
        H.LinattnForCausalLM(H.LinattnConfig(linattn=tiny("gla")), model=LinearTransformerLM(tiny("deltanet")))


def _saved(tmp_path):
    lm = LinearTransformerLM(tiny("hybrid")).eval()
    H.LinattnForCausalLM.from_linattn(lm).save_pretrained(tmp_path)
    return lm


@pytest.mark.parametrize("drop, extra", [(["model.blocks.1.attn.out.weight"], {}),
                                         (["model.tok_emb.weight", "model.norm.weight"], {}),
                                         ([], {"model.blocks.7.attn.out.weight": torch.zeros(2)})])
def test_from_pretrained_refuses_missing_or_unexpected_tensors(tmp_path, drop, extra):
    """Issue 37 item 20: a checkpoint with tensors removed loaded with transformers' load report only
    and the missing weights silently initialized (linattn's own loader refuses). Now a CheckpointError
    names them, through AutoModelForCausalLM and LinattnForCausalLM alike."""
    from safetensors.torch import load_file, save_file

    from linattn.models.checkpoint import CheckpointError

    _saved(tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = {k: v for k, v in load_file(path).items() if k not in drop}
    save_file({**tensors, **extra}, path, metadata={"format": "pt"})
    for loader in (transformers.AutoModelForCausalLM, H.LinattnForCausalLM):
        with pytest.raises(CheckpointError, match="|".join(drop + list(extra))) as err:
            loader.from_pretrained(tmp_path)
        assert all(name in str(err.value) for name in drop + list(extra))


def test_from_pretrained_refuses_a_config_without_linattns_fields(tmp_path):
    """Issue 37 item 20: a config.json without its `linattn` object (the ModelConfig) built linattn's
    default architecture around the mirrors (hidden_size, …) without a word."""
    _saved(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["linattn"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    for load in (transformers.AutoModelForCausalLM.from_pretrained, H.LinattnForCausalLM.from_pretrained,
                 H.LinattnConfig.from_pretrained):
        with pytest.raises(ValueError, match="linattn"):
            load(tmp_path)
    assert H.LinattnConfig().model_config == ModelConfig()  # built in code, the defaults stay a choice


def test_data_collator_with_flattening_trains_packed_documents(tmp_path):
    """Issue 37 item 19: LinattnForCausalLM refused DataCollatorWithFlattening's rows ("packing is
    unsupported"). A packed row now runs as packed documents: logits and loss equal those of the
    documents one by one (with or without the collator's flash-attention keywords), a cache is
    refused by name, and Trainer trains on such batches."""
    lm = LinearTransformerLM(tiny("hybrid")).eval()
    hf = H.LinattnForCausalLM.from_linattn(lm).eval()
    docs = [ids(1, 7, seed=1)[0].tolist(), ids(1, 5, seed=2)[0].tolist(), ids(1, 9, seed=3)[0].tolist()]
    for flash in (False, True):
        batch = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=flash)([{"input_ids": d} for d in docs])
        out = hf(**batch)
        alone = [hf(torch.tensor([d]), labels=torch.tensor([d])) for d in docs]
        torch.testing.assert_close(out.logits, torch.cat([a.logits for a in alone], 1), rtol=1e-5, atol=1e-6)
        targets = sum(len(d) - 1 for d in docs)
        want = sum(a.loss * (len(d) - 1) for a, d in zip(alone, docs)) / targets
        torch.testing.assert_close(out.loss, want, rtol=1e-5, atol=1e-6)
        assert out.cache is None
        with pytest.raises(ValueError, match="use_cache"):
            hf(**batch, use_cache=True)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=3, max_steps=2,
                                          report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True,
                                          remove_unused_columns=False)
    data = [{"input_ids": d} for d in docs * 2]
    trainer = transformers.Trainer(model=hf.train(), args=args, train_dataset=data,
                                   data_collator=transformers.DataCollatorWithFlattening())
    trainer.train()
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in trainer.state.log_history if "loss" in h)


def test_past_key_values_is_taken_as_the_cache():
    """transformers' older keyword for the cache: a decoding step given it continues that cache (it
    was swallowed by **kwargs, and each step started from an empty cache)."""
    hf = H.LinattnForCausalLM.from_linattn(LinearTransformerLM(tiny("gated_deltanet"))).eval()
    x = ids(b=1, n=9)
    with torch.no_grad():
        want = hf(x).logits[:, -1]
        by_name = hf(x[:, :-1], use_cache=True).cache
        got = hf(x[:, -1:], past_key_values=by_name, use_cache=True).logits[:, -1]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        with pytest.raises(ValueError, match="past_key_values"):
            hf(x[:, -1:], cache=by_name, past_key_values=by_name)
