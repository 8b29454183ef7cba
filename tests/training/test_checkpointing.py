"""linattn.training.checkpointing: resuming (latest, auto, a path), and errors that name the missing or corrupted file."""

from __future__ import annotations

import pytest

from linattn.models.checkpoint import CheckpointError
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


def _killed_mid_write(path) -> int:
    """Leaves a real temporary: a process killed (SIGKILL) inside linattn._io.atomic_write(path).
    Returns the dead process's id."""
    import subprocess
    import sys

    code = ("import os, sys\nfrom pathlib import Path\nfrom linattn._io import atomic_write\n"
            "def write(p):\n    p.mkdir()\n    (p / 'model.safetensors').write_bytes(b'half')\n"
            "    print(os.getpid(), flush=True)\n    os.kill(os.getpid(), 9)\n"
            "atomic_write(Path(sys.argv[1]), write)\n")
    r = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True)
    assert r.returncode == -9, r.stderr
    return int(r.stdout)


def _tree(folder):
    """{relative path: bytes or symlink target} of everything in `folder`."""
    import os

    out = {}
    for p in sorted(folder.rglob("*")):
        if p.is_symlink():
            out[str(p.relative_to(folder))] = "-> " + os.readlink(p)
        elif p.is_file():
            out[str(p.relative_to(folder))] = p.read_bytes()
    return out


@pytest.mark.skipif(__import__("os").name != "posix", reason="process ids and SIGKILL are POSIX")
def test_interrupted_saves_are_removed_on_resume_and_complete_checkpoints_never_touched(finished_run, tmp_path):
    import subprocess
    import sys

    root = finished_run / "checkpoints"
    complete = _tree(root)
    dead = _killed_mid_write(root / "step-00000003")
    (root / f".tmp-step-00000003-{dead}-0123abcd").mkdir()  # the name earlier versions used
    (root / ".last-0123abcd").symlink_to("step-00000003")
    (root / "notes.tmp-1-0123abcd").write_text("not a temporary of ours")  # no leading dot: kept
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        in_progress = root / f".step-00000004.tmp-{live.pid}-0123abcd"  # a save that is still running
        in_progress.mkdir()
        stale = sorted(p.name for p in root.iterdir() if p.name.startswith(".") and p != in_progress)
        assert len(stale) == 3
        train(mqar_config(steps=3, keep_checkpoints=5, out_dir=str(finished_run), resume="latest"), progress=False)
        after = {p.name for p in root.iterdir()}
        assert not after & set(stale)
        assert in_progress.name in after and "notes.tmp-1-0123abcd" in after
        now = _tree(root)
        for name, content in complete.items():  # the earlier complete checkpoints are as they were
            if not name.startswith("last"):
                assert now[name] == content, name
        assert now["last"] == "-> step-00000003"
    finally:
        live.kill()
        live.wait()


def test_the_next_save_removes_interrupted_saves(tmp_path):
    from linattn.training.checkpointing import remove_interrupted_saves

    root = tmp_path / "checkpoints"
    root.mkdir()
    dead = _killed_mid_write(root / "step-00000007")
    assert [p.name for p in root.iterdir()][0].startswith(f".step-00000007.tmp-{dead}-")
    (root / "step-00000006").mkdir()
    (root / "step-00000006" / "trainer.json").write_text("{}")
    assert [p.name for p in remove_interrupted_saves(root)][0].startswith(".step-00000007.tmp-")
    assert sorted(p.name for p in root.rglob("*")) == ["step-00000006", "trainer.json"]


def test_a_pointer_file_that_is_not_text_names_itself(finished_run):
    """Where there are no symlinks `last` is a text file; a corrupted one is named, not a decode traceback."""
    last = finished_run / "checkpoints" / "last"
    last.unlink()
    last.write_bytes(b"step-\xff\xfe")
    with pytest.raises(CheckpointError, match=rf"{last} is corrupted: a pointer file"):
        find_checkpoint(finished_run)
