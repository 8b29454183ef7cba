"""bf16 against fp32 on both ways of multiplying bf16 inputs, measured side by side in one run (issue 18).

    .venv/bin/python benchmarks/ops_bf16.py [--rounds 9] [--lengths 1024,4096,16384] [--threads 2]
                                            [--ops ungated,gated] [--min-run-time 0.3] [--clock wall|cpu]
                                            [--json PATH]

B=1, H=8, D=F=E=64, causal, φ = elu+1: `linear_attention` (normalized) and, with --ops gated,
`gated_linear_attention` with one GLA-like gate per head and token (g = logsigmoid(x)/16). For every
op, N and mode (forward without gradient, forward+backward) three calls are timed next to each other
in each round, in an order that rotates from round to round: fp32 inputs, bf16 inputs with
LINATTN_BF16_PATH=bf16 (bf16 gemms) and bf16 inputs with LINATTN_BF16_PATH=fp32 (blocks widened to
fp32 in cache, fp32 gemms). Each ratio fp32 time / bf16 time is formed within a round; the table gives
the median over rounds with the range. --clock cpu times the process's CPU time (time.process_time)
instead of the wall clock: with --threads 1 on a machine shared with other jobs it leaves out the time
the process waits for a core, the largest part of the noise there. The target, bf16 at least as fast as fp32 (≥ 1.0×), is judged
for the path this machine takes by default (printed above the table, with the reason: see
linattn.ops.precision).
Exit status 0; with --strict, 1 when a row of the default path fails.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as Fn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ops_core import _spread, check  # noqa: E402  (the table helpers of the core benchmark)
from torch.utils import benchmark  # noqa: E402

from linattn.bench.methods import Method, Shape, forward_fn, fwd_bwd_fn, make_inputs  # noqa: E402
from linattn.cli.args import int_list, positive_float, positive_int  # noqa: E402
from linattn.nn.feature_maps import EluPlusOne  # noqa: E402
from linattn.ops import gated_linear_attention, linear_attention, native, precision  # noqa: E402
from linattn.report import fmt_time, machine_info, make_console, make_table, progress, write_json  # noqa: E402

OPS = ("ungated", "gated")
VARIANTS = (("fp32", torch.float32, None), ("bf16·bf16 gemms", torch.bfloat16, "bf16"),
            ("bf16·fp32 gemms", torch.bfloat16, "fp32"))
MODES = (("fwd", "fwd", forward_fn), ("fwd_bwd", "fwd+bwd", fwd_bwd_fn))


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int_list, default=[1024, 4096, 16384], help="N (default: 1024,4096,16384)")
    p.add_argument("--ops", type=lambda s: [x for x in s.split(",") if x], default=["ungated"],
                   help=f"any of {','.join(OPS)} (default: ungated)")
    p.add_argument("--min-run-time", type=positive_float, default=0.3, help="seconds per timing (default: 0.3)")
    p.add_argument("--rounds", type=positive_int, default=9, help="interleaved rounds (default: 9)")
    p.add_argument("--threads", type=positive_int, default=2, help="torch threads (default: 2)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="wall: time.perf_counter (default); cpu: the process's CPU time (time.process_time)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the rows and raw timings as JSON")
    p.add_argument("--strict", action="store_true", help="exit 1 when a row of the default path fails")
    args = p.parse_args(argv)
    bad = [x for x in args.ops if x not in OPS]
    if bad:
        p.error(f"--ops: expected any of {OPS}, got {bad}")
    return args


def op_method(op: str, n: int) -> Method:
    """The call timed for `op`; the gated one draws its gates once per N, in q's dtype at call time."""
    fm = EluPlusOne(64)
    if op == "ungated":
        return Method(op, op, lambda q, k, v: linear_attention(q, k, v, causal=True, feature_map=fm))
    gen = torch.Generator().manual_seed(n)
    g = Fn.logsigmoid(torch.randn(1, 8, n, generator=gen)) / 16
    return Method(op, op, lambda q, k, v: gated_linear_attention(q, k, v, g.to(q.dtype), feature_map=fm))


