"""A packed call (cu_seqlens) on the fused CPU kernels against the ways it can otherwise run, forward +
backward, side by side in one run (issue 33: packed sequences inside the kernels).

    PYTHONPATH=src .venv/bin/python benchmarks/packed_ops.py [--families linear,gla,gdn,kda] [--lengths ...]
        [--tokens 4096] [--heads 8] [--dim 64] [--rounds 3] [--block-time 0.5] [--threads 1] [--seed 0]

Each family's operator on one packed row of T tokens holding documents of random lengths (a fixed
draw: --docs documents, lengths uniform in [1, 2·T/docs], rescaled to T), H heads, D = E = 64, fp32,
`o, S = op(...); (o.sum() + S.sum()).backward()`:

  kernel      one call with cu_seqlens, the kernels given the boundaries (linattn.ops.packed.IN_KERNELS)
  per-length  the same call with IN_KERNELS off: one operator call per distinct sequence length
              (how packed calls ran before)
  separate    one unpacked call per sequence, in a Python loop (what packing replaces)
  unpacked    one unpacked call on the whole row as one sequence (no boundaries: the floor)

Families: linear (linear_attention, elu+1, normalized), gla (gated_linear_attention, per-feature g),
gdn (delta_rule with g per head, qk_l2norm), kda (delta_rule with per-channel g). Every method is
timed in R interleaved rounds of a torch.utils.benchmark block each; printed: the median time and
each method's ratio to `kernel` formed within a round (median over rounds).
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F
import torch.utils.benchmark as tb

from linattn.nn.feature_maps import make_feature_map
from linattn.ops import delta_rule, gated_linear_attention, linear_attention, native, packed

METHODS = ("kernel", "per-length", "separate", "unpacked")


def draw_lengths(tokens: int, docs: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(1, max(2, 2 * tokens // docs), (docs,), generator=g).double()
    lengths = (raw / raw.sum() * tokens).floor().long()
    lengths[-1] += tokens - int(lengths.sum())
    return [int(x) for x in lengths]


def inputs(family: str, h: int, t: int, d: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    x = {"q": torch.randn(1, h, t, d, generator=g), "k": torch.randn(1, h, t, d, generator=g),
         "v": torch.randn(1, h, t, d, generator=g)}
    if family == "gla":
        x["g"] = F.logsigmoid(torch.randn(1, h, t, d, generator=g)) / 16
    elif family in ("gdn", "kda"):
        x["beta"] = torch.rand(1, h, t, generator=g)
        shape = (1, h, t) if family == "gdn" else (1, h, t, d)
        x["g"] = F.logsigmoid(torch.randn(*shape, generator=g) + 2)
    return {n: y.requires_grad_() for n, y in x.items()}


def operator(family: str, d: int):
    fm = make_feature_map("elu", d)

    def op(x, cu):
        if family == "linear":
            return linear_attention(x["q"], x["k"], x["v"], causal=True, feature_map=fm, return_state=True,
                                    cu_seqlens=cu)
        if family == "gla":
            return gated_linear_attention(x["q"], x["k"], x["v"], x["g"], feature_map=fm, return_state=True,
                                          cu_seqlens=cu)
        return delta_rule(x["q"], x["k"], x["v"], x["beta"], g=x["g"], qk_l2norm=True, return_state=True,
                          cu_seqlens=cu)
    return op


def step_fn(method: str, op, x: dict, lengths: list[int]):
    cu = packed.cu_seqlens_from_lengths(lengths)

    def loss(o, S):
        parts = S if isinstance(S, tuple) else (S,)
        return o.sum() + sum(p.sum() for p in parts)

    def run():
        packed.IN_KERNELS = method != "per-length"
        try:
            if method in ("kernel", "per-length"):
                loss(*op(x, cu)).backward()
            elif method == "unpacked":
                loss(*op(x, None)).backward()
            else:
                total, s = 0, 0
                for n in lengths:
                    if n:
                        total = total + loss(*op({m: y[:, :, s:s + n] for m, y in x.items()}, None))
                    s += n
                total.backward()
        finally:
            packed.IN_KERNELS = True
    return run


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default="linear,gla,gdn,kda")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--docs", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--block-time", type=float, default=0.5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"threads {args.threads}, fused kernels {native.available()}, torch {torch.__version__}, "
          f"T {args.tokens}, H {args.heads}, D = E = {args.dim}, fp32, fwd+bwd")
    print(f"{'family':<8}{'docs':>6}{'distinct':>10}" + "".join(f"{m + ' ms':>15}" for m in METHODS)
          + "".join(f"{m + '/kernel':>19}" for m in METHODS[1:]))
    for family in args.families.split(","):
        for docs in args.docs:
            lengths = draw_lengths(args.tokens, docs, args.seed)
            x = inputs(family, args.heads, args.tokens, args.dim, args.seed)
            op = operator(family, args.dim)
            fns = {m: step_fn(m, op, x, lengths) for m in METHODS}
            for fn in fns.values():
                fn()
            times: dict[str, list[float]] = {m: [] for m in METHODS}
            for _ in range(args.rounds):
                for m, fn in fns.items():
                    times[m].append(tb.Timer("f()", globals={"f": fn}).blocked_autorange(
                        min_run_time=args.block_time).median)
            ratios = {m: statistics.median(a / b for a, b in zip(times[m], times["kernel"])) for m in METHODS[1:]}
            print(f"{family:<8}{docs:>6}{len(set(lengths) - {0}):>10}"
                  + "".join(f"{1e3 * statistics.median(times[m]):>15.1f}" for m in METHODS)
                  + "".join(f"{ratios[m]:>18.2f}×" for m in METHODS[1:]), flush=True)


if __name__ == "__main__":
    main()
