"""`linattn bench ops --roofline`: every operator family against this machine's own limits.

Each chunked family runs at one shape (B × H × N × K × V, default 1 × 16 × 2048 × 128 × 128), forward
and forward+backward, in fp32 and bf16; its GFLOP/s come from the FLOP count of the algorithm it runs
(`FLOPS`, below and design §20) and are set against the matmul peak of the dtype measured in the same
run: the best of torch.bmm and linattn's own product (`linattn_cpu::gemm`, the tiles the fused kernels
multiply with; fp32 on the CPU) on batched square tiles of 64 … 512 (`PEAK_TILES`). The
one-token steps of linear attention, scalar-gated attention, Gated DeltaNet and KDA run at H × K × V =
8×64×64, 16×128×128, 32×128×128 (batch 1, fp32 state) and are set against one copy of tensors of the
state's size (`dst.copy_(src)`), the least a step must do: read and write its state once.

GFLOP/s and % of the peak count the FLOPs the fused CPU kernels' products (gemms, and the delta family's
triangular solves) execute, as they run (`executed_flops`, csrc/flop_count.h); elementwise work is not
counted. The forward formulas below are what they execute (tests/test_bench_roofline.py checks them
against the count). The backward recomputes each chunk's scores and the states entering its chunks
(the memory-efficient backward), so fwd+bwd executes more than 3× the forward: at the default 1 × 16 ×
2048 × 128 × 128, chunk 64, 3.46× (linear and gated), 3.58× (delta rule, Gated DeltaNet), 3.69× (KDA),
3.50× (sliding window; its forward executes 0.98× the formula there: the first block has no earlier
keys). The table shows fwd+bwd as 3× the forward formula beside it. Where the kernels do not run (other devices, SDPA),
the formulas are the count.

FLOP counts, forward, per (batch, head), N tokens, chunk C, key dim K, value dim V; multiply-adds × 2.

    linear, gated (scalar or per channel)    2·N·(2·K·V + C·K + C·V)
        (Q S and Kᵀ V per token; the intra-chunk scores Q Kᵀ and their product with V; the gates'
        rescaling of q and k is elementwise and not counted)
    delta rule, Gated DeltaNet, KDA (UT form, solved)    2·N·(2·C·K + 3·K·V + 1.5·C·V)
        (what csrc/delta.cpp runs per chunk of C tokens: [K; Q] Kᵀ, one 2C×K×C gemm (A and P);
        [K; Q] S, one 2C×K×V gemm; V' = (I + A)⁻¹ diag(β) X, a unit lower-triangular solve of V
        columns (C²/2 each); P V', a C×C×V gemm; the state update Kᵀ V', K×C×V. The WY form of the
        torch path, which builds W and U explicitly, costs more and is not what runs here. KDA's
        per-channel decays rescale k and q elementwise, its sub-chunked products cost what the dense
        ones do)
    sliding window, window W, query blocks of C    2·N·S·(K + V),  S = (⌈(W − 1)/C⌉ + 1)·C
        (each block of C queries against its span of S keys, as linattn.ops.swa's flash and torch-op
        paths run it; linattn's CPU kernels, fp32, read C + W − 1 keys: 127 of the 128 counted at
        W = C = 64)
    softmax, causal (SDPA)    N²·(K + V)   (the half of QKᵀ and PV under the diagonal)
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from rich.console import Console

from ..ops import delta_rule, delta_rule_step, gated_linear_attention, linear_attention, native
from ..ops import sliding_window_attention, softmax_attention
from ..report import make_table, progress
from .consistency import unstable
from .flops import best_matmul_peak, peak_workload
from .methods import Shape
from .timing import Timing, measure, median_round

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
STEP_SHAPES = ((8, 64, 64), (16, 128, 128), (32, 128, 128))


def linear_flops(n: int, k: int, v: int, c: int) -> float:
    return 2.0 * n * (2 * k * v + c * k + c * v)


def delta_flops(n: int, k: int, v: int, c: int) -> float:
    return 2.0 * n * (2 * c * k + 3 * k * v + 1.5 * c * v)


def window_flops(n: int, k: int, v: int, c: int, window: int) -> float:
    span = (math.ceil((window - 1) / c) + 1) * c
    return 2.0 * n * span * (k + v)


def softmax_flops(n: int, k: int, v: int) -> float:
    return float(n) * n * (k + v)


@dataclass
class RooflineConfig:
    """shape: batch, heads, key dim K (`head_dim`), value dim V and chunk C of every family; n: tokens."""

    shape: Shape = field(default_factory=lambda: Shape(batch=1, heads=16, head_dim=128, value_dim=128))
    n: int = 2048
    window: int = 64
    dtypes: list[str] = field(default_factory=lambda: ["fp32", "bf16"])
    families: list[str] | None = None
    step_shapes: tuple = STEP_SHAPES
    min_run_time: float = 0.5
    device: str = "cpu"
    #: rounds of measurement: each times the peak's workload, then every family forward and fwd+bwd in
    #: turn (min_run_time each); a row's share of the peak is the median over the rounds of its GFLOP/s
    #: over that round's peak, so a drift of the machine's speed during the run falls on both
    rounds: int = 1
    seed: int = 0


def _inputs(cfg: RooflineConfig, dtype, device, gate: str | None, beta: bool):
    g = torch.Generator().manual_seed(cfg.seed)
    s = cfg.shape
    b, h, n, k, v = s.batch, s.heads, cfg.n, s.head_dim, s.value_dim
    x = {"q": torch.randn(b, h, n, k, generator=g), "k": torch.randn(b, h, n, k, generator=g),
         "v": torch.randn(b, h, n, v, generator=g)}
    x = {name: t.to(device=device, dtype=dtype) for name, t in x.items()}
    extra = {}
    if gate is not None:
        shape = (b, h, n) if gate == "scalar" else (b, h, n, k)
        extra["g"] = F.logsigmoid(torch.randn(shape, generator=g) + 3.0).to(device)
    if beta:
        extra["beta"] = torch.sigmoid(torch.randn(b, h, n, generator=g)).to(device)
    return x, extra


def families(cfg: RooflineConfig) -> dict:
    """name -> (run(q, k, v, **extra), gate kind, needs beta, forward FLOPs of all heads)."""
    from ..nn.feature_maps import EluPlusOne
    from ..ops.kda import kda

    s = cfg.shape
    n, k, v, c, bh = cfg.n, s.head_dim, s.value_dim, s.chunk, s.batch * s.heads
    lin = bh * linear_flops(n, k, v, c)
    dlt = bh * delta_flops(n, k, v, c)
    phi = EluPlusOne(k)
    table = {
        "linear (elu+1)": (lambda q, k, v: linear_attention(q, k, v, causal=True, feature_map=phi, chunk_size=c),
                           None, False, lin),
        "gated, scalar g": (lambda q, k, v, g: gated_linear_attention(q, k, v, g, chunk_size=c), "scalar", False, lin),
        "gated, per-channel g (GLA)": (lambda q, k, v, g: gated_linear_attention(q, k, v, g, chunk_size=c),
                                       "channel", False, lin),
        "delta rule": (lambda q, k, v, beta: delta_rule(q, k, v, beta, qk_l2norm=True, chunk_size=c), None, True, dlt),
        "Gated DeltaNet": (lambda q, k, v, g, beta: delta_rule(q, k, v, beta, g=g, qk_l2norm=True, chunk_size=c),
                           "scalar", True, dlt),
        "KDA": (lambda q, k, v, g, beta: kda(q, k, v, beta, g, qk_l2norm=True, chunk_size=c), "channel", True, dlt),
        f"sliding window (W={cfg.window})": (
            lambda q, k, v: sliding_window_attention(q, k, v, window=cfg.window, chunk_size=c), None, False,
            bh * window_flops(n, k, v, c, cfg.window)),
        "softmax (SDPA)": (lambda q, k, v: softmax_attention(q, k, v, causal=True), None, False,
                           bh * softmax_flops(n, k, v)),
    }
    if cfg.families:
        unknown = [f for f in cfg.families if f not in table]
        if unknown:
            raise ValueError(f"families: unknown {unknown}; choose from {list(table)}")
        table = {k: v for k, v in table.items() if k in cfg.families}
    return table


#: the square tiles the peak is the best of: tile -> batch sizes (small tiles are what chunked kernels
#: multiply, large ones what a BLAS runs fastest; 64 and 128 alone measured one core's fp32 peak ~25%
#: low here: the delta rule's forward then showed 132% of it)
PEAK_TILES = {64: (128, 1024), 128: (32, 256), 256: (8, 32), 512: (2, 8)}


def executed_flops(fn) -> float | None:
    """The FLOPs the fused CPU kernels' products and solves execute in one call of fn
    (`native.executed_flops`); None where they do not run it (other devices, SDPA, the torch path)."""
    before = native.executed_flops()
    fn()
    if before is None:
        return None
    ran = native.executed_flops() - before
    return float(ran) if ran > 0 else None


def _family_workloads(name, spec, cfg, dtype_name, device) -> tuple[dict, dict]:
    """(row, {"fwd": fwd(), "fwd_bwd": step()}): the family's row (its FLOPs, counted as the kernels ran
    them) and its two workloads on inputs made once."""
    run, gate, beta, fl = spec
    x, extra = _inputs(cfg, DTYPES[dtype_name], device, gate, beta)
    row = {"family": name, "dtype": dtype_name, "flops_fwd": fl}

    def fwd():
        with torch.no_grad():
            run(**x, **extra)

    leaves = {n: a.detach().requires_grad_() for n, a in x.items()}

    def step():
        o = run(**leaves, **extra)
        o.backward(torch.ones_like(o))
        for a in leaves.values():
            a.grad = None

    row["flops_executed"] = {"fwd": executed_flops(fwd), "fwd_bwd": executed_flops(step)}
    return row, {"fwd": fwd, "fwd_bwd": step}


def _finish_row(row: dict, times: dict[str, list[Timing]], peaks: list[float]) -> dict:
    """Fills row["fwd"], row["fwd_bwd"] from each round's timing and that round's peak (GFLOP/s): the
    median round's timing, the median over rounds of GFLOP/s and of the share of the round's peak."""
    for mode, mult in (("fwd", 1), ("fwd_bwd", 3)):
        ts = times[mode]
        ran = row["flops_executed"][mode]
        model = [mult * row["flops_fwd"] / t.median / 1e9 for t in ts]
        gflops = model if ran is None else [ran / t.median / 1e9 for t in ts]
        row[mode] = median_round(ts).as_dict()
        row[mode].update(gflops=statistics.median(gflops),
                         pct_peak=statistics.median(100 * g / p for g, p in zip(gflops, peaks)),
                         pct_peak_rounds=[100 * g / p for g, p in zip(gflops, peaks)],
                         counted="model" if ran is None else "executed", model_gflops=statistics.median(model),
                         model_pct_peak=statistics.median(100 * g / p for g, p in zip(model, peaks)))
    return row


def _steps(h: int, k: int, v: int, seed: int, device) -> dict:
    """family -> (step(), state tensors): the one-token step of each family at batch 1, H × K × V, as a
    new state (out of place) and with inplace=True (the state updated in place, as decoding runs it;
    the values drift over the repetitions, which the time does not depend on)."""
    from ..ops import gated_linear_attention_step, linear_attention_step
    from ..ops.kda import kda_step

    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g).to(device)  # noqa: E731
    q, kk, vv = r(1, h, 1, k), r(1, h, 1, k), r(1, h, 1, v)
    beta = torch.sigmoid(r(1, h, 1))
    scalar, channel = F.logsigmoid(r(1, h, 1) + 3.0), F.logsigmoid(r(1, h, 1, k) + 3.0)
    kv, z, s = r(1, h, k, v), r(1, h, k).abs(), r(1, h, k, v)
    qa, ka = q.abs(), kk.abs()  # positive features for the normalized step, made once (not part of a step)
    calls = {
        "linear": (lambda **o: linear_attention_step((kv, z), qa, ka, vv, **o), (kv, z)),
        "gated, scalar g": (lambda **o: gated_linear_attention_step(s, q, kk, vv, scalar, **o), (s,)),
        "Gated DeltaNet": (lambda **o: delta_rule_step(s, q, kk, vv, beta, g=scalar, qk_l2norm=True, **o), (s,)),
        "KDA": (lambda **o: kda_step(s, q, kk, vv, beta, channel, qk_l2norm=True, **o), (s,)),
    }
    out = {}
    for name, (call, state) in calls.items():  # a new state per token, and the state updated in place (decoding)
        out[name] = ((lambda c=call: c()), state)
        out[f"{name}, in place"] = ((lambda c=call: c(inplace=True)), state)
    return out


def _step_rows(h: int, k: int, v: int, cfg: RooflineConfig, device) -> list[dict]:
    """Each family's one-token step against a copy of its state (the state read and written once)."""
    rows = []
    for family, (step, state) in _steps(h, k, v, cfg.seed, device).items():
        dst = [torch.empty_like(t) for t in state]

        def copy():
            for d, t in zip(dst, state):
                d.copy_(t)

        with torch.no_grad():
            t_step = measure(step, min_run_time=cfg.min_run_time)
            t_copy = measure(copy, min_run_time=cfg.min_run_time)
        rows.append({"family": family, "shape": f"{h}×{k}×{v}",
                     "state_bytes": sum(t.numel() * t.element_size() for t in state), "step": t_step.as_dict(),
                     "copy": t_copy.as_dict(), "x_copy": t_step.median / t_copy.median,
                     "overhead_us": (t_step.median - t_copy.median) * 1e6})
    return rows


