"""linattn.checkpoint: config.json + model.safetensors, no pickle, atomic saves, clear mismatch errors."""

import json
import pickle

import pytest
import safetensors.torch
import torch
from safetensors.torch import load_file, save_file

from linattn import checkpoint
from linattn.checkpoint import CheckpointError
from linattn.models import load_pretrained
from linattn.models import LinearTransformerEncoder, LinearTransformerLM, ModelConfig


@pytest.fixture(autouse=True)
def _single_thread(one_thread):
    yield


def cfg(**kw):
    base = dict(vocab_size=40, d_model=32, n_layers=2, n_heads=4, d_ff=48, max_len=64,
                attention=["linear", "softmax"], feature_map="favor", feature_map_options={"num_features": 12})
    base.update(kw)
    return ModelConfig(**base)


def _perturbed(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
        for blk in model.blocks:  # a redrawn FAVOR+ projection must survive the round trip
            fm = getattr(blk.attn, "feature_map", None)
            if fm is not None and hasattr(fm, "redraw"):
                fm.redraw(torch.Generator().manual_seed(99 + seed))
    return model


def _no_pickle(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("pickle used on the load path")

    monkeypatch.setattr(torch, "load", boom)
    monkeypatch.setattr(pickle, "load", boom)
    monkeypatch.setattr(pickle, "loads", boom)
    monkeypatch.setattr(pickle, "Unpickler", boom)


@pytest.mark.parametrize("cls, kw", [
    (LinearTransformerLM, {}),
    (LinearTransformerLM, dict(tie_embeddings=False, positions="learned")),
    (LinearTransformerEncoder, dict(num_classes=3, feature_map="hedgehog", feature_map_options={})),
])
def test_round_trip_without_pickle(tmp_path, monkeypatch, cls, kw):
    model = _perturbed(cls(cfg(**kw))).eval()
    model.save_pretrained(tmp_path / "ck")
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["config.json", "model.safetensors"]
    _no_pickle(monkeypatch)
    back = cls.from_pretrained(tmp_path / "ck").eval()
    assert back.config == model.config
    for (k, a), b in zip(model.state_dict().items(), back.state_dict().values()):
        assert torch.equal(a, b), k
    ids = torch.randint(0, 40, (2, 9))
    out_a, out_b = model(ids), back(ids)
    if cls is LinearTransformerLM:
        out_a, out_b = out_a[0], out_b[0]
        assert (back.lm_head.weight is back.tok_emb.weight) == model.config.tie_embeddings
    torch.testing.assert_close(out_b, out_a, rtol=0, atol=0)
    # load_pretrained without a class picks the recorded architecture
    assert type(load_pretrained(tmp_path / "ck")) is cls


def test_files_hold_favor_projections_and_config(tmp_path):
    model = _perturbed(LinearTransformerLM(cfg()))
    model.save_pretrained(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    torch.testing.assert_close(tensors["blocks.0.attn.feature_map.omega"], model.blocks[0].attn.feature_map.omega,
                               rtol=0, atol=0)
    assert "lm_head.weight" not in tensors  # tied: stored once
    doc = json.loads((tmp_path / "config.json").read_text())
    assert doc["architecture"] == "LinearTransformerLM"
    assert ModelConfig.from_dict(doc["config"]) == model.config


def test_interrupted_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    old = _perturbed(LinearTransformerLM(cfg()), seed=1)
    old.save_pretrained(tmp_path)
    new = _perturbed(LinearTransformerLM(cfg()), seed=2)

    def dies_midway(tensors, path, metadata=None):
        with open(path, "wb") as f:
            f.write(b"\x10\x00\x00\x00partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint, "save_file", dies_midway)
    with pytest.raises(KeyboardInterrupt):
        new.save_pretrained(tmp_path)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]  # no temporaries
    back = LinearTransformerLM.from_pretrained(tmp_path)
    for (k, a), b in zip(old.state_dict().items(), back.state_dict().values()):
        assert torch.equal(a, b), k


def test_config_and_weights_from_different_saves(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    LinearTransformerLM(cfg()).save_pretrained(a)
    LinearTransformerLM(cfg(seed=3)).save_pretrained(b)
    (a / "config.json").write_text((b / "config.json").read_text())
    with pytest.raises(CheckpointError, match="different saves"):
        LinearTransformerLM.from_pretrained(a)


def test_shape_mismatch_names_the_tensor(tmp_path):
    LinearTransformerLM(cfg()).save_pretrained(tmp_path)
    doc = json.loads((tmp_path / "config.json").read_text())
    doc["config"]["d_ff"] = 64
    doc.pop("checkpoint_id")
    (tmp_path / "config.json").write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match=r"blocks\.0\.ffn\.up\.weight.*\(96, 32\).*\(128, 32\)"):
        LinearTransformerLM.from_pretrained(tmp_path)


def test_missing_and_unexpected_tensors_are_named(tmp_path):
    LinearTransformerLM(cfg()).save_pretrained(tmp_path)
    path = str(tmp_path / "model.safetensors")
    tensors = load_file(path)
    del tensors["norm.weight"]
    tensors["extra.bias"] = torch.zeros(3)
    save_file(tensors, path)
    with pytest.raises(CheckpointError, match=r"missing tensors \['norm.weight'\].*unexpected tensors \['extra.bias'\]"):
        LinearTransformerLM.from_pretrained(tmp_path)


def test_config_mismatch_names_the_fields(tmp_path):
    LinearTransformerLM(cfg()).save_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match=r"d_ff: expected 96, checkpoint has 48.*n_heads: expected 8"):
        LinearTransformerLM.from_pretrained(tmp_path, config=cfg(d_ff=96, n_heads=8))
    LinearTransformerLM.from_pretrained(tmp_path, config=cfg())  # the same config loads


def test_wrong_architecture_and_bad_files(tmp_path):
    LinearTransformerLM(cfg()).save_pretrained(tmp_path / "lm")
    with pytest.raises(CheckpointError, match="holds a LinearTransformerLM, not a LinearTransformerEncoder"):
        LinearTransformerEncoder.from_pretrained(tmp_path / "lm")
    with pytest.raises(FileNotFoundError, match="config.json"):
        LinearTransformerLM.from_pretrained(tmp_path / "nothing")
    doc = json.loads((tmp_path / "lm" / "config.json").read_text())
    doc["config"]["norm"] = "batchnorm"
    (tmp_path / "lm" / "config.json").write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="norm"):
        LinearTransformerLM.from_pretrained(tmp_path / "lm")
    (tmp_path / "lm" / "config.json").write_text("{oops")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        LinearTransformerLM.from_pretrained(tmp_path / "lm")


def test_overwrite_replaces_checkpoint(tmp_path):
    a = _perturbed(LinearTransformerLM(cfg()), seed=4)
    b = _perturbed(LinearTransformerLM(cfg()), seed=5)
    a.save_pretrained(tmp_path)
    b.save_pretrained(tmp_path)
    back = LinearTransformerLM.from_pretrained(tmp_path)
    assert torch.equal(back.tok_emb.weight, b.tok_emb.weight)
    assert safetensors.torch.load_file(str(tmp_path / "model.safetensors")).keys() == {
        k for k in b.state_dict() if k != "lm_head.weight"}
