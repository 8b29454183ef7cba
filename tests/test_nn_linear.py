"""`linattn.nn.linear.Linear`: the tiled-gemm nn.Linear against F.linear in float64 (outputs and the
gradients of x, W and b) for both weight layouts, the fallbacks, second order and forward mode."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from linattn.nn import linear as L
from linattn.nn.base import column_major
from linattn.ops import native


def _case(rows, k, n, bias, column, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, rows, k, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    lin = L.Linear(k, n, bias=bias).to(dtype)
    if column:
        column_major(lin)
    return x, lin


def _grads(fn, x, lin):
    y = fn(x)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=y.dtype)
    params = [x, lin.weight] + ([lin.bias] if lin.bias is not None else [])
    return (y, *torch.autograd.grad(y, params, dy))


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 70), k=st.integers(1, 300), n=st.integers(1, 90), bias=st.booleans(), column=st.booleans(),
       seed=st.integers(0, 50))
def test_linear_matches_f_linear_in_float64(rows, k, n, bias, column, seed):
    x, lin = _case(rows, k, n, bias, column, seed=seed)
    got = _grads(lin, x, lin)
    want = _grads(lambda t: F.linear(t, lin.weight, lin.bias), x, lin)
    for a, b in zip(got, want):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.skipif(not (native.available() and torch.ops.linattn_cpu.uses_tile_gemm()),
                    reason="the tiled gemm does not run here")
@pytest.mark.parametrize("column", [False, True])
def test_linear_takes_the_tiles_from_min_rows_on(column, monkeypatch):
    calls = []
    real = L._TiledLinear.apply
    monkeypatch.setattr(L._TiledLinear, "apply", lambda *a: calls.append(1) or real(*a))
    x, lin = _case(L.MIN_ROWS, 64, 48, True, column)
    lin(x[:1])
    assert calls == [1]
    lin(x[:1, : L.MIN_ROWS - 1])  # decoding's few rows: F.linear
    x32, lin32 = _case(L.MIN_ROWS, 64, 48, True, column, dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast: F.linear, in bf16
        assert lin32(x32).dtype == torch.bfloat16
    assert calls == [1]
    # the weight's gradient keeps the parameter's layout (no copy by autograd)
    lin(x).sum().backward()
    assert lin.weight.grad.stride() == lin.weight.stride()


@pytest.mark.skipif(not (native.available() and torch.ops.linattn_cpu.uses_tile_gemm()),
                    reason="the tiled gemm does not run here")
@pytest.mark.parametrize("choice", ["tiles", "blas"])
def test_float32_follows_the_linear_gemm_choice_float64_keeps_the_tiles(choice, monkeypatch):
    calls = []
    real = L._TiledLinear.apply
    monkeypatch.setattr(L._TiledLinear, "apply", lambda *a: calls.append(a[0].dtype) or real(*a))
    monkeypatch.setattr(native, "linear_gemm", lambda: choice)
    x64, lin64 = _case(L.MIN_ROWS, 64, 48, True, False)
    x32, lin32 = _case(L.MIN_ROWS, 64, 48, True, False, dtype=torch.float32)
    y32 = lin32(x32)
    lin64(x64)
    assert calls == ([torch.float32] if choice == "tiles" else []) + [torch.float64]
    torch.testing.assert_close(y32, F.linear(x32, lin32.weight, lin32.bias), rtol=1e-5, atol=1e-5)


def test_pick_linear_gemm_wants_the_tiles_clearly_faster():
    assert native.pick_linear_gemm(1.0, native.LINEAR_TILES_MARGIN) == "tiles"
    assert native.pick_linear_gemm(1.0, 2.0) == "tiles"
    assert native.pick_linear_gemm(1.0, 0.99 * native.LINEAR_TILES_MARGIN) == "blas"
    assert native.pick_linear_gemm(1.0, 0.5) == "blas"


def test_linear_gemm_is_decided_once_and_can_be_forced(monkeypatch):
    timed = []
    monkeypatch.setattr(native, "_time_linear_products", lambda: timed.append(1) or (1.0, 3.0))
    monkeypatch.setattr(native, "tile_gemm", lambda: True)
    monkeypatch.delenv("LINATTN_LINEAR_GEMM", raising=False)
    state = dict(native._state)
    state.pop("linear", None)
    monkeypatch.setattr(native, "_state", state)
    assert native.linear_gemm() == "tiles" and native.linear_gemm() == "tiles" and timed == [1]
    for forced in ("blas", "tiles"):
        state.pop("linear")
        monkeypatch.setenv("LINATTN_LINEAR_GEMM", forced)
        assert native.linear_gemm() == forced and timed == [1]
    state.pop("linear")
    monkeypatch.setenv("LINATTN_LINEAR_GEMM", "mkl")
    with pytest.raises(ValueError, match="LINATTN_LINEAR_GEMM must be one of tiles, blas, got 'mkl'"):
        native.linear_gemm()
    monkeypatch.setattr(native, "tile_gemm", lambda: False)  # no tiles here: the BLAS, whatever is asked
    monkeypatch.setenv("LINATTN_LINEAR_GEMM", "tiles")
    assert native.linear_gemm() == "blas"


def test_linear_float32_matches_float64_reference(monkeypatch):
    monkeypatch.setattr(native, "linear_gemm", lambda: "tiles")  # the tiles' float32 path wherever they run
    x, lin = _case(40, 200, 70, True, False, dtype=torch.float32)
    y = lin(x)
    ref = F.linear(x.double(), lin.weight.double(), lin.bias.double())
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-4)


def test_linear_second_order_and_forward_mode():
    x, lin = _case(32, 20, 12, True, True)
    (gx,) = torch.autograd.grad((lin(x) ** 2).sum(), x, create_graph=True)
    (hx,) = torch.autograd.grad(gx.sum(), x)
    x2 = x.detach().requires_grad_()
    (gx2,) = torch.autograd.grad((F.linear(x2, lin.weight, lin.bias) ** 2).sum(), x2, create_graph=True)
    (hx2,) = torch.autograd.grad(gx2.sum(), x2)
    torch.testing.assert_close(hx, hx2)
    tangent = torch.randn_like(x)
    _, jvp = torch.func.jvp(lambda t: lin(t), (x.detach(),), (tangent,))
    torch.testing.assert_close(jvp, F.linear(tangent, lin.weight))


def test_linear_is_a_drop_in_nn_linear():
    lin = L.Linear(5, 3)
    ref = nn.Linear(5, 3)
    assert isinstance(lin, nn.Linear) and lin.state_dict().keys() == ref.state_dict().keys()
    ref.load_state_dict(lin.state_dict())
    x = torch.randn(4, 5)
    torch.testing.assert_close(lin(x), ref(x))


@pytest.mark.parametrize("k, n", [(0, 5), (5, 0)])
def test_linear_empty_weight_falls_back(k, n):
    lin = L.Linear(k, n)
    x = torch.randn(3, 20, k)
    torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias))
