"""`linattn bench ops|decode|generate|hf`: benchmarks. Thin: options -> linattn.bench -> report folder."""

from __future__ import annotations

import argparse
import io
import sys

import torch
from rich.console import Console

from .args import (add_command, add_common_options, int_list, nonnegative_int, positive_float, positive_int,
                   resolve_device, torch_dtype)
from ..ops.linear.chunked import DEFAULT_CHUNK_SIZE
from ..report import args_dict, machine_info, make_console, output_dir, timestamp, write_json


_THREADS_HELP = ("torch intra-op threads (default: one per idle core, i.e. the usable CPUs less the 1-minute load "
                 "average, at least 1: more threads than idle cores make timings jump to multiples of the "
                 "scheduler slice)")


def add_parser(subparsers) -> None:
    from ..bench.decode import DEFAULT_CONTEXTS
    from ..bench.ops import DEFAULT_LENGTHS

    bench = subparsers.add_parser(
        "bench", help="benchmark the attention operators (time, memory, throughput, decoding) and image generation",
        description="Benchmarks of the attention operators. Each writes a JSON report and a PNG plot to --out "
                    "and prints tables.")
    sub = bench.add_subparsers(dest="bench_command", metavar="BENCHMARK", required=True)

    ops = add_command(sub, "ops", run_ops_command,
                      help="operators vs sequence length: forward and fwd+bwd time, memory, GFLOP/s")
    ops.add_argument("--lengths", type=int_list, default=DEFAULT_LENGTHS, metavar="N[,N...]",
                     help=f"sequence lengths to sweep, comma-separated (default: {','.join(map(str, DEFAULT_LENGTHS))})")
    _shape_options(ops)
    ops.add_argument("--recurrent-max", type=positive_int, default=2048, metavar="N",
                     help="skip the (slow) token-by-token recurrent loop above this length (default: %(default)s)")
    ops.add_argument("--quadratic-max", type=positive_int, default=4096, metavar="N",
                     help="skip the quadratic reference (N×N memory) above this length (default: %(default)s)")
    ops.add_argument("--no-memory", action="store_true", help="do not measure fwd+bwd peak memory")
    ops.add_argument("--no-peers", action="store_true",
                     help="do not look for fast_transformers, performer_pytorch, fla")
    ops.add_argument("--roofline", action="store_true",
                     help="instead of the sweep: every family (linear, gated scalar / per channel, delta rule, Gated "
                          "DeltaNet, KDA, sliding window, softmax) at one shape, fwd and fwd+bwd in fp32 and bf16, "
                          "GFLOP/s by the FLOP count of the algorithm run and %% of the matmul peak (torch.bmm or linattn's product) measured in the same "
                          "run; the one-token step against one copy of its state (linattn.bench.roofline)")
    ops.add_argument("--roofline-shape", type=_roofline_shape, default=(1, 16, 2048, 128, 128), metavar="B,H,N,K,V",
                     help="--roofline's shape (default: 1,16,2048,128,128)")
    ops.add_argument("--roofline-dtypes", type=_dtype_names, default=["fp32", "bf16"], metavar="fp32,bf16",
                     help="--roofline's dtypes (default: fp32,bf16)")
    ops.add_argument("--roofline-rounds", type=positive_int, default=1, metavar="R",
                     help="--roofline's rounds: each re-times the matmul peak, then every family in turn; a "
                          "share of the peak is the median over the rounds of the share within the round (a "
                          "machine whose speed drifts; default: 1)")
    _run_options(ops)
    add_common_options(ops)

    dec = add_command(sub, "decode", run_decode_command,
                      help="per-token decode latency vs context: linear RNN step vs softmax with/without KV cache")
    dec.add_argument("--contexts", type=int_list, default=DEFAULT_CONTEXTS, metavar="N[,N...]",
                     help=f"context lengths to sweep, comma-separated (default: {','.join(map(str, DEFAULT_CONTEXTS))})")
    _shape_options(dec, chunk=False)
    dec.add_argument("--no-cache-max", type=positive_int, default=None, metavar="N",
                     help="skip softmax without cache above this context (default: never)")
    _model_options(dec)
    _run_options(dec)
    add_common_options(dec)

    _add_generate_parser(sub)
    _add_hf_parser(sub)


