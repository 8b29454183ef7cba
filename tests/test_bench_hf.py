"""`linattn bench hf` on the tiny shape: the table's structure (rows, columns, n/a), the gemv floor's
bytes, the option checks. Not times."""

import pytest
from torch import nn

from linattn.cli import main

from .test_bench import _load_report

pytest.importorskip("transformers", reason="the hf extra is not installed")
hf = pytest.importorskip("linattn.hf")


def run_tiny(tmp_path, capsys, *extra):
    out = tmp_path / "hf"
    argv = ["bench", "hf", "--shapes", "tiny", "--threads", "1,2", "--lengths", "16",
            "--decode-prompt", "8", "--train-len", "16", "--min-run-time", "0.01", "--out", str(out), *extra]
    assert main(argv) == 0
    return _load_report(out, "bench-hf"), capsys.readouterr().out


def test_bench_hf_tiny_table(tmp_path, capsys):
    from linattn.bench.hf import qwen_model

    data, printed = run_tiny(tmp_path, capsys, "--no-llama-cpp")
    rows = data["results"]
    base = ("prefill 16", "decode", "train 16")
    low = ("decode bf16", "decode int8", "decode int8 dyn")
    assert [(r["shape"], r["threads"], r["metric"]) for r in rows] == [
        ("tiny", t, m) for t in (1, 2) for m in base + low]
    linears = [m.weight.numel() for m in qwen_model("tiny", 0).modules() if isinstance(m, nn.Linear)]
    # accelerate's model reads the same matrices (q|k|v etc. fused), in fp32, bf16 and int8 + a scale per row
    for r in rows:
        if r["metric"] in low:
            assert r["transformers"] is None and r["kernels"] is None
            assert r["accelerate"] > 0 and r["floor_s"] > 0 and r["accelerate_note"] is None
            per = 2 if r["metric"] == "decode bf16" else 1
            assert per * sum(linears) <= r["weight_bytes"] < 4 * sum(linears)
            continue
        assert r["transformers"] > 0 and r["kernels"] > 0
        assert (r["floor_s"] is not None and r["floor_s"] > 0) == (r["metric"] == "decode")
        assert r["weight_bytes"] == 4 * sum(linears)
        assert r["accelerate"] > 0 and r["accelerate_note"] is None
    for r in rows:  # every metric from rounds that alternate its columns, the ratios within a round
        if r["metric"] == "decode":
            assert r["rounds"] == 3 and list(r["ratios"]) == ["accelerate / floor"] and r["ratios"][
                "accelerate / floor"] > 0
        elif r["metric"] in base:
            assert r["rounds"] == 3 and set(r["ratios"]) == {"transformers / kernels", "transformers / accelerate"}
            assert all(v > 0 for v in r["ratios"].values())
        else:
            assert "ratios" not in r
    for r in rows:  # the bound of a speed-up: transformers' time over its Linear products at the measured peak
        if r["metric"] in ("prefill 16", "train 16"):
            assert r["peak_gflops"] > 0 and r["linear_flops"] > 0
            assert r["speedup_bound"] == pytest.approx(r["transformers"] * r["peak_gflops"] * 1e9 / r["linear_flops"])
        else:
            assert "speedup_bound" not in r
    assert "bound on a speed-up over transformers (tiny, 1 thread(s)" in printed
    assert "decode (tiny, 1 thread(s)), 3 alternated rounds" in printed
    assert "transformers' Qwen3.5" in printed and "gemv floor (same weights)" in printed
    assert all(r["llama.cpp F32"] is None and r["llama.cpp Q8_0"] is None for r in rows)
    assert data["llama_cpp"] == [{"shape": "tiny", "check": None, "notes": {
        c: "skipped (--no-llama-cpp)" for c in ("llama.cpp F32", "llama.cpp Q8_0")}}]
    assert "llama.cpp n/a: llama.cpp F32: skipped (--no-llama-cpp); llama.cpp Q8_0: skipped" in printed


