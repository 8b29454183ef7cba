"""The `linattn` command line: one subcommand per module of this package (COMMANDS).

Each command module defines `add_parser(subparsers)`, which adds its subparser and sets
`func=callable(args) -> int` on it (`parser.set_defaults(func=...)`); a new command is a new module
and a name in COMMANDS. Commands stay thin: their logic lives in the library. Shared options and
argument types come from `linattn.cli.args`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch

from . import bench, demo, eval, generate, linearize, train

__all__ = ["COMMANDS", "build_parser", "main"]

#: the subcommands, in the order of `linattn --help`
COMMANDS = (bench, demo, eval, generate, linearize, train)


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with one subcommand per module of COMMANDS."""
    parser = argparse.ArgumentParser(
        prog="linattn",
        description="Linear attention for PyTorch: benchmarks, training, evaluation and demos.",
    )
    from .. import __version__

    parser.add_argument("--version", action="version", version=f"linattn {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in COMMANDS:
        module.add_parser(sub)
    return parser


#: Exit statuses of the failures `main` turns into one line (user mistakes exit 2, as argparse does).
EXIT_USAGE, EXIT_OUT_OF_MEMORY, EXIT_BROKEN_PIPE = 2, 1, 141  # 141 = 128 + SIGPIPE, what a shell reports


def _out_of_memory(exc: BaseException) -> bool:
    if isinstance(exc, MemoryError):
        return True
    oom = tuple(t for t in (getattr(torch, "OutOfMemoryError", None), getattr(torch.cuda, "OutOfMemoryError", None))
                if t is not None)
    text = str(exc).lower()
    return isinstance(exc, oom) or (isinstance(exc, RuntimeError) and ("out of memory" in text or
                                                                       "can't allocate memory" in text))


def _silence_stdout() -> None:
    """Points stdout at /dev/null so that the interpreter's last flush of a closed pipe stays quiet."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `linattn` console script; returns the exit status.

    What a user's mistake or the machine causes ends as one line on stderr and a non-zero status,
    never a traceback: a path that cannot be written or read (an --out naming a file, a missing
    file, no permission), the reader of stdout going away (`linattn generate ... | head -c 10`),
    running out of memory. Commands report their own errors the same way."""
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.error(f"command {args.command!r} needs a subcommand; see linattn {args.command} --help")
    name = " ".join(x for x in (args.command, getattr(args, "bench_command", None)) if x)

    def fail(status: int, message: str) -> int:
        with contextlib.suppress(OSError, ValueError):
            print(f"linattn {name}: error: {message}", file=sys.stderr)
        return status

    try:
        return int(func(args) or 0)
    except BrokenPipeError:
        _silence_stdout()
        return fail(EXIT_BROKEN_PIPE, "the output was closed by its reader (broken pipe); stopped")
    except (FileExistsError, NotADirectoryError, IsADirectoryError, PermissionError, FileNotFoundError) as exc:
        return fail(EXIT_USAGE, f"{exc.strerror}: {exc.filename}" if exc.strerror and exc.filename else str(exc))
    except (MemoryError, RuntimeError) as exc:
        if not _out_of_memory(exc):
            raise
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return fail(EXIT_OUT_OF_MEMORY, f"out of memory ({first}); use smaller sizes (batch, lengths, model) "
                                        "or free memory")