def run_roofline(cfg: RooflineConfig, console: Console | None = None) -> dict:
    """{"config", "peaks" {dtype: matmul peak (best_matmul_peak)}, "results" [family rows], "steps" [step rows]}."""
    if cfg.rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {cfg.rounds}")
    console = console or Console()
    device = torch.device(cfg.device)
    table = families(cfg)
    peaks = {}
    with console.status("measuring the matmul peaks (torch.bmm and linattn's product, tiles of 64 … 512)"):
        for name in cfg.dtypes:
            peaks[name] = best_matmul_peak(DTYPES[name], device, PEAK_TILES, min(cfg.min_run_time, 0.5))
    results, steps = [], []
    with progress(console) as bar:
        task = bar.add_task("roofline", total=len(cfg.dtypes) * len(table) * cfg.rounds + len(cfg.step_shapes))
        for name in cfg.dtypes:
            results += _dtype_rows(name, table, cfg, device, peaks[name], lambda d: (
                bar.update(task, description=d), bar.advance(task)))
        for h, k, v in cfg.step_shapes:
            bar.update(task, description=f"steps {h}×{k}×{v}")
            steps += _step_rows(h, k, v, cfg, device)
            bar.advance(task)
    config = asdict(cfg)
    shape = config.pop("shape")
    config = {"batch": shape["batch"], "heads": shape["heads"], "n": cfg.n, "key_dim": shape["head_dim"],
              "value_dim": shape["value_dim"], "chunk": shape["chunk"], **config}
    config["flops"] = __doc__[__doc__.index("GFLOP/s and % of the peak"):].strip()
    return {"config": config, "peaks": peaks, "results": results, "steps": steps}


