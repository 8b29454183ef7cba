"""Causal chunked linear attention against the float64 quadratic oracle: forward and gradients."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from linattn.nn.feature_maps import make_feature_map
from linattn.ops import linear_attention, native
from linattn.nn.positional import RotaryEmbedding

from .conftest import oracle, select_op_path

DT = torch.float64
MAP_OPTIONS = {"cosformer": {"max_len": 512}, "favor": {"num_features": 12}, "trig": {"num_features": 6},
               "hedgehog": {"num_features": 5}}


@pytest.fixture(autouse=True, params=["fused", "torch ops", "exact pass"])
def op_path(request, monkeypatch):
    """Every test here runs on both CPU paths of the causal op: the fused kernels (taken by φ elu+1 or
    identity without RoPE, mask or scale) and the torch-op autograd Function (LINATTN_NATIVE=0), and
    on the torch ops' exact pass (the one for NaN / Inf in the state, ops.nonfinite), forced."""
    select_op_path("torch ops" if request.param == "exact pass" else request.param, monkeypatch)
    if request.param == "exact pass":
        import linattn.ops.linear.api as linear

        monkeypatch.setattr(linear, "all_finite", lambda *tensors: False)
    return request.param


def _inputs(b, h, n, d, e, positive, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, n, d, dtype=DT, generator=g)
    k = torch.randn(b, h, n, d, dtype=DT, generator=g)
    v = torch.randn(b, h, n, e, dtype=DT, generator=g)
    if positive:
        q, k = q.abs() + 0.1, k.abs() + 0.1
    return [x.requires_grad_() for x in (q, k, v)]


def _compare(kwargs, q, k, v, state=None, params=(), atol=1e-9):
    """Output, final state and the gradients of a random functional of both agree with the oracle."""
    o, (kv, z) = linear_attention(q, k, v, causal=True, initial_state=state, return_state=True, **kwargs)
    kw = {key: val for key, val in kwargs.items() if key != "chunk_size"}
    ro, (rkv, rz) = oracle(q, k, v, causal=True, initial_state=state, **kw)
    g = torch.Generator().manual_seed(7)
    w = [torch.randn(x.shape, dtype=DT, generator=g) for x in (o, kv, z)]
    inputs = [q, k, v] + ([] if state is None else list(state)) + list(params)
    loss = (o * w[0]).sum() + (kv * w[1]).sum() + (z * w[2]).sum()
    rloss = (ro * w[0]).sum() + (rkv * w[1]).sum() + (rz * w[2]).sum()
    got = torch.autograd.grad(loss, inputs)
    want = torch.autograd.grad(rloss, inputs)
    scale_ = max(1.0, ro.abs().max().item())
    torch.testing.assert_close(o, ro, atol=atol * scale_, rtol=1e-7)
    torch.testing.assert_close(kv, rkv, atol=atol, rtol=1e-9)
    torch.testing.assert_close(z, rz, atol=atol, rtol=1e-9)
    for a, b_ in zip(got, want):
        torch.testing.assert_close(a, b_, atol=atol * max(1.0, b_.abs().max().item()), rtol=1e-7)


@pytest.mark.parametrize("name", ["elu", "relu", "favor", "trig", "cosformer", "taylor", "hedgehog"])
def test_every_feature_map_matches_oracle(name):
    d = 4 if name == "taylor" else 6
    fm = make_feature_map(name, d, **MAP_OPTIONS.get(name, {})).double()
    q, k, v = _inputs(2, 3, 37, d, 5, positive=False, seed=1)
    _compare(dict(feature_map=fm, chunk_size=8), q, k, v, params=list(fm.parameters()), atol=1e-8)


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("use_rope", [False, True])
@pytest.mark.parametrize("use_mask", [False, True])
@pytest.mark.parametrize("use_state", [False, True])
def test_options_match_oracle(normalize, use_rope, use_mask, use_state):
    b, h, n, d, e = 2, 2, 29, 6, 3
    fm = make_feature_map("elu", d).double()
    q, k, v = _inputs(b, h, n, d, e, positive=False, seed=2)
    g = torch.Generator().manual_seed(3)
    kwargs = dict(feature_map=fm, normalize=normalize, chunk_size=8, scale=0.7)
    if use_rope:
        kwargs["rope"] = RotaryEmbedding(d)
    if use_mask:
        mask = torch.rand(b, n, generator=g) > 0.3
        mask[:, 0] = True
        kwargs["key_padding_mask"] = mask
    state = None
    if use_state:
        state = (torch.rand(b, h, d, e, dtype=DT, generator=g).requires_grad_(),
                 (torch.rand(b, h, d, dtype=DT, generator=g) + 1).requires_grad_())
        kwargs["positions"] = torch.arange(11, 11 + n)
    _compare(kwargs, q, k, v, state=state)


def test_precomputed_features_without_map():
    q, k, v = _inputs(1, 2, 70, 4, 9, positive=True, seed=4)
    _compare(dict(chunk_size=16), q, k, v)


def test_per_sequence_positions_with_rope():
    b, h, n, d = 2, 2, 20, 4
    q, k, v = _inputs(b, h, n, d, 4, positive=True, seed=5)
    positions = torch.stack([torch.arange(n), torch.arange(n) + 9])
    _compare(dict(rope=RotaryEmbedding(d), positions=positions, chunk_size=6), q, k, v)


