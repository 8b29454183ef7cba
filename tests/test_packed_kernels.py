"""Packed sequences inside the fused CPU kernels (design §17, csrc/rows.h): a call with cu_seqlens that the
kernels take is one kernel call for the whole packed row, each (sequence, head) a row of the kernel from
its own initial state. It must equal the N separate calls — outputs, final states and every gradient,
float64 — for every family (linear, gated with scalar and per-feature gates, DeltaNet, Gated DeltaNet,
KDA), with sequences of length 0 and 1, sequences longer than the kernels' saved-state blocks, and the
same on the torch-op path (tests/test_packed_ops.py holds the per-length path to the same standard)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from linattn.nn.feature_maps import make_feature_map
from linattn.ops import delta_rule, gated_linear_attention, linear_attention, native, packed
from linattn.ops import native as native_module
from linattn.ops.delta import fused as delta_fused
from linattn.ops.gated import fused as gated_fused

from .test_packed_ops import _one_thread, compare, op_path

SHARED_FIXTURES = (_one_thread, op_path)  # test_packed_ops's: one thread (autouse), the CPU path
DT = torch.float64
FAMILIES = ["linear", "linear-unnormalized", "gated-scalar", "gated-vector", "gated-normalized", "deltanet",
            "gated-deltanet", "kda"]


@pytest.fixture
def path(op_path, monkeypatch):
    """The fused kernels given cu_seqlens ("kernel"), or the torch-op Functions one length at a time
    ("torch ops", LINATTN_NATIVE=0)."""
    monkeypatch.setattr(packed, "IN_KERNELS", True)
    return "kernel" if op_path == "fused" else op_path


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts the fused chunked forwards called, and those given cu_seqlens: {"all": n, "packed": n}."""
    seen = {"all": 0, "packed": 0}

    def counting(fn):
        def wrapped(*args, **kwargs):
            seen["all"] += 1
            seen["packed"] += kwargs.get("cu_seqlens") is not None
            return fn(*args, **kwargs)
        return wrapped

    for module in (native_module, gated_fused, delta_fused):
        monkeypatch.setattr(module, "chunked", counting(module.chunked))
    return seen


