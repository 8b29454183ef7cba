"""bf16 models converted by linattn.hf (Qwen3.5, Qwen3-Next, Qwen3.5-MoE, OLMo-Hybrid, Kimi Linear) against
transformers' own bf16 forward and greedy decoding. Two bf16 implementations round at different places,
so neither is the other's oracle: both are measured against the float32 model, and linattn's bf16 error
must be of the size of transformers' (at most twice it, plus a bf16 rounding of the logits). Measured
when written (median over positions of the largest logit error, transformers / linattn): Qwen3.5
0.0031 / 0.0036, Qwen3-Next 0.0034 / 0.0039, Qwen3.5-MoE 0.0028 / 0.0037, OLMo-Hybrid 0.0046 / 0.0045,
Kimi Linear 0.051 / 0.057 (logits up to 0.5-2.2)."""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.qwen3_5")
pytest.importorskip("transformers.models.kimi_linear")

import linattn.hf as H  # noqa: E402
from linattn.hf.hybrid import from_transformers_hybrid  # noqa: E402
from linattn.hf.kimi import from_transformers_kimi  # noqa: E402
from linattn.models.decoding import fused_decoding_obstacle  # noqa: E402

from .test_hf_hybrid import ids, logits, moe_model, olmo_model, qwen35  # noqa: E402
from .test_hf_kimi import kimi_model  # noqa: E402

MODELS = {
    "qwen3_5": (lambda: qwen35(), from_transformers_hybrid),
    "qwen3_next": (lambda: moe_model("qwen3_next"), from_transformers_hybrid),
    "qwen3_5_moe": (lambda: moe_model("qwen3_5_moe"), from_transformers_hybrid),
    "olmo_hybrid": (lambda: olmo_model(), from_transformers_hybrid),
    "kimi_linear": (lambda: kimi_model(), from_transformers_kimi),
}


def _error(x: torch.Tensor, ref: torch.Tensor) -> float:
    """The median over positions of the largest logit error at a position: a bf16 rounding can flip an
    MoE router's choice at a few positions (in either implementation), which the median passes over."""
    return float((x.float() - ref).abs().amax(-1).median())


@pytest.mark.parametrize("name", MODELS)
def test_bf16_logits_as_close_to_float32_as_transformers_bf16(name):
    build, convert = MODELS[name]
    m32 = build()
    m16 = copy.deepcopy(m32).to(torch.bfloat16)
    lm = convert(m16)
    assert lm.tok_emb.weight.dtype == torch.bfloat16
    x = ids(n=17)
    with torch.no_grad():
        ref = m32(x).logits
        theirs = m16(x).logits
        mine = logits(lm, x)
    assert mine.dtype == torch.bfloat16
    scale = float(ref.abs().max())
    assert scale > 0.1
    their_error, my_error = _error(theirs, ref), _error(mine, ref)
    assert their_error > 0  # bf16 did round: the comparison below measures something
    assert my_error <= 2 * their_error + 2 ** -8 * scale, (my_error, their_error)


@pytest.mark.parametrize("name", ["qwen3_5", "olmo_hybrid", "kimi_linear"])
def test_bf16_accelerated_greedy_decoding_follows_its_own_logits(name):
    """accelerate() on a bf16 model decodes with the fused bf16 step: each greedy token is the argmax of
    linattn's own bf16 forward over the sequence so far (the step and the parallel form agree), and the
    first token equals transformers' bf16 choice unless their top two logits are within a rounding."""
    build, _ = MODELS[name]
    m16 = build().to(torch.bfloat16)
    fast = H.accelerate(copy.deepcopy(m16))
    assert fused_decoding_obstacle(fast.model) is None  # generate runs the fused bf16 step
    x = ids(b=1, n=9, seed=3)
    out = fast.generate(x, max_new_tokens=6, do_sample=False)
    lm = fast.model
    with torch.no_grad():
        full = logits(lm, out[:, :-1])
        theirs = m16(x).logits[0, -1].float()
    for t in range(x.shape[1], out.shape[1]):
        row = full[0, t - 1].float()
        top2 = row.topk(2).values
        assert out[0, t] == row.argmax() or float(top2[0] - top2[1]) <= 2 ** -7 * float(top2[0].abs()), t
    best = theirs.topk(2)
    if float(best.values[0] - best.values[1]) > 2 ** -6 * float(best.values[0].abs()):
        assert out[0, x.shape[1]] == best.indices[0]
