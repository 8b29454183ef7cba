"""The fused CPU step of KDA (linattn_cpu::delta_step of csrc/delta.cpp, with a per-channel g) against
the torch-op step and the float64 recurrence: fp32, fp64 and bf16 inputs, l2norm on and off, strong
gates, and its value checks. Skipped where the extension is not built."""

from __future__ import annotations

import pytest
import torch

from linattn.ops.delta import fused
from linattn.ops.delta.api import _step
from linattn.ops.delta.reference import delta_rule_recurrent
from linattn.ops.kda import kda_step

def kda_recurrent(q, k, v, beta, g, **kw):
    return delta_rule_recurrent(q, k, v, beta, g=g, **kw)


pytestmark = pytest.mark.skipif(not fused.usable(torch.zeros(1)), reason="the fused kernels are not built")


def _one_token(dtype, seed=0, b=2, h=3, d=7, e=5, strong=False):
    gen = torch.Generator().manual_seed(seed)
    sdt = torch.float64 if dtype == torch.float64 else torch.float32
    q, k = (torch.randn(b, h, 1, d, generator=gen, dtype=torch.float64).to(dtype) for _ in range(2))
    v = torch.randn(b, h, 1, e, generator=gen, dtype=torch.float64).to(dtype)
    beta = (torch.rand(b, h, 1, generator=gen, dtype=torch.float64) * 0.98 + 0.01).to(sdt)
    g = torch.nn.functional.logsigmoid(torch.randn(b, h, 1, d, generator=gen, dtype=torch.float64)).to(sdt)
    if strong:
        g[..., ::2] = -1e30
    S = torch.randn(b, h, d, e, generator=gen, dtype=sdt)
    return S, q, k, v, beta, g


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("l2norm,scale", [(True, 0.5), (False, None)])
@pytest.mark.parametrize("strong", [False, True])
def test_fused_step_matches_torch_step_and_recurrence(dtype, l2norm, scale, strong):
    S, q, k, v, beta, g = _one_token(dtype, strong=strong)
    with torch.no_grad():
        o, S2 = kda_step(S, q, k, v, beta, g, scale=scale, qk_l2norm=l2norm)  # the fused operator
    ro, rS = _step(S, q, k, v, beta, g, scale, l2norm)
    tol = dict(atol=1e-2, rtol=1e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    if dtype == torch.float64:
        tol = dict(atol=1e-13, rtol=1e-13)
    assert o.dtype == dtype and S2.dtype == S.dtype
    torch.testing.assert_close(o.double(), ro.double(), **tol)
    torch.testing.assert_close(S2, rS, **tol)
    fo, fS = kda_recurrent(*(x.double() for x in (q, k, v, beta, g)), scale=scale, qk_l2norm=l2norm,
                           initial_state=S.double())
    torch.testing.assert_close(S2.double(), fS, **(tol if dtype == torch.float64 else dict(atol=1e-4, rtol=1e-4)))
    assert torch.equal(S, _one_token(dtype, strong=strong)[0]), "the input state must not change"


def test_fused_step_checks_values():
    S, q, k, v, beta, g = _one_token(torch.float32)
    with torch.no_grad(), pytest.raises(ValueError, match="g must be"):
        kda_step(S, q, k, v, beta, g.abs() + 0.1)
    with torch.no_grad(), pytest.raises(ValueError, match="beta"):
        kda_step(S, q, k, v, beta * 0 - 0.5, g)
