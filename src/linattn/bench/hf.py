"""`linattn bench hf`: transformers' Qwen3.5 three ways, measured side by side in one run.

For each model shape (random weights, nothing downloaded; fp32, batch 1) and each thread count:

    transformers   transformers' own torch path (its undecorated gated delta rule and convolution)
    kernels        the same model under linattn.hf.use_linattn_kernels("qwen3_5")
    accelerate     linattn.hf.accelerate(model): the model converted to a linattn LM (fused decoding);
                   "n/a" where this linattn has no linattn.hf.accelerate, or it refuses the model

and the metrics

    prefill T      tokens/s of a forward over T tokens (no cache; the last token's logits only)
    decode         ms per token of a one-token forward on the cache of a `decode_prompt`-token prompt
                   (the cache grows by a token a call; linattn's models take their fused step there),
                   beside the fp32 gemv floor measured in the same run: every nn.Linear weight of the
                   model read once by the fused decoder's matrix-vector kernels (csrc/matvec.h), the
                   bound a decoding step at B = 1 cannot beat
    train T        seconds of one training step (forward with labels = inputs, backward) over T tokens
    decode bf16 / decode int8 / decode int8 dyn   (accelerate only) the same decode with the converted
                   model's weights in bf16, int8 weight-only by torchao's Int8WeightOnlyConfig (fp32
                   activations), or int8 with int8 activations by Int8DynamicActivationInt8WeightConfig
                   (activations rounded per token, integer products: csrc/matvec_dynamic.h; llama.cpp's
                   Q8_0 also rounds the activations, in blocks of 32), each beside the gemv floor of
                   those weights

and, where llama-cpp-python imports and llama.cpp's converter is found (bench.llamacpp), the same model
converted to GGUF F32 and Q8_0 and run by llama.cpp on the same threads: the columns "llama.cpp F32" and
"llama.cpp Q8_0" (prefill and decode; training n/a), with llama.cpp F32's greedy tokens checked against
transformers' in the same run; "n/a" with the reason otherwise, or under `llama_cpp=False`.

Beside each prefill and training step, the bound on any speed-up over transformers that keeps the model's
products: transformers' time over the time its Linear layers' products (their FLOPs counted in one call
of transformers' path, `linear_flops`) take at this machine's fp32 matmul peak measured on the same
threads (bench.flops.best_matmul_peak, the roofline's tiles) — what a path would reach if those products
ran at the peak and nothing else took any time. Where transformers' own products already run near the
peak, no kernel reaches a large speed-up (design §15.7).

Times are medians of torch.utils.benchmark blocked runs (bench.timing.measure, `min_run_time` each);
each prefill and the training step come from `rounds` rounds that take transformers, kernels and
accelerate in turn, and the decode row's accelerate, floor and llama.cpp F32 figures from rounds that
alternate those three; the speed-ups are medians of the ratios within a round. The models' weights
are first put on transparent huge pages (linattn.models.huge_pages; `huge_pages=False` /
`--no-huge-pages` leaves them), which every column's decode then streams.
Shapes (SHAPES): "small", the 4-layer shape of the first measurements (3 Gated DeltaNet + 1 attention,
hidden 1024); "qwen3.5-0.8b", the published Qwen3.5-0.8B text model (24 layers, full attention every
4th, hidden 1024, FFN 3584, 8 × 256 attention heads with 2 KV heads, vocabulary 248,320, tied
embeddings; linear heads 16 × 128 for keys and values, transformers' Qwen3_5TextConfig defaults
for the rest) — about 2.6 GB of fp32 weights; "tiny", for tests.
"""

from __future__ import annotations

import contextlib
import importlib
from dataclasses import asdict, dataclass, field

import torch
from rich.console import Console
from torch import nn

from ..models.pages import huge_pages
from ..report import make_table, progress
from . import llamacpp
from .flops import best_matmul_peak
from .timing import alternate, measure, median_round, round_ratio

