"""Argument types and shared options of the `linattn` commands: each type rejects a bad value with an
argparse error that says what to pass instead."""

from __future__ import annotations

import argparse
import inspect

import torch

from .._checks import DTYPE_NAMES as DTYPES
from .._checks import check_output_folder, resolve_device, torch_dtype

__all__ = ["add_command", "add_common_options", "device_arg", "dtype_arg", "float_in", "int_list", "output_folder",
           "positive_float", "positive_int", "resolve_device", "torch_dtype", "utf8_text"]

DEVICES = ("cpu", "cuda", "auto")


def device_arg(value: str) -> str:
    """argparse type for --device: cpu, cuda (only when CUDA is available) or auto."""
    value = value.strip().lower()
    if value not in DEVICES:
        raise argparse.ArgumentTypeError(f"unknown device {value!r}: pass one of {', '.join(DEVICES)}")
    if value == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(
            "CUDA is not available on this machine (torch "
            f"{torch.__version__}, {'no CUDA build' if torch.version.cuda is None else 'no GPU visible'}): "
            "pass --device cpu or --device auto"
        )
    return value


def dtype_arg(value: str) -> str:
    """argparse type for --dtype: a key of DTYPES (the name is kept; see `torch_dtype`)."""
    value = value.strip().lower()
    aliases = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
    value = aliases.get(value, value)
    if value not in DTYPES:
        raise argparse.ArgumentTypeError(f"unknown dtype {value!r}: pass one of {', '.join(DTYPES)}")
    return value


def _int_at_least(value: str, low: int, what: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {value!r} (pass e.g. 8)") from None
    if n < low:
        raise argparse.ArgumentTypeError(f"expected {what}, got {n} (pass e.g. 8)")
    return n


def positive_int(value: str) -> int:
    """argparse type: an integer > 0."""
    return _int_at_least(value, 1, "a positive integer")


def nonnegative_int(value: str) -> int:
    """argparse type: an integer >= 0."""
    return _int_at_least(value, 0, "an integer >= 0")


def float_in(low: float, high: float = float("inf"), *, low_inclusive: bool = False, example: str = "0.5"):
    """argparse type factory: a finite float in (low, high] ([low, high] with low_inclusive)."""
    if high == float("inf"):
        what = f"a number >= {low:g}" if low_inclusive else ("a positive number" if low == 0 else f"a number > {low:g}")
    else:
        what = f"a number in {'[' if low_inclusive else '('}{low:g}, {high:g}]"

    def parse(value: str) -> float:
        try:
            x = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {value!r} (pass e.g. {example})") from None
        if not ((x >= low if low_inclusive else x > low) and x <= high and x != float("inf")):
            raise argparse.ArgumentTypeError(f"expected {what}, got {value!r} (pass e.g. {example})")
        return x

    return parse


#: argparse type: a finite float > 0.
positive_float = float_in(0.0)


def int_list(value: str) -> list[int]:
    """argparse type: comma-separated positive integers, e.g. 256,512,1024."""
    out = []
    for part in value.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            n = int(part)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{part!r} is not an integer: pass comma-separated positive integers, e.g. 256,512,1024") from None
        if n <= 0:
            raise argparse.ArgumentTypeError(
                f"lengths must be positive, got {n}: pass comma-separated positive integers, e.g. 256,512,1024")
        out.append(n)
    if not out:
        raise argparse.ArgumentTypeError("empty list: pass comma-separated positive integers, e.g. 256,512,1024")
    return out


def utf8_text(value: str) -> str:
    """argparse type: text that is valid UTF-8 (a command-line argument that is not arrives with
    surrogate escapes, which cannot be encoded)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raw = value.encode("utf-8", "surrogateescape")
        pos = len(value[:exc.start].encode("utf-8", "surrogateescape"))
        raise argparse.ArgumentTypeError(f"not valid UTF-8 text (byte 0x{raw[pos]:02x} at byte {pos}): pass UTF-8 "
                                         "text") from None
    return value


def output_folder(value: str) -> str:
    """argparse type for --out: a folder, or a path where one can be created (not an existing file,
    not under one)."""
    try:
        check_output_folder("", value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def add_common_options(parser: argparse.ArgumentParser, *, device: bool = True, dtype: bool = True, seed: bool = True,
                       out: bool = True, default_dtype: str = "float32") -> None:
    """Adds the options most commands share: --device, --dtype, --seed, --out."""
    if device:
        parser.add_argument("--device", type=device_arg, default="cpu", metavar="{cpu,cuda,auto}",
                            help="where to run: cpu, cuda (needs a CUDA build and a GPU) or auto (cuda when "
                                 "available, else cpu) (default: %(default)s)")
    if dtype:
        parser.add_argument("--dtype", type=dtype_arg, default=default_dtype, metavar="{float32,bfloat16,float16}",
                            help="floating dtype of the tensors; states always accumulate in float32 "
                                 "(default: %(default)s)")
    if seed:
        parser.add_argument("--seed", type=int, default=0, help="seed for every random draw (default: %(default)s)")
    if out:
        parser.add_argument("--out", metavar="DIR", default=None, type=output_folder,
                            help="output folder for the report (JSON, plots); created if missing "
                                 "(default: ./reports/<command>-<timestamp>)")


def add_command(subparsers, name: str, run, *, help: str, epilog: str | None = None,
                description_tail: str = "") -> argparse.ArgumentParser:
    """The subparser of the command `name`, which runs `run(args) -> int` (set as its `func`). Its --help
    description is run's docstring, then `description_tail` (argparse folds the white space of both into
    one paragraph); `help` is its line in the parent's list, `epilog` what follows the options."""
    description = " ".join(part for part in (inspect.getdoc(run), description_tail) if part)
    parser = subparsers.add_parser(name, help=help, description=description, epilog=epilog)
    parser.set_defaults(func=run)
    return parser
