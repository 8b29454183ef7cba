"""`linattn demo --quick`: runs end to end and writes a report folder that parses and links up."""

import json
import math
import re

import pytest
import torch

from linattn import cli
from linattn.demo import agreement

from .conftest import check_png, numbers


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "report"
    threads = torch.get_num_threads()
    try:
        code = cli.main(["demo", "--quick", "--out", str(out), "--threads", "1", "--seed", "1"])
    finally:
        torch.set_num_threads(threads)
    return code, out


def test_quick_demo_writes_the_report(demo_run):
    code, out = demo_run
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["kind"] == "demo" and summary["config"]["quick"] is True
    machine = summary["machine"]
    assert machine["torch"] == torch.__version__ and machine["torch_threads"] == 1 and machine["cpu"]
    assert summary["threads"] == 1 and summary["dtype"] == "float32"
    assert all(math.isfinite(x) for x in numbers(summary))
    assert summary["agreement_ok"] and len(summary["agreement"]) >= 7
    tr = summary["training"]
    assert tr["steps"] >= 1 and 0 < tr["bpb_after"] < 9 and 0 < tr["bpb_before"] < 9
    gen = summary["generation"]
    assert gen["text"].startswith("def ") and gen["new_bytes"] > 0
    assert gen["logits_parallel_vs_recurrent_max_abs"] < 1e-3
    assert summary["bench_ops"]["results"] and summary["bench_decode"]["results"]
    md = (out / "summary.md").read_text()
    for heading in ("agree", "Benchmarks", "Training", "Generation"):
        assert heading in md
    assert summary["bench_ops"]["bf16"]["line"] in md  # which path bf16 takes here, and why
    figures = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", md)
    assert {"bench-ops.png", "bench-decode.png", "training.png"} <= set(figures)
    for name in figures:
        check_png(out / name)


def test_demo_checkpoint_feeds_linattn_generate(demo_run, capsys):
    _, out = demo_run
    capsys.readouterr()
    code = cli.main(["generate", "--checkpoint", str(out / "train"), "--prompt", "import ", "--max-new-tokens", "8"])
    assert code == 0 and capsys.readouterr().out.startswith("import ")


def test_agreement_rows_are_within_tolerance():
    rows = agreement(n=10, chunk=4, seed=3)
    assert {r["method"] for r in rows} >= {"elu+1", "FAVOR+", "cosFormer", "Taylor (Based)"}
    assert all(r["ok"] for r in rows)


@pytest.mark.parametrize("argv, hint", [
    (["--dtype", "float16"], "pass --dtype float32 or --dtype bfloat16"),
    (["--attention", "linear,banana"], "linear,linear,linear,softmax"),
    (["--attention", "linear,linear,softmax"], "1, 2 or 4 kinds"),
])
def test_demo_bad_arguments_say_what_to_pass(argv, hint, tmp_path, capsys):
    code = cli.main(["demo", "--quick", "--out", str(tmp_path), *argv])
    assert code == 2 and hint in capsys.readouterr().err


def test_demo_bad_flag_values_are_argparse_errors(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["demo", "--train-seconds", "0"])
    assert exc.value.code == 2 and "positive number" in capsys.readouterr().err
