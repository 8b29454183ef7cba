"""llama.cpp beside linattn in `linattn bench hf`: the same random model as GGUF, run by llama-cpp-python.

For each shape, the random transformers model is saved (`save_pretrained`) into a temporary folder with
a minimal tokenizer, converted by llama.cpp's own converter (convert_hf_to_gguf.py, run as a subprocess
of this interpreter) to F32 and to Q8_0, and each GGUF is measured by `llama_cpp.Llama` on the same
thread counts as the torch columns:

    prefill T   tokens/s of evaluating a T-token prompt on a fresh context (the memory cleared first)
    decode      ms per token of evaluating one token after a `decode_prompt`-token prompt (the context
                grows by a token a call, as the transformers cache does)

both timed by bench.timing.measure. In the same run, llama.cpp F32's greedy next tokens (argmax of its
logits over GREEDY_STEPS steps after a short random prompt) are compared with transformers'; a
difference is a note, not a failure.

The tokenizer: llama.cpp is fed token ids, so the vocabulary only has to satisfy the converter and
llama.cpp's loader: a byte-level BPE (GPT-2's byte-to-character map) of the 254 bytes valid in UTF-8
text plus two merges (llama.cpp refuses a BPE vocabulary without merges), saved by transformers'
PreTrainedTokenizerFast; the converter pads it to the model's vocab_size with unused tokens. The
converter names the BPE pre-tokenizer from a hash of the token ids it encodes a check text to, which
only the published vocabularies produce; faking Qwen's hash would need Qwen's 248k-token vocabulary.
So the converter runs with its own hook for that name, TextModel.get_vocab_base_pre, answering
"qwen35" — the pre-tokenizer of the real model, which llama.cpp knows — in the converter's process
only. Our models carry no multi-token-prediction layers, hence the converter's --no-mtp where it has it.

Where the converter is: `llama_cpp_source` (`--llama-cpp-source DIR`), else the environment variable
LINATTN_LLAMA_CPP_SOURCE: a llama.cpp checkout, or an extracted llama-cpp-python sdist (its
vendor/llama.cpp). Without llama-cpp-python or the converter, the llama.cpp columns are n/a with the
reason (`pip install linattn[llamacpp]` builds llama-cpp-python from source).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from .timing import measure

ENV_SOURCE = "LINATTN_LLAMA_CPP_SOURCE"
#: bench hf's column -> the converter's --outtype
FORMATS = {"llama.cpp F32": "f32", "llama.cpp Q8_0": "q8_0"}
F32 = "llama.cpp F32"
GREEDY_STEPS = 4
GREEDY_PROMPT = 8
PRE_TOKENIZER = "qwen35"

# Runs in the converter's own process: argv = [-c, llama.cpp dir, converter arguments...]. The converter
# puts its gguf-py on sys.path itself; the pre-tokenizer name is answered through TextModel's hook.
_RUNNER = """
import sys
source, pre = sys.argv[1], sys.argv[2]
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[3:]]
sys.path.insert(0, source)
import convert_hf_to_gguf as converter
text_model = getattr(converter, "TextModel", None)
if text_model is None:
    from conversion.base import TextModel as text_model
text_model.get_vocab_base_pre = lambda self, tokenizer: pre
converter.main()
"""


def find_converter(source: str | os.PathLike | None = None) -> Path:
    """The llama.cpp folder holding convert_hf_to_gguf.py: `source` (a llama.cpp checkout or an extracted
    llama-cpp-python sdist), else $LINATTN_LLAMA_CPP_SOURCE. LookupError (the reason) when there is none."""
    given = source if source is not None else os.environ.get(ENV_SOURCE)
    if not given:
        raise LookupError(f"no llama.cpp converter: give --llama-cpp-source DIR or set {ENV_SOURCE}")
    root = Path(given).expanduser()
    for folder in (root, root / "vendor" / "llama.cpp"):
        if (folder / "convert_hf_to_gguf.py").is_file():
            return folder
    raise LookupError(f"llama_cpp_source {str(root)!r} has no convert_hf_to_gguf.py (nor vendor/llama.cpp/ with one)")


def why_unavailable(source: str | os.PathLike | None = None) -> str | None:
    """None when llama-cpp-python imports and the converter is found, else the reason."""
    try:
        importlib.import_module("llama_cpp")
    except ImportError as exc:
        return f"llama-cpp-python is not importable ({exc}); pip install linattn[llamacpp]"
    try:
        find_converter(source)
    except LookupError as exc:
        return str(exc)
    return None


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte-level map: printable Latin-1 bytes stand for themselves, the others for chr(256 + i)."""
    keep = set(range(33, 127)) | set(range(161, 173)) | set(range(174, 256))
    out, shifted = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + shifted)
            shifted += 1
    return out


