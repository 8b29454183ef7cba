"""The recall presets' outputs: table rows, markdown, the plot (accuracy against state size with
seeds as error bars, training curves of every seed) and the files recall.json (records in the
schema other tools read, and the per-kind summaries), recall-runs.json (the whole report), recall.md
and recall.png."""

from __future__ import annotations

from pathlib import Path

from .recall import LABELS, MIN_PAIRS, RECALL_KINDS
from .recall_stats import PLATEAU_ACCURACY, fmt_mean_sd

__all__ = ["RECORD_KEYS", "plot_recall", "recall_json", "render_recall_markdown", "recall_table_rows",
           "write_recall_report"]

#: the keys of a record of recall.json, in order
RECORD_KEYS = ("kind", "seq_len", "n_pairs", "lr", "state_size", "accuracy", "seed", "variant")
#: the keys of a summary of recall.json, in order
SUMMARY_KEYS = ("kind", "variant", "seq_len", "n_pairs", "lr", "state_size", "seeds", "accuracies", "mean", "sd",
                "worst", "worst_seed", "plateau_seeds")


def recall_json(report: dict) -> dict:
    """recall.json: {"records": [{kind, seq_len, n_pairs, lr, state_size, accuracy, seed, variant}] (one
    per run, every lr and seed), "summary": [per (setting, kind, variant): the chosen lr, mean, sd,
    every seed's accuracy, worst seed, plateau seeds], "wall_s", "machine"}."""
    return {"records": [{k: r.get(k, "" if k == "variant" else 0) for k in RECORD_KEYS} for r in report["records"]],
            "summary": [{k: s[k] for k in SUMMARY_KEYS} for s in report["summary"]],
            "wall_s": report["wall_s"], "machine": report["machine"]}


def _settings(report: dict) -> list[tuple[int, int]]:
    return sorted({(s["seq_len"], s["n_pairs"]) for s in report["summary"]})


def _order(kind: str) -> int:
    return RECALL_KINDS.index(kind) if kind in RECALL_KINDS else len(RECALL_KINDS)


def _rows(report: dict) -> list[tuple[str, str]]:
    """(kind, variant) pairs in table order (kinds by RECALL_KINDS, variants by state size)."""
    seen = {}
    for s in report["summary"]:
        seen.setdefault((s["kind"], s["variant"]), s["state_size"])
    return sorted(seen, key=lambda kv: (_order(kv[0]), kv[0], seen[kv]))


def _summary(report: dict, setting, kind, variant="") -> dict | None:
    for s in report["summary"]:
        if (s["seq_len"], s["n_pairs"], s["kind"], s["variant"]) == (*setting, kind, variant):
            return s
    return None


def _label(kind: str, variant: str) -> str:
    return LABELS.get(kind, kind) + (f" {variant}" if variant else "")


def _acc(x) -> str:
    return "—" if x is None else f"{x:.3f}"


def _seed_values(s: dict) -> str:
    """'0.995, 0.015 (plateau), 0.991' in seed order."""
    return ", ".join(f"{a:.3f}" + (" (plateau)" if seed in s["plateau_seeds"] else "")
                     for seed, a in zip(s["seeds"], s["accuracies"]))


def _cpu_line(report: dict) -> str:
    """The runs' CPU time and what it means for two quiet cores (records of older runs lack it)."""
    cpu = [r.get("cpu_s") for r in report["records"]]
    if not cpu or any(c is None for c in cpu):
        return ""
    total = sum(cpu)
    return (f" The runs took {total:.0f} CPU s in total: about {total / 120:.0f} min of wall time on two quiet "
            f"cores with --jobs 2.")


def recall_table_rows(report: dict) -> tuple[list[str], list[list[str]]]:
    """Header and rows: per kind (and variant), per setting the mean ± sd over seeds at the lr with
    the best mean, every seed's accuracy (plateau runs marked), the worst seed, that lr, the steps to
    99% per seed (— if never) and the state size (floats per layer)."""
    settings = _settings(report)
    header = ["attention"]
    for n, p in settings:
        header += [f"MQAR ({n}, {p}) acc ↑ (mean ± sd)", "per seed", "worst seed", "lr", "steps to 99%",
                   "state (floats/layer)"]
    rows = []
    for kind, variant in _rows(report):
        row = [_label(kind, variant)]
        for st in settings:
            s = _summary(report, st, kind, variant)
            if s is None:
                row += ["—"] * 6
                continue
            row += [fmt_mean_sd(s), _seed_values(s), f"{s['worst']:.3f} (seed {s['worst_seed']})", f"{s['lr']:g}",
                    ", ".join("—" if x is None else str(x) for x in s["steps_to_stop"]), f"{s['state_size']:,}"]
        rows.append(row)
    return header, rows


