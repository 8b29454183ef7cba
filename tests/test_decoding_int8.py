"""The fused decoding step on 8-bit weight-only quantized models (torchao's Int8WeightOnlyConfig;
linattn.models.weights, csrc/matvec.h) and on bf16 ones.

References: the eager step of the same quantized model (torchao's own F.linear: (x · qᵀ) · s), which
the fused step must match up to the order of float sums; the int8 products themselves against the
dequantised matrix product in float64, within the float32 rounding bound of a K-term sum."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from linattn.models.decoding import FusedDecoder, fused_decoding_obstacle
from linattn.models.weights import is_quantized
from linattn.ops import native

from .test_decoding import (assert_bf16_steps_close, assert_close_steps, check_fused_equals_eager, make_model,
                            perturb_biases, prompts, run_both, states)

torchao = pytest.importorskip("torchao", reason="torchao (the quant extra: pip install linattn[quant]) is not installed")
from torchao.quantization import Int8WeightOnlyConfig, quantize_  # noqa: E402

pytestmark = pytest.mark.skipif(not native.load(), reason="the fused CPU kernels are not built")


def quantized(dtype=torch.float32, config=None, **kw):
    model = make_model(dtype, **kw)
    quantize_(model, config or Int8WeightOnlyConfig())
    return model


def linears(model):
    return [m for m in model.modules() if isinstance(m, nn.Linear)]


# ---- the int8 products against float64


def plan_matvec(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor | None, kn: bool, threads: int = 1,
                act: int = 0) -> torch.Tensor:
    """y = (x · qᵀ) · s through one product of a bare DecodePlan (q (N, K) int8, scale (N,)); act: the
    activations quantized too, per row (1) or per tensor (2; csrc/matvec_dynamic.h). scale None: q is a
    float32 or bfloat16 matrix, y = x · qᵀ (fp32 activations and outputs)."""
    b, n = x.shape[0], q.shape[0]
    plan = torch.classes.linattn_cpu.DecodePlan(b, False)
    out = torch.zeros(b, n)
    plan.add("group", {"input": x}, {"_": 0}, {"_": 0.0})
    weight = q.t().contiguous() if kn else q.contiguous()
    tensors = {"weight": weight, "out": out} if scale is None else {"weight": weight, "scale": scale, "out": out}
    plan.add("product", tensors, {"kn": int(kn), "epilogue": 0, "act_quant": act}, {"_": 0.0})
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        plan.step(torch.zeros(b, dtype=torch.long), torch.zeros(b, dtype=torch.long), 0)
    finally:
        torch.set_num_threads(before)
    return out


@pytest.mark.parametrize("kn", [False, True])
@pytest.mark.parametrize("batch, k, n, threads", [(1, 1, 1, 1), (1, 15, 17, 1), (2, 16, 48, 1), (5, 37, 33, 1),
                                                  (9, 64, 40, 1), (3, 256, 200, 2), (8, 130, 300, 2),
                                                  (1, 200, 70, 1), (1, 130, 33, 2), (1, 64, 20, 1)])
def test_int8_matvec_equals_dequantised_matmul_in_float64(batch, k, n, threads, kn):
    g = torch.Generator().manual_seed(batch * 1000 + k + n)
    x = torch.randn(batch, k, generator=g)
    q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n, generator=g) * 0.02 + 1e-3
    y = plan_matvec(x, q, scale, kn, threads)
    w = q.double() * scale.double()[:, None]
    ref = x.double() @ w.t()
    # float32 sum of K products, then one product with the scale: |error| ≤ (K + 1)·u·Σ|x_i w_ji|
    bound = (k + 1) * 2.0 ** -24 * (x.double().abs() @ w.abs().t())
    assert torch.all((y.double() - ref).abs() <= bound), (y.double() - ref).abs().max()
    assert torch.count_nonzero(y) > 0


@pytest.mark.skipif(os.environ.get("LINATTN_INT8_KERNEL") == "portable", reason="this is the portable run")
def test_int8_portable_kernels_too():
    """The generic int8 kernels (every ISA clone; AVX-512 machines take vpmovsxbd ones, matvec.h) pass
    the float64 test as well: the same tests in a process with LINATTN_INT8_KERNEL=portable."""
    run_portable(__file__, "matvec_equals or int8_fused_step_equals_eager_step[")


def run_portable(path: str, selection: str) -> None:
    """The tests of file `path` matching `selection` (pytest -k) pass in a process with
    LINATTN_INT8_KERNEL=portable (the generic int8 kernels)."""
    env = {**os.environ, "LINATTN_INT8_KERNEL": "portable"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider", path,
                          "-k", selection], env=env,
                         cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "failed" not in run.stdout


def test_int8_matvec_equals_torchao_linear():
    """The product of a quantized nn.Linear's own int8 data and scales, as the plan reads them, is
    torchao's F.linear up to the order of the float sums."""
    lin = nn.Sequential(nn.Linear(96, 70, bias=False))
    quantize_(lin, Int8WeightOnlyConfig())
    w = lin[0].weight
    assert is_quantized(w) and w.qdata.dtype == torch.int8 and list(w.block_size) == [1, 96]
    x = torch.randn(4, 96, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = lin(x)
    y = plan_matvec(x, w.qdata, w.scale.reshape(-1).float().contiguous(), False)
    torch.testing.assert_close(y, ref, atol=2e-6, rtol=1e-5)


def test_plan_checks_int8_scales():
    x = torch.randn(2, 8)
    q = torch.ones(4, 8, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="only they. take a scale"):
        _product_without_scale(x, q)
    with pytest.raises(RuntimeError, match="float32 .N=4. vector"):
        plan_matvec(x, q, torch.ones(3), False)


def _product_without_scale(x, q):
    plan = torch.classes.linattn_cpu.DecodePlan(x.shape[0], False)
    plan.add("group", {"input": x}, {"_": 0}, {"_": 0.0})
    plan.add("product", {"weight": q, "out": torch.zeros(x.shape[0], q.shape[0])}, {"kn": 0, "epilogue": 0},
             {"_": 0.0})


# ---- whole models: the fused step against the eager step of the same quantized model


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kind", ["linear", "softmax", "gated_deltanet", "gla"])
def test_int8_fused_step_equals_eager_step(kind, threads):
    model = quantized(attention=[kind, "linear"], n_layers=2, positions="rope", short_conv=3, output_gate=True,
                      tie_embeddings=kind == "softmax", bias=True)
    assert all(is_quantized(m.weight) for m in linears(model))
    assert fused_decoding_obstacle(model) is None
    check_fused_equals_eager(model, threads=threads)


@settings(max_examples=8, deadline=None)
@given(kinds=st.lists(st.sampled_from(["linear", "softmax", "gated_deltanet", "simple_gla", "deltanet", "retnet"]),
                      min_size=1, max_size=2),
       batch=st.integers(1, 4), prompt=st.integers(1, 7), norm=st.sampled_from(["rmsnorm", "layernorm"]),
       activation=st.sampled_from(["swiglu", "gelu"]), bias=st.booleans(), tie=st.booleans(),
       short_conv=st.sampled_from([None, 0, 3]), gate=st.sampled_from([None, True, False]),
       threads=st.sampled_from([1, 2]), block=st.sampled_from(["transformer", "conv_mixer"]))
def test_int8_fused_step_equals_eager_step_over_configs(kinds, batch, prompt, norm, activation, bias, tie, short_conv,
                                                        gate, threads, block):
    model = make_model(attention=kinds, n_layers=2 * len(kinds), norm=norm, activation=activation, bias=bias,
                       tie_embeddings=tie, short_conv=short_conv, output_gate=gate, block=block, positions="rope")
    if bias:
        perturb_biases(model)
    quantize_(model, Int8WeightOnlyConfig())
    assert fused_decoding_obstacle(model) is None
    check_fused_equals_eager(model, threads=threads, batch=batch, n=prompt, steps=4)


@pytest.mark.parametrize("kind", ["linear", "gated_deltanet"])
def test_int8_conv_mixer_and_gelu(kind):
    model = quantized(attention=[kind], block="conv_mixer", n_layers=2, conv_mixer_kernel=3, activation="gelu",
                      norm="layernorm")
    assert fused_decoding_obstacle(model) is None
    ids, mask = prompts(4, 6, padded=True)
    out, _, _ = run_both(model, ids, mask, 5)
    assert_close_steps(out)


def test_int8_per_tensor_scales_and_column_major_layouts():
    from torchao.quantization.granularity import PerTensor

    model = quantized(config=Int8WeightOnlyConfig(granularity=PerTensor()), attention=["gated_deltanet"])
    w = model.blocks[0].attn.qkv.weight
    assert w.scale.numel() == 1 and w.qdata.t().is_contiguous()  # column_major: the plan reads it as kn
    assert fused_decoding_obstacle(model) is None
    ids, mask = prompts(2, 5, padded=True)
    out, _, _ = run_both(model, ids, mask, 4)
    assert_close_steps(out)


def test_int8_weight_streaming_reads_the_int8_bytes():
    model = quantized(attention=["gated_deltanet"], tie_embeddings=False)
    with torch.no_grad():
        _, cache = model(torch.tensor([[1, 2]]), cache=model.new_cache())
    decoder = FusedDecoder(model, cache)
    expected = sum(m.weight.qdata.numel() + 4 * m.out_features for m in linears(model))
    assert decoder.weight_bytes == expected  # one byte a weight and a float scale a row: no float copy
    state = [t.clone() for t in states(cache)]
    decoder.weight_streaming()
    for a, b in zip(state, states(cache)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kind", ["linear", "gated_deltanet", "softmax"])
def test_int8_greedy_generation_same_tokens_fused_and_eager(kind):
    model = quantized(attention=[kind, "softmax"], positions="rope")
    ps = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15]]
    eager = model.generate(ps, 16, temperature=0, fused=False)
    assert model.generate(ps, 16, temperature=0, fused=True) == eager


