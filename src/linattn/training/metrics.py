"""The metrics of a run: `metrics.jsonl` (one JSON record per logged step or evaluation) and its
loss plot.

Train records: {"step", "split": "train", "loss", "lr", "grad_norm", "tokens", "tokens_per_s",
"elapsed_s"}; evaluation records: {"step", "split": "validation", "loss", "accuracy", ...}; a run
that diverged ends with {"step", "split": "train", "loss": null, "event": "diverged"}.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

METRICS = "metrics.jsonl"
LOSS_PNG = "loss.png"


def read_metrics(path) -> list[dict]:
    """The records of a metrics.jsonl file (train records have "loss", eval records "split")."""
    out = []
    p = Path(path)
    if not p.is_file():
        return out
    for raw in p.read_bytes().splitlines():
        line = raw.strip()
        if line:
            try:
                out.append(json.loads(line.decode("utf-8")))
            except (UnicodeDecodeError, json.JSONDecodeError):
                continue  # a torn last line after a crash (it may end inside a multi-byte character)
    return out


def plot_metrics(records: list[dict], path, *, title: str = "training", bits: bool = False) -> Path:
    """Loss curve PNG: training loss per logged step and validation loss (and accuracy) per eval.
    bits: plot in bits (÷ ln 2), e.g. bits per byte for byte-level LM."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    scale = 1 / math.log(2) if bits else 1.0
    train = [(r["step"], r["loss"] * scale) for r in records if r.get("split") == "train" and r.get("loss") is not None]
    evals = [r for r in records if r.get("split") == "validation"]
    val = [(r["step"], r["loss"] * scale) for r in evals if r.get("loss") is not None]
    acc = [(r["step"], r["accuracy"]) for r in evals if r.get("accuracy") is not None]
    fig = Figure(figsize=(7.0, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    if train:
        ax.plot(*zip(*train), label="train", linewidth=1)
    if val:
        ax.plot(*zip(*val), marker="o", markersize=3, label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("bits per byte" if bits else "loss (nats)")
    ax.grid(True, alpha=0.3)
    if acc and not bits:
        ax2 = ax.twinx()
        ax2.plot(*zip(*acc), color="tab:green", linestyle="--", marker=".", label="validation accuracy")
        ax2.set_ylabel("accuracy")
        ax2.set_ylim(0, 1.02)
        ax2.legend(loc="upper center", fontsize=8)
    if train or val:
        ax.legend(loc="upper right", fontsize=8)
    ax.set_title(title)
    path = Path(path)
    fig.savefig(path, dpi=110)
    return path


class MetricsLog:
    """Appends records to a metrics.jsonl (path None: writes nothing). A resumed run keeps the
    history up to its checkpoint's step and drops what a crashed run logged after it."""

    def __init__(self, path: Path | None, resume_step: int | None):
        self.path = path
        if path is None:
            return
        if resume_step is None:
            path.write_text("", encoding="utf-8")
        else:
            keep = [r for r in read_metrics(path) if r.get("step", 0) <= resume_step]
            path.write_text("".join(json.dumps(r) + "\n" for r in keep), encoding="utf-8")

    def write(self, record: dict) -> None:
        if self.path is None:
            return
        record = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
