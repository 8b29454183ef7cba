"""Sequence parallelism on CPU: wall time and per-rank peak memory of one causal attention layer of
each sequence-parallel operator, forward + backward, on 1 rank vs 2 ranks (gloo, spawned processes),
and the bytes each exchanges per layer.

    .venv/bin/python benchmarks/seq_parallel.py [--ops linear gla deltanet] [--sizes 15 16 17] [--reps 2]
                                                [--json out.json]

Operators (--ops): linear (elu+1, normalize), simple_gla (gated, one log-decay per head and token),
gla (gated, one per feature), deltanet, gated_deltanet (L2-normalized q, k) — the single-process op
on 1 rank, linattn.parallel's on 2. B = 1, H = 8, D = E = 64, chunk 64, fp32. The bytes table gives
the state exchange per layer and rank from `state_exchange_bytes` / `transition_exchange_bytes` (the
same for every N), and each measured run checks its own exchanged bytes against it.

Every configuration runs in fresh processes, so the peak resident set (VmHWM from
/proc/self/status, reset with /proc/self/clear_refs before the inputs are allocated) is that
configuration's alone. "peak − base" is the peak over the RSS of the
process after imports and process-group set-up: inputs, activations, gradients and temporaries.

Thread settings (stated so the comparison is fair): the machine has 2 cores.
  1 rank × 2 threads — the single-process op using the whole machine (the baseline for speed-up);
  1 rank × 1 thread  — the same work per core as one rank of the 2-rank run;
  2 ranks × 1 thread — sequence parallel, one core each.
Time: one warm-up iteration, then the median of --reps iterations, each bracketed by barriers (the
slowest rank's wall time), and the CPU time of each rank's own process over the same iteration (a
load-independent measure of the work per rank; on a machine shared with other jobs the wall times
of the 2-thread and 2-rank rows suffer most from the contention).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp

B, H, D = 1, 8, 64
OPS = ("linear", "simple_gla", "gla", "deltanet", "gated_deltanet")


def _inputs(op: str, n: int, g: torch.Generator) -> dict:
    """The op's inputs for a shard of n tokens: q, k, v, do and its gate / beta (no gradient)."""
    x = {name: torch.randn(B, H, n, D, generator=g) for name in ("q", "k", "v", "do")}
    if op in ("simple_gla", "gated_deltanet"):
        x["g"] = torch.nn.functional.logsigmoid(torch.randn(B, H, n, generator=g) + 4)
    if op == "gla":
        x["g"] = torch.nn.functional.logsigmoid(torch.randn(B, H, n, D, generator=g) + 4) / 16
    if op in ("deltanet", "gated_deltanet"):
        x["beta"] = torch.rand(B, H, n, generator=g) * 0.9 + 0.05
    return x


def _call(op: str, x: dict, sharded: bool):
    """One forward of `op` on the inputs x, single-process or sequence-parallel (default group)."""
    from linattn import parallel
    from linattn.nn.feature_maps import make_feature_map
    from linattn.ops import delta_rule, gated_linear_attention, linear_attention

    q, k, v = x["q"], x["k"], x["v"]
    if op == "linear":
        fmap = make_feature_map("elu", D)
        if sharded:
            return parallel.sequence_parallel_linear_attention(q, k, v, feature_map=fmap, chunk_size=64)
        return linear_attention(q, k, v, causal=True, feature_map=fmap, chunk_size=64)
    if op in ("simple_gla", "gla"):
        fn = parallel.sequence_parallel_gated_linear_attention if sharded else gated_linear_attention
        return fn(q, k, v, x["g"], chunk_size=64)
    fn = parallel.sequence_parallel_delta_rule if sharded else delta_rule
    return fn(q, k, v, x["beta"], g=x.get("g"), qk_l2norm=True, chunk_size=64)


def exchange_bytes(op: str, world: int) -> int:
    """State bytes landing on each rank per layer, forward + backward, for any N."""
    from linattn import parallel

    if op == "linear":
        return 2 * parallel.state_exchange_bytes(B, H, D, D, world)
    kind = {"simple_gla": "scalar", "gla": "vector"}.get(op, "matrix")
    return sum(parallel.transition_exchange_bytes(B, H, D, D, world, transition=kind))


