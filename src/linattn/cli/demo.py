"""`linattn demo`: agreement check, benchmarks, a minute of training, RNN-mode generation, a report.
Thin: options -> linattn.demo.run_demo -> report folder (summary.md, summary.json, PNG plots)."""

from __future__ import annotations

import sys

import torch

from .args import add_command, add_common_options, positive_float, positive_int, resolve_device, utf8_text


def add_parser(subparsers) -> None:
    p = add_command(subparsers, "demo", run_demo_command,
                    help="the whole library in a few minutes: agreement, benchmarks, training, generation, report",
                    epilog="examples: linattn demo | linattn demo --quick --out /tmp/demo | "
                           "linattn demo --train-seconds 120 --attention linear,linear,linear,softmax --threads 2")
    p.add_argument("--quick", action="store_true",
                   help="tiny settings that finish in seconds (a smoke test; numbers are not meaningful)")
    p.add_argument("--train-seconds", type=positive_float, default=60.0, metavar="SECONDS",
                   help="training time budget; the step count is fitted to it after timing a few steps "
                        "(default: %(default)s; ignored with --quick)")
    p.add_argument("--attention", default="linear", metavar="PATTERN",
                   help="layer kinds of the trained LM, repeated over its 4 layers, e.g. linear or "
                        "linear,linear,linear,softmax (default: %(default)s)")
    p.add_argument("--prompt", default="def ", type=utf8_text,
                   help="prompt of the generation step (default: %(default)r)")
    p.add_argument("--gen-bytes", type=positive_int, default=200, metavar="N",
                   help="bytes to generate in RNN mode (default: %(default)s)")
    p.add_argument("--threads", type=positive_int, default=None, metavar="T",
                   help="torch intra-op threads (default: torch's choice, usually one per core)")
    add_common_options(p)


def _pattern_error(pattern: str) -> str | None:
    kinds = [a.strip() for a in pattern.split(",") if a.strip()]
    if not kinds or any(k not in ("linear", "softmax") for k in kinds):
        return (f"--attention {pattern!r}: pass comma-separated layer kinds from linear, softmax, "
                "e.g. linear or linear,linear,linear,softmax")
    if 4 % len(kinds):
        return f"--attention {pattern!r}: the pattern repeats over 4 layers, so give 1, 2 or 4 kinds"
    return None


def run_demo_command(args) -> int:
    """Runs, with no input and in a few minutes on a 2-core CPU: (1) an agreement check of the chunked (parallel)
    operator, the recurrent step loop and the quadratic oracle in float64 for every feature map; (2) a short
    operator benchmark sweep and a per-token decoding sweep; (3) about a minute of training of a tiny byte-level LM
    on the Python standard library's source (read from the running interpreter), with validation bits per byte
    before and after; (4) text generated in RNN mode from a prompt; (5) a report folder (summary.md, summary.json,
    PNG plots, the trained model's run folder) whose path it prints."""
    from ..demo import DemoConfig, run_demo
    from ..report import make_console, output_dir

    if args.dtype == "float16":
        print("linattn demo: error: --dtype float16 is not supported (training has no loss scaling): pass --dtype "
              "float32 or --dtype bfloat16", file=sys.stderr)
        return 2
    err = _pattern_error(args.attention)
    if err:
        print(f"linattn demo: error: {err}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    cfg = DemoConfig(quick=args.quick, seed=args.seed, device=str(device), dtype=args.dtype,
                     train_seconds=args.train_seconds, attention=args.attention, prompt=args.prompt,
                     gen_bytes=args.gen_bytes)
    out = output_dir("demo", args.out)
    console = make_console()
    summary = run_demo(cfg, out, console, args)
    t = summary["timings_s"]["total"]
    console.print(f"[bold green]report:[/] {out.resolve()}  (summary.md, summary.json, bench-ops.png, "
                  f"bench-decode.png, training.png; {t:.0f} s in all)")
    if not summary["agreement_ok"]:
        console.print("[bold red]agreement check failed[/]: see the table above and summary.json")
        return 1
    return 0
