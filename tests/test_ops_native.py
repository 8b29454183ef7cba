"""The fused CPU step (linattn.ops.native) against the torch-op step and the quadratic oracle."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from linattn.nn.feature_maps import EluPlusOne
from linattn.ops import linear_attention, linear_attention_step, native
from linattn.nn.positional import RotaryEmbedding

from .conftest import oracle

needs_native = pytest.mark.skipif(not native.available(), reason="the fused CPU kernels could not be built here")


def _steps(q, k, v, fm, rope, normalize=True):
    """Token-by-token steps from no state; returns (outputs (B, H, N, E), final state)."""
    outs, state = [], None
    for t in range(q.shape[2]):
        o, state = linear_attention_step(state, q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], feature_map=fm,
                                         rope=rope, normalize=normalize, positions=torch.tensor([t]))
        outs.append(o)
    return torch.cat(outs, 2), state


def _eager(monkeypatch, fn):
    with monkeypatch.context() as m:
        m.setenv("LINATTN_NATIVE", "0")
        return fn()


@needs_native
@settings(max_examples=25, deadline=None)
@given(b=st.integers(1, 3), h=st.integers(1, 4), f=st.integers(1, 9), e=st.integers(1, 9), n=st.integers(1, 5),
       elu=st.booleans(), use_rope=st.booleans(), normalize=st.booleans(), seed=st.integers(0, 2**16))
def test_fused_steps_equal_the_oracle_in_float64(b, h, f, e, n, elu, use_rope, normalize, seed):
    """Shapes incl. F ≠ E, odd F with RoPE, B·H > 1: outputs and states against the quadratic oracle."""
    use_rope = use_rope and f >= 2
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(b, h, n, f, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(b, h, n, e, generator=g, dtype=torch.float64)
    fm = EluPlusOne(f).double() if elu else None
    if fm is None:  # identity: the inputs are the (non-negative) features
        q, k = q.abs() + 0.1, k.abs() + 0.1
    rope = RotaryEmbedding(f).double() if use_rope else None
    with torch.inference_mode():
        o, (kv, z) = _steps(q, k, v, fm, rope, normalize)
    o_ref, (kv_ref, z_ref) = oracle(q, k, v, causal=True, feature_map=fm, normalize=normalize, rope=rope)
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-11)
    torch.testing.assert_close(kv, kv_ref, rtol=1e-11, atol=1e-11)
    torch.testing.assert_close(z, z_ref, rtol=1e-11, atol=1e-11)


@needs_native
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("use_rope", [False, True])
def test_fused_step_equals_the_torch_op_step_in_float32(monkeypatch, normalize, use_rope):
    """B=2, H=8, F=E=64 (the benchmark's shape) from a random state, per-row positions with RoPE."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 8, 4, 64, generator=g) for _ in range(3))
    state = (torch.randn(2, 8, 64, 64, generator=g), torch.rand(2, 8, 64, generator=g) + 1)
    fm, rope = EluPlusOne(64), RotaryEmbedding(64) if use_rope else None

    def run():
        with torch.inference_mode():
            outs, st_ = [], state
            for t in range(4):
                o, st_ = linear_attention_step(st_, q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1],
                                               feature_map=fm, rope=rope, normalize=normalize,
                                               positions=torch.tensor([[10 + t], [20 + t]]))
                outs.append(o)
            return torch.cat(outs, 2), st_

    fused, fused_state = run()
    eager, eager_state = _eager(monkeypatch, run)
    torch.testing.assert_close(fused, eager, rtol=1e-5, atol=1e-5)
    for a, b_ in zip(fused_state, eager_state):
        torch.testing.assert_close(a, b_, rtol=1e-6, atol=1e-5)


