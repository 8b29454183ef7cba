"""`linattn generate` (stream text from a saved model) and `linattn bench generate` (the paper's
image-generation speed experiment) on tiny settings."""

import json
import math

import pytest
import torch

from linattn import cli
from linattn.bench.generate import interpolated_sum, probe_points
from linattn.models import LinearTransformerLM, ModelConfig

from .conftest import check_png, numbers


def _run(argv, capsys):
    code = cli.main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    model = LinearTransformerLM(ModelConfig(d_model=16, n_layers=2, n_heads=2, seed=3))
    path = tmp_path_factory.mktemp("ckpt") / "model"
    model.save_pretrained(path)
    return path, model


def test_generate_streams_text_and_the_seed_fixes_it(checkpoint, capsys):
    path, _ = checkpoint
    argv = ["generate", "--checkpoint", str(path), "--prompt", "def ", "--max-new-tokens", "24"]
    code, first, _ = _run(argv + ["--seed", "5"], capsys)
    assert code == 0
    assert first.startswith("def ") and len(first) > len("def \n")
    code, again, _ = _run(argv + ["--seed", "5"], capsys)
    assert code == 0 and again == first
    code, other, _ = _run(argv + ["--seed", "6"], capsys)
    assert code == 0 and other != first
    code, no_echo, _ = _run(argv + ["--seed", "5", "--no-echo"], capsys)
    assert code == 0 and "def " + no_echo == first


def test_generate_matches_the_library_and_honours_stop(checkpoint, capsys):
    path, model = checkpoint
    prompt = list(b"import ")
    expected = model.generate(prompt, 30, temperature=0.0)[0]
    code, out, _ = _run(["generate", "--checkpoint", str(path), "--prompt", "import ", "--max-new-tokens", "30",
                         "--temperature", "0", "--no-echo"], capsys)
    assert code == 0
    assert out == bytes(expected).decode("utf-8", errors="replace") + "\n"
    ascii_ids = [t for t in expected[1:] if 32 <= t < 127]
    if not ascii_ids:
        pytest.skip("the greedy continuation of this tiny model holds no printable ASCII byte to stop on")
    stop = ascii_ids[0]
    cut = expected.index(stop)
    code, out, _ = _run(["generate", "--checkpoint", str(path), "--prompt", "import ", "--max-new-tokens", "30",
                         "--temperature", "0", "--no-echo", "--stop", chr(stop)], capsys)
    assert code == 0
    assert out == bytes(expected[:cut]).decode("utf-8", errors="replace") + "\n"


def test_generate_runs_the_model_in_its_saved_dtype_unless_asked(tmp_path, monkeypatch, capsys):
    LinearTransformerLM(ModelConfig(d_model=16, n_layers=2, n_heads=2, seed=3)).bfloat16().save_pretrained(tmp_path)
    seen = []
    stream = LinearTransformerLM.stream

    def recording(self, *a, **k):
        seen.append(next(self.parameters()).dtype)
        return stream(self, *a, **k)

    monkeypatch.setattr(LinearTransformerLM, "stream", recording)
    argv = ["generate", "--checkpoint", str(tmp_path), "--prompt", "x", "--max-new-tokens", "2"]
    assert _run(argv, capsys)[0] == 0
    assert _run(argv + ["--dtype", "float32"], capsys)[0] == 0
    assert seen == [torch.bfloat16, torch.float32]


def test_generate_missing_checkpoint_names_the_path(tmp_path, capsys):
    missing = tmp_path / "no-such-model"
    code, _, err = _run(["generate", "--checkpoint", str(missing), "--prompt", "x"], capsys)
    assert code != 0
    assert str(missing) in err and "does not exist" in err


def test_generate_corrupt_checkpoint_is_a_clear_error(checkpoint, tmp_path, capsys):
    path, _ = checkpoint
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((path / "config.json").read_text())
    (bad / "model.safetensors").write_bytes(b"\x00garbage")
    code, _, err = _run(["generate", "--checkpoint", str(bad), "--prompt", "x"], capsys)
    assert code == 2 and str(bad) in err and "error" in err
    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = _run(["generate", "--checkpoint", str(empty), "--prompt", "x"], capsys)
    assert code == 2 and "config.json" in err


