"""linattn.models.checkpoint: config.json + model.safetensors, no pickle, atomic saves, clear mismatch errors."""

import json
import pickle

import pytest
import safetensors.torch
import torch
from safetensors.torch import load_file, save_file

from linattn.models import checkpoint
from linattn.models.checkpoint import CheckpointError
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
    import torch._dynamo  # noqa: F401  (subclasses pickle.Unpickler when imported; the meta-device check imports it)

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


# ---- the config and the file are checked before anything is built (issue 13: items 4, 7 and 10)


def _edit_config(directory, **fields):
    doc = json.loads((directory / "config.json").read_text())
    doc["config"].update(fields)
    (directory / "config.json").write_text(json.dumps(doc))


@pytest.fixture
def built_blocks(monkeypatch):
    """The device of the first parameter of every Block the models build (meta: a shape-only build)."""
    import linattn.models.lm as models

    devices = []
    real = models.Block

    def counting(*a, **k):
        block = real(*a, **k)
        devices.append(next(block.parameters()).device.type)
        if len(devices) > 1000:
            raise AssertionError("more than 1000 blocks built")
        return block

    monkeypatch.setattr(models, "Block", counting)
    return devices


def test_a_config_asking_for_millions_of_layers_is_refused_before_building(tmp_path, built_blocks):
    LinearTransformerLM(cfg()).save_pretrained(tmp_path)
    built_blocks.clear()
    _edit_config(tmp_path, n_layers=10_000_000)
    with pytest.raises(CheckpointError, match=r"config\.json describes 10000000 layers but .*model\.safetensors holds 2"):
        LinearTransformerLM.from_pretrained(tmp_path)
    assert built_blocks == []


@pytest.mark.parametrize("fields, tensor", [
    (dict(d_ff=10**9), r"'blocks\.0\.ffn\.up\.weight' has shape \(96, 32\) but the model expects \(2000000000, 32\)"),
    (dict(vocab_size=10**9), r"'tok_emb\.weight' has shape \(40, 32\) but the model expects \(1000000000, 32\)"),
    (dict(feature_map_options={"num_features": 10**9}),
     r"'blocks\.0\.attn\.feature_map\.omega' has shape \(12, 8\) but the model expects \(1000000000, 8\)"),
])
def test_oversized_dims_are_refused_from_the_header_without_allocating(tmp_path, built_blocks, fields, tensor):
    """Each of these asks for 32-128 GB; the refusal names the file and the tensor, and only meta
    (shape-only) blocks were built."""
    LinearTransformerLM(cfg()).save_pretrained(tmp_path)
    built_blocks.clear()
    _edit_config(tmp_path, **fields)
    with pytest.raises(CheckpointError, match=rf"model\.safetensors: .*{tensor}"):
        LinearTransformerLM.from_pretrained(tmp_path)
    assert set(built_blocks) <= {"meta"}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64, torch.float16])
def test_from_pretrained_keeps_the_saved_dtype(tmp_path, dtype):
    model = _perturbed(LinearTransformerLM(cfg())).to(dtype)
    model.save_pretrained(tmp_path)
    back = LinearTransformerLM.from_pretrained(tmp_path)
    assert {p.dtype for p in back.parameters()} == {dtype}
    assert back.blocks[0].attn.feature_map.draws.dtype == torch.long  # integer buffers stay integer
    for (k, a), b in zip(model.state_dict().items(), back.state_dict().values()):
        assert a.dtype == b.dtype and torch.equal(a, b), k


def test_an_asked_dtype_casts_the_floating_tensors(tmp_path):
    model = _perturbed(LinearTransformerLM(cfg())).to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    back = LinearTransformerLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert {p.dtype for p in back.parameters()} == {torch.float32}
    assert back.blocks[0].attn.feature_map.draws.dtype == torch.long
    torch.testing.assert_close(back.tok_emb.weight, model.tok_emb.weight.float(), rtol=0, atol=0)
    with pytest.raises(TypeError, match="dtype must be None or one of"):
        LinearTransformerLM.from_pretrained(tmp_path, dtype=torch.int32)