@needs_native
def test_fused_step_takes_strided_inputs_and_leaves_the_state_alone():
    """q, k, v as the transposed views a layer makes from (B, N, H, D); the old state is not written."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 1, 3, 3 * 6, generator=g, dtype=torch.float64)  # (B, N, H, 3·D)
    q, k, v = (t.transpose(1, 2) for t in x.split(6, dim=-1))
    assert not q.is_contiguous()
    state = (torch.rand(2, 3, 6, 6, generator=g, dtype=torch.float64),
             torch.rand(2, 3, 6, generator=g, dtype=torch.float64))
    before = tuple(t.clone() for t in state)
    fm = EluPlusOne(6).double()
    with torch.inference_mode():
        o, new = linear_attention_step(state, q, k, v, feature_map=fm)
    o_ref, new_ref = linear_attention(q.contiguous(), k.contiguous(), v.contiguous(), causal=True, feature_map=fm,
                                      initial_state=state, return_state=True)
    torch.testing.assert_close(o, o_ref, rtol=1e-12, atol=1e-12)
    for a, b_ in zip(new, new_ref):
        torch.testing.assert_close(a, b_, rtol=1e-12, atol=1e-12)
    assert all(torch.equal(a, b_) for a, b_ in zip(state, before))


@needs_native
def test_steps_that_need_gradients_take_the_torch_ops_and_get_them():
    """With grad enabled and inputs that require it the step is differentiable: the gradients of two
    steps equal those of the chunked op."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 2, 4, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    fm = EluPlusOne(4).double()
    o, _ = _steps(q, k, v, fm, None)
    grads = torch.autograd.grad(o.square().sum(), (q, k, v))
    o_ref = linear_attention(q, k, v, causal=True, feature_map=fm)
    grads_ref = torch.autograd.grad(o_ref.square().sum(), (q, k, v))
    for a, b_ in zip(grads, grads_ref):
        torch.testing.assert_close(a, b_, rtol=1e-10, atol=1e-12)


@needs_native
def test_the_kernel_names_bad_shapes():
    kv, z = torch.zeros(1, 2, 4, 3), torch.zeros(1, 2, 4)
    q = k = torch.zeros(1, 2, 1, 4)
    with pytest.raises(RuntimeError, match="shapes of kv, z, q, k, v do not agree"):
        native.step((kv, z), q, k, torch.zeros(1, 2, 1, 5), phi=1, normalize=True, eps=1e-6)
    with pytest.raises(RuntimeError, match="z must have kv's dtype"):
        native.step((kv, z.double()), q, k, torch.zeros(1, 2, 1, 3), phi=1, normalize=True, eps=1e-6)
    with pytest.raises(RuntimeError, match="q, k, v must have the state's dtype, or be bf16 on a float32 state"):
        native.step((kv.double(), z.double()), q.bfloat16(), k.bfloat16(), torch.zeros(1, 2, 1, 3).bfloat16(), phi=1,
                    normalize=True, eps=1e-6)
    with pytest.raises(RuntimeError, match="q, k, v must share a dtype"):
        native.step((kv, z), q.bfloat16(), k, torch.zeros(1, 2, 1, 3), phi=1, normalize=True, eps=1e-6)


def test_fused_phi_picks_the_fused_path_only_where_it_applies(monkeypatch):
    monkeypatch.setattr(native, "available", lambda: True)
    st32 = (torch.zeros(1, 1, 4, 4), torch.zeros(1, 1, 4))
    x = torch.zeros(1, 1, 1, 4)
    assert native.fused_phi(EluPlusOne(4), None, None, st32, x, x, x) == 1
    assert native.fused_phi(None, None, None, st32, x, x, x) == 0
    from linattn.nn.feature_maps import make_feature_map

    assert native.fused_phi(make_feature_map("relu", 4), None, None, st32, x, x, x) is None
    assert native.fused_phi(EluPlusOne(4), 0.5, None, st32, x, x, x) is None
    assert native.fused_phi(EluPlusOne(4), None, torch.ones(1, 1, dtype=torch.bool), st32, x, x, x) is None
    xb = x.bfloat16()
    assert native.fused_phi(EluPlusOne(4), None, None, st32, xb, xb, xb) == 1  # bf16 inputs on a float32 state
    assert native.fused_phi(EluPlusOne(4), None, None, st32, xb, xb, xb, bf16=False) is None  # unless refused
    assert native.fused_phi(EluPlusOne(4), None, None, (st32[0].double(), st32[1].double()), xb, xb, xb) is None
    assert native.fused_phi(EluPlusOne(4), None, None, st32, xb, xb, x) is None  # mixed q/v dtypes
    xg = x.clone().requires_grad_()
    assert native.fused_phi(EluPlusOne(4), None, None, st32, xg, x, x) is None
    with torch.no_grad():
        assert native.fused_phi(EluPlusOne(4), None, None, st32, xg, x, x) == 1
    monkeypatch.setattr(native, "available", lambda: False)
    assert native.fused_phi(EluPlusOne(4), None, None, st32, x, x, x) is None


