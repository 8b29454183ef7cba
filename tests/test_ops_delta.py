"""The delta rule (DeltaNet, Gated DeltaNet) against the float64 token-by-token recurrence: outputs,
final state and the gradients of q, k, v, beta, g and the initial state, on both CPU paths."""

import functools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from linattn.ops import delta_rule, delta_rule_step, native
from linattn.ops.delta import fused
from linattn.ops.delta.reference import delta_rule_recurrent

DT = torch.float64


@pytest.fixture(autouse=True)
def _both_paths(op_path):
    """Every test here runs on both CPU paths: the fused kernels and the torch-op autograd Function
    (LINATTN_NATIVE=0)."""
    assert fused.usable(torch.empty(1)) == (op_path == "fused")
    return op_path


def make_inputs(b, h, n, d, e, *, gated, l2norm, seed=0, dtype=DT, state=False):
    """q, k (B, H, N, D), v (B, H, N, E), beta (B, H, N) in (0, 1), g (B, H, N) ≤ 0 or None, S0 or None.
    Without l2norm the keys come normalized (the recurrence is only stable for β‖k‖² ≤ 2)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, n, d, generator=gen, dtype=DT)
    k = torch.randn(b, h, n, d, generator=gen, dtype=DT)
    if not l2norm:
        k = torch.nn.functional.normalize(k, dim=-1)
    v = torch.randn(b, h, n, e, generator=gen, dtype=DT)
    beta = torch.rand(b, h, n, generator=gen, dtype=DT) * 0.98 + 0.01
    g = torch.nn.functional.logsigmoid(torch.randn(b, h, n, generator=gen, dtype=DT) + 2) if gated else None
    S0 = torch.randn(b, h, d, e, generator=gen, dtype=DT) if state else None
    return [None if x is None else x.to(dtype) for x in (q, k, v, beta, g, S0)]


def compare(q, k, v, beta, g, S0, *, scale=None, l2norm=False, chunk=64, tol=1e-10):
    """Output, final state and the gradients of a random functional of both agree with the recurrence."""
    leaves = [None if x is None else x.detach().clone().requires_grad_() for x in (q, k, v, beta, g, S0)]
    qq, kk, vv, bb, gg, SS = leaves
    o, S = delta_rule(qq, kk, vv, bb, g=gg, scale=scale, qk_l2norm=l2norm, initial_state=SS, return_state=True,
                      chunk_size=chunk)
    ro, rS = delta_rule_recurrent(qq, kk, vv, bb, g=gg, scale=scale, qk_l2norm=l2norm, initial_state=SS)
    gen = torch.Generator().manual_seed(7)
    wo, wS = torch.randn(o.shape, generator=gen, dtype=DT), torch.randn(S.shape, generator=gen, dtype=DT)
    wrt = [x for x in leaves if x is not None]
    got = torch.autograd.grad((o * wo).sum() + (S * wS).sum(), wrt)
    want = torch.autograd.grad((ro * wo).sum() + (rS * wS).sum(), wrt)
    assert o.dtype == q.dtype and S.dtype == DT
    torch.testing.assert_close(o, ro, atol=tol * max(1.0, ro.abs().max().item()), rtol=0)
    torch.testing.assert_close(S, rS, atol=tol * max(1.0, rS.abs().max().item()), rtol=0)
    names = [n for n, x in zip(("q", "k", "v", "beta", "g", "initial_state"), leaves) if x is not None]
    for name, a, b_ in zip(names, got, want):
        torch.testing.assert_close(a, b_, atol=tol * max(1.0, b_.abs().max().item()), rtol=0, msg=lambda m: f"d{name}: {m}")


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(b=st.integers(1, 2), h=st.integers(1, 3), n=st.integers(1, 80), d=st.integers(1, 40), e=st.integers(1, 40),
       chunk=st.sampled_from([1, 3, 8, 16, 64]), gated=st.booleans(), l2norm=st.booleans(), state=st.booleans(),
       scale=st.sampled_from([None, 0.5]), seed=st.integers(0, 2**16))
def test_matches_the_recurrence(b, h, n, d, e, chunk, gated, l2norm, state, scale, seed):
    """Random shapes: N = 1, tails (N not a multiple of the chunk), D ≠ E, B·H > 1, D and E on both
    sides of the kernels' register strips (16 doubles)."""
    compare(*make_inputs(b, h, n, d, e, gated=gated, l2norm=l2norm, seed=seed, state=state), scale=scale,
            l2norm=l2norm, chunk=chunk)


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("l2norm", [False, True])
@pytest.mark.parametrize("n", [1, 37, 300])
def test_deltanet_and_gated_deltanet(gated, l2norm, n):
    """Explicit cases: one token, a tail of 5 after whole chunks, and a sequence over the fused
    kernels' 256-token blocks (states saved per block, chunks recomputed in the backward)."""
    compare(*make_inputs(2, 2, n, 20, 36, gated=gated, l2norm=l2norm, seed=n, state=True), l2norm=l2norm, chunk=16)