def _add_hf_parser(sub) -> None:
    from ..bench.hf import SHAPES

    hf = add_command(sub, "hf", run_hf_command,
                     help="transformers' Qwen3.5: its torch path vs use_linattn_kernels() vs linattn.hf.accelerate()")
    hf.add_argument("--shapes", type=lambda v: _choices(v, SHAPES, "shapes"), default=["small"],
                    metavar="SHAPE[,...]", help=f"model shapes, from {','.join(SHAPES)} (default: small)")
    hf.add_argument("--threads", type=int_list, default=[1], metavar="T[,T...]",
                    help="torch thread counts, comma-separated (default: 1)")
    hf.add_argument("--lengths", type=int_list, default=[2048], metavar="T[,T...]",
                    help="prefill lengths (default: 2048)")
    hf.add_argument("--decode-prompt", type=positive_int, default=256, metavar="N",
                    help="prompt length before decoding (default: %(default)s)")
    hf.add_argument("--train-len", type=positive_int, default=1024, metavar="T",
                    help="tokens of the training step (default: %(default)s)")
    hf.add_argument("--min-run-time", type=positive_float, default=0.5, metavar="SECONDS",
                    help="minimum measuring time per point (default: %(default)s)")
    hf.add_argument("--llama-cpp-source", default=None, metavar="DIR",
                    help="llama.cpp's converter for the llama.cpp F32 / Q8_0 columns: a llama.cpp checkout or an "
                         "extracted llama-cpp-python sdist (default: $LINATTN_LLAMA_CPP_SOURCE); those columns "
                         "also need llama-cpp-python (the llamacpp extra)")
    hf.add_argument("--no-llama-cpp", dest="llama_cpp", action="store_false",
                    help="skip the llama.cpp columns (no GGUF conversion)")
    hf.add_argument("--no-huge-pages", dest="huge_pages", action="store_false",
                    help="leave the weights on the pages they have (default: transparent huge pages first, "
                         "linattn.models.huge_pages)")
    hf.add_argument("--rounds", type=nonnegative_int, default=3, metavar="N",
                    help="rounds that take the columns in turn: each prefill and the training step across "
                         "transformers, kernels and accelerate, and accelerate's fp32 decode, the gemv floor and "
                         "llama.cpp F32's decode (0: one round, the decodes measured apart; default: %(default)s)")
    add_common_options(hf)


def _choices(value: str, allowed, what: str) -> list[str]:
    """argparse type: comma-separated names from `allowed`."""
    names = [v.strip() for v in value.split(",") if v.strip()]
    if not names or any(n not in allowed for n in names):
        raise argparse.ArgumentTypeError(f"{what} must be among {','.join(allowed)}, got {value!r}")
    return names


def _model_options(p) -> None:
    from ..bench.decode_model import (DEFAULT_MODEL_CONTEXTS, DEFAULT_MODEL_KINDS, DEFAULT_MODELS, MODEL_KINDS,
                                      WEIGHT_FORMATS)

    p.add_argument("--models", type=_model_list, default=DEFAULT_MODELS, metavar="dWxL[,...]|none",
                   help="LMs whose whole decoding step to time, d_model x layers, 8 heads, comma-separated; 'none' "
                        f"skips them (default: {','.join(DEFAULT_MODELS)})")
    p.add_argument("--model-kinds", type=lambda v: _choices(v, MODEL_KINDS, "kinds"), default=DEFAULT_MODEL_KINDS,
                   metavar="KIND[,...]",
                   help=f"attention kinds of those LMs, from {','.join(MODEL_KINDS)} (default: "
                        f"{','.join(DEFAULT_MODEL_KINDS)})")
    p.add_argument("--model-contexts", type=int_list, default=DEFAULT_MODEL_CONTEXTS, metavar="N[,N...]",
                   help="positions of the decoded token (default: "
                        f"{','.join(map(str, DEFAULT_MODEL_CONTEXTS))})")
    p.add_argument("--model-batches", type=int_list, default=[1, 8], metavar="B[,B...]",
                   help="batch sizes of the LM steps (default: 1,8)")
    p.add_argument("--weights", type=lambda v: _choices(v, WEIGHT_FORMATS, "weight formats"), default=None,
                   metavar="fp32|bf16|int8[,...]",
                   help="weight formats of those LMs, comma-separated: fp32, bf16, int8 (weight-only, torchao's "
                        "Int8WeightOnlyConfig; fp32 activations); each step beside the weight streaming of the same "
                        "weights (default: --dtype's)")


def _model_list(value: str) -> list[str]:
    """argparse type: 'd256x4,d512x8' (d_model x layers), or 'none'."""
    from ..bench.decode_model import parse_model

    if value.strip() == "none":
        return []
    specs = [v.strip() for v in value.split(",") if v.strip()]
    try:
        for spec in specs:
            parse_model(spec)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return specs


