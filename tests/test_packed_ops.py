"""Packed sequences (cu_seqlens, design §16) in every operator family: a packed call equals the N
separate calls — outputs, final states and the gradients of every input, initial states included —
in float64 to 1e-10, on both CPU paths, with sequences of length 0 and 1 and lengths that are not a
multiple of the chunk."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from linattn.nn.feature_maps import make_feature_map
from linattn.ops import delta_rule, gated_linear_attention, linear_attention, native, packed
from linattn.nn.positional import RotaryEmbedding

DT = torch.float64
TOL = 1e-10
# chunk 4: lengths 1 and 0, lengths that are not a multiple of 4; sequences of one length (5: 0, 2, 3;
# 1: 1, 7) run as the rows of one batch, in an order that is not the sequences'
LENGTHS = [5, 1, 5, 5, 11, 0, 8, 1]


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Small shapes, many ops: one thread."""


@pytest.fixture(params=["fused", "torch ops"])
def op_path(request, monkeypatch):
    """The fused CPU kernels (where the call qualifies) or the torch-op Functions (LINATTN_NATIVE=0)."""
    if request.param == "fused" and not native.available():
        pytest.skip("the fused CPU kernels could not be built here")
    monkeypatch.setenv("LINATTN_NATIVE", "1" if request.param == "fused" else "0")
    return request.param


def _leaves(state):
    if state is None:
        return []
    return [x for x in state if x is not None] if isinstance(state, tuple) else [state]


def _close(got, want, what):
    torch.testing.assert_close(got, want, atol=TOL * max(1.0, want.abs().max().item()), rtol=0,
                               msg=lambda m: f"{what}: {m}")


def compare(call, inputs: dict, state, lengths, params=()):
    """call(inputs, state, cu_seqlens) -> (o (1, H, T, E), final state); inputs: name -> (1, H, T, …)
    tensors on the packed time axis (dim 2); state: the per-sequence initial state (leading dim N)
    or None. Checks the packed call against the calls on each sequence alone (outputs, states and
    the gradients of a random functional of both with respect to inputs, state and params)."""
    inputs = {n: x.detach().clone().requires_grad_(x.is_floating_point()) for n, x in inputs.items()}
    if state is not None:
        state = tuple(x.detach().clone().requires_grad_() for x in state) if isinstance(state, tuple) \
            else state.detach().clone().requires_grad_()
    cu = packed.cu_seqlens_from_lengths(lengths)
    o, S = call(inputs, state, cu)
    outs, finals = [], []
    for n, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        st_n = packed.select_state(state, n)
        if e == s:  # nothing to run: the state passes through (zeros without one)
            zeros = packed.select_state(tuple(torch.zeros_like(x) for x in S) if isinstance(S, tuple)
                                        else torch.zeros_like(S), n)
            finals.append(zeros if st_n is None else st_n)
            continue
        o_n, S_n = call({m: x[:, :, s:e] for m, x in inputs.items()}, st_n, None)
        outs.append(o_n)
        finals.append(S_n)
    ro, rS = torch.cat(outs, 2), packed.stack_states(finals)
    assert o.shape == ro.shape and o.dtype == ro.dtype
    _close(o, ro, "o")
    S_parts, rS_parts = _leaves(S), _leaves(rS)
    assert len(S_parts) == len(rS_parts)
    for i, (a, b) in enumerate(zip(S_parts, rS_parts)):
        assert a.shape[0] == len(lengths)
        _close(a, b, f"final state {i}")
    gen = torch.Generator().manual_seed(3)
    wo = torch.randn(o.shape, generator=gen, dtype=DT)
    wS = [torch.randn(x.shape, generator=gen, dtype=DT) for x in S_parts]
    wrt = [x for x in inputs.values() if x.requires_grad] + _leaves(state) + list(params)
    names = [n for n, x in inputs.items() if x.requires_grad] + [f"state{i}" for i in range(len(_leaves(state)))] \
        + [f"param{i}" for i in range(len(params))]

    def loss(o, parts):
        return (o * wo).sum() + sum((x * w).sum() for x, w in zip(parts, wS))

    got = torch.autograd.grad(loss(o, S_parts), wrt, allow_unused=True)
    want = torch.autograd.grad(loss(ro, rS_parts), wrt, allow_unused=True)
    for name, a, b in zip(names, got, want):
        if b is None:
            assert a is None or not a.any(), name
            continue
        _close(a, b, f"d{name}")