def test_bench_hf_without_accelerate_prints_na(tmp_path, capsys, monkeypatch):
    if hasattr(hf, "accelerate"):
        monkeypatch.delattr(hf, "accelerate")
    monkeypatch.delenv("LINATTN_LLAMA_CPP_SOURCE", raising=False)  # and no llama.cpp converter: n/a, with why
    data, printed = run_tiny(tmp_path, capsys)
    assert all(r["llama.cpp F32"] is None and r["llama.cpp Q8_0"] is None for r in data["results"])
    assert ("no llama.cpp converter: give --llama-cpp-source DIR" in printed
            or "llama-cpp-python is not importable" in printed)
    assert all(r["accelerate"] is None for r in data["results"])
    assert not any(r["metric"].startswith("decode ") for r in data["results"])  # no converted model to quantize
    assert "accelerate n/a: this linattn has no linattn.hf.accelerate" in printed


def test_bench_hf_rounds_zero_measures_apart(tmp_path, capsys):
    data, printed = run_tiny(tmp_path, capsys, "--no-llama-cpp", "--rounds", "0", "--threads", "1",
                             "--no-huge-pages")
    assert data["config"]["huge_pages"] is False and data["config"]["rounds"] == 0
    decode = next(r for r in data["results"] if r["metric"] == "decode")
    assert "ratios" not in decode and decode["accelerate"] > 0 and decode["floor_s"] > 0
    prefill = next(r for r in data["results"] if r["metric"] == "prefill 16")
    assert prefill["rounds"] == 1  # one round: the columns measured once each, in turn
    assert "alternated rounds" not in printed


def test_bench_hf_options_are_checked(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "hf", "--shapes", "qwen9"])
    assert "shapes must be among tiny,small,qwen3.5-0.8b" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "hf", "--rounds", "-1"])
    assert "--rounds: expected an integer >= 0, got -1" in capsys.readouterr().err


def test_render_takes_the_within_round_speed_ups():
    """A prefill row measured in rounds: "accelerate ×" is the median within-round ratio (2.50×), not the
    ratio of the two columns' median rounds (7.00×)."""
    from rich.console import Console

    from linattn.bench.hf import render_hf

    r = {"shape": "tiny", "threads": 1, "metric": "prefill 16", "transformers": 7.0, "kernels": 3.5, "accelerate": 1.0,
         "llama.cpp F32": None, "llama.cpp Q8_0": None, "floor_s": None, "weight_bytes": 0, "accelerate_note": None,
         "llama_cpp_note": None, "rounds": 3, "ratios": {"transformers / kernels": 1.5, "transformers / accelerate": 2.5}}
    console = Console(record=True, width=400)
    render_hf({"results": [r], "llama_cpp": []}, console)
    text = console.export_text()
    assert "2.50×" in text and "1.50×" in text and "7.00×" not in text and "2.00×" not in text


def test_linear_flops_count_every_linear_layer_as_called():
    """A prefill (the last token's logits only: the head multiplies one row) and a training step (the head on
    every row; the backward's two products per layer), against the layers' shapes and, for the training
    step, torch.utils.flop_counter's count of the 2-D products."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from linattn.bench.hf import HfBenchConfig, _workloads, linear_flops, qwen_model, torch_path

    model = qwen_model("tiny", 0)
    head = model.lm_head
    body = sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, nn.Linear) and m is not head)
    top = head.in_features * head.out_features
    work = _workloads(model, HfBenchConfig(shapes=["tiny"], lengths=[16, 5], train_len=12), 256)
    with torch_path():
        assert linear_flops(model, work["prefill 16"][0], False) == 2 * 16 * body + 2 * top
        assert linear_flops(model, work["prefill 5"][0], False) == 2 * 5 * body + 2 * top
        model.train()
        assert linear_flops(model, work["train 12"][0], True) == 3 * 2 * 12 * (body + top)
        with FlopCounterMode(display=False) as counter:
            work["train 12"][0]()
        model.eval()
    counted = counter.get_flop_counts()["Global"]
    assert sum(n for op, n in counted.items() if str(op) in ("aten.mm", "aten.addmm")) == 3 * 2 * 12 * (body + top)


def test_check_hf_warns_of_a_speed_up_above_its_bound():
    from linattn.bench.hf import check_hf

    r = {"shape": "tiny", "threads": 1, "metric": "prefill 16", "transformers": 2.0, "speedup_bound": 1.5,
         "ratios": {"transformers / kernels": 1.2, "transformers / accelerate": 1.7}}
    warnings = check_hf({"results": [r], "llama_cpp": []})
    assert len(warnings) == 1 and "accelerate is 1.70× transformers, above the bound 1.50×" in warnings[0]
