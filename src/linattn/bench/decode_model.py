"""`linattn bench decode`, whole models: the time of one decoding step of an LM beside the time to
read its weights once, the bound a step at small batch cannot beat.

For each model size (d_model × layers), attention kind, weight format, context and batch:

    eager step        model(tok (B, 1), cache=cache): the layers' torch ops, one fused op per attention
    fused step        linattn.models.decoding.FusedDecoder.step: the whole step in one C++ call
    weight streaming  FusedDecoder.weight_streaming: every matrix-vector product of the step once (one
                      per weight matrix, same kernels and threads), nothing else

all timed in the same run with torch.utils.benchmark (bench.timing.measure), in `rounds` rounds that
alternate the three (each round min_run_time / rounds per method; the median round is reported), and
the ratios step ÷ weight streaming. The context is the position of the decoded token: a prefill of `prefill` tokens,
then the caches' position counters moved on to the context. The state of these kinds has the same
size and the step the same work at every context (only RoPE's angles change), so this measures what a
real prefill of the whole context would, without its minutes of prefill on a small machine.

Weight formats (`weights`): fp32 and bf16 (the model in that dtype), int8 (the fp32 model quantized by
torchao's Int8WeightOnlyConfig: int8 weights with a float scale per output row, fp32 activations;
linattn.models.weights). The weight streaming runs the products of the same weights, so each row's
step stands beside the floor of its own format.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

import torch
from rich.console import Console

from ..models.decoding import FusedDecoder, fused_decoding_obstacle
from ..models import KINDS, LinearTransformerLM, ModelConfig
from ..report import fmt_time, make_table, progress
from .consistency import unstable
from .methods import short_dtype
from .timing import alternate, median_round, round_ratio

#: the kinds a model row can take: those with a constant-size state (softmax's KV cache grows)
MODEL_KINDS = tuple(k.name for k in KINDS.values() if k.rnn)
DEFAULT_MODELS = ["d256x4"]
DEFAULT_MODEL_KINDS = ["linear", "gated_deltanet"]
DEFAULT_MODEL_CONTEXTS = [256, 65536]
#: the weight formats of the LMs: their dtype, or int8 weight-only quantization of the fp32 model
WEIGHT_FORMATS = ("fp32", "bf16", "int8")


def parse_model(spec: str) -> tuple[int, int]:
    """'d256x4' -> (d_model 256, 4 layers)."""
    m = re.fullmatch(r"d(\d+)x(\d+)", spec.strip())
    if m is None or int(m[1]) % 8 or int(m[1]) < 16 or int(m[2]) < 1:  # 8 heads of >= 2 dims (RoPE rotates pairs)
        raise ValueError(f"a model is written dWIDTHxLAYERS with WIDTH a multiple of 8 (heads) of at least 16 and "
                         f"LAYERS >= 1, e.g. d256x4, got {spec!r}")
    return int(m[1]), int(m[2])


@dataclass
class ModelDecodeConfig:
    models: list[str] = field(default_factory=lambda: list(DEFAULT_MODELS))
    kinds: list[str] = field(default_factory=lambda: list(DEFAULT_MODEL_KINDS))
    contexts: list[int] = field(default_factory=lambda: list(DEFAULT_MODEL_CONTEXTS))
    batches: list[int] = field(default_factory=lambda: [1])
    dtype: torch.dtype = torch.float32
    seed: int = 0
    min_run_time: float = 0.5
    prefill: int = 64
    rounds: int = 5
    #: weight formats (WEIGHT_FORMATS); None: the format of `dtype`
    weights: list[str] | None = None

    def __post_init__(self):
        for spec in self.models:
            parse_model(spec)
        bad = [k for k in self.kinds if k not in MODEL_KINDS]
        if bad or not self.kinds:
            raise ValueError(f"model kinds must be among {MODEL_KINDS}, got {self.kinds!r}")
        if self.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"model decoding runs float32 or bfloat16, got {self.dtype}")
        if self.weights is None:
            self.weights = [short_dtype(self.dtype)]
        bad = [w for w in self.weights if w not in WEIGHT_FORMATS]
        if bad or not self.weights:
            raise ValueError(f"weights must be among {WEIGHT_FORMATS}, got {self.weights!r}")


def build_model(spec: str, kind: str, cfg: ModelDecodeConfig, weights: str | None = None) -> LinearTransformerLM:
    """The LM of `spec` (8 heads, byte vocabulary, RoPE, SwiGLU, RMSNorm: ModelConfig's defaults) in every
    layer `kind`, untrained (the step's time does not depend on the weights), its weights in the format
    `weights` (default: cfg.dtype's)."""
    d, layers = parse_model(spec)
    config = ModelConfig(d_model=d, n_layers=layers, n_heads=8, attention=[kind], positions="rope", seed=cfg.seed)
    weights = weights or short_dtype(cfg.dtype)
    model = LinearTransformerLM(config).to(torch.bfloat16 if weights == "bf16" else torch.float32).eval()
    if weights == "int8":
        quantize_int8(model)
    return model


def quantize_int8(model, dynamic: bool = False) -> None:
    """Quantizes every nn.Linear of `model` to int8 weight-only (torchao's Int8WeightOnlyConfig), or with
    dynamic int8 activations (Int8DynamicActivationInt8WeightConfig), in place."""
    try:
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig, quantize_
    except ImportError as exc:
        raise ValueError("int8 weights need torchao: pip install 'linattn[quant]'") from exc
    quantize_(model, Int8DynamicActivationInt8WeightConfig() if dynamic else Int8WeightOnlyConfig())


def cache_at_context(model, batch: int, ctx: int, prefill: int, seed: int):
    """A cache after a prefill of min(prefill, ctx) random tokens, its position counters moved to ctx."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (batch, min(prefill, ctx)), generator=g)
    with torch.inference_mode():
        _, cache = model(ids, cache=model.new_cache(), last_only=True)
    for counter in (cache, *cache.layers):
        counter.length = ctx
    return cache


def _point(model, batch: int, ctx: int, cfg: ModelDecodeConfig) -> dict:
    tok = torch.randint(0, model.config.vocab_size, (batch,), generator=torch.Generator().manual_seed(cfg.seed))
    eager_cache = cache_at_context(model, batch, ctx, cfg.prefill, cfg.seed)
    fused_cache = cache_at_context(model, batch, ctx, cfg.prefill, cfg.seed)
    decoder = FusedDecoder(model, fused_cache)

    def eager():
        with torch.inference_mode():
            return model(tok[:, None], cache=eager_cache, last_only=True)

    fns = {"eager": eager, "fused": lambda: decoder.step(tok), "stream": decoder.weight_streaming}
    for fn in fns.values():
        fn()
    per_round = alternate(fns, rounds=cfg.rounds, min_run_time=cfg.min_run_time)
    times = {key: median_round(ts) for key, ts in per_round.items()}
    row = {key: t.as_dict() for key, t in times.items()}
    stream = times["stream"].median
    row.update(weight_bytes=decoder.weight_bytes, stream_gb_s=decoder.weight_bytes / stream / 1e9,
               fused_over_stream=round_ratio(per_round, "fused", "stream"),
               eager_over_stream=round_ratio(per_round, "eager", "stream"),
               eager_over_fused=round_ratio(per_round, "eager", "fused"), fused_tokens_s=batch / times["fused"].median)
    return row


def run_model_decode(cfg: ModelDecodeConfig, console: Console | None = None) -> dict:
    """Per-token step times of whole models (eager, fused) and their weight-streaming time."""
    console = console or Console()
    rows = []
    points = [(m, k, w, c, b) for m in cfg.models for k in cfg.kinds for w in cfg.weights for c in cfg.contexts
              for b in cfg.batches]
    with progress(console) as bar:
        task = bar.add_task("bench decode (models)", total=len(points))
        built: dict = {}
        for spec, kind, weights, ctx, batch in points:
            bar.update(task, description=f"{spec} {kind} {weights} ctx={ctx} B={batch}")
            if (spec, kind, weights) not in built:
                built = {(spec, kind, weights): build_model(spec, kind, cfg, weights)}
            model = built[(spec, kind, weights)]
            obstacle = fused_decoding_obstacle(model)
            if obstacle is not None:
                raise ValueError(f"bench decode --models: {obstacle}")
            rows.append({"model": spec, "kind": kind, "weights": weights, "ctx": ctx, "batch": batch,
                         **_point(model, batch, ctx, cfg)})
            bar.advance(task)
    config = asdict(cfg)
    config["dtype"] = short_dtype(cfg.dtype)
    return {"config": config, "results": rows}


def check_model_decode(res: dict) -> list[str]:
    """Warnings about the sweep's own numbers: unstable points, and a fused step faster than reading
    its weights (impossible unless the weights sit in cache, which a larger model avoids)."""
    out = []
    for r in res["results"]:
        where = f"{r['model']} {r['kind']} {r.get('weights', '')} ctx={r['ctx']} B={r['batch']}"
        for key in ("eager", "fused", "stream"):
            out += unstable(f"model {key}", where, r[key]["median_s"], r[key]["iqr_s"])
        if r["fused_over_stream"] < 0.9:
            out.append(f"{where}: the fused step took {r['fused_over_stream']:.2f}× the weight streaming time; the "
                       "weights may sit in the CPU cache (a larger model streams them from memory)")
    return out


def render_model_decode(res: dict, console: Console) -> None:
    cols = ["model", "kind", "format", "ctx", "B", "eager", "fused", "weights", "fused÷w", "eager÷w", "eager÷fused",
            "MB", "GB/s", "tokens/s"]
    rows = []
    for r in res["results"]:
        rows.append([r["model"], r["kind"], r.get("weights", res["config"]["dtype"]), str(r["ctx"]), str(r["batch"]),
                     *(fmt_time(r[k]["median_s"], r[k]["iqr_s"]) for k in ("eager", "fused", "stream")),
                     *(f"{r[k]:.2f}×" for k in ("fused_over_stream", "eager_over_stream", "eager_over_fused")),
                     f"{r['weight_bytes'] / 1e6:.1f}", f"{r['stream_gb_s']:.1f}", f"{r['fused_tokens_s']:.0f}"])
    console.print(make_table("per-token decode step of whole LMs (ms, median ±IQR; ratios: median over alternating "
                             "rounds); format: the weights' (int8: weight-only, fp32 activations); weights = every "
                             "matrix-vector product of the step once, alone, same weights; tokens/s of the fused step",
                             cols, rows))
