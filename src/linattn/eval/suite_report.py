"""The report of `linattn eval`'s presets: per task and kind the mean and spread over seeds
(`summarize`), the literature's expectations checked in words (`literature_notes`), the table,
markdown and plot (`write_report`)."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from .kinds import HIGHER_IS_BETTER, KIND_LABELS, METRIC_LABELS, kind_model

__all__ = ["EXPECTATIONS", "literature_notes", "plot_eval", "render_markdown", "summarize", "table_rows",
           "write_report"]


def _stats(values: list) -> dict:
    vals = [v for v in values if v is not None and math.isfinite(v)]
    if not vals:
        return {"mean": None, "spread": None, "n": 0, "values": values}
    spread = statistics.stdev(vals) if len(vals) > 1 else None
    return {"mean": statistics.fmean(vals), "spread": spread, "n": len(vals), "values": values}


def summarize(report: dict) -> dict:
    """{task: {kind: {metric: {"mean", "spread" (sample sd over seeds, None for one seed), "n", "values"}}}}."""
    out: dict = {}
    for task in report["tasks"]:
        metrics = report["task_specs"][task]["metrics"]
        out[task] = {}
        for kind in report["kinds"]:
            runs = [r for r in report["runs"] if r["task"] == task and r["kind"] == kind]
            if not runs:
                continue
            out[task][kind] = {m: _stats([(r["metrics"] or {}).get(m) for r in runs]) for m in metrics}
    return out


def _mean(report, task, kind, metric):
    try:
        return report["summary"][task][kind][metric]["mean"]
    except KeyError:
        return None


EXPECTATIONS = {
    "mqar": "softmax and Taylor solve MQAR while elu+1, FAVOR+ and cosFormer fail (Hedgehog paper, Zhang et al. "
            "2024, Table 2: 100% vs ~17% accuracy; Zoology, Arora et al. 2023)",
    "copy": "linear attention reaches the copy loss of softmax (Linear Transformer paper, Katharopoulos et al. "
            "2020, Fig. 2)",
}
SOLVED_ACC = 0.9   # "solves MQAR"
FAILED_ACC = 0.5   # "fails MQAR" (the paper's failures are ~0.17-0.3)
ORDER_MARGIN = 0.1  # the ordering holds when every "solver" beats every "failer" by at least this much accuracy


def literature_notes(report: dict) -> list[dict]:
    """One note per check: {"check", "expected", "verdict" ("agrees" | "partly agrees" | "disagrees" |
    "not run"), "detail"}. MQAR: the ordering holds when softmax and Taylor beat elu+1, FAVOR+ and
    cosFormer by ORDER_MARGIN accuracy; "agrees" needs also SOLVED_ACC / FAILED_ACC. Copy: a linear
    kind reaches softmax when its loss is within max(0.05, 25%) of softmax's."""
    notes = []
    kinds = report["kinds"]
    mqar_tasks = [t for t in report["tasks"] if report["task_specs"][t]["task"] == "mqar"]
    solve = [k for k in ("softmax", "taylor") if k in kinds]
    fail = [k for k in ("elu", "favor", "cosformer") if k in kinds]
    for t in mqar_tasks:
        label = report["task_specs"][t]["label"]
        if not solve or not fail:
            notes.append({"check": label, "expected": EXPECTATIONS["mqar"], "verdict": "not run",
                          "detail": "needs softmax or taylor and one of elu, favor, cosformer"})
            continue
        acc = {k: _mean(report, t, k, "accuracy") for k in solve + fail}
        if any(v is None for v in acc.values()):
            notes.append({"check": label, "expected": EXPECTATIONS["mqar"], "verdict": "not run",
                          "detail": "some runs produced no metrics (diverged or interrupted)"})
            continue
        desc = ", ".join(f"{KIND_LABELS[k]} {acc[k]:.2f}" for k in solve + fail)
        ordering = min(acc[k] for k in solve) - max(acc[k] for k in fail) >= ORDER_MARGIN
        solved = all(acc[k] >= SOLVED_ACC for k in solve)
        failed = all(acc[k] < FAILED_ACC for k in fail)
        if ordering and solved and failed:
            verdict, detail = "agrees", f"accuracy: {desc}"
        elif ordering:
            missing = []
            if not solved:
                missing.append(f"{'/'.join(KIND_LABELS[k] for k in solve if acc[k] < SOLVED_ACC)} below "
                               f"{SOLVED_ACC:.0%} (undertrained at this budget?)")
            if not failed:
                missing.append(f"{'/'.join(KIND_LABELS[k] for k in fail if acc[k] >= FAILED_ACC)} at or above "
                               f"{FAILED_ACC:.0%} (the task is easy at this size?)")
            verdict, detail = "partly agrees", f"the ordering holds but {'; '.join(missing)}; accuracy: {desc}"
        else:
            bad = [f"{KIND_LABELS[f]} {'≥' if acc[f] >= acc[s] else 'within ' + format(ORDER_MARGIN, 'g') + ' of'} "
                   f"{KIND_LABELS[s]}" for s in solve for f in fail if acc[s] - acc[f] < ORDER_MARGIN]
            verdict, detail = "disagrees", f"ordering broken ({', '.join(bad)}); accuracy: {desc}"
        notes.append({"check": label, "expected": EXPECTATIONS["mqar"], "verdict": verdict, "detail": detail})
    for t in [t for t in report["tasks"] if report["task_specs"][t]["task"] == "copy"]:
        label = report["task_specs"][t]["label"]
        linear = [k for k in kinds if k not in ("softmax",)]
        if "softmax" not in kinds or not linear or "loss" not in report["task_specs"][t]["metrics"]:
            notes.append({"check": label, "expected": EXPECTATIONS["copy"], "verdict": "not run",
                          "detail": "needs softmax and at least one linear kind"})
            continue
        ref = _mean(report, t, "softmax", "loss")
        if ref is None:
            notes.append({"check": label, "expected": EXPECTATIONS["copy"], "verdict": "not run",
                          "detail": "softmax produced no metrics"})
            continue
        tol = max(0.05, 0.25 * ref)
        close, far = [], []
        for k in linear:
            v = _mean(report, t, k, "loss")
            if v is None:
                continue
            (close if v <= ref + tol else far).append(f"{KIND_LABELS[k]} {v:.3f}")
        detail = f"softmax loss {ref:.3f} (tolerance +{tol:.3f}); reach it: {', '.join(close) or 'none'}"
        if far:
            detail += f"; do not: {', '.join(far)}"
        verdict = "agrees" if not far else ("partly agrees" if close else "disagrees")
        notes.append({"check": label, "expected": EXPECTATIONS["copy"], "verdict": verdict, "detail": detail})
    return notes


