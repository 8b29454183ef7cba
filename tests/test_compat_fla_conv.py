"""linattn.compat.fla's causal_conv1d_fn / causal_conv1d_update (Dao's causal-conv1d signatures)
against transformers' torch fallbacks of Qwen3.5, which compute in the weight's dtype: float64 here."""

import pytest
import torch

from linattn.compat import fla as C

from .compat_fla_peers import F64, close, leaves, qwen35


def _conv_inputs(b=2, c=6, n=11, w=4, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(b, c, n, generator=gen, dtype=dtype), torch.randn(c, w, generator=gen, dtype=dtype),
            torch.randn(c, generator=gen, dtype=dtype))


@pytest.mark.parametrize("activation", [None, "silu", "swish"])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("n,w", [(11, 4), (2, 4), (7, 1)])
def test_causal_conv1d_fn_equals_transformers(activation, with_bias, n, w):
    ref = qwen35("causal_conv1d_fn")
    x, weight, bias = _conv_inputs(n=n, w=w)
    bias = bias if with_bias else None
    out = C.causal_conv1d_fn(x, weight, bias, activation=activation)
    expect = ref(x, weight, bias, activation="silu" if activation == "swish" else activation)
    assert out.shape == x.shape and out.dtype == x.dtype
    close(out, expect, F64, "out")


def test_causal_conv1d_fn_gradients_equal_transformers():
    ref = qwen35("causal_conv1d_fn")
    x, weight, bias = _conv_inputs(n=9, seed=1)
    a, b = leaves(dict(x=x, w=weight, b=bias)), leaves(dict(x=x, w=weight, b=bias))
    gen = torch.Generator().manual_seed(2)
    dy = torch.randn(x.shape, generator=gen, dtype=torch.float64)
    (ref(a["x"], a["w"], a["b"], activation="silu") * dy).sum().backward()
    (C.causal_conv1d_fn(b["x"], b["w"], b["b"], activation="silu") * dy).sum().backward()
    for n in ("x", "w", "b"):
        close(b[n].grad, a[n].grad, F64, f"d{n}")


def test_initial_and_final_states_equal_transformers_update():
    """initial_states are the inputs before x: transformers' update over all of x from that state
    gives the same outputs, and its new state (W−1 long) is the final state."""
    ref = qwen35("causal_conv1d_update")
    x, weight, bias = _conv_inputs(n=10, seed=3)
    init = torch.randn(2, 6, 3, dtype=torch.float64)
    state = init.clone()
    expect = ref(x, state, weight, bias, "silu")
    out, final = C.causal_conv1d_fn(x, weight, bias, initial_states=init, return_final_states=True, activation="silu")
    close(out, expect, F64, "out")
    close(final, state, F64, "final states")
    buf = torch.full((2, 6, 3), float("nan"), dtype=torch.float64)
    _, into = C.causal_conv1d_fn(x, weight, bias, initial_states=init, return_final_states=True,
                                 final_states_out=buf, activation="silu")
    assert into is buf
    close(buf, state, F64, "final_states_out")
    _, short = C.causal_conv1d_fn(x[:, :, :2], weight, return_final_states=True)
    close(short, torch.cat((torch.zeros(2, 6, 1, dtype=torch.float64), x[:, :, :2]), 2), F64,
          "final states of a sequence shorter than W−1: zeros before it")


@pytest.mark.parametrize("state_len", [3, 5])
@pytest.mark.parametrize("n", [None, 1, 4])
def test_causal_conv1d_update_equals_transformers(state_len, n):
    """x (B, C) (n None) or (B, C, n); conv_state updated in place, as transformers' fallback does."""
    ref = qwen35("causal_conv1d_update")
    x, weight, bias = _conv_inputs(n=n or 1, seed=4)
    x = x[:, :, 0] if n is None else x
    state = torch.randn(2, 6, state_len, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    mine, theirs = state.clone(), state.clone()
    out = C.causal_conv1d_update(x, mine, weight, bias, "silu")
    expect = ref(x.unsqueeze(-1) if n is None else x, theirs, weight, bias, "silu")
    expect = expect[:, :, 0] if n is None else expect
    assert out.shape == x.shape
    close(out, expect, F64, "out")
    close(mine, theirs, F64, "conv_state")


def test_prefill_then_steps_equal_one_call():
    """fn over a prompt (final states) then update token by token = fn over everything."""
    x, weight, bias = _conv_inputs(n=12, seed=6)
    whole = C.causal_conv1d_fn(x, weight, bias, activation="silu")
    head, state = C.causal_conv1d_fn(x[:, :, :7], weight, bias, return_final_states=True, activation="silu")
    steps = [C.causal_conv1d_update(x[:, :, t], state, weight, bias, "silu") for t in range(7, 12)]
    close(torch.cat((head, torch.stack(steps, -1)), -1), whole, F64, "prefill + steps")


def test_bf16_input_float32_weight_like_transformers():
    """bf16 activations with float32 weights: computed in float32, returned in bf16."""
    ref = qwen35("causal_conv1d_fn")
    x, weight, bias = _conv_inputs(seed=7, dtype=torch.float32)
    xb = x.bfloat16()
    out = C.causal_conv1d_fn(xb, weight, bias, activation="silu")
    assert out.dtype is torch.bfloat16
    close(out, ref(xb, weight, bias, activation="silu"), 2 ** -8, "out (one bf16 rounding apart at most)")
