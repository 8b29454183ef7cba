"""`linattn bench decode`: the cost of generating one token against a context of length `ctx`.

    linear step     linattn.linear_attention_step on a (kv, z) state — O(1) in ctx
    gated step      linattn.gated_linear_attention_step on a state kv (D×E per head), scalar or vector g
    DeltaNet step   linattn.delta_rule_step (qk_l2norm) on a state S (D×E per head) — O(1) in ctx
    Gated DeltaNet step  the same with a log-decay g — O(1) in ctx
    softmax + cache SDPA of the new query against a KV cache of ctx tokens — O(ctx)
    softmax, no cache  full causal SDPA over ctx + 1 tokens, recomputed for the last token — O(ctx²)

All under torch.inference_mode, per layer of H heads. Also reports the bytes a linear state and a
KV cache hold at that context.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from rich.console import Console

from ..nn.feature_maps import EluPlusOne
from ..ops import delta_rule_step, gated_linear_attention_step, linear_attention_step
from ..report import fmt_bytes, fmt_time, make_table, plot_loglog, progress
from .consistency import growing_series, unstable
from .methods import Shape, SweepConfig, short_dtype
from .timing import measure

DEFAULT_CONTEXTS = [256, 512, 1024, 2048, 4096, 8192, 16384]
DECODE_METHODS = {"linear_step": "linear RNN step", "gated_scalar_step": "gated step, scalar g",
                  "gated_vector_step": "GLA step, vector g", "delta_step": "DeltaNet step",
                  "gated_delta_step": "Gated DeltaNet step", "kv_cache": "softmax + KV cache",
                  "no_cache": "softmax, no cache"}


def _randn(gen, *size, dtype, device):
    return torch.randn(*size, generator=gen).to(device=device, dtype=dtype)


def _one_token(shape: Shape, dtype: torch.dtype, device, seed: int):
    """(generator, q, k (B, H, 1, D), v (B, H, 1, E), a float32 state S (B, H, D, E)), drawn in that order."""
    gen = torch.Generator().manual_seed(seed)
    b, h, d, e = shape.batch, shape.heads, shape.head_dim, shape.value_dim
    q, k = (_randn(gen, b, h, 1, d, dtype=dtype, device=device) for _ in range(2))
    v = _randn(gen, b, h, 1, e, dtype=dtype, device=device)
    return gen, q, k, v, _randn(gen, b, h, d, e, dtype=torch.float32, device=device)


def _inference(op, *args, **kwargs):
    """op(*args, **kwargs) under torch.inference_mode(), as a function of nothing (what is timed)."""

    def fn():
        with torch.inference_mode():
            return op(*args, **kwargs)

    return fn


def linear_step_fn(shape: Shape, dtype: torch.dtype, device, seed: int = 0):
    """One linattn.linear_attention_step (elu+1, normalized) from a float32 state (B, H, F, E), (B, H, F)."""
    gen, q, k, v, kv = _one_token(shape, dtype, device, seed)
    z = _randn(gen, shape.batch, shape.heads, shape.head_dim, dtype=torch.float32, device=device).abs() + 1
    return _inference(linear_attention_step, (kv, z), q, k, v, feature_map=EluPlusOne(shape.head_dim))


def gated_step_fn(shape: Shape, dtype: torch.dtype, device, seed: int = 0, per_feature: bool = False):
    """One linattn.gated_linear_attention_step (g = −0.1, per head or per feature) from a float32 state kv."""
    _, q, k, v, state = _one_token(shape, dtype, device, seed)
    b, h, d = shape.batch, shape.heads, shape.head_dim
    g = torch.full((b, h, 1, d) if per_feature else (b, h, 1), -0.1, device=device)
    return _inference(gated_linear_attention_step, state, q, k, v, g)


def delta_step_fn(shape: Shape, dtype: torch.dtype, device, seed: int = 0, gated: bool = False):
    """One linattn.delta_rule_step (qk_l2norm, β = 0.5, g = −0.1 when gated) from a float32 state (B, H, D, E)."""
    _, q, k, v, state = _one_token(shape, dtype, device, seed)
    b, h = shape.batch, shape.heads
    beta = torch.full((b, h, 1), 0.5, device=device)
    g = torch.full((b, h, 1), -0.1, device=device) if gated else None
    return _inference(delta_rule_step, state, q, k, v, beta, g=g, qk_l2norm=True)


def kv_cache_fn(shape: Shape, ctx: int, dtype: torch.dtype, device, seed: int = 0):
    """SDPA of one query (B, H, 1, D) against a cache of ctx keys and values (no mask needed)."""
    gen = torch.Generator().manual_seed(seed)
    b, h, d, e = shape.batch, shape.heads, shape.head_dim, shape.value_dim
    q = _randn(gen, b, h, 1, d, dtype=dtype, device=device)
    kc = _randn(gen, b, h, ctx, d, dtype=dtype, device=device)
    vc = _randn(gen, b, h, ctx, e, dtype=dtype, device=device)
    return _inference(F.scaled_dot_product_attention, q, kc, vc)


def no_cache_fn(shape: Shape, ctx: int, dtype: torch.dtype, device, seed: int = 0):
    """Full causal SDPA over ctx + 1 tokens (what decoding costs without a cache), last row kept."""
    gen = torch.Generator().manual_seed(seed)
    b, h, d, e = shape.batch, shape.heads, shape.head_dim, shape.value_dim
    q, k = (_randn(gen, b, h, ctx + 1, d, dtype=dtype, device=device) for _ in range(2))
    v = _randn(gen, b, h, ctx + 1, e, dtype=dtype, device=device)

    def fn():
        with torch.inference_mode():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)[:, :, -1:]

    return fn


def state_bytes(shape: Shape) -> int:
    """Bytes of a float32 linear-attention state (kv + z) for one layer."""
    return 4 * shape.batch * shape.heads * (shape.head_dim * shape.value_dim + shape.head_dim)


def kv_cache_bytes(shape: Shape, ctx: int, dtype: torch.dtype) -> int:
    """Bytes of a K and V cache of ctx tokens for one layer."""
    el = torch.empty((), dtype=dtype).element_size()
    return el * shape.batch * shape.heads * ctx * (shape.head_dim + shape.value_dim)


@dataclass
class DecodeConfig(SweepConfig):
    contexts: list[int] = field(default_factory=lambda: list(DEFAULT_CONTEXTS))
    no_cache_max: int | None = None


def run_decode(cfg: DecodeConfig, console: Console | None = None) -> dict:
    """Per-token latency of each decode method at each context length; ratios to the linear step."""
    console = console or Console()
    device = torch.device(cfg.device)
    rows = []
    with progress(console) as bar:
        task = bar.add_task("bench decode", total=len(cfg.contexts) * len(DECODE_METHODS))
        for ctx in cfg.contexts:
            row = {"ctx": ctx, "state_bytes": state_bytes(cfg.shape),
                   "kv_cache_bytes": kv_cache_bytes(cfg.shape, ctx, cfg.dtype)}
            for key, label in DECODE_METHODS.items():
                bar.update(task, description=f"ctx={ctx} {label}")
                if key == "no_cache" and cfg.no_cache_max is not None and ctx > cfg.no_cache_max:
                    row[key] = None
                else:
                    fn = {"linear_step": lambda: linear_step_fn(cfg.shape, cfg.dtype, device, cfg.seed),
                          "gated_scalar_step": lambda: gated_step_fn(cfg.shape, cfg.dtype, device, cfg.seed),
                          "gated_vector_step": lambda: gated_step_fn(cfg.shape, cfg.dtype, device, cfg.seed,
                                                                     per_feature=True),
                          "delta_step": lambda: delta_step_fn(cfg.shape, cfg.dtype, device, cfg.seed),
                          "gated_delta_step": lambda: delta_step_fn(cfg.shape, cfg.dtype, device, cfg.seed,
                                                                       gated=True),
                          "kv_cache": lambda: kv_cache_fn(cfg.shape, ctx, cfg.dtype, device, cfg.seed),
                          "no_cache": lambda: no_cache_fn(cfg.shape, ctx, cfg.dtype, device, cfg.seed)}[key]()
                    row[key] = measure(fn, min_run_time=cfg.min_run_time, warmup=3).as_dict()
                bar.advance(task)
            base = row["linear_step"]["median_s"]
            for key in ("kv_cache", "no_cache"):
                row[f"{key}_over_step"] = None if row[key] is None else row[key]["median_s"] / base
            rows.append(row)
    config = asdict(cfg)
    config["dtype"] = short_dtype(cfg.dtype)
    config.update(feature_map="elu+1", normalize=True, state_dtype="float32")
    return {"config": config, "methods": DECODE_METHODS, "results": rows}


#: the decode methods whose per-token cost grows with the context (the linear step's does not)
GROWS_WITH_CONTEXT = ("kv_cache", "no_cache")


def check_decode(res: dict) -> list[str]:
    """Warnings about the sweep's own numbers (bench.consistency): unstable points, and softmax with
    or without a cache faster at a longer context, or flat over the sweep."""
    out = []
    for key, label in DECODE_METHODS.items():
        pts = [(r["ctx"], r[key]["median_s"], r[key]["iqr_s"]) for r in res["results"] if r.get(key)]
        for ctx, median, iqr in pts:
            out += unstable(label, f"context {ctx}", median, iqr)
        if key in GROWS_WITH_CONTEXT:
            out += growing_series(label, "context", pts)
    if res.get("models"):
        from .decode_model import check_model_decode

        out += check_model_decode(res["models"])
    return out


def render_decode(res: dict, console: Console) -> None:
    cols = ["context"] + list(DECODE_METHODS.values()) + [
        "KV cache / step", "no cache / step", "state (MiB)", "KV cache (MiB)"]
    rows = []
    for r in res["results"]:
        row = [str(r["ctx"])]
        for key in DECODE_METHODS:
            t = r[key]
            row.append("skipped" if t is None else fmt_time(t["median_s"], t["iqr_s"]))
        for key in ("kv_cache_over_step", "no_cache_over_step"):
            row.append("—" if r[key] is None else f"{r[key]:.2f}×")
        row += [fmt_bytes(r["state_bytes"]), fmt_bytes(r["kv_cache_bytes"])]
        rows.append(row)
    console.print(make_table("per-token decode latency, one layer (ms, median ±IQR)", cols, rows))
    if res.get("models"):
        from .decode_model import render_model_decode

        render_model_decode(res["models"], console)


def plot_decode(res: dict, path) -> None:
    series = {}
    for key, label in DECODE_METHODS.items():
        pts = [(r["ctx"], r[key]["median_s"] * 1e3) for r in res["results"] if r[key]]
        if pts:
            series[label] = ([p[0] for p in pts], [p[1] for p in pts])
    cfg, sh = res["config"], res["config"]["shape"]
    plot_loglog(path, [{"title": "per-token latency", "series": series}],
                title=f"decoding, B={sh['batch']} H={sh['heads']} F={sh['head_dim']} E={sh['value_dim']} "
                      f"{cfg['dtype']} on {cfg['device']}",
                xlabel="context length (tokens)", ylabel="time per token (ms)")
