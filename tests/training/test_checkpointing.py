"""linattn.training.checkpointing: resuming (latest, auto, a path), and errors that name the missing or corrupted file."""

from __future__ import annotations

import pytest

from linattn.checkpoint import CheckpointError
from linattn.training import find_checkpoint, train

from .helpers import mqar_config

@pytest.fixture
def finished_run(tmp_path):
    out = tmp_path / "run"
    train(mqar_config(steps=2, out_dir=str(out)), progress=False)
    return out


def test_missing_checkpoint_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing to resume"):
        train(mqar_config(out_dir=str(tmp_path / "empty"), resume="latest"), progress=False)
    with pytest.raises(FileNotFoundError, match="no training checkpoint"):
        train(mqar_config(resume=str(tmp_path / "nowhere")), progress=False)


def test_fresh_run_refuses_a_used_out_dir(finished_run):
    with pytest.raises(ValueError, match="already holds checkpoints"):
        train(mqar_config(out_dir=str(finished_run)), progress=False)


def test_auto_resume_starts_fresh_then_resumes(tmp_path):
    out = str(tmp_path / "run")
    a = train(mqar_config(steps=2, out_dir=out, resume="auto"), progress=False)
    b = train(mqar_config(steps=4, out_dir=out, resume="auto"), progress=False)
    assert (a.start_step, a.step, b.start_step, b.step) == (0, 2, 2, 4)


@pytest.mark.parametrize("damage, error, match", [
    ("flip-weights", CheckpointError, r"corrupted: model\.safetensors does not match the checksum"),
    ("truncate-trainer", CheckpointError, r"corrupted: trainer\.safetensors"),
    ("bad-json", CheckpointError, r"trainer\.json is not valid JSON"),
    ("edit-trainer", CheckpointError, r"corrupted: trainer\.json does not match the checksum it records"),
    ("delete-optimizer", FileNotFoundError, r"incomplete: trainer\.safetensors is missing"),
    ("delete-doc", FileNotFoundError, r"incomplete: trainer\.json is missing"),
])
def test_corrupted_checkpoint_gives_clear_error(finished_run, damage, error, match):
    ckpt = find_checkpoint(finished_run)
    if damage == "flip-weights":
        p = ckpt / "model.safetensors"
        raw = bytearray(p.read_bytes())
        raw[-10] ^= 0xFF
        p.write_bytes(bytes(raw))
    elif damage == "truncate-trainer":
        p = ckpt / "trainer.safetensors"
        p.write_bytes(p.read_bytes()[:100])
    elif damage == "bad-json":
        (ckpt / "trainer.json").write_text('{"format": "linattn-trainer", ')
    elif damage == "edit-trainer":  # valid JSON, one value changed: only a checksum of the document sees it
        p = ckpt / "trainer.json"
        p.write_text(p.read_text().replace('"step": 2,', '"step": 1,'))
    elif damage == "delete-optimizer":
        (ckpt / "trainer.safetensors").unlink()
    else:
        (ckpt / "trainer.json").unlink()
    with pytest.raises(error, match=match):
        train(mqar_config(steps=4, out_dir=str(finished_run), resume="latest"), progress=False)


def test_resume_with_a_different_setup_is_refused(finished_run):
    with pytest.raises(ValueError, match=r"different training setup \(lr: checkpoint 0.003, now 0.001\)"):
        train(mqar_config(steps=4, lr=1e-3, out_dir=str(finished_run), resume="latest"), progress=False)


def test_a_trainer_json_without_a_checksum_still_resumes(finished_run):
    """Checkpoints written before trainer.json recorded its own checksum resume as before."""
    import json

    p = find_checkpoint(finished_run) / "trainer.json"
    doc = json.loads(p.read_text())
    del doc["sha256"]
    p.write_text(json.dumps(doc, indent=2))
    res = train(mqar_config(steps=3, out_dir=str(finished_run), resume="latest"), progress=False)
    assert (res.start_step, res.step) == (2, 3)
