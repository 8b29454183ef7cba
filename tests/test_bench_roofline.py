"""`linattn bench ops --roofline` (linattn.bench.roofline): the FLOP counts, and a tiny end-to-end run
of every family and step with its report."""

import io
import statistics

import pytest
import torch
from rich.console import Console

from linattn.bench import roofline as R
from linattn.bench.flops import chunked_linear_flops
from linattn.cli import main
from linattn.ops import native

from .test_bench import _load_report


@pytest.fixture(autouse=True)
def _keep_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_linear_count_is_the_chunked_linear_count():
    assert R.linear_flops(4096, 64, 32, 64) == chunked_linear_flops(1, 1, 4096, 64, 32, 64)


def test_delta_count_is_the_products_of_the_fused_kernel():
    """csrc/delta.cpp per chunk of c tokens: [K; Q] Kᵀ (2c×k×c), [K; Q] S (2c×k×v), the unit triangular
    solve of v columns (c²/2 each), P V' (c×c×v), Kᵀ V' (k×c×v) multiply-adds."""
    n, k, v, c = 2048, 128, 128, 64
    per_chunk_macs = 2 * c * k * c + 2 * c * k * v + v * c * c / 2 + c * c * v + k * c * v
    assert R.delta_flops(n, k, v, c) == pytest.approx(2 * per_chunk_macs * n / c)
    # design §20: ≈ 5.1 GFLOP forward at T = 2048, H = 16, K = V = 128
    assert 16 * R.delta_flops(2048, 128, 128, 64) / 1e9 == pytest.approx(5.1, abs=0.1)


def test_window_count_is_the_span_that_runs():
    # W = 64, C = 64: each block of 64 queries sees its own block and the one before: a span of 128 keys
    assert R.window_flops(1024, 32, 16, 64, 64) == 2 * 1024 * 128 * 48
    assert R.window_flops(1024, 32, 16, 64, 65) == 2 * 1024 * 128 * 48  # key i − 64 is in the block before
    assert R.window_flops(1024, 32, 16, 64, 66) == 2 * 1024 * 192 * 48
    assert R.softmax_flops(100, 8, 4) == 100 * 100 * 12