def _qkv(h, t, d, e, seed, positive=False):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(1, h, t, d, generator=gen, dtype=DT) for _ in range(2))
    if positive:
        q, k = q.abs() + 0.1, k.abs() + 0.1
    return gen, q, k, torch.randn(1, h, t, e, generator=gen, dtype=DT)


# ---------------------------------------------------------------------------------------------------------
# linear attention


LINEAR_CASES = [("elu", True), ("elu", False), (None, False), (None, True), ("relu", True), ("favor", True),
                ("cosformer", True), ("taylor", False), ("hedgehog", True)]


@pytest.mark.parametrize("fmap,normalize", LINEAR_CASES)
@pytest.mark.parametrize("with_state", [False, True])
def test_linear_packed_equals_separate(op_path, fmap, normalize, with_state):
    h, d, e = 2, 4, 3
    fm = None if fmap is None else make_feature_map(fmap, d).double()
    feat = d if fm is None else fm.feature_dim
    gen, q, k, v = _qkv(h, sum(LENGTHS), d, e, seed=1, positive=fm is None)
    state = None
    if with_state:
        state = (torch.randn(len(LENGTHS), h, feat, e, generator=gen, dtype=DT),
                 torch.rand(len(LENGTHS), h, feat, generator=gen, dtype=DT) + 1)
    if with_state and getattr(fm, "needs_positions", False):
        pytest.skip("a position-dependent map resuming from a state needs positions: covered with RoPE below")

    def call(x, s, cu):
        return linear_attention(x["q"], x["k"], x["v"], causal=True, feature_map=fm, normalize=normalize,
                                initial_state=s, return_state=True, chunk_size=4, cu_seqlens=cu)

    compare(call, {"q": q, "k": k, "v": v}, state, LENGTHS, params=[p for p in (fm.parameters() if fm else ())])


def test_linear_packed_rope_restarts_positions(op_path):
    """RoPE (and position-dependent maps) see positions restarting at 0 in each sequence."""
    h, d, e = 2, 4, 3
    rope = RotaryEmbedding(d)
    _, q, k, v = _qkv(h, sum(LENGTHS), d, e, seed=2)
    fm = make_feature_map("elu", d)

    def call(x, s, cu):
        return linear_attention(x["q"], x["k"], x["v"], causal=True, feature_map=fm, rope=rope, return_state=True,
                                chunk_size=4, cu_seqlens=cu)

    compare(call, {"q": q, "k": k, "v": v}, None, LENGTHS)


def test_linear_packed_key_padding_mask(op_path):
    """A key_padding_mask on the packed axis is read per sequence."""
    h, d, e = 2, 4, 3
    gen, q, k, v = _qkv(h, sum(LENGTHS), d, e, seed=3)
    mask = torch.rand(1, sum(LENGTHS), generator=gen) > 0.3
    fm = make_feature_map("elu", d)

    def call(x, s, cu):
        m = mask if cu is not None else None
        if cu is None:  # the separate calls get their own slice of the mask
            m = call.slices.pop(0)
        return linear_attention(x["q"], x["k"], x["v"], causal=True, feature_map=fm, key_padding_mask=m,
                                return_state=True, chunk_size=4, cu_seqlens=cu)

    cu = packed.cu_seqlens_from_lengths(LENGTHS).tolist()
    call.slices = [mask[:, s:e] for s, e in zip(cu[:-1], cu[1:]) if e > s]
    compare(call, {"q": q, "k": k, "v": v}, None, LENGTHS)


