"""The recall preset's outputs: table rows, markdown, the plot (recall vs state size, training curves)
and the files recall.json (records in the schema other tools read), recall-runs.json (the whole
report), recall.md and recall.png."""

from __future__ import annotations

from pathlib import Path

from .recall import LABELS, MIN_PAIRS, RECALL_KINDS

__all__ = ["RECORD_KEYS", "plot_recall", "recall_json", "render_recall_markdown", "recall_table_rows",
           "write_recall_report"]

#: the keys of a record of recall.json, in order
RECORD_KEYS = ("kind", "seq_len", "n_pairs", "lr", "state_size", "accuracy")


def recall_json(report: dict) -> dict:
    """recall.json: {"records": [{kind, seq_len, n_pairs, lr, state_size, accuracy}] (one per run, every
    lr), "wall_s", "machine"}."""
    return {"records": [{k: r[k] for k in RECORD_KEYS} for r in report["records"]],
            "wall_s": report["wall_s"], "machine": report["machine"]}


def _settings(report: dict) -> list[tuple[int, int]]:
    return sorted({(r["seq_len"], r["n_pairs"]) for r in report["records"]})


def _kinds(report: dict) -> list[str]:
    present = {r["kind"] for r in report["records"]}
    return [k for k in RECALL_KINDS if k in present]


def _best(report: dict, setting, kind) -> dict | None:
    for r in report["best"]:
        if (r["seq_len"], r["n_pairs"], r["kind"]) == (*setting, kind):
            return r
    return None


def _acc(x) -> str:
    return "—" if x is None else f"{x:.3f}"


def _cpu_line(report: dict) -> str:
    """The runs' CPU time and what it means for two quiet cores (records of older runs lack it)."""
    cpu = [r.get("cpu_s") for r in report["records"]]
    if not cpu or any(c is None for c in cpu):
        return ""
    total = sum(cpu)
    return (f" The runs took {total:.0f} CPU s in total: about {total / 120:.0f} min of wall time on two quiet "
            f"cores with --jobs 2.")


def recall_table_rows(report: dict) -> tuple[list[str], list[list[str]]]:
    """Header and rows: per kind, per setting the best accuracy, its lr and its steps to 99% (— if
    never), and the state size (floats per layer)."""
    settings = _settings(report)
    header = ["attention"]
    for n, p in settings:
        header += [f"MQAR ({n}, {p}) acc ↑", "lr", "steps to 99%", "state (floats/layer)"]
    rows = []
    for k in _kinds(report):
        row = [LABELS[k]]
        for s in settings:
            b = _best(report, s, k)
            if b is None:
                row += ["—"] * 4
                continue
            row += [_acc(b["accuracy"]), f"{b['lr']:g}",
                    str(b["steps_to_stop"]) if b["steps_to_stop"] is not None else "—", f"{b['state_size']:,}"]
        rows.append(row)
    return header, rows