@pytest.mark.parametrize("gated", [False, True])
def test_chunks_that_do_not_divide_the_saved_blocks(gated):
    """Chunks of 48: the fused kernels save a state every 240 tokens (whole chunks), 500 = 2·240 + 20."""
    compare(*make_inputs(1, 3, 500, 16, 16, gated=gated, l2norm=True, seed=14, state=True), l2norm=True, chunk=48)


def test_strong_decay_and_extreme_beta():
    """Decays down to e^-30 per token (gate factors far below the smallest normal float inside a chunk)
    and β at both ends of (0, 1]."""
    q, k, v, beta, g, S0 = make_inputs(1, 2, 70, 8, 8, gated=True, l2norm=True, seed=3, state=True)
    g = -torch.rand(g.shape, dtype=DT, generator=torch.Generator().manual_seed(1)) * 30
    beta = torch.where(torch.arange(70) % 3 == 0, torch.ones_like(beta), beta)
    beta[..., 1::3] = 1e-6
    compare(q, k, v, beta, g, S0, l2norm=True, chunk=32)


def test_strided_inputs():
    """Non-contiguous q, k, v, beta, g and initial state give the contiguous result."""
    q, k, v, beta, g, S0 = make_inputs(2, 3, 29, 6, 5, gated=True, l2norm=True, seed=4, state=True)
    views = (q.transpose(1, 2).contiguous().transpose(1, 2), k.transpose(2, 3).contiguous().transpose(2, 3),
             torch.stack([v, v], -1)[..., 1], beta.transpose(0, 1).contiguous().transpose(0, 1),
             torch.stack([g, g], -1)[..., 0], S0.transpose(2, 3).contiguous().transpose(2, 3))
    assert not any(x.is_contiguous() for x in views)
    torch.testing.assert_close(views[2], v)
    o, S = delta_rule(*views[:4], g=views[4], qk_l2norm=True, initial_state=views[5], return_state=True, chunk_size=8)
    o2, S2 = delta_rule(q, k, v, beta, g=g, qk_l2norm=True, initial_state=S0, return_state=True, chunk_size=8)
    torch.testing.assert_close(o, o2, atol=1e-13, rtol=0)
    torch.testing.assert_close(S, S2, atol=1e-13, rtol=0)
    compare(*views, l2norm=True, chunk=8)


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("split", [1, 17, 64])
def test_split_and_resume_equals_one_call(gated, split):
    q, k, v, beta, g, _ = make_inputs(2, 2, 90, 7, 9, gated=gated, l2norm=True, seed=5)
    parts = [(x[:, :, :split], x[:, :, split:]) if x is not None else (None, None) for x in (q, k, v, beta, g)]
    o1, S1 = delta_rule(*[p[0] for p in parts[:4]], g=parts[4][0], qk_l2norm=True, return_state=True, chunk_size=16)
    o2, S2 = delta_rule(*[p[1] for p in parts[:4]], g=parts[4][1], qk_l2norm=True, initial_state=S1,
                        return_state=True, chunk_size=16)
    o, S = delta_rule(q, k, v, beta, g=g, qk_l2norm=True, return_state=True, chunk_size=16)
    torch.testing.assert_close(torch.cat([o1, o2], 2), o, atol=1e-12, rtol=0)
    torch.testing.assert_close(S2, S, atol=1e-12, rtol=0)


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("grad", [False, True])
def test_steps_equal_the_parallel_form(gated, grad):
    """Token by token (the fused step without gradients, the torch-op step with them), then a block of
    several tokens, against one parallel call; gradients of the steps against the parallel form's."""
    q, k, v, beta, g, S0 = make_inputs(2, 3, 23, 5, 6, gated=gated, l2norm=True, seed=6, state=True)
    leaves = [None if x is None else x.clone().requires_grad_(grad) for x in (q, k, v, beta, g, S0)]
    state, outs = leaves[5], []
    for t in range(20):
        sl = [None if x is None else x[:, :, t:t + 1] for x in leaves[:5]]
        o_t, state = delta_rule_step(state, *sl[:4], g=sl[4], scale=0.8, qk_l2norm=True)
        assert o_t.shape == (2, 3, 1, 6)
        outs.append(o_t)
    sl = [None if x is None else x[:, :, 20:] for x in leaves[:5]]
    o_blk, state = delta_rule_step(state, *sl[:4], g=sl[4], scale=0.8, qk_l2norm=True)
    o_steps = torch.cat(outs + [o_blk], 2)
    o, S = delta_rule(*leaves[:4], g=leaves[4], scale=0.8, qk_l2norm=True, initial_state=leaves[5], return_state=True,
                      chunk_size=8)
    torch.testing.assert_close(o_steps, o, atol=1e-12, rtol=0)
    torch.testing.assert_close(state, S, atol=1e-12, rtol=0)
    if grad:
        wrt = [x for x in leaves if x is not None]
        w = torch.randn(o.shape, dtype=DT, generator=torch.Generator().manual_seed(2))
        got = torch.autograd.grad((o_steps * w).sum() + state.sum(), wrt)
        want = torch.autograd.grad((o * w).sum() + S.sum(), wrt)
        for a, b_ in zip(got, want):
            torch.testing.assert_close(a, b_, atol=1e-11, rtol=0)