def _dtype_rows(name: str, table: dict, cfg: RooflineConfig, device, peak: dict, tick) -> list[dict]:
    """The rows of one dtype in cfg.rounds rounds (RooflineConfig.rounds); the peak's workload is that of
    `peak` (best_matmul_peak's best tile, batch and kernel), re-timed at the start of each round and kept
    in peak["rounds_gflops"]. tick(description) after each family of each round."""
    run_peak = peak_workload(DTYPES[name], device, tile=peak["tile"], batch=peak["batch"],
                             kernel=peak.get("kernel", "torch.bmm"))
    peak_flops = 2 * peak["batch"] * peak["tile"] ** 3
    work = [_family_workloads(fam, spec, cfg, name, device) for fam, spec in table.items()]
    times = [{"fwd": [], "fwd_bwd": []} for _ in work]
    peak["rounds_gflops"] = []
    for i in range(cfg.rounds):
        peak["rounds_gflops"].append(peak_flops / measure(run_peak, min_run_time=cfg.min_run_time).median / 1e9)
        for (row, fns), t in zip(work, times):
            for mode, fn in fns.items():
                t[mode].append(measure(fn, min_run_time=cfg.min_run_time))
            tick(f"{row['family']} {name} (round {i + 1} of {cfg.rounds})")
    return [_finish_row(row, t, peak["rounds_gflops"]) for (row, _), t in zip(work, times)]


