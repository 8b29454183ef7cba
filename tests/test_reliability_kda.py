"""KDA folded into the delta family (issue 32) closes what its separate copy lacked (issue 37 items 2,
3, 18, 19): forward-mode AD through `kda_step` on the fused path gave a zero tangent (now the torch-op
step runs and gives the recurrence's tangent); a gradient penalty through `kda` dropped its second-order
term without a word (now refused by name, as the delta rule's); the chunked op under forward mode is
refused by name; a non-finite scale gave NaN (now refused by name); B = 0 gave a raw aminmax error. Both
CPU paths."""

import pytest
import torch
import torch.autograd.forward_ad as fwAD

from linattn.ops.delta.reference import delta_rule_recurrent
from linattn.ops.kda import kda, kda_step

from .test_ops_delta import _both_paths  # noqa: F401  (autouse fixture: both CPU paths)

DT = torch.float64


def _inputs(n=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(1, 2, n, 4, generator=gen, dtype=DT) for _ in range(2))
    v = torch.randn(1, 2, n, 3, generator=gen, dtype=DT)
    beta = torch.rand(1, 2, n, generator=gen, dtype=DT) * 1.9 + 0.05
    g = -torch.rand(1, 2, n, 4, generator=gen, dtype=DT)
    S0 = torch.randn(1, 2, 4, 3, generator=gen, dtype=DT)
    return q, k, v, beta, g, S0


def test_kda_step_forward_ad_gives_the_recurrence_tangent():
    """torch.func.jvp and forward_ad through one fused-path step: the tangent of the float64 recurrence
    (before: zeros on the fused path)."""
    q, k, v, beta, g, S0 = _inputs(1, seed=3)
    tq, tv, tg, tS = (torch.randn_like(x) for x in (q, v, g, S0))

    def step(q, v, g, S):
        return kda_step(S, q, k, v, beta, g, qk_l2norm=True, scale=0.7)

    def ref(q, v, g, S):
        return delta_rule_recurrent(q, k, v, beta, g=g, qk_l2norm=True, scale=0.7, initial_state=S)

    got = torch.func.jvp(step, (q, v, g, S0), (tq, tv, tg, tS))[1]
    want = torch.func.jvp(ref, (q, v, g, S0), (tq, tv, tg, tS))[1]
    for a, b in zip(got, want):
        assert b.abs().max() > 0
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
    with fwAD.dual_level():
        o, S = step(fwAD.make_dual(q, tq), fwAD.make_dual(v, tv), fwAD.make_dual(g, tg), fwAD.make_dual(S0, tS))
        torch.testing.assert_close(fwAD.unpack_dual(o).tangent, want[0], atol=1e-12, rtol=0)
        torch.testing.assert_close(fwAD.unpack_dual(S).tangent, want[1], atol=1e-12, rtol=0)


def test_kda_forward_ad_is_refused_by_name():
    q, k, v, beta, g, _ = _inputs()
    with pytest.raises(NotImplementedError, match="KDA.*forward-mode AD"):
        torch.func.jvp(lambda x: kda(q, k, x, beta, g, qk_l2norm=True), (v,), (torch.ones_like(v),))


@pytest.mark.parametrize("nonfinite", [False, True])
def test_kda_gradient_penalty_is_refused_by_name(nonfinite):
    """loss = Σo² + Σ(∂Σo/∂q)²: the backward refuses create_graph=True (before: the second-order term was
    dropped, relative error 1.10). Also through the exact pass for a NaN in a late value."""
    q, k, v, beta, g, _ = _inputs(8)
    if nonfinite:
        v = v.clone()
        v[0, 1, 6, 0] = float("nan")
    q = q.clone().requires_grad_()
    o = kda(q, k, v, beta, g, qk_l2norm=True)[:, :, :5]
    with pytest.raises(RuntimeError, match="KDA.*not twice differentiable"):
        (dq,) = torch.autograd.grad(o.sum(), q, create_graph=True)
        ((o * o).sum() + (dq * dq).sum()).backward()


def test_kda_first_order_gradients_still_run():
    q, k, v, beta, g, S0 = (x.clone().requires_grad_() for x in _inputs())
    o, S = kda(q, k, v, beta, g, qk_l2norm=True, initial_state=S0, return_state=True)
    ((o ** 2).sum() + S.sum()).backward()
    assert all(x.grad is not None and torch.isfinite(x.grad).all() for x in (q, k, v, beta, g, S0))


@pytest.mark.parametrize("step", [False, True])
def test_kda_bad_scale_and_empty_batch_name_the_argument(step):
    q, k, v, beta, g, S0 = _inputs(1 if step else 5)

    def call(*xs, **kw):
        return kda_step(None, *xs, **kw) if step else kda(*xs, **kw)

    for bad in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(ValueError, match="scale must be finite"):
            call(q, k, v, beta, g, scale=bad)
    with pytest.raises(ValueError, match="batch B >= 1"):
        call(q[:0], k[:0], v[:0], beta[:0], g[:0])
    with pytest.raises(ValueError, match=r"g must have shape \(B, H, N, D\)"):
        call(q, k, v, beta, g[..., 0])
