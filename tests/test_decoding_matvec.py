"""The fused decoder's float matrix-vector products (csrc/matvec.h: fp32 and bf16 weights, layouts kn and
nk; one row at a time at B = 1, tiles of rows for batches) against float64."""

import pytest
import torch

from linattn.ops import native

pytestmark = pytest.mark.skipif(not (native.enabled() and native.load()), reason="needs the fused CPU kernels")


def plan_matvec(x, w, kn: bool, threads: int = 1):
    """x (B, K) float32 times w (N, K) (float32 or bfloat16) through a one-product plan -> (B, N)."""
    b, n = x.shape[0], w.shape[0]
    plan = torch.classes.linattn_cpu.DecodePlan(b, False)  # fp32 activations and outputs, whatever the weights
    out = torch.zeros(b, n)
    plan.add("group", {"input": x}, {"_": 0}, {"_": 0.0})
    plan.add("product", {"weight": w.t().contiguous() if kn else w.contiguous(), "out": out},
             {"kn": int(kn), "epilogue": 0, "act_quant": 0}, {"_": 0.0})
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        plan.step(torch.zeros(b, dtype=torch.long), torch.zeros(b, dtype=torch.long), 0)
    finally:
        torch.set_num_threads(before)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kn", [False, True])
@pytest.mark.parametrize("batch, k, n, threads", [(1, 1, 1, 1), (1, 15, 17, 1), (1, 64, 20, 1), (1, 200, 70, 1),
                                                  (1, 130, 33, 2), (1, 1030, 48, 2), (2, 200, 70, 1), (5, 37, 33, 1),
                                                  (9, 130, 300, 2)])
def test_float_matvec_within_fp32_rounding_of_float64(batch, k, n, threads, kn, dtype):
    g = torch.Generator().manual_seed(batch * 1000 + k + n)
    x = torch.randn(batch, k, generator=g)
    w = torch.randn(n, k, generator=g).to(dtype)
    y = plan_matvec(x, w, kn, threads)
    ref = x.double() @ w.double().t()
    # a float32 sum of K products in any order: |error| ≤ K·u·Σ|x_i w_ji|
    bound = k * 2.0 ** -24 * (x.double().abs() @ w.double().abs().t())
    assert torch.all((y.double() - ref).abs() <= bound), (y.double() - ref).abs().max()
    assert torch.count_nonzero(y) > 0