def check_roofline(res: dict) -> list[str]:
    """Unstable points, and a share of the peak above 100% (a FLOP count or a peak that is off)."""
    out = []
    for r in res["results"]:
        for mode in ("fwd", "fwd_bwd"):
            out += unstable(f"{r['family']} {r['dtype']} {mode}", "", r[mode]["median_s"], r[mode]["iqr_s"])
            if r[mode]["pct_peak"] > 100:
                out.append(f"{r['family']} {r['dtype']} {mode}: {r[mode]['pct_peak']:.0f}% of the measured matmul peak "
                           "(above 100%: the peak was measured low, or the FLOP count overstates the work)")
    for s in res["steps"]:
        out += unstable(f"{s['family']} step {s['shape']}", "", s["step"]["median_s"], s["step"]["iqr_s"])
    return out


def render_roofline(res: dict, console: Console) -> None:
    peaks = res["peaks"]
    rows = []
    for r in res["results"]:
        fb = r["fwd_bwd"]
        model = "" if fb.get("counted") == "model" else f"{fb.get('model_pct_peak', fb['pct_peak']):.0f}%"
        rows.append([r["family"], r["dtype"], f"{r['fwd']['median_s'] * 1e3:.1f}", f"{r['fwd']['gflops']:.0f}",
                     f"{r['fwd']['pct_peak']:.0f}%", f"{fb['median_s'] * 1e3:.1f}", f"{fb['gflops']:.0f}",
                     f"{fb['pct_peak']:.0f}%", model])
    c = res["config"]
    cap = "; ".join(f"{k} matmul peak {v['gflops']:.0f} GFLOP/s ({v.get('kernel', 'torch.bmm')}, {v['batch']}×{v['tile']}²"
                    + "".join(f"; {kk} {g:.0f}" for kk, g in v.get("by_kernel", {}).items() if kk != v.get("kernel"))
                    + ")" + _rounds_note(v) for k, v in peaks.items())
    console.print(make_table(
        f"roofline: B×H×N×K×V = {c['batch']}×{c['heads']}×{c['n']}×{c['key_dim']}×{c['value_dim']}, chunk {c['chunk']}",
        ["family", "dtype", "fwd ms", "GFLOP/s", "% peak", "fwd+bwd ms", "GFLOP/s", "% peak", "% (3× fwd)"], rows,
        caption=cap + "; GFLOP/s of the FLOPs the kernels' products executed (counted as they ran; the model "
        "count where they did not run), beside fwd+bwd as 3× the forward formula; linattn.bench.roofline, design §20"))
    rows = [[s["family"], s["shape"], f"{s['state_bytes'] / 2 ** 10:.0f} KiB", f"{s['step']['median_s'] * 1e6:.1f}",
             f"{s['copy']['median_s'] * 1e6:.1f}", f"{s['x_copy']:.1f}×", f"{s['overhead_us']:.1f}"]
            for s in res["steps"]]
    console.print(make_table("one-token steps (batch 1, fp32 state) against one copy of the state",
                             ["family", "H×K×V", "state", "step µs", "copy µs", "step / copy", "step − copy µs"], rows,
                             caption="target (issue 33): step ≤ 1.5 × copy + 10 µs"))


