"""`linattn bench generate`: the image-generation speed experiment of the Linear Transformer paper.

Katharopoulos et al. 2020, "Transformers are RNNs" (§4.2.1, Tables 1–2, appendix): generate whole
images autoregressively, one pixel value (a token of 256) at a time, and count images per second.

    dataset    tokens per image     paper model (fast-transformers run of the paper's code)
    MNIST      784 (28×28×1)        8 layers, 8 heads × 32 = d_model 256, FFN 1024
    CIFAR-10   3,072 (32×32×3)      16 layers, 8 heads × 32 = d_model 256, FFN 1024

Three ways to generate, timed on the same shapes:

    linear (RNN)        linear attention (elu+1) decoding through the model's cache: each new token
                        updates a constant-size state (kv, z) per layer — O(1) per token
    softmax + KV cache  softmax attention decoding against a growing K/V cache — O(t) per token
                        (the paper's "stateful-softmax")
    softmax, no cache   the paper's softmax baseline: every new token recomputes the forward pass
                        over the whole prefix — O(t²) per token

Linear and KV-cache generation run model.stream, whose steps are fused (linattn.models.decoding: the whole
model's step in one C++ call) for these CPU models; beside them, the time to read every weight once
(each matrix-vector product of a step alone, measured in the same run) bounds a step at small batch.
Linear and KV-cache generation always run end to end (a full image, wall clock). Softmax without a
cache runs end to end up to `full_no_cache_max` tokens; above, its per-token cost is measured at a
few evenly spaced prefix lengths and summed over every prefix length of the image with linear
interpolation in between (the cost of one uncached step is a smooth, convex function of the prefix
length, so the trapezoidal sum overestimates by ~1/(2P²) at most for P intervals).

The models are untrained (random weights): generation speed does not depend on the weights. Other
differences from the paper: a 256-way softmax output instead of a mixture of 10 logistics, learned
absolute position embeddings instead of concatenated sinusoids, pre-norm LayerNorm blocks.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch
from rich.console import Console

from ..models.decoding import FusedDecoder, fused_decoding_obstacle
from ..models.generation import sample_next
from ..models.lm import LinearTransformerLM, ModelConfig
from ..report import fmt_bytes, make_table, progress
from .consistency import growing_series
from .methods import short_dtype
from .timing import measure

DATASETS = {
    "mnist": {"label": "MNIST", "image": "28×28×1", "tokens": 784, "layers": 8},
    "cifar10": {"label": "CIFAR-10", "image": "32×32×3", "tokens": 3072, "layers": 16},
}
D_MODEL, HEADS, D_FF, VOCAB = 256, 8, 1024, 256
#: scale -> (divisor of the paper's layer count, divisor of the tokens per image)
SCALES = {"paper": (1, 1), "small": (4, 1), "tiny": (8, 4)}
METHODS = {"linear": "linear (RNN)", "kv_cache": "softmax + KV cache", "no_cache": "softmax, no cache"}

#: Images per second reported by the paper (Table 1: MNIST, Table 2: CIFAR-10), on the authors' GPU
#: setup; None where the paper has no such row. Speedups: MNIST 142.8 / 0.45 = 317×, CIFAR-10
#: 17.85 / 0.004 = 4,462× (vs softmax) and 17.85 / 0.32 ≈ 56× (vs stateful-softmax).
PAPER_IMAGES_PER_S = {
    "mnist": {"linear": 142.8, "kv_cache": None, "no_cache": 0.45},
    "cifar10": {"linear": 17.85, "kv_cache": 0.32, "no_cache": 0.004},
}
PAPER_SOURCE = ("Katharopoulos et al. 2020, 'Transformers are RNNs', Table 1 (MNIST) and Table 2 (CIFAR-10), "
                "images/s of softmax, stateful-softmax and linear")


@dataclass
class GenerateConfig:
    """What `run_generate` measures. layers / tokens override the scale's (for every dataset)."""

    datasets: list[str] = field(default_factory=lambda: list(DATASETS))
    batches: list[int] = field(default_factory=lambda: [1, 8])
    scale: str = "small"
    layers: int | None = None
    tokens: int | None = None
    d_model: int = D_MODEL
    heads: int = HEADS
    d_ff: int = D_FF
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    seed: int = 0
    min_run_time: float = 0.2
    probes: int = 6
    full_no_cache_max: int = 256

    def __post_init__(self):
        unknown = [d for d in self.datasets if d not in DATASETS]
        if unknown or not self.datasets:
            raise ValueError(f"datasets must be a non-empty subset of {list(DATASETS)}, got {self.datasets!r}")
        if self.scale not in SCALES:
            raise ValueError(f"scale must be one of {list(SCALES)}, got {self.scale!r}")
        if not self.batches or any(b < 1 for b in self.batches):
            raise ValueError(f"batches must be positive ints, got {self.batches!r}")
        if self.tokens is not None and self.tokens < 2:
            raise ValueError(f"tokens must be >= 2 (a first pixel and at least one generated one), got {self.tokens}")
        if self.d_model % self.heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by heads ({self.heads})")

    def shape(self, dataset: str) -> dict:
        """Tokens per image and layers for `dataset` at this scale (overrides applied)."""
        spec = DATASETS[dataset]
        div_layers, div_tokens = SCALES[self.scale]
        return {"tokens": self.tokens or max(2, spec["tokens"] // div_tokens),
                "layers": self.layers or max(1, spec["layers"] // div_layers)}


def model_config(kind: str, tokens: int, layers: int, cfg: GenerateConfig) -> ModelConfig:
    """The paper's image model in linattn terms: `kind` ("linear" or "softmax") in every layer."""
    return ModelConfig(vocab_size=VOCAB, d_model=cfg.d_model, n_layers=layers, n_heads=cfg.heads, d_ff=cfg.d_ff,
                       attention=[kind], feature_map="elu", positions="learned", max_len=tokens, activation="gelu",
                       norm="layernorm", seed=cfg.seed)


def probe_points(tokens: int, probes: int) -> list[int]:
    """Prefix lengths in [1, tokens − 1]: probes + 1 evenly spaced ones (both ends included, for the sum)
    and the powers of 4 below (cheap, for the log-scale latency plot)."""
    hi = tokens - 1
    if hi <= probes + 1:
        return list(range(1, hi + 1))
    even = {1 + round(i * (hi - 1) / probes) for i in range(probes + 1)}
    return sorted(even | {4 ** i for i in range(1, 16) if 4 ** i < hi // 2})


def interpolated_sum(points: list[tuple[int, float]], lo: int, hi: int) -> float:
    """Σ_{t=lo}^{hi} c(t) with c linearly interpolated between the measured (t, c) points (constant
    beyond the ends)."""
    pts = sorted(points)
    total, j = 0.0, 0
    for t in range(lo, hi + 1):
        while j + 1 < len(pts) and pts[j + 1][0] < t:
            j += 1
        if t <= pts[0][0]:
            total += pts[0][1]
        elif t >= pts[-1][0]:
            total += pts[-1][1]
        else:
            (t0, c0), (t1, c1) = pts[j], pts[j + 1]
            total += c0 + (c1 - c0) * (t - t0) / (t1 - t0)
    return total


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _prompt(batch: int, seed: int, device) -> torch.Tensor:
    """The first pixel of every image (unconditional generation, as the paper's offset 1)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, 1), generator=g).to(device)


def cached_generation(model, prompt: torch.Tensor, n_new: int, seed: int, on_step=None) -> tuple[float, list[float]]:
    """Generates n_new tokens after `prompt` through the model's cache (model.stream: one prefill, then
    one cached step per token). Returns (total seconds, seconds of every step); step i produced the
    token at position i + 1, with a context of i + 1 tokens."""
    device = prompt.device
    _sync(device)
    stamps = [time.perf_counter()]
    for _ in model.stream(prompt, n_new, temperature=1.0, seed=seed):  # tokens come back as ints: synced
        stamps.append(time.perf_counter())
        if on_step is not None:
            on_step()
    return stamps[-1] - stamps[0], [b - a for a, b in zip(stamps, stamps[1:])]


def _generators(batch: int, seed: int, device) -> list[torch.Generator]:
    return [torch.Generator(device=device).manual_seed(seed) for _ in range(batch)]


def uncached_generation(model, prompt: torch.Tensor, n_new: int, seed: int, on_step=None) -> tuple[float, list[float]]:
    """The paper's softmax baseline: each new token runs the whole forward pass over the prefix (no
    cache) and samples from the last position. Same return value as `cached_generation`."""
    device = prompt.device
    gens = _generators(prompt.shape[0], seed, device)
    ids = prompt
    _sync(device)
    stamps = [time.perf_counter()]
    with torch.inference_mode():
        for _ in range(n_new):
            logits, _ = model(ids, last_only=True)
            tok = sample_next(logits[:, -1], 1.0, generators=gens)
            ids = torch.cat([ids, tok[:, None]], dim=1)
            _sync(device)
            stamps.append(time.perf_counter())
            if on_step is not None:
                on_step()
    return stamps[-1] - stamps[0], [b - a for a, b in zip(stamps, stamps[1:])]


def uncached_step_fn(model, batch: int, prefix: int, seed: int, device):
    """One uncached generation step with a prefix of `prefix` tokens: forward over the prefix, sample."""
    g = torch.Generator().manual_seed(seed + prefix)
    ids = torch.randint(0, VOCAB, (batch, prefix), generator=g).to(device)
    gens = _generators(batch, seed, device)

    def fn():
        with torch.inference_mode():
            logits, _ = model(ids, last_only=True)
            return sample_next(logits[:, -1], 1.0, generators=gens)

    return fn


def _window_latency(step_s: list[float], points: list[int]) -> list[list[float]]:
    """[[t, ms], ...]: the mean step time around context t (a window of ±w steps) from a full run."""
    n = len(step_s)
    w = max(1, n // (8 * max(1, len(points))))
    out = []
    for t in points:
        i = t - 1
        window = step_s[max(0, i - w): min(n, i + w + 1)]
        out.append([t, 1e3 * sum(window) / len(window)])
    return out


def cache_bytes(kind: str, batch: int, tokens: int, layers: int, cfg: GenerateConfig) -> int:
    """Bytes of the decoding cache after a whole image: the float32 (kv, z) state of every linear layer,
    or the K/V cache of every softmax layer."""
    head = cfg.d_model // cfg.heads
    if kind == "linear":
        return 4 * layers * batch * cfg.heads * (head * head + head)
    el = torch.empty((), dtype=cfg.dtype).element_size()
    return el * layers * batch * cfg.heads * tokens * 2 * head


def weight_streaming_ms(model, prompt: torch.Tensor, cfg: GenerateConfig) -> float | None:
    """Milliseconds to read every weight of `model` once at this batch (linattn.models.decoding: each
    matrix-vector product of a decoding step, alone), the bound a token's step at small batch cannot
    beat; None where the model takes the eager step (fused_decoding_obstacle)."""
    if fused_decoding_obstacle(model) is not None:
        return None
    with torch.inference_mode():
        _, cache = model(prompt, cache=model.new_cache(), last_only=True)
    decoder = FusedDecoder(model, cache)
    return measure(decoder.weight_streaming, min_run_time=cfg.min_run_time, warmup=3).median * 1e3


def run_generate(cfg: GenerateConfig, console: Console | None = None) -> dict:
    """Runs the experiment; returns {"config", "methods", "paper", "results", "notes"} (see module doc)."""
    console = console or Console()
    device = torch.device(cfg.device)
    runs = [(d, b) for d in cfg.datasets for b in cfg.batches]
    results = []
    with progress(console) as bar:
        overall = bar.add_task("bench generate", total=len(runs) * len(METHODS))
        inner = bar.add_task("", total=1, visible=False)
        for dataset in cfg.datasets:
            shape = cfg.shape(dataset)
            n_tok, n_layers = shape["tokens"], shape["layers"]
            n_new = n_tok - 1
            models = {}
            for kind in ("linear", "softmax"):
                m = LinearTransformerLM(model_config(kind, n_tok, n_layers, cfg)).to(device=device, dtype=cfg.dtype)
                models[kind] = m.eval()
            points = probe_points(n_tok, cfg.probes)
            for batch in cfg.batches:
                prompt = _prompt(batch, cfg.seed, device)
                row = {"dataset": dataset, "label": DATASETS[dataset]["label"], "image": DATASETS[dataset]["image"],
                       "batch": batch, "tokens": n_tok, "layers": n_layers,
                       "params": {k: sum(p.numel() for p in m.parameters()) for k, m in models.items()},
                       "weights_ms": {k: weight_streaming_ms(m, prompt, cfg) for k, m in models.items()},
                       "methods": {}}
                tag = f"{DATASETS[dataset]['label']} B={batch}"
                for key, label in METHODS.items():
                    model = models["linear" if key == "linear" else "softmax"]
                    full = key != "no_cache" or n_tok <= cfg.full_no_cache_max
                    bar.update(overall, description=f"{tag} {label}")
                    steps = n_new if full else len(points)
                    bar.reset(inner, total=steps, visible=True,
                              description=f"  {'tokens' if full else 'prefix lengths'} ({label})")
                    advance = lambda: bar.advance(inner)  # noqa: E731
                    if full:
                        gen = cached_generation if key != "no_cache" else uncached_generation
                        gen(model, prompt, min(8, n_new), cfg.seed)  # warm-up
                        total, step_s = gen(model, prompt, n_new, cfg.seed, on_step=advance)
                        latency = _window_latency(step_s, points)
                        how = f"measured: {n_new} tokens generated end to end"
                    else:
                        latency = []
                        for t in points:
                            timing = measure(uncached_step_fn(model, batch, t, cfg.seed, device),
                                             min_run_time=cfg.min_run_time)
                            latency.append([t, timing.median * 1e3])
                            advance()
                        total = interpolated_sum([(t, ms / 1e3) for t, ms in latency], 1, n_new)
                        how = (f"extrapolated: one step timed at {len(points)} prefix lengths "
                               f"({', '.join(str(t) for t in points)}), interpolated and summed over all {n_new}")
                    row["methods"][key] = {
                        "label": label, "measured": "full" if full else "extrapolated", "how": how,
                        "seconds": total, "images_per_s": batch / total if total > 0 else None,
                        "ms_per_token": 1e3 * total / n_new,
                        "cache_bytes": cache_bytes("linear" if key == "linear" else "softmax", batch, n_tok,
                                                   n_layers, cfg) if key != "no_cache" else 0,
                        "latency_ms": latency,
                    }
                    weights = row["weights_ms"]["linear" if key == "linear" else "softmax"]
                    row["methods"][key]["over_weights"] = (1e3 * total / n_new / weights
                                                           if key != "no_cache" and weights else None)
                    bar.advance(overall)
                lin = row["methods"]["linear"]["images_per_s"]
                row["speedup"] = {k: (lin / row["methods"][k]["images_per_s"]
                                      if lin and row["methods"][k]["images_per_s"] else None)
                                  for k in ("no_cache", "kv_cache")}
                paper = PAPER_IMAGES_PER_S[dataset]
                row["paper_speedup"] = {k: (paper["linear"] / paper[k] if paper[k] else None)
                                        for k in ("no_cache", "kv_cache")}
                results.append(row)
            del models
        bar.update(inner, visible=False)
    config = asdict(cfg)
    config["dtype"] = short_dtype(cfg.dtype)
    config.update(feature_map="elu+1", positions="learned", norm="layernorm", activation="gelu", vocab=VOCAB,
                  weights="untrained (random init; speed does not depend on the weights)",
                  sampling="temperature 1, one torch.Generator per image")
    config["decoding"] = {k: fused_decoding_obstacle(
        LinearTransformerLM(model_config(k, 2, 1, cfg)).to(dtype=cfg.dtype, device=device)) or "fused"
        for k in ("linear", "softmax")}
    notes = [
        "Models are untrained: generation speed does not depend on the weights.",
        "Cached generation (linear, softmax + KV cache) runs model.stream's default step: fused "
        "(linattn.models.decoding, one C++ call per token) where the model allows it, eager otherwise; "
        f"here: {config['decoding']}.",
        "Linear (RNN) and softmax + KV cache always generate whole images end to end; softmax without a cache "
        f"does so up to {cfg.full_no_cache_max} tokens, above which its per-token cost is timed at "
        f"{cfg.probes + 1} prefix lengths and summed over every prefix length (linear interpolation).",
        "Paper numbers come from the authors' GPU runs of full-size trained models (mixture-of-logistics "
        "output); ours: a 256-way softmax output, learned positions, pre-norm LayerNorm blocks.",
    ]
    paper = {d: {"images_per_s": PAPER_IMAGES_PER_S[d], "tokens": DATASETS[d]["tokens"],
                 "layers": DATASETS[d]["layers"], "d_model": D_MODEL, "heads": HEADS, "d_ff": D_FF}
             for d in DATASETS}
    return {"config": config, "methods": METHODS, "paper": paper, "paper_source": PAPER_SOURCE,
            "results": results, "notes": notes}


def check_generate(res: dict) -> list[str]:
    """Warnings about the run's own numbers (bench.consistency), which are single end-to-end runs
    (no spread: a 10% slack): per method and batch, a larger model (layers × tokens) faster per
    token than a smaller one; per image size and method, a larger batch generated faster than a
    smaller one; softmax without a cache faster per token at a longer prefix."""
    out, rows = [], res["results"]
    for key, label in METHODS.items():
        for batch in sorted({r["batch"] for r in rows}):
            pts = [(r["layers"] * r["tokens"], r["methods"][key]["ms_per_token"] / 1e3, None)
                   for r in rows if r["batch"] == batch and key in r["methods"]]
            out += growing_series(f"{label}, batch {batch}, per token", "layers×tokens", pts)
        for dataset in dict.fromkeys(r["dataset"] for r in rows):
            pts = [(r["batch"], r["methods"][key]["seconds"], None) for r in rows
                   if r["dataset"] == dataset and key in r["methods"]]
            out += growing_series(f"{label}, {DATASETS[dataset]['label']}, one batch", "batch", pts)
    for r in rows:
        m = r["methods"].get("no_cache")
        if m and m["latency_ms"]:
            out += growing_series(f"softmax, no cache, {r['label']} B={r['batch']}, one step", "prefix",
                                  [(t, ms / 1e3, None) for t, ms in m["latency_ms"]])
    return out


def _rate(x: float | None) -> str:
    if x is None:
        return "—"
    if x >= 100:
        return f"{x:,.0f}"
    return f"{x:.3g}"


def _times(x: float | None) -> str:
    if x is None:
        return "—"
    return f"{x:,.0f}×" if x >= 100 else f"{x:.3g}×"


def render_generate(res: dict, console: Console) -> None:
    """Two tables: images/s and speedups next to the paper's; time, ms/token and cache per method."""
    cols = ["images", "B", "tokens×layers", "linear img/s", "softmax+KV img/s", "softmax img/s", "÷ softmax",
            "paper", "÷ softmax+KV", "paper"]
    rows = []
    for r in res["results"]:
        m = r["methods"]
        rows.append([r["label"], str(r["batch"]), f"{r['tokens']}×{r['layers']}"]
                    + [_rate(m[k]["images_per_s"]) + ("*" if m[k]["measured"] == "extrapolated" else "")
                       for k in METHODS]
                    + [_times(r["speedup"]["no_cache"]), _times(r["paper_speedup"]["no_cache"]),
                       _times(r["speedup"]["kv_cache"]), _times(r["paper_speedup"]["kv_cache"])])
    cfg = res["config"]
    caption = (f"untrained models, d_model {cfg['d_model']}, {cfg['heads']} heads, FFN {cfg['d_ff']}, "
               f"{cfg['dtype']} on {cfg['device']}, scale {cfg['scale']!r}. "
               "÷: images/s of linear (RNN mode) over the other. "
               "*: extrapolated from one-step timings at a few prefix lengths. paper: Tables 1-2 of Katharopoulos "
               "et al. 2020 (MNIST 8 layers × 784 tokens, CIFAR-10 16 layers × 3,072, the authors' GPU runs).")
    console.print(make_table("autoregressive image generation: images per second, speedup of linear attention",
                             cols, rows, caption=caption))
    cols = ["images", "B", "method", "s per batch", "ms per token", "weights once (ms)", "÷ weights",
            "cache at end (MiB)", "measured"]
    rows = []
    for r in res["results"]:
        for k, m in r["methods"].items():
            how = (f"full image ({r['tokens'] - 1} steps)" if m["measured"] == "full"
                   else f"{len(m['latency_ms'])} prefix lengths, summed")
            weights = r.get("weights_ms", {}).get("linear" if k == "linear" else "softmax")
            ratio = m.get("over_weights")
            rows.append([r["label"], str(r["batch"]), m["label"], f"{m['seconds']:.3g}", f"{m['ms_per_token']:.3g}",
                         "—" if weights is None else f"{weights:.3g}", "—" if ratio is None else f"{ratio:.2f}×",
                         fmt_bytes(m["cache_bytes"]) if k != "no_cache" else "none", how])
    console.print(make_table("time to generate one batch of images", cols, rows,
                             caption="weights once: every matrix-vector product of a decoding step alone (the "
                                     "time to read the weights, linattn.models.decoding), measured in the same run; "
                                     "÷ weights: ms per token (sampling included) over it"))


def plot_generate(res: dict, path) -> None:
    """One log-log panel per dataset (per-token latency vs context length, every method and batch) and
    a bar panel of images/s (log scale), all with labelled axes and legends."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    datasets = list(dict.fromkeys(r["dataset"] for r in res["results"]))
    fig = Figure(figsize=(5.5 * (len(datasets) + 1), 4.6), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(datasets) + 1, squeeze=False)[0]
    colors = {"linear": "tab:blue", "kv_cache": "tab:orange", "no_cache": "tab:red"}
    batches = sorted({r["batch"] for r in res["results"]})
    styles = ["-", "--", ":", "-."]
    for ax, dataset in zip(axes, datasets):
        for r in (r for r in res["results"] if r["dataset"] == dataset):
            ls = styles[batches.index(r["batch"]) % len(styles)]
            for k, m in r["methods"].items():
                pts = [(t, ms) for t, ms in m["latency_ms"] if ms and ms > 0]
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], ls, color=colors[k], marker="o", markersize=3,
                            label=f"{m['label']}, B={r['batch']}" + (" (timed prefixes)" if m["measured"] ==
                                                                      "extrapolated" else ""))
        first = next(r for r in res["results"] if r["dataset"] == dataset)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("context length when generating (tokens)")
        ax.set_ylabel("time per generated token (ms)")
        ax.set_title(f"{first['label']}: {first['tokens']} tokens, {first['layers']} "
                     f"layer{'s' if first['layers'] > 1 else ''}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    ax = axes[-1]
    groups = [(r["label"], r["batch"], r) for r in res["results"]]
    width = 0.8 / len(METHODS)
    for j, (k, label) in enumerate(METHODS.items()):
        xs = [i + (j - (len(METHODS) - 1) / 2) * width for i in range(len(groups))]
        pts = [(x, g[2]["methods"][k]["images_per_s"]) for x, g in zip(xs, groups)
               if g[2]["methods"][k]["images_per_s"]]
        ax.bar([p[0] for p in pts], [p[1] for p in pts], width=width, color=colors[k], label=label)
    ax.set_xticks(range(len(groups)), [f"{g[0]}\nB={g[1]}" for g in groups])
    ax.set_yscale("log")
    ax.set_ylabel("images per second (log scale)")
    ax.set_xlabel("dataset, batch size")
    ax.set_title("throughput")
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.legend(fontsize=8)
    cfg = res["config"]
    fig.suptitle(f"autoregressive image generation (untrained, d_model {cfg['d_model']}, {cfg['heads']} heads, "
                 f"{cfg['dtype']} on {cfg['device']})")
    fig.savefig(path, dpi=110)


__all__ = ["DATASETS", "METHODS", "PAPER_IMAGES_PER_S", "SCALES", "GenerateConfig", "cached_generation",
           "interpolated_sum", "model_config", "plot_generate", "probe_points", "render_generate", "run_generate",
           "uncached_generation"]
