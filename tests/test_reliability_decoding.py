"""FusedDecoder after an eager step on its cache, and its ids (issue 23, items 4 and 17).

The reference is the model's definition: a float64 copy of the model run on the whole sequence at
once (no cache), whose last logits are what any way of decoding that sequence must give. Before the
fix the fused step ignored an eager step taken on its cache (its plan kept the tensors the eager
step had replaced) and its logits were off by 8e-4 … 6.5e-2, with no error; float ids were truncated.
"""

from __future__ import annotations

import copy

import pytest
import torch

from linattn.models.decoding import FusedDecoder
from linattn.models import LinearTransformerLM, ModelConfig
from linattn.ops import native

pytestmark = pytest.mark.skipif(not native.load(), reason="the fused CPU kernels are not built")

VOCAB = 48
KINDS = ["linear", "softmax", "retnet", "simple_gla", "gla", "deltanet", "gated_deltanet"]


def make_model(**kw) -> LinearTransformerLM:
    cfg = dict(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=2, max_len=64, seed=3, positions="rope")
    cfg.update(kw)
    return LinearTransformerLM(ModelConfig(**cfg)).float().eval()


@pytest.mark.parametrize("block", ["transformer", "conv_mixer"])
@pytest.mark.parametrize("kind", KINDS)
def test_fused_steps_after_eager_steps_match_the_whole_sequence(kind, block):
    """Prefill, decoder built, then eager, fused, eager, eager, fused, fused steps on one cache: every
    fused step's logits equal the float64 model's on the whole sequence so far (left-padded rows)."""
    model = make_model(attention=[kind], block=block)
    ref = copy.deepcopy(model).double()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, 5), generator=gen)
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[1, :2] = False
    toks = torch.randint(0, VOCAB, (6, 2), generator=gen)
    with torch.no_grad():
        _, cache = model(ids, mask, cache=model.new_cache())
        decoder = FusedDecoder(model, cache, reserve=3)
        seq = ids
        for t, path in zip(toks, ["eager", "fused", "eager", "eager", "fused", "fused"]):
            seq = torch.cat([seq, t[:, None]], 1)
            full_mask = torch.cat([mask, torch.ones(2, seq.shape[1] - 5, dtype=torch.bool)], 1)
            want = ref(seq, full_mask)[0][:, -1]
            if path == "eager":
                got = model(t[:, None], cache=cache)[0][:, -1]
            else:
                got = decoder.step(t).clone()
            torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-4, msg=lambda m: f"{path}: {m}")
    assert cache.length == 11


def test_float_ids_are_refused_as_the_eager_path_does():
    model = make_model(attention=["linear"])
    with torch.no_grad():
        _, cache = model(torch.tensor([[1, 2, 3]]), cache=model.new_cache())
        decoder = FusedDecoder(model, cache)
        with pytest.raises(ValueError, match="ids must be an integer tensor"):  # the eager path refuses floats
            model(torch.tensor([[1.7]]), cache=copy.deepcopy(cache))
        for bad in (torch.tensor([1.7]), torch.tensor([True]), torch.tensor([1.0], dtype=torch.float64)):
            with pytest.raises(ValueError, match="ids must be an integer tensor"):
                decoder.step(bad)
        assert cache.length == 3
        decoder.step(torch.tensor([2], dtype=torch.int32))  # integer dtypes other than long still run
        assert cache.length == 4