def measure_round(args, shape: Shape, rnd: int) -> dict:
    """One round: for each op, N and mode the three variants timed one after the other, the order
    rotated by the round number. Returns {op: {n: {mode: {variant: seconds}}}}."""
    out: dict = {}
    order = [VARIANTS[(i + rnd) % len(VARIANTS)] for i in range(len(VARIANTS))]
    for op in args.ops:
        for n in args.lengths:
            method = op_method(op, n)
            for mode, _, make in MODES:
                for name, dtype, path in order:
                    if path is not None:
                        os.environ[precision.ENV] = path
                    q, k, v, do = make_inputs(shape, n, dtype, "cpu", requires_grad=mode == "fwd_bwd")
                    fn = make(method, q, k, v) if mode == "fwd" else make(method, q, k, v, do)
                    fn()  # warm-up: first calls, buffers
                    timer = benchmark.Timer("fn()", globals={"fn": fn}, num_threads=args.threads,
                                            timer=time.process_time if args.clock == "cpu" else time.perf_counter)
                    t = timer.blocked_autorange(min_run_time=args.min_run_time).median
                    out.setdefault(op, {}).setdefault(n, {}).setdefault(mode, {})[name] = t
                    os.environ.pop(precision.ENV, None)
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    console = make_console()
    saved = os.environ.pop(precision.ENV, None)  # the default path is judged: measured with the variable unset
    try:
        summary = native.bf16_summary()
        console.print(summary["line"], highlight=False, markup=False)
        default = (native.bf16_choice() if native.available() else precision.torch_choice()).label
        shape = Shape()
        rounds = []
        with progress(console) as bar:
            task = bar.add_task("bf16 vs fp32", total=args.rounds)
            for r in range(args.rounds):
                bar.update(task, description=f"round {r + 1}/{args.rounds}")
                rounds.append(measure_round(args, shape, r))
                bar.advance(task)
    finally:
        if saved is not None:
            os.environ[precision.ENV] = saved
    rows, results, n_fail = [], [], 0
    for op in args.ops:
        for n in args.lengths:
            for mode, label, _ in MODES:
                def per_round(name):
                    return [rnd[op][n][mode]["fp32"] / rnd[op][n][mode][name] for rnd in rounds]

                def med(name):
                    return statistics.median(rnd[op][n][mode][name] for rnd in rounds)

                ratios = {name: per_round(name) for name, _, _ in VARIANTS[1:]}
                judged = statistics.median(ratios[f"bf16·{default}"])
                ok = judged >= 1.0
                n_fail += not ok
                rows.append([op, f"N={n}", label, fmt_time(med("fp32")),
                             *(f"{fmt_time(med(name))} · {_spread(ratios[name])}×" for name, _, _ in VARIANTS[1:]),
                             f"{default}: ≥ 1.0×", check(ok)])
                results.append({"op": op, "n": n, "mode": mode, "median_s": {name: med(name) for name, _, _ in VARIANTS},
                                "fp32_over_bf16": ratios, "default_path": default, "pass": ok})
    console.print(make_table(
        "bf16 vs fp32 (B=1 H=8 D=F=E=64, causal, elu+1): time (ms) · fp32 time / bf16 time, median [min–max]",
        ["op", "N", "mode", "fp32", "bf16, bf16 gemms", "bf16, fp32 gemms (widened)", "target (default path)",
         "result"], rows,
        caption=f"{len(rows) - n_fail}/{len(rows)} PASS on the median of {args.rounds} interleaved rounds — "
                f"{machine_info(torch.device('cpu'))['cpu']}, threads: {torch.get_num_threads()}, "
                f"torch {torch.__version__}; each time a median of torch.utils.benchmark blocked_autorange, "
                f"{'process CPU time' if args.clock == 'cpu' else 'wall clock'}"))
    if args.json:
        write_json(args.json, {"machine": machine_info(torch.device("cpu")), "args": vars(args), "bf16": summary,
                               "rows": results, "rounds": rounds})
    return 1 if args.strict and n_fail else 0


if __name__ == "__main__":
    sys.exit(main())
