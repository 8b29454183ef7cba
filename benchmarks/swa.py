"""Sliding-window softmax attention (W = 64) against linear attention and against SDPA with a band
mask: forward + backward time, ratios side by side in one run.

    .venv/bin/python benchmarks/swa.py [--lengths 4096,16384] [--window 64] [--threads 1]
                                       [--rounds 3] [--block-time 0.5] [--max-mask-mib 256] [--json PATH]

Shapes: B = 1, H = 8, D = E = 64, fp32, causal. Methods, each `o = f(q, k, v); o.sum().backward()`:

    linear     linattn.linear_attention (elu+1, chunk 64; the fused CPU kernels where built)
    swa        linattn.ops.swa.sliding_window_attention, its default block (CPU fp32: linattn's kernels,
               csrc/swa.cpp, with query blocks of 16 for W ≤ 64, 32 above: ops.swa.cpu.native_chunk)
    swa-c64    the same with query blocks of 64 (span 127 keys at W = 64); swa-c32: of 32 (span 95),
               swa-c16: of 16 (span 79)
    swa-flash  the CPU path before linattn's kernels: torch's flash kernel on padded spans (chunk 64)
    swa-torch  the torch-op path (the Function of linattn.ops.swa.chunked, other devices' path)
    sdpa-band  torch's scaled_dot_product_attention with an N×N additive band mask (the quadratic way;
               skipped where the mask would pass --max-mask-mib)

Every (method, N) point is timed in interleaved rounds (a short torch.utils.benchmark block each),
so that a machine shared with other jobs loads them alike; reported: the median over all blocks and
the best block, and each one's ratio to linear attention at the same N. Target (issue 27): swa
within 1.5× of linear attention at N = 4096 and 16384.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics

import torch
import torch.nn.functional as F
import torch.utils.benchmark as tb

import linattn
from linattn.ops.swa import chunked, cpu, sliding_window_attention

METHODS = ("linear", "swa", "swa-c64", "swa-c32", "swa-c16", "swa-flash", "swa-torch", "sdpa-band")


def band_bias(n: int, window: int) -> torch.Tensor:
    i, j = torch.arange(n)[:, None], torch.arange(n)[None]
    return torch.zeros(n, n).masked_fill_(~((j <= i) & (j > i - window)), float("-inf"))


def step_fn(method: str, q, k, v, window: int, bias):
    def swa(chunk: int | None, fused: bool, own: bool = True):
        def run():
            old, chunked.FUSED_CPU = chunked.FUSED_CPU, fused
            old_own, cpu.NATIVE = cpu.NATIVE, own
            try:
                sliding_window_attention(q, k, v, window=window, chunk_size=chunk).sum().backward()
            finally:
                chunked.FUSED_CPU, cpu.NATIVE = old, old_own
        return run

    if method == "linear":
        return lambda: linattn.linear_attention(q, k, v, causal=True).sum().backward()
    if method == "swa":
        return swa(None, True)
    if method in ("swa-c64", "swa-c32", "swa-c16"):
        return swa(int(method[5:]), True)
    if method == "swa-flash":
        return swa(64, True, own=False)
    if method == "swa-torch":
        return swa(64, False)
    return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias).sum().backward()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="4096,16384")
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--block-time", type=float, default=0.5)
    ap.add_argument("--max-mask-mib", type=float, default=256)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    lengths = [int(x) for x in args.lengths.split(",")]
    methods = [m for m in args.methods.split(",") if m]
    g = torch.Generator().manual_seed(0)
    points = {}
    for n in lengths:
        q, k, v = (torch.randn(1, 8, n, 64, generator=g).requires_grad_() for _ in range(3))
        fits = n * n * 4 / 2 ** 20 <= args.max_mask_mib
        bias = band_bias(n, args.window) if fits and "sdpa-band" in methods else None
        for m in methods:
            if m == "sdpa-band" and bias is None:
                continue
            fn = step_fn(m, q, k, v, args.window, bias)
            fn()  # warm-up (builds the native kernels once)
            points[(m, n)] = (fn, [])
    for _ in range(args.rounds):
        for (m, n), (fn, times) in points.items():
            t = tb.Timer("fn()", globals={"fn": fn}, num_threads=args.threads).blocked_autorange(
                min_run_time=args.block_time)
            times.extend(t.times)
    rows = []
    for n in lengths:
        base = points.get(("linear", n))
        base_med = statistics.median(base[1]) if base else None
        base_min = min(base[1]) if base else None
        for m in methods:
            if (m, n) not in points:
                rows.append(dict(method=m, n=n, skipped="mask over --max-mask-mib"))
                continue
            ts = points[(m, n)][1]
            med, best = statistics.median(ts), min(ts)
            rows.append(dict(method=m, n=n, median_ms=med * 1e3, min_ms=best * 1e3,
                             ratio_median=med / base_med if base_med else None,
                             ratio_min=best / base_min if base_min else None))
    print(f"fwd+bwd, B=1 H=8 D=64 fp32, W={args.window}, {args.threads} thread(s), {platform.processor() or 'cpu'}")
    print(f"{'method':<10} {'N':>6} {'median ms':>10} {'min ms':>9} {'×linear (med)':>14} {'×linear (min)':>14}")
    for r in rows:
        if "skipped" in r:
            print(f"{r['method']:<10} {r['n']:>6}   skipped: {r['skipped']}")
            continue
        print(f"{r['method']:<10} {r['n']:>6} {r['median_ms']:>10.1f} {r['min_ms']:>9.1f} "
              f"{r['ratio_median']:>14.2f} {r['ratio_min']:>14.2f}")
    verdict = {n: next((r["ratio_median"] for r in rows if r["method"] == "swa" and r["n"] == n and "skipped" not in r),
                       None) for n in lengths}
    for n, ratio in verdict.items():
        if ratio is not None:
            print(f"target swa ≤ 1.5× linear at N={n}: {ratio:.2f}× ({'met' if ratio <= 1.5 else 'missed'})")
    result = dict(window=args.window, threads=args.threads, torch=torch.__version__, rows=rows)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)
    return result


if __name__ == "__main__":
    main()
