"""`linattn eval`: attention kinds × tasks in one table. Thin: options -> linattn.eval.suite -> report folder."""

from __future__ import annotations

import argparse
import io
import sys

from .args import add_command, add_common_options, positive_int


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
    from ..eval.kinds import EVAL_KINDS
    from ..eval.suite import PRESETS
    from ..eval.recall_frontier import RECALL_PRESETS

    tasks = "; ".join(f"{name}: {','.join(t.name for t in pr.tasks)}" for name, pr in PRESETS.items())
    p = add_command(subparsers, "eval", run_eval_command,
                    help="train and compare attention kinds on copy, MQAR, ListOps and byte-LM in one table",
                    epilog="presets: " + "; ".join(f"{n}: {pr.description}" for n, pr in PRESETS.items())
                           + "; " + "; ".join(f"{n}: {pr.description}" for n, pr in RECALL_PRESETS.items()))
    p.add_argument("--preset", choices=sorted(PRESETS) + sorted(RECALL_PRESETS), default="quick",
                   help="sizes and budgets (default: %(default)s); recall: associative recall (MQAR) by the "
                        "Zoology/Based recipe, every recall kind at every lr of its sweep and every seed "
                        "(linattn.eval.recall); recall-frontier: accuracy against state size, each kind at three sizes "
                        "(linattn.eval.recall_frontier)")
    p.add_argument("--kinds", type=_names, default=None, metavar="K[,K...]",
                   help="attention kinds (default: all): " + ",".join(EVAL_KINDS))
    p.add_argument("--tasks", type=_names, default=None, metavar="T[,T...]",
                   help=f"tasks of the --preset (default: all of them); per preset: {tasks}; a name before its "
                        "'-' (e.g. mqar) selects every setting of that task")
    p.add_argument("--seeds", type=_seeds, default=None, metavar="S[,S...]",
                   help="seeds (default: the preset's; the recall presets: 0,1,2)")
    p.add_argument("--steps", type=positive_int, default=None,
                   help="override every task's training steps (smoke tests)")
    p.add_argument("--threads", type=positive_int, default=None, metavar="T",
                   help="torch intra-op threads (per process with --jobs)")
    p.add_argument("--jobs", type=positive_int, default=1, metavar="J",
                   help="train J runs at once in separate processes (e.g. one per core with --threads 1); "
                        "results do not depend on it (default: %(default)s)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--restart", action="store_true",
                   help="recall presets: ignore the runs already in --out's recall-runs.jsonl and run everything "
                        "again (default: a re-run with the same --out skips the runs it finished)")
    p.add_argument("--report-only", action="store_true",
                   help="recall presets: train nothing; write the report of the runs already in --out's "
                        "recall-runs.jsonl (a partial report while a long run goes on)")
    add_common_options(p, dtype=False, seed=False)


def run_eval_command(args) -> int:
    """Trains one small model per attention kind × task × seed (fixed seeds) and prints one table of mean ± sd over
    seeds, with notes comparing the results to the literature (MQAR: softmax and Taylor solve it, elu+1 / FAVOR+ /
    cosFormer do not; copy: linear attention reaches softmax's loss). Writes eval.md, eval.json and eval.png to
    --out."""
    import torch
    from rich.console import Console

    from ..eval.suite import run_eval
    from ..eval.suite_report import table_rows, write_report
    from ..report import make_console, make_table, output_dir

    if args.threads and args.jobs == 1:
        torch.set_num_threads(args.threads)
    if args.preset.startswith("recall"):
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


