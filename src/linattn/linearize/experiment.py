"""`linattn linearize --preset experiment`: how much of a softmax teacher each recipe keeps, on this
machine, over seeds (issue 35).

1. The teacher: a softmax byte LM trained by `linattn.training.train` on Python's standard library
   (TEACHER; out/teacher, reused when it completed there).
2. Every recipe × seed linearizes it with 10% of the teacher's training tokens (LINEARIZE: half in
   stage 1, half in stage 2; LoRA rank 8, or full fine-tuning for T2R): out/<recipe>-seed<s>/.
3. out/linearize.{json,md,png}: per recipe, bits per byte of the naive swap, stage 1 and stage 2
   (mean ± sd over seeds, every seed, the worst), the share of the naive swap's gap recovered, the
   recall probe, and decode ms/token and cache bytes by context beside the teacher's KV cache.

Everything resumes: the teacher's run and every stage are training runs with resume="auto", and a
linearization whose report exists is read back, not run again.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from ..models.linearized import RECIPES
from ..report import make_table, machine_info, timestamp, write_json
from ..training import TrainConfig, train
from .run import LinearizeConfig, LinearizeInterrupted, linearize

__all__ = ["LINEARIZE", "SEEDS", "TEACHER", "measure_decode", "run_experiment", "summarize"]

SEEDS = (0, 1, 2)
#: the teacher: 4 softmax layers of d_model 128 (4 heads, RoPE), windows of 512 bytes, 16 per step
TEACHER = dict(task="bytes", model={"d_model": 128, "n_layers": 4, "n_heads": 4, "attention": "softmax",
                                    "positions": "rope"},
               seq_len=512, batch_size=16, steps=1500, lr=2e-3, warmup_steps=100, min_lr_ratio=0.1,
               eval_interval=0, eval_batches=16, checkpoint_interval=100, distributed="off")
#: each linearization: 150 + 150 steps of 8 × 512 bytes = 1.23M bytes, 10% of the teacher's 12.3M
#: (stage 2's learning rate: the mode's, linattn.linearize.run.FINETUNE_LR)
LINEARIZE = dict(seq_len=512, batch_size=8, transfer_steps=150, finetune_steps=150, transfer_lr=1e-2,
                 eval_batches=16, recall=64)
#: decode lengths, measured once per recipe (seed 0) and for the teacher
CONTEXTS = (1024, 4096, 8192, 16384, 32768)


def _stats(values: list) -> dict:
    vals = [v for v in values if v is not None]
    if not vals:
        return {"mean": None, "sd": None, "worst": None, "values": values}
    return {"mean": statistics.fmean(vals), "sd": statistics.stdev(vals) if len(vals) > 1 else None,
            "values": values}


def summarize(runs: dict, teacher_bpb: float) -> list[dict]:
    """Per recipe, from {(recipe, seed): linearize report}: bpb of each stage and the recovered share
    (mean, sd, every seed; the worst seed is the highest bpb, the lowest share), the recall probe."""
    out = []
    for recipe in RECIPES:
        reps = [runs[(r, s)] for (r, s) in sorted(runs) if r == recipe]
        if not reps:
            continue
        row = {"recipe": recipe, "seeds": [s for (r, s) in sorted(runs) if r == recipe]}
        for stage in ("naive swap", "stage 1", "stage 2"):
            got = [next((x for x in rep["rows"] if x["model"] == stage), None) for rep in reps]
            if all(g is None for g in got):
                continue
            bpb = _stats([g and g["bpb"] for g in got])
            bpb["worst"] = max(v for v in bpb["values"] if v is not None)
            row[stage] = {"bpb": bpb, "recall": _stats([g and g["recall"] for g in got]),
                          "recall_gain": _stats([g and g.get("recall_gain") for g in got])}
            if stage != "naive swap":
                rec = _stats([g and g["recovered"] for g in got])
                rec["worst"] = min((v for v in rec["values"] if v is not None), default=None)
                row[stage]["recovered"] = rec
        final = row["stage 2"]["bpb"]
        row["stage 2 / teacher"] = final["mean"] / teacher_bpb
        row["decode"] = reps[0].get("decode", {}).get("stage 2")
        out.append(row)
    return out


def _teacher(out: Path, fields: dict, progress: bool, console):
    cfg = TrainConfig(**{**fields, "out_dir": str(out / "teacher"), "resume": "auto"})
    res = train(cfg, progress=progress, console=console)
    if res.status != "completed":
        raise LinearizeInterrupted(f"the teacher's run stopped ({res.status}): run the same command again")
    return res


def measure_decode(out: Path, recipes, seed: int, contexts) -> dict:
    """{"teacher": decode_costs, recipe: decode_costs of its seed's final model}, all in one pass (so
    that they are measured side by side, on one machine state), written to out/decode.json."""
    from ..training.linearize import load_teacher
    from .evaluate import decode_costs

    models = {"teacher": load_teacher(out / "teacher")}
    models.update({r: load_teacher(out / f"{r}-seed{seed}" / "model", r) for r in recipes})
    result = {name: decode_costs(m, contexts) for name, m in models.items()}
    result["_machine"] = machine_info("cpu")
    write_json(out / "decode.json", result)
    return result


def run_experiment(out, *, seeds=None, recipes=None, console=None, progress: bool = True,
                   teacher_overrides: dict | None = None, linearize_overrides: dict | None = None,
                   contexts=CONTEXTS, decode: bool = True) -> dict:
    """Runs (or resumes) the preset into `out`; returns the report (also written as linearize.*).
    The decode costs are measured at the end, for the teacher and every recipe's first-seed model in
    one pass (out/decode.json, reused when present; decode=False leaves them out, so that they can be
    measured later on an idle machine)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    seeds = tuple(SEEDS if seeds is None else seeds)
    recipes = tuple(RECIPES if recipes is None else recipes)
    teacher_fields = {**TEACHER, **(teacher_overrides or {})}
    _teacher(out, teacher_fields, progress, console)
    runs = {}
    for recipe in recipes:
        for seed in seeds:
            folder = out / f"{recipe}-seed{seed}"
            done = folder / "linearize.json"
            if done.exists():
                runs[(recipe, seed)] = json.loads(done.read_text(encoding="utf-8"))
                continue
            cfg = LinearizeConfig(teacher=str(out / "teacher"), out=str(folder), recipe=recipe, seed=seed,
                                  contexts=(), **{**LINEARIZE, **(linearize_overrides or {})})
            runs[(recipe, seed)] = linearize(cfg, progress=progress, console=console)
    first = runs[(recipes[0], seeds[0])]
    teacher_row = next(x for x in first["rows"] if x["model"] == "teacher")
    dec = None
    if (out / "decode.json").exists():
        dec = json.loads((out / "decode.json").read_text(encoding="utf-8"))
    elif decode and contexts:
        dec = measure_decode(out, recipes, seeds[0], contexts)
    for (r, s), rep in runs.items():
        if dec is not None and s == seeds[0]:
            rep["decode"] = {"teacher": dec["teacher"], "stage 2": dec.get(r)}
    report = {"teacher": {"bpb": teacher_row["bpb"], "recall": teacher_row["recall"],
                          "recall_gain": teacher_row.get("recall_gain"),
                          # the run's whole budget (teacher.tokens counts this process's only: 0 on a resume)
                          "tokens": teacher_fields["steps"] * teacher_fields["batch_size"] * teacher_fields["seq_len"],
                          "config": teacher_fields,
                          "decode": None if dec is None else dec["teacher"]},
              "linearize": {**LINEARIZE, **(linearize_overrides or {})}, "seeds": list(seeds),
              "recipes": summarize(runs, teacher_row["bpb"]),
              "runs": {f"{r}-seed{s}": rep["rows"] for (r, s), rep in runs.items()},
              "machine": machine_info("cpu"), "timestamp": timestamp()}
    write_experiment(report, out, console)
    return report