@pytest.mark.parametrize("replacement, castable", [
    (lambda t: t.half(), True),
    (lambda t: (t * 100).long(), False),
])
def test_a_tensor_of_another_dtype_is_not_cast_silently(tmp_path, replacement, castable):
    LinearTransformerLM(cfg()).save_pretrained(tmp_path)
    path = str(tmp_path / "model.safetensors")
    tensors = load_file(path)
    tensors["norm.weight"] = replacement(tensors["norm.weight"])
    save_file(tensors, path, metadata={"format": "pt"})
    doc = json.loads((tmp_path / "config.json").read_text())
    doc.pop("weights_sha256", None)  # the file was changed on purpose
    (tmp_path / "config.json").write_text(json.dumps(doc))
    if castable:  # two floating dtypes in one file: which one the model takes must be asked for
        with pytest.raises(CheckpointError, match=r"model\.safetensors holds floating tensors of several dtypes.*"
                                                  r"float16 \('norm\.weight'"):
            LinearTransformerLM.from_pretrained(tmp_path)
        back = LinearTransformerLM.from_pretrained(tmp_path, dtype=torch.float32)
        assert back.norm.weight.dtype == torch.float32
    else:  # an integer tensor for a floating parameter is refused even when a dtype is asked for
        for dtype in (None, torch.float32):
            with pytest.raises(CheckpointError, match=r"'norm\.weight' is int64 but the model's is float32"):
                LinearTransformerLM.from_pretrained(tmp_path, dtype=dtype)


def test_load_weights_into_a_model_refuses_another_dtype(tmp_path):
    """The training resume path (load_weights into a built model): an fp16 file into an fp32 model."""
    LinearTransformerLM(cfg()).half().save_pretrained(tmp_path)
    model = LinearTransformerLM(cfg())
    with pytest.raises(CheckpointError, match=r"tensor dtype mismatch.*is float16 but the model's is float32"):
        checkpoint.load_weights(tmp_path, model)


def test_a_flipped_byte_in_the_weights_is_caught_by_the_checksum(tmp_path):
    LinearTransformerLM(cfg()).save_pretrained(tmp_path)
    doc = json.loads((tmp_path / "config.json").read_text())
    assert len(doc["weights_sha256"]) == 64
    path = tmp_path / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x10  # inside the last tensor's data: the header stays valid
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"model\.safetensors does not match the SHA-256 recorded in .*config\.json"):
        LinearTransformerLM.from_pretrained(tmp_path)


def test_a_checkpoint_saved_before_the_checksum_still_loads(tmp_path):
    model = _perturbed(LinearTransformerLM(cfg()))
    model.save_pretrained(tmp_path)
    doc = json.loads((tmp_path / "config.json").read_text())
    del doc["weights_sha256"]
    (tmp_path / "config.json").write_text(json.dumps(doc))
    back = LinearTransformerLM.from_pretrained(tmp_path)
    assert torch.equal(back.tok_emb.weight, model.tok_emb.weight)


@pytest.mark.parametrize("cut", [1, 100, 10_000])
def test_a_truncated_weights_file_names_the_file(tmp_path, cut):
    LinearTransformerLM(cfg()).save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-cut])
    with pytest.raises(CheckpointError, match=rf"{path}.* (is truncated|truncated)"):
        LinearTransformerLM.from_pretrained(tmp_path)


def test_header_describing_other_bytes_is_refused(tmp_path):
    """A header whose tensors do not tile the data (gaps, trailing bytes, wrong sizes)."""
    LinearTransformerLM(cfg()).save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    path.write_bytes(path.read_bytes() + b"\0" * 8)
    with pytest.raises(CheckpointError, match="has trailing bytes"):
        checkpoint.read_header(path)
    header = json.dumps({"a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 12]}}).encode()
    path.write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 12)
    with pytest.raises(CheckpointError, match=r"tensor 'a' of dtype F32 and shape \(2, 2\) needs 16 bytes"):
        checkpoint.read_header(path)


def test_save_removes_what_a_killed_save_left(tmp_path):
    import os
    import subprocess
    import sys

    LinearTransformerLM(cfg()).save_pretrained(tmp_path)
    code = ("import os, sys\nfrom pathlib import Path\nfrom linattn._io import atomic_write\n"
            "def write(p):\n    p.write_bytes(b'half')\n    os.kill(os.getpid(), 9)\n"
            "atomic_write(Path(sys.argv[1]) / 'model.safetensors', write)\n")
    assert subprocess.run([sys.executable, "-c", code, str(tmp_path)]).returncode == -9
    assert len(os.listdir(tmp_path)) == 3
    model = _perturbed(LinearTransformerLM(cfg()))
    model.save_pretrained(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]
    assert torch.equal(LinearTransformerLM.from_pretrained(tmp_path).tok_emb.weight, model.tok_emb.weight)
