"""The `linattn` CLI: command discovery, --help everywhere, argparse errors that say what to pass."""

import argparse
import sys

import pytest
import torch

from linattn import cli, commands


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
    paths = list(_command_paths(cli.build_parser()))
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
    assert cli.dtype_arg("bf16") == "bfloat16"
    assert cli.torch_dtype(cli.dtype_arg("fp32")) is torch.float32
    assert cli.resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")


def test_commands_are_discovered_from_the_package(tmp_path, monkeypatch, capsys):
    """A new module in linattn.commands with add_parser(subparsers) becomes a command, nothing else."""
    (tmp_path / "zz_hello.py").write_text(
        "def add_parser(subparsers):\n"
        "    p = subparsers.add_parser('zz-hello', help='say hello')\n"
        "    p.add_argument('--name', default='world')\n"
        "    p.set_defaults(func=lambda args: print('hello', args.name) or 3)\n"
    )
    monkeypatch.setattr(commands, "__path__", [*commands.__path__, str(tmp_path)])
    try:
        assert cli.main(["zz-hello", "--name", "linattn"]) == 3
        assert "hello linattn" in capsys.readouterr().out
    finally:
        sys.modules.pop("linattn.commands.zz_hello", None)
