"""The `linattn` CLI: command discovery, --help everywhere, argparse errors that say what to pass."""

import argparse
import sys

import pytest
import torch

import types

from linattn import cli
from linattn.cli import args as cli_args
from linattn.cli import app as cli_main


def _command_paths(parser, prefix=()):
    """Every (sub)command path of the parser, e.g. ("bench",), ("bench", "ops")."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield (*prefix, name)
                yield from _command_paths(sub, (*prefix, name))


def _run(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    out = capsys.readouterr()
    return exc.value.code, out.out, out.err


def test_top_level_help(capsys):
    code, out, _ = _run(["--help"], capsys)
    assert code == 0
    assert "bench" in out and "usage: linattn" in out


def test_every_subcommand_has_help(capsys):
    paths = list(_command_paths(cli_main.build_parser()))
    assert ("bench", "ops") in paths and ("bench", "decode") in paths
    for path in paths:
        code, out, _ = _run([*path, "--help"], capsys)
        assert code == 0, path
        assert "usage: linattn " + " ".join(path) in out


def test_missing_command_is_an_error(capsys):
    code, _, err = _run([], capsys)
    assert code == 2 and "COMMAND" in err
    code, _, err = _run(["bench"], capsys)
    assert code == 2 and "BENCHMARK" in err


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["bench", "ops", "--lengths=-5"], "e.g. 256,512,1024"),
        (["bench", "ops", "--lengths", "64,abc"], "comma-separated positive integers"),
        (["bench", "decode", "--contexts", "0"], "e.g. 256,512,1024"),
        (["bench", "ops", "--dtype", "float64"], "pass one of float32, bfloat16, float16"),
        (["bench", "ops", "--device", "tpu"], "pass one of cpu, cuda, auto"),
        (["bench", "ops", "--min-run-time", "-1"], "positive number"),
        (["bench", "ops", "--heads", "0"], "positive integer"),
    ],
)
def test_bad_arguments_say_what_to_pass(argv, expected, capsys):
    code, _, err = _run(argv, capsys)
    assert code == 2
    assert expected in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_suggests_cpu_or_auto(capsys):
    code, _, err = _run(["bench", "decode", "--device", "cuda"], capsys)
    assert code == 2
    assert "--device cpu or --device auto" in err


def test_dtype_aliases_and_auto_device():
    assert cli_args.dtype_arg("bf16") == "bfloat16"
    assert cli_args.torch_dtype(cli_args.dtype_arg("fp32")) is torch.float32
    assert cli_args.resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")


def _add_command(monkeypatch, source: str) -> None:
    """Adds a command module built from `source` to linattn.cli.app.COMMANDS for one test."""
    module = types.ModuleType("zz_command")
    exec(source, module.__dict__)
    monkeypatch.setattr(cli_main, "COMMANDS", (*cli_main.COMMANDS, module))


def test_a_module_in_commands_becomes_a_command(monkeypatch, capsys):
    """A module with add_parser(subparsers), named in linattn.cli.app.COMMANDS, is a command."""
    _add_command(monkeypatch,
                 "def add_parser(subparsers):\n"
                 "    p = subparsers.add_parser('zz-hello', help='say hello')\n"
                 "    p.add_argument('--name', default='world')\n"
                 "    p.set_defaults(func=lambda args: print('hello', args.name) or 3)\n")
    assert cli.main(["zz-hello", "--name", "linattn"]) == 3
    assert "hello linattn" in capsys.readouterr().out


# ---- user mistakes and the machine: one line on stderr and a non-zero status, no traceback (issue 13, item 8)


def _status(argv, capsys):
    """(exit status, stdout, stderr) whether main returns or argparse exits."""
    try:
        code = cli.main(argv)
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err



@pytest.mark.parametrize("argv", [
    ["train", "--steps", "1"], ["demo", "--quick"], ["bench", "decode", "--contexts", "8"],
    ["eval", "--steps", "1"],
])
def test_out_naming_a_file_is_refused_before_any_work(tmp_path, capsys, argv):
    afile = tmp_path / "afile"
    afile.write_text("keep me")
    for out, what in ((afile, "is a file, not a folder"), (afile / "sub", "lies under")):
        code, _, err = _status([*argv, "--out", str(out)], capsys)
        assert code == 2 and what in err and str(out) in err and "Traceback" not in err
        assert len(err.strip().splitlines()[-1]) > 0
    assert afile.read_text() == "keep me"


def test_a_prompt_that_is_not_utf8_is_refused(tmp_path, capsys):
    bad = b"ab\xff".decode("utf-8", "surrogateescape")  # how Python hands over such an argument
    for argv in (["generate", "--checkpoint", str(tmp_path), "--prompt", bad], ["demo", "--quick", "--prompt", bad]):
        code, _, err = _status(argv, capsys)
        assert code == 2 and "--prompt: not valid UTF-8 text (byte 0xff at byte 2)" in err


def _failing_command(monkeypatch, raise_line: str):
    _add_command(monkeypatch,
                 "def add_parser(subparsers):\n"
                 "    p = subparsers.add_parser('zz-fail')\n"
                 f"    p.set_defaults(func=lambda args: {raise_line})\n")


@pytest.mark.parametrize("raise_line, status, message", [
    ("(_ for _ in ()).throw(PermissionError(13, 'Permission denied', '/srv/x'))", 2, "Permission denied: /srv/x"),
    ("(_ for _ in ()).throw(MemoryError())", 1, "out of memory (MemoryError"),
    ("(_ for _ in ()).throw(RuntimeError('CUDA out of memory. Tried to allocate 2.00 GiB'))", 1,
     "out of memory (CUDA out of memory. Tried to allocate 2.00 GiB); use smaller sizes"),
])
def test_machine_errors_are_one_line(tmp_path, monkeypatch, capsys, raise_line, status, message):
    _failing_command(monkeypatch, raise_line)
    assert cli.main(["zz-fail"]) == status
    err = capsys.readouterr().err
    assert err.startswith("linattn zz-fail: error: ") and message in err and len(err.strip().splitlines()) == 1


def test_other_runtime_errors_are_not_hidden(tmp_path, monkeypatch):
    """A bug is not a user mistake: it keeps its traceback."""
    _failing_command(monkeypatch, "(_ for _ in ()).throw(RuntimeError('shape mismatch'))")
    with pytest.raises(RuntimeError, match="shape mismatch"):
        cli.main(["zz-fail"])


def test_a_real_allocation_failure_is_one_line(tmp_path, capsys):
    """The KV cache of 2^32 tokens (8 TiB) cannot be allocated: torch raises at once."""
    code, _, err = _status(["bench", "decode", "--contexts", str(2**32), "--min-run-time", "0.01",
                         "--out", str(tmp_path)], capsys)
    assert code == 1 and "error: out of memory (" in err and "Traceback" not in err


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX pipes")
def test_generate_into_a_closed_pipe_ends_quietly(tmp_path):
    import os
    import subprocess

    from linattn.models import LinearTransformerLM, ModelConfig

    LinearTransformerLM(ModelConfig(d_model=16, n_layers=1, n_heads=2)).save_pretrained(tmp_path / "m")
    cmd = [sys.executable, "-m", "linattn.cli", "generate", "--checkpoint", str(tmp_path / "m"), "--prompt", "ab",
           "--max-new-tokens", "100000"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ,
                                                                                       "OMP_NUM_THREADS": "1"})
    try:
        assert len(proc.stdout.read(10)) == 10  # like `| head -c 10`
        proc.stdout.close()
        err = proc.stderr.read().decode()
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 141, err
    assert err.strip() == "linattn generate: error: the output was closed by its reader (broken pipe); stopped"
