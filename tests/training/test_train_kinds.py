"""`linattn train` with the gated and delta-rule kinds: the example config trains (loss falls), its
checkpoint loads and decodes; a sequence-parallel config of these kinds is accepted."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from linattn.cli import main as cli_main
from linattn.models import LinearTransformerLM
from linattn.training import TrainConfig, find_checkpoint, read_metrics

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "train_bytes_gated_deltanet.toml"


def test_example_config_trains_and_its_checkpoint_decodes(tmp_path, corpus):
    out = tmp_path / "run"
    rc = cli_main(["train", "--config", str(CONFIG), "--out", str(out), "--corpus", corpus, "--seq-len", "32",
                   "--batch-size", "8", "--steps", "30", "--warmup-steps", "3", "--lr", "1e-2", "--d-model", "32",
                   "--n-heads", "2", "--eval-batches", "1", "--eval-interval", "0", "--log-interval", "1", "--quiet"])
    assert rc == 0
    losses = [r["loss"] for r in read_metrics(out / "metrics.jsonl") if r["split"] == "train"]
    assert len(losses) == 30 and sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 1.0, losses
    model = LinearTransformerLM.from_pretrained(find_checkpoint(out))
    assert model.config.layer_kinds == ["gated_deltanet"] * 3 + ["softmax"]
    ids = torch.tensor([list(b"def f(x):")])
    with torch.no_grad():
        full, _ = model(ids)
        cache = model.new_cache()
        parts = [model(ids[:, :4], cache=cache)[0]] + [model(ids[:, t:t + 1], cache=cache)[0] for t in range(4, 9)]
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=0, atol=1e-4 * float(full.abs().max()))
    assert len(model.generate(ids, 5, temperature=0)[0]) == 5


def test_sequence_parallel_with_a_delta_kind_and_short_convolutions_is_accepted():
    """Sequence parallelism runs every kind now (the 2-process run: tests/training/test_processes.py)."""
    cfg = TrainConfig(task="bytes", sequence_parallel=2, model={"attention": "gated_deltanet,softmax"})
    assert cfg.sequence_parallel == 2 and cfg.model_config().short_conv_for("gated_deltanet") == 4