def test_generate_bad_arguments_say_what_to_pass(checkpoint, capsys):
    path, _ = checkpoint
    code, _, err = _run(["generate", "--checkpoint", str(path), "--prompt", ""], capsys)
    assert code == 2 and "--prompt" in err
    for flag, value, hint in [("--temperature", "-1", "pass e.g. 0.8"), ("--top-p", "1.5", "pass e.g. 0.9"),
                              ("--top-k", "0", "pass e.g. 8")]:
        with pytest.raises(SystemExit) as exc:
            cli.main(["generate", "--checkpoint", str(path), "--prompt", "x", flag, value])
        assert exc.value.code == 2 and hint in capsys.readouterr().err


# ---------------------------------------------------------------------------------------- bench generate


def test_interpolated_sum_is_exact_for_linear_costs():
    pts = [(t, 2.0 + 0.5 * t) for t in (1, 10, 40, 99)]
    assert interpolated_sum(pts, 1, 99) == pytest.approx(sum(2.0 + 0.5 * t for t in range(1, 100)))
    assert probe_points(3072, 6)[0] == 1 and probe_points(3072, 6)[-1] == 3071
    assert probe_points(5, 6) == [1, 2, 3, 4]


def test_bench_generate_tiny_writes_json_png_and_table(tmp_path, capsys):
    threads = torch.get_num_threads()
    out = tmp_path / "bg"
    try:
        code, stdout, _ = _run(["bench", "generate", "--layers", "1", "--tokens", "24", "--batches", "1,2",
                                "--full-no-cache-max", "12", "--probes", "3", "--min-run-time", "0.01",
                                "--threads", "1", "--out", str(out)], capsys)
    finally:
        torch.set_num_threads(threads)
    assert code == 0
    assert "images per second" in stdout and "paper" in stdout and "317" in stdout
    res = json.loads((out / "bench-generate.json").read_text())
    assert res["machine"]["torch"] == torch.__version__ and res["machine"]["torch_threads"] == 1
    assert res["config"]["dtype"] == "fp32"
    assert [(r["dataset"], r["batch"]) for r in res["results"]] == [
        ("mnist", 1), ("mnist", 2), ("cifar10", 1), ("cifar10", 2)]
    for r in res["results"]:
        assert r["tokens"] == 24 and r["layers"] == 1
        assert set(r["methods"]) == {"linear", "kv_cache", "no_cache"}
        assert r["methods"]["linear"]["measured"] == "full"
        assert r["methods"]["no_cache"]["measured"] == "extrapolated"  # 24 tokens > --full-no-cache-max 12
        for m in r["methods"].values():
            assert m["images_per_s"] > 0 and m["seconds"] > 0 and m["latency_ms"]
        assert r["speedup"]["no_cache"] > 0 and r["speedup"]["kv_cache"] > 0
        # the weight-streaming time beside the cached methods (fused decoding: CPU float32 models)
        assert r["weights_ms"]["linear"] > 0 and r["weights_ms"]["softmax"] > 0
        for k in ("linear", "kv_cache"):
            m = r["methods"][k]
            assert m["over_weights"] == pytest.approx(m["ms_per_token"] / r["weights_ms"]["linear" if k == "linear"
                                                                                     else "softmax"])
        assert r["methods"]["no_cache"]["over_weights"] is None
    assert res["config"]["decoding"] == {"linear": "fused", "softmax": "fused"}
    assert "weights once (ms)" in stdout
    assert res["results"][0]["paper_speedup"]["no_cache"] == pytest.approx(317, rel=0.01)
    assert res["results"][2]["paper_speedup"]["no_cache"] == pytest.approx(4462, rel=0.01)
    assert res["results"][2]["paper_speedup"]["kv_cache"] == pytest.approx(56, rel=0.01)
    assert all(math.isfinite(x) for x in numbers(res))
    check_png(out / "bench-generate.png")
    assert "images per second" in (out / "bench-generate.txt").read_text()


def test_bench_generate_runs_uncached_softmax_end_to_end_when_short(tmp_path, capsys):
    code, _, _ = _run(["bench", "generate", "--datasets", "mnist", "--layers", "1", "--tokens", "8", "--batches", "1",
                       "--out", str(tmp_path)], capsys)
    assert code == 0
    res = json.loads((tmp_path / "bench-generate.json").read_text())
    assert res["results"][0]["methods"]["no_cache"]["measured"] == "full"


@pytest.mark.parametrize("argv, hint", [
    (["--datasets", "imagenet"], "mnist,cifar10"),
    (["--tokens", "1"], "at least 2 tokens"),
    (["--batches", "0"], "e.g. 256,512,1024"),
    (["--scale", "huge"], "choose from"),
])
def test_bench_generate_bad_arguments(argv, hint, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "generate", *argv])
    assert exc.value.code == 2 and hint in capsys.readouterr().err
