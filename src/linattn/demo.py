"""`linattn demo`: the library end to end in a few minutes on a laptop CPU, with no input.

    1. agreement   random q, k, v in float64: the chunked (parallel) operator, the recurrent step loop
                   and the quadratic oracle agree for every feature map (and softmax SDPA against a
                   KV cache against its oracle)
    2. benchmarks  a short `bench ops` sweep (time vs sequence length, fwd and fwd+bwd) and a
                   `bench decode` sweep (per-token latency: RNN step vs softmax with/without cache)
    3. training    a tiny byte-level LM on the Python standard library's source (read from the
                   running interpreter) for about a minute; validation bits per byte before/after
    4. generation  bytes from a prompt in RNN mode (O(1) per token), streamed; the same model's
                   parallel and recurrent logits compared; RNN mode timed against recomputing
    5. report      summary.md (tables, figures), summary.json (machine, torch, threads, dtype, all
                   numbers), PNG plots, the run folder of the trained model (a checkpoint)

`run_demo(DemoConfig(...), console)` does it all and returns the summary dict; `quick=True` shrinks
every step to seconds (used by the tests).
"""

from __future__ import annotations

import codecs
import io
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from rich.console import Console

from .report import args_dict, machine_info, make_table, progress, timestamp, write_json

AGREEMENT_MAPS = {"elu": {}, "relu": {}, "favor": {"num_features": 16}, "trig": {"num_features": 8},
                  "cosformer": {"max_len": 1024}, "taylor": {}, "hedgehog": {"num_features": 6}}
@dataclass
class DemoConfig:
    """Settings of one demo run. dtype: benchmark dtype and training autocast ("float32"/"bfloat16")."""

    quick: bool = False
    seed: int = 0
    device: str = "cpu"
    dtype: str = "float32"
    train_seconds: float = 60.0
    attention: str = "linear"
    prompt: str = "def "
    gen_bytes: int = 200
    temperature: float = 0.8
    top_k: int | None = 40

    def __post_init__(self):
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be float32 or bfloat16 (training has no loss scaling for float16), "
                             f"got {self.dtype!r}")
        if not self.train_seconds > 0 or not math.isfinite(self.train_seconds):
            raise ValueError(f"train_seconds must be a positive number, got {self.train_seconds!r}")
        if not self.prompt:
            raise ValueError("prompt must be a non-empty string, e.g. 'def '")


# ----------------------------------------------------------------------------------------------
# 1. agreement


def agreement(*, n: int = 64, batch: int = 2, heads: int = 2, dim: int = 8, chunk: int = 16, seed: int = 0,
              device="cpu", console: Console | None = None) -> list[dict]:
    """Max |difference| between the chunked op, the recurrent step loop and the quadratic oracle, in
    float64, for every feature map (φ applied with the token positions) and for softmax (SDPA over the
    whole sequence, one query at a time against a growing KV cache, and the masked-softmax oracle)."""
    from .nn.feature_maps import make_feature_map
    from .ops import linear_attention, linear_attention_step, reference, softmax_attention

    dt = torch.float64
    device = torch.device(device)
    rows = []
    with progress(console or Console()) as bar:
        task = bar.add_task("agreement (float64)", total=len(AGREEMENT_MAPS) + 1)
        for name, opts in AGREEMENT_MAPS.items():
            d = 4 if name == "taylor" else dim
            fm = make_feature_map(name, d, **opts).to(device=device, dtype=dt).eval()
            g = torch.Generator().manual_seed(seed)
            q, k, v = (torch.randn(batch, heads, n, d if i < 2 else dim, dtype=dt, generator=g).to(device)
                       for i in range(3))
            pos = torch.arange(n, device=device)
            with torch.no_grad():
                chunked = linear_attention(q, k, v, causal=True, feature_map=fm, chunk_size=chunk)
                state, steps = None, []
                for t in range(n):
                    o, state = linear_attention_step(state, q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1],
                                                     feature_map=fm, positions=pos[t:t + 1])
                    steps.append(o)
                recurrent = torch.cat(steps, dim=2)
                qf, kf = fm(q, is_query=True, positions=pos), fm(k, is_query=False, positions=pos)
                oracle, _ = reference.kernel_attention(qf, kf, v, causal=True)
            rows.append(_agreement_row(fm.label, fm.feature_dim, chunked, recurrent, oracle))
            bar.advance(task)
        g = torch.Generator().manual_seed(seed)
        q, k, v = (torch.randn(batch, heads, n, dim, dtype=dt, generator=g).to(device) for _ in range(3))
        with torch.no_grad():
            parallel = softmax_attention(q, k, v, causal=True)
            cached = torch.cat([softmax_attention(q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1], causal=True)
                                for t in range(n)], dim=2)
            oracle = reference.softmax_attention_reference(q, k, v, causal=True)
        rows.append(_agreement_row("softmax (SDPA; KV cache)", None, parallel, cached, oracle))
        bar.advance(task)
    return rows


