"""The fused decoding step on models quantized by torchao's Int8DynamicActivationInt8WeightConfig (int8
weights, activations rounded to int8 per row or per tensor, integer products; csrc/matvec_dynamic.h).

References: torchao's own F.linear on the same quantized weight (its CPU path: symmetric activation
scales, `_int_mm`, then the two scales), which the plan's product must equal to the bit, and the
quantization formula written out in torch ops; whole models against their eager step."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from linattn.models.decoding import fused_decoding_obstacle
from linattn.models.weights import activation_quantization
from linattn.ops import native

from .test_decoding import make_model, prompts, run_both_on_threads
from .test_decoding_int8 import plan_matvec, run_portable

torchao = pytest.importorskip("torchao", reason="torchao (the quant extra: pip install linattn[quant]) is not installed")
from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_  # noqa: E402
from torchao.quantization.granularity import PerRow, PerTensor  # noqa: E402

pytestmark = pytest.mark.skipif(not native.load(), reason="the fused CPU kernels are not built")


def formula(x, q, scale, act: int) -> torch.Tensor:
    """torchao's symmetric dynamic int8 product written out: s_x = max(max|x| / 127.5, eps), x_q =
    clamp(round(x · (1/s_x))), y = (float(x_q · qᵀ) · s_x) · s."""
    m = x.abs().amax(-1, keepdim=True) if act == 1 else x.abs().amax().expand(x.shape[0], 1)
    sx = torch.clamp(m / 127.5, min=torch.finfo(torch.float32).eps)
    xq = torch.clamp(torch.round(x * (1.0 / sx)), -128, 127).to(torch.int64)
    c = xq @ q.to(torch.int64).t()
    return (c.to(torch.float32) * sx) * scale


@pytest.mark.parametrize("act", [1, 2])
@pytest.mark.parametrize("kn", [False, True])
@pytest.mark.parametrize("batch, k, n, threads", [(1, 1, 1, 1), (1, 15, 17, 1), (2, 64, 64, 1), (5, 37, 33, 1),
                                                  (9, 130, 70, 1), (3, 256, 200, 2), (6, 67, 129, 2),
                                                  (1, 64, 16, 1), (1, 200, 70, 1), (1, 130, 33, 2), (1, 320, 19, 1)])
def test_dynamic_matvec_equals_the_formula_to_the_bit(batch, k, n, threads, kn, act):
    g = torch.Generator().manual_seed(batch * 1000 + k + n)
    x = torch.randn(batch, k, generator=g) * torch.rand(batch, 1, generator=g) * 4
    x[0, 0] = 0.5 / 127.5 * x[0].abs().max()  # a value that rounds half way
    q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n, generator=g) * 0.02 + 1e-3
    y = plan_matvec(x, q, scale, kn, threads, act)
    assert torch.equal(y, formula(x, q, scale, act))
    assert torch.count_nonzero(y) > 0


def test_zero_rows_and_extreme_weights():
    x = torch.zeros(3, 70)
    x[1] = 1e-30  # below the eps scale: rounds to zero
    x[2, ::3] = -5.0
    q = torch.full((40, 70), -128, dtype=torch.int8)
    q[::2] = 127
    scale = torch.rand(40) + 0.5
    for kn in (False, True):
        for act in (1, 2):
            assert torch.equal(plan_matvec(x, q, scale, kn, act=act), formula(x, q, scale, act))


@pytest.mark.parametrize("granularity", [PerRow(), PerTensor()], ids=["per_row", "per_tensor"])
def test_dynamic_matvec_equals_torchao_linear(granularity):
    lin = nn.Sequential(nn.Linear(96, 70, bias=False))
    quantize_(lin, Int8DynamicActivationInt8WeightConfig(granularity=granularity))
    w = lin[0].weight
    act = activation_quantization(lin[0])
    assert act == (1 if isinstance(granularity, PerRow) else 2)
    x = torch.randn(4, 96, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = lin(x)
    scale = w.scale.reshape(-1).float().expand(70).contiguous()
    assert torch.equal(plan_matvec(x, w.qdata, scale, False, act=act), ref)


def test_plan_checks_act_quant():
    x = torch.randn(2, 8)
    with pytest.raises(RuntimeError, match="act_quant must be 0, 1"):
        plan_matvec(x, torch.ones(4, 8, dtype=torch.int8), torch.ones(4), False, act=3)


@pytest.mark.skipif(os.environ.get("LINATTN_INT8_KERNEL") == "portable", reason="this is the portable run")
def test_dynamic_portable_kernels_too():
    """The integer loops that run without VNNI pass the same tests (LINATTN_INT8_KERNEL=portable)."""
    run_portable(__file__, "to_the_bit or extreme or fused_step")


# The fused and the eager steps quantize inputs that agree to float32 rounding, not always to the bit
# (sums in another order), and an input within an ulp of a rounding boundary of x · (1/s_x) can round
# to the neighbouring integer in one path only: that output then moves by s_x · s_j · |w_ji|, a
# quantization step (1/127.5 of the row's largest input), not a rounding, and a recurrent state carries
# it on. Hence two checks: every step within FLIP (2.5 such steps) of the logits' scale, and over many
# small models most steps equal to float32 rounding (measured when written: 23 of 24 bit for bit or
# within 6e-8, one flip moving logits of ~0.4 by ~1e-3). The products themselves are tested to the bit.
FLIP = 2e-2


def steps_of(model, granularity, batch: int, threads: int = 1, steps: int = 3):
    quantize_(model, Int8DynamicActivationInt8WeightConfig(granularity=granularity))
    assert all(activation_quantization(m) for m in model.modules() if isinstance(m, nn.Linear))
    assert fused_decoding_obstacle(model) is None
    ids, mask = prompts(batch, 7, padded=batch > 1)
    out, _, _ = run_both_on_threads(model, ids, mask, steps, threads)
    for le, lf, _ in out:
        assert float((lf - le).abs().max()) <= FLIP * float(le.abs().max())
    return [bool(torch.allclose(lf, le, atol=2e-6, rtol=1e-5)) for le, lf, _ in out]


def test_dynamic_fused_steps_mostly_equal_eager_to_float32_rounding():
    exact = []
    for kw in (dict(attention=["linear"], n_layers=1), dict(attention=["linear"], n_layers=1, positions="rope"),
               dict(attention=["softmax"], n_layers=1), dict(attention=["linear"], n_layers=2)):
        for granularity in (PerRow(), PerTensor()):
            for batch in (1, 3):
                exact += steps_of(make_model(**kw), granularity, batch)
    assert sum(exact) * 4 >= len(exact) * 3, f"only {sum(exact)} of {len(exact)} steps equal to float32 rounding"


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kind, granularity", [("gated_deltanet", PerRow()), ("softmax", PerRow()),
                                               ("linear", PerTensor())])
def test_dynamic_fused_step_within_a_flip_of_eager(kind, granularity, threads):
    model = make_model(attention=[kind, "linear"], n_layers=2, positions="rope", short_conv=3, output_gate=True,
                       tie_embeddings=False, bias=True)
    steps_of(model, granularity, 3, threads, steps=6)


def test_dynamic_quantization_of_a_bf16_model_is_refused_by_name():
    model = make_model(torch.bfloat16, attention=["gated_deltanet"])
    quantize_(model, Int8DynamicActivationInt8WeightConfig())
    why = fused_decoding_obstacle(model)
    assert why is not None and "bfloat16 model" in why and "parameter " in why