def family_call(family: str, h: int, t: int, n: int, d: int, e: int, seed: int, chunk: int, with_state: bool):
    """(call(inputs, state, cu) -> (o, final state), inputs, initial state or None) for one family."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=DT)

    q, k, v = randn(1, h, t, d), randn(1, h, t, d), randn(1, h, t, e)
    x = {"q": q, "k": k, "v": v}
    fm = make_feature_map("elu", d)
    if family.startswith("linear"):
        normalize = family == "linear"
        state = (randn(n, h, d, e), torch.rand(n, h, d, generator=gen, dtype=DT) + 1) if with_state else None

        def call(x, s, cu):
            return linear_attention(x["q"], x["k"], x["v"], causal=True, feature_map=fm, normalize=normalize,
                                    initial_state=s, return_state=True, chunk_size=chunk, cu_seqlens=cu)
        return call, x, state
    if family.startswith("gated"):
        if family != "gated-deltanet":
            normalize = family == "gated-normalized"
            shape = (1, h, t, d) if family == "gated-vector" else (1, h, t)
            x["g"] = -torch.rand(*shape, generator=gen, dtype=DT) * 0.7
            kv0 = randn(n, h, d, e)
            state = None if not with_state else (kv0, torch.rand(n, h, d, generator=gen, dtype=DT) + 1) \
                if normalize else kv0

            def call(x, s, cu):
                return gated_linear_attention(x["q"], x["k"], x["v"], x["g"], feature_map=fm, normalize=normalize,
                                              initial_state=s, return_state=True, chunk_size=chunk, cu_seqlens=cu)
            return call, x, state
    x["beta"] = torch.rand(1, h, t, generator=gen, dtype=DT) * 0.98 + 0.01
    if family == "gated-deltanet":
        x["g"] = torch.nn.functional.logsigmoid(randn(1, h, t) + 2)
    elif family == "kda":
        x["g"] = torch.nn.functional.logsigmoid(randn(1, h, t, d) + 2)
    state = randn(n, h, d, e) if with_state else None

    def call(x, s, cu):
        return delta_rule(x["q"], x["k"], x["v"], x["beta"], g=x.get("g"), scale=0.7, qk_l2norm=True,
                          initial_state=s, return_state=True, chunk_size=chunk, cu_seqlens=cu)
    return call, x, state


@settings(max_examples=24, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lengths=st.lists(st.integers(0, 13), min_size=1, max_size=6).filter(lambda ls: sum(ls) > 0),
       chunk=st.sampled_from([1, 2, 4, 5, 16]), family=st.sampled_from(FAMILIES), with_state=st.booleans(),
       seed=st.integers(0, 2**16))
def test_packed_kernel_equals_separate_calls(path, kernel_calls, lengths, chunk, family, with_state, seed):
    call, x, state = family_call(family, 2, sum(lengths), len(lengths), 4, 3, seed, chunk, with_state)
    packed_calls = kernel_calls["packed"]
    compare(call, x, state, lengths)
    if path == "kernel":  # the packed call was one kernel call with cu_seqlens
        assert kernel_calls["packed"] == packed_calls + 1


@pytest.mark.parametrize("family", FAMILIES)
def test_sequences_beyond_the_saved_blocks(path, family):
    """Sequences longer than the kernels' saved-state blocks (512 tokens for linear and gated, 256 for the
    delta family), between sequences of length 0 and 1: the backward walks several blocks per row."""
    lengths = [0, 530, 1, 270, 0, 3]
    call, x, state = family_call(family, 2, sum(lengths), len(lengths), 4, 3, 7, 16, True)
    compare(call, x, state, lengths)


def test_one_kernel_call_per_packed_row(kernel_calls, monkeypatch):
    """Every family's packed call on the fused path is one kernel call with cu_seqlens; with
    IN_KERNELS off it is one call per distinct length (here 3)."""
    if not native.available():
        pytest.skip("the fused CPU kernels could not be built here")
    lengths = [5, 0, 3, 5, 1]
    cu = packed.cu_seqlens_from_lengths(lengths)
    for family in FAMILIES:
        call, x, state = family_call(family, 2, sum(lengths), len(lengths), 4, 3, 1, 4, True)
        before = dict(kernel_calls)
        call(x, state, cu)
        assert (kernel_calls["all"] - before["all"], kernel_calls["packed"] - before["packed"]) == (1, 1), family
        monkeypatch.setattr(packed, "IN_KERNELS", False)
        before = dict(kernel_calls)
        call(x, state, cu)
        assert (kernel_calls["all"] - before["all"], kernel_calls["packed"] - before["packed"]) == (3, 0), family
        monkeypatch.setattr(packed, "IN_KERNELS", True)


@pytest.mark.parametrize("family", FAMILIES)
def test_kernel_and_per_length_paths_agree_in_fp32(family, monkeypatch):
    """fp32 (and bf16 for the families that take it in their kernels): the packed kernel call gives the
    per-length path's numbers up to rounding, forward and backward, two threads."""
    if not native.available():
        pytest.skip("the fused CPU kernels could not be built here")
    torch.set_num_threads(2)
    lengths = [70, 0, 1, 200, 33]
    call, x, state = family_call(family, 4, sum(lengths), len(lengths), 16, 8, 3, 32, True)
    cu = packed.cu_seqlens_from_lengths(lengths)
    results = []
    for in_kernels in (True, False):
        monkeypatch.setattr(packed, "IN_KERNELS", in_kernels)
        xs = {m: y.float().requires_grad_() for m, y in x.items()}
        st_ = None if state is None else tuple(s.float().requires_grad_() for s in state) \
            if isinstance(state, tuple) else state.float().requires_grad_()
        o, S = call(xs, st_, cu)
        parts = list(S) if isinstance(S, tuple) else [S]
        loss = (o * torch.linspace(-1, 1, o.numel()).view_as(o)).sum() + sum(p.sum() for p in parts)
        leaves = list(xs.values()) + (list(st_) if isinstance(st_, tuple) else [st_])
        results.append([o.detach(), *[p.detach() for p in parts], *torch.autograd.grad(loss, leaves)])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=2e-5 * max(1.0, b.abs().max().item()), rtol=0)


