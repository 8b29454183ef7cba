"""The one-token steps with inplace=True (decoding without a new state tensor per token): the delta
family (no gate, one decay per head, one per key channel), gated linear attention (scalar and vector
gates, with and without the normalizer) and linear attention give exactly the out-of-place step's
output and state, written into the given state; the fused CPU steps update it themselves
(linattn_cpu::delta_step_, gated_step_, step_), the other paths (a non-contiguous state, LINATTN_NATIVE=0,
a block of T > 1 tokens) copy into it; no state or a gradient wanted is refused."""

from __future__ import annotations

import pytest
import torch

from linattn.ops import delta_rule_step, gated_linear_attention_step, linear_attention_step, native
from linattn.ops.kda import kda_step

B, H, D, E = 2, 3, 8, 5


def _inputs(dtype, t=1, seed=0):
    gen = torch.Generator().manual_seed(seed)
    sdt = torch.float64 if dtype == torch.float64 else torch.float32
    q, k = (torch.randn(B, H, t, D, generator=gen, dtype=torch.float64).to(dtype) for _ in range(2))
    v = torch.randn(B, H, t, E, generator=gen, dtype=torch.float64).to(dtype)
    beta = torch.rand(B, H, t, generator=gen, dtype=torch.float64).to(sdt)
    g = -torch.rand(B, H, t, generator=gen, dtype=torch.float64).to(sdt)
    gc = -torch.rand(B, H, t, D, generator=gen, dtype=torch.float64).to(sdt)
    S = torch.randn(B, H, D, E, generator=gen, dtype=torch.float64).to(sdt)
    z = torch.rand(B, H, D, generator=gen, dtype=torch.float64).to(sdt) + 1
    return q, k, v, beta, g, gc, S, z


def _cases(dtype, t=1):
    """(name, step(state, inplace) -> (o, new_state), the state)."""
    q, k, v, beta, g, gc, S, z = _inputs(dtype, t)
    out = []
    for name, gate in (("DeltaNet", None), ("Gated DeltaNet", g), ("KDA", gc)):
        out.append((name, lambda s, inplace, gate=gate: delta_rule_step(s, q, k, v, beta, g=gate, qk_l2norm=True,
                                                                         scale=0.5, inplace=inplace), S))
    out.append(("kda_step", lambda s, inplace: kda_step(s, q, k, v, beta, gc, qk_l2norm=True, inplace=inplace), S))
    if dtype != torch.bfloat16 and t == 1:  # the gated and linear steps widen bf16 on a float32 state only
        for gname, gate in (("scalar", g), ("vector", gc)):
            out.append((f"gated {gname}", lambda s, inplace, gate=gate: gated_linear_attention_step(
                s, q, k, v, gate, inplace=inplace), S))
            out.append((f"gated {gname} normalized", lambda s, inplace, gate=gate: gated_linear_attention_step(
                s, q, k, v, gate, normalize=True, inplace=inplace), (S, z)))
        out.append(("linear", lambda s, inplace: linear_attention_step(s, q, k, v, inplace=inplace), (S, z)))
        out.append(("linear unnormalized", lambda s, inplace: linear_attention_step(s, q, k, v, normalize=False,
                                                                                     inplace=inplace), (S, z)))
    return out


def _clone(state):
    return tuple(x.clone() for x in state) if isinstance(state, tuple) else state.clone()


def _leaves(state):
    return state if isinstance(state, tuple) else (state,)


def _check(name, step, state, *, transform=lambda x: x):
    with torch.no_grad():
        ref_o, ref_state = step(_clone(state), False)
        mine = transform(_clone(state))
        o, new = step(mine, True)
    assert new is mine, name
    assert torch.equal(o, ref_o), name
    for a, b in zip(_leaves(new), _leaves(ref_state)):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_inplace_equals_the_new_state(dtype):
    for name, step, state in _cases(dtype):
        _check(name, step, state)


@pytest.mark.skipif(not native.available(), reason="the fused CPU kernels could not be built here")
def test_the_fused_steps_update_the_state_themselves():
    """The in-place kernels run, and no (B, H, D, E) tensor is allocated by the step."""
    for name, step, state in _cases(torch.float32):
        mine = _clone(state)
        with torch.no_grad(), torch.profiler.profile() as prof:
            step(mine, True)
        names = {e.key for e in prof.key_averages()}
        assert names & {"linattn_cpu::delta_step_", "linattn_cpu::gated_step_", "linattn_cpu::step_"}, (name, names)
        assert not names & {"linattn_cpu::delta_step", "linattn_cpu::gated_step", "linattn_cpu::step", "aten::copy_",
                            "aten::clone", "aten::empty_like"}, (name, names)


def test_other_paths_copy_into_the_state(monkeypatch):
    """A non-contiguous state, the torch ops (LINATTN_NATIVE=0) and a block of T > 1 tokens."""
    def transposed(state):  # the same values, laid out (B, H, E, D) underneath
        return tuple(x.mT.contiguous().mT if x.dim() == 4 else x for x in _leaves(state)) if isinstance(
            state, tuple) else state.mT.contiguous().mT

    for name, step, state in _cases(torch.float32):
        _check(name, step, state, transform=transposed)
    for name, step, state in _cases(torch.float32, t=3):
        _check(f"{name}, T = 3", step, state)
    monkeypatch.setenv("LINATTN_NATIVE", "0")
    for name, step, state in _cases(torch.float64):
        _check(f"{name}, torch ops", step, state)


def test_inplace_refuses_no_state_and_gradients():
    q, k, v, beta, g, gc, S, z = _inputs(torch.float32)
    with pytest.raises(ValueError, match="needs a state"):
        delta_rule_step(None, q, k, v, beta, inplace=True)
    with pytest.raises(ValueError, match="without autograd"):
        delta_rule_step(S, q.requires_grad_(), k, v, beta, inplace=True)
    with pytest.raises(ValueError, match="without autograd"):
        gated_linear_attention_step(S.clone().requires_grad_(), k, k, v, g, inplace=True)
    with pytest.raises(ValueError, match="needs a state"):
        linear_attention_step(None, k, k, v, inplace=True)


@pytest.mark.skipif(not native.available(), reason="the fused CPU kernels could not be built here")
def test_the_inplace_kernels_want_a_contiguous_state():
    q, k, v, beta, g, gc, S, z = _inputs(torch.float32)
    St = S.mT.contiguous().mT
    with pytest.raises(RuntimeError, match="delta_step_: the state must be contiguous"):
        torch.ops.linattn_cpu.delta_step_(St, q, k, v, beta, g, 1.0, False)
    with pytest.raises(RuntimeError, match="gated_step_: the state must be contiguous"):
        torch.ops.linattn_cpu.gated_step_(St, None, q, k, v, g, 0, 1e-6)
    with pytest.raises(RuntimeError, match="step_: the state must be contiguous"):
        torch.ops.linattn_cpu.step_(St, z, q, k, v, 0, True, 1e-6, None, None, H)
