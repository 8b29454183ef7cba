"""Per-token decoding latency of a linear-attention LM vs a hybrid vs a softmax LM with a KV cache.

    .venv/bin/python benchmarks/model_decode.py [--contexts 256,1024,4096,16384] [--threads 1]
                                               [--rounds 12] [--block-time 0.25] [--json PATH]

Model: 4 layers, d_model=256, 8 heads (head dim 32), the default (parameter-matched) SwiGLU FFN
d_ff = 704, RMSNorm, RoPE, vocab 256, fp32, batch 1, eval, inference mode. Three attention layouts:

    linear   elu+1 linear attention in every layer: state (kv, z) per layer, O(1) per token
    hybrid   linear, linear, linear, softmax: one layer in four keeps a KV cache
    softmax  softmax attention in every layer with a KV cache (preallocated, amortized append)

For every layout and context length T the model prefills T random tokens (chunked parallel path /
SDPA); then one decoding step (one token against the cache: embedding, 4 blocks, final norm, LM
head) is timed with torch.utils.benchmark (blocked_autorange). The cache is rolled back after each
timed step so the context stays at T. The 12 (layout, T) points are timed in interleaved rounds
(each point a short block per round), so that a machine shared with other jobs loads them alike.
Reported: the median over all blocks (± IQR) and the best block ("min", the least disturbed); the
targets are checked on both. Targets: linear latency at the longest context within 1.2× of the shortest
(constant-time decoding) and ≥ 10× below softmax+KV cache at the longest.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys

import torch
import torch.utils.benchmark as tb
from rich.console import Console
from rich.table import Table

from linattn.models import LinearTransformerLM, ModelConfig

LAYOUTS = {
    "linear": ["linear"],
    "hybrid": ["linear", "linear", "linear", "softmax"],
    "softmax": ["softmax"],
}


def config(attention: list[str]) -> ModelConfig:
    return ModelConfig(vocab_size=256, d_model=256, n_layers=4, n_heads=8, attention=attention,
                       feature_map="elu", positions="rope", max_len=1 << 20)


def _snapshot(cache):
    layers = [(c.length, c.seen, getattr(c, "state", None)) for c in cache.layers]
    return cache.length, cache.seen, layers


def _restore(cache, snap) -> None:
    cache.length, cache.seen, layers = snap
    for c, (length, seen, state) in zip(cache.layers, layers):
        c.length, c.seen = length, seen
        if hasattr(c, "state"):
            c.state = state


def decode_step(model: LinearTransformerLM, context: int, seed: int = 0):
    """Prefills `context` random tokens; returns (step, cache): step() decodes one token and rolls
    the cache back to `context` tokens."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, model.config.vocab_size, (1, context), generator=g)
    cache = model.new_cache()
    with torch.inference_mode():
        model(prompt, cache=cache, last_only=True)
    snap = _snapshot(cache)
    tok = torch.randint(0, model.config.vocab_size, (1, 1), generator=g)

    def step():
        with torch.inference_mode():
            model(tok, cache=cache, last_only=True)
        _restore(cache, snap)

    step()  # warm-up (the first append may grow the KV buffer)
    return step, cache


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", default="256,1024,4096,16384", help="context lengths (comma-separated)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1: decode is dispatch-bound)")
    p.add_argument("--rounds", type=int, default=12, help="interleaved timing rounds (default 12)")
    p.add_argument("--block-time", type=float, default=0.25, help="seconds per point per round (default 0.25)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON")
    args = p.parse_args(argv)
    contexts = [int(c) for c in args.contexts.split(",")]
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    console = Console(width=140)

    steps, caches = {}, {}
    for name, attention in LAYOUTS.items():
        model = LinearTransformerLM(config(attention)).eval()
        for n in contexts:
            steps[name, n], caches[name, n] = decode_step(model, n)
    times: dict = {key: [] for key in steps}
    for r in range(args.rounds):
        for key, step in steps.items():
            m = tb.Timer(stmt="step()", globals={"step": step}, num_threads=args.threads)
            times[key] += m.blocked_autorange(min_run_time=args.block_time).times
        console.print(f"  round {r + 1}/{args.rounds}: " + "  ".join(
            f"{k[0][:3]}@{k[1]} {min(v) * 1e3:.2f}" for k, v in times.items()), highlight=False)
    res: dict[str, dict[int, dict]] = {name: {} for name in LAYOUTS}
    for (name, n), ts in times.items():
        t = torch.tensor(ts, dtype=torch.float64)
        q1, med, q3 = (float(x) for x in torch.quantile(t, torch.tensor([0.25, 0.5, 0.75], dtype=torch.float64)))
        res[name][n] = {"median": med, "iqr": q3 - q1, "min": float(t.min()), "blocks": len(ts),
                        "cache_bytes": sum(caches[name, n].nbytes)}

    table = Table(title="Per-token decoding latency (ms), 4 layers, d_model 256, 8 heads, fp32, batch 1, CPU, "
                        f"{args.threads} thread{'s' if args.threads > 1 else ''}: median ±IQR / min",
                  header_style="bold")
    table.add_column("context", justify="right")
    for name in LAYOUTS:
        table.add_column(name, justify="right")
    table.add_column("softmax/linear", justify="right")
    table.add_column("hybrid/linear", justify="right")
    table.add_column("cache MiB lin/hyb/soft", justify="right")
    for n in contexts:
        r = {k: res[k][n] for k in LAYOUTS}
        ratio = lambda a, b: f"{r[a]['median'] / r[b]['median']:.1f} / {r[a]['min'] / r[b]['min']:.1f}"  # noqa: E731
        table.add_row(str(n), *[f"{r[k]['median'] * 1e3:.2f} ±{r[k]['iqr'] * 1e3:.2g} / {r[k]['min'] * 1e3:.2f}"
                                for k in LAYOUTS],
                      ratio("softmax", "linear"), ratio("hybrid", "linear"),
                      " / ".join(f"{r[k]['cache_bytes'] / 2**20:.2f}" for k in LAYOUTS))
    console.print(table)

    lo, hi = contexts[0], contexts[-1]
    checks = Table(title="Targets (median / min)", header_style="bold")
    for col in ("criterion", "median", "min", "target", "result"):
        checks.add_column(col, justify="left" if col == "criterion" else "right")
    summary = {}
    for label, a, na, b, nb, target in ((f"linear t({hi}) / t({lo})", "linear", hi, "linear", lo, 1.2),
                                         (f"softmax+KV / linear at {hi}", "softmax", hi, "linear", hi, 10.0),
                                         (f"hybrid / linear at {hi}", "hybrid", hi, "linear", hi, None)):
        med = res[a][na]["median"] / res[b][nb]["median"]
        best = res[a][na]["min"] / res[b][nb]["min"]
        summary[label] = {"median": med, "min": best}
        if target is None:
            checks.add_row(label, f"{med:.2f}", f"{best:.2f}", "(reported)", "—")
            continue
        ok = (lambda x: x <= target) if target < 2 else (lambda x: x >= target)
        verdict = "/".join("PASS" if ok(x) else "FAIL" for x in (med, best))
        checks.add_row(label, f"{med:.2f}", f"{best:.2f}", ("≤ " if target < 2 else "≥ ") + f"{target:g}", verdict)
    console.print(checks)

    if args.json:
        out = {"machine": {"platform": platform.platform(), "processor": platform.processor(),
                           "torch": torch.__version__, "threads": args.threads},
               "contexts": contexts,
               "results": {k: {str(n): v for n, v in d.items()} for k, d in res.items()},
               "ratios": summary}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
