"""`linattn bench ops`: time and memory of the attention operators against sequence length.

A sweep over N of every method in `methods.core_methods` (plus importable peers), forward and
forward+backward, timed with torch.utils.benchmark (median, IQR); peak fwd+bwd memory beyond the
output and input gradients; GFLOP/s and % of the measured matmul peak for the chunked op; the way bf16
inputs are multiplied on this machine and why (`bf16_path`). Produces a result dict (written as JSON),
rich tables and a log-log plot.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
from rich.console import Console

from ..report import fmt_bytes, fmt_time, make_table, plot_loglog, progress
from .consistency import growing_series, unstable
from .flops import best_matmul_peak
from .methods import MODE_LABELS, MODES, SweepConfig, core_methods, measure_method
from .peers import peer_methods

DEFAULT_LENGTHS = [256, 512, 1024, 2048, 4096, 8192, 16384]


@dataclass
class OpsConfig(SweepConfig):
    lengths: list[int] = field(default_factory=lambda: list(DEFAULT_LENGTHS))
    recurrent_max: int | None = 2048
    quadratic_max: int | None = 4096
    memory: bool = True
    peers: bool = True


def bf16_path(device: torch.device) -> dict:
    """How the operators multiply bf16 inputs on `device`: on the CPU `native.bf16_summary()` (fused
    kernels and torch ops: bf16 gemms or fp32 gemms on widened blocks, and why); elsewhere bf16 gemms.
    Always has "line", one sentence for reports."""
    if device.type == "cpu":
        from ..ops import native

        return native.bf16_summary()
    return {"mode": None, "line": f"bf16 → bf16 gemms on {device.type} (fp32 accumulation)"}


def run_ops(cfg: OpsConfig, console: Console | None = None) -> dict:
    """Runs the sweep; returns {"config", "peaks", "methods", "results", "crossover", "notes", "bf16"}
    ("bf16": `bf16_path`)."""
    console = console or Console()
    device = torch.device(cfg.device)
    methods = core_methods(cfg.dtype, head_dim=cfg.shape.head_dim, chunk=cfg.shape.chunk,
                           recurrent_max=cfg.recurrent_max, quadratic_max=cfg.quadratic_max)
    notes = []
    if cfg.peers:
        extra, notes = peer_methods(device, cfg.shape.head_dim)
        methods += extra
    for note in notes:
        console.print(f"[yellow]note:[/] {note}")
    peak_time = max(0.05, min(cfg.min_run_time, 0.5))
    peak_dtypes = {m.dtype or cfg.dtype for m in methods if m.counts_flops}
    peaks = {}
    with console.status("measuring the matmul peak (torch.bmm and linattn's product, 64×64 tiles)"):
        for dt in sorted(peak_dtypes, key=str):
            p = best_matmul_peak(dt, device, {64: (128, 1024)}, peak_time)
            peaks[p["dtype"]] = p
    results = []
    with progress(console) as bar:
        task = bar.add_task("bench ops", total=len(cfg.lengths) * len(methods))
        for n in cfg.lengths:
            for m in methods:
                bar.update(task, description=f"N={n} {m.label}")
                results.append(measure_method(m, cfg.shape, n, dtype=cfg.dtype, device=device, seed=cfg.seed,
                                              min_run_time=cfg.min_run_time, memory=cfg.memory,
                                              peaks={k: v["gflops"] for k, v in peaks.items()}))
                bar.advance(task)
    config = asdict(cfg)
    config["dtype"] = str(cfg.dtype).replace("torch.", "")
    config.update(causal=True, feature_map="elu+1", normalize=True,
                  flops_formula="fwd: B·H·2·N·(2·F·E + C·F + C·E), C = chunk; fwd+bwd: 3× fwd",
                  memory_note=("peak fwd+bwd bytes beyond output and input grads; CPU: live storages of "
                               "tensors allocated by ATen ops (TorchDispatchMode), CUDA: max_memory_allocated"))
    out = {"config": config, "peaks": peaks,
           "methods": [{"key": m.key, "label": m.label, "dtype": str(m.dtype or cfg.dtype).replace("torch.", ""),
                        "max_n": m.max_n} for m in methods],
           "results": results, "notes": notes, "bf16": bf16_path(device)}
    out["crossover"] = crossover(results)
    return out


def _series(results: list[dict], method: str, mode: str) -> dict[int, float]:
    return {r["n"]: r[mode]["median_s"] for r in results if r["method"] == method and r.get(mode)}


def crossover(results: list[dict], linear: str = "chunked", softmax: str = "softmax", mode: str = "fwd_bwd") -> dict:
    """The smallest measured N from which `linear` stays faster than `softmax` (in `mode`) at every
    larger measured N. {"n": int or None, "from_first": True when already faster at the first N}."""
    a, b = _series(results, linear, mode), _series(results, softmax, mode)
    ns = sorted(set(a) & set(b))
    n_cross = None
    for n in reversed(ns):
        if a[n] < b[n]:
            n_cross = n
        else:
            break
    return {"n": n_cross, "from_first": bool(ns) and n_cross == ns[0], "mode": mode, "linear": linear,
            "softmax": softmax}


def check_ops(res: dict) -> list[str]:
    """Warnings about the sweep's own numbers (bench.consistency): unstable points, and a method
    faster at a larger N, or flat over the sweep, although every method's cost grows with N."""
    out = []
    for m in res["methods"]:
        for mode in MODES:
            label = f"{m['label']} {MODE_LABELS[mode]}"
            pts = [(r["n"], r[mode]["median_s"], r[mode]["iqr_s"]) for r in res["results"]
                   if r["method"] == m["key"] and r.get(mode)]
            for n, median, iqr in pts:
                out += unstable(label, f"N={n}", median, iqr)
            out += growing_series(label, "N", pts)
    return out