def _fmt(stat: dict | None, metric: str) -> str:
    if not stat or stat["mean"] is None:
        return "—"
    s = f"{stat['mean']:.3f}"
    if stat["spread"] is not None:
        s += f" ± {stat['spread']:.3f}"
    return s


def _columns(report: dict) -> list[tuple[str, str, str]]:
    cols = []
    for t in report["tasks"]:
        spec = report["task_specs"][t]
        for m in spec["metrics"]:
            arrow = "↑" if HIGHER_IS_BETTER[m] else "↓"
            cols.append((t, m, f"{spec['label']} {METRIC_LABELS[m]} {arrow}"))
    return cols


def table_rows(report: dict) -> tuple[list[str], list[list[str]]]:
    cols = _columns(report)
    header = ["attention"] + [c[2] for c in cols]
    rows = []
    for k in report["kinds"]:
        rows.append([KIND_LABELS[k]] + [_fmt(report["summary"].get(t, {}).get(k, {}).get(m), m) for t, m, _ in cols])
    return header, rows


def render_markdown(report: dict) -> str:
    """The report as markdown: the table (mean ± sd over seeds), the notes, the setup."""
    header, rows = table_rows(report)
    n_seeds = len(report["seeds"])
    lines = [f"# linattn eval — preset `{report['preset']}`", "",
             f"{report['preset_description']}.", "",
             f"Mean ± sample standard deviation over {n_seeds} seed(s) {report['seeds']}"
             + (" (one seed: no spread)" if n_seeds == 1 else "") + f"; {report['elapsed_s']:.0f} s in total.", "",
             "| " + " | ".join(header) + " |", "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    lines += ["", "## Notes: comparison with the literature", ""]
    if not report["notes"]:
        lines.append("- (no check applies to this selection of kinds and tasks)")
    for n in report["notes"]:
        lines.append(f"- **{n['check']}** — {n['verdict'].upper()}. Expected: {n['expected']}. Ours: {n['detail']}.")
    bad = [r for r in report["runs"] if r["status"] != "completed"]
    for r in bad:
        lines.append(f"- run {r['task']} · {r['kind']} · seed {r['seed']}: {r['status']} — {r['message']}")
    lines += ["", "## Setup", "",
              f"- model: {report['model']}; per-kind changes: {report['kind_options']}; hybrid = elu+1 layers with "
              f"one softmax layer in every 4 (with fewer layers: the last one), here "
              f"{kind_model('hybrid', report['model'])['attention']}",
              "- metrics: copy loss (nats) and token accuracy on the copied half; MQAR accuracy at the query "
              "positions; ListOps accuracy; byte-LM validation bits per byte"]
    for t in report["tasks"]:
        spec = report["task_specs"][t]
        train = dict(spec["train"])
        if report.get("steps_override"):
            train["steps"] = report["steps_override"]
        lines.append(f"- {spec['label']}: task {spec['task']} {spec['options']}, training {train}")
    m = report["machine"]
    lines.append(f"- machine: {m.get('cpu')}, {m.get('torch_threads')} torch threads, torch {m.get('torch')}, "
                 f"device {m.get('device')}")
    return "\n".join(lines) + "\n"


def plot_eval(report: dict, path) -> Path:
    """A bar chart, one panel per (task, metric), one bar per kind with the spread as error bar."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    cols = _columns(report)
    n = max(1, len(cols))
    ncols = min(3, n)
    nrows = math.ceil(n / ncols)
    fig = Figure(figsize=(4.6 * ncols, 3.6 * nrows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    kinds = report["kinds"]
    for ax, (t, m, label) in zip(axes, cols):
        means, errs = [], []
        for k in kinds:
            st = report["summary"].get(t, {}).get(k, {}).get(m)
            means.append(st["mean"] if st and st["mean"] is not None else 0.0)
            errs.append(st["spread"] if st and st["spread"] is not None else None)
        has_err = any(e is not None for e in errs)
        ax.bar(range(len(kinds)), means, yerr=[e or 0.0 for e in errs] if has_err else None, capsize=3,
               color=["tab:gray" if k == "softmax" else "tab:blue" for k in kinds])
        ax.set_xticks(range(len(kinds)), [KIND_LABELS[k].split(" (")[0] for k in kinds], rotation=45, ha="right",
                      fontsize=8)
        ax.set_title(label, fontsize=10)
        if m == "accuracy":
            ax.set_ylim(0, 1.02)
        ax.grid(True, axis="y", alpha=0.3)
    for ax in axes[len(cols):]:
        ax.set_visible(False)
    fig.suptitle(f"linattn eval ({report['preset']}): mean ± sd over seeds {report['seeds']}")
    path = Path(path)
    fig.savefig(path, dpi=110)
    return path


def write_report(report: dict, out_dir) -> dict:
    """Writes eval.md, eval.json and eval.png into out_dir; returns their paths."""
    from ..report import write_json

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"markdown": out / "eval.md", "json": out / "eval.json", "png": out / "eval.png"}
    paths["markdown"].write_text(render_markdown(report), encoding="utf-8")
    write_json(paths["json"], report)
    plot_eval(report, paths["png"])
    return paths
