"""Kimi Linear's layers in the fused decoding step (linattn.models.decoding, design §15, §22): KDA
(the delta mixer with a per-key-channel decay from a low-rank projection, β, the sigmoid output gate
after an RMSNorm) equals the eager step over several steps, left-padded batches, 1 and 2 threads,
float32 and bfloat16."""

from __future__ import annotations

import pytest
import torch

from linattn.models.decoding import fused_decoding_obstacle

from .test_decoding import (assert_bf16_steps_close, check_fused_equals_eager, make_model, prompts, run_both,
                            run_both_on_threads)


def _kda_model(dtype=torch.float32, **kw):
    model = make_model(dtype, attention=["kda", "softmax"], positions="none", n_layers=2, **kw)
    with torch.no_grad():  # faster decays than the init's, so a wrong channel shows within a few steps
        for block in model.blocks:
            gate = getattr(block.attn, "forget_gate", None)
            if gate is not None:
                gate.dt_bias.add_(torch.linspace(-1.0, 3.0, gate.dt_bias.numel()).to(dtype))
    return model


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("output_gate", [True, False])
def test_kda_fused_step_equals_eager_step(threads, output_gate):
    model = _kda_model(output_gate=output_gate)
    assert fused_decoding_obstacle(model) is None
    check_fused_equals_eager(model, threads=threads)


@pytest.mark.parametrize("threads", [1, 2])
def test_kda_bfloat16_fused_step_within_one_rounding_of_eager(threads):
    model = _kda_model(torch.bfloat16)
    ids, mask = prompts(2, 6, padded=True)
    out, _, _ = run_both_on_threads(model, ids, mask, 5, threads)
    assert_bf16_steps_close(out)


#: multi-head latent attention's options on the softmax layers (linattn.nn.mla)
MLA = [dict(kv_lora_rank=8, q_lora_rank=6, shared_k_dim=4, qk_dim=12, v_dim=10),
       dict(kv_lora_rank=8, qk_dim=12, v_dim=10, shared_k_dim=3),
       dict(kv_lora_rank=8, q_lora_rank=6, qk_dim=8)]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("opts", MLA)
def test_mla_fused_step_equals_eager_step(opts, threads):
    model = make_model(attention=["kda", "softmax"], positions="none", kind_options={"softmax": dict(opts)})
    assert model.blocks[1].attn.latent and fused_decoding_obstacle(model) is None
    check_fused_equals_eager(model, threads=threads)


def test_mla_bfloat16_fused_step_within_one_rounding_of_eager():
    model = make_model(torch.bfloat16, attention=["softmax"], positions="rope", kind_options={"softmax": MLA[0]})
    ids, mask = prompts(2, 6, padded=True)
    out, _, _ = run_both(model, ids, mask, 5)
    assert_bf16_steps_close(out)


def test_converted_kimi_linear_generates_fused_and_equals_transformers(monkeypatch):
    """A tiny Kimi Linear (KDA and MLA layers, MoE FFNs) through linattn.hf.accelerate: greedy
    generation of a left-padded batch takes the fused step (counted) and gives transformers' tokens."""
    pytest.importorskip("transformers.models.kimi_linear")
    import linattn.hf as H
    from linattn.models.decoding import FusedDecoder

    from . import test_hf_hybrid as hh
    from . import test_hf_kimi as hk

    calls = []
    step = FusedDecoder.step
    monkeypatch.setattr(FusedDecoder, "step", lambda self, ids: calls.append(1) or step(self, ids))
    m = hk.kimi_model()
    fast = H.accelerate(m)
    assert fused_decoding_obstacle(fast.model) is None
    a, b, _ = hh.greedy_left_padded(m, fast)
    assert b.tolist() == a.tolist()
    assert len(calls) >= 6  # the decoding steps after the prefill ran fused


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_converted_kimi_linear_fused_step_equals_eager(dtype):
    """The converted model's fused step against its eager step (left-padded batch): float32, bf16,
    and torchao's int8 weight-only Linears (the low-rank gates' and MLA's products read in place)."""
    pytest.importorskip("transformers.models.kimi_linear")
    from linattn.hf.kimi import from_transformers_kimi

    from . import test_hf_kimi as hk
    from .test_decoding_hybrid import fused_vs_eager

    lm = from_transformers_kimi(hk.kimi_model(), share=False)
    if dtype == "bfloat16":
        lm = lm.to(torch.bfloat16)
    if dtype == "int8":
        pytest.importorskip("torchao")
        from torchao.quantization import Int8WeightOnlyConfig, quantize_

        quantize_(lm, Int8WeightOnlyConfig())
    assert fused_decoding_obstacle(lm) is None
    fused_vs_eager(lm, steps=4)
