"""One decoding run (linattn.models.session.DecodingSession) and the plan's two contracts with it: the
plan counts no positions (the cache does), and it builds mixers by name from one table (issue 32)."""

from __future__ import annotations

import pytest
import torch

from linattn.models import LinearTransformerLM, ModelConfig
from linattn.models.decoding import FusedDecoder
from linattn.models.kinds import FUSED_MIXERS
from linattn.models.session import DecodingSession
from linattn.ops import native

pytestmark = pytest.mark.skipif(not native.load(), reason="the fused CPU kernels are not built")

VOCAB = 40


def make_model(**kw) -> LinearTransformerLM:
    cfg = dict(vocab_size=VOCAB, d_model=32, n_layers=3, n_heads=2, max_len=64, seed=7, positions="rope",
               attention=["linear", "softmax", "gated_deltanet"])
    cfg.update(kw)
    return LinearTransformerLM(ModelConfig(**cfg)).eval()


def padded_prompts():
    ids = torch.randint(0, VOCAB, (3, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(3, 6, dtype=torch.bool)
    mask[1, :2] = False
    mask[2, :4] = False
    return ids, mask


def test_the_mixer_table_is_the_kinds_tables_names():
    """csrc/model_mixers.h builds the mixers by name from one table; FUSED_MIXERS lists the same names."""
    assert sorted(torch.classes.linattn_cpu.DecodePlan.mixers()) == sorted(FUSED_MIXERS)


def test_the_plan_counts_no_positions():
    """The cache's counters are the only ones: a fused step hands the plan the cache's positions and
    advances the counters by one, as the eager step does; the plan itself advances nothing."""
    model = make_model(positions="learned")
    ids, mask = padded_prompts()
    with torch.no_grad():
        _, cache = model(ids, mask, cache=model.new_cache(), last_only=True)
        decoder = FusedDecoder(model, cache, reserve=2)
        seen, length = cache.seen.clone(), cache.length
        decoder.step(torch.tensor([1, 2, 3]))
    assert torch.equal(decoder.positions, seen)  # this step's positions, read from the cache
    assert cache.length == length + 1 and torch.equal(cache.seen, seen + 1)
    for lc in cache.layers:
        assert lc.length == length + 1 and torch.equal(lc.seen, seen + 1)
    positions = decoder.positions.clone()
    decoder.plan.step(torch.tensor([1, 2, 3]), positions, cache.length)  # the plan alone: nothing moves
    assert torch.equal(positions, decoder.positions) and cache.length == length + 1


def test_a_session_runs_fused_rebuilds_and_equals_the_eager_run():
    """Fused steps past the reserved room (the plan rebuilt), an eager call in between, a row selection
    (the next step eager, then fused again): the logits are the eager session's at every step."""
    model = make_model()
    ids, mask = padded_prompts()
    fused, eager = DecodingSession(model), DecodingSession(model, fused=False)
    toks = torch.randint(0, VOCAB, (9, 3), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        for s in (fused, eager):
            s.forward(ids, mask)
            s.reserve(2)
        plans = []
        for i, tok in enumerate(toks):
            if i == 4:  # an eager call of two tokens
                got, want = fused.forward(toks[i:i + 2].T), eager.forward(toks[i:i + 2].T)
            elif i == 6:  # beam search's reorder
                for s in (fused, eager):
                    s.select_rows(torch.tensor([2, 0, 0]))
                got, want = fused.step(tok), eager.step(tok)
                assert fused.decoder is None  # rows just selected: the eager step
            else:
                got, want = fused.step(tok).clone(), eager.step(tok)
                plans.append(fused.decoder)
            torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    assert eager.decoder is None and fused.decoder is not None
    assert plans[0] is plans[1] and plans[2] is not plans[1]  # two steps of room, then a new plan
    assert fused.batch_size == 3 and fused.cache.length == eager.cache.length


def test_fused_true_says_why_not():
    model = make_model(attention=["linear"], feature_map="t2r", n_layers=1)  # a φ with no fused code
    with pytest.raises(ValueError, match="fused=True: .*T2R"):
        DecodingSession(model, fused=True)
    with pytest.raises(ValueError, match="fused"):
        DecodingSession(model, fused="yes")