@pytest.mark.parametrize("family", ["linear", "gated-scalar", "gated-vector"])
def test_nan_in_one_query_reaches_no_other_sequence(family):
    """A NaN in one query of sequence 1: the forward's final states stay finite (queries do not enter
    them), so the packed kernel runs; the backward meets the NaN and runs the torch ops' exact pass
    sequence by sequence. A loss over the other sequences' outputs gets the gradients of the calls
    without the NaN, finite, and sequence 1's gradients are zero."""
    if not native.available():
        pytest.skip("the fused CPU kernels could not be built here")
    lengths = [6, 6, 5, 6]
    cu = packed.cu_seqlens_from_lengths(lengths)
    call, x, state = family_call(family, 2, sum(lengths), len(lengths), 4, 3, 9, 4, True)
    bad = {m: y.clone() for m, y in x.items()}
    bad["q"][:, :, 8] = math.nan  # inside sequence 1 (tokens 6 … 11)
    grads = []
    for inputs in (x, bad):
        xs = {m: y.clone().requires_grad_() for m, y in inputs.items()}
        o, _ = call(xs, state, cu)
        others = torch.cat((o[:, :, :6], o[:, :, 12:]), 2)
        assert torch.isfinite(others).all()
        grads.append(torch.autograd.grad((others * others).sum(), list(xs.values())))
    for name, clean, got in zip(x, *grads):
        assert torch.isfinite(got).all(), name
        torch.testing.assert_close(got, clean, atol=1e-12, rtol=0, msg=lambda m: f"d{name}: {m}")


def test_the_kernels_check_cu_seqlens():
    if not native.available():
        pytest.skip("the fused CPU kernels could not be built here")
    q = torch.zeros(1, 2, 6, 4)
    st_ = (torch.zeros(2, 2, 4, 4), torch.zeros(2, 2, 4))
    op = torch.ops.linattn_cpu.chunked.default
    with pytest.raises(RuntimeError, match="cu_seqlens must run from 0 to N = 6"):
        op(q, q, q, *st_, 1, True, 1e-6, 4, False, False, torch.tensor([0, 2, 5]))
    with pytest.raises(RuntimeError, match="cu_seqlens must be non-decreasing"):
        op(q, q, q, *st_, 1, True, 1e-6, 4, False, False, torch.tensor([0, 4, 2, 6]))
    with pytest.raises(RuntimeError, match="the batch must be 1"):
        q2 = torch.zeros(2, 2, 6, 4)
        op(q2, q2, q2, *st_, 1, True, 1e-6, 4, False, False, torch.tensor([0, 2, 6]))
    with pytest.raises(RuntimeError, match="initial state must be"):  # 3 sequences, states for 2
        op(q, q, q, *st_, 1, True, 1e-6, 4, False, False, torch.tensor([0, 2, 3, 6]))
    beta, S0 = torch.ones(1, 2, 6), torch.zeros(3, 2, 4, 4)
    with pytest.raises(RuntimeError, match="delta_chunked: the state must be"):
        torch.ops.linattn_cpu.delta_chunked(q, q, q, beta, None, S0[:2], 1.0, False, 4, False, torch.tensor([0, 2, 3, 6]))
    o, S, _ = torch.ops.linattn_cpu.delta_chunked(q, q, q, beta, None, S0, 1.0, False, 4, False, torch.tensor([0, 2, 3, 6]))
    assert o.shape == q.shape and S.shape == (3, 2, 4, 4)
