"""`linattn generate`: stream text from a saved byte-level model in RNN mode.

    linattn generate --checkpoint runs/bytes --prompt "def " --max-new-tokens 300 --temperature 0.8

The prompt is encoded as UTF-8 bytes (the models are byte-level, vocabulary 256); the prompt is
prefilled in parallel, then every new byte costs one cached step (O(1) per linear layer). Bytes are
written to stdout as they come, decoded incrementally as UTF-8 (invalid sequences become U+FFFD).
Thin: options -> LinearTransformerLM.from_pretrained -> model.stream -> stdout.
"""

from __future__ import annotations

import codecs
import sys
from pathlib import Path

from .args import (add_command, add_common_options, dtype_arg, float_in, positive_int, resolve_device, torch_dtype,
                   utf8_text)


_nonneg_float = float_in(0.0, low_inclusive=True, example="0.8; 0 = greedy")
_top_p = float_in(0.0, 1.0, example="0.9")


def add_parser(subparsers) -> None:
    p = add_command(subparsers, "generate", run_generate_command,
                    help="stream text from a saved model (byte-level, RNN-mode decoding)",
                    epilog="examples: linattn generate --checkpoint runs/bytes --prompt 'def ' | "
                           "linattn generate --checkpoint reports/demo-X/train --prompt 'import ' --temperature 0 "
                           "--max-new-tokens 100 --stop $'\\n\\n'")
    p.add_argument("--checkpoint", required=True, metavar="DIR",
                   help="a model folder (config.json + model.safetensors), a training checkpoint folder, or a run "
                        "folder (its checkpoints/last is used)")
    p.add_argument("--prompt", required=True, type=utf8_text,
                   help="text to continue (encoded as UTF-8 bytes; must not be empty)")
    p.add_argument("--max-new-tokens", type=positive_int, default=200, metavar="N",
                   help="bytes to generate at most (default: %(default)s)")
    p.add_argument("--temperature", type=_nonneg_float, default=0.8, metavar="T",
                   help="sampling temperature; 0 picks the most likely byte (greedy) (default: %(default)s)")
    p.add_argument("--top-k", type=positive_int, default=None, metavar="K",
                   help="sample among the K most likely bytes only (default: all)")
    p.add_argument("--top-p", type=_top_p, default=None, metavar="P",
                   help="nucleus sampling: the smallest set of bytes with probability >= P (default: off)")
    p.add_argument("--stop", default=None, metavar="STRING", type=utf8_text,
                   help="stop once the generated text contains STRING (not printed); e.g. a blank line $'\\n\\n'")
    p.add_argument("--no-echo", action="store_true", help="do not print the prompt before the continuation")
    p.add_argument("--dtype", type=dtype_arg, default=None, metavar="{float32,bfloat16,float16}",
                   help="floating dtype of the model (default: the dtype it was saved in)")
    add_common_options(p, out=False, dtype=False)


def _model_dir(path: Path) -> Path:
    """The folder holding config.json + model.safetensors that `path` refers to."""
    from ..models.checkpoint import CONFIG_NAME

    if not path.exists():
        raise FileNotFoundError(f"checkpoint folder {str(path)!r} does not exist: pass a folder written by "
                                "save_pretrained (config.json + model.safetensors) or a `linattn train` run folder")
    if not path.is_dir():
        raise FileNotFoundError(f"--checkpoint {str(path)!r} is a file, not a folder: pass the folder that holds "
                                f"{CONFIG_NAME} and model.safetensors")
    if (path / CONFIG_NAME).is_file():
        return path
    from ..training import find_checkpoint

    try:
        return find_checkpoint(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"no model in {str(path)!r}: expected {CONFIG_NAME} and model.safetensors there, or "
                                "a training run folder with checkpoints/last") from None


class _StopFilter:
    """Holds back the bytes that could still begin `stop`; `feed` returns the bytes safe to print and
    whether the stop string was found (the text before it is returned, the stop string is not)."""

    def __init__(self, stop: bytes | None):
        self.stop = stop or b""
        self.buf = b""

    def feed(self, data: bytes) -> tuple[bytes, bool]:
        if not self.stop:
            return data, False
        self.buf += data
        i = self.buf.find(self.stop)
        if i >= 0:
            out, self.buf = self.buf[:i], b""
            return out, True
        keep = len(self.stop) - 1
        out, self.buf = (self.buf[:-keep], self.buf[-keep:]) if keep else (self.buf, b"")
        return out, False

    def flush(self) -> bytes:
        out, self.buf = self.buf, b""
        return out


def run_generate_command(args) -> int:
    """Loads a model saved with save_pretrained (a folder with config.json and model.safetensors) or the latest
    checkpoint of a `linattn train` / `linattn demo` run folder, encodes --prompt as UTF-8 bytes and streams the
    generated bytes to stdout as they come, decoded as UTF-8 (invalid sequences are shown as U+FFFD). Decoding is
    recurrent: one cached step per byte."""
    import torch
    from safetensors import SafetensorError

    from ..models.checkpoint import CheckpointError
    from ..models.lm import LinearTransformerLM

    def fail(msg: str) -> int:
        print(f"linattn generate: error: {msg}", file=sys.stderr)
        return 2

    if args.prompt == "":
        return fail("--prompt is empty: pass some text to continue, e.g. --prompt 'def '")
    device = resolve_device(args.device)
    try:
        directory = _model_dir(Path(args.checkpoint))
        dtype = None if args.dtype is None else torch_dtype(args.dtype)
        model = LinearTransformerLM.from_pretrained(directory, device=device, dtype=dtype)
    except (FileNotFoundError, CheckpointError, SafetensorError, ValueError, OSError) as exc:
        return fail(f"cannot load the model from {str(args.checkpoint)!r}: {exc}")
    if model.config.vocab_size < 256:
        return fail(f"the model in {str(directory)!r} has a vocabulary of {model.config.vocab_size} tokens, not bytes "
                    "(256): generate needs a byte-level LM")
    model = model.eval()
    prompt = list(args.prompt.encode("utf-8"))
    out = sys.stdout
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    stop = _StopFilter(args.stop.encode("utf-8") if args.stop else None)
    if not args.no_echo:
        out.write(args.prompt)
        out.flush()
    try:
        steps = model.stream(prompt, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                             top_p=args.top_p, seed=args.seed)
        stopped = False
        with torch.inference_mode():
            for step in steps:
                tok = step[0]
                if tok is None or tok >= 256:  # a larger vocabulary's extra ids are not bytes
                    continue
                data, stopped = stop.feed(bytes([tok]))
                if data:
                    out.write(decoder.decode(data))
                    out.flush()
                if stopped:
                    steps.close()
                    break
    except ValueError as exc:  # e.g. more positions than a learned-position model takes
        out.write("\n")
        return fail(str(exc))
    except KeyboardInterrupt:
        out.write(decoder.decode(b"", final=True) + "\n")
        out.flush()
        return 130
    if not stopped:
        out.write(decoder.decode(stop.flush()))
    out.write(decoder.decode(b"", final=True) + "\n")
    out.flush()
    return 0
