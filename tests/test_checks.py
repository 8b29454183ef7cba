"""linattn._checks: the generic validators every part uses (messages name the argument, bools are
not ints, bounds open or closed as asked) and the device and dtype names."""

from __future__ import annotations

import math

import pytest
import torch

from linattn._checks import (
    check_bool,
    check_choice,
    check_device,
    check_int,
    check_number,
    check_positive_int,
    resolve_device,
    torch_dtype,
)


@pytest.mark.parametrize("call, message", [
    (lambda: check_int("n", True), "n must be an int, got True"),
    (lambda: check_int("n", 2.0), "n must be an int, got 2.0"),
    (lambda: check_int("n", -1, minimum=0), "n must be an int >= 0, got -1"),
    (lambda: check_int("rank", 2, minimum=0, below=2), r"rank must be an int in \[0, 2\), got 2"),
    (lambda: check_int("k", "3", minimum=1, allow_none=True), "k must be None or an int >= 1, got '3'"),
    (lambda: check_positive_int("heads", 0), "heads must be a positive int, got 0"),
    (lambda: check_positive_int("top_k", False, allow_none=True), "top_k must be a positive int or None, got False"),
    (lambda: check_number("lr", 0, minimum=0, low_open=True), "lr must be a positive number, got 0"),
    (lambda: check_number("lr", math.inf, minimum=0, low_open=True), "lr must be a positive number, got inf"),
    (lambda: check_number("p", math.nan, minimum=0, maximum=1), r"p must be a number in \[0, 1\], got nan"),
    (lambda: check_number("dropout", 1, minimum=0, maximum=1, high_open=True), r"dropout must be a number in \[0, 1\)"),
    (lambda: check_number("wd", -0.1, minimum=0), "wd must be a number >= 0, got -0.1"),
    (lambda: check_number("x", True), "x must be a number, got True"),
    (lambda: check_bool("bias", 1), "bias must be a bool, got int 1"),
    (lambda: check_choice("norm", "batch", ("rmsnorm", "layernorm")), r"norm must be one of \('rmsnorm', 'layernorm'\)"),
    (lambda: check_device("device", "gpu0"), "device must be 'cpu', 'cuda', 'cuda:N' or 'auto', got 'gpu0'"),
    (lambda: check_device("device", ""), "device must be a string"),
    (lambda: torch_dtype("int8"), "dtype must be one of"),
])
def test_bad_values_get_a_message_naming_the_argument(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_good_values_pass():
    check_int("n", 0, minimum=0)
    check_int("rank", 1, minimum=0, below=2)
    check_int("seed", -5)
    check_positive_int("k", None, allow_none=True)
    check_number("p", 1, minimum=0, maximum=1)
    check_number("eps", 1e-8, minimum=0, low_open=True)
    check_number("t", None, allow_none=True)
    check_bool("flag", False)
    check_device("device", "auto")
    check_device("device", "cuda:1")
    assert torch_dtype("bfloat16") is torch.bfloat16


def test_error_type_can_be_a_type_error():
    with pytest.raises(TypeError, match="causal must be a bool"):
        check_bool("causal", "yes", error=TypeError)
    with pytest.raises(TypeError, match="seed must be an int"):
        check_int("seed", 1.5, error=TypeError)


def test_resolve_device():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            resolve_device("cuda")
    else:
        assert resolve_device("cuda", local_rank=torch.cuda.device_count()) == torch.device("cuda", 0)


def test_check_output_folder(tmp_path):
    from linattn._checks import check_output_folder

    check_output_folder("out_dir", tmp_path)  # an existing folder
    check_output_folder("out_dir", tmp_path / "new" / "deeper")  # created later
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match=r"^out_dir '.*f' is a file, not a folder"):
        check_output_folder("out_dir", tmp_path / "f")
    with pytest.raises(ValueError, match=r"out_dir '.*f/a/b' lies under '.*f', which is a file"):
        check_output_folder("out_dir", tmp_path / "f" / "a" / "b")
