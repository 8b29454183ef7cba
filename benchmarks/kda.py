"""KDA's speed against Gated DeltaNet and transformers' torch fallback (issue 25), side by side in one run.

    .venv/bin/python benchmarks/kda.py [--lengths 4096 16384] [--threads 2] [--min-run-time 1]

fp32, q̂ and k̂ L2-normalized inside the ops, β = sigmoid(N(0, 1)), gates logsigmoid(N(0, 1) + 2)
(per key channel for KDA, per head for Gated DeltaNet), chunks of 64. Rows, each with the ratio of
two timings taken next to each other (torch.utils.benchmark, median of blocked runs) and the
issue's target:

  - fwd+bwd, B=1, H=8, K=V=64 at each N: linattn.ops.kda.kda / linattn.delta_rule(g=…)   (≤ 1.3×)
  - one decoding step, B=1, H=8, K=V=64: kda_step / delta_rule_step                      (≤ 1.2×)
  - forward, B=1, H=16, K=V=128, N = the first length: transformers' chunk_kimi_delta_attention
    (undecorated) / kda                                                                   (≥ 5×)
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.utils import benchmark

from linattn.ops import delta_rule, delta_rule_step
from linattn.ops.kda import kda, kda_step


def _inputs(b, h, n, d, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, n, d, generator=gen) for _ in range(3))
    beta = torch.sigmoid(torch.randn(b, h, n, generator=gen))
    g = F.logsigmoid(torch.randn(b, h, n, d, generator=gen) + 2)
    return q, k, v, beta, g


def _time(fn, min_run_time: float) -> float:
    return benchmark.Timer("fn()", globals={"fn": fn}).blocked_autorange(min_run_time=min_run_time).median


def _fwd_bwd(op, xs):
    leaves = [x.clone().requires_grad_() for x in xs]

    def run():
        for x in leaves:
            x.grad = None
        op(*leaves).sum().backward()

    return run


def rows(lengths, min_run_time):
    out = []
    for n in lengths:
        q, k, v, beta, g = _inputs(1, 8, n, 64, seed=n)
        gs = g[..., 0].contiguous()
        t_kda = _time(_fwd_bwd(lambda *a: kda(*a, qk_l2norm=True, scale=0.125), (q, k, v, beta, g)), min_run_time)
        t_gdn = _time(_fwd_bwd(lambda q, k, v, beta, g: delta_rule(q, k, v, beta, g=g, qk_l2norm=True, scale=0.125),
                               (q, k, v, beta, gs)), min_run_time)
        out.append((f"fwd+bwd N={n}, H=8, K=V=64: KDA / Gated DeltaNet", t_kda, t_gdn, t_kda / t_gdn, "≤ 1.3"))
    q, k, v, beta, g = _inputs(1, 8, 1, 64, seed=1)
    S = torch.randn(1, 8, 64, 64)
    gs = g[..., 0].contiguous()
    with torch.no_grad():
        t_kda = _time(lambda: kda_step(S, q, k, v, beta, g, qk_l2norm=True, scale=0.125), min_run_time)
        t_gdn = _time(lambda: delta_rule_step(S, q, k, v, beta, g=gs, qk_l2norm=True, scale=0.125), min_run_time)
    out.append(("one step, B=1, H=8, K=V=64: KDA / Gated DeltaNet", t_kda, t_gdn, t_kda / t_gdn, "≤ 1.2"))
    try:
        from transformers.models.kimi_linear import modeling_kimi_linear as m
    except ImportError:
        return out
    chunk = getattr(m.chunk_kimi_delta_attention, "__wrapped__", m.chunk_kimi_delta_attention)
    n = lengths[0]
    q, k, v, beta, g = _inputs(1, 16, n, 128, seed=2)
    t = lambda x: x.transpose(1, 2).contiguous()  # noqa: E731  their [B, T, H, K]
    tq, tk, tv, tb, tg = t(q), t(k), t(v), beta.transpose(1, 2).contiguous(), t(g)
    with torch.no_grad():
        t_ours = _time(lambda: kda(q, k, v, beta, g, qk_l2norm=True, scale=128 ** -0.5), min_run_time)
        t_hf = _time(lambda: chunk(tq, tk, tv, tg, tb, chunk_size=64, use_qk_l2norm_in_kernel=True), min_run_time)
    out.append((f"forward N={n}, H=16, K=V=128: transformers chunk_kimi_delta_attention / KDA", t_hf, t_ours,
                t_hf / t_ours, "≥ 5"))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--min-run-time", type=float, default=1.0)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s)")
    print(f"{'row':<78} {'a':>10} {'b':>10} {'a/b':>7}  target")
    for name, a, b, ratio, target in rows(args.lengths, args.min_run_time):
        print(f"{name:<78} {a * 1e3:>8.2f}ms {b * 1e3:>8.2f}ms {ratio:>7.2f}  {target}")


if __name__ == "__main__":
    main()