def test_environment_switch_is_read_at_every_call(monkeypatch):
    """The switch follows os.environ as it changes (set, changed, unset), not a value read once."""
    monkeypatch.delenv("LINATTN_NATIVE", raising=False)
    assert native.enabled()
    for value, on in (("0", False), ("1", True), ("No", False), ("yes", True), ("OFF", False)):
        monkeypatch.setenv("LINATTN_NATIVE", value)
        assert native.enabled() is on, value
    monkeypatch.delenv("LINATTN_NATIVE")
    assert native.enabled()
    reader = native._environ_reader("LINATTN_TEST_SWITCH_VALUE")
    assert reader() is None
    monkeypatch.setenv("LINATTN_TEST_SWITCH_VALUE", "é x")
    assert reader() == "é x"


def test_environment_switch_and_a_failed_build_fall_back_with_one_warning(monkeypatch):
    monkeypatch.setenv("LINATTN_NATIVE", "off")
    assert not native.enabled() and not native.available()
    monkeypatch.setenv("LINATTN_NATIVE", "1")
    monkeypatch.setattr(native, "_state", {"loaded": None, "error": None})

    def broken(*args, **kwargs):
        raise OSError("no compiler here")

    import torch.utils.cpp_extension as cpp

    monkeypatch.setattr(cpp, "load", broken)
    with pytest.warns(RuntimeWarning, match="no compiler here"):
        assert native.load() is False
    assert native.load() is False  # remembered: no second build, no second warning
    fm = EluPlusOne(3).double()
    q, k, v = (torch.randn(1, 1, 1, 3, dtype=torch.float64) for _ in range(3))
    with torch.inference_mode():
        o, _ = linear_attention_step(None, q, k, v, feature_map=fm)
    torch.testing.assert_close(o, oracle(q, k, v, causal=True, feature_map=fm)[0], rtol=1e-12, atol=1e-12)


@needs_native
@settings(max_examples=20, deadline=None)
@given(rows=st.integers(1, 40), d=st.integers(1, 300), transpose=st.booleans(), seed=st.integers(0, 2**16))
def test_fused_rms_norm_equals_torch_in_float64(rows, d, transpose, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, d, generator=g, dtype=torch.float64) * 3
    if transpose:  # a strided input
        x = torch.randn(d, rows, generator=g, dtype=torch.float64).t()
    w = torch.randn(d, generator=g, dtype=torch.float64)
    torch.testing.assert_close(native.rms_norm(x, w, 1e-5), torch.nn.functional.rms_norm(x, (d,), w, 1e-5),
                               rtol=1e-12, atol=1e-12)


@needs_native
def test_rmsnorm_layer_is_the_same_with_and_without_gradients():
    """The layer takes the fused operator only without gradients; both give the same numbers (fp32)."""
    from linattn.nn.norms import RMSNorm

    torch.manual_seed(0)
    norm = RMSNorm(64)
    with torch.no_grad():
        norm.weight.mul_(torch.rand(64) + 0.5)
    x = torch.randn(2, 7, 64)
    assert native.rms_norm_fusable(x, norm.weight.detach()) and not native.rms_norm_fusable(x, norm.weight)
    with torch.no_grad():
        fused = norm(x)
    plain = norm(x)
    assert plain.requires_grad
    torch.testing.assert_close(fused, plain.detach(), rtol=2e-6, atol=2e-6)
    assert not native.rms_norm_fusable(x.bfloat16(), norm.weight.detach())