def _previous_runs(path, console) -> list:
    """The records of an earlier run in recall-runs.jsonl at `path` ([] if none); a line cut short by
    a crash, or the record of a run that was interrupted, is dropped (and the file rewritten without
    it, so that new lines start on their own and the run is trained again)."""
    import json

    if not path.exists():
        return []
    out, good, dropped = [], [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            dropped = True
            console.print(f"[yellow]{path}: dropped an incomplete line[/]")
            continue
        if isinstance(record, dict) and record.get("status") == "interrupted":  # (written by older versions)
            dropped = True
            console.print(f"[yellow]{path}: dropped an interrupted run (it runs again)[/]")
            continue
        out.append(record)
        good.append(line)
    if dropped:
        path.write_text("".join(x + "\n" for x in good), encoding="utf-8")
    if out:
        console.print(f"resuming: {len(out)} finished run(s) in {path}")
    return out


def run_recall_command(args) -> int:
    """--preset recall / recall-frontier: linattn.eval.recall.run_recall, the table and the criteria,
    <preset>.{json,md,png}; a re-run with the same --out resumes from its <preset>-runs.jsonl."""
    import dataclasses
    import json

    from rich.console import Console

    from ..eval import recall, recall_frontier, recall_init
    from ..eval.recall_report import recall_table_rows, write_recall_report
    from ..report import make_console, make_table, output_dir

    if args.tasks is not None:
        print(f"linattn eval: error: --preset {args.preset} takes no --tasks (its MQAR settings are fixed; see "
              "linattn.eval.recall_frontier.RECALL_PRESETS)", file=sys.stderr)
        return 2
    # looked up now: tests shrink them
    presets = {"recall": recall.RECALL_PRESET, "recall-frontier": recall_frontier.RECALL_FRONTIER,
               "recall-init": recall_init.RECALL_INIT}
    preset = presets[args.preset]
    if args.steps is not None:
        preset = dataclasses.replace(preset, steps=args.steps, warmup_steps=min(preset.warmup_steps,
                                                                                max(1, args.steps // 10)))
    try:  # bad --kinds / --seeds: one line on stderr before any folder is made
        plan, _ = recall.recall_plan(preset, args.kinds, args.device, args.seeds)
    except ValueError as exc:
        print(f"linattn eval: error: {exc}", file=sys.stderr)
        return 2
    stem = args.preset
    console = make_console()
    out = output_dir(stem, args.out)
    partial = out / f"{stem}-runs.jsonl"  # one line per finished run, as they finish: survives a crash
    if args.report_only and (args.restart or not partial.exists()):
        print(f"linattn eval: error: --report-only reports the runs in {partial}, "
              f"{'which --restart would ignore' if args.restart else 'which does not exist'}", file=sys.stderr)
        return 2
    previous = [] if args.restart else _previous_runs(partial, console)
    if args.restart or not partial.exists():
        partial.write_text("", encoding="utf-8")
    todo = recall.runs_to_do(plan, previous)
    cpu_s = recall.estimate_cpu_s(todo)
    console.print(f"plan: {len(plan)} runs, {len(plan) - len(todo)} already in {partial.name}; the other {len(todo)} "
                  f"need about {cpu_s / 3600:.1f} CPU h at full step budgets (early stops make it less): "
                  f"~{cpu_s / 3600 / args.jobs:.1f} h with --jobs {args.jobs}"
                  + (" (--report-only: none is trained now)" if args.report_only else ""))

    def keep(record):
        if record.get("status") == "interrupted":  # not a finished run: a re-run trains it again
            return
        with partial.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    report, status = run_or_exit(lambda: recall.run_recall(
        preset, kinds=args.kinds, seeds=args.seeds, jobs=args.jobs, threads_per_job=args.threads or 1,
        device=args.device, progress=not args.quiet and not args.report_only, console=console, on_record=keep,
        done_records=previous, train=not args.report_only), console)
    if report is None:
        return status
    if args.preset == "recall-frontier":
        report["claims"] = recall_frontier.frontier_claims(report)
    if args.preset == "recall-init":
        report["init_findings"] = recall_init.init_findings(report)
    header, rows = recall_table_rows(report)
    table = make_table(f"linattn eval ({stem}): {report['description']}", header, rows,
                       caption=f"lr of {report['lrs']} with the best mean over seeds {report['seeds']}; "
                               f"{report['wall_s']:.0f} s; {report['resumed']} runs resumed"
                               + (f"; a partial report: {len(report['records'])} of {report['planned']} planned runs"
                                  if len(report["records"]) < report["planned"] else ""))

    def show(con):
        con.print(table)
        for c in report["criteria"]:
            ok = c["holds"] if c["holds_every_seed"] is not False else False
            colour = {True: "green", False: "red"}.get(ok, "dim")
            verdict = {True: "holds", False: "does not hold", None: "not run"}[c["holds"]]
            every = {True: "holds", False: "does not hold", None: "—"}[c["holds_every_seed"]]
            con.print(f"[{colour}]MQAR {tuple(c['setting'])}: {c['check']}: {verdict} on the mean, {every} on every "
                      f"seed ({c['seeds_holding']})[/] ({c['detail']})")
        for c in report.get("claims", []):
            colour = {True: "green", False: "red"}.get(c["holds"], "dim")
            verdict = {True: "holds", False: "does not hold", None: "not comparable"}[c["holds"]]
            con.print(f"[{colour}]MQAR {tuple(c['setting'])}: {c['claim']}: {verdict}[/] ({c['detail']})")
        for f in report.get("init_findings", []):
            verdict = "the slow range is better" if f["slow_better"] else "the slow range is not better"
            con.print(f"[{'green' if f['slow_better'] else 'yellow'}]{verdict}[/] ({f['detail']})")
        for line in report["skipped"]:
            con.print(f"[dim]{line}[/]")

    show(console)
    text = Console(file=io.StringIO(), width=200, record=True)
    show(text)
    (out / f"{stem}.txt").write_text(text.export_text(), encoding="utf-8")
    write_recall_report(report, out, stem)
    console.print(f"report: {out.resolve()} ({stem}.json, {stem}-runs.json, {stem}-runs.jsonl, {stem}.md, {stem}.png, "
                  f"{stem}.txt)")
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
