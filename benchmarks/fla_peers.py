"""linattn.compat.fla against the peers' own torch code, side by side in one run (issue 24).

    .venv/bin/python benchmarks/fla_peers.py [--lengths 512,2048,8192] [--fwd-bwd-lengths …] [--other-lengths 512,2048]
                  [--threads 1,2] [--dtypes fp32,bf16] [--min-run-time 0.2] [--skip-others] [--json PATH]

B=1, H=16, K=V=128 (Qwen3.5's linear-attention heads), q/k L2-normalized in the op where the peer
does it. Rows (ratio = peer's time / linattn's time; higher means linattn is faster):

  - Gated DeltaNet: chunk_gated_delta_rule vs transformers' torch_chunk_gated_delta_rule (Qwen3.5's
    fallback when FLA is absent), forward and forward+backward (gradients of o·do w.r.t. q, k, v,
    g, β); target ≥ 5×;
  - one decoding step from a state: fused_recurrent_gated_delta_rule (T = 1) vs transformers'
    torch_recurrent_gated_delta_rule, no gradient; target ≥ 10×;
  - the other families, forward, against FLA's naive chunk references: chunk_linear_attn (normalize)
    vs naive_chunk_linear_attn, chunk_retention and chunk_simple_gla vs naive_chunk_simple_gla
    (g = log γ_h for retention), chunk_gla vs naive_recurrent_gla (FLA has no naive chunk GLA),
    chunk_delta_rule vs delta_rule_chunkwise; target ≥ 5×.

Each pair is timed next to each other with torch.utils.benchmark (median of blocked_autorange) at
1 and 2 threads, fp32 and bf16 (q, k, v in bf16; gates, β and states in float32, as a bf16 model
passes them; the peers compute in float32 where they cast). Whether the CPU has AMX (bf16 tiles)
comes from /proc/cpuinfo's flags. Needs transformers and flash-linear-attention (the test extra).
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings

import torch
import torch.nn.functional as F
from torch.utils import benchmark

import linattn.compat.fla as C
from linattn.report import cpu_model, make_console, make_table

B, H, D = 1, 16, 128
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def int_list(text: str) -> list[int]:
    """'512,2048' -> [512, 2048] (positive ints)."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int_list, default=[512, 2048, 8192],
                   help="T of the gated delta rule rows (default: 512,2048,8192)")
    p.add_argument("--fwd-bwd-lengths", type=int_list, default=None,
                   help="T of the gated delta rule's forward+backward rows (default: --lengths)")
    p.add_argument("--other-lengths", type=int_list, default=[512, 2048],
                   help="T of the other families' rows (default: 512,2048; FLA's naive references are slow)")
    p.add_argument("--threads", type=int_list, default=[1, 2], help="torch threads (default: 1,2)")
    p.add_argument("--dtypes", default="fp32,bf16", help="fp32 and/or bf16 (default: both)")
    p.add_argument("--min-run-time", type=positive_float, default=0.2, help="seconds per timing (default: 0.2)")
    p.add_argument("--skip-others", action="store_true", help="only the gated delta rule rows")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the rows as JSON")
    return p.parse_args(argv)


