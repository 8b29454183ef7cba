"""KDA's speed against Gated DeltaNet and transformers' torch fallback (issues 25, 33), side by side in one run.

    .venv/bin/python benchmarks/kda.py [--lengths 4096 16384] [--threads 1] [--rounds 3] [--min-run-time 1]
                                       [--no-transformers]

fp32, q̂ and k̂ L2-normalized inside the ops, β = sigmoid(N(0, 1)), gates logsigmoid(N(0, 1) + 2)
(per key channel for KDA, per head for Gated DeltaNet: mean −0.16 per token), chunks of 64. Each row
is the ratio of two timings taken next to each other (torch.utils.benchmark, median of blocked runs),
in R interleaved rounds; printed: both times of the last round and the median ratio over rounds
[min–max], with the issue's target:

  - fwd+bwd, B=1, H=8, K=V=64 at each N: kda (fused kernels, csrc/kda.cpp) / delta_rule(g=…) (≤ 1.3×)
  - the same with KDA on the torch-op path (LINATTN_NATIVE=0 for the KDA call only: the path before
    the fused kernels), and fused / torch-op KDA
  - fwd+bwd with strong gates, 8 · logsigmoid(N(0, 1) + 2) (mean −1.3 per token: a chunk of 64 decays
    by ~80 and its scores are formed in two or three row blocks, design §13.8) / Gated DeltaNet
  - forward only, KDA / Gated DeltaNet
  - one decoding step, B=1, H=8, K=V=64: kda_step / delta_rule_step                        (≤ 1.2×)
  - forward, B=1, H=16, K=V=128, N = the first length: transformers' chunk_kimi_delta_attention
    (undecorated) / kda                                                                   (≥ 5×)

and, at the largest N, the fwd+bwd peak memory beyond the output and the input gradients (q, k, v,
β, g), fused KDA and Gated DeltaNet, as a multiple of q's size (linattn.bench.memory: ATen outputs,
not the kernels' per-thread buffers).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics

import torch
import torch.nn.functional as F
from torch.utils import benchmark

from linattn.bench.memory import nbytes, peak_memory
from linattn.ops import delta_rule, delta_rule_step
from linattn.ops.kda import kda, kda_step


def _inputs(b, h, n, d, seed=0, gate_scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, n, d, generator=gen) for _ in range(3))
    beta = torch.sigmoid(torch.randn(b, h, n, generator=gen))
    g = F.logsigmoid(torch.randn(b, h, n, d, generator=gen) + 2) * gate_scale
    return q, k, v, beta, g


def _time(fn, min_run_time: float) -> float:
    return benchmark.Timer("fn()", globals={"fn": fn}).blocked_autorange(min_run_time=min_run_time).median


@contextlib.contextmanager
def _native(on: bool):
    """LINATTN_NATIVE set for the calls inside (read at every call)."""
    old = os.environ.get("LINATTN_NATIVE")
    os.environ["LINATTN_NATIVE"] = "1" if on else "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("LINATTN_NATIVE")
        else:
            os.environ["LINATTN_NATIVE"] = old


def _fwd_bwd(op, xs, native: bool = True):
    leaves = [x.clone().requires_grad_() for x in xs]

    def run():
        for x in leaves:
            x.grad = None
        with _native(native):
            op(*leaves).sum().backward()

    return run


def _forward(op, xs):
    def run():
        with torch.no_grad():
            op(*xs)

    return run


def _kda(*a):
    return kda(*a, qk_l2norm=True, scale=0.125)


def _gdn(q, k, v, beta, g):
    return delta_rule(q, k, v, beta, g=g, qk_l2norm=True, scale=0.125)


def pairs(lengths):
    """[(row name, fn a, fn b, target)]: each row's two timed callables."""
    out = []
    for i, n in enumerate(lengths):
        q, k, v, beta, g = _inputs(1, 8, n, 64, seed=n)
        gs = g[..., 0].contiguous()
        gdn = _fwd_bwd(_gdn, (q, k, v, beta, gs))
        fused = _fwd_bwd(_kda, (q, k, v, beta, g))
        out.append((f"fwd+bwd N={n}, H=8, K=V=64: KDA / Gated DeltaNet", fused, gdn, "≤ 1.3"))
        slow = _fwd_bwd(_kda, (q, k, v, beta, g), native=False)
        out.append((f"fwd+bwd N={n}: KDA on the torch ops (before) / Gated DeltaNet", slow, gdn, ""))
        out.append((f"fwd+bwd N={n}: KDA fused / KDA on the torch ops", fused, slow, ""))
        if i == 0:
            strong = _fwd_bwd(_kda, (q, k, v, beta, g * 8))
            out.append((f"fwd+bwd N={n}, gates ×8 (row blocks): KDA / Gated DeltaNet", strong, gdn, ""))
            out.append((f"forward N={n}: KDA / Gated DeltaNet", _forward(_kda, (q, k, v, beta, g)),
                        _forward(_gdn, (q, k, v, beta, gs)), ""))
    q, k, v, beta, g = _inputs(1, 8, 1, 64, seed=1)
    S = torch.randn(1, 8, 64, 64)
    gs = g[..., 0].contiguous()
    out.append(("one step, B=1, H=8, K=V=64: KDA / Gated DeltaNet",
                _forward(lambda: kda_step(S, q, k, v, beta, g, qk_l2norm=True, scale=0.125), ()),
                _forward(lambda: delta_rule_step(S, q, k, v, beta, g=gs, qk_l2norm=True, scale=0.125), ()), "≤ 1.2"))
    return out


