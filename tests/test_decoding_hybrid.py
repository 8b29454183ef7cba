"""The fused decoding step on transformers' hybrids converted by linattn.hf (issue 34): OLMo-Hybrid's
post-norm blocks and q/k RMSNorm across the heads, Qwen3-Next's and Qwen3.5-MoE's mixture-of-experts
FFN. From one left-padded prefill the fused step's logits equal the eager step's over several steps
(float32: to its rounding; bf16: to a bf16 rounding or two), int8 weights included."""

import pytest
import torch

pytest.importorskip("transformers")

from linattn.hf.hybrid import from_transformers_hybrid  # noqa: E402
from linattn.models.decoding import FusedDecoder, fused_decoding_obstacle  # noqa: E402

from . import test_hf_hybrid as hh  # noqa: E402


def fused_vs_eager(lm, steps=5, b=3, n=7):
    """Runs `steps` tokens through the eager and the fused step from one left-padded prefill of a
    batch of b rows; asserts their logits equal at each step (the eager greedy tokens fed to both).
    Returns the eager logits of the last step."""
    x = hh.ids(b=b, n=n)
    mask = torch.ones_like(x, dtype=torch.bool)
    mask[1, :2] = False
    if b > 2:
        mask[2, :4] = False
    bf16 = next(lm.parameters()).dtype == torch.bfloat16
    with torch.no_grad():
        logits_, eager = lm(x, mask, cache=lm.new_cache(), last_only=True)
        _, fused = lm(x, mask, cache=lm.new_cache(), last_only=True)
        decoder = FusedDecoder(lm, fused, reserve=steps)
        tok = logits_[:, -1].argmax(-1)
        for _ in range(steps):
            le, eager = lm(tok[:, None], cache=eager, last_only=True)
            lf = decoder.step(tok).clone()
            if bf16:  # bf16 logits of size ~1: one bf16 rounding is 2^-8 relative; allow two
                torch.testing.assert_close(lf.float(), le[:, -1].float(), atol=2e-2, rtol=2e-2)
            else:
                torch.testing.assert_close(lf, le[:, -1], atol=2e-6 * le.abs().max().item(), rtol=1e-5)
            tok = le[:, -1].argmax(-1)
    return le


def olmo(dtype=torch.float32, **over):
    return from_transformers_hybrid(hh.olmo_model(**over), share=False).to(dtype)


def moe(model_type, dtype=torch.float32):
    return from_transformers_hybrid(hh.moe_model(model_type), share=False).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("nope", [False, True], ids=["rope", "nope"])
def test_olmo_hybrid_fused_step_equals_eager(dtype, nope):
    lm = olmo(dtype, nope=nope)
    blocks = lm.blocks
    assert blocks[1].post_norm and blocks[1].attn.qk_norm_across_heads  # what the fused step now plans
    assert fused_decoding_obstacle(lm) is None
    fused_vs_eager(lm)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("model_type", hh.MOE_TYPES)
def test_moe_fused_step_equals_eager(model_type, dtype):
    lm = moe(model_type, dtype)
    assert fused_decoding_obstacle(lm) is None
    fused_vs_eager(lm)


@pytest.mark.parametrize("threads", [1, 3])
def test_moe_fused_step_without_shared_expert_and_post_norm(threads):
    """The MoE op writing a buffer (post-norm block: x ← x + Norm₂(MoE(x))) and without a shared expert:
    an OLMo-Hybrid whose FFNs are swapped for MoE ones (a combination no converted model has); on one
    thread and on three (uneven column shares, threads without hidden columns at the MoE op's barrier)."""
    from linattn.nn.moe import MoEFeedForward

    lm = olmo()
    torch.manual_seed(3)
    with torch.no_grad():
        for i, block in enumerate(lm.blocks):
            ffn = MoEFeedForward(64, 5, 3, 12, None, norm_topk_prob=bool(i % 2))
            torch.nn.init.normal_(ffn.router.weight, std=0.5)
            ffn.gate_up.mul_(10)
            block.ffn = ffn.eval()
    assert fused_decoding_obstacle(lm) is None
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        fused_vs_eager(lm, b=2)
    finally:
        torch.set_num_threads(before)


def test_qk_norm_all_after_a_short_convolution_is_refused_by_name():
    lm = olmo()
    attn = lm.blocks[1].attn
    attn.conv = lm.blocks[0].attn.conv  # any convolution: the obstacle is the order conv → norm across heads
    assert "qk_norm='all'" in fused_decoding_obstacle(lm)


@pytest.mark.parametrize("make", [lambda: olmo(), lambda: moe("qwen3_5_moe")], ids=["olmo_hybrid", "qwen3_5_moe"])
def test_int8_weights_fused_step_equals_eager(make):
    """torchao's int8 weight-only Linears (attention, router, shared expert; the stacked experts stay
    float: quantize_ takes nn.Linear only) read in place by the fused step."""
    torchao = pytest.importorskip("torchao")
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    lm = make()
    quantize_(lm, Int8WeightOnlyConfig())
    assert fused_decoding_obstacle(lm) is None
    fused_vs_eager(lm, steps=3)
    del torchao


@pytest.mark.parametrize("make", [hh.olmo_model, lambda: hh.moe_model("qwen3_next"),
                                  lambda: hh.moe_model("qwen3_5_moe")],
                         ids=["olmo_hybrid", "qwen3_next", "qwen3_5_moe"])
def test_accelerate_generate_runs_fused_and_equals_transformers(make, monkeypatch):
    """Through linattn.hf.accelerate, greedy generation of a left-padded batch takes the fused step
    (counted) and gives transformers' own tokens."""
    import linattn.hf as H

    calls = []
    step = FusedDecoder.step
    monkeypatch.setattr(FusedDecoder, "step", lambda self, ids: calls.append(1) or step(self, ids))
    m = make()
    fast = H.accelerate(m)
    assert fused_decoding_obstacle(fast.model) is None
    a, b, _ = hh.greedy_left_padded(m, fast)
    assert b.tolist() == a.tolist()
    assert len(calls) >= 6  # the decoding steps after the prefill ran fused
