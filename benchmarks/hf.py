"""transformers and linattn, both directions, measured side by side in one run (issue 26).

    .venv/bin/python benchmarks/hf.py [--lengths 2048 8192] [--decode 32] [--train-len 1024] [--threads 1]
                                      [--vocab 4096] [--json PATH]

1. transformers' Qwen3.5 on linattn's kernels: a random Qwen3.5-shaped model (4 layers: 3 Gated
   DeltaNet + 1 full attention, hidden and intermediate 1024, linear heads 16 × 128 for keys and
   values, 8 × 128 attention heads with 2 KV heads, vocabulary --vocab), fp32, batch 1, on
   transformers' own torch path and with linattn.hf.use_linattn_kernels():
     - prefill tokens/s at each T of --lengths (the logits of the last token only),
     - decode ms/token (--decode steps after a 256-token prefill),
     - one training step (forward + backward, labels = inputs) at T = --train-len,
   each beside the share of its time spent inside the gated delta rule and the short convolution
   (the four module functions that use_linattn_kernels rebinds, timed by wrapping them).
2. A linattn model of the same shape (ModelConfig: d_model 1024, 16 heads, 3 gated_deltanet +
   1 softmax, d_ff 1024) generating --decode tokens through LinattnForCausalLM.generate against
   LinearTransformerLM.generate: the per-token cost of each (the time of N tokens minus the time
   of 1, over N − 1) and their ratio (target ≤ 1.10).

Times are medians of --rounds repetitions (torch.utils.benchmark.Timer, one call each).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time

import torch
from torch.utils.benchmark import Timer

import linattn.hf as H
from linattn.hf import kernels as K
from linattn.models import LinearTransformerLM, ModelConfig

QWEN = "transformers.models.qwen3_5.modeling_qwen3_5"


def qwen_model(vocab: int):
    import transformers

    cfg = transformers.Qwen3_5TextConfig(
        vocab_size=vocab, hidden_size=1024, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, head_dim=128, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_num_key_heads=16, linear_num_value_heads=16, linear_conv_kernel_dim=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"], tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).float().eval()


class _Clock:
    """Wraps the rebindable module functions and sums the seconds spent inside them."""

    def __init__(self):
        self.seconds = 0.0

    @contextlib.contextmanager
    def wrapping(self, module, names):
        saved = {n: getattr(module, n) for n in names}

        def timed(fn):
            def inner(*a, **kw):
                t0 = time.perf_counter()
                try:
                    return fn(*a, **kw)
                finally:
                    self.seconds += time.perf_counter() - t0
            return inner

        for n, f in saved.items():
            setattr(module, n, timed(f))
        try:
            yield
        finally:
            for n, f in saved.items():
                setattr(module, n, f)


@contextlib.contextmanager
def torch_path(module, names):
    """transformers' undecorated torch functions (its wrapper may point at FLA's Triton kernels)."""
    saved = {n: getattr(module, n) for n in names}
    for n, f in saved.items():
        setattr(module, n, getattr(f, "__wrapped__", f))
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(module, n, f)


def _median(fn, rounds: int) -> float:
    return Timer(stmt="fn()", globals={"fn": fn}).timeit(rounds).median if rounds > 1 else _once(fn)


def _once(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _shared(fn, rounds, module, names):
    """(median seconds, share of the time inside the wrapped functions)."""
    clock = _Clock()
    with clock.wrapping(module, names):
        t = _median(fn, rounds)
    return t, clock.seconds / (t * max(rounds, 1))


def bench_qwen(args) -> dict:
    import importlib

    module = importlib.import_module(QWEN)
    names = list(K.MODEL_TYPES["qwen3_5"][1])
    model = qwen_model(args.vocab)
    out: dict = {}
    for label, ctx in (("transformers", lambda: torch_path(module, names)),
                       ("linattn", lambda: H.use_linattn_kernels("qwen3_5"))):
        res = out[label] = {}
        with ctx():
            for t in args.lengths:
                x = torch.randint(0, args.vocab, (1, t))
                with torch.no_grad():
                    sec, share = _shared(lambda: model(x, use_cache=False, logits_to_keep=1), args.rounds,
                                         module, names)
                res[f"prefill_{t}"] = {"tokens_per_s": t / sec, "seconds": sec, "gdn_conv_share": share}
            x = torch.randint(0, args.vocab, (1, 256))
            with torch.no_grad():
                cache = model(x, use_cache=True).cache
                tok = x[:, -1:]

                def steps():
                    for _ in range(args.decode):
                        model(tok, cache=cache, logits_to_keep=1)
                sec, share = _shared(steps, 1, module, names)
            res["decode"] = {"ms_per_token": 1e3 * sec / args.decode, "gdn_conv_share": share}
            x = torch.randint(0, args.vocab, (1, args.train_len))
            model.train()

            def step():
                model.zero_grad(set_to_none=True)
                model(x, labels=x, use_cache=False).loss.backward()
            sec, share = _shared(step, 1, module, names)
            model.eval()
            res["train_step"] = {"seconds": sec, "tokens": args.train_len, "gdn_conv_share": share}
    return out


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
    if not args.skip_qwen:
        q = report["qwen3_5"] = bench_qwen(args)
        print(f"Qwen3.5-shaped (4 layers, 3 GDN + 1 attention, hidden 1024, linear heads 16x128), {args.threads} thread(s)")
        print(f"{'':24}{'transformers':>24}{'linattn kernels':>24}{'speed-up':>10}")
        for key in q["transformers"]:
            a, b = q["transformers"][key], q["linattn"][key]
            if "tokens_per_s" in a:
                va, vb, unit, up = a["tokens_per_s"], b["tokens_per_s"], "tok/s", b["tokens_per_s"] / a["tokens_per_s"]
            elif "ms_per_token" in a:
                va, vb, unit, up = a["ms_per_token"], b["ms_per_token"], "ms/tok", a["ms_per_token"] / b["ms_per_token"]
            else:
                va, vb, unit, up = a["seconds"], b["seconds"], "s", a["seconds"] / b["seconds"]
            print(f"{key:24}{va:>12.2f} {unit:6} ({a['gdn_conv_share']:4.0%})"
                  f"{vb:>12.2f} {unit:6} ({b['gdn_conv_share']:4.0%}){up:>9.2f}x")
        print("(in parentheses: share of the time inside the gated delta rule and the short convolution)")
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
