"""Core acceptance criteria of the linear-attention operators, measured side by side in one run.

    .venv/bin/python benchmarks/ops_core.py [--min-run-time 0.5] [--threads T] [--json PATH]

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

Everything is measured with linattn.bench (the code behind `linattn bench ops|decode`).
Exit status 0; with --strict, 1 when a row fails.
"""

from __future__ import annotations

import argparse
import sys

import torch

from linattn.bench.decode import kv_cache_fn, linear_step_fn
from linattn.bench.flops import matmul_peak
from linattn.bench.methods import Shape, core_methods, measure_method
from linattn.bench.timing import measure
from linattn.cli import int_list, positive_float, positive_int
from linattn.report import fmt_bytes, fmt_time, machine_info, make_console, make_table, progress, write_json

LENGTHS = [256, 512, 1024, 2048, 4096, 8192, 16384]


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int_list, default=LENGTHS, help="N for chunked vs SDPA (default: 256…16384)")
    p.add_argument("--bf16-lengths", type=int_list, default=[4096, 16384],
                   help="N for bf16 vs fp32 (default: 4096,16384)")
    p.add_argument("--cache", type=positive_int, default=1024, help="KV-cache length for the step row (default: 1024)")
    p.add_argument("--min-run-time", type=positive_float, default=0.5, help="seconds per timing (default: 0.5)")
    p.add_argument("--threads", type=positive_int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the rows and raw measurements as JSON")
    p.add_argument("--strict", action="store_true", help="exit 1 when any row fails")
    return p.parse_args(argv)


def check(ok: bool) -> str:
    return "[green]PASS[/]" if ok else "[red]FAIL[/]"


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    console = make_console()
    shape, dev, mrt = Shape(), torch.device("cpu"), args.min_run_time
    methods = {m.key: m for m in core_methods(torch.float32, recurrent_max=None, quadratic_max=None)}
    n_max = max(args.lengths)
    chunked_ns = sorted(set(args.lengths) | {max(1, n_max // 2)} | set(args.bf16_lengths))
    raw = {"chunked": {}, "softmax": {}, "chunked_bf16": {}}
    with console.status("measuring the bmm peaks"):
        peaks = {d: matmul_peak(getattr(torch, d), dev, min_run_time=max(0.05, min(mrt, 0.5)))
                 for d in ("float32", "bfloat16")}
    gflops = {k: v["gflops"] for k, v in peaks.items()}
    jobs = [("chunked", n) for n in chunked_ns] + [("softmax", n) for n in args.lengths]
    jobs += [("chunked_bf16", n) for n in args.bf16_lengths]
    with progress(console) as bar:
        task = bar.add_task("ops core", total=len(jobs) + 1)
        for key, n in jobs:
            bar.update(task, description=f"{key} N={n}")
            modes = ("fwd_bwd",) if key == "softmax" else ("fwd", "fwd_bwd")
            raw[key][n] = measure_method(methods[key], shape, n, dtype=torch.float32, device=dev, min_run_time=mrt,
                                         modes=modes, memory=(key == "chunked" and n == n_max), peaks=gflops)
            bar.advance(task)
        bar.update(task, description=f"decode step vs SDPA over {args.cache}")
        step = measure(linear_step_fn(shape, torch.float32, dev), min_run_time=mrt, warmup=3)
        cache = measure(kv_cache_fn(shape, args.cache, torch.float32, dev), min_run_time=mrt, warmup=3)
        bar.advance(task)

    rows, results = [], []

    def add(criterion, setting, measured, target, ok):
        rows.append([criterion, setting, measured, target, check(ok)])
        results.append({"criterion": criterion, "setting": setting, "measured": measured, "target": target,
                        "pass": bool(ok)})

    def t(key, n, mode):
        r = raw[key].get(n)
        return None if r is None or r.get(mode) is None else r[mode]["median_s"]

    for n in args.lengths:
        lin, sm = t("chunked", n, "fwd_bwd"), t("softmax", n, "fwd_bwd")
        target = 20.0 if n >= 16384 else 1.0
        ratio = sm / lin
        add("fwd+bwd: SDPA time / chunked time", f"N={n}",
            f"{ratio:.2f}× (chunked {fmt_time(lin)}, SDPA {fmt_time(sm)} ms)", f"{'≥ 20×' if target > 1 else '> 1×'}",
            ratio >= target if target > 1 else ratio > 1)
    fwd = raw["chunked"][n_max]["fwd"]
    add("fwd throughput, % of fp32 bmm peak", f"N={n_max}",
        f"{fwd['pct_peak']:.0f}% ({fwd['gflops']:.1f} of {gflops['float32']:.1f} GFLOP/s)", "≥ 50%",
        fwd["pct_peak"] >= 50)
    for mode, name in (("fwd", "fwd"), ("fwd_bwd", "fwd+bwd")):
        a, b = t("chunked", n_max, mode), t("chunked", n_max // 2, mode)
        add(f"linearity {name}: t(N)/t(N/2)", f"N={n_max}", f"{a / b:.2f} ({fmt_time(a)} / {fmt_time(b)} ms)",
            "≤ 2.3", a / b <= 2.3)
    mem = raw["chunked"][n_max]["memory"]
    add("fwd+bwd peak memory beyond o, dq, dk, dv", f"N={n_max}",
        f"{mem['extra_x_q']:.2f}× q ({fmt_bytes(mem['extra_bytes'])} MiB)", "≤ 2× q", mem["extra_x_q"] <= 2)
    for n in args.bf16_lengths:
        for mode, name in (("fwd", "fwd"), ("fwd_bwd", "fwd+bwd")):
            f32, b16 = t("chunked", n, mode), t("chunked_bf16", n, mode)
            add(f"bf16 vs fp32 {name}: fp32 time / bf16 time", f"N={n}",
                f"{f32 / b16:.2f}× (bf16 {fmt_time(b16)}, fp32 {fmt_time(f32)} ms)", "> 1× (bf16 faster)",
                f32 / b16 > 1)
    add(f"recurrent step / SDPA 1 query over {args.cache}-token cache", "B=1 H=8 F=E=64",
        f"{step.median / cache.median:.2f} (step {fmt_time(step.median)}, SDPA {fmt_time(cache.median)} ms)", "≤ 1/3",
        step.median <= cache.median / 3)

    n_pass = sum(r["pass"] for r in results)
    console.print(make_table(
        "linattn operators: core criteria (fp32 unless noted, B=1 H=8 D=F=E=64, causal, normalized elu+1)",
        ["criterion", "setting", "measured", "target", "result"], rows,
        caption=f"{n_pass}/{len(results)} PASS — {machine_info(dev)['cpu']}, threads: {torch.get_num_threads()}, "
                f"torch {torch.__version__}; times are medians of torch.utils.benchmark blocked_autorange"))
    if args.json:
        write_json(args.json, {"machine": machine_info(dev), "args": vars(args), "peaks": peaks, "rows": results,
                               "raw": {k: list(v.values()) for k, v in raw.items()},
                               "decode": {"step": step.as_dict(), "kv_cache": cache.as_dict()}})
    return 1 if args.strict and n_pass < len(results) else 0


if __name__ == "__main__":
    sys.exit(main())