def _agreement_row(label, feature_dim, parallel, recurrent, oracle) -> dict:
    scale = max(1.0, float(oracle.abs().max()))
    errs = {"parallel_vs_oracle": float((parallel - oracle).abs().max()),
            "recurrent_vs_oracle": float((recurrent - oracle).abs().max()),
            "parallel_vs_recurrent": float((parallel - recurrent).abs().max())}
    return {"method": label, "feature_dim": feature_dim, **errs, "max_abs_output": float(oracle.abs().max()),
            "tolerance": 1e-9 * scale, "ok": all(e <= 1e-9 * scale for e in errs.values())}


def render_agreement(rows: list[dict], console: Console) -> None:
    cols = ["attention", "F", "chunked vs oracle", "recurrent vs oracle", "chunked vs recurrent", "ok"]
    console.print(make_table(
        "parallel (chunked) vs recurrent vs quadratic oracle: max |difference|, float64", cols,
        [[r["method"], "—" if r["feature_dim"] is None else str(r["feature_dim"]), f"{r['parallel_vs_oracle']:.1e}",
          f"{r['recurrent_vs_oracle']:.1e}", f"{r['parallel_vs_recurrent']:.1e}", "yes" if r["ok"] else "NO"]
         for r in rows],
        caption="causal, random q/k/v ~ N(0, 1); softmax row: SDPA on the whole sequence vs one query at a time "
                "against a growing KV cache"))


# ----------------------------------------------------------------------------------------------
# 3. training


