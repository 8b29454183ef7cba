"""`linattn train` (linattn.cli.train): config file and flags, resume, errors, Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from linattn.cli import main as cli_main
from linattn.training import EXIT_INTERRUPTED, find_checkpoint, read_metrics

def test_cli_train_config_flags_and_resume(tmp_path, corpus, capsys):
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'task = "bytes"\ncorpus = ["{corpus}"]\nseq_len = 16\nbatch_size = 4\nsteps = 3\n'
                   'warmup_steps = 1\neval_batches = 1\n[model]\nd_model = 16\nn_layers = 1\nn_heads = 2\n')
    out = tmp_path / "run"
    rc = cli_main(["train", "--config", str(cfg), "--out", str(out), "--steps", "4", "--set", "model.dropout=0.1",
                   "--quiet"])
    assert rc == 0
    saved = json.loads((out / "train_config.json").read_text())
    assert saved["steps"] == 4 and saved["model"]["dropout"] == 0.1 and saved["seq_len"] == 16
    # resume without --config: the checkpoint's config, extended by --steps
    assert cli_main(["train", "--out", str(out), "--resume", "--steps", "6", "--quiet"]) == 0
    assert find_checkpoint(out).name == "step-00000006"
    # errors are one clear line and exit status 2
    assert cli_main(["train", "--out", str(tmp_path / "none"), "--resume", "--quiet"]) == 2
    assert "nothing to resume" in capsys.readouterr().err
    assert cli_main(["train", "--config", str(cfg), "--dtype", "float16", "--quiet", "--out", str(tmp_path / "x")]) == 2
    assert "bfloat16" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_ctrl_c_saves_and_exits_130(tmp_path, corpus):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "linattn.cli", "train", "--corpus", corpus, "--seq-len", "16", "--batch-size", "4",
           "--steps", "100000", "--d-model", "16", "--n-layers", "1", "--n-heads", "2", "--log-interval", "1",
           "--eval-interval", "0", "--out", str(out), "--quiet"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            if len(read_metrics(out / "metrics.jsonl")) >= 3:
                break
            time.sleep(0.2)
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == EXIT_INTERRUPTED, err
    assert "interrupted at step" in err and "checkpoint saved" in err
    doc = json.loads((find_checkpoint(out) / "trainer.json").read_text())
    assert doc["step"] >= 3