def _draw_chunked_case(b, h, n, f, e, elu, with_state, seed):
    """float64 q, k (B, H, N, F), v (B, H, N, E), φ (elu+1, or None with positive q, k) and an initial
    state (kv, z ≥ 1) or None."""
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(b, h, n, f, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(b, h, n, e, generator=g, dtype=torch.float64)
    fm = EluPlusOne(f).double() if elu else None
    if fm is None:
        q, k = q.abs() + 0.1, k.abs() + 0.1
    state = ((torch.rand(b, h, f, e, generator=g, dtype=torch.float64),
              torch.rand(b, h, f, generator=g, dtype=torch.float64) + 1) if with_state else None)
    return q, k, v, fm, state


@needs_native
@settings(max_examples=25, deadline=None)
@given(b=st.integers(1, 2), h=st.integers(1, 3), n=st.integers(1, 140), f=st.integers(1, 9), e=st.integers(1, 9),
       chunk=st.sampled_from([1, 7, 16, 64]), elu=st.booleans(), normalize=st.booleans(), with_state=st.booleans(),
       seed=st.integers(0, 2**16))
def test_fused_chunked_forward_equals_the_oracle_in_float64(b, h, n, f, e, chunk, elu, normalize, with_state, seed):
    """Inference forward (no gradient wanted): outputs and final state against the quadratic oracle,
    N=1 and N not a multiple of the chunk included."""
    q, k, v, fm, state = _draw_chunked_case(b, h, n, f, e, elu, with_state, seed)
    assert native.chunked_ready(torch.float64)
    with torch.no_grad():
        o, (kv, z) = linear_attention(q, k, v, causal=True, feature_map=fm, normalize=normalize, chunk_size=chunk,
                                      initial_state=state, return_state=True)
    o_ref, (kv_ref, z_ref) = oracle(q, k, v, causal=True, feature_map=fm, normalize=normalize, initial_state=state)
    torch.testing.assert_close(o, o_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(kv, kv_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(z, z_ref, rtol=1e-10, atol=1e-10)


@needs_native
def test_fused_chunked_forward_equals_the_autograd_op_in_float32(monkeypatch):
    """The benchmark's shape class (B·H = 8, F = E = 64, N with a tail), strided inputs, and the initial
    state left alone."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(1, 1000, 8, 3 * 64, generator=g)
    q, k, v = (t.transpose(1, 2) for t in x.split(64, dim=-1))
    state = (torch.rand(1, 8, 64, 64, generator=g), torch.rand(1, 8, 64, generator=g))
    before = tuple(t.clone() for t in state)
    fm = EluPlusOne(64)

    def run():
        with torch.no_grad():
            return linear_attention(q, k, v, causal=True, feature_map=fm, initial_state=state, return_state=True)

    fused, (kv, z) = run()
    plain, (kv_p, z_p) = _eager(monkeypatch, run)
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kv, kv_p, rtol=1e-5, atol=1e-3)
    torch.testing.assert_close(z, z_p, rtol=1e-5, atol=1e-3)
    assert all(torch.equal(a, b_) for a, b_ in zip(state, before))


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fused_chunked_features_are_elu_plus_one_within_an_ulp(dtype):
    """The fused forward computes exp of its own (a polynomial, so that the loop vectorizes): one
    token's final z is φ(k) itself, checked against exp/x+1 in float64 from -120 to 5 (underflow
    included): within one ulp of the dtype where φ is normal (from 1.00001× the smallest normal up),
    and beneath it no larger than the smallest normal (the kernel clamps x there, without a branch)."""
    x = torch.cat([torch.linspace(-120, 5, 100_001, dtype=torch.float64),
                   torch.tensor([0.0, -0.0, -1e-30, 1e-30, -87.3, -87.34, -708.3, -708.4], dtype=torch.float64)]).to(dtype)
    k = x.view(1, 1, 1, -1)
    f = k.shape[-1]
    state = (torch.zeros(1, 1, f, 1, dtype=dtype), torch.zeros(1, 1, f, dtype=dtype))
    _, (_, z) = native.chunked(torch.zeros_like(k), k, torch.ones(1, 1, 1, 1, dtype=dtype), state, phi=1,
                               normalize=True, eps=1e-6, chunk=64)
    xd = x.double()
    want = torch.where(xd > 0, xd + 1, torch.exp(xd))
    got = z.view(-1).double()
    info = torch.finfo(dtype)
    normal = want >= info.tiny * 1.00001
    assert ((got - want).abs() / want)[normal].max() <= info.eps
    assert (got[~normal] <= info.tiny * 1.00001).all()
    assert (got >= 0).all()


@needs_native
@pytest.mark.parametrize("n", [1, 70, 600])
def test_fused_chunked_forward_in_bf16_is_as_close_to_the_oracle_as_the_torch_ops(monkeypatch, bf16_path, n):
    """bf16 q, k, v on a float32 state (MKL's bf16 gemm or fp32 gemms on widened blocks, fp32 scores
    and accumulation): its error against the float64 oracle is no larger than the torch-op path's on
    the same path."""
    if not native.chunked_ready(torch.bfloat16):
        pytest.skip("no bf16 gemm in this torch")
    g = torch.Generator().manual_seed(8)
    lo = [torch.randn(2, 4, n, 64, generator=g).bfloat16() for _ in range(3)]
    fm = EluPlusOne(64)
    want, (_, z_want) = oracle(*(x.double() for x in lo), causal=True, feature_map=fm.double())

    def run():
        with torch.no_grad():
            return linear_attention(*lo, causal=True, feature_map=fm, return_state=True)

    fused, (kv, z) = run()
    plain, (kv_p, z_p) = _eager(monkeypatch, run)
    assert fused.dtype == torch.bfloat16 and kv.dtype == z.dtype == torch.float32
    err_fused = (fused.double() - want).abs().max().item()
    err_plain = (plain.double() - want).abs().max().item()
    ulp = 2.0 ** (math.floor(math.log2(want.abs().max().item())) - 7)  # of bf16 at the outputs' size
    assert err_fused <= err_plain + ulp, (err_fused, err_plain)
    # z accumulates in float32 (the torch-op path rounds each chunk's sum to bf16 first); both start
    # from the same bf16 features, whose rounding dominates the error against the oracle
    rel = lambda x: ((x.double() - z_want).abs() / z_want.abs()).max().item()  # noqa: E731
    assert rel(z) <= rel(z_p) + 1e-6


def _loss_grads(outs, inputs, seed=7):
    """Gradients of a random linear functional of (o, kv, z) with respect to `inputs`."""
    g = torch.Generator().manual_seed(seed)
    w = [torch.randn(x.shape, generator=g, dtype=torch.float64).to(x.dtype) for x in outs]
    return torch.autograd.grad(sum((x * wx).sum() for x, wx in zip(outs, w)), inputs)


@needs_native
@settings(max_examples=30, deadline=None)
@given(b=st.integers(1, 2), h=st.integers(1, 3), n=st.one_of(st.integers(1, 140), st.integers(500, 1100)),
       f=st.integers(1, 7), e=st.integers(1, 7), chunk=st.sampled_from([1, 7, 16, 64]), elu=st.booleans(),
       normalize=st.booleans(), with_state=st.booleans(), seed=st.integers(0, 2**16))
def test_fused_training_forward_and_backward_equal_the_oracle_in_float64(b, h, n, f, e, chunk, elu, normalize,
                                                                         with_state, seed):
    """Gradients wanted: the fused forward (saving denominators and block states) and the fused
    backward against the float64 oracle: outputs, final state, and the gradients of q, k, v and the
    initial state. N = 1, tails, and N past one 512-token block (the backward carries the state
    gradient across blocks and recomputes the chunk states inside each)."""
    q, k, v, fm, state = _draw_chunked_case(b, h, n, f, e, elu, with_state, seed)
    inputs = [x.requires_grad_() for x in (q, k, v, *(state or ()))]
    o, (kv, z) = linear_attention(q, k, v, causal=True, feature_map=fm, normalize=normalize, chunk_size=chunk,
                                  initial_state=state, return_state=True)
    assert type(o.grad_fn).__name__ == "FusedChunkedCausalBackward"
    o_ref, (kv_ref, z_ref) = oracle(q, k, v, causal=True, feature_map=fm, normalize=normalize, initial_state=state)
    for got, want in zip((o, kv, z), (o_ref, kv_ref, z_ref)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    for got, want in zip(_loss_grads((o, kv, z), inputs), _loss_grads((o_ref, kv_ref, z_ref), inputs)):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9 * max(1.0, want.abs().max().item()))


@needs_native
def test_fused_training_passes_gradcheck():
    """Finite differences in float64 through q, k, v and the initial state, chunk 2 over 5 tokens."""
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(1, 2, 5, 3, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    kv0 = torch.rand(1, 2, 3, 3, generator=g, dtype=torch.float64, requires_grad=True)
    z0 = (torch.rand(1, 2, 3, generator=g, dtype=torch.float64) + 1).requires_grad_()
    fm = EluPlusOne(3).double()

    def f(q, k, v, kv0, z0):
        o, (kv, z) = linear_attention(q, k, v, causal=True, feature_map=fm, chunk_size=2, initial_state=(kv0, z0),
                                      return_state=True)
        assert type(o.grad_fn).__name__ == "FusedChunkedCausalBackward"
        return o, kv, z

    assert torch.autograd.gradcheck(f, (q, k, v, kv0, z0))


@needs_native
def test_fused_training_equals_the_autograd_op_in_float32(monkeypatch):
    """The benchmark's shape class (B·H = 8, F = E = 64) with strided inputs and a tail, the output
    used alone (the final state's gradients are None) and with the state."""
    g = torch.Generator().manual_seed(10)
    x = torch.randn(1, 1000, 8, 3 * 64, generator=g, requires_grad=True)
    fm = EluPlusOne(64)

    def run(with_state):
        q, k, v = (t.transpose(1, 2) for t in x.split(64, dim=-1))
        o, (kv, z) = linear_attention(q, k, v, causal=True, feature_map=fm, return_state=True)
        loss = (o * o.detach().sin()).sum() + (kv.sum() + z.sum() if with_state else 0)
        return o.detach(), torch.autograd.grad(loss, x)[0], type(o.grad_fn).__name__

    for with_state in (False, True):
        o, gx, name = run(with_state)
        o_ref, gx_ref, name_ref = _eager(monkeypatch, lambda: run(with_state))
        assert (name, name_ref) == ("FusedChunkedCausalBackward", "ChunkedCausalLinearAttentionBackward")
        torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(gx, gx_ref, rtol=1e-4, atol=1e-4 * gx_ref.abs().max().item())


@needs_native
def test_fused_training_in_bf16_is_as_close_to_the_oracle_as_the_torch_ops(monkeypatch, bf16_path):
    """bf16 inputs on a float32 state, either path: the gradients' error against the float64 oracle is
    within a bf16 ulp of the torch-op path's (the fused path keeps G, P and every accumulation in
    float32)."""
    if not native.chunked_ready(torch.bfloat16):
        pytest.skip("no bf16 gemm in this torch")
    g = torch.Generator().manual_seed(11)
    lo = [torch.randn(2, 4, 600, 64, generator=g).bfloat16().requires_grad_() for _ in range(3)]
    fm = EluPlusOne(64)
    hi = [x.detach().double().requires_grad_() for x in lo]
    o_ref = oracle(*hi, causal=True, feature_map=fm.double())[0]
    w = torch.randn(o_ref.shape, generator=g, dtype=torch.float64)
    want = torch.autograd.grad((o_ref * w).sum(), hi)

    def run():
        o = linear_attention(*lo, causal=True, feature_map=fm)
        return torch.autograd.grad((o * w.bfloat16()).sum(), lo), type(o.grad_fn).__name__

    fused, name = run()
    plain, name_ref = _eager(monkeypatch, run)
    assert (name, name_ref) == ("FusedChunkedCausalBackward", "ChunkedCausalLinearAttentionBackward")
    for a, b_, ref in zip(fused, plain, want):
        ulp = 2.0 ** (math.floor(math.log2(ref.abs().max().item())) - 7)
        err_fused, err_plain = ((x.double() - ref).abs().max().item() for x in (a, b_))
        assert err_fused <= err_plain + ulp, (err_fused, err_plain)


@needs_native
def test_large_results_reuse_pooled_buffers(monkeypatch):
    """A freed result of 8 MiB or more goes back to the pool and the next result of its size takes
    it; the pool holds no more than LINATTN_POOL_MB; with 0 it is off; release_pool empties it."""
    q = torch.rand(1, 1, 32768, 64)  # o: 8 MiB
    state = (torch.zeros(1, 1, 64, 64), torch.zeros(1, 1, 64))

    def forward():
        with torch.no_grad():
            return native.chunked(q, q, q, state, phi=0, normalize=True, eps=1e-6, chunk=64)[0]

    native.release_pool()
    first = forward()
    ptr, want = first.data_ptr(), first.clone()
    del first
    second = forward()
    assert second.data_ptr() == ptr and torch.equal(second, want)
    third = forward()  # the pool is empty while `second` lives: a new buffer
    assert third.data_ptr() != ptr
    monkeypatch.setenv("LINATTN_POOL_MB", "8")
    del second, third  # the cap keeps one of the two
    assert native.release_pool() == 8 << 20
    assert native.release_pool() == 0
    monkeypatch.setenv("LINATTN_POOL_MB", "0")
    forward()  # made and freed with the pool off: not kept
    assert native.release_pool() == 0 and torch.equal(forward(), want)


_FAILED_BUILD = """
import warnings
warnings.simplefilter("always")
from linattn.ops import native
with warnings.catch_warnings(record=True) as caught:
    assert native.load() is False
print("\\n".join(str(w.message) for w in caught if issubclass(w.category, RuntimeWarning) and "linattn" in str(w.message)))
"""


def test_a_failed_build_warns_with_its_cause(tmp_path):
    """The warning once stopped at 300 characters, inside the compiler's command line, so the cause never
    showed. A compiler that does not exist, in a fresh extension folder, in a subprocess (the build is
    process-wide state)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "CXX": str(tmp_path / "no-such-c++"), "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"),
           "LINATTN_NATIVE": "1"}
    res = subprocess.run([sys.executable, "-c", _FAILED_BUILD], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    message = res.stdout.strip()
    assert message.count("could not be built") == 1, message
    assert f"{tmp_path / 'no-such-c++'}: not found" in message, message  # the cause, from the shell
    assert "-DTORCH_EXTENSION_NAME" not in message and len(message) < 1200, message  # no command lines


def test_a_killed_build_does_not_hang_the_next_one(tmp_path):
    """A build killed midway leaves torch's lock file in the extension folder, and torch then waited
    for it forever in every later process (seen: a test run hung for half an hour). The next build
    must go ahead: here it starts, and fails fast on a compiler that does not exist."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "CXX": str(tmp_path / "no-such-c++"), "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"),
           "LINATTN_NATIVE": "1"}
    where = subprocess.run([sys.executable, "-c", "from linattn.ops import native; print(native._build_directory())"],
                           env=env, capture_output=True, text=True, timeout=120)
    assert where.returncode == 0, where.stderr[-2000:]
    (Path(where.stdout.strip()) / "lock").touch()  # what a killed build leaves
    res = subprocess.run([sys.executable, "-c", _FAILED_BUILD], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "could not be built" in res.stdout, res.stdout


def test_two_checkouts_of_the_same_sources_build_in_two_folders(tmp_path, monkeypatch):
    """torch rebuilds an extension whose source paths changed: two checkouts sharing one folder would
    rebuild at every switch (seen: worktrees of this repository rebuilding each other's kernels)."""
    import shutil

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    here = Path(native._build_directory())
    copy = tmp_path / "csrc"
    shutil.copytree(native._CSRC, copy)
    monkeypatch.setattr(native, "_CSRC", copy)
    there = Path(native._build_directory())
    assert there != here and there.parent == here.parent
