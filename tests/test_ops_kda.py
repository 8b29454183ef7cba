"""linattn.ops.kda against the float64 token-by-token recurrence written from the definition
(linattn.ops.delta.reference): outputs, final states and the gradients of q, k, v, beta, g and the
initial state, at edge lengths and chunk sizes, with strong gates (−1e4 … −1e30) and g = 0; the
special cases Gated DeltaNet and DeltaNet; the step, resumption, packed sequences, the affine form,
bf16, non-finite causality and the argument errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from linattn.ops import delta_rule
from linattn.ops.kda import kda, kda_affine_form, kda_step
from linattn.ops.delta.reference import delta_rule_recurrent

F64 = torch.float64


def kda_recurrent(q, k, v, beta, g, **kw):
    """The float64 recurrence of the delta family with the per-channel g (linattn.ops.delta.reference)."""
    return delta_rule_recurrent(q, k, v, beta, g=g, **kw)


def inputs(b=2, h=2, n=19, d=6, e=5, dtype=F64, seed=0, strong=None, gate_scale=1.0):
    """q, k, v, beta, g, S0 in float64 (then cast: q, k, v to dtype; the rest to the state dtype). strong:
    a log-decay written at a few (token, channel) places (a reset)."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(b, h, n, d, generator=gen, dtype=F64) for _ in range(2))
    v = torch.randn(b, h, n, e, generator=gen, dtype=F64)
    beta = torch.rand(b, h, n, generator=gen, dtype=F64) * 0.98 + 0.01
    g = torch.nn.functional.logsigmoid(torch.randn(b, h, n, d, generator=gen, dtype=F64) + 2) * gate_scale
    if strong is not None:
        g[:, :, n // 3, : d // 2] = strong
        g[:, :, (2 * n) // 3, d // 3:] = strong
        g[0, 0, n - 1, 0] = strong
    S0 = torch.randn(b, h, d, e, generator=gen, dtype=F64)
    sdt = F64 if dtype == F64 else torch.float32
    return q.to(dtype), k.to(dtype), v.to(dtype), beta.to(sdt), g.to(sdt), S0.to(sdt)


def grads_of(fn, xs, seed=1):
    """(o, S, grads of Σ w·o + Σ w'·S over xs) with fixed random weights."""
    xs = [x.detach().clone().requires_grad_() for x in xs]
    o, S = fn(*xs)
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(o.shape, generator=gen, dtype=F64)
    w2 = torch.randn(S.shape, generator=gen, dtype=F64)
    loss = (o.double() * w).sum() + (S.double() * w2).sum()
    return o.detach(), S.detach(), torch.autograd.grad(loss, xs)


def compare(a, b, atol, rtol, what):
    assert torch.isfinite(a).all(), f"{what}: not finite"
    torch.testing.assert_close(a.double(), b.double(), atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


NAMES = ("q", "k", "v", "beta", "g", "initial_state")


def check_against_reference(xs, atol=1e-10, rtol=1e-9, **opts):
    chunk = opts.pop("chunk_size", 64)

    def ours(q, k, v, beta, g, S0):
        return kda(q, k, v, beta, g, initial_state=S0, return_state=True, chunk_size=chunk, **opts)

    def ref(q, k, v, beta, g, S0):
        return kda_recurrent(*(x.double() for x in (q, k, v, beta, g)), initial_state=S0.double(), **opts)

    o, S, gr = grads_of(ours, xs)
    ro, rS, rg = grads_of(ref, xs)
    compare(o, ro, atol, rtol, "output")
    compare(S, rS, atol, rtol, "final state")
    for name, a, b in zip(NAMES, gr, rg):
        compare(a, b, atol, rtol, f"d{name}")


@pytest.mark.parametrize("n,chunk,d,e", [(1, 64, 4, 3), (19, 64, 6, 5), (19, 4, 6, 5), (37, 16, 5, 7),
                                         (40, 5, 3, 4), (64, 64, 8, 8), (70, 32, 4, 6), (9, 1, 3, 2)])
@pytest.mark.parametrize("l2norm,scale", [(True, 0.4), (False, None)])
def test_matches_recurrence_fp64(n, chunk, d, e, l2norm, scale):
    xs = inputs(n=n, d=d, e=e, seed=n + chunk)
    if not l2norm:  # keep β‖k‖² ≤ 2 for a stable recurrence
        xs = (xs[0], torch.nn.functional.normalize(xs[1], dim=-1), *xs[2:])
    check_against_reference(xs, qk_l2norm=l2norm, scale=scale, chunk_size=chunk)


@pytest.mark.parametrize("strong", [-1e4, -1e8, -1e30, -200.0])
@pytest.mark.parametrize("chunk", [64, 7])
def test_strong_gates_fp64_exact(strong, chunk):
    """A reset of some channels keeps outputs, states and every gradient exact and finite (FLA's
    naive_chunk_kda gives NaN gradients at −1e4)."""
    xs = inputs(n=45, strong=strong, seed=3)
    check_against_reference(xs, qk_l2norm=True, scale=0.5, chunk_size=chunk)


def test_strong_gates_fp32():
    xs = inputs(n=70, strong=-1e30, dtype=torch.float32, seed=4)
    check_against_reference(xs, atol=2e-4, rtol=2e-4, qk_l2norm=True, scale=0.5, chunk_size=32)


def test_every_gate_strong_and_zero():
    """g = −1e4 everywhere: only the current token is remembered, S_t = β k̂ vᵀ; g = 0: no decay."""
    q, k, v, beta, g, S0 = inputs(n=21, seed=5)
    check_against_reference((q, k, v, beta, torch.full_like(g, -1e4), S0), qk_l2norm=True, chunk_size=8)
    check_against_reference((q, k, v, beta, torch.zeros_like(g), S0), qk_l2norm=True, chunk_size=8)


def test_long_decay_chain_fp32():
    """Many moderate gates in a chunk (b down to −64·10): the sub-chunk factors stay exact."""
    xs = inputs(n=128, dtype=torch.float32, seed=6, gate_scale=1.0)
    q, k, v, beta, g, S0 = xs
    g = g - 10.0 * torch.rand_like(g)
    check_against_reference((q, k, v, beta, g, S0), atol=1e-4, rtol=1e-4, qk_l2norm=True, chunk_size=64)


def test_gated_deltanet_and_deltanet_are_special_cases():
    q, k, v, beta, g, S0 = inputs(n=33, seed=7)
    gs = g[..., 0]
    o, S = kda(q, k, v, beta, gs[..., None].expand_as(g).contiguous(), qk_l2norm=True, initial_state=S0,
               return_state=True, chunk_size=16)
    o2, S2 = delta_rule(q, k, v, beta, g=gs, qk_l2norm=True, initial_state=S0, return_state=True, chunk_size=16)
    compare(o, o2, 1e-10, 1e-10, "Gated DeltaNet output")
    compare(S, S2, 1e-10, 1e-10, "Gated DeltaNet state")
    o = kda(q, k, v, beta, torch.zeros_like(g), qk_l2norm=True, chunk_size=16)
    compare(o, delta_rule(q, k, v, beta, qk_l2norm=True, chunk_size=16), 1e-10, 1e-10, "DeltaNet output")


@settings(max_examples=10, deadline=None)
@given(n=st.integers(1, 40), chunk=st.integers(1, 40), d=st.integers(1, 6), e=st.integers(1, 5),
       bh=st.sampled_from([(1, 1), (2, 1), (1, 3)]), seed=st.integers(0, 10_000),
       strong=st.sampled_from([None, -1e4, -1e30]))
def test_property_matches_recurrence(n, chunk, d, e, bh, seed, strong):
    xs = inputs(b=bh[0], h=bh[1], n=n, d=d, e=e, seed=seed, strong=strong)
    check_against_reference(xs, qk_l2norm=True, scale=0.7, chunk_size=chunk)


def test_bf16_inputs_float32_state():
    q, k, v, beta, g, S0 = inputs(n=40, dtype=torch.bfloat16, seed=8)
    o, S = kda(q, k, v, beta, g, qk_l2norm=True, initial_state=S0, return_state=True, chunk_size=16)
    assert o.dtype == torch.bfloat16 and S.dtype == torch.float32
    ro, rS = kda_recurrent(*(x.double() for x in (q, k, v, beta, g)), qk_l2norm=True, initial_state=S0.double())
    compare(o, ro, 3e-2, 3e-2, "bf16 output")
    compare(S, rS, 1e-4, 1e-4, "bf16 state (fp32)")


def test_resume_from_state_and_step():
    """Two halves from the carried state, and token-by-token kda_step, give the whole call."""
    q, k, v, beta, g, S0 = inputs(n=23, seed=9)
    o, S = kda(q, k, v, beta, g, qk_l2norm=True, scale=0.3, initial_state=S0, return_state=True, chunk_size=8)
    o1, S1 = kda(q[:, :, :10], k[:, :, :10], v[:, :, :10], beta[:, :, :10], g[:, :, :10], qk_l2norm=True,
                 scale=0.3, initial_state=S0, return_state=True, chunk_size=8)
    o2, S2 = kda_step(S1, q[:, :, 10:], k[:, :, 10:], v[:, :, 10:], beta[:, :, 10:], g[:, :, 10:], qk_l2norm=True,
                      scale=0.3)  # a block of T > 1 tokens
    compare(torch.cat((o1, o2), 2), o, 1e-12, 1e-12, "resumed output")
    compare(S2, S, 1e-12, 1e-12, "resumed state")
    state, outs = S0, []
    for t in range(23):
        sl = slice(t, t + 1)
        ot, state = kda_step(state, q[:, :, sl], k[:, :, sl], v[:, :, sl], beta[:, :, sl], g[:, :, sl],
                             qk_l2norm=True, scale=0.3)
        outs.append(ot)
    compare(torch.cat(outs, 2), o, 1e-12, 1e-12, "step outputs")
    compare(state, S, 1e-12, 1e-12, "step state")


def test_step_gradients():
    q, k, v, beta, g, S0 = inputs(n=1, seed=10)

    def ours(q, k, v, beta, g, S0):
        return kda_step(S0, q, k, v, beta, g, qk_l2norm=True, scale=0.5)

    def ref(q, k, v, beta, g, S0):
        return kda_recurrent(q, k, v, beta, g, qk_l2norm=True, scale=0.5, initial_state=S0)

    o, S, gr = grads_of(ours, (q, k, v, beta, g, S0))
    ro, rS, rg = grads_of(ref, (q, k, v, beta, g, S0))
    compare(o, ro, 1e-12, 1e-12, "step output")
    for name, a, b in zip(NAMES, gr, rg):
        compare(a, b, 1e-12, 1e-12, f"step d{name}")


def test_packed_sequences_equal_separate_calls():
    lengths = [1, 13, 1, 20, 7]
    n = sum(lengths)
    q, k, v, beta, g, _ = inputs(b=1, n=n, seed=11)
    S0 = torch.randn(len(lengths), 2, 6, 5, dtype=F64)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    xs = [x.clone().requires_grad_() for x in (q, k, v, beta, g, S0)]
    o, S = kda(*xs[:5], qk_l2norm=True, initial_state=xs[5], return_state=True, chunk_size=8, cu_seqlens=cu)
    w = torch.randn_like(o)
    gr = torch.autograd.grad((o * w).sum() + S.sum(), xs)
    ys = [x.clone().requires_grad_() for x in (q, k, v, beta, g, S0)]
    outs, states = [], []
    for i in range(len(lengths)):
        s, t = int(cu[i]), int(cu[i + 1])
        oi, Si = kda_recurrent(*(y[:, :, s:t] for y in ys[:5]), qk_l2norm=True, initial_state=ys[5][i:i + 1])
        outs.append(oi)
        states.append(Si)
    ro, rS = torch.cat(outs, 2), torch.cat(states, 0)
    rg = torch.autograd.grad((ro * w).sum() + rS.sum(), ys)
    compare(o, ro, 1e-10, 1e-10, "packed output")
    compare(S, rS, 1e-10, 1e-10, "packed states")
    for name, a, b in zip(NAMES, gr, rg):
        compare(a, b, 1e-10, 1e-10, f"packed d{name}")


def test_affine_form():
    q, k, v, beta, g, S0 = inputs(n=17, seed=12)
    form = kda_affine_form(q, k, v, beta, g, qk_l2norm=True, scale=0.5, chunk_size=8)
    o, S = kda(q, k, v, beta, g, qk_l2norm=True, scale=0.5, initial_state=S0, return_state=True, chunk_size=8)
    compare(form.output(S0), o, 1e-10, 1e-10, "affine output")
    compare(form.final(S0), S, 1e-10, 1e-10, "affine final state")


def test_nonfinite_respects_causality():
    q, k, v, beta, g, S0 = inputs(n=30, seed=13)
    v = v.clone()
    v[1, 0, 17, 2] = float("nan")
    k = k.clone()
    k[0, 1, 21, 0] = float("inf")
    xs = [x.clone().requires_grad_() for x in (q, k, v, beta, g, S0)]
    o = kda(*xs[:5], qk_l2norm=True, initial_state=xs[5], chunk_size=8)
    assert torch.isfinite(o[:, :, :17]).all()
    gr = torch.autograd.grad(o[:, :, :17].sum(), xs)
    ys = [x.clone().requires_grad_() for x in (q, k, v, beta, g, S0)]
    ro, _ = kda_recurrent(*(y[:, :, :17] for y in ys[:5]), qk_l2norm=True, initial_state=ys[5])
    compare(o[:, :, :17].detach(), ro, 1e-10, 1e-10, "output before the NaN")
    rg = torch.autograd.grad(ro.sum(), ys, allow_unused=True)
    for name, a, b in zip(NAMES, gr, rg):
        if name == "initial_state":
            compare(a, b, 1e-10, 1e-10, name)
        else:
            compare(a[:, :, :17], b[:, :, :17], 1e-10, 1e-10, f"d{name} before the NaN")
            assert (a[:, :, 17:] == 0).all(), f"d{name} after the NaN must be exactly 0"


def test_errors_name_the_argument():
    q, k, v, beta, g, S0 = inputs(n=5)
    with pytest.raises(ValueError, match="g must have shape"):
        kda(q, k, v, beta, g[..., 0])
    with pytest.raises(ValueError, match="beta"):
        kda(q, k, v, beta * 0 + 2.5, g)
    with pytest.raises(ValueError, match="g must be a finite log-decay"):
        kda(q, k, v, beta, -g)
    with pytest.raises(ValueError, match="g must be a finite log-decay"):
        kda(q, k, v, beta, torch.full_like(g, float("-inf")))
    with pytest.raises(TypeError, match="initial_state"):
        kda(q, k, v, beta, g, initial_state=S0.float())
    with pytest.raises(ValueError, match="chunk_size"):
        kda(q, k, v, beta, g, chunk_size=0)
    with pytest.raises(ValueError, match="cu_seqlens"):
        kda(q[:1], k[:1], v[:1], beta[:1], g[:1], cu_seqlens=torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="batch must be 1"):
        kda(q, k, v, beta, g, cu_seqlens=torch.tensor([0, 5]))
    with pytest.raises(TypeError, match="state"):
        kda_step(S0.float(), q[:, :, :1], k[:, :, :1], v[:, :, :1], beta[:, :, :1], g[:, :, :1])
