"""Gated linear attention against ungated, measured side by side in one run (issue 14's targets).

    .venv/bin/python benchmarks/ops_gated.py [--rounds 5] [--min-run-time 0.5] [--threads 2] [--json PATH]

fp32, B=1, H=8, D=F=E=64, causal, φ = elu+1 and normalize=False on both sides. The gates are
data-dependent and GLA-like, g = logsigmoid(x)/16 with x ~ N(0, 1): one per head and token (scalar,
Mamba2/SSD-style) or one per feature (vector, GLA). One table, each row: measured value, target,
PASS/FAIL:

  - fwd+bwd time, scalar-gated / ungated linear_attention at each N: ≤ 1.3×; vector-gated: ≤ 2.5×
    (the gated backward also returns ∂L/∂g);
  - scalar-gated forward throughput at the largest N as % of the torch.bmm peak on 64×64 tiles
    measured in the same run, FLOPs counted as benchmarks/ops_core.py counts them: ≥ 50%;
  - one recurrent step (inference, float32 state), scalar- and vector-gated / ungated: ≤ 1.2×;
  - peak fwd+bwd memory at the largest N beyond the output and the input gradients (dq, dk, dv, dg),
    as a multiple of q's size, scalar and vector: ≤ 2.

Measured in R interleaved rounds: each ratio is formed from timings taken next to each other in the
same round, and the table gives the median over rounds with the range (linattn.bench, as ops_core).
Exit status 0; with --strict, 1 when a row fails.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as Fn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ops_core import _spread, _stats, add_criteria_args, check, print_criteria  # noqa: E402  (the table helpers of the core benchmark)

from linattn.bench.flops import chunked_linear_flops, matmul_peak  # noqa: E402
from linattn.bench.methods import Shape, fwd_bwd_memory, make_inputs  # noqa: E402
from linattn.bench.timing import measure  # noqa: E402
from linattn.nn.feature_maps import EluPlusOne  # noqa: E402
from linattn.ops import gated_linear_attention, gated_linear_attention_step, linear_attention  # noqa: E402
from linattn.ops import linear_attention_step  # noqa: E402
from linattn.report import fmt_bytes, fmt_time, machine_info, make_console, progress, write_json  # noqa: E402

KINDS = ("ungated", "scalar", "vector")
LIMITS = {"scalar": 1.3, "vector": 2.5}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_criteria_args(p, lengths_help="N of the fwd+bwd rows", rounds=5)
    return p.parse_args(argv)


def gates(shape: Shape, n: int, kind: str, seed: int = 0) -> torch.Tensor | None:
    """g = logsigmoid(x)/16, (B, H, N) for scalar gates, (B, H, N, F) for vector gates; None ungated."""
    if kind == "ungated":
        return None
    gen = torch.Generator().manual_seed(seed * 1_000_003 + n + 1)
    feat = (shape.head_dim,) if kind == "vector" else ()
    return Fn.logsigmoid(torch.randn(shape.batch, shape.heads, n, *feat, generator=gen)) / 16


def attend(kind: str, fm, q, k, v, g):
    if kind == "ungated":
        return linear_attention(q, k, v, causal=True, feature_map=fm, normalize=False)
    return gated_linear_attention(q, k, v, g, feature_map=fm)


def forward_fn(kind: str, shape: Shape, n: int):
    q, k, v, _ = make_inputs(shape, n, torch.float32, "cpu")
    g, fm = gates(shape, n, kind), EluPlusOne(shape.head_dim)

    def fn():
        with torch.no_grad():
            return attend(kind, fm, q, k, v, g)

    return fn


def fwd_bwd_fn(kind: str, shape: Shape, n: int):
    """Forward, then the gradients of (o · do) with respect to q, k, v (and g). Returns (o, *grads); also q."""
    q, k, v, do = make_inputs(shape, n, torch.float32, "cpu", requires_grad=True)
    g, fm = gates(shape, n, kind), EluPlusOne(shape.head_dim)
    leaves = (q, k, v) if g is None else (q, k, v, g.requires_grad_())

    def fn():
        o = attend(kind, fm, q, k, v, g)
        return (o, *torch.autograd.grad(o, leaves, do))

    return fn, q


def step_fn(kind: str, shape: Shape):
    """One step from a random float32 state (ungated: (kv, z); gated: kv), under inference_mode."""
    gen = torch.Generator().manual_seed(0)
    b, h, d, e = shape.batch, shape.heads, shape.head_dim, shape.value_dim
    q, k, v = (torch.randn(b, h, 1, x, generator=gen) for x in (d, d, e))
    kv, z, fm = torch.randn(b, h, d, e, generator=gen), torch.rand(b, h, d, generator=gen) + 1, EluPlusOne(d)
    g = gates(shape, 1, kind)

    def fn():
        with torch.inference_mode():
            if kind == "ungated":
                return linear_attention_step((kv, z), q, k, v, feature_map=fm, normalize=False)
            return gated_linear_attention_step(kv, q, k, v, g, feature_map=fm)

    return fn


def measure_round(args, shape: Shape, first: bool) -> dict:
    """One round: at each N the three fwd+bwd timings next to each other; at the largest N the bmm
    peak and the forward timings; then the three steps. Memory in the first round only."""
    mrt, n_max = args.min_run_time, max(args.lengths)
    out = {"fwd_bwd": {kind: {} for kind in KINDS}, "fwd": {}, "step": {}, "memory": {}}
    for n in sorted(args.lengths):
        for kind in KINDS:
            fn, q = fwd_bwd_fn(kind, shape, n)
            out["fwd_bwd"][kind][n] = measure(fn, min_run_time=mrt, warmup=1).as_dict()
            if first and n == n_max and kind != "ungated":
                out["memory"][kind] = fwd_bwd_memory(fn, q, "cpu")
    out["peak"] = matmul_peak(torch.float32, "cpu", min_run_time=max(0.05, min(mrt, 0.5)))
    for kind in ("ungated", "scalar"):
        out["fwd"][kind] = measure(forward_fn(kind, shape, n_max), min_run_time=mrt, warmup=1).as_dict()
    for kind in KINDS:
        out["step"][kind] = measure(step_fn(kind, shape), min_run_time=mrt, warmup=3).as_dict()
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    console, shape = make_console(), Shape()
    n_max = max(args.lengths)
    rounds = []
    with progress(console) as bar:
        task = bar.add_task("ops gated", total=args.rounds)
        for r in range(args.rounds):
            bar.update(task, description=f"round {r + 1}/{args.rounds}")
            rounds.append(measure_round(args, shape, first=r == 0))
            bar.advance(task)

    rows, results = [], []

    def add(criterion, setting, values, measured, target, ok):
        med, lo, hi = _stats(values)
        rows.append([criterion, setting, measured, target, check(ok(med))])
        results.append({"criterion": criterion, "setting": setting, "measured": measured, "target": target,
                        "per_round": values, "median": med, "min": lo, "max": hi, "pass": bool(ok(med))})

    def median_s(*path):
        """The median over rounds of the timing at rnd[path[0]][path[1]]…"""
        return statistics.median(functools.reduce(lambda x, key: x[key], path, rnd)["median_s"] for rnd in rounds)

    for kind in ("scalar", "vector"):
        for n in args.lengths:
            ratios = [rnd["fwd_bwd"][kind][n]["median_s"] / rnd["fwd_bwd"]["ungated"][n]["median_s"] for rnd in rounds]
            t_g, t_u = median_s("fwd_bwd", kind, n), median_s("fwd_bwd", "ungated", n)
            add(f"fwd+bwd: {kind}-gated / ungated time", f"N={n}", ratios,
                f"{_spread(ratios)}× ({kind} {fmt_time(t_g)}, ungated {fmt_time(t_u)} ms)", f"≤ {LIMITS[kind]}×",
                lambda x, lim=LIMITS[kind]: x <= lim)
    flops = chunked_linear_flops(shape.batch, shape.heads, n_max, shape.head_dim, shape.value_dim, shape.chunk)
    pct = [100 * flops / rnd["fwd"]["scalar"]["median_s"] / 1e9 / rnd["peak"]["gflops"] for rnd in rounds]
    t_f = median_s("fwd", "scalar")
    peak = statistics.median(rnd["peak"]["gflops"] for rnd in rounds)
    add("scalar-gated fwd throughput, % of fp32 bmm peak", f"N={n_max}", pct,
        f"{_spread(pct, '{:.0f}')}% ({flops / t_f / 1e9:.1f} of {peak:.1f} GFLOP/s)", "≥ 50%", lambda x: x >= 50)
    for kind in ("scalar", "vector"):
        st = [rnd["step"][kind]["median_s"] / rnd["step"]["ungated"]["median_s"] for rnd in rounds]
        t_g, t_u = median_s("step", kind), median_s("step", "ungated")
        add(f"one-token step: {kind}-gated / ungated", "B=1 H=8 F=E=64", st,
            f"{_spread(st)}× ({kind} {fmt_time(t_g)}, ungated {fmt_time(t_u)} ms)", "≤ 1.2×", lambda x: x <= 1.2)
    for kind in ("scalar", "vector"):
        mem = rounds[0]["memory"][kind]
        add(f"fwd+bwd peak memory beyond o, dq, dk, dv, dg: {kind}", f"N={n_max}", [mem["extra_x_q"]],
            f"{mem['extra_x_q']:.2f}× q ({fmt_bytes(mem['extra_bytes'])} MiB)", "≤ 2× q", lambda x: x <= 2)

    n_pass = print_criteria(console, "linattn gated operators vs ungated (fp32, B=1 H=8 D=F=E=64, causal, elu+1, normalize=False)", rows, results, args.rounds)
    if args.json:
        write_json(args.json, {"machine": machine_info("cpu"), "args": vars(args), "rows": results, "rounds": [
            {**rnd, "fwd_bwd": {k: list(v.values()) for k, v in rnd["fwd_bwd"].items()}} for rnd in rounds]})
    return 1 if args.strict and n_pass < len(results) else 0


if __name__ == "__main__":
    sys.exit(main())