def render_ops(res: dict, console: Console) -> None:
    """Prints the time tables (one per mode), the chunked throughput table, the memory table and the
    way bf16 inputs are multiplied here."""
    methods, results = res["methods"], res["results"]
    ns = sorted({r["n"] for r in results})
    by = {(r["method"], r["n"]): r for r in results}
    cross = res["crossover"]

    def label_n(n):
        if n == cross["n"]:
            return f"{n} ◀ crossover" if not cross["from_first"] else f"{n} ◀ faster from here"
        return str(n)

    for mode in MODES:
        cols = ["N"] + [m["label"] for m in methods] + ["softmax / chunked"]
        rows = []
        for n in ns:
            row = [label_n(n) if mode == cross["mode"] else str(n)]
            for m in methods:
                r = by.get((m["key"], n))
                row.append("skipped" if r and r["skipped"] else fmt_time(*(_mi(r, mode))))
            a, b = by.get(("chunked", n)), by.get(("softmax", n))
            ratio = (b[mode]["median_s"] / a[mode]["median_s"]) if a and b and a[mode] and b[mode] else None
            row.append("—" if ratio is None else f"{ratio:.2f}×")
            rows.append(row)
        console.print(make_table(f"{MODE_LABELS[mode]} time (ms, median ±IQR)", cols, rows))

    flop_methods = [m for m in methods if any(by.get((m["key"], n), {}).get("fwd") and
                                              "gflops" in by[(m["key"], n)]["fwd"] for n in ns)]
    if flop_methods:
        cols = ["N"]
        for m in flop_methods:
            cols += [f"{m['label']} fwd", "% peak", f"{m['label']} fwd+bwd", "% peak"]
        rows = []
        for n in ns:
            row = [str(n)]
            for m in flop_methods:
                r = by.get((m["key"], n))
                for mode in MODES:
                    t = r.get(mode) if r else None
                    row += [_num(t and t.get("gflops")), _num(t and t.get("pct_peak"))]
            rows.append(row)
        peaks = ", ".join(f"{k}: {v['gflops']:.1f} GFLOP/s ({v.get('kernel', 'torch.bmm')} of {v['batch']}×64×64)"
                          for k, v in res["peaks"].items())
        console.print(make_table("chunked linear throughput (GFLOP/s, % of the measured matmul peak of its dtype)",
                                 cols, rows, caption=f"matmul peaks: {peaks}"))

    if any(r.get("memory") for r in results):
        cols = ["N"] + [m["label"] for m in methods]
        rows = []
        for n in ns:
            row = [str(n)]
            for m in methods:
                mem = (by.get((m["key"], n)) or {}).get("memory")
                row.append("—" if not mem else f"{fmt_bytes(mem['extra_bytes'])} ({mem['extra_x_q']:.2f}× q)")
            rows.append(row)
        console.print(make_table("fwd+bwd peak memory beyond output and input grads (MiB, × size of q)", cols, rows,
                                 caption="CPU: live ATen-op allocations (TorchDispatchMode); "
                                         "CUDA: max_memory_allocated"))
    labels = {m["key"]: m["label"] for m in methods}
    reasons = {}
    for r in results:
        if r["skipped"]:
            reasons.setdefault((r["method"], r["skipped"]), []).append(r["n"])
    for (key, why), skipped_ns in reasons.items():
        console.print(f"skipped: {labels[key]} at N = {', '.join(map(str, skipped_ns))}: {why}")
    if cross["n"] is None:
        console.print("crossover: chunked linear fwd+bwd is not faster than softmax at the largest measured N")
    else:
        console.print(f"crossover: chunked linear fwd+bwd is faster than softmax SDPA from N = {cross['n']}"
                      + (" (the smallest measured N)" if cross["from_first"] else ""))
    if res.get("bf16"):  # reports written before the bf16 rule have none
        console.print(res["bf16"]["line"], highlight=False, markup=False)


def plot_ops(res: dict, path) -> None:
    """Log-log time vs N per method, one panel per mode, the crossover as a dashed line."""
    panels = []
    for mode in MODES:
        series = {}
        for m in res["methods"]:
            pts = sorted(_series(res["results"], m["key"], mode).items())
            if pts:
                series[m["label"]] = ([p[0] for p in pts], [p[1] * 1e3 for p in pts])
        vlines = {}
        if mode == res["crossover"]["mode"] and res["crossover"]["n"] is not None:
            vlines[f"crossover N={res['crossover']['n']}"] = res["crossover"]["n"]
        panels.append({"title": MODE_LABELS[mode], "series": series, "vlines": vlines})
    cfg = res["config"]
    sh = cfg["shape"]
    plot_loglog(path, panels, title=(f"attention operators, B={sh['batch']} H={sh['heads']} D={sh['head_dim']} "
                                     f"E={sh['value_dim']} {cfg['dtype']} on {cfg['device']}"),
                xlabel="sequence length N (tokens)", ylabel="time per call (ms)")


def _mi(r, mode):
    t = r.get(mode) if r else None
    return (t["median_s"], t["iqr_s"]) if t else (None, None)


def _num(x):
    return "—" if x is None else f"{x:.1f}"
