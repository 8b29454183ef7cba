"""The benchmark tools: memory tracker, FLOP count, crossover, and tiny end-to-end runs of
`linattn bench ops|decode` and benchmarks/ops_core.py."""

import gc
import importlib.util
import json
import math
import os
from pathlib import Path

import pytest
import torch

from linattn.bench.flops import chunked_linear_flops
from linattn.bench.memory import AllocationTracker, peak_memory
from linattn.bench.ops import crossover
from linattn.bench.timing import measure
from linattn.cli import main

from .conftest import check_png, numbers

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _keep_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def _load_report(out: Path, kind: str) -> dict:
    # json.loads rejects nothing by default; parse_constant catches NaN/Infinity sneaking in
    def bad(name):
        raise AssertionError(f"non-finite constant {name} in JSON")

    data = json.loads((out / f"{kind}.json").read_text(), parse_constant=bad)
    assert all(math.isfinite(x) for x in numbers(data))
    check_png(out / f"{kind}.png")
    assert (out / f"{kind}.txt").read_text().strip()
    return data


def test_tracker_counts_a_known_allocation():
    with AllocationTracker() as tracker:
        base = tracker.live
        x = torch.empty(1 << 18, dtype=torch.float32)  # 1 MiB
        assert tracker.live - base == 1 << 20
        y = x.view(-1, 2)  # a view: no new storage
        x.add_(1)  # in-place: no new storage
        torch.mul(x, 2, out=x)  # out=: no new storage
        assert tracker.live - base == 1 << 20
        z = x * 2  # a new 1 MiB
        assert tracker.live - base == 2 << 20
        del x, y, z
        gc.collect()
        assert tracker.live == base
        assert tracker.peak >= base + (2 << 20)


def test_tracker_ignores_tensors_from_before_and_counts_backward():
    q = torch.randn(1, 2, 256, 16, requires_grad=True)

    def fwd_bwd():
        o = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        return (o, *torch.autograd.grad(o.sum(), (q,)))

    peak, (o, dq) = peak_memory(fwd_bwd)
    assert peak >= o.nbytes + dq.nbytes  # output and gradient are counted, q is not


def test_chunked_flops_formula():
    n, f, e = 1024, 64, 32
    assert chunked_linear_flops(2, 3, n, f, e, chunk=64) == 2 * 3 * 2 * n * (2 * f * e + 64 * f + 64 * e)


def test_crossover_is_where_linear_stays_faster():
    def rows(method, times):
        return [{"method": method, "n": n, "fwd_bwd": {"median_s": t}} for n, t in times.items()]

    soft = {256: 1.0, 512: 2.0, 1024: 4.0, 2048: 8.0}
    res = rows("softmax", soft) + rows("chunked", {256: 0.5, 512: 3.0, 1024: 3.0, 2048: 4.0})
    assert crossover(res) == {**crossover(res), "n": 1024, "from_first": False}
    res = rows("softmax", soft) + rows("chunked", {n: t / 2 for n, t in soft.items()})
    assert crossover(res)["n"] == 256 and crossover(res)["from_first"]
    res = rows("softmax", soft) + rows("chunked", {n: t * 2 for n, t in soft.items()})
    assert crossover(res)["n"] is None


def test_measure_reports_median_and_iqr():
    t = measure(lambda: torch.ones(64, 64) @ torch.ones(64, 64), min_run_time=0.01)
    assert t.median > 0 and t.iqr >= 0 and t.blocks >= 1


