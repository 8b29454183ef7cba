"""Gated linear attention against its float64 recurrence written from the definition
(linattn.ops.gated.reference): outputs, final states and every gradient, on both CPU paths."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as Fn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from linattn.nn.feature_maps import EluPlusOne, make_feature_map
from linattn.ops import gated_linear_attention, gated_linear_attention_step, native
from linattn.ops.gated.reference import gated_recurrence

DT = torch.float64


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Small shapes, many ops: one thread (on a shared machine two wait on each other at every op)."""


def draw(b, h, n, f, e, *, vector, elu, with_state, normalize, strength, seed, dtype=DT):
    """q, k (B, H, N, F), v (B, H, N, E), g ≤ 0 of the given strength (−strength·U(0, 1)), φ, and an
    initial state of normalize's form or None. Without φ, q and k are positive (they are features)."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(b, h, n, f, generator=gen, dtype=DT) for _ in range(2))
    v = torch.randn(b, h, n, e, generator=gen, dtype=DT)
    g = -strength * torch.rand(b, h, n, *((f,) if vector else ()), generator=gen, dtype=DT)
    fm = EluPlusOne(f).double() if elu else None
    if fm is None:
        q, k = q.abs() + 0.1, k.abs() + 0.1
    state = None
    if with_state:
        kv0 = torch.randn(b, h, f, e, generator=gen, dtype=DT)
        state = (kv0, torch.rand(b, h, f, generator=gen, dtype=DT) + 1) if normalize else kv0
    q, k, v, g = (x.to(dtype) for x in (q, k, v, g))
    return q, k, v, g, fm, state


def leaves(state):
    return [] if state is None else list(state) if isinstance(state, tuple) else [state]


def oracle(q, k, v, g, fm=None, *, scale=None, key_padding_mask=None, **kw):
    """The recurrence on the features φ(scale·q), φ(k)."""
    qs = q if scale is None else q * scale
    qf = qs if fm is None else fm(qs, is_query=True)
    kf = k if fm is None else fm(k, is_query=False)
    if key_padding_mask is not None:  # the recurrence keeps the state at masked tokens by itself
        kf = kf * key_padding_mask[:, None, :, None]
    return gated_recurrence(qf, kf, v, g, key_padding_mask=key_padding_mask, **kw)


def functional_grads(o, state, inputs, seed=7):
    """Gradients of a random linear functional of (o, final state) with respect to `inputs`."""
    gen = torch.Generator().manual_seed(seed)
    outs = [o, *leaves(state)]
    ws = [torch.randn(x.shape, generator=gen, dtype=DT).to(x.dtype) for x in outs]
    loss = sum((x * w).sum() for x, w in zip(outs, ws))
    return torch.autograd.grad(loss, inputs, allow_unused=True)


def assert_close_rel(got, want, rel):
    """|got − want| ≤ rel · max(1, max|want|) everywhere."""
    scale_ = max(1.0, want.abs().max().item())
    err = (got.to(want.dtype) - want).abs().max().item()
    assert err <= rel * scale_, (err, scale_)


def compare(q, k, v, g, fm, state, *, normalize, chunk=64, rel=1e-9, **kw):
    """Outputs, final state and the gradients of q, k, v, g and the initial state against the oracle."""
    inputs = [x.detach().requires_grad_() for x in (q, k, v, g, *leaves(state))]
    q, k, v, g = inputs[:4]
    st0 = None if state is None else (tuple(inputs[4:]) if normalize else inputs[4])
    o, fin = gated_linear_attention(q, k, v, g, feature_map=fm, normalize=normalize, initial_state=st0,
                                    return_state=True, chunk_size=chunk, **kw)
    ro, rfin = oracle(q, k, v, g, fm, normalize=normalize, initial_state=st0, **kw)
    assert o.dtype == q.dtype and all(s.dtype == torch.float64 for s in leaves(fin))
    assert isinstance(fin, tuple) == normalize
    for got, want in zip([o, *leaves(fin)], [ro, *leaves(rfin)]):
        assert_close_rel(got, want, rel)
    for got, want in zip(functional_grads(o, fin, inputs), functional_grads(ro, rfin, inputs)):
        assert_close_rel(got, want, rel)
    return o


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(b=st.integers(1, 2), h=st.integers(1, 3), n=st.one_of(st.integers(1, 140), st.integers(500, 700)),
       f=st.integers(1, 7), e=st.integers(1, 7), chunk=st.sampled_from([1, 7, 16, 64]), vector=st.booleans(),
       elu=st.booleans(), normalize=st.booleans(), with_state=st.booleans(),
       strength=st.sampled_from([1e-3, 0.3, 3.0, 60.0]), seed=st.integers(0, 2**16))
def test_matches_the_recurrence_in_float64(op_path, b, h, n, f, e, chunk, vector, elu, normalize, with_state,
                                           strength, seed):
    """Scalar and vector gates, with and without φ and normalization, N = 1, tails, N past a 512-token
    block, F ≠ E, B·H > 1, weak to strong decay (strong vector gates cut the chunks)."""
    q, k, v, g, fm, state = draw(b, h, n, f, e, vector=vector, elu=elu, with_state=with_state, normalize=normalize,
                                 strength=strength, seed=seed)
    compare(q, k, v, g, fm, state, normalize=normalize, chunk=chunk)


@pytest.mark.parametrize("vector", [False, True])
def test_mixed_and_resetting_decays(op_path, vector):
    """A feature decaying by e^−50 per token next to features that barely decay, and tokens with
    g = −1e4 (a reset) mid-chunk: every chunk is cut into pieces of one or a few rows (vector gates)."""
    q, k, v, g, fm, state = draw(2, 2, 600, 5, 3, vector=vector, elu=True, with_state=True, normalize=True,
                                 strength=1e-3, seed=3)
    if vector:
        g[..., 0] = -50.0
    g[:, :, [5, 70, 71, 530]] = -1e4
    compare(q, k, v, g, fm, state, normalize=True, chunk=16)


@pytest.mark.parametrize("vector", [False, True])
@pytest.mark.parametrize("reset", [-1e12, -1e16, -1e30])
def test_a_gate_far_below_any_decay_is_exact(op_path, vector, reset):
    """One g ≤ −1e12 (issue 37 item 1): the later tokens' decays must not lose their small gates in the
    cumulative sums that also hold the huge one (before: 0.35 relative error at −1e16 in float64, scalar
    gates on both paths, vector gates on the torch path). Float64 outputs, state and every gradient."""
    q, k, v, g, fm, state = draw(1, 2, 150, 4, 3, vector=vector, elu=True, with_state=True, normalize=True,
                                 strength=0.1, seed=11)
    g[:, :, [10, 97]] = reset
    compare(q, k, v, g, fm, state, normalize=True, chunk=16)
    compare(q, k, v, g, fm, state[0], normalize=False, chunk=64)


@pytest.mark.parametrize("name", ["relu", "favor", "hedgehog"])
def test_other_feature_maps_scale_and_their_parameters(name):
    """φ without a fused kernel (hedgehog: trainable parameters, their gradients too) and scale."""
    fm = make_feature_map(name, 4, **({"num_features": 6} if name == "favor" else
                                      {"num_features": 3} if name == "hedgehog" else {})).double()
    feat = fm.feature_dim
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 2, 37, d, generator=gen, dtype=DT) for d in (4, 4, 3))
    state = (torch.randn(2, 2, feat, 3, generator=gen, dtype=DT), torch.rand(2, 2, feat, generator=gen, dtype=DT) + 1)
    params = [p for p in fm.parameters() if p.requires_grad]
    assert bool(params) == (name == "hedgehog")
    for g in (-torch.rand(2, 2, 37, generator=gen, dtype=DT), -torch.rand(2, 2, 37, feat, generator=gen, dtype=DT)):
        inputs = [x.detach().requires_grad_() for x in (q, k, v, g)] + params
        o = gated_linear_attention(*inputs[:4], feature_map=fm, normalize=True, scale=0.7, initial_state=state,
                                   chunk_size=8)
        ro, _ = oracle(*inputs[:4], fm, scale=0.7, normalize=True, initial_state=state)
        assert_close_rel(o, ro, 1e-10)
        for a, b_ in zip(functional_grads(o, None, inputs), functional_grads(ro, None, inputs)):
            assert_close_rel(a, b_, 1e-9)


@pytest.mark.parametrize("vector", [False, True])
def test_a_masked_token_leaves_the_state_alone(op_path, vector):
    """key_padding_mask: the final state and the outputs at real tokens equal those of the sequence
    with the masked tokens removed (here: left and right padding and a hole), gradients included."""
    q, k, v, g, fm, _ = draw(2, 2, 30, 4, 3, vector=vector, elu=True, with_state=False, normalize=True,
                             strength=0.5, seed=6)
    mask = torch.ones(2, 30, dtype=torch.bool)
    mask[0, :4] = False
    mask[0, 17:19] = False
    mask[1, 25:] = False
    compare(q, k, v, g, fm, None, normalize=True, key_padding_mask=mask, chunk=8)
    o, kv_z = gated_linear_attention(q, k, v, g, feature_map=fm, normalize=True, key_padding_mask=mask,
                                     return_state=True, chunk_size=8)
    for i in range(2):
        keep = mask[i]
        sub = [x[i:i + 1, :, keep] for x in (q, k, v, g)]
        o_sub, kv_z_sub = gated_linear_attention(*sub, feature_map=fm, normalize=True, return_state=True)
        torch.testing.assert_close(o[i:i + 1, :, keep], o_sub, rtol=1e-12, atol=1e-12)
        for a, b_ in zip(kv_z, kv_z_sub):
            torch.testing.assert_close(a[i:i + 1], b_, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("vector", [False, True])
@pytest.mark.parametrize("normalize", [False, True])
def test_split_and_resume_equals_one_call(op_path, vector, normalize):
    """Two calls, the second from the first's final state: the same outputs and gradients (q, k, v,
    g and the initial state) as one call over the whole sequence."""
    q, k, v, g, fm, state = draw(2, 3, 150, 5, 4, vector=vector, elu=True, with_state=True, normalize=normalize,
                                 strength=0.3, seed=8)
    inputs = [x.detach().requires_grad_() for x in (q, k, v, g, *leaves(state))]
    q, k, v, g = inputs[:4]
    st0 = tuple(inputs[4:]) if normalize else inputs[4]
    kw = dict(feature_map=fm, normalize=normalize, return_state=True, chunk_size=16)
    o, fin = gated_linear_attention(q, k, v, g, initial_state=st0, **kw)
    o1, mid = gated_linear_attention(q[:, :, :61], k[:, :, :61], v[:, :, :61], g[:, :, :61], initial_state=st0, **kw)
    o2, fin2 = gated_linear_attention(q[:, :, 61:], k[:, :, 61:], v[:, :, 61:], g[:, :, 61:], initial_state=mid, **kw)
    torch.testing.assert_close(torch.cat([o1, o2], 2), o, rtol=1e-12, atol=1e-12)
    for a, b_ in zip(leaves(fin2), leaves(fin)):
        torch.testing.assert_close(a, b_, rtol=1e-12, atol=1e-12)
    for a, b_ in zip(functional_grads(torch.cat([o1, o2], 2), fin2, inputs), functional_grads(o, fin, inputs)):
        torch.testing.assert_close(a, b_, rtol=1e-11, atol=1e-11)


@pytest.mark.parametrize("vector", [False, True])
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("elu", [False, True])
def test_steps_equal_the_parallel_form(op_path, vector, normalize, elu):
    """Token by token without gradients (the fused step where it applies), then with gradients (torch
    ops): outputs, states and gradients equal the chunked call's; a block of T > 1 tokens too."""
    q, k, v, g, fm, state = draw(2, 2, 9, 4, 3, vector=vector, elu=elu, with_state=True, normalize=normalize,
                                 strength=0.5, seed=9)
    o_ref, fin_ref = gated_linear_attention(q, k, v, g, feature_map=fm, normalize=normalize, initial_state=state,
                                            return_state=True, chunk_size=4)

    def steps(q, k, v, g, st0):
        outs, st_ = [], st0
        for t in range(q.shape[2]):
            o, st_ = gated_linear_attention_step(st_, q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1],
                                                 g[:, :, t:t + 1], feature_map=fm, normalize=normalize)
            outs.append(o)
        return torch.cat(outs, 2), st_

    with torch.no_grad():
        o, fin = steps(q, k, v, g, state)
    torch.testing.assert_close(o, o_ref, rtol=1e-12, atol=1e-12)
    for a, b_ in zip(leaves(fin), leaves(fin_ref)):
        torch.testing.assert_close(a, b_, rtol=1e-12, atol=1e-12)
    o_blk, fin_blk = gated_linear_attention_step(state, q[:, :, :5], k[:, :, :5], v[:, :, :5], g[:, :, :5],
                                                 feature_map=fm, normalize=normalize)
    o_rest, _ = steps(q[:, :, 5:], k[:, :, 5:], v[:, :, 5:], g[:, :, 5:], fin_blk)
    torch.testing.assert_close(torch.cat([o_blk, o_rest], 2), o_ref, rtol=1e-12, atol=1e-12)
    inputs = [x.detach().requires_grad_() for x in (q, k, v, g, *leaves(state))]
    st0 = tuple(inputs[4:]) if normalize else inputs[4]
    o, fin = steps(*inputs[:4], st0)
    o_par, fin_par = gated_linear_attention(*inputs[:4], feature_map=fm, normalize=normalize, initial_state=st0,
                                            return_state=True, chunk_size=4)
    for a, b_ in zip(functional_grads(o, fin, inputs), functional_grads(o_par, fin_par, inputs)):
        torch.testing.assert_close(a, b_, rtol=1e-11, atol=1e-11)