def _shape_options(p, chunk: bool = True) -> None:
    p.add_argument("--batch", type=positive_int, metavar="B", default=1, help="batch size B (default: %(default)s)")
    p.add_argument("--heads", type=positive_int, metavar="H", default=8, help="heads H (default: %(default)s)")
    p.add_argument("--head-dim", type=positive_int, metavar="D", default=64,
                   help="q/k head dim D (= feature dim F for elu+1) (default: %(default)s)")
    p.add_argument("--value-dim", type=positive_int, metavar="E", default=64, help="value dim E (default: %(default)s)")
    if chunk:
        p.add_argument("--chunk-size", type=positive_int, metavar="C", default=DEFAULT_CHUNK_SIZE,
                       help="chunk size C of the chunked op (default: %(default)s)")


def _run_options(p) -> None:
    p.add_argument("--min-run-time", type=positive_float, default=0.5, metavar="SECONDS",
                   help="minimum measuring time per point, for torch.utils.benchmark blocked_autorange "
                        "(default: %(default)s)")
    p.add_argument("--threads", type=positive_int, metavar="T", default=None, help=_THREADS_HELP)


def _shape(args):
    from ..bench.methods import Shape

    return Shape(batch=args.batch, heads=args.heads, head_dim=args.head_dim, value_dim=args.value_dim,
                 chunk=getattr(args, "chunk_size", DEFAULT_CHUNK_SIZE))


def _finish(kind: str, res: dict, args, device, out, console: Console, render, plot, check) -> int:
    results = res.get("results") or []
    if results and all(r.get("skipped") for r in results):  # nothing was measured: no report, an error
        why = sorted({str(r["skipped"]) for r in results})
        print(f"linattn {kind.replace('-', ' ')}: error: every point was skipped ({'; '.join(why)[:400]}); "
              "pass smaller sizes (e.g. --lengths 256,1024)", file=sys.stderr)
        return 2
    res = {"kind": kind, "timestamp": timestamp(), "machine": machine_info(device), "args": args_dict(args),
           "threads": {"count": torch.get_num_threads(), "how": args.threads_how}, **res}
    res["warnings"] = check(res)
    text = Console(file=io.StringIO(), width=200, record=True)
    for con in (console, text):
        render(res, con)
        _print_warnings(res["warnings"], res["threads"]["count"], con)
    (out / f"{kind}.txt").write_text(text.export_text(), encoding="utf-8")
    write_json(out / f"{kind}.json", res)
    plot(res, out / f"{kind}.png")
    console.print(f"report: {out.resolve()} ({kind}.json, {kind}.png, {kind}.txt)")
    return 0


def _print_warnings(warnings: list[str], threads: int, console: Console) -> None:
    from ..bench.consistency import advice

    for w in warnings:
        console.print(f"[yellow]warning:[/] {w}", markup=True, highlight=False)
    if warnings:
        console.print(f"[yellow]{advice(warnings, threads)}[/]", highlight=False)


def _setup(args, kind: str):
    """Threads (--threads, else one per idle core: bench.consistency.stable_threads), device, output
    folder and console shared by the bench commands."""
    from ..bench.consistency import stable_threads

    if args.threads:
        args.threads_how = "--threads"
        threads = args.threads
    else:
        threads, args.threads_how = stable_threads()
    torch.set_num_threads(threads)
    device, out, console = resolve_device(args.device), output_dir(kind, args.out), make_console()
    console.print(f"threads: {threads} ({args.threads_how})", highlight=False)
    return device, out, console


def _roofline_shape(value: str) -> tuple:
    try:
        parts = tuple(int(x) for x in value.split(","))
    except ValueError:
        parts = ()
    if len(parts) != 5 or min(parts) < 1:
        raise argparse.ArgumentTypeError(f"expected five positive integers B,H,N,K,V, got {value!r}")
    return parts


def _dtype_names(value: str) -> list[str]:
    names = [x for x in value.split(",") if x]
    bad = [x for x in names if x not in ("fp32", "bf16")]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"expected fp32, bf16 or fp32,bf16, got {value!r}")
    return names


def run_roofline_command(args) -> int:
    from ..bench.methods import Shape
    from ..bench.roofline import RooflineConfig, check_roofline, plot_roofline, render_roofline, run_roofline

    device, out, console = _setup(args, "bench-roofline")
    b, h, n, k, v = args.roofline_shape
    cfg = RooflineConfig(shape=Shape(batch=b, heads=h, head_dim=k, value_dim=v, chunk=args.chunk_size), n=n, window=64,
                         dtypes=args.roofline_dtypes, min_run_time=args.min_run_time, device=str(device), seed=args.seed,
                         rounds=args.roofline_rounds)
    return _finish("bench-roofline", run_roofline(cfg, console), args, device, out, console, render_roofline,
                   plot_roofline, check_roofline)