def has_amx() -> bool | None:
    """amx_bf16 and amx_tile among the first processor's flags in /proc/cpuinfo (None: unreadable)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return "amx_bf16" in flags and "amx_tile" in flags
    except OSError:
        return None
    return None


def peers():
    """transformers' undecorated Qwen3.5 fallbacks and FLA's naive modules."""
    import inspect

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from fla.ops.delta_rule import naive as delta_nv
        from fla.ops.gla import naive as gla_nv
        from fla.ops.linear_attn import naive as linear_nv
        from fla.ops.simple_gla import naive as sgla_nv
        from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen
    return {"chunk": inspect.unwrap(qwen.torch_chunk_gated_delta_rule),
            "recurrent": inspect.unwrap(qwen.torch_recurrent_gated_delta_rule),
            "linear": linear_nv, "simple_gla": sgla_nv, "gla": gla_nv, "delta": delta_nv}


def inputs(t: int, dtype, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed + t)

    def r(*shape):
        return torch.randn(*shape, generator=gen)

    x = dict(q=r(B, t, H, D).to(dtype), k=r(B, t, H, D).to(dtype), v=r(B, t, H, D).to(dtype),
             g=F.logsigmoid(r(B, t, H) + 2.0), beta=torch.sigmoid(r(B, t, H)), gk=F.logsigmoid(r(B, t, H, D) + 4.0))
    x["kn"] = F.normalize(x["k"].float(), dim=-1).to(dtype)
    x["qp"], x["kp"] = x["q"].sigmoid(), x["k"].sigmoid()
    return x


def gdn_pairs(P, x, fwd_bwd: bool):
    """(peer, linattn) callables for the gated delta rule at one T."""
    names = ("q", "k", "v", "g", "beta")
    if not fwd_bwd:
        return (lambda: P["chunk"](x["q"], x["k"], x["v"], x["g"], x["beta"], use_qk_l2norm_in_kernel=True),
                lambda: C.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"],
                                                 use_qk_l2norm_in_kernel=True))
    leaves = {n: x[n].detach().clone().requires_grad_() for n in names}
    do = torch.randn(x["v"].shape, generator=torch.Generator().manual_seed(1)).to(x["v"].dtype)

    def run(fn):
        o, _ = fn(*(leaves[n] for n in names), use_qk_l2norm_in_kernel=True)
        return torch.autograd.grad(o, list(leaves.values()), do)

    return lambda: run(P["chunk"]), lambda: run(C.chunk_gated_delta_rule)


def step_pair(P, dtype):
    """One token from a state, no gradient: (peer, linattn)."""
    x = inputs(1, dtype, seed=5)
    S0 = torch.randn(B, H, D, D, generator=torch.Generator().manual_seed(6)) * 0.1
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])

    def peer():
        with torch.inference_mode():
            return P["recurrent"](*args, initial_state=S0, output_final_state=True, use_qk_l2norm_in_kernel=True)

    def ours():
        with torch.inference_mode():
            return C.fused_recurrent_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], beta=x["beta"], initial_state=S0,
                                                      output_final_state=True, use_qk_l2norm_in_kernel=True)

    return peer, ours


def other_pairs(P, x):
    """{family: (peer, linattn)} forward callables at one T, without gradients."""
    t = x["q"].shape[1]
    gamma = (1 - 2.0 ** (-5.0 - torch.arange(H, dtype=torch.float))).log()
    g_ret = gamma.expand(B, t, H)
    hf = {n: x[n].transpose(1, 2).to(x["q"].dtype).contiguous() for n in ("q", "kn", "v", "beta")}
    return {
        "linear (normalize)": (lambda: P["linear"].naive_chunk_linear_attn(x["qp"], x["kp"], x["v"], normalize=True),
                               lambda: C.chunk_linear_attn(x["qp"], x["kp"], x["v"], normalize=True)),
        "retention": (lambda: P["simple_gla"].naive_chunk_simple_gla(x["q"], x["k"], x["v"], g_ret),
                      lambda: C.chunk_retention(x["q"], x["k"], x["v"])),
        "simple GLA": (lambda: P["simple_gla"].naive_chunk_simple_gla(x["q"], x["k"], x["v"], x["g"]),
                       lambda: C.chunk_simple_gla(x["q"], x["k"], x["v"], x["g"])),
        "GLA (recurrent ref)": (lambda: P["gla"].naive_recurrent_gla(x["q"], x["k"], x["v"], x["gk"]),
                                lambda: C.chunk_gla(x["q"], x["k"], x["v"], x["gk"])),
        "DeltaNet": (lambda: P["delta"].delta_rule_chunkwise(hf["q"], hf["kn"], hf["v"], hf["beta"]),
                     lambda: C.chunk_delta_rule(x["q"], x["kn"], x["v"], x["beta"])),
    }


def timed(fn, threads: int, mrt: float) -> float:
    """Median seconds per call (torch.utils.benchmark.Timer.blocked_autorange) at `threads` threads."""
    fn()  # warm-up (kernel selection, caches)
    timer = benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=threads)
    return timer.blocked_autorange(min_run_time=mrt).median


def run(args, console) -> list[dict]:
    P = peers()
    rows = []
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    for threads in args.threads:
        for dname in dtypes:
            dtype = DTYPES[dname]
            cases = []
            for t in args.lengths:
                x = inputs(t, dtype)
                cases.append(("Gated DeltaNet fwd", t, "torch_chunk_gated_delta_rule", gdn_pairs(P, x, False), 5.0))
                if t in (args.fwd_bwd_lengths or args.lengths):
                    cases.append(("Gated DeltaNet fwd+bwd", t, "torch_chunk_gated_delta_rule", gdn_pairs(P, x, True),
                                  5.0))
            for t in [] if args.skip_others else args.other_lengths:
                for fam, pair in other_pairs(P, inputs(t, dtype)).items():
                    cases.append((f"{fam} fwd", t, "FLA naive", pair, 5.0))
            cases.append(("Gated DeltaNet step", 1, "torch_recurrent_gated_delta_rule", step_pair(P, dtype), 10.0))
            for what, t, peer, (fp, fo), target in cases:
                grad = "fwd+bwd" in what
                with torch.set_grad_enabled(grad):
                    tp, to = timed(fp, threads, args.min_run_time), timed(fo, threads, args.min_run_time)
                rows.append(dict(threads=threads, dtype=dname, case=what, T=t, peer=peer, peer_s=tp, linattn_s=to,
                                 ratio=tp / to, target=target))
                console.print(f"  {threads} thr {dname} {what:28s} T={t:5d}: {peer} {tp * 1e3:9.2f} ms, "
                              f"linattn {to * 1e3:8.2f} ms, {tp / to:6.1f}×", highlight=False)
    return rows


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    console = make_console()
    amx = has_amx()
    console.print(f"CPU: {cpu_model()}; AMX (amx_bf16+amx_tile in /proc/cpuinfo): "
                  f"{'unknown' if amx is None else 'yes' if amx else 'no'}; torch {torch.__version__}", highlight=False)
    rows = run(args, console)
    table = [(r["case"], str(r["T"]), f"{r['threads']}", r["dtype"], f"{r['peer_s'] * 1e3:.2f}",
              f"{r['linattn_s'] * 1e3:.2f}", f"{r['ratio']:.1f}×", f"≥ {r['target']:.0f}×",
              "[green]PASS[/]" if r["ratio"] >= r["target"] else "[red]FAIL[/]") for r in rows]
    console.print(make_table("linattn.compat.fla vs the peers' torch code (B=1, H=16, K=V=128)",
                             ["case", "T", "threads", "dtype", "peer ms", "linattn ms", "peer/linattn", "target",
                              "result"], table,
                             caption=f"{cpu_model()}, AMX: {'unknown' if amx is None else 'yes' if amx else 'no'}"))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"amx": amx, "cpu": cpu_model(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