def test_step_leaves_the_state_alone_and_takes_a_strided_one():
    q, k, v, beta, g, S0 = make_inputs(2, 2, 1, 4, 7, gated=True, l2norm=False, seed=8, state=True)
    S_t = S0.transpose(2, 3).contiguous().transpose(2, 3)
    before = S_t.clone()
    o, S = delta_rule_step(S_t, q, k, v, beta, g=g)
    assert torch.equal(S_t, before)
    ro, rS = delta_rule_recurrent(q, k, v, beta, g=g, initial_state=S0)
    torch.testing.assert_close(o, ro, atol=1e-13, rtol=0)
    torch.testing.assert_close(S, rS, atol=1e-13, rtol=0)


def test_step_from_no_state_and_float32_state_for_low_precision():
    q, k, v, beta, g, _ = make_inputs(1, 2, 1, 8, 8, gated=True, l2norm=True, seed=9)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        o, S = delta_rule_step(None, q.to(dtype), k.to(dtype), v.to(dtype), beta.to(dtype), g=g.to(dtype),
                               qk_l2norm=True)
        assert o.dtype == dtype and S.dtype == torch.float32
        ro, rS = delta_rule_recurrent(*(x.to(dtype).double() for x in (q, k, v, beta)), g=g.to(dtype).double(),
                                      qk_l2norm=True)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(o.double(), ro, atol=tol, rtol=0)
        torch.testing.assert_close(S.double(), rS, atol=tol, rtol=0)


