"""Speed and agreement of the operators on a CUDA device, against the device itself and its peers.

One run, side by side (torch.utils.benchmark, CUDA synchronized): for each family of
`linattn.compat.fla` at B × T × H × K × V, forward and forward+backward of linattn's torch path on the
GPU (`fn.__wrapped__`: no handover), of FLA's Triton kernel (the handover, where `fla` imports) and of
causal SDPA at the same shape; the relative difference of the two outputs; and the share of the
device's measured bf16 / fp32 matmul peak that each reaches by the FLOP count of the chunked
algorithm (design §20). The one-token step against one copy of its state. Writes gpu_check.json.

    python benchmarks/gpu_check.py [--dry-run] [--out DIR]

--dry-run: tiny sizes on the CPU (checks the script; its figures mean nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.utils import benchmark

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

#: family -> (compat name, gate: None / "scalar" / "vector", needs beta)
FAMILIES = {
    "linear": ("chunk_linear_attn", None, False),
    "retention": ("chunk_retention", None, False),
    "simple GLA": ("chunk_simple_gla", "scalar", False),
    "GLA": ("chunk_gla", "vector", False),
    "DeltaNet": ("chunk_delta_rule", None, True),
    "Gated DeltaNet": ("chunk_gated_delta_rule", "scalar", True),
    "KDA": ("chunk_kda", "vector", True),
}


def flops(family: str, b: int, t: int, h: int, k: int, v: int, c: int = 64) -> float:
    """Forward FLOPs of the chunked algorithm (design §20; multiply-adds × 2), per chunk of C per head."""
    if family in ("DeltaNet", "Gated DeltaNet", "KDA"):
        per_chunk = 3 * c * c * k + 2 * c * c * v + 3 * c * k * v + c ** 3 / 3
    else:
        per_chunk = c * c * k + c * c * v + 2 * c * k * v
    return 2 * per_chunk * (t / c) * b * h


def timed(fn, min_run_time: float) -> float:
    """Median seconds of fn() (torch.utils.benchmark synchronizes CUDA)."""
    return benchmark.Timer(stmt="fn()", globals={"fn": fn}).blocked_autorange(min_run_time=min_run_time).median


def peaks(device, dry: bool, min_run_time: float) -> dict:
    n = 256 if dry else 8192
    out = {}
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        a = torch.randn(n, n, device=device, dtype=dtype)
        s = timed(lambda: a @ a, min_run_time)
        out[f"matmul_{name}_tflops"] = 2 * n ** 3 / s / 1e12
    x = torch.empty(256 * 2 ** 20 // 4 if not dry else 2 ** 16, device=device)
    y = torch.empty_like(x)
    s = timed(lambda: y.copy_(x), min_run_time)
    out["copy_gb_s"] = 2 * x.numel() * 4 / s / 1e9  # read + write
    return out


def inputs(family: str, b, t, h, k, v, device, dtype) -> dict:
    _, gate, beta = FAMILIES[family]
    g = torch.Generator(device="cpu").manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g).to(device=device, dtype=dtype)  # noqa: E731
    x = dict(q=r(b, t, h, k), k=r(b, t, h, k), v=r(b, t, h, v))
    if gate == "scalar":
        x["g"] = F.logsigmoid(r(b, t, h).float() + 3.0).to(dtype)
    elif gate == "vector":
        x["g"] = F.logsigmoid(r(b, t, h, k).float() + 3.0).to(dtype)
    if beta:
        x["beta"] = torch.rand(b, t, h, generator=g).to(device=device, dtype=dtype) * 0.8 + 0.1
    return x


def family_row(family: str, shape, device, dtype, min_run_time: float, has_fla: bool) -> dict:
    import linattn.compat.fla as compat

    name = FAMILIES[family][0]
    fn = getattr(compat, name)
    ours = getattr(fn, "__wrapped__", fn)
    kw = {"use_qk_l2norm_in_kernel": True} if FAMILIES[family][2] else {}
    if family == "linear":
        kw = {"normalize": False}
    x = inputs(family, *shape, device, dtype)
    row = {"family": family, "function": name, "dtype": str(dtype).replace("torch.", "")}
    peers = {"linattn": ours, **({"fla": fn} if has_fla else {})}
    outs = {}
    for who, f in peers.items():
        try:
            with torch.no_grad():
                outs[who] = f(**x, **kw)[0]
                row[f"{who}_fwd_ms"] = timed(lambda: f(**x, **kw), min_run_time) * 1e3
            leaves = {n: t.detach().requires_grad_() for n, t in x.items()}

            def step():
                o = f(**leaves, **kw)[0]
                o.backward(torch.ones_like(o))

            row[f"{who}_fwdbwd_ms"] = timed(step, min_run_time) * 1e3
        except Exception as exc:  # a peer that cannot run a case is reported, not fatal
            row[f"{who}_error"] = f"{type(exc).__name__}: {exc}"[:200]
    if "linattn" in outs and "fla" in outs:
        a, e = outs["linattn"].double(), outs["fla"].double()
        row["rel_diff"] = ((a - e).norm() / e.norm()).item()
    return row


def sdpa_row(shape, device, dtype, min_run_time: float) -> dict:
    b, t, h, k, v = shape
    g = torch.Generator(device="cpu").manual_seed(0)
    q, kk, vv = (torch.randn(b, h, t, d, generator=g).to(device=device, dtype=dtype) for d in (k, k, k))
    row = {"family": "softmax (SDPA)", "function": "scaled_dot_product_attention", "dtype": str(dtype).replace("torch.", "")}
    with torch.no_grad():
        row["sdpa_fwd_ms"] = timed(lambda: F.scaled_dot_product_attention(q, kk, vv, is_causal=True), min_run_time) * 1e3
    leaves = [x.detach().requires_grad_() for x in (q, kk, vv)]

    def step():
        o = F.scaled_dot_product_attention(*leaves, is_causal=True)
        o.backward(torch.ones_like(o))

    row["sdpa_fwdbwd_ms"] = timed(step, min_run_time) * 1e3
    return row


def step_rows(device, dtype, dry: bool, min_run_time: float, has_fla: bool) -> list:
    """One-token fused_recurrent_gated_delta_rule at H×K×V against one copy of the state."""
    import linattn.compat.fla as compat

    fn = compat.fused_recurrent_gated_delta_rule
    rows = []
    for h, k, v in ((8, 64, 64), (16, 128, 128), (32, 128, 128)) if not dry else ((2, 8, 8),):
        x = inputs("Gated DeltaNet", 1, 1, h, k, v, device, dtype)
        s0 = torch.randn(1, h, k, v, device=device, dtype=torch.float32)
        dst = torch.empty_like(s0)
        row = {"step": f"{h}x{k}x{v}", "dtype": str(dtype).replace("torch.", ""),
               "copy_us": timed(lambda: dst.copy_(s0), min_run_time) * 1e6}
        for who, f in {"linattn": getattr(fn, "__wrapped__", fn), **({"fla": fn} if has_fla else {})}.items():
            with torch.no_grad():
                row[f"{who}_us"] = timed(lambda: f(**x, initial_state=s0, output_final_state=True,
                                                   use_qk_l2norm_in_kernel=True), min_run_time) * 1e6
        rows.append(row)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--shape", default="2,4096,16,128,128", help="B,T,H,K,V")
    ap.add_argument("--families", default=",".join(FAMILIES), help="comma-separated, of: " + ", ".join(FAMILIES))
    ap.add_argument("--dtypes", default="bf16,fp32", help="bf16, fp32 or both")
    args = ap.parse_args(argv)
    dry = args.dry_run or not torch.cuda.is_available()
    device = "cpu" if dry else "cuda"
    shape = (1, 128, 2, 16, 16) if dry else tuple(int(x) for x in args.shape.split(","))
    mrt = 0.05 if dry else 0.3
    import importlib.util

    has_fla = not dry and importlib.util.find_spec("fla") is not None
    if not dry:
        torch.backends.cuda.matmul.allow_tf32 = False
    report = {"device": torch.cuda.get_device_name() if not dry else "cpu (dry run)", "torch": torch.__version__,
              "shape_BTHKV": shape, "fla": has_fla, "timestamp": time.strftime("%Y-%m-%d %H:%M:%S"),
              "peaks": peaks(device, dry, mrt), "families": [], "steps": []}
    print(json.dumps({k: report[k] for k in ("device", "torch", "shape_BTHKV", "fla", "peaks")}), flush=True)
    families = [f for f in args.families.split(",") if f]
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        ap.error(f"--families: unknown {unknown}; choose from {list(FAMILIES)}")
    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
    for dtype in (dtypes[d] for d in args.dtypes.split(",")):
        peak = report["peaks"]["matmul_bf16_tflops" if dtype == torch.bfloat16 else "matmul_fp32_tflops"] * 1e12
        for family in families:
            row = family_row(family, shape, device, dtype, mrt, has_fla)
            fl = flops(family, *shape)
            for who in ("linattn", "fla"):
                for what, mult in (("fwd", 1), ("fwdbwd", 3)):
                    if f"{who}_{what}_ms" in row:
                        row[f"{who}_{what}_peak_pct"] = 100 * mult * fl / (row[f"{who}_{what}_ms"] / 1e3) / peak
            report["families"].append(row)
            save(report, args.out)
        report["families"].append(sdpa_row(shape, device, dtype, mrt))
        save(report, args.out)
    report["steps"] = step_rows(device, torch.float32, dry, mrt, has_fla)
    save(report, args.out)
    for r in report["steps"]:
        print(json.dumps(r), flush=True)
    print(f"wrote {os.path.join(args.out, 'gpu_check.json')}")
    return 0


def save(report: dict, out: str) -> None:
    """Writes gpu_check.json atomically after every row (a run cut off by its time limit keeps what it
    measured) and prints the newest row."""
    rows = report["families"]
    if rows:
        print(json.dumps(rows[-1]), flush=True)
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "gpu_check.json")
    with open(path + ".tmp", "w") as f:
        json.dump(report, f, indent=1)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    raise SystemExit(main())
