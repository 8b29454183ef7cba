"""The fused CPU kernels of the delta rule (csrc/delta.cpp) beside the torch-op path: fp32 agreement
at the benchmark's shapes, bf16 accuracy, the denormal guard, and which path a call takes."""

import pytest
import torch

from linattn.ops import delta_rule, delta_rule_step, native
from linattn.ops.delta import fused
from linattn.ops.delta.reference import delta_rule_recurrent

from .test_ops_delta import make_inputs

pytestmark = pytest.mark.skipif(not native.available(), reason="the fused CPU kernels could not be built here")


def _run(monkeypatch, path, args, g, grad_of=None, **kw):
    """(o, S) and, with grad_of = (do, dS), the gradients of every input, on one path."""
    with monkeypatch.context() as m:
        m.setenv("LINATTN_NATIVE", "1" if path == "fused" else "0")
        leaves = [None if x is None else x.detach().clone().requires_grad_(grad_of is not None) for x in (*args, g)]
        o, S = delta_rule(*leaves[:4], g=leaves[4], return_state=True, **kw)
        if grad_of is None:
            return o, S, ()
        wrt = [x for x in leaves if x is not None]
        return o, S, torch.autograd.grad((o.float() * grad_of[0]).sum() + (S * grad_of[1]).sum(), wrt)


@pytest.mark.parametrize("gated", [False, True])
def test_fused_equals_the_torch_ops_in_float32(monkeypatch, gated):
    """D = E = 64, chunks of 64 over 600 tokens (3 saved blocks, a tail): outputs, state and every
    gradient within fp32 rounding of the torch-op path."""
    q, k, v, beta, g, S0 = make_inputs(2, 2, 600, 64, 64, gated=gated, l2norm=True, seed=1, dtype=torch.float32,
                                       state=True)
    gen = torch.Generator().manual_seed(2)
    grad_of = (torch.randn(2, 2, 600, 64, generator=gen), torch.randn(2, 2, 64, 64, generator=gen))
    kw = dict(qk_l2norm=True, scale=0.125, initial_state=S0)
    a = _run(monkeypatch, "fused", (q, k, v, beta), g, grad_of, **kw)
    b = _run(monkeypatch, "torch ops", (q, k, v, beta), g, grad_of, **kw)
    for x, y in zip((a[0], a[1], *a[2]), (b[0], b[1], *b[2])):
        torch.testing.assert_close(x, y, atol=2e-5 * y.abs().max().item(), rtol=0)


@pytest.mark.parametrize("gated", [False, True])
def test_bf16_is_as_close_to_float64_as_the_torch_ops(monkeypatch, gated):
    """bf16 inputs (fp32 products, solves and state inside): the output error against the float64
    recurrence on the same rounded inputs is within an output ulp of the torch-op path's, forward and
    gradients, and the output is bf16, the state float32."""
    q, k, v, beta, g, S0 = make_inputs(1, 2, 300, 32, 32, gated=gated, l2norm=True, seed=3, state=True)
    low = [x.bfloat16() for x in (q, k, v, beta)]
    g_low = None if g is None else g.bfloat16()
    gen = torch.Generator().manual_seed(4)
    grad_of = (torch.randn(1, 2, 300, 32, generator=gen), torch.randn(1, 2, 32, 32, generator=gen))
    leaves = [x.double().requires_grad_() for x in low] + ([] if g is None else [g_low.double().requires_grad_()])
    ro, rS = delta_rule_recurrent(*leaves[:4], g=None if g is None else leaves[4], qk_l2norm=True,
                                  initial_state=S0.float().double())
    rg = torch.autograd.grad((ro * grad_of[0]).sum() + (rS * grad_of[1]).sum(), leaves)
    kw = dict(qk_l2norm=True, initial_state=S0.float())
    results = {p: _run(monkeypatch, p, low, g_low, grad_of, **kw) for p in ("fused", "torch ops")}
    assert results["fused"][0].dtype == torch.bfloat16 and results["fused"][1].dtype == torch.float32
    for i, ref in enumerate((ro, rS, *rg)):
        errs = {p: ((r[0], r[1], *r[2])[i].double() - ref).abs().max().item() for p, r in results.items()}
        ulp = 2.0 ** -8 * ref.abs().max().item()
        assert errs["fused"] <= errs["torch ops"] + ulp, (i, errs, ulp)


def test_the_denormal_guard_is_lifted_after_the_kernels():
    """The kernels flush denormals to zero while they run (strong decays) and restore the thread's
    floating-point mode after: a denormal product in the calling thread stays a denormal."""
    q, k, v, beta, g, _ = make_inputs(1, 1, 80, 8, 8, gated=True, l2norm=True, seed=5, dtype=torch.float32)
    with torch.no_grad():
        delta_rule(q, k, v, beta, g=g * 40, qk_l2norm=True)
        delta_rule_step(None, q[:, :, :1], k[:, :, :1], v[:, :, :1], beta[:, :, :1], g=g[:, :, :1])
    tiny = torch.tensor([1e-30], dtype=torch.float32) * torch.tensor([1e-10], dtype=torch.float32)
    assert 0 < tiny.item() < 1.2e-38


def test_which_path_runs(monkeypatch):
    """CPU fp32/fp64/bf16 take the kernels, fp16 and LINATTN_NATIVE=0 the torch ops; the fp16 result
    matches the fp32 one to fp16 precision."""
    assert fused.usable(torch.empty(1)) and fused.usable(torch.empty(1, dtype=torch.bfloat16))
    assert not fused.usable(torch.empty(1, dtype=torch.float16))
    monkeypatch.setenv("LINATTN_NATIVE", "0")
    assert not fused.usable(torch.empty(1))
    monkeypatch.setenv("LINATTN_NATIVE", "1")
    q, k, v, beta, g, _ = make_inputs(1, 2, 40, 8, 8, gated=True, l2norm=True, seed=6, dtype=torch.float32)
    o32 = delta_rule(q, k, v, beta, g=g, qk_l2norm=True)
    o16 = delta_rule(q.half(), k.half(), v.half(), beta.half(), g=g.half(), qk_l2norm=True)
    assert o16.dtype == torch.float16
    torch.testing.assert_close(o16.float(), o32, atol=5e-3 * o32.abs().max().item(), rtol=0)


def test_the_kernels_name_bad_shapes():
    q = torch.zeros(1, 2, 5, 4)
    with pytest.raises(RuntimeError, match="delta_chunked expects q, k"):
        torch.ops.linattn_cpu.delta_chunked(q, q[..., :3], q, torch.ones(1, 2, 5), None, torch.zeros(1, 2, 4, 4), 1.0,
                                            False, 8, False)
    with pytest.raises(RuntimeError, match="the saved block states do not match"):
        torch.ops.linattn_cpu.delta_chunked_backward(q, q, q, torch.ones(1, 2, 5), None, torch.zeros(3), q, None, 1.0,
                                                     False, 8)
    with pytest.raises(RuntimeError, match="delta_step expects q, k"):
        torch.ops.linattn_cpu.delta_step(torch.zeros(1, 2, 4, 4), q, q, q, torch.ones(1, 2, 5), None, 1.0, False)