# ---- bf16


@pytest.mark.parametrize("kind", ["linear", "gated_deltanet", "softmax", "gla"])
def test_bf16_int8_fused_step_within_one_rounding_of_eager(kind):
    model = quantized(torch.bfloat16, attention=[kind], positions="rope", short_conv=3, output_gate=True)
    assert fused_decoding_obstacle(model) is None
    ids, mask = prompts(2, 6, padded=True)
    out, _, _ = run_both(model, ids, mask, 5)
    assert_bf16_steps_close(out)


@pytest.mark.parametrize("kind", ["gated_deltanet", "softmax"])
def test_bf16_fused_greedy_tokens_equal_eager(kind):
    model = make_model(torch.bfloat16, attention=[kind, "linear"], positions="rope", short_conv=3, output_gate=True)
    ps = [[1, 2, 3, 4, 5], [7, 8]]
    assert model.generate(ps, 12, temperature=0, fused=True) == model.generate(ps, 12, temperature=0, fused=False)


# ---- what the fused step does not read: refused by name, generation takes the eager step


def test_refuses_per_group_scales_and_runs_eager():
    from torchao.quantization.granularity import PerGroup

    model = quantized(config=Int8WeightOnlyConfig(granularity=PerGroup(16)), attention=["linear"])
    why = fused_decoding_obstacle(model)
    assert why is not None and "blocks.0.attn.qkv.weight" in why and "per-group" in why
    with pytest.raises(ValueError, match="per-group"):
        model.generate([1, 2], 3, fused=True)
    assert model.generate([1, 2, 3], 4, temperature=0) == model.generate([1, 2, 3], 4, temperature=0, fused=False)


def test_refuses_asymmetric_activation_quantization():
    """Dynamic int8 activations are read (tests/test_decoding_int8_dynamic.py), asymmetric ones are not."""
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, MappingType

    model = quantized(config=Int8DynamicActivationInt8WeightConfig(act_mapping_type=MappingType.ASYMMETRIC),
                      attention=["linear"])
    why = fused_decoding_obstacle(model)
    assert why is not None and "asymmetrically" in why and ".weight" in why


def test_refuses_a_quantized_embedding():
    model = make_model(attention=["linear"])
    quantize_(model, Int8WeightOnlyConfig(), filter_fn=lambda m, fqn: isinstance(m, nn.Embedding))
    why = fused_decoding_obstacle(model)
    assert why is not None and "tok_emb.weight" in why and "Embedding" in why
