"""The report of one linearization (linearize.{json,md,png}) and its console table."""

from __future__ import annotations

from pathlib import Path

from ..report import fmt_bytes, machine_info, make_table, timestamp, write_json

__all__ = ["render_markdown", "report_table", "write_report"]


def _num(x, fmt="{:.3f}") -> str:
    return "—" if x is None else fmt.format(x)


def report_table(report: dict):
    """A rich table: one row per model (teacher, naive swap, stage 1, stage 2)."""
    rows = [[r["model"], _num(r["bpb"]), _num(r["recall"]), _num(r.get("recall_gain"), "{:+.3f}"),
             _num(r["recovered"], "{:.0%}")] for r in report["rows"]]
    return make_table(f"linearize ({report['recipe']['name']}): teacher vs the linearized model",
                      ["model", "bpb ↓", "copy probe ↑", "gain from context", "gap recovered"], rows,
                      caption="gap recovered: (naive − stage) / (naive − teacher) of the bpb")


def render_markdown(report: dict) -> str:
    r, c = report["recipe"], report["config"]
    lines = [f"# linattn linearize — recipe `{r['name']}` ({r['cite']})", "",
             f"Teacher `{c['teacher']}`; the student's linearized layers are kind `{r['kind']}`; stage 1 "
             f"(attention transfer) {'ran' if r['transfer'] else 'is not part of this recipe'}; stage 2: "
             f"{r['finetune']} fine-tuning. seq_len {c['seq_len']}, batch {c['batch_size']}; tokens: "
             + ", ".join(f"{k} {v:,}" for k, v in report["tokens"].items()) + f"; {report['wall_s']:.0f} s.", "",
             "| model | bpb ↓ | copy probe ↑ | gain from context | gap recovered |", "|---|---:|---:|---:|---:|"]
    for row in report["rows"]:
        lines.append(f"| {row['model']} | {_num(row['bpb'])} | {_num(row['recall'])} | "
                     f"{_num(row.get('recall_gain'), '{:+.3f}')} | {_num(row['recovered'], '{:.0%}')} |")
    lines += ["", "Copy probe: held-out 192-byte snippets written twice, accuracy on the second copy; the gain is that "
              "less the accuracy on the first copy (what the context adds).", ""]
    if report.get("decode"):
        lines += ["| context | teacher ms/token | teacher cache | linearized ms/token | linearized cache |",
                  "|---:|---:|---:|---:|---:|"]
        t, s = report["decode"]["teacher"], report["decode"]["stage 2"]
        for a, b in zip(t, s):
            lines.append(f"| {a['context']:,} | {_num(a['ms_per_token'], '{:.2f}')} | {fmt_bytes(a['cache_bytes'])} | "
                         f"{_num(b['ms_per_token'], '{:.2f}')} | {fmt_bytes(b['cache_bytes'])} |")
        lines.append("")
    m = report.get("machine", {})
    lines.append(f"Machine: {m.get('cpu', '?')}, torch {m.get('torch', '?')}, {m.get('torch_threads', '?')} thread(s); "
                 f"{report.get('timestamp', '')}.")
    return "\n".join(lines) + "\n"


def _plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = report.get("curves", {})
    fig, axes = plt.subplots(1, max(1, len(curves)), figsize=(5.5 * max(1, len(curves)), 4), squeeze=False)
    for ax, (stage, rows) in zip(axes[0], curves.items()):
        pts = [(r["step"], r["loss"]) for r in rows if "loss" in r and "step" in r and r.get("split", "train") == "train"]
        if pts:
            ax.plot(*zip(*pts))
        ax.set_title({"stage1": "stage 1: attention transfer (MSE)", "stage2": "stage 2: fine-tuning (nats/byte)"}
                     .get(stage, stage))
        ax.set_xlabel("step")
        ax.set_yscale("log" if stage == "stage1" else "linear")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(report: dict, out) -> None:
    """out/linearize.json, linearize.md and linearize.png (the stages' loss curves)."""
    out = Path(out)
    report.setdefault("machine", machine_info(report["config"].get("device", "cpu")))
    report.setdefault("timestamp", timestamp())
    write_json(out / "linearize.json", report)
    (out / "linearize.md").write_text(render_markdown(report), encoding="utf-8")
    _plot(report, out / "linearize.png")