def _fmt(stat: dict | None, pct: bool = False) -> str:
    if not stat or stat.get("mean") is None:
        return "—"
    f = (lambda x: f"{x:.0%}") if pct else (lambda x: f"{x:.3f}")
    sd = f" ± {f(stat['sd'])}" if stat.get("sd") is not None else ""
    worst = f" (worst {f(stat['worst'])})" if stat.get("worst") is not None else ""
    return f"{f(stat['mean'])}{sd}{worst}"


def _rows(report: dict) -> list[list[str]]:
    gain = report["teacher"].get("recall_gain")
    rows = [["teacher (softmax)", f"{report['teacher']['bpb']:.3f}", "—", "—", "—", "—",
             f"{report['teacher']['recall']:.3f}" + ("" if gain is None else f" ({gain:+.3f})")]]
    for r in report["recipes"]:
        s1, s2 = r.get("stage 1", {}), r["stage 2"]
        rows.append([r["recipe"], _fmt(r["naive swap"]["bpb"]), _fmt(s1.get("bpb")), _fmt(s2["bpb"]),
                     _fmt(s2.get("recovered"), pct=True), f"{r['stage 2 / teacher']:.3f}×",
                     _fmt(s2["recall"]) + _gain(s2.get("recall_gain"))])
    return rows