def test_bench_ops_tiny_run(tmp_path, capsys):
    out = tmp_path / "ops"
    argv = ["bench", "ops", "--lengths", "64,128", "--min-run-time", "0.01", "--threads", "1",
            "--recurrent-max", "64", "--out", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    for text in ("forward time", "forward+backward time", "peak memory", "crossover", str(out.resolve())):
        assert text in printed
    assert "not installed, skipped" in printed  # optional peers: the skip path
    data = _load_report(out, "bench-ops")
    assert data["machine"]["cpu"] and data["machine"]["torch"] == torch.__version__
    assert data["args"]["lengths"] == [64, 128] and data["config"]["dtype"] == "float32"
    keys = {m["key"] for m in data["methods"]}
    assert {"chunked", "chunked_bf16", "noncausal", "recurrent", "quadratic", "softmax", "gated_scalar",
            "gated_vector", "delta", "gated_delta"} <= keys
    by = {(r["method"], r["n"]): r for r in data["results"]}
    for (key, n), r in by.items():
        if key == "recurrent" and n == 128:
            assert r["skipped"].startswith("N > 64") and r["fwd"] is None
            continue
        assert r["skipped"] is None, r
        assert r["fwd"]["median_s"] > 0 and r["fwd_bwd"]["median_s"] > 0
        assert r["memory"]["extra_bytes"] >= 0 and r["memory"]["output_and_grads_bytes"] > 0
    assert by[("chunked", 128)]["fwd"]["gflops"] > 0 and by[("chunked", 128)]["fwd"]["pct_peak"] > 0
    assert data["peaks"]["float32"]["gflops"] > 0 and data["peaks"]["bfloat16"]["gflops"] > 0
    bf16 = data["bf16"]  # the way bf16 is multiplied here, and why, printed and in the report
    assert " ".join(bf16["line"].split()) in " ".join(printed.split())
    assert bf16["line"].startswith("bf16 → ") and "torch ops: " in bf16["line"]
    assert bf16["torch_ops"]["path"] in ("bf16 gemms", "fp32 gemms") and bf16["torch_ops"]["reason"]
    if bf16["fused"] is not None and bf16["mode"] == "auto":  # bf16 gemms with AMX or linattn's AVX512-BF16 tiles
        tiles = bool(torch.ops.linattn_cpu.uses_bf16_tiles())
        assert (bf16["fused"]["path"] == "bf16 gemms") == bool(bf16["cpu"]["amx"] or tiles), bf16
        assert bf16["fused"]["reason"] in bf16["line"]


def test_bench_decode_tiny_run(tmp_path, capsys):
    out = tmp_path / "decode"
    argv = ["bench", "decode", "--contexts", "32,64", "--min-run-time", "0.01", "--threads", "1",
            "--heads", "2", "--models", "d16x1,d24x2", "--model-kinds", "linear,gated_deltanet",
            "--model-contexts", "8,70000", "--model-batches", "1,3", "--out", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "per-token decode latency" in printed and str(out.resolve()) in printed
    data = _load_report(out, "bench-decode")
    assert [r["ctx"] for r in data["results"]] == [32, 64]
    for r in data["results"]:
        for key in ("linear_step", "gated_scalar_step", "gated_vector_step", "delta_step", "gated_delta_step",
                    "kv_cache", "no_cache"):
            assert r[key]["median_s"] > 0
        assert r["kv_cache_over_step"] > 0 and r["kv_cache_bytes"] == 4 * 2 * r["ctx"] * 128
    assert "per-token decode step of whole LMs" in printed
    rows = data["models"]["results"]
    assert [(r["model"], r["kind"], r["ctx"], r["batch"]) for r in rows] == [
        (m, k, c, b) for m in ("d16x1", "d24x2") for k in ("linear", "gated_deltanet") for c in (8, 70000)
        for b in (1, 3)]
    for r in rows:
        for key in ("eager", "fused", "stream"):
            assert r[key]["median_s"] > 0
        assert r["fused_over_stream"] > 0 and r["eager_over_fused"] > 0 and r["fused_tokens_s"] > 0
    d16 = [r for r in rows if r["model"] == "d16x1" and r["kind"] == "linear"]
    # d16x1 linear: qkv 16x48, out 16x16, SwiGLU up 16x(2·64), down 64x16, head 256x16 (tied), float32
    assert {r["weight_bytes"] for r in d16} == {4 * (16 * 48 + 16 * 16 + 16 * 128 + 64 * 16 + 256 * 16)}


def test_bench_decode_model_options_are_checked(capsys):
    for argv, what in ((["--models", "d250x4"], "dWIDTHxLAYERS"), (["--model-kinds", "softmax"], "kinds must be"),
                       (["--model-batches", "0"], "positive")):
        with pytest.raises(SystemExit):
            main(["bench", "decode", *argv])
        assert what in capsys.readouterr().err


def test_ops_core_script_smoke(capsys, tmp_path):
    spec = importlib.util.spec_from_file_location("ops_core", ROOT / "benchmarks" / "ops_core.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "core.json"
    assert mod.main(["--lengths", "64,128", "--bf16-lengths", "128", "--cache", "64", "--min-run-time", "0.01",
                     "--threads", "1", "--rounds", "2", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "core criteria" in printed and "2 interleaved rounds" in printed
    assert printed.count("PASS") + printed.count("FAIL") >= 9
    data = json.loads(out.read_text())
    assert len(data["rounds"]) == 2
    ratio = data["rows"][0]  # SDPA / chunked at N=64: one ratio per round, the median between min and max
    assert len(ratio["per_round"]) == 2 and ratio["min"] <= ratio["median"] <= ratio["max"]
    rnd = data["rounds"][1]
    expected = rnd["raw"]["softmax"][0]["fwd_bwd"]["median_s"] / rnd["raw"]["chunked"][0]["fwd_bwd"]["median_s"]
    assert ratio["per_round"][1] == pytest.approx(expected)


def test_ops_gated_script_smoke(capsys, tmp_path):
    """benchmarks/ops_gated.py: every row of its table, the ratios formed within rounds."""
    spec = importlib.util.spec_from_file_location("ops_gated", ROOT / "benchmarks" / "ops_gated.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "gated.json"
    assert mod.main(["--lengths", "64,128", "--min-run-time", "0.01", "--threads", "1", "--rounds", "2",
                     "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "gated operators vs ungated" in printed and "2 interleaved rounds" in printed
    data = json.loads(out.read_text())
    assert len(data["rows"]) == 9 and printed.count("PASS") + printed.count("FAIL") >= 9
    ratio = data["rows"][0]  # scalar-gated / ungated at N=64, one ratio per round
    rnd = data["rounds"][1]
    expected = rnd["fwd_bwd"]["scalar"][0]["median_s"] / rnd["fwd_bwd"]["ungated"][0]["median_s"]
    assert ratio["per_round"][1] == pytest.approx(expected)
    memory = data["rows"][-1]
    assert 0 < memory["median"] < 100


def test_ops_bf16_script_smoke(capsys, tmp_path, monkeypatch):
    """benchmarks/ops_bf16.py: both forced paths timed in every round, the ratios formed within a
    round, the default path named and judged, LINATTN_BF16_PATH left as it was."""
    monkeypatch.setenv("LINATTN_BF16_PATH", "bf16")
    spec = importlib.util.spec_from_file_location("ops_bf16", ROOT / "benchmarks" / "ops_bf16.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "bf16.json"
    assert mod.main(["--lengths", "70", "--ops", "ungated,gated", "--min-run-time", "0.01", "--threads", "1",
                     "--rounds", "2", "--json", str(out)]) == 0
    assert os.environ["LINATTN_BF16_PATH"] == "bf16"
    printed = capsys.readouterr().out
    assert "bf16 → " in printed and "2 interleaved rounds" in printed
    data = json.loads(out.read_text())
    assert data["bf16"]["mode"] == "auto" and len(data["rows"]) == 4 and len(data["rounds"]) == 2
    for row in data["rows"]:
        assert row["default_path"] in ("bf16 gemms", "fp32 gemms")
        for name in ("bf16·bf16 gemms", "bf16·fp32 gemms"):
            per_round = [rnd[row["op"]][str(row["n"])][row["mode"]] for rnd in data["rounds"]]
            assert row["fp32_over_bf16"][name] == pytest.approx([t["fp32"] / t[name] for t in per_round])


def test_seq_parallel_script_smoke(capsys, monkeypatch):
    """benchmarks/seq_parallel.py: one 2-rank Gated DeltaNet run in spawned processes (the script
    checks the state bytes it exchanged against transition_exchange_bytes and raises on a mismatch)
    and the bytes table of every op."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # spawned ranks import the script by name
    import seq_parallel
    from rich.console import Console

    ranks = seq_parallel.measure("gated_deltanet", 9, 2, 1, 1)
    assert [(r["rank"], r["world"], r["op"], r["n"]) for r in ranks] == [(0, 2, "gated_deltanet", 9),
                                                                         (1, 2, "gated_deltanet", 9)]
    state = seq_parallel.exchange_bytes("gated_deltanet", 2)
    assert state == 2 * 8 * (64 * 64 * 2) * 4 + 2 * 8 * 64 * 64 * 4  # P·B·H·(D² + D·E) fwd + P·B·H·D·E bwd, fp32
    assert all(r["comm_bytes"] > state and r["time_s"] > 0 and r["peak_rss"] >= r["base_rss"] for r in ranks)
    seq_parallel.render_bytes(Console(width=200), seq_parallel.OPS)
    printed = capsys.readouterr().out
    assert all(op in printed for op in seq_parallel.OPS) and f"{state:,}" in printed