@pytest.mark.skipif(not native.load(), reason="the fused CPU kernels are not built")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_formulas_are_what_the_kernels_execute(dtype):
    """The documented forward counts against the FLOPs the kernels' products and solves execute
    (csrc/flop_count.h), N a multiple of the chunk; the backward executes more than 3× the forward (it
    recomputes the chunk states and scores)."""
    from linattn.bench.methods import Shape

    b, h, n, k, v, c = 1, 2, 256, 32, 48, 64
    cfg = R.RooflineConfig(shape=Shape(batch=b, heads=h, head_dim=k, value_dim=v, chunk=c), n=n)
    for name, (run, gate, beta, fl) in R.families(cfg).items():
        if name.startswith("softmax"):
            continue
        x, extra = R._inputs(cfg, dtype, "cpu", gate, beta)
        with torch.no_grad():
            ran = R.executed_flops(lambda: run(**x, **extra))
        if name.startswith("sliding"):
            # the first block of c queries has no block before it: c keys, not 2c
            assert ran == pytest.approx(fl * (2 * (n // c) - 1) / (2 * (n // c)))
        elif name in ("delta rule", "Gated DeltaNet", "KDA"):
            # the solve's strictly lower triangle: c(c − 1)/2 multiply-adds per column, not c²/2
            assert ran == pytest.approx(fl - b * h * (n // c) * c * v)
        else:
            assert ran == fl
        leaves = {name_: t.detach().requires_grad_() for name_, t in x.items()}

        def step():
            o = run(**leaves, **extra)
            o.backward(torch.ones_like(o))

        assert R.executed_flops(step) > 3 * ran


def test_matmul_peak_kernels_are_checked():
    from linattn.bench.flops import matmul_peak

    with pytest.raises(ValueError, match="kernel: unknown"):
        matmul_peak(kernel="mkl")
    with pytest.raises(ValueError, match="kernel: linattn's product runs on the CPU in float32"):
        matmul_peak(torch.float16, kernel="linattn")
    if not native.bf16_tiles():
        with pytest.raises(ValueError, match="bfloat16 with AVX512-BF16"):
            matmul_peak(torch.bfloat16, kernel="linattn")


def test_unknown_family_is_refused():
    with pytest.raises(ValueError, match="families: unknown"):
        R.families(R.RooflineConfig(families=["mamba"]))


def test_roofline_tiny_run(tmp_path, capsys):
    out = tmp_path / "r"
    code = main(["bench", "ops", "--roofline", "--roofline-shape", "1,2,96,16,8", "--roofline-dtypes", "fp32,bf16",
                 "--min-run-time", "0.01", "--threads", "1", "--out", str(out)])
    assert code == 0
    text = capsys.readouterr().out
    assert "roofline" in text and "one-token steps" in text
    data = _load_report(out, "bench-roofline")
    fams = {r["family"] for r in data["results"]}
    assert len(fams) == 8 and {r["dtype"] for r in data["results"]} == {"fp32", "bf16"}
    for r in data["results"]:
        for mode, mult in (("fwd", 1), ("fwd_bwd", 3)):
            t, ran = r[mode], r["flops_executed"][mode]
            assert t["model_gflops"] == pytest.approx(mult * r["flops_fwd"] / t["median_s"] / 1e9)
            assert t["gflops"] == pytest.approx((t["model_gflops"] * 1e9 * t["median_s"] if ran is None else ran)
                                                / t["median_s"] / 1e9)
            assert t["counted"] == ("model" if ran is None else "executed")
            # one round: the share is against the peak's workload re-timed before the families
            (peak,) = data["peaks"][r["dtype"]]["rounds_gflops"]
            assert t["pct_peak"] == pytest.approx(100 * t["gflops"] / peak)
            assert t["pct_peak_rounds"] == [pytest.approx(t["pct_peak"])]
        # the fused kernels count what they run; SDPA's products are not theirs
        kernels = native.load() and not r["family"].startswith("softmax")
        assert (r["flops_executed"]["fwd"] is not None) == kernels
    names = ("linear", "gated, scalar g", "Gated DeltaNet", "KDA")
    assert {s["family"] for s in data["steps"]} == {*names, *(f"{n}, in place" for n in names)}
    assert data["peaks"]["fp32"]["tile"] in (64, 128, 256, 512)
    # the peak is the best kernel's: fp32 measured with torch.bmm and (fused kernels built) linattn's product
    fp32 = data["peaks"]["fp32"]
    assert fp32["gflops"] == pytest.approx(max(fp32["by_kernel"].values()))
    assert fp32["by_kernel"][fp32["kernel"]] == pytest.approx(fp32["gflops"])
    if native.load():
        assert set(fp32["by_kernel"]) == {"torch.bmm", "linattn"}
    assert set(data["peaks"]["bf16"]["by_kernel"]) == ({"torch.bmm", "linattn"} if native.bf16_tiles() else {"torch.bmm"})
    assert {s["shape"] for s in data["steps"]} == {"8×64×64", "16×128×128", "32×128×128"}
    assert all(s["x_copy"] > 0 and s["state_bytes"] > 0 for s in data["steps"])


def test_roofline_rounds_take_the_median_share_within_rounds():
    """rounds=3: each round re-times the peak's workload, then each family; a row's share is the median
    over the rounds of its GFLOP/s over its own round's peak, its time the median round's."""
    cfg = R.RooflineConfig(shape=R.Shape(batch=1, heads=2, head_dim=16, value_dim=8, chunk=64), n=96,
                           dtypes=["fp32"], families=["linear (elu+1)", "KDA"], step_shapes=(), min_run_time=0.01,
                           rounds=3)
    res = R.run_roofline(cfg, Console(file=io.StringIO()))
    peaks = res["peaks"]["fp32"]["rounds_gflops"]
    assert len(peaks) == 3 and all(p > 0 for p in peaks)
    assert [r["family"] for r in res["results"]] == ["linear (elu+1)", "KDA"]
    for r in res["results"]:
        for mode in ("fwd", "fwd_bwd"):
            t = r[mode]
            shares = t["pct_peak_rounds"]
            assert len(shares) == 3
            assert t["pct_peak"] == pytest.approx(statistics.median(shares))
            # each round's share is that round's GFLOP/s over that round's peak
            gflops = [s * p / 100 for s, p in zip(shares, peaks)]
            assert t["gflops"] == pytest.approx(statistics.median(gflops))
    text = io.StringIO()
    R.render_roofline(res, Console(file=text, width=200))
    assert "re-timed in each of 3 rounds" in text.getvalue()
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        R.run_roofline(R.RooflineConfig(rounds=0), Console(file=io.StringIO()))


def test_roofline_shape_is_checked(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "ops", "--roofline", "--roofline-shape", "1,2,3"])
    assert exc.value.code == 2
    assert "B,H,N,K,V" in capsys.readouterr().err
