"""The delta rule's speed and memory criteria (issue 15), measured side by side in one run.

    .venv/bin/python benchmarks/ops_delta.py [--rounds 3] [--min-run-time 0.5] [--threads 2] [--json PATH]

fp32, B=1, H=8, D=E=64, chunks of 64; DeltaNet = linattn.delta_rule(qk_l2norm=True), Gated DeltaNet
adds g = logsigmoid(N(0, 1)) (strong decay: mean −0.8 per token); β = sigmoid(N(0, 1)). One table,
each row: measured value, target, PASS/FAIL:

  - fwd+bwd time of DeltaNet / ungated linear_attention(causal, normalize=False, φ identity) at
    N = 4096 and 16384: ≤ 3×; Gated DeltaNet: ≤ 3.5×;
  - one decoding step (delta_rule_step, B=1, H=8) / linear_attention_step(normalize=False): ≤ 1.5×,
    DeltaNet and Gated DeltaNet;
  - fwd+bwd peak memory at the largest N beyond the output and the input gradients (q, k, v, β, g),
    as a multiple of q's size: ≤ 3×.

As in benchmarks/ops_core.py (whose helpers this reuses), everything is measured in R interleaved
rounds: each ratio is formed from two timings taken next to each other in the same round, and the
table gives the median over rounds with the range. Exit status 0; with --strict, 1 when a row fails.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from linattn.bench.memory import nbytes, peak_memory
from linattn.bench.methods import Shape, make_inputs
from linattn.bench.timing import measure
from linattn.ops import delta_rule, delta_rule_step, linear_attention, linear_attention_step
from linattn.report import fmt_bytes, fmt_time, machine_info, make_console, progress, write_json


def _ops_core():
    """benchmarks/ops_core.py, for its PASS/FAIL and median-over-rounds helpers."""
    spec = importlib.util.spec_from_file_location("ops_core", Path(__file__).with_name("ops_core.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


core = _ops_core()
VARIANTS = {"linear": "linear (ungated)", "deltanet": "DeltaNet", "gated": "Gated DeltaNet"}
TARGETS = {"deltanet": 3.0, "gated": 3.5}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    core.add_criteria_args(p, lengths_help="N for the fwd+bwd ratios", rounds=3)
    return p.parse_args(argv)


def gates(shape: Shape, n: int, seed: int = 0):
    """β = sigmoid(N(0, 1)) and g = logsigmoid(N(0, 1)), (B, H, N) fp32."""
    gen = torch.Generator().manual_seed(seed * 7 + n)
    size = (shape.batch, shape.heads, n)
    return torch.sigmoid(torch.randn(size, generator=gen)), F.logsigmoid(torch.randn(size, generator=gen))


def fwd_bwd_fn(variant: str, shape: Shape, n: int):
    """Forward, then the gradients of (o · do) w.r.t. every input; returns (o, *gradients)."""
    q, k, v, do = make_inputs(shape, n, torch.float32, "cpu", requires_grad=True)
    beta, g = (x.requires_grad_() for x in gates(shape, n))

    def fn():
        if variant == "linear":
            o = linear_attention(q, k, v, causal=True, normalize=False, chunk_size=shape.chunk)
            return (o, *torch.autograd.grad(o, (q, k, v), do))
        gg = g if variant == "gated" else None
        o = delta_rule(q, k, v, beta, g=gg, qk_l2norm=True, chunk_size=shape.chunk)
        wrt = (q, k, v, beta) + ((gg,) if gg is not None else ())
        return (o, *torch.autograd.grad(o, wrt, do))

    return fn, q


def step_fn(variant: str, shape: Shape):
    """One decoding step from a state (B, H, D, E) under inference_mode."""
    q, k, v, _ = make_inputs(shape, 1, torch.float32, "cpu", seed=1)
    beta, g = gates(shape, 1, seed=1)
    state = torch.randn(shape.batch, shape.heads, shape.head_dim, shape.value_dim) * 0.1
    z = torch.ones(shape.batch, shape.heads, shape.head_dim)  # unused without normalization

    def fn():
        with torch.inference_mode():
            if variant == "linear":
                return linear_attention_step((state, z), q, k, v, normalize=False)
            return delta_rule_step(state, q, k, v, beta, g=g if variant == "gated" else None, qk_l2norm=True)

    return fn


def measure_round(args, shape: Shape, first: bool) -> dict:
    """One round: at each N the three variants' fwd+bwd back to back, then the three steps. The
    memory of the largest N is measured in the first round only."""
    mrt, n_max = args.min_run_time, max(args.lengths)
    raw = {"fwd_bwd": {v: {} for v in VARIANTS}, "step": {}, "memory": {}}
    for n in sorted(args.lengths):
        for variant in VARIANTS:
            fn, q = fwd_bwd_fn(variant, shape, n)
            raw["fwd_bwd"][variant][n] = measure(fn, min_run_time=mrt).as_dict()
            if first and n == n_max and variant != "linear":
                peak, result = peak_memory(fn)
                extra = max(0, peak - nbytes(*result))
                raw["memory"][variant] = {"peak_bytes": peak, "extra_bytes": extra, "extra_x_q": extra / nbytes(q)}
    for variant in VARIANTS:
        raw["step"][variant] = measure(step_fn(variant, shape), min_run_time=mrt, warmup=3).as_dict()
    return raw


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    console = make_console()
    shape = Shape()
    rounds = []
    with progress(console) as bar:
        task = bar.add_task("ops delta", total=args.rounds)
        for r in range(args.rounds):
            bar.update(task, description=f"round {r + 1}/{args.rounds}")
            rounds.append(measure_round(args, shape, first=r == 0))
            bar.advance(task)

    rows, results = [], []

    def add(criterion, setting, values, measured, target, ok):
        med, lo, hi = core._stats(values)
        rows.append([criterion, setting, measured, target, core.check(ok(med))])
        results.append({"criterion": criterion, "setting": setting, "measured": measured, "target": target,
                        "per_round": values, "median": med, "min": lo, "max": hi, "pass": bool(ok(med))})

    def med_time(kind, variant, n=None):
        return fmt_time(statistics.median((rnd[kind][variant] if n is None else rnd[kind][variant][n])["median_s"]
                                          for rnd in rounds))

    for variant, limit in TARGETS.items():
        for n in sorted(args.lengths):
            ratios = [rnd["fwd_bwd"][variant][n]["median_s"] / rnd["fwd_bwd"]["linear"][n]["median_s"] for rnd in rounds]
            add(f"{VARIANTS[variant]} fwd+bwd / linear", f"N={n}", ratios,
                f"{core._spread(ratios)}× ({VARIANTS[variant]} {med_time('fwd_bwd', variant, n)}, "
                f"linear {med_time('fwd_bwd', 'linear', n)} ms)", f"≤ {limit}×", lambda x, lim=limit: x <= lim)
    for variant in TARGETS:
        ratios = [rnd["step"][variant]["median_s"] / rnd["step"]["linear"]["median_s"] for rnd in rounds]
        add(f"{VARIANTS[variant]} step / linear step", "one token", ratios,
            f"{core._spread(ratios)}× ({med_time('step', variant)}, linear {med_time('step', 'linear')} ms)",
            "≤ 1.5×", lambda x: x <= 1.5)
    n_max = max(args.lengths)
    for variant in TARGETS:
        mem = rounds[0]["memory"][variant]
        add(f"{VARIANTS[variant]} fwd+bwd memory beyond o, grads", f"N={n_max}",
            [mem["extra_x_q"]], f"{mem['extra_x_q']:.2f}× q ({fmt_bytes(mem['extra_bytes'])} MiB)", "≤ 3× q",
            lambda x: x <= 3)

    n_pass = core.print_criteria(console, "linattn delta rule: speed and memory criteria (fp32, B=1 H=8 D=E=64, chunks of 64, qk_l2norm)", rows, results, args.rounds)
    if args.json:
        write_json(args.json, {"machine": machine_info("cpu"), "args": vars(args), "rows": results, "rounds": [
            {**rnd, "fwd_bwd": {v: list(t.values()) for v, t in rnd["fwd_bwd"].items()}} for rnd in rounds]})
    return 1 if args.strict and n_pass < len(results) else 0


if __name__ == "__main__":
    sys.exit(main())
