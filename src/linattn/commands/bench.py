"""`linattn bench ops|decode`: operator benchmarks. Thin: options -> linattn.bench -> report folder."""

from __future__ import annotations

import io

import torch
from rich.console import Console

from ..cli import add_common_options, int_list, positive_float, positive_int, resolve_device, torch_dtype
from ..report import args_dict, machine_info, make_console, output_dir, timestamp, write_json


def add_parser(subparsers) -> None:
    from ..bench.decode import DEFAULT_CONTEXTS
    from ..bench.ops import DEFAULT_LENGTHS

    bench = subparsers.add_parser(
        "bench", help="benchmark the attention operators (time, memory, throughput, decoding)",
        description="Benchmarks of the attention operators. Each writes a JSON report and a PNG plot to --out "
                    "and prints tables.")
    sub = bench.add_subparsers(dest="bench_command", metavar="BENCHMARK", required=True)

    ops = sub.add_parser(
        "ops", help="operators vs sequence length: forward and fwd+bwd time, memory, GFLOP/s",
        description="Sweeps the sequence length N for causal chunked linear attention (fp32 and bf16), "
                    "non-causal linear, the recurrent loop, the quadratic reference and softmax SDPA "
                    "(normalized elu+1). Times forward and forward+backward (median ±IQR), measures fwd+bwd "
                    "peak memory and the chunked op's GFLOP/s against the measured bmm peak, marks the "
                    "crossover with softmax. --dtype sets every method's dtype except the extra bf16 chunked "
                    "column.")
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
    _run_options(ops)
    add_common_options(ops)
    ops.set_defaults(func=run_ops_command)

    dec = sub.add_parser(
        "decode", help="per-token decode latency vs context: linear RNN step vs softmax with/without KV cache",
        description="Per-token latency against context length: a linear-attention RNN step (constant), "
                    "softmax attention of one query against a KV cache, and softmax recomputed over the whole "
                    "context without a cache. One layer of H heads.")
    dec.add_argument("--contexts", type=int_list, default=DEFAULT_CONTEXTS, metavar="N[,N...]",
                     help=f"context lengths to sweep, comma-separated (default: {','.join(map(str, DEFAULT_CONTEXTS))})")
    _shape_options(dec, chunk=False)
    dec.add_argument("--no-cache-max", type=positive_int, default=None, metavar="N",
                     help="skip softmax without cache above this context (default: never)")
    _run_options(dec)
    add_common_options(dec)
    dec.set_defaults(func=run_decode_command)


def _shape_options(p, chunk: bool = True) -> None:
    p.add_argument("--batch", type=positive_int, metavar="B", default=1, help="batch size B (default: %(default)s)")
    p.add_argument("--heads", type=positive_int, metavar="H", default=8, help="heads H (default: %(default)s)")
    p.add_argument("--head-dim", type=positive_int, metavar="D", default=64,
                   help="q/k head dim D (= feature dim F for elu+1) (default: %(default)s)")
    p.add_argument("--value-dim", type=positive_int, metavar="E", default=64, help="value dim E (default: %(default)s)")
    if chunk:
        p.add_argument("--chunk-size", type=positive_int, metavar="C", default=64,
                       help="chunk size C of the chunked op (default: %(default)s)")


def _run_options(p) -> None:
    p.add_argument("--min-run-time", type=positive_float, default=0.5, metavar="SECONDS",
                   help="minimum measuring time per point, for torch.utils.benchmark blocked_autorange "
                        "(default: %(default)s)")
    p.add_argument("--threads", type=positive_int, metavar="T", default=None,
                   help="torch intra-op threads (default: torch's choice)")


def _shape(args):
    from ..bench.methods import Shape

    return Shape(batch=args.batch, heads=args.heads, head_dim=args.head_dim, value_dim=args.value_dim,
                 chunk=getattr(args, "chunk_size", 64))


def _finish(kind: str, res: dict, args, device, out, console: Console, render, plot) -> int:
    res = {"kind": kind, "timestamp": timestamp(), "machine": machine_info(device), "args": args_dict(args), **res}
    render(res, console)
    text = Console(file=io.StringIO(), width=200, record=True)
    render(res, text)
    (out / f"{kind}.txt").write_text(text.export_text(), encoding="utf-8")
    write_json(out / f"{kind}.json", res)
    plot(res, out / f"{kind}.png")
    console.print(f"report: {out.resolve()} ({kind}.json, {kind}.png, {kind}.txt)")
    return 0


def run_ops_command(args) -> int:
    from ..bench.ops import OpsConfig, plot_ops, render_ops, run_ops

    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    out = output_dir("bench-ops", args.out)
    console = make_console()
    cfg = OpsConfig(lengths=args.lengths, shape=_shape(args), dtype=torch_dtype(args.dtype), device=str(device),
                    seed=args.seed, min_run_time=args.min_run_time, recurrent_max=args.recurrent_max,
                    quadratic_max=args.quadratic_max, memory=not args.no_memory, peers=not args.no_peers)
    return _finish("bench-ops", run_ops(cfg, console), args, device, out, console, render_ops, plot_ops)


def run_decode_command(args) -> int:
    from ..bench.decode import DecodeConfig, plot_decode, render_decode, run_decode

    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    out = output_dir("bench-decode", args.out)
    console = make_console()
    cfg = DecodeConfig(contexts=args.contexts, shape=_shape(args), dtype=torch_dtype(args.dtype), device=str(device),
                       seed=args.seed, min_run_time=args.min_run_time, no_cache_max=args.no_cache_max)
    return _finish("bench-decode", run_decode(cfg, console), args, device, out, console, render_decode, plot_decode)