def _verdict(c: dict) -> str:
    mean = {True: "holds", False: "DOES NOT HOLD", None: "not run"}[c["holds"]]
    if c["holds"] is None:
        return f"**{mean}**"
    every = {True: "holds", False: "does not hold", None: "—"}[c["holds_every_seed"]]
    return f"on the mean **{mean}**; on every seed **{every}** ({c['seeds_holding']} seeds)"


def render_recall_markdown(report: dict) -> str:
    """The report as markdown: setup, the table, the criteria, every run, the notes, the machine."""
    header, rows = recall_table_rows(report)
    m = report["machine"]
    resumed = f" {report['resumed']} runs were reused from an earlier run's recall-runs.jsonl." if report.get(
        "resumed") else ""
    planned = report.get("planned", len(report["records"]))
    if len(report["records"]) < planned:
        resumed += (f" **A partial report: {len(report['records'])} of the {planned} planned runs have finished**"
                    " (the rest are still running or to run; kinds and settings without runs are absent).")
    lines = [f"# linattn eval — preset `{report['preset']}` (associative recall, MQAR)", "",
             f"{report['description']}.", "",
             f"Seeds {report['seeds']}. Wall time {report['wall_s']:.0f} s ({report['wall_s'] / 60:.1f} min) with "
             f"{m.get('jobs')} process(es) × {m.get('threads_per_job')} thread(s) on {m.get('cpu')} ({m.get('cores')} "
             f"cores; torch {m.get('torch')}, device {m.get('device')}); {report['timestamp']}." + _cpu_line(report)
             + resumed, "",
             "Per kind, the lr with the best mean accuracy over seeds (accuracy at the query positions on fixed "
             "validation examples of each seed), mean ± sample sd, every seed's value (seed order "
             f"{report['seeds']}; *plateau*: the run's best validation accuracy stayed below {PLATEAU_ACCURACY}, it "
             "never left the initial plateau), the worst seed, and the steps to 99% per seed.", "",
             "| " + " | ".join(header) + " |", "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    lines += ["", f"## Criteria (issues 16, 28; settings with at least {MIN_PAIRS} pairs; on the means and on "
              "every seed)", ""]
    if not report["criteria"]:
        lines.append("- no setting with enough pairs was run")
    for c in report["criteria"]:
        lines.append(f"- MQAR ({c['setting'][0]}, {c['setting'][1]}): {c['check']} — {_verdict(c)} "
                     f"({c['detail']})")
    if report.get("claims"):
        lines += ["", "## Frontier claims (Zoology Fig. 2, Based Fig. 3, DeltaNet; means over seeds, the upper kind's "
                  "curve interpolated in log state at the lower kind's sizes)", ""]
        for c in report["claims"]:
            verdict = {True: "holds", False: "DOES NOT HOLD", None: "not comparable"}[c["holds"]]
            lines.append(f"- MQAR ({c['setting'][0]}, {c['setting'][1]}): {c['claim']} — **{verdict}** ({c['detail']})")
    lines += ["", "## Every run", "", "| kind | setting | lr | seed | accuracy | steps | steps to 99% | plateau | "
              "status | s |", "|---|---|---:|---:|---:|---:|---:|---|---|---:|"]
    from .recall_stats import on_plateau

    for r in report["records"]:
        lines.append(f"| {_label(r['kind'], r.get('variant', ''))} | ({r['seq_len']}, {r['n_pairs']}) | {r['lr']:g} | "
                     f"{r.get('seed', 0)} | {_acc(r['accuracy'])} | {r['steps']} | "
                     f"{r['steps_to_stop'] if r['steps_to_stop'] is not None else '—'} | "
                     f"{'plateau' if on_plateau(r) else ''} | {r['status']} | {r['elapsed_s']:.0f} |")
    lines += ["", "## Notes", ""]
    lines += [f"- {n}" for n in report["notes"]]
    lines += [f"- {s}" for s in report["skipped"]]
    lines += [f"- run {LABELS.get(r['kind'], r['kind'])} lr {r['lr']:g} seed {r.get('seed', 0)}: {r['status']} — "
              f"{r['message']}" for r in report["records"] if r["status"] != "completed"]
    lines += [f"- model: {report['model']}; per-kind changes: {report['kind_options']}"]
    if report.get("variants"):
        lines.append(f"- sizes per kind (variants): {report['variants']}")
    lines += [f"- lr sweep {report['lrs']}; at most {report['steps']} steps; early stop at {report['stop_accuracy']}",
              "- state size: floats of the decoding cache per layer (mean over layers) after one sequence of "
              "seq_len tokens, measured on the model: the recurrent state (softmax: its KV cache at that length) "
              "plus the short convolutions' tails"]
    return "\n".join(lines) + "\n"


