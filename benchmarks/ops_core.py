"""Core acceptance criteria of the linear-attention operators, measured side by side in one run.

    .venv/bin/python benchmarks/ops_core.py [--rounds 3] [--min-run-time 0.5] [--threads T] [--json PATH]

fp32, B=1, H=8, D=F=E=64, causal, normalized elu+1. One table, each row: measured value, target,
PASS/FAIL:

  - fwd+bwd time of chunked linear vs F.scaled_dot_product_attention(is_causal=True) at every N:
    faster from the smallest N, ≥ 20× at 16384;
  - forward throughput at the largest N as % of the measured torch.bmm peak on 64×64 tiles, FLOPs
    2·N·(2·F·E + 64·F + 64·E) per head: ≥ 50%;
  - linearity t(N)/t(N/2) at the largest N, forward and fwd+bwd: ≤ 2.3;
  - peak fwd+bwd memory at the largest N beyond the output and the three input grads, as a multiple
    of q's size: ≤ 2;
  - bf16 vs fp32, forward and fwd+bwd, at 4096 and 16384: bf16 faster;
  - one recurrent step (B=1, H=8, F=E=64) vs SDPA of one query over a 1024-token KV cache: ≤ 1/3.

On a machine shared with other jobs single timings swing by tens of percent, so everything is
measured in R interleaved rounds: each ratio is formed from two timings taken next to each other in
the same round, and the table gives the median over rounds with the range. Everything is measured
with linattn.bench (the code behind `linattn bench ops|decode`).
Exit status 0; with --strict, 1 when a row fails.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from linattn.bench.decode import kv_cache_fn, linear_step_fn
from linattn.bench.flops import matmul_peak
from linattn.bench.methods import Shape, core_methods, measure_method
from linattn.bench.timing import measure
from linattn.cli.args import int_list, positive_float, positive_int
from linattn.report import fmt_bytes, fmt_time, machine_info, make_console, make_table, progress, write_json

LENGTHS = [256, 512, 1024, 2048, 4096, 8192, 16384]


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int_list, default=LENGTHS, help="N for chunked vs SDPA (default: 256…16384)")
    p.add_argument("--bf16-lengths", type=int_list, default=[4096, 16384],
                   help="N for bf16 vs fp32 (default: 4096,16384)")
    p.add_argument("--cache", type=positive_int, default=1024, help="KV-cache length for the step row (default: 1024)")
    p.add_argument("--min-run-time", type=positive_float, default=0.5, help="seconds per timing (default: 0.5)")
    p.add_argument("--rounds", type=positive_int, default=3,
                   help="interleaved rounds; each ratio is formed within a round, PASS judged on the median (default: 3)")
    p.add_argument("--threads", type=positive_int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the rows and raw measurements as JSON")
    p.add_argument("--strict", action="store_true", help="exit 1 when any row fails")
    return p.parse_args(argv)


def check(ok: bool) -> str:
    return "[green]PASS[/]" if ok else "[red]FAIL[/]"


def _stats(values: list[float]) -> tuple[float, float, float]:
    """(median, min, max) of the per-round values."""
    vals = sorted(values)
    return statistics.median(vals), vals[0], vals[-1]


def _spread(values: list[float], fmt: str = "{:.2f}") -> str:
    med, lo, hi = _stats(values)
    return fmt.format(med) if len(values) == 1 else f"{fmt.format(med)} [{fmt.format(lo)}–{fmt.format(hi)}]"


def measure_round(args, methods, shape, dev, first: bool) -> dict:
    """One round: every (method, N) once, in order of N, so that the two sides of each ratio are
    timed next to each other; right before the largest N, the bmm peak and the chunked op at N/2
    once more (the linearity pair); then the decode step and the SDPA it is compared with. The fwd+bwd memory is measured in the first round only."""
    mrt, n_max = args.min_run_time, max(args.lengths)
    chunked_ns = sorted(set(args.lengths) | {max(1, n_max // 2)} | set(args.bf16_lengths))
    raw = {"chunked": {}, "softmax": {}, "chunked_bf16": {}}
    peaks = None
    for n in chunked_ns:
        jobs = [("chunked", ("fwd", "fwd_bwd"))]
        if n == n_max:
            peaks = {d: matmul_peak(getattr(torch, d), dev, min_run_time=max(0.05, min(mrt, 0.5)))
                     for d in ("float32", "bfloat16")}
            # N/2 once more, right before N, for the linearity ratio
            raw["chunked_half"] = {n: measure_method(methods["chunked"], shape, max(1, n // 2), dtype=torch.float32,
                                                     device=dev, min_run_time=mrt, modes=("fwd", "fwd_bwd"),
                                                     memory=False)}
        gflops = None if peaks is None else {k: v["gflops"] for k, v in peaks.items()}
        if n in args.lengths:
            jobs.append(("softmax", ("fwd_bwd",)))
        if n in args.bf16_lengths:
            jobs.append(("chunked_bf16", ("fwd", "fwd_bwd")))
        for key, modes in jobs:
            raw[key][n] = measure_method(methods[key], shape, n, dtype=torch.float32, device=dev, min_run_time=mrt,
                                         modes=modes, memory=first and key == "chunked" and n == n_max, peaks=gflops)
    step = measure(linear_step_fn(shape, torch.float32, dev), min_run_time=mrt, warmup=3)
    cache = measure(kv_cache_fn(shape, args.cache, torch.float32, dev), min_run_time=mrt, warmup=3)
    return {"peaks": peaks, "raw": raw, "step": step.as_dict(), "kv_cache": cache.as_dict()}




def add_criteria_args(p, *, lengths_help: str, rounds: int) -> None:
    """The options the criteria benchmarks of the gated and delta-rule operators share."""
    p.add_argument("--lengths", type=int_list, default=[4096, 16384], help=f"{lengths_help} (default: 4096,16384)")
    p.add_argument("--min-run-time", type=positive_float, default=0.5, help="seconds per timing (default: 0.5)")
    p.add_argument("--rounds", type=positive_int, default=rounds,
                   help=f"interleaved rounds; each ratio is formed within a round, PASS judged on the median (default: {rounds})")
    p.add_argument("--threads", type=positive_int, default=2, help="torch threads (default: 2)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the rows and raw measurements as JSON")
    p.add_argument("--strict", action="store_true", help="exit 1 when any row fails")

def print_criteria(console, title: str, rows: list, results: list, rounds: int, device: str = "cpu") -> int:
    """The criteria table (criterion, setting, measured, target, result) with its PASS count and the
    machine in the caption; returns the number of rows that pass."""
    n_pass = sum(r["pass"] for r in results)
    console.print(make_table(
        title, ["criterion", "setting", "measured: median of rounds [min–max]", "target", "result"], rows,
        caption=f"{n_pass}/{len(results)} PASS on the median of {rounds} interleaved round"
                f"{'s' if rounds > 1 else ''} — {machine_info(device)['cpu']}, threads: {torch.get_num_threads()}, "
                f"torch {torch.__version__}; each time a median of torch.utils.benchmark blocked_autorange, "
                "each ratio formed within a round"))
    return n_pass

def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    console = make_console()
    shape, dev = Shape(), torch.device("cpu")
    methods = {m.key: m for m in core_methods(torch.float32, recurrent_max=None, quadratic_max=None)}
    n_max = max(args.lengths)
    rounds = []
    with progress(console) as bar:
        task = bar.add_task("ops core", total=args.rounds)
        for r in range(args.rounds):
            bar.update(task, description=f"round {r + 1}/{args.rounds}")
            rounds.append(measure_round(args, methods, shape, dev, first=r == 0))
            bar.advance(task)

    rows, results = [], []

    def add(criterion, setting, values, measured, target, ok):
        """values: the criterion's number in each round; PASS is judged on their median."""
        med, lo, hi = _stats(values)
        rows.append([criterion, setting, measured, target, check(ok(med))])
        results.append({"criterion": criterion, "setting": setting, "measured": measured, "target": target,
                        "per_round": values, "median": med, "min": lo, "max": hi, "pass": bool(ok(med))})

    def t(rnd, key, n, mode):
        return rnd["raw"][key][n][mode]["median_s"]

    def times(key, n, mode):
        return fmt_time(statistics.median(t(rnd, key, n, mode) for rnd in rounds))

    for n in args.lengths:
        ratios = [t(rnd, "softmax", n, "fwd_bwd") / t(rnd, "chunked", n, "fwd_bwd") for rnd in rounds]
        target = 20.0 if n >= 16384 else 1.0
        add("fwd+bwd: SDPA time / chunked time", f"N={n}", ratios,
            f"{_spread(ratios)}× (chunked {times('chunked', n, 'fwd_bwd')}, SDPA {times('softmax', n, 'fwd_bwd')} ms)",
            "≥ 20×" if target > 1 else "> 1×", (lambda x: x >= target) if target > 1 else (lambda x: x > 1))
    pct = [rnd["raw"]["chunked"][n_max]["fwd"]["pct_peak"] for rnd in rounds]
    rate = statistics.median(rnd["raw"]["chunked"][n_max]["fwd"]["gflops"] for rnd in rounds)
    peak = statistics.median(rnd["peaks"]["float32"]["gflops"] for rnd in rounds)
    add("fwd throughput, % of fp32 bmm peak", f"N={n_max}", pct,
        f"{_spread(pct, '{:.0f}')}% ({rate:.1f} of {peak:.1f} GFLOP/s)", "≥ 50%", lambda x: x >= 50)
    for mode, name in (("fwd", "fwd"), ("fwd_bwd", "fwd+bwd")):
        lin = [t(rnd, "chunked", n_max, mode) / t(rnd, "chunked_half", n_max, mode) for rnd in rounds]
        add(f"linearity {name}: t(N)/t(N/2)", f"N={n_max}", lin,
            f"{_spread(lin)} ({times('chunked', n_max, mode)} / {times('chunked_half', n_max, mode)} ms)",
            "≤ 2.3", lambda x: x <= 2.3)
    mem = rounds[0]["raw"]["chunked"][n_max]["memory"]
    add("fwd+bwd peak memory beyond o, dq, dk, dv", f"N={n_max}", [mem["extra_x_q"]],
        f"{mem['extra_x_q']:.2f}× q ({fmt_bytes(mem['extra_bytes'])} MiB)", "≤ 2× q", lambda x: x <= 2)
    for n in args.bf16_lengths:
        for mode, name in (("fwd", "fwd"), ("fwd_bwd", "fwd+bwd")):
            sp = [t(rnd, "chunked", n, mode) / t(rnd, "chunked_bf16", n, mode) for rnd in rounds]
            add(f"bf16 vs fp32 {name}: fp32 time / bf16 time", f"N={n}", sp,
                f"{_spread(sp)}× (bf16 {times('chunked_bf16', n, mode)}, fp32 {times('chunked', n, mode)} ms)",
                "> 1× (bf16 faster)", lambda x: x > 1)
    st = [rnd["step"]["median_s"] / rnd["kv_cache"]["median_s"] for rnd in rounds]
    step_t = statistics.median(rnd["step"]["median_s"] for rnd in rounds)
    cache_t = statistics.median(rnd["kv_cache"]["median_s"] for rnd in rounds)
    add(f"recurrent step / SDPA 1 query over {args.cache}-token cache", "B=1 H=8 F=E=64", st,
        f"{_spread(st)} (step {fmt_time(step_t)}, SDPA {fmt_time(cache_t)} ms)", "≤ 1/3", lambda x: x <= 1 / 3)

    n_pass = print_criteria(
        console, "linattn operators: core criteria (fp32 unless noted, B=1 H=8 D=F=E=64, causal, normalized elu+1)",
        rows, results, args.rounds, dev)
    if args.json:
        write_json(args.json, {"machine": machine_info(dev), "args": vars(args), "rows": results,
                               "rounds": [{**rnd, "raw": {k: list(v.values()) for k, v in rnd["raw"].items()}}
                                          for rnd in rounds]})
    return 1 if args.strict and n_pass < len(results) else 0


if __name__ == "__main__":
    sys.exit(main())