_LINEAR_HEADS = dict(linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
                     linear_num_value_heads=16, linear_conv_kernel_dim=4)
#: Qwen3_5TextConfig arguments of each shape
SHAPES = {
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=32, linear_key_head_dim=16, linear_value_head_dim=16,
                 linear_num_key_heads=2, linear_num_value_heads=2, linear_conv_kernel_dim=4,
                 tie_word_embeddings=False),
    "small": dict(vocab_size=4096, hidden_size=1024, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=128, tie_word_embeddings=False, **_LINEAR_HEADS),
    "qwen3.5-0.8b": dict(vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=256, tie_word_embeddings=True,
                         **_LINEAR_HEADS),
}
COLUMNS = ("transformers", "kernels", "accelerate")
LLAMA_COLUMNS = tuple(llamacpp.FORMATS)


@dataclass
class HfBenchConfig:
    shapes: list[str] = field(default_factory=lambda: ["small"])
    threads: list[int] = field(default_factory=lambda: [1])
    lengths: list[int] = field(default_factory=lambda: [2048])
    decode_prompt: int = 256
    train_len: int = 1024
    min_run_time: float = 0.5
    seed: int = 0
    #: also decode the accelerated model with bf16, int8 weight-only and int8 dynamic (torchao) weights
    low_precision: bool = True
    #: also convert the model to GGUF F32 / Q8_0 and run it by llama.cpp (where available)
    llama_cpp: bool = True
    #: llama.cpp's converter: a llama.cpp checkout or llama-cpp-python sdist (None: $LINATTN_LLAMA_CPP_SOURCE)
    llama_cpp_source: str | None = None
    #: rounds that take the columns in turn: each prefill and the training step across transformers, kernels
    #: and accelerate, and the decode of accelerate, its gemv floor and llama.cpp F32 (the machine's memory
    #: bandwidth drifts between measurements minutes apart; the ratios are medians of within-round ratios);
    #: 0: one round of the metrics, and the decode contest skipped (each decode measured apart)
    rounds: int = 3
    #: the models' weights on transparent huge pages (linattn.models.huge_pages) before anything is
    #: measured: every column's decode streams them (llama.cpp reads its own GGUF mapping)
    huge_pages: bool = True

    def __post_init__(self):
        bad = [s for s in self.shapes if s not in SHAPES]
        if bad or not self.shapes:
            raise ValueError(f"shapes must be among {','.join(SHAPES)}, got {self.shapes!r}")
        if self.rounds < 0:
            raise ValueError(f"rounds must be >= 0, got {self.rounds}")
        for name in ("decode_prompt", "train_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.threads or min(self.threads) < 1 or not self.lengths or min(self.lengths) < 1:
            raise ValueError(f"threads and lengths must be positive, got {self.threads!r}, {self.lengths!r}")


def qwen_model(shape: str, seed: int) -> nn.Module:
    """A random Qwen3.5 causal LM of `shape` (SHAPES): 3 Gated DeltaNet layers to 1 full attention, fp32, eval."""
    import transformers

    kw = dict(SHAPES[shape])
    layers = kw["num_hidden_layers"]
    kw["layer_types"] = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    torch.manual_seed(seed)
    config = transformers.Qwen3_5TextConfig(**kw)
    return transformers.AutoModelForCausalLM.from_config(config).float().eval()


@contextlib.contextmanager
def torch_path():
    """transformers' undecorated torch functions (its wrapper may point at FLA's Triton kernels)."""
    from ..hf import kernels

    path, names = kernels.MODEL_TYPES["qwen3_5"]
    module = importlib.import_module(path)
    saved = {n: getattr(module, n) for n in names if hasattr(module, n)}
    for n, f in saved.items():
        setattr(module, n, getattr(f, "__wrapped__", f))
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(module, n, f)


def floor_plan(model: nn.Module, dtype: torch.dtype = torch.float32):
    """(plan, bytes): a DecodePlan whose `stream()` reads every nn.Linear weight of `model` once with the
    fused decoder's matrix-vector kernels at B = 1 (one product per weight, as a fused step runs them: fp32
    activations, the weights as they are, fp32, bf16 (dtype bfloat16) or torchao int8; with torchao's
    dynamic int8, the activations rounded to int8 and integer products), and the bytes it reads."""
    from ..models.weights import activation_quantization, plan_weight
    from ..ops import native

    if not (native.enabled() and native.load()):
        raise ValueError("bench hf: the gemv floor needs the fused CPU kernels (linattn.ops.native), which did not load")
    plan = torch.classes.linattn_cpu.DecodePlan(1, dtype == torch.bfloat16)
    for lin in (m for m in model.modules() if isinstance(m, nn.Linear)):
        t, kn = plan_weight(lin, dtype)
        t.pop("bias", None)
        act = activation_quantization(lin)
        x, out = torch.zeros(1, lin.in_features), torch.zeros(1, lin.out_features)  # fp32, as the plan's buffers
        plan.add("group", {"input": x}, {"_": 0}, {"_": 0.0})
        plan.add("product", {**t, "out": out}, {"kn": kn, "epilogue": 0, "act_quant": act}, {"_": 0.0})
    return plan, int(plan.weight_bytes())


def gemv_floor(model: nn.Module, min_run_time: float, dtype: torch.dtype = torch.float32) -> tuple[float, int]:
    """(seconds, bytes) of floor_plan(model, dtype).stream(): the bound a decoding step at B = 1 cannot beat."""
    plan, total = floor_plan(model, dtype)
    return measure(plan.stream, min_run_time=min_run_time).median, total


def _workloads(model, cfg: HfBenchConfig, vocab: int) -> dict:
    """{metric: (function, trains)}: a prefill per length (no cache, the last token's logits) and a training
    step (forward with labels = inputs, backward), the inputs drawn from cfg.seed."""
    g = torch.Generator().manual_seed(cfg.seed)
    out = {}
    for t in cfg.lengths:
        x = torch.randint(0, vocab, (1, t), generator=g)

        def prefill(x=x):
            with torch.no_grad():
                model(x, use_cache=False, logits_to_keep=1)
        out[f"prefill {t}"] = (prefill, False)
    x = torch.randint(0, vocab, (1, cfg.train_len), generator=g)

    def train_step():
        model.zero_grad(set_to_none=True)
        model(x, labels=x, use_cache=False).loss.backward()
    out[f"train {cfg.train_len}"] = (train_step, True)
    return out


def linear_flops(model: nn.Module, fn, trains: bool) -> float:
    """FLOPs of the products of model's nn.Linear layers in one call of fn(): 2·rows·in·out per call of
    a layer (rows: its input's rows, read by a forward hook), three times that when the call trains
    (the backward's products for the input's and the weight's gradients). The mixers' own products
    are not counted: linattn's kernels replace them."""
    total = [0]

    def count(module, args, _out):
        total[0] += 2 * (args[0].numel() // module.in_features) * module.in_features * module.out_features

    hooks = [m.register_forward_hook(count) for m in model.modules() if isinstance(m, nn.Linear)]
    try:
        fn()
    finally:
        for h in hooks:
            h.remove()
    return float(total[0] * (3 if trains else 1))


def linear_flop_counts(model, cfg: HfBenchConfig, vocab: int) -> dict:
    """{metric: FLOPs of the Linear products} of each prefill and the training step on transformers' path
    (`linear_flops`); counted once per shape: the count does not depend on the thread count."""
    out = {}
    for metric, (fn, trains) in _workloads(model, cfg, vocab).items():
        with torch_path():
            model.train(trains)
            try:
                out[metric] = linear_flops(model, fn, trains)
            finally:
                model.zero_grad(set_to_none=True)
                model.eval()
    return out


def _fp32_peak(cfg: HfBenchConfig, threads: int) -> float:
    """GFLOP/s of the fp32 matmul peak on `threads` threads (best_matmul_peak over the roofline's tiles)."""
    from .roofline import PEAK_TILES

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return best_matmul_peak(torch.float32, "cpu", PEAK_TILES, min(cfg.min_run_time, 0.5))["gflops"]
    finally:
        torch.set_num_threads(before)


def _alternated_metrics(runs: dict, cfg: HfBenchConfig, vocab: int) -> tuple[dict, dict, dict]:
    """The columns' prefills and training step, each metric in max(cfg.rounds, 1) rounds that take the
    columns in turn. runs: {column: (model, context)}, the context (a function returning a context
    manager) entered around each of the column's measurements. Returns ({column: {metric: seconds of the
    median round}}, {metric: {"transformers / column": median within-round ratio}}, {column: why it
    failed}): a column whose first call raises is dropped with its error."""
    rounds = max(cfg.rounds, 1)
    work = {c: _workloads(m, cfg, vocab) for c, (m, _) in runs.items()}
    cols: dict = {c: {} for c in runs}
    ratios: dict = {}
    failed: dict = {}
    for metric in work[next(iter(runs))]:
        fns = {}
        for c, (model, context) in runs.items():
            if c in failed:
                continue
            fn, trains = work[c][metric]

            def run(fn=fn, trains=trains, model=model, context=context):
                with context():
                    model.train(trains)
                    try:
                        fn()
                    finally:
                        if trains:
                            model.zero_grad(set_to_none=True)
                        model.eval()
            try:
                run()  # a warm-up call, and the column's chance to fail
            except Exception as exc:  # noqa: BLE001  (accelerate is young: its failure is the column's note)
                failed[c] = f"{c} ran into {type(exc).__name__}: {exc}"[:300]
                continue
            fns[c] = run
        per_round = alternate(fns, rounds=rounds, min_run_time=cfg.min_run_time)
        for c, ts in per_round.items():
            cols[c][metric] = median_round(ts).median
        ratios[metric] = {f"transformers / {c}": round_ratio(per_round, "transformers", c)
                          for c in per_round if c != "transformers" and "transformers" in per_round}
    return cols, ratios, failed


def _decode_step(model, cfg: HfBenchConfig, vocab: int, g: torch.Generator):
    """A function running one one-token forward on the cache of a `decode_prompt`-token prompt (the cache
    grows by a token a call)."""
    prompt = torch.randint(0, vocab, (1, cfg.decode_prompt), generator=g)
    with torch.no_grad():
        cache = model(prompt, use_cache=True, logits_to_keep=1).cache
    tok = prompt[:, -1:]

    def step():
        with torch.no_grad():
            model(tok, cache=cache, use_cache=True, logits_to_keep=1)
    return step


def _decode(model, cfg: HfBenchConfig, vocab: int, g: torch.Generator) -> float:
    """Seconds per token of _decode_step."""
    return measure(_decode_step(model, cfg, vocab, g), min_run_time=cfg.min_run_time).median


def _decode_contest(acc, plan, threads: int, cfg: HfBenchConfig, ggufs: llamacpp.Ggufs, vocab: int,
                    llama_probe: float | None) -> dict:
    """accelerate's fp32 decode, the gemv floor (`plan`: floor_plan of the model) and (where its GGUF runs)
    llama.cpp F32's decode, in cfg.rounds rounds that alternate them on `threads` threads: {"rounds",
    "seconds": {name: median round}, "ratios": {"a / b": median over the rounds of the within-round ratio}}."""
    fns = {"accelerate": _decode_step(acc, cfg, vocab, torch.Generator().manual_seed(cfg.seed)),
           "floor": plan.stream}
    prompt = torch.randint(0, vocab, (cfg.decode_prompt,), generator=torch.Generator().manual_seed(cfg.seed)).tolist()
    with contextlib.ExitStack() as stack:
        if llamacpp.F32 in ggufs.paths and llama_probe:
            fns[llamacpp.F32] = stack.enter_context(llamacpp.decode_stepper(
                ggufs.paths[llamacpp.F32], threads, prompt, cfg.min_run_time + 0.2 * cfg.rounds, llama_probe))
        for fn in fns.values():
            fn()
        per_round = alternate(fns, rounds=cfg.rounds, min_run_time=cfg.min_run_time)
    pairs = [("accelerate", "floor"), (llamacpp.F32, "floor"), (llamacpp.F32, "accelerate")]
    return {"rounds": cfg.rounds, "seconds": {k: median_round(ts).median for k, ts in per_round.items()},
            "ratios": {f"{a} / {b}": round_ratio(per_round, a, b) for a, b in pairs if a in fns}}


def _low_precision_decodes(acc, cfg: HfBenchConfig, vocab: int) -> list[dict]:
    """The accelerated model's decode with bf16, int8 weight-only and int8 dynamic (torchao) weights, each
    beside the gemv floor of the same weights: [{"weights", "decode_s", "floor_s", "weight_bytes",
    "note"}]."""
    import copy

    from .decode_model import quantize_int8

    out = []
    for fmt in ("bf16", "int8", "int8 dyn"):
        row = {"weights": fmt, "decode_s": None, "floor_s": None, "weight_bytes": None, "note": None}
        try:
            m = copy.deepcopy(acc)
            if fmt == "bf16":
                m = m.to(torch.bfloat16)
                if cfg.huge_pages:
                    huge_pages(m)
            else:
                quantize_int8(m, dynamic=fmt == "int8 dyn")
            dtype = torch.bfloat16 if fmt == "bf16" else torch.float32
            row["floor_s"], row["weight_bytes"] = gemv_floor(m, cfg.min_run_time, dtype)
            row["decode_s"] = _decode(m, cfg, vocab, torch.Generator().manual_seed(cfg.seed))
            del m
        except Exception as exc:  # noqa: BLE001  (torchao missing, a refusal: the row's note)
            row["note"] = f"{type(exc).__name__}: {exc}"[:200]
        out.append(row)
    return out


def _accelerated(model):
    """(linattn.hf.accelerate(model), None), or (None, why not)."""
    from .. import hf

    if not hasattr(hf, "accelerate"):
        return None, "this linattn has no linattn.hf.accelerate"
    try:
        return hf.accelerate(model).float().eval(), None
    except (ValueError, NotImplementedError, KeyError) as exc:  # a model it does not convert
        return None, f"{type(exc).__name__}: {exc}"


def _metric_names(cfg: HfBenchConfig) -> list[str]:
    """The rows of a shape × threads point, in order."""
    return [*(f"prefill {t}" for t in cfg.lengths), "decode", f"train {cfg.train_len}"]


def _point(shape: str, model, threads: int, cfg: HfBenchConfig, ggufs: llamacpp.Ggufs, flops: dict) -> list[dict]:
    """The rows of one shape × thread count; flops: `linear_flop_counts` of the shape's model."""
    from ..hf import use_linattn_kernels

    vocab = SHAPES[shape]["vocab_size"]
    plan, weight_bytes = floor_plan(model)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        acc, why = _accelerated(model)
        if acc is not None and cfg.huge_pages:
            huge_pages(acc)  # the matrices accelerate built (the shared ones are done)
        runs = {"transformers": (model, torch_path), "kernels": (model, lambda: use_linattn_kernels("qwen3_5"))}
        if acc is not None:
            runs["accelerate"] = (acc, contextlib.nullcontext)
        measured, ratios, failed = _alternated_metrics(runs, cfg, vocab)
        why = failed.pop("accelerate", why)
        if failed:  # transformers' own path or its patched kernels failing is the run's end
            raise RuntimeError("; ".join(failed.values()))
        cols: dict = dict.fromkeys(COLUMNS)
        for c, (m, context) in runs.items():
            if not measured[c]:
                continue
            cols[c] = dict(measured[c])
            if not (cfg.rounds and c == "accelerate"):  # accelerate's decode comes from the contest below
                with context():
                    cols[c]["decode"] = _decode(m, cfg, vocab, torch.Generator().manual_seed(cfg.seed))
        low_precision = []
        if cfg.low_precision and cols["accelerate"] is not None:
            low_precision = _low_precision_decodes(acc, cfg, vocab)
    finally:
        torch.set_num_threads(before)
    peak = _fp32_peak(cfg, threads)
    llama, llama_notes = llamacpp.columns(ggufs, threads, cfg.lengths, cfg.decode_prompt, cfg.min_run_time, vocab,
                                          cfg.seed)
    llama_note = "; ".join(f"{c}: {n}" for c, n in llama_notes.items()) or None
    contest = None
    torch.set_num_threads(threads)
    try:
        if cfg.rounds and cols["accelerate"] is not None:
            contest = _decode_contest(acc, plan, threads, cfg, ggufs, vocab, (llama[llamacpp.F32] or {}).get("decode"))
            cols["accelerate"]["decode"] = contest["seconds"]["accelerate"]
            floor = contest["seconds"]["floor"]
            if llamacpp.F32 in contest["seconds"]:
                llama[llamacpp.F32]["decode"] = contest["seconds"][llamacpp.F32]
        else:
            floor = measure(plan.stream, min_run_time=cfg.min_run_time).median
    finally:
        torch.set_num_threads(before)
    rows = []
    for metric in _metric_names(cfg):
        row = {"shape": shape, "threads": threads, "metric": metric}
        for c in COLUMNS:
            row[c] = None if cols[c] is None else cols[c][metric]
        for c in LLAMA_COLUMNS:  # no training step in llama.cpp
            row[c] = None if llama[c] is None else llama[c].get(metric)
        row["floor_s"] = floor if metric == "decode" else None
        row["weight_bytes"] = weight_bytes
        row["accelerate_note"] = why
        row["llama_cpp_note"] = llama_note
        if metric in ratios:
            row["rounds"], row["ratios"] = max(cfg.rounds, 1), ratios[metric]
        if flops.get(metric) and row["transformers"]:  # transformers' time over its Linear products at the peak
            row["linear_flops"], row["peak_gflops"] = flops[metric], peak
            row["speedup_bound"] = row["transformers"] * peak * 1e9 / flops[metric]
        if metric == "decode" and contest is not None:
            row["rounds"], row["ratios"] = contest["rounds"], contest["ratios"]
        rows.append(row)
    for low in low_precision:  # accelerate only: transformers' own path has no fused int8 / bf16 decode here
        rows.append({"shape": shape, "threads": threads, "metric": f"decode {low['weights']}", "transformers": None,
                     "kernels": None, "accelerate": low["decode_s"], **dict.fromkeys(LLAMA_COLUMNS),
                     "floor_s": low["floor_s"], "weight_bytes": low["weight_bytes"], "accelerate_note": low["note"],
                     "llama_cpp_note": None})
    return rows


def run_hf(cfg: HfBenchConfig, console: Console | None = None) -> dict:
    """Every shape × threads point: the three columns' metrics and the decode floor (seconds)."""
    console = console or Console()
    rows: list[dict] = []
    checks: list[dict] = []
    with progress(console) as bar:
        task = bar.add_task("bench hf", total=len(cfg.shapes) * len(cfg.threads))
        for shape in cfg.shapes:
            model = qwen_model(shape, cfg.seed)
            if cfg.huge_pages:
                huge_pages(model)
            bar.update(task, description=f"{shape}: GGUF conversion")
            with llamacpp.converted(model, enabled=cfg.llama_cpp, source=cfg.llama_cpp_source, seed=cfg.seed,
                                    reference=torch_path) as gg:
                checks.append({"shape": shape, "check": gg.check, "notes": dict(gg.notes)})
                flops = linear_flop_counts(model, cfg, SHAPES[shape]["vocab_size"])
                for threads in cfg.threads:
                    bar.update(task, description=f"{shape}, {threads} thread(s)")
                    rows += _point(shape, model, threads, cfg, gg, flops)
                    bar.advance(task)
            del model
    return {"config": asdict(cfg), "results": rows, "llama_cpp": checks}


def _shown(metric: str, seconds: float | None) -> str:
    """tokens/s of a prefill, ms/token of decoding, s of a training step."""
    if seconds is None:
        return "n/a"
    if metric.startswith("prefill"):
        return f"{int(metric.split()[1]) / seconds:.0f} tok/s"
    return f"{seconds * 1e3:.2f} ms/tok" if metric.startswith("decode") else f"{seconds:.3f} s"


def _vs_llama(rows: list[dict], r: dict, col: str) -> str:
    """How many times faster accelerate is than llama.cpp column `col` on row `r`; the int8 decode is
    set against llama.cpp's Q8_0 decode (both int8 weights), and so is the int8 dynamic one."""
    theirs = r[col]
    if (ratio := r.get("ratios", {}).get(f"{col} / accelerate")) is not None:
        return f"{ratio:.2f}×"
    if r["metric"] in ("decode int8", "decode int8 dyn") and col == "llama.cpp Q8_0":
        theirs = next((o[col] for o in rows if (o["shape"], o["threads"], o["metric"]) ==
                       (r["shape"], r["threads"], "decode")), None)
    elif r["metric"].startswith("decode "):
        theirs = None
    return f"{theirs / r['accelerate']:.2f}×" if theirs and r["accelerate"] else "n/a"


def render_hf(res: dict, console: Console) -> None:
    cols = ["shape", "threads", "metric", "transformers", "kernels", "accelerate", "kernels ×", "accelerate ×",
            "gemv floor (same weights)", *LLAMA_COLUMNS, "accelerate vs F32", "accelerate vs Q8_0"]
    rows = []
    for r in res["results"]:
        base = r["transformers"]
        ups = []
        for c in ("kernels", "accelerate"):  # the within-round ratio where the metric was alternated
            x = r.get("ratios", {}).get(f"transformers / {c}") or (base / r[c] if r[c] and base else None)
            ups.append(f"{x:.2f}×" if x else "n/a")
        floor = "" if r["floor_s"] is None else f"{r['floor_s'] * 1e3:.2f} ms ({r['weight_bytes'] / 1e6:.0f} MB)"
        llama = [_shown(r["metric"], r.get(c)) for c in LLAMA_COLUMNS]
        rows.append([r["shape"], str(r["threads"]), r["metric"], *(_shown(r["metric"], r[c]) for c in COLUMNS),
                     *ups, floor, *llama, *(_vs_llama(res["results"], r, c) for c in LLAMA_COLUMNS)])
    console.print(make_table("transformers' Qwen3.5 (random weights, fp32, B = 1): transformers' torch path, "
                             "use_linattn_kernels(), linattn.hf.accelerate(); speed-ups over transformers; decode "
                             "beside the time to read every Linear weight once; the same model as GGUF run by "
                             "llama.cpp, and how many times faster accelerate is (int8 decode against Q8_0)",
                             cols, rows))
    notes = sorted({r["accelerate_note"] for r in res["results"] if r["accelerate_note"]})
    for note in notes:
        console.print(f"accelerate n/a: {note}", highlight=False)
    for note in sorted({r.get("llama_cpp_note") for r in res["results"] if r.get("llama_cpp_note")}):
        console.print(f"llama.cpp n/a: {note}", highlight=False)
    for r in res["results"]:
        if r.get("ratios") and r["metric"] == "decode":
            said = ", ".join(f"{k} {v:.2f}×" for k, v in r["ratios"].items())
            console.print(f"decode ({r['shape']}, {r['threads']} thread(s)), {r['rounds']} alternated rounds, ratios "
                          f"of times within a round (median): {said}", highlight=False)
    for (shape, threads), group in _grouped(res["results"]).items():
        said = ", ".join(f"{r['metric']} {r['speedup_bound']:.2f}×" for r in group if r.get("speedup_bound"))
        if said:
            console.print(f"bound on a speed-up over transformers ({shape}, {threads} thread(s); its Linear products "
                          f"at the measured fp32 peak, {group[0]['peak_gflops']:.0f} GFLOP/s, and nothing else): "
                          f"{said}", highlight=False)
    for entry in res.get("llama_cpp", []):
        if (c := entry["check"]) is not None:
            same = sum(a == b for a, b in zip(c["llama.cpp"], c["transformers"]))
            verdict = ("equal" if c["equal"] else
                       f"DIFFER (llama.cpp {c['llama.cpp']}, transformers {c['transformers']})")
            console.print(f"llama.cpp F32 greedy check ({entry['shape']}): {same}/{len(c['transformers'])} next "
                          f"tokens {verdict}; max |logit difference| {c['max_abs_logit_diff']:.2e}", highlight=False)


def _grouped(rows: list[dict]) -> dict:
    """{(shape, threads): [rows]} in the rows' order."""
    out: dict = {}
    for r in rows:
        out.setdefault((r["shape"], r["threads"]), []).append(r)
    return out


def check_hf(res: dict) -> list[str]:
    """Warnings: a decode faster than its own floor (the weights then sat in cache); a speed-up above its
    bound (the peak or the FLOP count is off); llama.cpp F32's greedy tokens not transformers'."""
    out = []
    for r in res["results"]:
        if r["metric"].startswith("decode"):
            for c in COLUMNS + (("llama.cpp F32",) if r["metric"] == "decode" else ()):
                if r.get(c) is not None and r[c] < 0.9 * r["floor_s"]:
                    out.append(f"{r['shape']} {r['threads']} thread(s): {c} decoded faster than the gemv floor; "
                               "the weights sat in the CPU cache")
        bound = r.get("speedup_bound")
        for c in ("kernels", "accelerate"):
            up = r.get("ratios", {}).get(f"transformers / {c}")
            if bound and up and up > bound:
                out.append(f"{r['shape']} {r['threads']} thread(s) {r['metric']}: {c} is {up:.2f}× transformers, above "
                           f"the bound {bound:.2f}× (the peak or the FLOP count is off)")
    for entry in res.get("llama_cpp", []):
        if entry["check"] is not None and not entry["check"]["equal"]:
            out.append(f"{entry['shape']}: llama.cpp F32's greedy tokens {entry['check']['llama.cpp']} differ from "
                       f"transformers' {entry['check']['transformers']}")
    return out


def plot_hf(res: dict, path) -> None:
    """Speed-up over transformers per metric, one panel per shape × threads."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    groups = sorted({(r["shape"], r["threads"]) for r in res["results"]})
    fig = Figure(figsize=(5.0 * len(groups), 4.0), layout="constrained")
    FigureCanvasAgg(fig)
    for ax, (shape, threads) in zip(fig.subplots(1, len(groups), squeeze=False)[0], groups):
        rows = [r for r in res["results"] if (r["shape"], r["threads"]) == (shape, threads) and r["transformers"]]
        for i, c in enumerate(("kernels", "accelerate", *LLAMA_COLUMNS)):
            ups = [r["transformers"] / r[c] if r.get(c) else 0.0 for r in rows]
            ax.bar([j + 0.2 * i for j in range(len(rows))], ups, width=0.2, label=c)
        ax.set_xticks([j + 0.3 for j in range(len(rows))], [r["metric"] for r in rows], rotation=30)
        ax.axhline(1.0, color="gray", linewidth=1)
        ax.set_title(f"{shape}, {threads} thread(s)")
        ax.set_ylabel("speed-up over transformers")
        ax.legend(fontsize=8)
    fig.savefig(path, dpi=100)


__all__ = ["COLUMNS", "HfBenchConfig", "LLAMA_COLUMNS", "SHAPES", "check_hf", "floor_plan", "gemv_floor", "plot_hf",
           "qwen_model",
           "render_hf", "run_hf"]
