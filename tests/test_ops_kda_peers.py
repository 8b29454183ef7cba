"""linattn.ops.kda against the peers' own torch code (design §17): FLA's fla.ops.kda.naive references
(naive_recurrent_kda, naive_chunk_kda, the gate functions) and transformers' undecorated
chunk_kimi_delta_attention / recurrent_kimi_delta_attention (kimi_linear), in their (B, T, H, K)
layout, each skipped when the package does not import."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from linattn.ops.kda import kda, kda_gate, kda_lowerbound_gate

B, T, H, K, V = 2, 37, 3, 8, 6


def _inputs(seed=0, strong=None):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, T, H, K, generator=gen) for _ in range(2))
    k = torch.nn.functional.normalize(k, dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, K, generator=gen) + 2)
    if strong is not None:
        g[:, 11, :, :4] = strong
    beta = torch.rand(B, T, H, generator=gen) * 0.98 + 0.01
    S0 = torch.randn(B, H, K, V, generator=gen)
    return q, k, v, g, beta, S0


def _ours(q, k, v, g, beta, S0, *, l2norm=False, chunk=16):
    """kda in the peers' layout and defaults (scale K^−1/2)."""
    t = lambda x: x.transpose(1, 2)  # noqa: E731
    o, S = kda(t(q), t(k), t(v), beta.transpose(1, 2), t(g), scale=K ** -0.5, qk_l2norm=l2norm, initial_state=S0,
               return_state=True, chunk_size=chunk)
    return o.transpose(1, 2), S


def _fla_naive():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pytest.importorskip("fla.ops.kda.naive")


def test_fla_naive_recurrent_and_chunk():
    naive = _fla_naive()
    q, k, v, g, beta, S0 = _inputs()
    o, S = _ours(q, k, v, g, beta, S0)
    ro, rS = naive.naive_recurrent_kda(q, k, v, g, beta, initial_state=S0, output_final_state=True)
    torch.testing.assert_close(o, ro, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(S, rS, atol=1e-4, rtol=1e-4)
    n = 32  # naive_chunk_kda needs whole chunks
    co, cS = naive.naive_chunk_kda(q[:, :n], k[:, :n], v[:, :n], g[:, :n], beta[:, :n], initial_state=S0,
                                   output_final_state=True, chunk_size=16)
    o, S = _ours(*(x[:, :n] for x in (q, k, v, g, beta)), S0)
    torch.testing.assert_close(o, co, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(S, cS, atol=1e-4, rtol=1e-4)


def test_strong_gate_gradients_finite_and_equal_flas_recurrence():
    """At g = −1e4 our gradients stay finite and equal the (finite) gradients of FLA's token-by-token
    recurrence. (FLA 0.6's naive_chunk_kda forms e^{−b} there and its gradients overflow: a weakness of
    that reference, not asserted here, so that a fixed FLA does not fail linattn's tests.)"""
    naive = _fla_naive()
    xs = [x.double().requires_grad_() for x in _inputs(seed=1, strong=-1e4)]
    o, S = naive.naive_recurrent_kda(*xs[:5], initial_state=xs[5], output_final_state=True)
    ref = torch.autograd.grad(o.double().sum() + S.sum(), xs)
    ys = [x.detach().float().requires_grad_() for x in xs]
    o, S = _ours(*ys)
    got = torch.autograd.grad(o.sum() + S.sum(), ys)
    for a, b in zip(got, ref):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a.double(), b, atol=2e-3, rtol=2e-3)


def test_fla_gates():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gate = pytest.importorskip("fla.ops.kda.gate")
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 5, H, K, generator=gen) * 3
    A_log = torch.rand(H, generator=gen) * 2
    dt_bias = torch.randn(H * K, generator=gen)
    torch.testing.assert_close(kda_gate(x, A_log, dt_bias), gate.naive_kda_gate(x, A_log, dt_bias))
    for a in (A_log, None):
        torch.testing.assert_close(kda_lowerbound_gate(x, a, dt_bias, lower_bound=-5.0),
                                   gate.naive_kda_lowerbound_gate(x, a, dt_bias, lower_bound=-5.0))


def test_gates_from_the_definition():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, H, K, generator=gen, dtype=torch.float64) * 10
    A_log = torch.randn(H, generator=gen, dtype=torch.float64)
    dt_bias = torch.randn(H * K, generator=gen, dtype=torch.float64)
    y = x + dt_bias.view(H, K)
    want = -A_log.exp()[:, None] * torch.log1p(torch.exp(y))
    torch.testing.assert_close(kda_gate(x, A_log, dt_bias), want)
    got = kda_lowerbound_gate(x, A_log, dt_bias, lower_bound=-3.0)
    torch.testing.assert_close(got, -3.0 / (1 + torch.exp(-A_log.exp()[:, None] * y)))
    assert (got < 0).all() and (got > -3).all()
    with pytest.raises(ValueError, match="lower_bound"):
        kda_lowerbound_gate(x, A_log, lower_bound=1.0)
    with pytest.raises(ValueError, match="dt_bias"):
        kda_gate(x, A_log, dt_bias[:-1])
    with pytest.raises(ValueError, match="A_log"):
        kda_gate(x, A_log[:-1])


def _transformers():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")


@pytest.mark.parametrize("l2norm", [True, False])
def test_transformers_chunk_and_recurrent(l2norm):
    m = _transformers()
    chunk = getattr(m.chunk_kimi_delta_attention, "__wrapped__", m.chunk_kimi_delta_attention)
    rec = getattr(m.recurrent_kimi_delta_attention, "__wrapped__", m.recurrent_kimi_delta_attention)
    q, k, v, g, beta, S0 = _inputs(seed=4)
    o, S = _ours(q, k, v, g, beta, S0, l2norm=l2norm)
    co, cS = chunk(q, k, v, g, beta, chunk_size=16, initial_state=S0, output_final_state=True,
                   use_qk_l2norm_in_kernel=l2norm)
    ro, rS = rec(q, k, v, g, beta, initial_state=S0, output_final_state=True, use_qk_l2norm_in_kernel=l2norm)
    for name, (a, b) in dict(chunk=(co, cS), recurrent=(ro, rS)).items():
        torch.testing.assert_close(o, a, atol=1e-4, rtol=1e-4, msg=lambda s: f"{name} output: {s}")
        torch.testing.assert_close(S, b, atol=1e-4, rtol=1e-4, msg=lambda s: f"{name} state: {s}")


def test_transformers_forget_gate_formula():
    m = _transformers()
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 3, H, K, generator=gen) * 8
    A_log = torch.randn(H, generator=gen)
    dt_bias = torch.randn(H * K, generator=gen)
    y = x + dt_bias.view(H, K)
    sp = torch.where(y > 20.0, y, torch.log(1.0 + torch.exp(y)))  # KimiLinearForgetGate's softplus
    torch.testing.assert_close(kda_gate(x, A_log, dt_bias), -A_log.exp().view(H, 1) * sp)
    assert math.isfinite(float(kda_gate(x * 100, A_log, dt_bias).sum()))
