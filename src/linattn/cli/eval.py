"""`linattn eval`: attention kinds × tasks in one table. Thin: options -> linattn.eval.suite -> report folder."""

from __future__ import annotations

import argparse
import io
import sys

from .args import add_common_options, positive_int


def _names(value: str) -> list[str]:
    out = [v.strip() for v in value.split(",") if v.strip()]
    if not out:
        raise argparse.ArgumentTypeError("empty list: pass comma-separated names, e.g. softmax,elu")
    return out


def _seeds(value: str) -> list[int]:
    try:
        out = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, e.g. 0,1,2, got {value!r}") from None
    if not out:
        raise argparse.ArgumentTypeError("empty list: pass comma-separated integers, e.g. 0,1,2")
    return out


def add_parser(subparsers) -> None:
    from ..eval.suite import EVAL_KINDS, PRESETS
    from ..eval.recall import RECALL_PRESET

    tasks = "; ".join(f"{name}: {','.join(t.name for t in pr.tasks)}" for name, pr in PRESETS.items())
    p = subparsers.add_parser(
        "eval", help="train and compare attention kinds on copy, MQAR, ListOps and byte-LM in one table",
        description="Trains one small model per attention kind × task × seed (fixed seeds) and prints one table of "
                    "mean ± sd over seeds, with notes comparing the results to the literature (MQAR: softmax and "
                    "Taylor solve it, elu+1 / FAVOR+ / cosFormer do not; copy: linear attention reaches softmax's "
                    "loss). Writes eval.md, eval.json and eval.png to --out.",
        epilog="presets: " + "; ".join(f"{n}: {pr.description}" for n, pr in PRESETS.items())
               + f"; recall: {RECALL_PRESET.description}")
    p.add_argument("--preset", choices=sorted(PRESETS) + ["recall"], default="quick",
                   help="sizes and budgets (default: %(default)s); recall: associative recall (MQAR) by the "
                        "Zoology/Based recipe, every recall kind at every lr of its sweep (linattn.eval.recall)")
    p.add_argument("--kinds", type=_names, default=None, metavar="K[,K...]",
                   help="attention kinds (default: all): " + ",".join(EVAL_KINDS))
    p.add_argument("--tasks", type=_names, default=None, metavar="T[,T...]",
                   help=f"tasks of the --preset (default: all of them); per preset: {tasks}; a name before its "
                        "'-' (e.g. mqar) selects every setting of that task")
    p.add_argument("--seeds", type=_seeds, default=None, metavar="S[,S...]", help="seeds (default: the preset's)")
    p.add_argument("--steps", type=positive_int, default=None,
                   help="override every task's training steps (smoke tests)")
    p.add_argument("--threads", type=positive_int, default=None, metavar="T",
                   help="torch intra-op threads (per process with --jobs)")
    p.add_argument("--jobs", type=positive_int, default=1, metavar="J",
                   help="train J runs at once in separate processes (e.g. one per core with --threads 1); "
                        "results do not depend on it (default: %(default)s)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_common_options(p, dtype=False, seed=False)
    p.set_defaults(func=run_eval_command)


def run_eval_command(args) -> int:
    import torch
    from rich.console import Console

    from ..eval.suite import run_eval, table_rows, write_report
    from ..report import make_console, make_table, output_dir

    if args.threads and args.jobs == 1:
        torch.set_num_threads(args.threads)
    if args.preset == "recall":
        return run_recall_command(args)
    console = make_console()
    report, status = run_or_exit(lambda: run_eval(
        args.preset, kinds=args.kinds, tasks=args.tasks, seeds=args.seeds, steps=args.steps, device=args.device,
        progress=not args.quiet, console=console, jobs=args.jobs, threads_per_job=args.threads), console)
    if report is None:
        return status
    out = output_dir("eval", args.out)
    header, rows = table_rows(report)
    caption = f"mean ± sd over seeds {report['seeds']}; preset {report['preset']}; {report['elapsed_s']:.0f} s"
    table = make_table(f"linattn eval ({report['preset']})", header, rows, caption=caption)

    def show(con):
        con.print(table)
        for n in report["notes"]:
            colour = {"agrees": "green", "partly agrees": "yellow", "disagrees": "red"}.get(n["verdict"], "dim")
            con.print(f"[{colour}]{n['check']}: {n['verdict']}[/] — {n['detail']}")

    show(console)
    text = Console(file=io.StringIO(), width=200, record=True)
    show(text)
    (out / "eval.txt").write_text(text.export_text(), encoding="utf-8")
    write_report(report, out)
    console.print(f"report: {out.resolve()} (eval.md, eval.json, eval.png, eval.txt)")
    return status


def run_recall_command(args) -> int:
    """--preset recall: linattn.eval.recall.run_recall, the table and the criteria, recall.{json,md,png}."""
    import dataclasses
    import json

    from rich.console import Console

    from ..eval import recall
    from ..eval.recall_report import recall_table_rows, write_recall_report
    from ..report import make_console, make_table, output_dir

    if args.tasks is not None or args.seeds is not None:
        print("linattn eval: error: --preset recall takes no --tasks or --seeds (its MQAR settings and seed are "
              "fixed; see linattn.eval.recall.RECALL_PRESET)", file=sys.stderr)
        return 2
    preset = recall.RECALL_PRESET  # looked up now: tests shrink it
    if args.steps is not None:
        preset = dataclasses.replace(preset, steps=args.steps, warmup_steps=min(preset.warmup_steps,
                                                                                max(1, args.steps // 10)))
    console = make_console()
    out = output_dir("recall", args.out)
    partial = out / "recall-runs.jsonl"  # one line per finished run, as they finish: survives a crash
    partial.write_text("", encoding="utf-8")

    def keep(record):
        with partial.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    report, status = run_or_exit(lambda: recall.run_recall(
        preset, kinds=args.kinds, jobs=args.jobs, threads_per_job=args.threads or 1, device=args.device,
        progress=not args.quiet, console=console, on_record=keep), console)
    if report is None:
        return status
    header, rows = recall_table_rows(report)
    table = make_table(f"linattn eval (recall): {report['description']}", header, rows,
                       caption=f"best of lr {report['lrs']} per kind; {report['wall_s']:.0f} s")

    def show(con):
        con.print(table)
        for c in report["criteria"]:
            colour = {True: "green", False: "red"}.get(c["holds"], "dim")
            verdict = {True: "holds", False: "does not hold", None: "not run"}[c["holds"]]
            con.print(f"[{colour}]MQAR {tuple(c['setting'])}: {c['check']}: {verdict}[/] ({c['detail']})")
        for line in report["skipped"]:
            con.print(f"[dim]{line}[/]")

    show(console)
    text = Console(file=io.StringIO(), width=200, record=True)
    show(text)
    (out / "recall.txt").write_text(text.export_text(), encoding="utf-8")
    write_recall_report(report, out)
    console.print(f"report: {out.resolve()} (recall.json, recall-runs.json, recall-runs.jsonl, recall.md, recall.png, "
                  "recall.txt)")
    return status


def run_or_exit(run, console) -> tuple[dict | None, int]:
    """(report, exit status) of run(): status 0; a ValueError is one line on stderr and (None, 2);
    Ctrl-C gives the partial report the run attached to its KeyboardInterrupt and 130, or (None, 130)."""
    try:
        return run(), 0
    except ValueError as exc:
        print(f"linattn eval: error: {exc}", file=sys.stderr)
        return None, 2
    except KeyboardInterrupt as exc:
        report = exc.args[0] if exc.args and isinstance(exc.args[0], dict) else None
        if report is None:
            print("linattn eval: interrupted", file=sys.stderr)
            return None, 130
        console.print("[yellow]interrupted: writing the partial report[/]")
        return report, 130