def render_recall_markdown(report: dict) -> str:
    """The report as markdown: setup, the table, the criteria, every run, the notes, the machine."""
    header, rows = recall_table_rows(report)
    m = report["machine"]
    lines = [f"# linattn eval — preset `{report['preset']}` (associative recall, MQAR)", "",
             f"{report['description']}.", "",
             f"Wall time {report['wall_s']:.0f} s ({report['wall_s'] / 60:.1f} min) with {m.get('jobs')} process(es) "
             f"× {m.get('threads_per_job')} thread(s) on {m.get('cpu')} ({m.get('cores')} cores; torch {m.get('torch')}, "
             f"device {m.get('device')}); {report['timestamp']}." + _cpu_line(report), "",
             "Best run per kind over the lr sweep (accuracy at the query positions on fixed validation examples; "
             "steps to 99%: the validation that stopped the run).", "",
             "| " + " | ".join(header) + " |", "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    lines += ["", f"## Criteria (issue 16; settings with at least {MIN_PAIRS} pairs)", ""]
    if not report["criteria"]:
        lines.append("- no setting with enough pairs was run")
    for c in report["criteria"]:
        verdict = {True: "holds", False: "DOES NOT HOLD", None: "not run"}[c["holds"]]
        lines.append(f"- MQAR ({c['setting'][0]}, {c['setting'][1]}): {c['check']} — **{verdict}** ({c['detail']})")
    lines += ["", "## Every run", "", "| kind | setting | lr | accuracy | steps | steps to 99% | status | s |",
              "|---|---|---:|---:|---:|---:|---|---:|"]
    for r in report["records"]:
        lines.append(f"| {LABELS[r['kind']]} | ({r['seq_len']}, {r['n_pairs']}) | {r['lr']:g} | {_acc(r['accuracy'])} | "
                     f"{r['steps']} | {r['steps_to_stop'] if r['steps_to_stop'] is not None else '—'} | {r['status']} | "
                     f"{r['elapsed_s']:.0f} |")
    lines += ["", "## Notes", ""]
    lines += [f"- {n}" for n in report["notes"]]
    lines += [f"- {s}" for s in report["skipped"]]
    lines += [f"- run {LABELS[r['kind']]} lr {r['lr']:g}: {r['status']} — {r['message']}"
              for r in report["records"] if r["status"] != "completed"]
    lines += [f"- model: {report['model']}; per-kind changes: {report['kind_options']}",
              f"- lr sweep {report['lrs']}; at most {report['steps']} steps; early stop at {report['stop_accuracy']}",
              "- state size: floats of the decoding cache per layer (mean over layers) after one sequence of "
              "seq_len tokens, measured on the model: the recurrent state (softmax: its KV cache at that length) "
              "plus the short convolutions' tails"]
    return "\n".join(lines) + "\n"


def plot_recall(report: dict, path) -> Path:
    """Per setting two panels: best accuracy against state size (log x), and the validation accuracy
    curves of the best runs."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    settings = _settings(report) or [(0, 0)]
    kinds = _kinds(report)
    fig = Figure(figsize=(13.5, 4.6 * len(settings)), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(settings), 2, squeeze=False)
    palette = [f"C{i}" for i in range(10)] + ["black", "olive"]  # 12 distinct colours for the 12 kinds
    colours = {k: palette[i % len(palette)] for i, k in enumerate(kinds)}
    markers = {k: "os^vD<>ph*Xd"[i % 12] for i, k in enumerate(kinds)}
    for (ax_s, ax_c), s in zip(axes, settings):
        for k in kinds:
            b = _best(report, s, k)
            if b is None:
                continue
            acc = b["accuracy"] if b["accuracy"] is not None else 0.0
            ax_s.scatter([b["state_size"]], [acc], color=colours[k], marker=markers[k], s=50, label=LABELS[k])
            if b["curve"]:
                steps, accs = zip(*b["curve"])
                ax_c.plot(steps, accs, color=colours[k], marker=markers[k], markersize=3,
                          label=f"{LABELS[k]} (lr {b['lr']:g})")
        ax_s.set_xscale("log")
        ax_s.set_xlabel("state size (floats per layer; softmax: KV cache at seq_len)")
        ax_s.set_ylabel("accuracy at the query positions")
        ax_s.set_ylim(-0.02, 1.02)
        ax_s.set_title(f"MQAR {s}: recall vs state size (best lr)", fontsize=10)
        ax_s.grid(True, which="both", alpha=0.3)
        ax_s.legend(fontsize=7, loc="best")
        ax_c.set_xlabel("step")
        ax_c.set_ylabel("validation accuracy")
        ax_c.set_ylim(-0.02, 1.02)
        ax_c.set_title(f"MQAR {s}: training curves (best lr per kind)", fontsize=10)
        ax_c.grid(True, alpha=0.3)
        ax_c.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.suptitle(f"linattn eval --preset {report['preset']} ({report['wall_s'] / 60:.0f} min, "
                 f"{report['machine'].get('cpu')})", fontsize=10)
    path = Path(path)
    fig.savefig(path, dpi=100)
    return path


def write_recall_report(report: dict, out_dir) -> dict:
    """Writes recall.json, recall-runs.json, recall.md and recall.png into out_dir; returns their paths."""
    from ..report import write_json

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "recall.json", "runs": out / "recall-runs.json", "markdown": out / "recall.md",
             "png": out / "recall.png"}
    write_json(paths["json"], recall_json(report))
    write_json(paths["runs"], report)
    paths["markdown"].write_text(render_recall_markdown(report), encoding="utf-8")
    plot_recall(report, paths["png"])
    return paths