def _status(field: str) -> int:
    """A VmXXX field of /proc/self/status in bytes."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # resets VmHWM to the current RSS


def _run(rank: int, world: int, op: str, n: int, threads: int, reps: int, init: str, out_dir: str) -> None:
    torch.set_num_threads(threads)
    from linattn import parallel

    barrier = lambda: None  # noqa: E731
    if world > 1:
        parallel.init_distributed("gloo", init_method=init, rank=rank, world_size=world, timeout_s=1800)
        barrier = torch.distributed.barrier
    s, t = parallel.shard_bounds(n, rank, world)
    base = _status("VmRSS")
    _reset_peak()
    x = _inputs(op, t - s, torch.Generator().manual_seed(rank))
    leaves = [x[name].requires_grad_() for name in ("q", "k", "v")]

    def step():
        for leaf in leaves:
            leaf.grad = None
        _call(op, x, world > 1).backward(x["do"])

    times, cpu = [], []
    for i in range(reps + 1):
        barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        c1 = time.process_time()
        barrier()
        if i:
            times.append(time.perf_counter() - t0)
            cpu.append(c1 - c0)
    parallel.comm_stats.reset()
    if world > 1:
        step()
    state_bytes = sum(v for k, v in parallel.comm_stats.bytes.items() if k.startswith("state_"))
    if world > 1 and state_bytes != exchange_bytes(op, world):
        raise RuntimeError(f"{op}: {state_bytes} state bytes exchanged, the formula says {exchange_bytes(op, world)}")
    result = dict(rank=rank, world=world, op=op, n=n, threads=threads, time_s=statistics.median(times),
                  cpu_s=statistics.median(cpu), peak_rss=_status("VmHWM"), base_rss=base,
                  comm_bytes=parallel.comm_stats.total)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(result, fh)
    if world > 1:
        torch.distributed.destroy_process_group()


def measure(op: str, n: int, world: int, threads: int, reps: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_run, args=(world, op, n, threads, reps, f"file://{tmp}/rendezvous", tmp), nprocs=world,
                           join=True, start_method="spawn")
        return [json.load(open(os.path.join(tmp, f"rank{r}.json"))) for r in range(world)]


def render(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=200)
    table = Table(title=f"Sequence-parallel causal attention layers, fwd+bwd, B={B} H={H} D=E={D}, fp32, gloo, "
                        f"{os.cpu_count()} CPU cores")
    for col in ("op", "N", "ranks × threads", "wall (s)", "wall vs 1×1", "CPU s / rank", "peak RSS / rank (MiB)",
                "peak − base / rank (MiB)", "memory vs 1 rank", "bytes exchanged / rank (fwd+bwd)"):
        table.add_column(col, justify="right")
    for r in rows:
        op = r.get("op", "linear")
        same = [x for x in rows if x.get("op", "linear") == op and x["n"] == r["n"] and x["world"] == 1]
        one = next(x for x in same if x["threads"] == 1)
        ref = next(x for x in same if x["threads"] == 2)
        table.add_row(op, f"2^{r['n'].bit_length() - 1}", f"{r['world']} × {r['threads']}", f"{r['time_s']:.2f}",
                      f"{one['time_s'] / r['time_s']:.2f}×", f"{r['cpu_s']:.2f}", f"{r['peak_mib']:.0f}",
                      f"{r['work_mib']:.0f}", f"{r['work_mib'] / ref['work_mib']:.2f}",
                      f"{r['comm_bytes']:,}" if r["world"] > 1 else "—")
    console.print(table)
    render_bytes(console, sorted({r.get("op", "linear") for r in rows}, key=OPS.index))


def render_bytes(console, ops) -> None:
    """The state bytes per layer and rank (forward + backward) of each op, for any N."""
    from rich.table import Table

    worlds = (2, 4, 8)
    table = Table(title=f"State bytes exchanged per layer and rank, forward + backward, B={B} H={H} D=E={D}, fp32 "
                        "(independent of N)")
    table.add_column("op")
    for p in worlds:
        table.add_column(f"P = {p}", justify="right")
    for op in ops:
        table.add_row(op, *(f"{exchange_bytes(op, p):,}" for p in worlds))
    console.print(table)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS), help="the operators to measure")
    p.add_argument("--sizes", type=int, nargs="+", default=[15, 16, 17], help="log2 of the sequence lengths")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--json", help="also write the raw results here")
    p.add_argument("--render", metavar="JSON", help="only print the table of an earlier --json file")
    args = p.parse_args(argv)
    if args.render:
        with open(args.render) as fh:
            render(json.load(fh))
        return
    configs = [(1, 2), (1, 1), (2, 1)]  # (ranks, threads per rank)
    rows = []
    for op in args.ops:
        for e in args.sizes:
            n = 2**e
            for world, threads in configs:
                res = measure(op, n, world, threads, args.reps)
                rows.append(dict(op=op, n=n, world=world, threads=threads, time_s=max(r["time_s"] for r in res),
                                 cpu_s=max(r["cpu_s"] for r in res),
                                 peak_mib=max(r["peak_rss"] for r in res) / 2**20,
                                 work_mib=max(r["peak_rss"] - r["base_rss"] for r in res) / 2**20,
                                 comm_bytes=res[0]["comm_bytes"]))
                print(f"{op} N=2^{e} ranks={world} threads={threads}: {rows[-1]['time_s']:.2f} s "
                      f"(CPU {rows[-1]['cpu_s']:.2f} s), peak-base {rows[-1]['work_mib']:.0f} MiB", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    render(rows)


if __name__ == "__main__":
    main()