def train_config(cfg: DemoConfig, out_dir: Path | None, steps: int):
    """The TrainConfig of the demo's byte-level LM (`steps` optimizer steps)."""
    from .training import TrainConfig

    pattern = [a.strip() for a in cfg.attention.split(",") if a.strip()]
    if cfg.quick:
        model = {"d_model": 32, "n_layers": len(pattern) if len(pattern) > 1 else 2, "n_heads": 2,
                 "attention": pattern}
        data = dict(seq_len=32, batch_size=4, corpus_max_bytes=300_000, eval_batches=2, lr=3e-3)
    else:
        model = {"d_model": 128, "n_layers": 4 if 4 % len(pattern) == 0 else len(pattern), "n_heads": 4,
                 "attention": pattern}
        data = dict(seq_len=128, batch_size=16, eval_batches=8, lr=3e-3)
    return TrainConfig(model=model, steps=steps, warmup_steps=max(1, steps // 10), eval_interval=0,
                       log_interval=max(1, min(10, steps // 20)), checkpoint_interval=0, keep_checkpoints=1,
                       out_dir=None if out_dir is None else str(out_dir), device=cfg.device, dtype=cfg.dtype,
                       seed=cfg.seed, distributed="off", **data)


def calibrate_steps(cfg: DemoConfig, seconds: float) -> tuple[int, float]:
    """(optimizer steps that take about `seconds`, measured seconds per step): a 4-step run of the
    same config, timed between steps (the first step's warm-up excluded)."""
    from .training import train

    stamps = []
    probe = train_config(cfg, None, 4).replace(eval_batches=1)
    train(probe, progress=False, callback=lambda info: stamps.append(time.perf_counter()))
    diffs = sorted(b - a for a, b in zip(stamps, stamps[1:]))
    per_step = diffs[len(diffs) // 2] if diffs else 1.0
    return max(10, int(seconds / per_step)), per_step


def run_training(cfg: DemoConfig, out: Path, console: Console) -> dict:
    """Trains the demo LM into out/<train>; returns its numbers and the trained model."""
    from .training import build_model, evaluate, make_task, plot_metrics, read_metrics, train

    run_dir = out / "train"
    i = 2
    while (run_dir / "checkpoints").exists():  # a re-run into the same --out starts a fresh run folder
        run_dir, i = out / f"train-{i}", i + 1
    if cfg.quick:
        steps, per_step = 4, None
    else:
        with console.status("timing a few training steps to fit the time budget"):
            steps, per_step = calibrate_steps(cfg, cfg.train_seconds)
        console.print(f"{per_step * 1e3:.0f} ms per step: training for {steps} steps (~{cfg.train_seconds:.0f} s)")
    tcfg = train_config(cfg, run_dir, steps)
    task = make_task(tcfg)
    with console.status("validation bits per byte of the untrained model"):
        before = evaluate(build_model(tcfg).to(torch.device(cfg.device)), task, dtype=cfg.dtype)
    console.print(f"untrained: validation {before['bpb']:.3f} bits per byte (uniform guessing: 8)")
    t0 = time.perf_counter()
    limit = 3 * cfg.train_seconds + 30

    def guard(info):  # a machine much busier than during calibration: stop (saves a checkpoint) rather than overrun
        if not cfg.quick and time.perf_counter() - t0 > limit:
            raise KeyboardInterrupt

    result = train(tcfg, progress=True, console=console, callback=guard)
    wall = time.perf_counter() - t0
    final = result.final
    if final is None:  # stopped early by the guard
        final = evaluate(result.model, task, dtype=cfg.dtype)
    records = read_metrics(run_dir / "metrics.jsonl")
    plot_metrics(records, out / "training.png", bits=True,
                 title=f"byte-level LM on the Python standard library ({result.step} steps)")
    mc = tcfg.model_config()
    return {
        "model": result.model,
        "summary": {
            "corpus": task.describe(), "status": result.status, "steps": result.step,
            "calibrated_seconds_per_step": per_step, "train_seconds": result.elapsed_s, "wall_seconds": wall,
            "tokens": result.tokens, "tokens_per_s": result.tokens_per_s,
            "parameters": sum(p.numel() for p in result.model.parameters()),
            "model": {"d_model": mc.d_model, "n_layers": mc.n_layers, "n_heads": mc.n_heads,
                      "attention": mc.layer_kinds, "feature_map": mc.feature_map, "positions": mc.positions},
            "batch_size": tcfg.batch_size, "seq_len": tcfg.seq_len, "lr": tcfg.lr,
            "bpb_before": before["bpb"], "bpb_after": final["bpb"], "accuracy_after": final["accuracy"],
            "first_loss_bits": result.losses[0] / math.log(2) if result.losses else None,
            "last_loss_bits": result.losses[-1] / math.log(2) if result.losses else None,
            "run_dir": str(run_dir), "checkpoint": None if result.checkpoint is None else str(result.checkpoint),
        },
    }


# ----------------------------------------------------------------------------------------------
# 4. generation


def run_generation(model, cfg: DemoConfig, console: Console) -> dict:
    """Streams cfg.gen_bytes bytes after the prompt in RNN mode; checks recurrent vs parallel logits
    on the generated text; times RNN mode against recomputing the forward for every byte."""
    from .bench.generate import uncached_generation

    device = next(model.parameters()).device
    prompt = list(cfg.prompt.encode("utf-8"))
    n = min(cfg.gen_bytes, 48) if cfg.quick else cfg.gen_bytes
    limit = model.config.max_positions
    if limit is not None:
        n = max(1, min(n, limit - len(prompt)))
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    console.print(f"[bold]prompt[/] {cfg.prompt!r}, {n} bytes, temperature {cfg.temperature}, top-k {cfg.top_k}:")
    console.print(cfg.prompt, end="", markup=False, highlight=False)
    new = []
    t0 = time.perf_counter()
    for step in model.stream(prompt, n, temperature=cfg.temperature, top_k=cfg.top_k, seed=cfg.seed):
        tok = step[0]
        new.append(tok)
        console.print(decoder.decode(bytes([tok])), end="", markup=False, highlight=False)
    rnn_s = time.perf_counter() - t0
    console.print(decoder.decode(b"", final=True), markup=False, highlight=False)
    text = bytes(prompt + new).decode("utf-8", errors="replace")

    # the same sequence, in parallel (one forward) and in RNN mode (prefill the prompt, then one step per byte)
    ids = torch.tensor([prompt + new], device=device)
    model.eval()
    with torch.no_grad():
        parallel, _ = model(ids)
        logits, cache = model(ids[:, :len(prompt)], cache=model.new_cache())
        steps = [logits]
        for t in range(len(prompt), ids.shape[1]):
            logits, cache = model(ids[:, t:t + 1], cache=cache)
            steps.append(logits)
        recurrent = torch.cat(steps, dim=1)
    diff = float((parallel.float() - recurrent.float()).abs().max())
    # recomputing the whole forward for every new byte, as softmax attention without a cache would
    recompute_s, _ = uncached_generation(model, torch.tensor([prompt], device=device), n, cfg.seed)
    return {"prompt": cfg.prompt, "text": text, "new_bytes": n, "temperature": cfg.temperature, "top_k": cfg.top_k,
            "rnn_seconds": rnn_s, "rnn_bytes_per_s": n / rnn_s if rnn_s > 0 else None,
            "recompute_seconds": recompute_s, "recompute_bytes_per_s": n / recompute_s if recompute_s > 0 else None,
            "rnn_speedup": recompute_s / rnn_s if rnn_s > 0 else None,
            "logits_parallel_vs_recurrent_max_abs": diff, "logits_max_abs": float(parallel.abs().max())}


# ----------------------------------------------------------------------------------------------
# the whole demo


def _rule(console: Console, i: int, title: str) -> None:
    console.rule(f"[bold]{i}/5 {title}")


def _record(render, res) -> str:
    text = Console(file=io.StringIO(), width=200, record=True)
    render(res, text)
    return text.export_text().rstrip()


def run_demo(cfg: DemoConfig, out: Path, console: Console, args=None) -> dict:
    """Runs the five steps, writes the report folder `out` and returns the summary dict."""
    from .bench.decode import DecodeConfig, plot_decode, render_decode, run_decode
    from .bench.methods import Shape
    from .bench.ops import OpsConfig, plot_ops, render_ops, run_ops
    from ._checks import torch_dtype

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    timings = {}
    device = torch.device(cfg.device)
    dtype = torch_dtype(cfg.dtype)

    _rule(console, 1, "agreement: chunked vs recurrent vs quadratic oracle")
    t = time.perf_counter()
    rows = agreement(n=24 if cfg.quick else 64, chunk=8 if cfg.quick else 16, seed=cfg.seed, device=device,
                     console=console)
    render_agreement(rows, console)
    timings["agreement"] = time.perf_counter() - t

    _rule(console, 2, "benchmarks: operators vs sequence length, per-token decoding")
    t = time.perf_counter()
    if cfg.quick:
        ops_cfg = OpsConfig(lengths=[64, 128], shape=Shape(heads=2, head_dim=16, value_dim=16, chunk=16), dtype=dtype,
                            device=str(device), seed=cfg.seed, min_run_time=0.01, recurrent_max=128,
                            quadratic_max=128, memory=True, peers=False)
        dec_cfg = DecodeConfig(contexts=[64, 256], shape=Shape(heads=2, head_dim=16, value_dim=16), dtype=dtype,
                               device=str(device), seed=cfg.seed, min_run_time=0.01)
    else:
        ops_cfg = OpsConfig(lengths=[256, 512, 1024, 2048, 4096], dtype=dtype, device=str(device), seed=cfg.seed,
                            min_run_time=0.1, recurrent_max=256, quadratic_max=2048, memory=True, peers=False)
        dec_cfg = DecodeConfig(contexts=[256, 1024, 4096, 16384], dtype=dtype, device=str(device), seed=cfg.seed,
                               min_run_time=0.1)
    ops = run_ops(ops_cfg, console)
    render_ops(ops, console)
    plot_ops(ops, out / "bench-ops.png")
    dec = run_decode(dec_cfg, console)
    render_decode(dec, console)
    plot_decode(dec, out / "bench-decode.png")
    timings["benchmarks"] = time.perf_counter() - t

    _rule(console, 3, "training a byte-level LM on the Python standard library")
    t = time.perf_counter()
    trained = run_training(cfg, out, console)
    tr = trained["summary"]
    console.print(f"validation bits per byte: {tr['bpb_before']:.3f} before, {tr['bpb_after']:.3f} after "
                  f"{tr['steps']} steps ({tr['tokens']:,} bytes seen, {tr['tokens_per_s']:,.0f} bytes/s)")
    timings["training"] = time.perf_counter() - t

    _rule(console, 4, "generation in RNN mode")
    t = time.perf_counter()
    gen = run_generation(trained["model"], cfg, console)
    console.print(f"RNN mode: {gen['rnn_bytes_per_s']:,.0f} bytes/s; recomputing the forward for every byte: "
                  f"{gen['recompute_bytes_per_s']:,.0f} bytes/s (RNN-mode speedup {gen['rnn_speedup']:.1f}×). "
                  f"Parallel vs recurrent logits: max |diff| {gen['logits_parallel_vs_recurrent_max_abs']:.1e}")
    timings["generation"] = time.perf_counter() - t

    _rule(console, 5, "report")
    timings["total_before_report"] = time.perf_counter() - t_start
    summary = {
        "kind": "demo", "timestamp": timestamp(), "machine": machine_info(device), "dtype": cfg.dtype,
        "threads": torch.get_num_threads(), "config": asdict(cfg),
        "args": args_dict(args) if args is not None else None,
        "timings_s": timings, "agreement": rows, "agreement_ok": all(r["ok"] for r in rows),
        "training": tr, "generation": gen, "bench_ops": ops, "bench_decode": dec,
        "files": {"markdown": "summary.md", "json": "summary.json", "plots": ["bench-ops.png", "bench-decode.png",
                                                                             "training.png"],
                  "run_dir": Path(tr["run_dir"]).name},
    }
    write_json(out / "summary.json", summary)
    (out / "summary.md").write_text(markdown(summary, _record(render_ops, ops), _record(render_decode, dec)),
                                    encoding="utf-8")
    timings["total"] = time.perf_counter() - t_start
    write_json(out / "summary.json", summary)  # again, with the total time
    return summary


# ----------------------------------------------------------------------------------------------
# markdown


def _md_table(cols, rows) -> str:
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join(["---"] + ["---:"] * (len(cols) - 1)) + "|"]
    lines += ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in rows]
    return "\n".join(lines)


def markdown(s: dict, ops_text: str, dec_text: str) -> str:
    """summary.md: what ran, on what, the tables and the figures."""
    m, tr, gen = s["machine"], s["training"], s["generation"]
    cross = s["bench_ops"]["crossover"]
    parts = [
        "# linattn demo",
        "",
        f"{s['timestamp']} · {m['cpu']} · {m['cores']} cores ({m['torch_threads']} torch threads) · "
        f"torch {m['torch']} · "
        f"Python {m['python']} · device {m['device']}" + (f" ({m['gpu']})" if m.get("gpu") else "")
        + f" · dtype {s['dtype']}" + (" · **quick mode**" if s["config"]["quick"] else ""),
        "",
        f"Steps took: agreement {s['timings_s']['agreement']:.1f} s, benchmarks {s['timings_s']['benchmarks']:.1f} s, "
        f"training {s['timings_s']['training']:.1f} s, generation {s['timings_s']['generation']:.1f} s. "
        "All numbers are in `summary.json`.",
        "",
        "## 1. Parallel, recurrent and quadratic forms agree",
        "",
        "Causal attention on random q, k, v (float64): the chunked operator (training/prefill), a loop of "
        "recurrent steps (decoding) and the quadratic oracle written from the definition. Max |difference|:",
        "",
        _md_table(["attention", "F", "chunked vs oracle", "recurrent vs oracle", "chunked vs recurrent", "ok"],
                  [[r["method"], "—" if r["feature_dim"] is None else r["feature_dim"],
                    f"{r['parallel_vs_oracle']:.1e}",
                    f"{r['recurrent_vs_oracle']:.1e}", f"{r['parallel_vs_recurrent']:.1e}",
                    "yes" if r["ok"] else "**NO**"] for r in s["agreement"]]),
        "",
        "## 2. Benchmarks",
        "",
        "Operators against sequence length N (times in ms, median ± IQR; memory: peak fwd+bwd bytes beyond output "
        "and input gradients):",
        "",
        "![operator time vs sequence length](bench-ops.png)",
        "",
        "```text",
        ops_text,
        "```",
        "",
        ("Chunked linear attention (fwd+bwd) is faster than softmax SDPA from N = "
         f"{cross['n']}." if cross["n"] is not None else
         "Chunked linear attention (fwd+bwd) is not faster than softmax SDPA at the lengths measured here."),
        "",
        "Per-token decoding latency against context length (one layer): the linear RNN step stays flat, "
        "softmax with a KV cache grows linearly, softmax without a cache quadratically:",
        "",
        "![per-token decode latency](bench-decode.png)",
        "",
        "```text",
        dec_text,
        "```",
        "",
        "## 3. Training a byte-level LM",
        "",
        f"{tr['corpus']}. Model: {tr['parameters']:,} parameters, d_model {tr['model']['d_model']}, "
        f"{tr['model']['n_layers']} layers ({', '.join(tr['model']['attention'])}), {tr['model']['n_heads']} heads, "
        f"feature map {tr['model']['feature_map']}, positions {tr['model']['positions']}; batch {tr['batch_size']} × "
        f"{tr['seq_len']} bytes, AdamW lr {tr['lr']:g} (warm-up, cosine decay).",
        "",
        _md_table(["", "value"], [
            ["steps", tr["steps"]],
            ["training time", f"{tr['train_seconds']:.1f} s"],
            ["throughput", f"{tr['tokens_per_s']:,.0f} bytes/s"],
            ["validation bits per byte, untrained", f"{tr['bpb_before']:.3f}"],
            ["validation bits per byte, trained", f"{tr['bpb_after']:.3f}"],
            ["validation next-byte accuracy, trained", f"{tr['accuracy_after']:.1%}"],
        ]),
        "",
        "![training loss](training.png)",
        "",
        f"The run folder `{Path(tr['run_dir']).name}/` holds metrics.jsonl and the checkpoint; continue generating "
        f"with `linattn generate --checkpoint {tr['run_dir']} --prompt 'import '`.",
        "",
        "## 4. Generation in RNN mode",
        "",
        f"Prompt {gen['prompt']!r}, {gen['new_bytes']} new bytes, temperature {gen['temperature']}, "
        f"top-k {gen['top_k']}:",
        "",
        "```text",
        gen["text"].replace("```", "`` `"),
        "```",
        "",
        _md_table(["", "value"], [
            ["RNN mode (cached state, O(1) per byte)", f"{gen['rnn_bytes_per_s']:,.0f} bytes/s"],
            ["recomputing the forward for every byte", f"{gen['recompute_bytes_per_s']:,.0f} bytes/s"],
            ["speedup of RNN mode", f"{gen['rnn_speedup']:.1f}×"],
            ["parallel vs recurrent logits, max |diff|",
             f"{gen['logits_parallel_vs_recurrent_max_abs']:.1e} (logits up to {gen['logits_max_abs']:.1f})"],
        ]),
        "",
    ]
    return "\n".join(parts)


__all__ = ["DemoConfig", "agreement", "markdown", "run_demo", "run_generation", "run_training", "train_config"]