def plot_recall(report: dict, path) -> Path:
    """Per setting two panels: accuracy against state size (log x; one line per kind through its
    sizes, mean over seeds with ± sd error bars, every seed as a small dot), and the validation
    curves of every seed at each kind's chosen lr (one colour per kind; the smallest size only when
    a kind has several)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    settings = _settings(report) or [(0, 0)]
    kinds = sorted({s["kind"] for s in report["summary"]}, key=lambda k: (_order(k), k))
    fig = Figure(figsize=(13.5, 4.6 * len(settings)), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(settings), 2, squeeze=False)
    palette = [f"C{i}" for i in range(10)] + ["black", "olive", "teal", "maroon"]
    colours = {k: palette[i % len(palette)] for i, k in enumerate(kinds)}
    markers = {k: "os^vD<>ph*Xd+x"[i % 14] for i, k in enumerate(kinds)}
    for (ax_s, ax_c), st in zip(axes, settings):
        for k in kinds:
            points = sorted((s for s in report["summary"] if (s["seq_len"], s["n_pairs"], s["kind"]) == (*st, k)),
                            key=lambda s: s["state_size"])
            if not points:
                continue
            xs = [s["state_size"] for s in points]
            ax_s.errorbar(xs, [s["mean"] for s in points], yerr=[s["sd"] or 0.0 for s in points], color=colours[k],
                          marker=markers[k], markersize=6, capsize=3, label=LABELS.get(k, k))
            for s in points:
                ax_s.scatter([s["state_size"]] * len(s["accuracies"]), s["accuracies"], color=colours[k], s=8,
                             alpha=0.5)
            chosen = points[0]
            for seed in chosen["seeds"]:
                curve = next((r["curve"] for r in report["records"] if (r["seq_len"], r["n_pairs"], r["kind"],
                              r.get("variant", ""), r["lr"], r.get("seed", 0)) == (*st, k, chosen["variant"],
                                                                                  chosen["lr"], seed)), None)
                if curve:
                    steps, accs = zip(*curve)
                    ax_c.plot(steps, accs, color=colours[k], marker=markers[k], markersize=3, alpha=0.8,
                              label=f"{_label(k, chosen['variant'])} (lr {chosen['lr']:g})"
                              if seed == chosen["seeds"][0] else None)
        ax_s.set_xscale("log")
        ax_s.set_xlabel("state size (floats per layer; softmax: KV cache at seq_len)")
        ax_s.set_ylabel("accuracy at the query positions")
        ax_s.set_ylim(-0.02, 1.02)
        ax_s.set_title(f"MQAR {st}: recall vs state size (mean ± sd over seeds; dots: seeds)", fontsize=10)
        ax_s.grid(True, which="both", alpha=0.3)
        ax_s.legend(fontsize=7, loc="best")
        ax_c.set_xlabel("step")
        ax_c.set_ylabel("validation accuracy")
        ax_c.set_ylim(-0.02, 1.02)
        ax_c.set_title(f"MQAR {st}: training curves (every seed, chosen lr per kind)", fontsize=10)
        ax_c.grid(True, alpha=0.3)
        ax_c.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.suptitle(f"linattn eval --preset {report['preset']}, seeds {report['seeds']} "
                 f"({report['wall_s'] / 60:.0f} min, {report['machine'].get('cpu')})", fontsize=10)
    path = Path(path)
    fig.savefig(path, dpi=100)
    return path


def write_recall_report(report: dict, out_dir, stem: str = "recall") -> dict:
    """Writes <stem>.json, <stem>-runs.json, <stem>.md and <stem>.png into out_dir; returns their paths."""
    from ..report import write_json

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / f"{stem}.json", "runs": out / f"{stem}-runs.json", "markdown": out / f"{stem}.md",
             "png": out / f"{stem}.png"}
    write_json(paths["json"], recall_json(report))
    write_json(paths["runs"], report)
    paths["markdown"].write_text(render_recall_markdown(report), encoding="utf-8")
    plot_recall(report, paths["png"])
    return paths