def run_ops_command(args) -> int:
    """Sweeps the sequence length N for causal chunked linear attention (fp32 and bf16), non-causal linear, the
    recurrent loop, the quadratic reference and softmax SDPA (normalized elu+1), gated linear attention (scalar and
    vector gates) and the delta rule (DeltaNet, Gated DeltaNet). Times forward and forward+backward (median ±IQR),
    measures fwd+bwd peak memory and the chunked op's GFLOP/s against the measured matmul peak, marks the crossover
    with softmax. --dtype sets every method's dtype except the extra bf16 chunked column."""
    from ..bench.ops import OpsConfig, check_ops, plot_ops, render_ops, run_ops

    if args.roofline:
        return run_roofline_command(args)
    device, out, console = _setup(args, "bench-ops")
    cfg = OpsConfig(lengths=args.lengths, shape=_shape(args), dtype=torch_dtype(args.dtype), device=str(device),
                    seed=args.seed, min_run_time=args.min_run_time, recurrent_max=args.recurrent_max,
                    quadratic_max=args.quadratic_max, memory=not args.no_memory, peers=not args.no_peers)
    return _finish("bench-ops", run_ops(cfg, console), args, device, out, console, render_ops, plot_ops, check_ops)


def run_decode_command(args) -> int:
    """Per-token latency against context length: a linear-attention RNN step and the gated (scalar, vector g),
    DeltaNet and Gated DeltaNet steps (constant), softmax attention of one query against a KV cache, and softmax
    recomputed over the whole context without a cache. One layer of H heads. Then whole LMs (--models): the eager
    and the fused decoding step (linattn.models.decoding) beside the weight-streaming time measured in the same run
    (every matrix-vector product of the step once), at each --model-contexts and --model-batches."""
    from ..bench.decode import DecodeConfig, check_decode, plot_decode, render_decode, run_decode
    from ..bench.decode_model import ModelDecodeConfig, run_model_decode

    device, out, console = _setup(args, "bench-decode")
    cfg = DecodeConfig(contexts=args.contexts, shape=_shape(args), dtype=torch_dtype(args.dtype), device=str(device),
                       seed=args.seed, min_run_time=args.min_run_time, no_cache_max=args.no_cache_max)
    res = run_decode(cfg, console)
    if args.models:
        if device.type != "cpu":
            raise ValueError("--models: the fused decoding step runs on the CPU only; pass --models none")
        models = ModelDecodeConfig(models=args.models, kinds=args.model_kinds, contexts=args.model_contexts,
                                   batches=args.model_batches, dtype=torch_dtype(args.dtype), seed=args.seed,
                                   min_run_time=args.min_run_time, weights=args.weights)
        res["models"] = run_model_decode(models, console)
    return _finish("bench-decode", res, args, device, out, console, render_decode, plot_decode, check_decode)


def _add_generate_parser(sub) -> None:
    from ..bench.generate import DATASETS, SCALES

    gen = add_command(sub, "generate", run_generate_command,
                      help="image generation speed (Linear Transformer paper, Tables 1-2): images/s, linear vs softmax",
                      epilog="examples: linattn bench generate | linattn bench generate --scale paper --batches 1,16 | "
                             "linattn bench generate --datasets mnist --layers 2 --tokens 64 --batches 1")
    gen.add_argument("--datasets", type=_dataset_list, default=list(DATASETS), metavar="NAME[,NAME]",
                     help=f"image sizes to generate, comma-separated from {', '.join(DATASETS)} "
                          f"(default: {','.join(DATASETS)})")
    gen.add_argument("--batches", type=int_list, default=[1, 8], metavar="B[,B...]",
                     help="batch sizes (images generated together), comma-separated (default: 1,8)")
    gen.add_argument("--scale", choices=list(SCALES), default="small",
                     help="model size: paper (MNIST 8 layers, CIFAR-10 16), small (layers / 4, full images; for a "
                          "CPU), tiny (layers / 8, images / 4) (default: %(default)s)")
    gen.add_argument("--layers", type=positive_int, default=None, metavar="N",
                     help="layers of every model (overrides --scale)")
    gen.add_argument("--tokens", type=_at_least_two, default=None, metavar="N",
                     help="tokens (pixel values) per image for every dataset (overrides --scale)")
    gen.add_argument("--probes", type=positive_int, default=6, metavar="P",
                     help="for long images, softmax without a cache is timed at P+1 evenly spaced prefix lengths "
                          "(default: %(default)s)")
    gen.add_argument("--full-no-cache-max", type=positive_int, default=256, metavar="N",
                     help="generate whole images with softmax without a cache up to N tokens; extrapolate above "
                          "(default: %(default)s)")
    gen.add_argument("--min-run-time", type=positive_float, default=0.2, metavar="SECONDS",
                     help="minimum measuring time per timed prefix length (default: %(default)s)")
    gen.add_argument("--threads", type=positive_int, metavar="T", default=None, help=_THREADS_HELP)
    add_common_options(gen)


