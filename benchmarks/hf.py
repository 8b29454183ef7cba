"""transformers and linattn, both directions, measured side by side in one run (issue 26).

    .venv/bin/python benchmarks/hf.py [--lengths 2048 8192] [--decode 32] [--train-len 1024] [--threads 1]
                                      [--vocab 4096] [--json PATH] [--skip-qwen]

1. transformers' Qwen3.5 three ways (its torch path, use_linattn_kernels(), linattn.hf.accelerate())
   is now `linattn bench hf` (linattn.bench.hf: shapes small and qwen3.5-0.8b, several thread counts,
   the decode beside the fp32 gemv floor); this script runs it on the small shape (--vocab is that
   shape's own, 4096) unless --skip-qwen.
2. A linattn model (ModelConfig: d_model 1024, 16 heads, 3 gated_deltanet + 1 softmax, d_ff 1024)
   generating --decode tokens through LinattnForCausalLM.generate against
   LinearTransformerLM.generate: the per-token cost of each (the time of N tokens minus the time
   of 1, over N − 1) and their ratio (target ≤ 1.10).

Times are medians of --rounds repetitions (torch.utils.benchmark.Timer, one call each).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch.utils.benchmark import Timer

import linattn.hf as H
from linattn.cli import main as linattn_main
from linattn.models import LinearTransformerLM, ModelConfig


def _median(fn, rounds: int) -> float:
    return Timer(stmt="fn()", globals={"fn": fn}).timeit(rounds).median if rounds > 1 else _once(fn)


def _once(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_wrapper(args) -> dict:
    mc = ModelConfig(vocab_size=args.vocab, d_model=1024, n_heads=16, n_layers=4, d_ff=1024,
                     attention=["gated_deltanet"] * 3 + ["softmax"])
    lm = LinearTransformerLM(mc).eval()
    hf = H.LinattnForCausalLM.from_linattn(lm)
    prompt = torch.randint(0, args.vocab, (1, 16))
    n = args.decode

    def native(k):
        return lambda: lm.generate(prompt[0].tolist(), k, temperature=0)

    def wrapped(k):
        return lambda: hf.generate(prompt, max_new_tokens=k, do_sample=False)

    res = {}
    for label, make in (("LinearTransformerLM.generate", native), ("LinattnForCausalLM.generate", wrapped)):
        make(2)()  # warm (the fused plan, transformers' generation config)
        full, one = _median(make(n), args.rounds), _median(make(1), args.rounds)
        res[label] = {"ms_per_token": 1e3 * (full - one) / (n - 1)}
    a, b = (res[k]["ms_per_token"] for k in ("LinattnForCausalLM.generate", "LinearTransformerLM.generate"))
    res["ratio"] = a / b
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[2048])
    p.add_argument("--decode", type=int, default=32)
    p.add_argument("--train-len", type=int, default=1024)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--skip-qwen", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    report = {"threads": args.threads, "vocab": args.vocab}
    if not args.skip_qwen:  # part 1: linattn bench hf on the small shape
        argv = ["bench", "hf", "--shapes", "small", "--threads", str(args.threads),
                "--lengths", ",".join(map(str, args.lengths)), "--train-len", str(args.train_len)]
        if linattn_main(argv) != 0:
            return 1
    w = report["wrapper"] = bench_wrapper(args)
    print(f"linattn model through transformers: {w['LinattnForCausalLM.generate']['ms_per_token']:.2f} ms/token, "
          f"LinearTransformerLM.generate {w['LinearTransformerLM.generate']['ms_per_token']:.2f} ms/token, "
          f"ratio {w['ratio']:.3f} (target <= 1.10)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