@pytest.mark.parametrize("variant", ["rope", "elu", "elu mask unnormalized", "identity"])
def test_blocks_of_many_chunks(monkeypatch, variant):
    """Force several blocks so the state is carried between them in forward and backward: the
    autograd path (RoPE) and the elementwise-gradient path (elu+1, identity), with a tail block."""
    import linattn.ops.linear.chunked as chunked

    monkeypatch.setattr(chunked, "BLOCK_ELEMENTS", 64)
    q, k, v = _inputs(2, 2, 53, 4, 3, positive=variant == "identity", seed=6)
    kwargs = dict(chunk_size=4, scale=0.8)
    if variant != "identity":
        kwargs["feature_map"] = make_feature_map("elu", 4).double()
    if variant == "rope":
        kwargs.update(rope=RotaryEmbedding(4), positions=torch.arange(5, 58))
    if variant == "elu mask unnormalized":
        mask = torch.rand(2, 53, generator=torch.Generator().manual_seed(1)) > 0.3
        kwargs.update(normalize=False, key_padding_mask=mask)
    state = (torch.rand(2, 2, 4, 3, dtype=DT).requires_grad_(), (torch.rand(2, 2, 4, dtype=DT) + 1).requires_grad_())
    _compare(kwargs, q, k, v, state=state)
    assert chunked.block_tokens(4, 4, 4) == 4


def test_features_without_map_with_mask_and_scale():
    q, k, v = _inputs(2, 2, 21, 4, 3, positive=True, seed=11)
    mask = torch.rand(2, 21, generator=torch.Generator().manual_seed(2)) > 0.4
    mask[:, 0] = True
    _compare(dict(chunk_size=8, key_padding_mask=mask, scale=0.5), q, k, v)


@pytest.mark.parametrize("name", ["elu", "hedgehog"])
def test_backward_twice_with_retained_graph(name):
    """The backward reuses the forward's last block once; a second backward recomputes it."""
    fm = make_feature_map(name, 4).double()
    q, k, v = _inputs(1, 2, 19, 4, 3, positive=False, seed=12)
    o = linear_attention(q, k, v, causal=True, feature_map=fm, chunk_size=4)
    first = torch.autograd.grad(o.sum(), (q, k, v), retain_graph=True)
    second = torch.autograd.grad(o.sum(), (q, k, v))
    for a, b_ in zip(first, second):
        torch.testing.assert_close(a, b_, atol=1e-12, rtol=1e-12)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    b=st.integers(1, 2), h=st.integers(1, 3), n=st.integers(1, 40), d=st.integers(1, 6), e=st.integers(1, 6),
    chunk=st.integers(1, 17), normalize=st.booleans(), seed=st.integers(0, 2**16),
)
def test_property_shapes_and_chunks(b, h, n, d, e, chunk, normalize, seed):
    q, k, v = _inputs(b, h, n, d, e, positive=True, seed=seed)
    _compare(dict(chunk_size=chunk, normalize=normalize), q, k, v)


def test_gradcheck_tiny():
    fm = make_feature_map("elu", 3).double()
    q, k, v = _inputs(1, 2, 5, 3, 2, positive=False, seed=8)
    state = (torch.rand(1, 2, 3, 2, dtype=DT).requires_grad_(), (torch.rand(1, 2, 3, dtype=DT) + 1).requires_grad_())

    def f(q, k, v, kv0, z0):
        o, (kv, z) = linear_attention(q, k, v, causal=True, feature_map=fm, chunk_size=2,
                                      initial_state=(kv0, z0), return_state=True)
        return o, kv, z

    assert torch.autograd.gradcheck(f, (q, k, v, *state))


def test_hedgehog_parameter_gradient_matches_finite_differences():
    fm = make_feature_map("hedgehog", 3, num_features=2).double()
    q, k, v = _inputs(1, 1, 6, 3, 2, positive=False, seed=9)

    def f(w):
        fm.weight.data = w
        return linear_attention(q.detach(), k.detach(), v.detach(), causal=True, feature_map=fm, chunk_size=4)

    # gradcheck through the parameter: compare the op's parameter gradient with finite differences
    w = fm.weight.detach().clone()
    o = linear_attention(q, k, v, causal=True, feature_map=fm, chunk_size=4)
    gw = torch.autograd.grad(o.sum(), fm.weight)[0]
    fd = torch.zeros_like(w)
    for i in range(w.numel()):
        dw = torch.zeros_like(w).view(-1)
        dw[i] = 1e-6
        dw = dw.view_as(w)
        with torch.no_grad():
            fd.view(-1)[i] = (f(w + dw).sum() - f(w - dw).sum()) / 2e-6
    fm.weight.data = w
    torch.testing.assert_close(gw, fd, atol=1e-6, rtol=1e-5)


def test_gradient_only_through_state():
    """When only the final state is used, gradients still reach k and v (o's grad is None)."""
    q, k, v = _inputs(1, 1, 10, 3, 2, positive=True, seed=10)
    _, (kv, z) = linear_attention(q, k, v, causal=True, return_state=True, chunk_size=4)
    gk, gv = torch.autograd.grad(kv.sum() + z.sum(), (k, v))
    torch.testing.assert_close(gv, k.detach().sum(-1, keepdim=True).expand_as(v))
    torch.testing.assert_close(gk, v.detach().sum(-1, keepdim=True).expand_as(k) + 1)