# ---------------------------------------------------------------------------------------------------------
# gated linear attention


@pytest.mark.parametrize("gate", ["scalar", "vector", "retnet"])
@pytest.mark.parametrize("elu,normalize", [(True, False), (False, False), (True, True)])
@pytest.mark.parametrize("with_state", [False, True])
def test_gated_packed_equals_separate(op_path, gate, elu, normalize, with_state):
    h, d, e, t = 2, 4, 3, sum(LENGTHS)
    fm = make_feature_map("elu", d).double() if elu else None
    gen, q, k, v = _qkv(h, t, d, e, seed=4, positive=not elu)
    if gate == "vector":
        g = -torch.rand(1, h, t, d, generator=gen, dtype=DT)
    elif gate == "scalar":
        g = -torch.rand(1, h, t, generator=gen, dtype=DT)
    else:  # RetNet: a constant decay per head
        gamma = 1 - 2.0 ** (-5 - torch.arange(h, dtype=DT))
        g = gamma.log()[None, :, None].expand(1, h, t).contiguous()
    state = None
    if with_state:
        kv0 = torch.randn(len(LENGTHS), h, d, e, generator=gen, dtype=DT)
        state = (kv0, torch.rand(len(LENGTHS), h, d, generator=gen, dtype=DT) + 1) if normalize else kv0

    def call(x, s, cu):
        return gated_linear_attention(x["q"], x["k"], x["v"], x["g"], feature_map=fm, normalize=normalize,
                                      initial_state=s, return_state=True, chunk_size=4, cu_seqlens=cu)

    compare(call, {"q": q, "k": k, "v": v, "g": g}, state, LENGTHS)


# ---------------------------------------------------------------------------------------------------------
# delta rule


def _delta_inputs(h, t, d, e, gen_seed, gated, l2norm):
    gen, q, k, v = _qkv(h, t, d, e, seed=gen_seed)
    if not l2norm:
        k = torch.nn.functional.normalize(k, dim=-1)
    x = {"q": q, "k": k, "v": v, "beta": torch.rand(1, h, t, generator=gen, dtype=DT) * 0.98 + 0.01}
    if gated:
        x["g"] = torch.nn.functional.logsigmoid(torch.randn(1, h, t, generator=gen, dtype=DT) + 2)
    return gen, x


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("l2norm", [False, True])
@pytest.mark.parametrize("with_state", [False, True])
def test_delta_packed_equals_separate(op_path, gated, l2norm, with_state):
    h, d, e = 2, 4, 3
    gen, x = _delta_inputs(h, sum(LENGTHS), d, e, 5, gated, l2norm)
    state = torch.randn(len(LENGTHS), h, d, e, generator=gen, dtype=DT) if with_state else None

    def call(x, s, cu):
        return delta_rule(x["q"], x["k"], x["v"], x["beta"], g=x.get("g"), scale=0.7, qk_l2norm=l2norm,
                          initial_state=s, return_state=True, chunk_size=4, cu_seqlens=cu)

    compare(call, x, state, LENGTHS)


@pytest.mark.parametrize("family", ["linear", "gated", "delta"])
def test_consecutive_sequences_of_one_length(op_path, family):
    """Sequences of one length that follow each other (one view of the row, no copy) and a last one."""
    lengths, h, d, e = [4, 4, 4, 3], 2, 4, 3
    t, n = sum(lengths), len(lengths)
    gen, x = _delta_inputs(h, t, d, e, 11, True, True)
    fm = make_feature_map("elu", d)
    if family == "delta":
        state = torch.randn(n, h, d, e, generator=gen, dtype=DT)

        def call(x, s, cu):
            return delta_rule(x["q"], x["k"], x["v"], x["beta"], g=x["g"], qk_l2norm=True, initial_state=s,
                              return_state=True, chunk_size=4, cu_seqlens=cu)
    elif family == "gated":
        state = torch.randn(n, h, d, e, generator=gen, dtype=DT)

        def call(x, s, cu):
            return gated_linear_attention(x["q"], x["k"], x["v"], x["g"], feature_map=fm, initial_state=s,
                                          return_state=True, chunk_size=4, cu_seqlens=cu)
    else:
        state = (torch.randn(n, h, d, e, generator=gen, dtype=DT), torch.rand(n, h, d, generator=gen, dtype=DT) + 1)

        def call(x, s, cu):
            return linear_attention(x["q"], x["k"], x["v"], causal=True, feature_map=fm, initial_state=s,
                                    return_state=True, chunk_size=4, cu_seqlens=cu)

    compare(call, x, state, lengths)