def transformers_pair(n):
    """transformers' chunk_kimi_delta_attention / kda, forward, H=16, K=V=128, or None without it."""
    try:
        from transformers.models.kimi_linear import modeling_kimi_linear as m
    except ImportError:
        return None
    chunk = getattr(m.chunk_kimi_delta_attention, "__wrapped__", m.chunk_kimi_delta_attention)
    q, k, v, beta, g = _inputs(1, 16, n, 128, seed=2)
    t = lambda x: x.transpose(1, 2).contiguous()  # noqa: E731  their [B, T, H, K]
    tq, tk, tv, tb, tg = t(q), t(k), t(v), beta.transpose(1, 2).contiguous(), t(g)
    return (f"forward N={n}, H=16, K=V=128: transformers chunk_kimi_delta_attention / KDA",
            _forward(lambda: chunk(tq, tk, tv, tg, tb, chunk_size=64, use_qk_l2norm_in_kernel=True), ()),
            _forward(lambda: kda(q, k, v, beta, g, qk_l2norm=True, scale=128 ** -0.5), ()), "≥ 5")


def memory(n):
    """[(name, bytes beyond o and the input gradients, that / q's bytes)] of fwd+bwd at N = n."""
    q, k, v, beta, g = _inputs(1, 8, n, 64, seed=n)
    out = []
    for name, op, gate in (("KDA", _kda, g), ("Gated DeltaNet", _gdn, g[..., 0].contiguous())):
        leaves = [x.clone().requires_grad_() for x in (q, k, v, beta, gate)]
        do = torch.ones_like(v)

        def fn():
            o = op(*leaves)
            return (o, *torch.autograd.grad(o, leaves, do))

        peak, result = peak_memory(fn)
        extra = max(0, peak - nbytes(*result))
        out.append((name, extra, extra / nbytes(q)))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--min-run-time", type=float, default=1.0)
    p.add_argument("--no-transformers", action="store_true", help="skip the transformers row")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = pairs(args.lengths)
    peer = None if args.no_transformers else transformers_pair(args.lengths[0])
    rows += [] if peer is None else [peer]
    ratios = {name: [] for name, *_ in rows}
    last = {}
    for _ in range(args.rounds):
        for name, a, b, _target in rows:
            ta, tb = _time(a, args.min_run_time), _time(b, args.min_run_time)
            ratios[name].append(ta / tb)
            last[name] = (ta, tb)
    print(f"torch {torch.__version__}, {args.threads} thread(s), {args.rounds} round(s); ratios: median [min–max]")
    print(f"{'row':<78} {'a':>10} {'b':>10} {'a/b':>6} {'range':>13}  target")
    for name, _a, _b, target in rows:
        r = ratios[name]
        ta, tb = last[name]
        print(f"{name:<78} {ta * 1e3:>8.2f}ms {tb * 1e3:>8.2f}ms {statistics.median(r):>6.2f} "
              f"[{min(r):.2f}–{max(r):.2f}]  {target}")
    n = max(args.lengths)
    for name, extra, ratio in memory(n):
        print(f"fwd+bwd memory beyond o and the input gradients, N={n}, {name}: {extra / 2**20:.2f} MiB = {ratio:.2f} × q")


if __name__ == "__main__":
    main()