def _dataset_list(value: str) -> list[str]:
    import argparse

    from ..bench.generate import DATASETS

    aliases = {"cifar": "cifar10", "cifar-10": "cifar10"}
    out = [aliases.get(v.strip().lower(), v.strip().lower()) for v in value.split(",") if v.strip()]
    bad = [v for v in out if v not in DATASETS]
    if bad or not out:
        raise argparse.ArgumentTypeError(f"unknown dataset(s) {', '.join(bad) or repr(value)}: pass a comma-separated "
                                         f"list of {', '.join(DATASETS)}, e.g. mnist,cifar10")
    return list(dict.fromkeys(out))


def _at_least_two(value: str) -> int:
    import argparse

    n = positive_int(value)
    if n < 2:
        raise argparse.ArgumentTypeError(f"an image needs at least 2 tokens, got {n} (pass e.g. 64)")
    return n


def run_generate_command(args) -> int:
    """The image-generation speed experiment of Katharopoulos et al. 2020 ('Transformers are RNNs', Tables 1-2):
    generates whole MNIST-sized (784 tokens) and CIFAR-10-sized (3,072 tokens) images, one pixel value of 256 at a
    time, with the paper's model shapes (d_model 256, 8 heads, FFN 1024; 8 layers for MNIST, 16 for CIFAR-10,
    divided by --scale) and untrained weights. Reports images/s of linear attention in RNN mode, softmax with a KV
    cache and softmax without a cache (the paper's baseline, extrapolated from a few prefix lengths for long images)
    and prints our speedups next to the paper's (317x and 4,462x vs softmax, ~56x vs stateful softmax)."""
    from ..bench.generate import GenerateConfig, check_generate, plot_generate, render_generate, run_generate

    device, out, console = _setup(args, "bench-generate")
    cfg = GenerateConfig(datasets=args.datasets, batches=args.batches, scale=args.scale, layers=args.layers,
                         tokens=args.tokens, dtype=torch_dtype(args.dtype), device=str(device), seed=args.seed,
                         min_run_time=args.min_run_time, probes=args.probes, full_no_cache_max=args.full_no_cache_max)
    return _finish("bench-generate", run_generate(cfg, console), args, device, out, console, render_generate,
                   plot_generate, check_generate)


def run_hf_command(args) -> int:
    """Random Qwen3.5-shaped transformers models (nothing downloaded), fp32, batch 1: prefill tokens/s, decode
    ms/token beside the fp32 gemv floor measured in the same run (every Linear weight read once by the fused
    decoder's kernels) and one training step, on transformers' own torch path, under
    linattn.hf.use_linattn_kernels() and converted by linattn.hf.accelerate() (n/a where this linattn lacks it);
    beside them the same model as GGUF F32 and Q8_0 run by llama.cpp, where llama-cpp-python and llama.cpp's
    converter are found. Needs the hf extra."""
    from ..bench.hf import HfBenchConfig, check_hf, plot_hf, render_hf, run_hf

    args.threads_how = "--threads"
    device, out, console = resolve_device(args.device), output_dir("bench-hf", args.out), make_console()
    if device.type != "cpu":
        raise ValueError("bench hf runs on the CPU (the fused decoder and its gemv floor)")
    cfg = HfBenchConfig(shapes=args.shapes, threads=args.threads, lengths=args.lengths,
                        decode_prompt=args.decode_prompt, train_len=args.train_len, min_run_time=args.min_run_time,
                        seed=args.seed, llama_cpp=args.llama_cpp, llama_cpp_source=args.llama_cpp_source,
                        rounds=args.rounds, huge_pages=args.huge_pages)
    return _finish("bench-hf", run_hf(cfg, console), args, device, out, console, render_hf, plot_hf, check_hf)