# ---------------------------------------------------------------------------------------------------------
# random lengths, every family


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lengths=st.lists(st.integers(0, 13), min_size=1, max_size=5).filter(lambda ls: sum(ls) > 0),
       chunk=st.sampled_from([1, 3, 4, 16]), family=st.sampled_from(["linear", "gated", "delta"]),
       seed=st.integers(0, 2**16))
def test_packed_random_lengths(op_path, lengths, chunk, family, seed):
    h, d, e, t = 2, 4, 3, sum(lengths)
    n = len(lengths)
    if family == "delta":
        gen, x = _delta_inputs(h, t, d, e, seed, True, True)
        state = torch.randn(n, h, d, e, generator=gen, dtype=DT)

        def call(x, s, cu):
            return delta_rule(x["q"], x["k"], x["v"], x["beta"], g=x["g"], qk_l2norm=True, initial_state=s,
                              return_state=True, chunk_size=chunk, cu_seqlens=cu)
    elif family == "gated":
        gen, q, k, v = _qkv(h, t, d, e, seed)
        x = {"q": q, "k": k, "v": v, "g": -torch.rand(1, h, t, generator=gen, dtype=DT)}
        state = torch.randn(n, h, d, e, generator=gen, dtype=DT)
        fm = make_feature_map("elu", d)

        def call(x, s, cu):
            return gated_linear_attention(x["q"], x["k"], x["v"], x["g"], feature_map=fm, initial_state=s,
                                          return_state=True, chunk_size=chunk, cu_seqlens=cu)
    else:
        gen, q, k, v = _qkv(h, t, d, e, seed)
        x = {"q": q, "k": k, "v": v}
        state = (torch.randn(n, h, d, e, generator=gen, dtype=DT), torch.rand(n, h, d, generator=gen, dtype=DT) + 1)
        fm = make_feature_map("elu", d)

        def call(x, s, cu):
            return linear_attention(x["q"], x["k"], x["v"], causal=True, feature_map=fm, initial_state=s,
                                    return_state=True, chunk_size=chunk, cu_seqlens=cu)

    compare(call, x, state, lengths)


# ---------------------------------------------------------------------------------------------------------
# isolation and errors


def test_nan_in_one_sequence_reaches_no_other(op_path):
    """A NaN in one sequence's keys leaves the outputs, states and gradients of the others finite
    (sequences 0, 1 and 3 have one length: they run as the rows of one batch)."""
    h, d, e, lengths = 2, 4, 3, [6, 6, 5, 6]
    cu = packed.cu_seqlens_from_lengths(lengths)
    gen, x = _delta_inputs(h, sum(lengths), d, e, 9, True, True)
    for name in ("linear", "delta"):
        xs = {m: y.clone() for m, y in x.items()}
        xs["k"][:, :, 8] = math.nan  # inside sequence 1 (tokens 6 … 11)
        xs = {m: y.requires_grad_() for m, y in xs.items()}
        if name == "delta":
            o, S = delta_rule(xs["q"], xs["k"], xs["v"], xs["beta"], g=xs["g"], qk_l2norm=True, return_state=True,
                              chunk_size=4, cu_seqlens=cu)
        else:
            o, (S, _) = linear_attention(xs["q"], xs["k"], xs["v"], causal=True, return_state=True, chunk_size=4,
                                         feature_map=make_feature_map("elu", d), cu_seqlens=cu)
        others = torch.cat((o[:, :, :6], o[:, :, 12:]), 2)
        assert torch.isfinite(others).all() and torch.isfinite(S[[0, 2, 3]]).all(), name
        assert not torch.isfinite(S[1]).all(), name
        others.sum().backward()
        for m in ("q", "k", "v"):
            grad = xs[m].grad
            assert torch.isfinite(grad[:, :, :6]).all() and torch.isfinite(grad[:, :, 12:]).all(), (name, m)