def _rounds_note(peak: dict) -> str:
    """How the peak read when re-timed in each round (the shares are against these)."""
    rounds = peak.get("rounds_gflops", [])
    if not rounds:
        return ""
    if len(rounds) == 1:
        return f", {rounds[0]:.0f} when re-timed before the families"
    return (f", re-timed in each of {len(rounds)} rounds: {min(rounds):.0f}–{max(rounds):.0f}, median "
            f"{statistics.median(rounds):.0f} (% peak: the median of the rounds' shares)")


def plot_roofline(res: dict, path) -> None:
    """Bars: % of the matmul peak per family, forward and fwd+bwd, one panel per dtype."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dtypes = list(res["peaks"])
    fig, axes = plt.subplots(1, len(dtypes), figsize=(6 * len(dtypes), 4.5), squeeze=False)
    for ax, dt in zip(axes[0], dtypes):
        rows = [r for r in res["results"] if r["dtype"] == dt]
        xs = range(len(rows))
        ax.bar([i - 0.27 for i in xs], [r["fwd"]["pct_peak"] for r in rows], width=0.27, label="forward")
        ax.bar(list(xs), [r["fwd_bwd"]["pct_peak"] for r in rows], width=0.27, label="fwd+bwd (executed FLOPs)")
        ax.bar([i + 0.27 for i in xs], [r["fwd_bwd"].get("model_pct_peak", r["fwd_bwd"]["pct_peak"]) for r in rows],
               width=0.27, label="fwd+bwd (3× forward)")
        ax.set_xticks(list(xs), [r["family"] for r in rows], rotation=35, ha="right", fontsize=8)
        ax.set_ylabel(f"% of the measured {dt} matmul peak ({res['peaks'][dt]['gflops']:.0f} GFLOP/s)")
        ax.set_title(dt)
        ax.legend()
    c = res["config"]
    fig.suptitle(f"roofline, B×H×N×K×V = {c['batch']}×{c['heads']}×{c['n']}×{c['key_dim']}×{c['value_dim']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
