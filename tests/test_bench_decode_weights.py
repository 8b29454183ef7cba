"""`linattn bench decode --weights fp32,bf16,int8`: each LM step beside the weight streaming of the
same weights (the int8 floor reads int8 bytes). Structure and bytes only, not times."""

import pytest

from linattn.cli import main

from .test_bench import _load_report

pytest.importorskip("torchao", reason="torchao (the quant extra) is not installed")


def test_bench_decode_weight_formats(tmp_path, capsys):
    out = tmp_path / "decode"
    argv = ["bench", "decode", "--contexts", "32", "--min-run-time", "0.01", "--threads", "1", "--heads", "2",
            "--models", "d16x1", "--model-kinds", "linear", "--model-contexts", "8", "--model-batches", "1,2",
            "--weights", "fp32,bf16,int8", "--out", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "per-token decode step of whole LMs" in printed and "int8" in printed
    rows = _load_report(out, "bench-decode")["models"]["results"]
    assert [(r["weights"], r["batch"]) for r in rows] == [(w, b) for w in ("fp32", "bf16", "int8") for b in (1, 2)]
    for r in rows:
        for key in ("eager", "fused", "stream"):
            assert r[key]["median_s"] > 0
    # d16x1 linear: qkv 16x48, out 16x16, SwiGLU up 16x128, down 64x16, head 256x16 (tied)
    shapes = [(16, 48), (16, 16), (16, 128), (64, 16), (16, 256)]
    weights = sum(k * n for k, n in shapes)
    expected = {"fp32": 4 * weights, "bf16": 2 * weights, "int8": weights + 4 * sum(n for _, n in shapes)}
    for r in rows:
        assert r["weight_bytes"] == expected[r["weights"]], r["weights"]


def test_bench_decode_weights_option_is_checked(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "decode", "--weights", "int4"])
    assert "weight formats must be among fp32,bf16,int8" in capsys.readouterr().err