def _small():
    return torch.randn(1, 2, 6, 4, dtype=DT), torch.randn(1, 2, 6, 4, dtype=DT), torch.randn(1, 2, 6, 3, dtype=DT)


@pytest.mark.parametrize("cu,error,match", [
    ([0, 3, 6.0], TypeError, "integer"),
    ([[0, 6]], ValueError, "1-D"),
    ([0], ValueError, "1-D"),
    ([1, 6], ValueError, r"cu_seqlens\[0\]"),
    ([0, 4, 3, 6], ValueError, "non-decreasing"),
    ([0, 3, 5], ValueError, r"cu_seqlens\[-1\]"),
])
def test_bad_cu_seqlens(cu, error, match):
    q, k, v = _small()
    beta = torch.full((1, 2, 6), 0.5, dtype=DT)
    for run in (lambda c: linear_attention(q, k, v, causal=True, cu_seqlens=c),
                lambda c: gated_linear_attention(q.abs(), k.abs(), v, -beta, cu_seqlens=c),
                lambda c: delta_rule(q, k, v, beta, qk_l2norm=True, cu_seqlens=c)):
        with pytest.raises(error, match=match):
            run(torch.tensor(cu))
    with pytest.raises(TypeError, match="cu_seqlens"):
        linear_attention(q, k, v, causal=True, cu_seqlens=[0, 6])


def test_packed_needs_batch_one_and_per_sequence_states():
    q, k, v = _small()
    cu = torch.tensor([0, 2, 6])
    q2, k2, v2 = (torch.cat((x, x)) for x in (q, k, v))
    with pytest.raises(ValueError, match="batch size must be 1"):
        linear_attention(q2, k2, v2, causal=True, cu_seqlens=cu)
    with pytest.raises(ValueError, match="causal=True"):
        linear_attention(q, k, v, causal=False, cu_seqlens=cu)
    with pytest.raises(ValueError, match="initial_state.*N=2"):
        delta_rule(q, k, v, torch.full((1, 2, 6), 0.5, dtype=DT), qk_l2norm=True, cu_seqlens=cu,
                   initial_state=torch.zeros(1, 2, 4, 3, dtype=DT))
    with pytest.raises(ValueError, match=r"initial_state\[1\].*N=2"):
        linear_attention(q, k, v, causal=True, cu_seqlens=cu,
                         initial_state=(torch.zeros(2, 2, 4, 3, dtype=DT), torch.zeros(3, 2, 4, dtype=DT)))
    with pytest.raises(ValueError, match="initial_state.*N=2"):
        gated_linear_attention(q.abs(), k.abs(), v, -torch.rand(1, 2, 6, dtype=DT), cu_seqlens=cu,
                               initial_state=torch.zeros(3, 2, 4, 3, dtype=DT))


def test_positions_and_sequence_ids():
    cu = torch.tensor([0, 3, 3, 4, 7])
    assert packed.positions(cu).tolist() == [0, 1, 2, 0, 0, 1, 2]
    assert packed.sequence_ids(cu).tolist() == [0, 0, 0, 2, 3, 3, 3]
    assert packed.cu_seqlens_from_lengths([3, 0, 1, 3]).tolist() == cu.tolist()
