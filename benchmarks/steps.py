"""The one-token steps against the time to copy their state once (issue 33: step ≤ 1.5× copy + 10 µs).

    .venv/bin/python benchmarks/steps.py [--sizes 8x64 16x128 32x128] [--threads 1] [--number 50] [--repeat 40]

B = 1, H heads, D = E (the state H·D·E fp32), under inference_mode, q̂ and k̂ normalized inside the delta
family's steps. For each size: `dst.copy_(src)` of a state-sized tensor, then each step as the bare
kernel (torch.ops.linattn_cpu.*: delta_step for Gated DeltaNet and KDA, gated_step, step) and as the
public function (delta_rule_step, kda_step, gated_linear_attention_step, linear_attention_step), each
out of place and with inplace=True (the `*_` kernels: the state updated in place, no new state per
token). Times are the minimum over `repeat` runs of `number` calls (timeit): on a machine shared with
other jobs the minimum is the best estimate of a call's own cost, and every row is measured in the
same run as its copy. Printed: µs per call, × the copy, and whether it is within 1.5× copy + 10 µs.
"""

from __future__ import annotations

import argparse
import timeit

import torch

from linattn.ops import delta_rule_step, gated_linear_attention_step, linear_attention_step, native
from linattn.ops.kda import kda_step


def _min_time(fn, number: int, repeat: int) -> float:
    fn()
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number


def rows(h: int, d: int):
    """[(name, fn)] for one size; the in-place rows update their own copy of the state."""
    ops = torch.ops.linattn_cpu
    S = torch.randn(1, h, d, d) * 0.1
    dst, S2 = torch.empty_like(S), S.clone()
    q, k, v = (torch.randn(1, h, 1, d) for _ in range(3))
    beta, g, gc = torch.rand(1, h, 1), -torch.rand(1, h, 1), -torch.rand(1, h, 1, d)
    z = torch.ones(1, h, d)
    z2 = z.clone()
    return [
        ("copy of the state", lambda: dst.copy_(S)),
        ("kernel delta_step (Gated DeltaNet)", lambda: ops.delta_step.default(S, q, k, v, beta, g, 1.0, True)),
        ("kernel delta_step_ (Gated DeltaNet, in place)", lambda: ops.delta_step_.default(S2, q, k, v, beta, g, 1.0, True)),
        ("kernel delta_step (KDA)", lambda: ops.delta_step.default(S, q, k, v, beta, gc, 1.0, True)),
        ("kernel delta_step_ (KDA, in place)", lambda: ops.delta_step_.default(S2, q, k, v, beta, gc, 1.0, True)),
        ("kernel gated_step", lambda: ops.gated_step.default(S, None, q, k, v, g, 0, 1e-6)),
        ("kernel gated_step_ (in place)", lambda: ops.gated_step_.default(S2, None, q, k, v, g, 0, 1e-6)),
        ("kernel step", lambda: ops.step.default(S, z, q, k, v, 0, False, 1e-6, None, None, h)),
        ("kernel step_ (in place)", lambda: ops.step_.default(S2, z2, q, k, v, 0, False, 1e-6, None, None, h)),
        ("delta_rule_step (Gated DeltaNet)", lambda: delta_rule_step(S, q, k, v, beta, g=g, qk_l2norm=True)),
        ("delta_rule_step inplace=True", lambda: delta_rule_step(S2, q, k, v, beta, g=g, qk_l2norm=True, inplace=True)),
        ("kda_step", lambda: kda_step(S, q, k, v, beta, gc, qk_l2norm=True)),
        ("kda_step inplace=True", lambda: kda_step(S2, q, k, v, beta, gc, qk_l2norm=True, inplace=True)),
        ("gated_linear_attention_step", lambda: gated_linear_attention_step(S, q, k, v, g)),
        ("gated_linear_attention_step inplace=True", lambda: gated_linear_attention_step(S2, q, k, v, g, inplace=True)),
        ("linear_attention_step", lambda: linear_attention_step((S, z), q, k, v, normalize=False)),
        ("linear_attention_step inplace=True",
         lambda: linear_attention_step((S2, z2), q, k, v, normalize=False, inplace=True)),
    ]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", nargs="+", default=["8x64", "16x128", "32x128"], help="HxD (D = E)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--number", type=int, default=50)
    p.add_argument("--repeat", type=int, default=40)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not native.available():
        raise SystemExit("the fused CPU kernels are not built here")
    print(f"torch {torch.__version__}, {args.threads} thread(s); min over {args.repeat} × {args.number} calls")
    for size in args.sizes:
        h, d = (int(x) for x in size.split("x"))
        with torch.inference_mode():
            times = [(name, _min_time(fn, args.number, args.repeat)) for name, fn in rows(h, d)]
        copy = times[0][1]
        print(f"H={h}, D=E={d} ({h * d * d * 4 / 2**20:.2f} MiB): copy {copy * 1e6:.1f} µs, "
              f"1.5 × copy + 10 µs = {(1.5 * copy + 1e-5) * 1e6:.1f} µs")
        for name, t in times[1:]:
            verdict = "ok" if t <= 1.5 * copy + 1e-5 else "over"
            print(f"   {name:<46} {t * 1e6:8.1f} µs  {t / copy:5.2f}× copy  {verdict}")


if __name__ == "__main__":
    main()