def test_step_leaves_the_state_alone_and_starts_from_zeros(op_path):
    q, k, v, g, fm, state = draw(1, 2, 1, 4, 3, vector=True, elu=True, with_state=True, normalize=True,
                                 strength=0.5, seed=10)
    before = tuple(x.clone() for x in state)
    with torch.no_grad():
        gated_linear_attention_step(state, q, k, v, g, feature_map=fm, normalize=True)
        o0, st0 = gated_linear_attention_step(None, q, k, v, g, feature_map=fm)
    assert all(torch.equal(a, b_) for a, b_ in zip(state, before))
    ro, rst = oracle(q, k, v, g, fm)
    torch.testing.assert_close(o0, ro, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(st0, rst, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("vector", [False, True])
def test_strided_inputs(op_path, vector):
    """q, k, v as the transposed views a layer makes from (B, N, H, ·), g as a transposed view too."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(2, 70, 3, 3 * 5, generator=gen, dtype=DT)
    q, k, v = (t.transpose(1, 2) for t in x.split(5, dim=-1))
    graw = -torch.rand(2, 70, 3, *((5,) if vector else ()), generator=gen, dtype=DT)
    g = graw.transpose(1, 2)
    assert not (q.is_contiguous() or g.is_contiguous())
    compare(q, k, v, g, EluPlusOne(5).double(), None, normalize=True, chunk=16)


@pytest.mark.parametrize("vector", [False, True])
def test_gradcheck(op_path, vector):
    """Finite differences through q, k, v, g and the initial state (kv, z), chunk 2 over 5 tokens."""
    q, k, v, g, fm, state = draw(1, 2, 5, 3, 2, vector=vector, elu=True, with_state=True, normalize=True,
                                 strength=0.7, seed=12)
    g = g - 0.05  # finite differences must not cross g = 0

    def f(q, k, v, g, kv0, z0):
        o, (kv, z) = gated_linear_attention(q, k, v, g, feature_map=fm, normalize=True, initial_state=(kv0, z0),
                                            return_state=True, chunk_size=2)
        return o, kv, z

    args = [x.detach().requires_grad_() for x in (q, k, v, g, *state)]
    assert torch.autograd.gradcheck(f, args)


@pytest.mark.parametrize("vector", [False, True])
@pytest.mark.parametrize("g_value", [-5.0, -1e-4])
def test_fp32_at_64k_tokens_is_within_1e4_of_float64(op_path, vector, g_value):
    """N = 65,536 with strong (g = −5) and weak (g = −1e-4) decay: fp32 outputs, final state and
    gradients are finite and within 1e-4 (relative to the largest value) of the same op in float64
    (which matches the recurrence, above)."""
    n, f = 65536, 8
    gen = torch.Generator().manual_seed(13)
    q, k = (torch.randn(1, 1, n, f, generator=gen, dtype=DT) for _ in range(2))
    v, w = (torch.randn(1, 1, n, f, generator=gen, dtype=DT) for _ in range(2))
    g = torch.full((1, 1, n, *((f,) if vector else ())), g_value, dtype=DT)
    fm = EluPlusOne(f)
    results = {}
    for dt in (torch.float32, torch.float64):
        inputs = [x.to(dt).requires_grad_() for x in (q, k, v, g)]
        o, kv = gated_linear_attention(*inputs, feature_map=fm.to(dt), return_state=True)
        grads = torch.autograd.grad((o * w.to(dt)).sum() + kv.sum(), inputs)
        results[dt] = [o, kv, *grads]
    for lo, hi in zip(results[torch.float32], results[torch.float64]):
        assert torch.isfinite(lo).all()
        err = (lo.double() - hi).abs().max().item() / hi.abs().max().item()
        assert err <= 1e-4, err


def _small(vector=False, normalize=False):
    q, k, v, g, fm, state = draw(1, 2, 6, 4, 3, vector=vector, elu=True, with_state=True, normalize=normalize,
                                 strength=0.5, seed=14, dtype=torch.float32)
    return q, k, v, g, fm, state


@pytest.mark.parametrize("bad, match", [
    (lambda g: g + 1.0, r"g \(the log of the decay\) must be ≤ 0 and finite, got [0-9]"),
    (lambda g: g.index_fill(2, torch.tensor([3]), float("nan")), "must be ≤ 0 and finite, got nan"),
    (lambda g: g.index_fill(2, torch.tensor([3]), float("-inf")), "must be ≤ 0 and finite, got -inf"),
])
@pytest.mark.parametrize("vector", [False, True])
def test_bad_gate_values_are_refused(op_path, bad, match, vector):
    q, k, v, g, fm, _ = _small(vector)
    with pytest.raises(ValueError, match=match):
        gated_linear_attention(q, k, v, bad(g), feature_map=fm)
    for grad in (False, True):  # the fused step checks g itself, the torch-op step in Python
        with torch.set_grad_enabled(grad), pytest.raises(ValueError, match=r"g \(the log of the decay\) must be"):
            gated_linear_attention_step(None, q[:, :, :1], k[:, :, :1], v[:, :, :1],
                                        bad(g)[:, :, 3:4].requires_grad_(grad), feature_map=fm)


def test_bad_gate_shape_dtype_and_device():
    q, k, v, g, fm, _ = _small()
    with pytest.raises(ValueError, match=r"g must have shape \(B, H, N\) = \(1, 2, 6\).*\(B, H, N, F\) = "
                                         r"\(1, 2, 6, 4\).*got \(1, 2, 5\)"):
        gated_linear_attention(q, k, v, g[:, :, :5], feature_map=fm)
    with pytest.raises(ValueError, match=r"got \(1, 2, 6, 3\)"):
        gated_linear_attention(q, k, v, g[..., None].expand(1, 2, 6, 3), feature_map=fm)
    with pytest.raises(TypeError, match="g must be a torch.Tensor, got float"):
        gated_linear_attention(q, k, v, -0.1, feature_map=fm)
    with pytest.raises(TypeError, match="g .* must be a floating tensor, got dtype torch.int64"):
        gated_linear_attention(q, k, v, torch.zeros(1, 2, 6, dtype=torch.long), feature_map=fm)
    with pytest.raises(ValueError, match=r"g must be on q's device \(cpu\), got meta"):
        gated_linear_attention(q, k, v, g.to("meta"), feature_map=fm)


@pytest.mark.parametrize("normalize", [False, True])
def test_a_state_of_the_other_form_is_refused(normalize):
    q, k, v, g, fm, state = _small(normalize=not normalize)
    form = "tensor" if normalize else "tuple"
    with pytest.raises(TypeError, match=rf"initial_state must be the .*normalize={normalize}, got a {form}"):
        gated_linear_attention(q, k, v, g, feature_map=fm, normalize=normalize, initial_state=state)
    with pytest.raises(TypeError, match=rf"state must be the .*normalize={normalize}, got a {form}"):
        gated_linear_attention_step(state, q[:, :, :1], k[:, :, :1], v[:, :, :1], g[:, :, :1], feature_map=fm,
                                    normalize=normalize)


def test_bad_state_and_the_checks_of_linear_attention():
    q, k, v, g, fm, state = _small()
    with pytest.raises(ValueError, match=r"initial_state must have shape \(B, H, F, E\) = \(1, 2, 4, 3\), got \(1, 2, 4, 4\)"):
        gated_linear_attention(q, k, v, g, feature_map=fm, initial_state=torch.zeros(1, 2, 4, 4))
    with pytest.raises(ValueError, match=r"initial_state kv must have shape"):
        gated_linear_attention(q, k, v, g, feature_map=fm, normalize=True, initial_state=(state, torch.zeros(1, 2, 4))[::-1])
    with pytest.raises(ValueError, match="chunk_size must be a positive int, got 0"):
        gated_linear_attention(q, k, v, g, chunk_size=0)
    with pytest.raises(ValueError, match="q must have 4 dimensions"):
        gated_linear_attention(q[0], k, v, g)
    with pytest.raises(ValueError, match="needs q and k of equal length, got 5 and 6"):
        gated_linear_attention(q[:, :, :5], k, v, g)
    with pytest.raises(TypeError, match="v.dtype must equal q.dtype"):
        gated_linear_attention(q, k, v.double(), g)
    with pytest.raises(ValueError, match="key_padding_mask must have shape"):
        gated_linear_attention(q, k, v, g, key_padding_mask=torch.ones(1, 5, dtype=torch.bool))
    with pytest.raises(TypeError, match="scale must be a float or None"):
        gated_linear_attention(q, k, v, g, scale="2")
    for bad in (-1e-6, float("nan")):
        with pytest.raises(ValueError, match=f"eps must be a finite float >= 0, got {bad!r}"):
            gated_linear_attention(q, k, v, g, eps=bad)
        with pytest.raises(ValueError, match=f"eps must be a finite float >= 0, got {bad!r}"):
            gated_linear_attention_step(None, q[:, :, :1], k[:, :, :1], v[:, :, :1], g[:, :, :1], eps=bad)
    with pytest.raises(TypeError, match="eps must be a finite float >= 0, got '1e-6'"):
        gated_linear_attention(q, k, v, g, eps="1e-6")
    for name in ("normalize", "return_state"):
        with pytest.raises(TypeError, match=f"{name} must be a bool, got str 'False'"):
            gated_linear_attention(q, k, v, g, **{name: "False"})
    with pytest.raises(TypeError, match="normalize must be a bool, got int 1"):
        gated_linear_attention_step(None, q[:, :, :1], k[:, :, :1], v[:, :, :1], g[:, :, :1], normalize=1)
    cos = make_feature_map("cosformer", 4, max_len=64)
    with pytest.raises(ValueError, match="take no positions, so a position-dependent feature map .*initial_state"):
        gated_linear_attention(q, k, v, g, feature_map=cos, initial_state=torch.zeros(1, 2, cos.feature_dim, 3))