def byte_tokenizer():
    """A 256-token byte-level BPE: id b for each byte b < 254 (0xFE and 0xFF never occur in UTF-8) and two
    merges ("Ġt", "in"), as a transformers PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = _byte_chars()
    vocab = {chars[b]: b for b in range(254)}
    merges = [(chars[ord(" ")], "t"), ("i", "n")]
    for i, (a, b) in enumerate(merges):
        vocab[a + b] = 254 + i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def prepare_folder(model: nn.Module, folder: str | os.PathLike) -> Path:
    """`folder` as the converter reads it: `model.save_pretrained` (config.json, model.safetensors) and the
    byte-level tokenizer (tokenizer.json, tokenizer_config.json)."""
    vocab = model.config.vocab_size
    if vocab < 256:
        raise ValueError(f"model.config.vocab_size must be >= 256 for the byte-level tokenizer, got {vocab}")
    folder = Path(folder)
    model.save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return folder


def convert(source: Path, folder: Path, outtype: str, outfile: Path) -> Path:
    """Converts the model `folder` to GGUF `outfile` (--outtype `outtype`) with the converter in `source`.
    RuntimeError (the converter's last error line) when it fails."""
    args = [sys.executable, "-c", _RUNNER, str(source), PRE_TOKENIZER, str(folder), "--outfile", str(outfile),
            "--outtype", outtype]
    if "--no-mtp" in (source / "convert_hf_to_gguf.py").read_text(encoding="utf-8"):
        args.append("--no-mtp")
    done = subprocess.run(args, capture_output=True, text=True, check=False)
    if done.returncode != 0 or not outfile.is_file():
        lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
        last = lines[-1] if lines else f"exit status {done.returncode}"
        raise RuntimeError(f"convert_hf_to_gguf.py --outtype {outtype} failed: {last}"[:300])
    return outfile


def _llama(path: Path, threads: int, n_ctx: int, n_batch: int, logits_all: bool = False):
    import llama_cpp

    return llama_cpp.Llama(model_path=str(path), n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx,
                           n_batch=n_batch, logits_all=logits_all, verbose=False)


@dataclass
class Ggufs:
    """One shape's GGUF files and what became of them."""

    #: column -> GGUF file
    paths: dict[str, Path] = field(default_factory=dict)
    #: column -> why that column is n/a (every column when llama.cpp is unavailable or skipped)
    notes: dict[str, str] = field(default_factory=dict)
    #: the greedy comparison of llama.cpp F32 with transformers (greedy_check), when it ran
    check: dict | None = None


@contextlib.contextmanager
def converted(model: nn.Module, *, enabled: bool = True, source=None, seed: int = 0,
              reference=contextlib.nullcontext):
    """Ggufs of `model` (F32 and Q8_0) in a temporary folder, removed on exit; notes instead of files when
    `enabled` is false, llama.cpp is unavailable or a conversion fails. `reference`: the context under
    which transformers computes the greedy check's logits (bench hf: its torch path)."""
    why = "skipped (--no-llama-cpp)" if not enabled else why_unavailable(source)
    if why is not None:
        yield Ggufs(notes={c: why for c in FORMATS})
        return
    src = find_converter(source)
    with tempfile.TemporaryDirectory(prefix="linattn-gguf-") as tmp:
        out = Ggufs()
        folder = prepare_folder(model, Path(tmp) / "hf")
        for col, outtype in FORMATS.items():
            try:
                out.paths[col] = convert(src, folder, outtype, Path(tmp) / f"model-{outtype}.gguf")
            except RuntimeError as exc:
                out.notes[col] = str(exc)
        shutil.rmtree(folder)  # the safetensors copy: the GGUFs are what is measured
        if F32 in out.paths:
            try:
                out.check = greedy_check(out.paths[F32], model, seed, reference=reference)
            except Exception as exc:  # noqa: BLE001  (a llama.cpp that cannot load the file: a note)
                out.notes[F32] = f"llama.cpp could not run the F32 GGUF: {type(exc).__name__}: {exc}"[:300]
                out.paths.pop(F32)
        yield out


def greedy_check(path: Path, model: nn.Module, seed: int, steps: int = GREEDY_STEPS,
                 reference=contextlib.nullcontext) -> dict:
    """llama.cpp's greedy next tokens from GGUF `path` against transformers' (`model` under the context
    `reference()`) after a GREEDY_PROMPT-token random prompt: {"prompt", "llama.cpp", "transformers",
    "equal", "max_abs_logit_diff"}."""
    import numpy as np

    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, vocab, (GREEDY_PROMPT,), generator=g).tolist()
    ours, theirs, diff = [], [], 0.0
    llm = _llama(path, 1, GREEDY_PROMPT + steps + 1, GREEDY_PROMPT, logits_all=True)
    try:
        llm.eval(ids)
        seq = list(ids)
        for _ in range(steps):
            lc = np.asarray(llm.scores[llm.n_tokens - 1], dtype=np.float32)
            with torch.no_grad(), reference():
                hf = model(torch.tensor([seq]), use_cache=False, logits_to_keep=1).logits[0, -1].float()
            diff = max(diff, float((hf - torch.from_numpy(lc.copy())).abs().max()))
            nxt = int(hf.argmax())
            ours.append(int(lc.argmax()))
            theirs.append(nxt)
            seq.append(nxt)
            llm.eval([nxt])  # both continue on transformers' token: each step compares one next token
    finally:
        llm.close()
    return {"prompt": GREEDY_PROMPT, "llama.cpp": ours, "transformers": theirs, "equal": ours == theirs,
            "max_abs_logit_diff": diff}


