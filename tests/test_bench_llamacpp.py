"""bench.llamacpp: llama.cpp's columns of `linattn bench hf` — n/a with the reason where llama-cpp-python or
the converter is missing, the converter's input folder, the table's ratios, and (where llama.cpp is here
and $LINATTN_LLAMA_CPP_SOURCE names its converter) the tiny shape end to end: llama.cpp F32's greedy
tokens equal transformers'."""

import json
import sys
import types

import pytest
from rich.console import Console

pytest.importorskip("transformers", reason="the hf extra is not installed")
pytest.importorskip("linattn.hf")

from linattn.bench import llamacpp  # noqa: E402
from linattn.bench.hf import qwen_model, render_hf  # noqa: E402


@pytest.fixture
def fake_llama_cpp(monkeypatch):
    """llama_cpp importable (an empty module): only the converter decides."""
    monkeypatch.setitem(sys.modules, "llama_cpp", types.ModuleType("llama_cpp"))


def test_na_without_llama_cpp(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp raises ImportError
    why = llamacpp.why_unavailable(str(tmp_path))
    assert why.startswith("llama-cpp-python is not importable") and "linattn[llamacpp]" in why
    with llamacpp.converted(qwen_model("tiny", 0), source=str(tmp_path)) as gg:
        assert gg.paths == {} and gg.check is None and gg.notes == {c: why for c in llamacpp.FORMATS}
        cols, notes = llamacpp.columns(gg, 1, [16], 8, 0.01, 256, 0)
    assert cols == {c: None for c in llamacpp.FORMATS} and notes == gg.notes


def test_na_without_converter(fake_llama_cpp, monkeypatch, tmp_path):
    monkeypatch.delenv(llamacpp.ENV_SOURCE, raising=False)
    assert llamacpp.why_unavailable() == ("no llama.cpp converter: give --llama-cpp-source DIR or set "
                                          "LINATTN_LLAMA_CPP_SOURCE")
    assert "has no convert_hf_to_gguf.py" in llamacpp.why_unavailable(str(tmp_path))
    monkeypatch.setenv(llamacpp.ENV_SOURCE, str(tmp_path / "nowhere"))
    assert "nowhere" in llamacpp.why_unavailable()
    with llamacpp.converted(qwen_model("tiny", 0), enabled=False) as gg:
        assert gg.notes == {c: "skipped (--no-llama-cpp)" for c in llamacpp.FORMATS}


def test_find_converter_checkout_sdist_and_env(fake_llama_cpp, monkeypatch, tmp_path):
    checkout = tmp_path / "sdist" / "vendor" / "llama.cpp"
    checkout.mkdir(parents=True)
    (checkout / "convert_hf_to_gguf.py").write_text("")
    assert llamacpp.find_converter(checkout) == checkout
    assert llamacpp.find_converter(tmp_path / "sdist") == checkout  # the extracted llama-cpp-python sdist
    monkeypatch.setenv(llamacpp.ENV_SOURCE, str(tmp_path / "sdist"))
    assert llamacpp.find_converter() == checkout and llamacpp.why_unavailable() is None


def test_convert_failure_is_the_converters_last_line(tmp_path):
    (tmp_path / "convert_hf_to_gguf.py").write_text(
        "import sys\nclass TextModel:\n    pass\ndef main():\n    sys.exit('Model Foo is not supported')\n")
    with pytest.raises(RuntimeError, match="--outtype q8_0 failed: Model Foo is not supported"):
        llamacpp.convert(tmp_path, tmp_path, "q8_0", tmp_path / "out.gguf")


def test_prepare_folder_is_what_the_converter_reads(tmp_path):
    from transformers import AutoTokenizer

    model = qwen_model("tiny", 0)
    folder = llamacpp.prepare_folder(model, tmp_path / "hf")
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5ForCausalLM"] and config["vocab_size"] == 256
    assert (folder / "model.safetensors").is_file()
    tok = AutoTokenizer.from_pretrained(folder)
    assert max(tok.get_vocab().values()) < config["vocab_size"]  # the converter's own assertion
    assert tok.encode("A\n") == [65, 10]  # byte b is id b
    assert tok.encode(" in") == [32, 255] and tok.decode([32, 255, 254]) == " in t"
    merges = json.loads((folder / "tokenizer.json").read_text())["model"]["merges"]
    assert len(merges) == 2  # llama.cpp's loader refuses a BPE vocabulary without merges
    small = qwen_model("tiny", 0)
    small.config.vocab_size = 200
    with pytest.raises(ValueError, match="model.config.vocab_size must be >= 256"):
        llamacpp.prepare_folder(small, tmp_path / "small")


def test_render_sets_accelerate_against_llama_cpp():
    def row(metric, acc, f32, q8):
        return {"shape": "tiny", "threads": 1, "metric": metric, "transformers": 7.0, "kernels": 7.0,
                "accelerate": acc, "llama.cpp F32": f32, "llama.cpp Q8_0": q8, "floor_s": None, "weight_bytes": 0,
                "accelerate_note": None, "llama_cpp_note": None}
    res = {"results": [row("decode", 1.0, 3.0, 2.0), row("decode int8", 0.5, None, None)],
           "llama_cpp": [{"shape": "tiny", "notes": {},
                          "check": {"llama.cpp": [1, 2], "transformers": [1, 3], "equal": False,
                                    "max_abs_logit_diff": 0.5}}]}
    console = Console(record=True, width=400)
    render_hf(res, console)
    text = console.export_text()
    assert "7.00×" in text and "14.00×" in text  # accelerate over transformers
    assert "3.00×" in text and "2.00×" in text  # decode: F32 3 s / 1 s, Q8_0 2 s / 1 s
    assert "4.00×" in text  # decode int8: Q8_0's decode 2 s / 0.5 s
    assert "llama.cpp F32 greedy check (tiny): 1/2 next tokens DIFFER" in text


def test_render_takes_the_alternated_rounds_ratio():
    """A decode row measured in alternated rounds: "accelerate vs F32" is the median ratio within the rounds
    (here 1.25×), not the ratio of the two median rounds (3.00×), and the rounds' ratios are printed."""
    r = {"shape": "tiny", "threads": 2, "metric": "decode", "transformers": 7.0, "kernels": 7.0, "accelerate": 1.0,
         "llama.cpp F32": 3.0, "llama.cpp Q8_0": None, "floor_s": 0.9, "weight_bytes": 0, "accelerate_note": None,
         "llama_cpp_note": None, "rounds": 3,
         "ratios": {"accelerate / floor": 1.11, "llama.cpp F32 / floor": 1.39, "llama.cpp F32 / accelerate": 1.25}}
    console = Console(record=True, width=400)
    render_hf({"results": [r], "llama_cpp": []}, console)
    text = console.export_text()
    assert "1.25×" in text and "3.00×" not in text
    assert ("decode (tiny, 2 thread(s)), 3 alternated rounds, ratios of times within a round (median): accelerate "
            "/ floor 1.11×, llama.cpp F32 / floor 1.39×, llama.cpp F32 / accelerate 1.25×") in text


def test_tiny_end_to_end_greedy_tokens_equal_transformers(tmp_path, capsys):
    """`linattn bench hf` on the tiny shape with llama.cpp: both GGUFs measured, F32's greedy tokens
    transformers'."""
    from linattn.cli import main

    from .test_bench import _load_report

    why = llamacpp.why_unavailable()
    if why is not None:
        pytest.skip(f"llama.cpp columns unavailable: {why}")
    out = tmp_path / "hf"
    assert main(["bench", "hf", "--shapes", "tiny", "--lengths", "16", "--decode-prompt", "8", "--train-len", "16",
                 "--min-run-time", "0.01", "--out", str(out)]) == 0
    data, printed = _load_report(out, "bench-hf"), capsys.readouterr().out
    (entry,) = data["llama_cpp"]
    assert entry["notes"] == {} and entry["check"]["equal"], entry
    assert entry["check"]["transformers"] == entry["check"]["llama.cpp"] and len(entry["check"]["llama.cpp"]) == 4
    assert entry["check"]["max_abs_logit_diff"] < 1e-3
    rows = {r["metric"]: r for r in data["results"]}
    for c in llamacpp.FORMATS:
        assert rows["prefill 16"][c] > 0 and rows["decode"][c] > 0 and rows["train 16"][c] is None
        assert rows["decode int8"][c] is None and rows["decode"]["llama_cpp_note"] is None
    assert "llama.cpp F32 greedy check (tiny): 4/4 next tokens equal" in printed
    decode = rows["decode"]  # accelerate, the floor and llama.cpp F32 in alternated rounds
    assert decode["rounds"] == 3 and set(decode["ratios"]) == {
        "accelerate / floor", "llama.cpp F32 / floor", "llama.cpp F32 / accelerate"}
    assert all(v > 0 for v in decode["ratios"].values())
    assert "accelerate vs Q8_0" in printed and "llama.cpp n/a" not in printed
