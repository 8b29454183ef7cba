"""linattn.training.metrics: the metrics log (resume trimming, non-finite values, torn lines) and the plot."""

from __future__ import annotations

import json

from linattn.training.metrics import MetricsLog, plot_metrics, read_metrics

from ..conftest import check_png


def test_log_resumes_at_the_checkpoint_and_writes_strict_json(tmp_path):
    path = tmp_path / "metrics.jsonl"
    log = MetricsLog(path, None)
    for step in range(1, 6):
        log.write({"step": step, "split": "train", "loss": 1.0 / step})
    log.write({"step": 6, "split": "train", "loss": float("nan"), "event": "diverged"})
    assert json.loads(path.read_text().splitlines()[-1])["loss"] is None  # NaN is not JSON
    with open(path, "a") as f:
        f.write('{"step": 7, "spl')  # a torn last line after a crash
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3, 4, 5, 6]
    with open(path, "ab") as f:  # torn inside a multi-byte character
        f.write(b'\n{"step": 7, "note": "\xc3')
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3, 4, 5, 6]
    MetricsLog(path, 3)  # resuming from step 3 drops what came after it
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3]
    MetricsLog(None, None).write({"step": 1})  # no file: nothing happens
    assert read_metrics(tmp_path / "missing.jsonl") == []


def test_plot(tmp_path):
    records = [{"step": s, "split": "train", "loss": 3.0 / s} for s in range(1, 9)]
    records += [{"step": 4, "split": "validation", "loss": 1.0, "accuracy": 0.5},
                {"step": 8, "split": "validation", "loss": 0.5, "accuracy": 0.7}]
    check_png(plot_metrics(records, tmp_path / "a.png"))
    check_png(plot_metrics(records, tmp_path / "b.png", bits=True, title="bytes"))
