"""Forward-mode AD and second-order gradients (issue 23, items 2 and 3; linattn.ops.autodiff).

The chunked operators have a first-order reverse-mode backward only. Before the fix the fused paths
gave a zero tangent under forward mode, and a gradient penalty (create_graph=True) ran on every path
with its second-order term silently dropped. Now both raise, naming the operator, on both CPU paths;
the one-token steps take their torch-op path under forward mode and give the tangent of the float64
recurrence written from the definition.
"""

import pytest
import torch
import torch.autograd.forward_ad as fwAD

from linattn.ops import (delta_rule, delta_rule_step, gated_linear_attention, gated_linear_attention_step,
                         linear_attention, linear_attention_step)
from linattn.ops.delta.reference import delta_rule_recurrent

from .test_ops_delta import _both_paths  # noqa: F401  (autouse fixture: both CPU paths)

DT = torch.float64


def _inputs(n=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(1, 2, n, 4, generator=gen, dtype=DT) for _ in range(2))
    v = torch.randn(1, 2, n, 3, generator=gen, dtype=DT)
    beta = torch.rand(1, 2, n, generator=gen, dtype=DT) * 0.9 + 0.05
    g = -torch.rand(1, 2, n, generator=gen, dtype=DT)
    return q, torch.nn.functional.normalize(k, dim=-1), v, beta, g


# op name, f(q, k, v, beta, g) -> o: the three chunked operators, in forms the fused kernels take
OPS = {
    "linear_attention": lambda q, k, v, beta, g: linear_attention(q.exp(), k.exp(), v, causal=True),
    "gated_linear_attention": lambda q, k, v, beta, g: gated_linear_attention(q, k, v, g),
    "delta_rule": lambda q, k, v, beta, g: delta_rule(q, k, v, beta, g=g, qk_l2norm=True),
}


@pytest.mark.parametrize("op", list(OPS))
def test_forward_ad_is_refused_by_name(op):
    q, k, v, beta, g = _inputs()
    with fwAD.dual_level():
        qd = fwAD.make_dual(q, torch.ones_like(q))
        with pytest.raises(NotImplementedError, match=f"{op}.*forward-mode AD"):
            OPS[op](qd, k, v, beta, g)


@pytest.mark.parametrize("op", list(OPS))
def test_func_jvp_is_refused_by_name(op):
    q, k, v, beta, g = _inputs()
    with pytest.raises(NotImplementedError, match=f"{op}.*forward-mode AD"):
        torch.func.jvp(lambda x: OPS[op](q, k, x, beta, g), (v,), (torch.ones_like(v),))


@pytest.mark.parametrize("op", list(OPS))
def test_a_gradient_penalty_is_refused_by_name(op):
    """loss = Σo² + Σ(∂Σo/∂q)²: the second term needs the gradient of the backward itself, so the
    backward refuses to run with create_graph=True at all."""
    q, k, v, beta, g = (x.clone().requires_grad_() for x in _inputs())
    o = OPS[op](q, k, v, beta, g)
    with pytest.raises(RuntimeError, match=f"{op}.*not twice differentiable"):
        (dq,) = torch.autograd.grad(o.sum(), q, create_graph=True)
        loss = (o * o).sum() + (dq * dq).sum()
        loss.backward()


@pytest.mark.parametrize("op", list(OPS))
def test_first_order_gradients_still_run(op):
    q, k, v, beta, g = (x.clone().requires_grad_() for x in _inputs())
    (OPS[op](q, k, v, beta, g) ** 2).sum().backward()
    assert all(x.grad is not None and torch.isfinite(x.grad).all() for x in (q, k, v))


def test_the_exact_pass_for_non_finite_inputs_refuses_double_backward_too():
    """A NaN in a late value sends delta_rule through its exact piecewise pass (ops.delta.exact)."""
    q, k, v, beta, g = _inputs(8)
    v = v.clone()
    v[0, 1, 6, 0] = float("nan")
    q = q.clone().requires_grad_()
    o = delta_rule(q, k, v, beta, g=g, qk_l2norm=True)
    with pytest.raises(RuntimeError, match="delta_rule.*not twice differentiable"):
        (dq,) = torch.autograd.grad(o[:, :, :5].sum(), q, create_graph=True)
        (dq * dq).sum().backward()


def test_delta_rule_step_forward_ad_gives_the_recurrence_tangent():
    """Under forward mode the step takes its torch-op path (before the fix the fused step returned
    no tangent): its jvp equals that of the float64 recurrence."""
    q, k, v, beta, g = (x[:, :, :1] for x in _inputs(1, seed=3))
    S0 = torch.randn(1, 2, 4, 3, dtype=DT, generator=torch.Generator().manual_seed(4))
    tq, tv, tS = torch.randn_like(q), torch.randn_like(v), torch.randn_like(S0)

    def step(q, v, S):
        return delta_rule_step(S, q, k, v, beta, g=g, qk_l2norm=True)

    def ref(q, v, S):
        return delta_rule_recurrent(q, k, v, beta, g=g, qk_l2norm=True, initial_state=S)

    got = torch.func.jvp(step, (q, v, S0), (tq, tv, tS))[1]
    want = torch.func.jvp(ref, (q, v, S0), (tq, tv, tS))[1]
    for a, b in zip(got, want):
        assert b.abs().max() > 0
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
    with fwAD.dual_level():
        o, S = step(fwAD.make_dual(q, tq), fwAD.make_dual(v, tv), fwAD.make_dual(S0, tS))
        torch.testing.assert_close(fwAD.unpack_dual(o).tangent, want[0], atol=1e-12, rtol=0)
        torch.testing.assert_close(fwAD.unpack_dual(S).tangent, want[1], atol=1e-12, rtol=0)


def test_linear_and_gated_steps_forward_ad_give_the_recurrence_tangent():
    """One token from a state, identity features: o = kv'ᵀq / (q·z' + ε) with kv' = α kv + k vᵀ,
    z' = α z + k (α = 1 ungated), written here from the definition and differentiated by jvp."""
    gen = torch.Generator().manual_seed(5)
    q, k = (torch.rand(1, 2, 1, 4, generator=gen, dtype=DT) + 0.1 for _ in range(2))
    v = torch.randn(1, 2, 1, 3, generator=gen, dtype=DT)
    g = -torch.rand(1, 2, 1, generator=gen, dtype=DT)
    kv = torch.randn(1, 2, 4, 3, generator=gen, dtype=DT)
    z = torch.rand(1, 2, 4, generator=gen, dtype=DT) + 1
    tv = torch.randn_like(v)

    def definition(v, alpha, normalize):
        kv2 = alpha[..., None, None] * kv + k[:, :, 0, :, None] * v[:, :, 0, None, :]
        num = (q[:, :, 0, :, None] * kv2).sum(-2)
        if not normalize:
            return num[:, :, None]
        z2 = alpha[..., None] * z + k[:, :, 0]
        return (num / ((q[:, :, 0] * z2).sum(-1, keepdim=True) + 1e-6))[:, :, None]

    got = torch.func.jvp(lambda x: linear_attention_step((kv, z), q, k, x)[0], (v,), (tv,))[1]
    want = torch.func.jvp(lambda x: definition(x, torch.ones(1, 2, dtype=DT), True), (v,), (tv,))[1]
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    got = torch.func.jvp(lambda x: gated_linear_attention_step(kv, q, k, x, g)[0], (v,), (tv,))[1]
    want = torch.func.jvp(lambda x: definition(x, g[:, :, 0].exp(), False), (v,), (tv,))[1]
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
