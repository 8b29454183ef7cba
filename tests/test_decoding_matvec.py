"""The fused decoder's float matrix-vector products (csrc/matvec.h: fp32 and bf16 weights, layouts kn and
nk; one row at a time at B = 1, tiles of rows for batches) against float64."""

import pytest
import torch

from linattn.ops import native

from .test_decoding_int8 import plan_matvec

pytestmark = pytest.mark.skipif(not (native.enabled() and native.load()), reason="needs the fused CPU kernels")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kn", [False, True])
@pytest.mark.parametrize("batch, k, n, threads", [(1, 1, 1, 1), (1, 15, 17, 1), (1, 64, 20, 1), (1, 200, 70, 1),
                                                  (1, 130, 33, 2), (1, 1030, 48, 2), (2, 200, 70, 1), (5, 37, 33, 1),
                                                  (9, 130, 300, 2)])
def test_float_matvec_within_fp32_rounding_of_float64(batch, k, n, threads, kn, dtype):
    g = torch.Generator().manual_seed(batch * 1000 + k + n)
    x = torch.randn(batch, k, generator=g)
    w = torch.randn(n, k, generator=g).to(dtype)
    y = plan_matvec(x, w, None, kn, threads)
    ref = x.double() @ w.double().t()
    # a float32 sum of K products in any order: |error| ≤ K·u·Σ|x_i w_ji|
    bound = k * 2.0 ** -24 * (x.double().abs() @ w.double().abs().t())
    assert torch.all((y.double() - ref).abs() <= bound), (y.double() - ref).abs().max()
    assert torch.count_nonzero(y) > 0