@functools.lru_cache(maxsize=2)
def long_run(gated: bool):
    """Inputs of 65,536 tokens and the float64 recurrence's (o, S) on them (computed once: ~4 s)."""
    inputs = make_inputs(1, 1, 65536, 8, 8, gated=gated, l2norm=True, seed=11)
    with torch.no_grad():
        return inputs, delta_rule_recurrent(*inputs[:4], g=inputs[4], qk_l2norm=True)


@pytest.mark.parametrize("gated", [False, True])
def test_float32_over_65536_tokens_stays_within_1e4_of_float64(gated):
    """A long fp32 run is finite and within 1e-4 (relative to the largest value) of the float64
    recurrence, output and final state."""
    (q, k, v, beta, g, _), (ro, rS) = long_run(gated)
    with torch.no_grad():
        o, S = delta_rule(*(x.float() for x in (q, k, v, beta)), g=None if g is None else g.float(), qk_l2norm=True,
                          return_state=True)
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    assert (o.double() - ro).abs().max() <= 1e-4 * ro.abs().max()
    assert (S.double() - rS).abs().max() <= 1e-4 * rS.abs().max()


def test_gradcheck():
    """Finite differences of the whole op (both paths), DeltaNet and Gated DeltaNet in one call each."""
    for gated in (False, True):
        q, k, v, beta, g, S0 = make_inputs(1, 2, 7, 3, 2, gated=gated, l2norm=True, seed=12, state=True)
        args = [x.requires_grad_() for x in (q, k, v, beta) + ((g,) if gated else ()) + (S0,)]

        def fn(*xs):
            gg, s0 = (xs[4], xs[5]) if gated else (None, xs[4])
            o, S = delta_rule(*xs[:4], g=gg, qk_l2norm=True, initial_state=s0, return_state=True, chunk_size=4)
            return o, S

        assert torch.autograd.gradcheck(fn, args, eps=1e-6, atol=1e-7, fast_mode=True)


def test_only_the_final_state_or_only_the_output_gets_a_gradient():
    q, k, v, beta, g, S0 = make_inputs(1, 2, 40, 5, 5, gated=True, l2norm=True, seed=13, state=True)
    leaves = [x.requires_grad_() for x in (q, k, v, beta, g, S0)]
    o, S = delta_rule(*leaves[:4], g=leaves[4], qk_l2norm=True, initial_state=leaves[5], return_state=True,
                      chunk_size=16)
    ro, rS = delta_rule_recurrent(*leaves[:4], g=leaves[4], qk_l2norm=True, initial_state=leaves[5])
    for out, ref in ((S, rS), (o, ro)):
        got = torch.autograd.grad(out.sum(), leaves, retain_graph=True, allow_unused=True)
        want = torch.autograd.grad(ref.sum(), leaves, retain_graph=True, allow_unused=True)
        for x, a, b_ in zip(leaves, got, want):  # S does not depend on q: the reference gives no gradient
            torch.testing.assert_close(torch.zeros_like(x) if a is None else a, torch.zeros_like(x) if b_ is None else b_,
                                       atol=1e-11, rtol=0)


def _good(b=1, h=2, n=6, d=4, e=3, dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(b, h, n, d, generator=gen, dtype=dtype) for _ in range(2))
    v = torch.randn(b, h, n, e, generator=gen, dtype=dtype)
    return q, k, v, torch.full((b, h, n), 0.5, dtype=dtype), torch.full((b, h, n), -0.1, dtype=dtype)


@pytest.mark.parametrize("step", [False, True])
def test_bad_values_of_beta_and_g_are_refused(step):
    """β outside [0, 2] or not finite, g > 0 or not finite: a ValueError naming the argument, from the
    chunked op and from the step (whose fused kernel checks them itself)."""
    q, k, v, beta, g = _good(n=1 if step else 6)

    def call(beta_, g_):
        if step:
            return delta_rule_step(None, q, k, v, beta_, g=g_)
        return delta_rule(q, k, v, beta_, g=g_)

    for bad in (-1e-30, 2.5, 2.0000005, -0.2, float("nan"), float("inf")):
        b2 = beta.clone()
        b2[0, 1, 0] = bad
        with pytest.raises(ValueError, match=r"beta must lie in \[0, 2\]"):
            call(b2, g)
    for bad in (0.3, float("nan"), float("-inf"), float("inf")):
        g2 = g.clone()
        g2[0, 0, -1] = bad
        with pytest.raises(ValueError, match="g must be a finite log-decay ≤ 0"):
            call(beta, g2)
    call(torch.full_like(beta, 2.0), torch.zeros_like(g))  # the closed ends are allowed
    call(torch.zeros_like(beta), g)


