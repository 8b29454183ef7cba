"""Edge shapes and arguments of the operators (issue 23, items 5, 8, 9, 10 and 11), on both CPU paths.

Before the fixes: delta_rule with D = 0 or E = 0 on the fused path printed BLAS parameter errors and
returned uninitialized memory; B = 0 or H = 0 gave a raw `aminmax` error (and the fused step an
empty result); a chunk far larger than N sized the fused work buffers by chunk² and failed; scale
NaN/inf gave all-NaN outputs and the gated op took scale=True; L2 normalization in fp32 overflowed
for |x| ≳ 1.8e19 (k̂ = 0, output silently 0).
"""

import math

import pytest
import torch

from linattn.ops import (delta_rule, delta_rule_step, gated_linear_attention, gated_linear_attention_step,
                         linear_attention)
from linattn.ops.delta.reference import delta_rule_recurrent

from .test_ops_delta import _both_paths  # noqa: F401  (autouse fixture: both CPU paths)


def _delta_inputs(b, h, n, d, e, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(b, h, n, d, generator=gen, dtype=torch.float64).to(dtype) for _ in range(2))
    v = torch.randn(b, h, n, e, generator=gen, dtype=torch.float64).to(dtype)
    beta = (torch.rand(b, h, n, generator=gen, dtype=torch.float64) * 0.9 + 0.05).to(dtype)
    g = (-torch.rand(b, h, n, generator=gen, dtype=torch.float64)).to(dtype)
    return q, k, v, beta, g


@pytest.mark.parametrize("shape, match", [((1, 1, 4, 0, 3), "head dim D >= 1"), ((1, 1, 4, 3, 0), "value dim E >= 1"),
                                          ((0, 1, 4, 3, 3), "batch B >= 1 and heads H >= 1"),
                                          ((1, 0, 4, 3, 3), "batch B >= 1 and heads H >= 1")])
def test_empty_dims_are_refused_by_the_delta_rule_and_its_step(shape, match):
    q, k, v, beta, g = _delta_inputs(*shape)
    for gate in (None, g):
        with pytest.raises(ValueError, match=match):
            delta_rule(q, k, v, beta, g=gate)
        with pytest.raises(ValueError, match=match):
            delta_rule_step(None, q[:, :, :1], k[:, :, :1], v[:, :, :1], beta[:, :, :1],
                            g=None if gate is None else gate[:, :, :1])


@pytest.mark.parametrize("chunk", [2**31 - 1, 2**40])
def test_a_chunk_far_beyond_the_sequence_is_one_chunk(chunk):
    """N = 33 with chunks of 2^31 − 1 and 2^40 tokens (any positive int is accepted): the recurrence's
    output and gradients."""
    q, k, v, beta, g = (x.requires_grad_() for x in _delta_inputs(1, 2, 33, 4, 3, dtype=torch.float64))
    o, S = delta_rule(q, k, v, beta, g=g, qk_l2norm=True, chunk_size=chunk, return_state=True)
    ro, rS = delta_rule_recurrent(q, k, v, beta, g=g, qk_l2norm=True)
    torch.testing.assert_close(o, ro, atol=1e-12, rtol=0)
    torch.testing.assert_close(S, rS, atol=1e-12, rtol=0)
    got = torch.autograd.grad(o.sum() + S.sum(), (q, k, v, beta, g))
    want = torch.autograd.grad(ro.sum() + rS.sum(), (q, k, v, beta, g))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-11, rtol=0)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -math.inf])
def test_non_finite_scales_are_refused(bad):
    q, k, v, beta, g = _delta_inputs(1, 1, 3, 4, 2)
    with pytest.raises(ValueError, match="scale must be finite"):
        delta_rule(q, k, v, beta, g=g, scale=bad)
    with pytest.raises(ValueError, match="scale must be finite"):
        delta_rule_step(None, q[:, :, :1], k[:, :, :1], v[:, :, :1], beta[:, :, :1], scale=bad)
    with pytest.raises(ValueError, match="scale must be finite"):
        gated_linear_attention(q, k, v, g, scale=bad)
    with pytest.raises(ValueError, match="scale must be finite"):
        gated_linear_attention_step(None, q[:, :, :1], k[:, :, :1], v[:, :, :1], g[:, :, :1], scale=bad)
    with pytest.raises(ValueError, match="scale must be finite"):
        linear_attention(q, k, v, causal=True, scale=bad)


def test_a_bool_scale_is_refused():
    q, k, v, beta, g = _delta_inputs(1, 1, 3, 4, 2)
    for call in (lambda: gated_linear_attention(q, k, v, g, scale=True),
                 lambda: linear_attention(q, k, v, causal=True, scale=True),
                 lambda: delta_rule(q, k, v, beta, scale=True)):
        with pytest.raises(TypeError, match="scale must be a float or None"):
            call()


@pytest.mark.parametrize("magnitude", [1e19, 1e25, 1e36])
def test_l2_normalization_of_huge_rows_in_float32(magnitude):
    """fp32 q, k of size up to 1e36 (‖x‖² overflows float32 from ≈1.8e19): with qk_l2norm the op is
    the float64 recurrence on the same inputs (whose norms do not overflow), chunked and step."""
    q, k, v, beta, g = _delta_inputs(1, 2, 9, 6, 3)
    q, k = q * magnitude, k * magnitude
    k[0, 1, 4] = k[0, 1, 4] / magnitude  # one row of ordinary size among them
    o, S = delta_rule(q, k, v, beta, g=g, qk_l2norm=True, chunk_size=4, return_state=True)
    ro, rS = delta_rule_recurrent(*(x.double() for x in (q, k, v, beta)), g=g.double(), qk_l2norm=True)
    assert ro.abs().max() > 0.1
    torch.testing.assert_close(o.double(), ro, atol=2e-5, rtol=0)
    torch.testing.assert_close(S.double(), rS, atol=2e-5, rtol=0)
    o1, S1 = delta_rule_step(None, q[:, :, :1], k[:, :, :1], v[:, :, :1], beta[:, :, :1], g=g[:, :, :1],
                             qk_l2norm=True)
    torch.testing.assert_close(o1.double(), ro[:, :, :1], atol=2e-5, rtol=0)
    qq = q.detach().clone().requires_grad_()
    delta_rule(qq, k, v, beta, g=g, qk_l2norm=True, chunk_size=4).sum().backward()
    assert torch.isfinite(qq.grad).all()