@contextlib.contextmanager
def decode_stepper(path: Path, threads: int, prompt: list[int], seconds: float, probe: float):
    """A function that evaluates one more token after `prompt` (GGUF `path`, `threads` threads), on a
    context sized for `seconds` of such calls at `probe` seconds a token (with room for a 3× speed-up);
    the model is closed on exit."""
    calls = int(3 * (seconds + 0.1) / max(probe, 1e-6)) + 64
    n_ctx = len(prompt) + calls
    llm = _llama(path, threads, n_ctx, min(len(prompt), 512))
    try:
        llm.eval(prompt)
        tok = prompt[-1:]

        def step():
            if llm.n_tokens >= n_ctx:
                raise RuntimeError(f"decode filled its context of {n_ctx} tokens (probe {probe * 1e3:.3f} ms/token)")
            llm.eval(tok)
        yield step
    finally:
        llm.close()


def _decode_seconds(path: Path, threads: int, prompt: list[int], min_run_time: float, probe: float) -> float:
    """Seconds per one-token eval after `prompt` (decode_stepper)."""
    with decode_stepper(path, threads, prompt, min_run_time, probe) as step:
        return measure(step, min_run_time=min_run_time).median


def metrics(path: Path, threads: int, lengths: list[int], decode_prompt: int, min_run_time: float, vocab: int,
            seed: int) -> dict:
    """{"prefill T": seconds per prompt (fresh context), "decode": seconds per token} of GGUF `path` on
    `threads` threads, the prompts drawn as bench hf draws its own."""
    g = torch.Generator().manual_seed(seed)
    prompts = {t: torch.randint(0, vocab, (t,), generator=g).tolist() for t in lengths}
    prompt = torch.randint(0, vocab, (decode_prompt,), generator=g).tolist()
    longest = max(max(lengths), decode_prompt + 16)
    out = {}
    llm = _llama(path, threads, longest, max(lengths))
    try:
        for t, ids in prompts.items():
            def prefill(ids=ids):
                llm.reset()  # clears the KV cache and the recurrent states: a fresh context
                llm.eval(ids)
            out[f"prefill {t}"] = measure(prefill, min_run_time=min_run_time).median
        llm.reset()
        llm.eval(prompt)
        times = []
        for _ in range(16):  # a probe of the decode speed, to size the decode context
            t0 = time.perf_counter()
            llm.eval(prompt[-1:])
            times.append(time.perf_counter() - t0)
    finally:
        llm.close()
    out["decode"] = _decode_seconds(path, threads, prompt, min_run_time, sorted(times)[len(times) // 2])
    return out


def columns(ggufs: Ggufs, threads: int, lengths: list[int], decode_prompt: int, min_run_time: float, vocab: int,
            seed: int) -> tuple[dict, dict]:
    """({column: metrics or None}, {column: note}) of every llama.cpp column on `threads` threads; a column
    that fails to run is None with the error as its note."""
    cols, notes = {c: None for c in FORMATS}, dict(ggufs.notes)
    for col, path in ggufs.paths.items():
        try:
            cols[col] = metrics(path, threads, lengths, decode_prompt, min_run_time, vocab, seed)
        except Exception as exc:  # noqa: BLE001  (llama.cpp refusing a model or a context: the column's note)
            notes[col] = f"{type(exc).__name__}: {exc}"[:300]
    return cols, notes


__all__ = ["ENV_SOURCE", "F32", "FORMATS", "Ggufs", "byte_tokenizer", "columns", "convert", "converted",
           "decode_stepper",
           "find_converter", "greedy_check", "metrics", "prepare_folder", "why_unavailable"]