@pytest.mark.parametrize("step", [False, True])
def test_bad_shapes_dtypes_devices_and_states_name_the_argument(step):
    q, k, v, beta, g = _good(n=1 if step else 6)

    def call(*args, **kw):
        if step:
            state = kw.pop("initial_state", None)
            kw.pop("chunk_size", None)
            return delta_rule_step(state, *args, **kw)
        return delta_rule(*args, **kw)

    n = q.shape[2]
    with pytest.raises(ValueError, match=r"q must have 4 dimensions"):
        call(q[0], k, v, beta)
    with pytest.raises(TypeError, match="v must be a torch.Tensor, got list"):
        call(q, k, [1], beta)
    with pytest.raises(TypeError, match="k.dtype must equal q.dtype"):
        call(q, k.double(), v, beta)
    with pytest.raises(ValueError, match="k head dim must equal q's"):
        call(q, k[..., :3], v, beta)
    with pytest.raises(ValueError, match=r"beta must have shape \(B, H, N\) = \(1, 2, %d\), got \(1, 2, %d, 1\)" % (n, n)):
        call(q, k, v, beta[..., None])
    with pytest.raises(TypeError, match="beta must be a torch.Tensor of shape"):
        call(q, k, v, 0.5)
    with pytest.raises(TypeError, match="g must be a floating tensor, got dtype torch.int64"):
        call(q, k, v, beta, g=torch.zeros(beta.shape, dtype=torch.long))
    with pytest.raises(ValueError, match=r"g must have shape \(B, H, N\)"):
        call(q, k, v, beta, g=g[:, :1])
    with pytest.raises(ValueError, match="beta must be on q's device"):
        call(q, k, v, beta.to("meta"))
    with pytest.raises(TypeError, match="scale must be a float or None, got str"):
        call(q, k, v, beta, scale="0.5")
    with pytest.raises(TypeError, match="qk_l2norm must be a bool, got int"):
        call(q, k, v, beta, qk_l2norm=1)
    S = torch.zeros(1, 2, 4, 3)
    name = "state" if step else "initial_state"
    with pytest.raises(TypeError, match=name + r" must be one tensor S \(B, H, D, E\).*no normalizer z"):
        call(q, k, v, beta, initial_state=(S, torch.zeros(1, 2, 4)))
    with pytest.raises(ValueError, match=name + r" must have shape \(B, H, D, E\) = \(1, 2, 4, 3\), got \(1, 2, 3, 4\)"):
        call(q, k, v, beta, initial_state=S.transpose(2, 3))
    with pytest.raises(TypeError, match=name + " must be torch.float32 .*got torch.float64"):
        call(q, k, v, beta, initial_state=S.double())
    with pytest.raises(TypeError, match=name + " must be torch.float64 .*got torch.float32"):
        call(q.double(), k.double(), v.double(), beta, initial_state=S)
    with pytest.raises(TypeError, match=name + " must be a torch.Tensor"):
        call(q, k, v, beta, initial_state="S")
    if not step:
        with pytest.raises(ValueError, match="chunk_size must be a positive int, got 0"):
            call(q, k, v, beta, chunk_size=0)
        with pytest.raises(ValueError, match="the delta rule is causal: q and k must have the same length, got 5 and 6"):
            call(q[:, :, :5], k, v, beta)
        with pytest.raises(ValueError, match="at least one token"):
            call(q[:, :, :0], k[:, :, :0], v[:, :, :0], beta[..., :0])
