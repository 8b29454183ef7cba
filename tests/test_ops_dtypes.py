"""bf16 / fp16 inputs: float32 states, outputs in the input dtype, bounded error against fp64."""

import pytest
import torch

from linattn.nn.feature_maps import make_feature_map
from linattn.ops import linear_attention, linear_attention_step

from .conftest import oracle


@pytest.mark.parametrize("dtype,tol,path", [(torch.bfloat16, 3e-2, "bf16"), (torch.bfloat16, 3e-2, "fp32"),
                                            (torch.float16, 4e-3, None), (torch.float32, 1e-5, None)])
@pytest.mark.parametrize("causal", [True, False])
def test_low_precision_error_is_bounded(monkeypatch, dtype, tol, path, causal):
    """bf16 on both paths (LINATTN_BF16_PATH: bf16 gemms, fp32 gemms on widened blocks)."""
    if path is not None:
        monkeypatch.setenv("LINATTN_BF16_PATH", path)
    g = torch.Generator().manual_seed(0)
    q, k, v = [torch.randn(2, 4, 300, 32, generator=g, dtype=torch.float64) for _ in range(3)]
    fm = make_feature_map("elu", 32)
    ref, _ = oracle(q, k, v, causal=causal, feature_map=fm.double())
    qs, ks, vs = [x.to(dtype).requires_grad_() for x in (q, k, v)]
    o = linear_attention(qs, ks, vs, causal=causal, feature_map=fm)
    assert o.dtype == dtype
    err = (o.double() - ref).abs().max().item() / ref.abs().max().item()
    assert err < tol, f"relative error {err:.2e} for {dtype}"
    o.float().sum().backward()
    for x in (qs, ks, vs):
        assert x.grad.dtype == dtype and torch.isfinite(x.grad.float()).all()


def test_low_precision_gradients_are_close(bf16_path):
    g = torch.Generator().manual_seed(1)
    q, k, v = [torch.randn(1, 2, 200, 16, generator=g, dtype=torch.float64).requires_grad_() for _ in range(3)]
    fm = make_feature_map("elu", 16)
    w = torch.randn(1, 2, 200, 16, generator=g, dtype=torch.float64)
    ref, _ = oracle(q, k, v, causal=True, feature_map=fm.double())
    want = torch.autograd.grad((ref * w).sum(), (q, k, v))
    xs = [x.detach().to(torch.bfloat16).requires_grad_() for x in (q, k, v)]
    o = linear_attention(*xs, causal=True, feature_map=fm.float())
    got = torch.autograd.grad((o.float() * w.float()).sum(), xs)
    for a, b in zip(got, want):
        rel = (a.double() - b).abs().max() / b.abs().max()
        assert rel < 5e-2


def test_fp16_long_sequence_stays_finite():
    """z grows like N: at N = 65,536 it exceeds fp16's range, so it must live in fp32."""
    g = torch.Generator().manual_seed(2)
    n = 65_536
    q, k, v = [torch.randn(1, 1, n, 16, generator=g).half() for _ in range(3)]
    k = k + 3  # large positive features: z ~ 4·N > 65,504
    fm = make_feature_map("elu", 16)
    o, (kv, z) = linear_attention(q, k, v, causal=True, feature_map=fm, return_state=True)
    assert o.dtype == torch.float16 and torch.isfinite(o).all()
    assert z.dtype == torch.float32 and z.max() > 65_504
    o_step, _ = linear_attention_step((kv, z), q[:, :, :1], k[:, :, :1], v[:, :, :1], feature_map=fm)
    assert torch.isfinite(o_step).all()