def _gain(stat: dict | None) -> str:
    return "" if not stat or stat.get("mean") is None else f" ({stat['mean']:+.3f})"


_HEADER = ["model", "naive swap bpb", "stage 1 bpb", "stage 2 bpb", "gap recovered (stage 2)", "stage 2 / teacher",
           "copy probe (gain from context)"]


def write_experiment(report: dict, out: Path, console=None) -> None:
    write_json(out / "linearize.json", report)
    lines = ["# linattn linearize — the experiment (`--preset experiment`)", "",
             f"Teacher: softmax byte LM {report['teacher']['config']['model']}, {report['teacher']['tokens']:,} training "
             f"bytes of the Python standard library. Each recipe linearizes it with "
             f"{(report['linearize']['transfer_steps'] + report['linearize']['finetune_steps']) * report['linearize']['batch_size'] * report['linearize']['seq_len']:,} "
             f"bytes (stage 1 + stage 2) on seeds {report['seeds']}: mean ± sd (worst seed).", "",
             "| " + " | ".join(_HEADER) + " |", "|" + "---|" * len(_HEADER)]
    lines += ["| " + " | ".join(row) + " |" for row in _rows(report)]
    dec = report["teacher"].get("decode")
    if dec:
        lines += ["", "Decoding, ms/token (cache) after a prefill of each context, 1 sequence:", "",
                  "| context | teacher | " + " | ".join(r["recipe"] for r in report["recipes"]) + " |",
                  "|---:|---:|" + "---:|" * len(report["recipes"])]
        for i, t in enumerate(dec):
            cells = [f"{t['ms_per_token']:.2f} ({t['cache_bytes'] / 2**20:.1f} MiB)" if t.get("ms_per_token") else "—"]
            for r in report["recipes"]:
                d = (r.get("decode") or [None] * len(dec))[i]
                cells.append(f"{d['ms_per_token']:.2f} ({d['cache_bytes'] / 2**20:.2f} MiB)" if d and d.get("ms_per_token")
                             else "—")
            lines.append(f"| {t['context']:,} | " + " | ".join(cells) + " |")
    m = report["machine"]
    lines += ["", f"Machine: {m.get('cpu')}, torch {m.get('torch')}, {m.get('torch_threads')} thread(s); "
                  f"{report['timestamp']}."]
    (out / "linearize.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    _plot(report, out / "linearize.png")
    if console is not None:
        console.print(make_table("linattn linearize --preset experiment", _HEADER, _rows(report)))


def _plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.5))
    stages = ("naive swap", "stage 1", "stage 2")
    width = 0.8 / len(stages)
    for j, stage in enumerate(stages):
        xs, ys, es, dots = [], [], [], []
        for i, r in enumerate(report["recipes"]):
            if stage in r:
                b = r[stage]["bpb"]
                xs.append(i + (j - 1) * width)
                ys.append(b["mean"])
                es.append(b["sd"] or 0.0)
                dots += [(i + (j - 1) * width, v) for v in b["values"] if v is not None]
        ax.bar(xs, ys, width, yerr=es, label=stage, capsize=3)
        if dots:
            ax.scatter(*zip(*dots), s=8, color="black", zorder=3)
    ax.axhline(report["teacher"]["bpb"], color="red", ls="--", label="teacher")
    ax.set_xticks(range(len(report["recipes"])), [r["recipe"] for r in report["recipes"]])
    ax.set_ylabel("validation bits per byte")
    ax.set_title(f"seeds {report['seeds']} (dots), mean ± sd")
    ax.legend(fontsize=8)
    dec = report["teacher"].get("decode") or []
    pts = [(d["context"], d["ms_per_token"]) for d in dec if d.get("ms_per_token")]
    if pts:
        bx.plot(*zip(*pts), "o-", label="teacher (KV cache)")
    for r in report["recipes"]:
        pts = [(d["context"], d["ms_per_token"]) for d in (r.get("decode") or []) if d.get("ms_per_token")]
        if pts:
            bx.plot(*zip(*pts), "o-", label=r["recipe"])
    bx.set_xscale("log")
    bx.set_xlabel("context (tokens)")
    bx.set_ylabel("ms per token")
    bx.set_title("decoding after a prefill of each context")
    bx.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
