"""linattn.models.generation: greedy == argmax of the full forward, padded batches == prompts alone,
constant-size linear state, streaming, sampling filters, stop tokens, argument checks."""

import re

import pytest
import torch

from linattn.models.generation import filter_logits, prepare_prompts, sample_next
from linattn.models import LinearTransformerLM

from .conftest import spread, tiny_config


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def lm(**kw):
    return spread(LinearTransformerLM(tiny_config(**kw))).double().eval()


PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 1], [9, 9, 2, 4]]


def _greedy_by_full_forward(model, prompt, n):
    seq, out = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            logits, _ = model(torch.tensor([seq]))
            t = int(logits[0, -1].argmax())
            out.append(t)
            seq.append(t)
    return out


@pytest.mark.parametrize("kw", [
    dict(attention=["linear"], feature_map="elu"),
    dict(attention=["linear", "softmax"], feature_map="favor"),
    dict(attention=["softmax", "linear"], feature_map="cosformer", positions="learned"),
])
def test_greedy_equals_repeated_argmax_of_full_forward(kw):
    model = lm(**kw)
    for prompt in PROMPTS[:2]:
        got = model.generate(prompt, 12, temperature=0)
        assert got == [_greedy_by_full_forward(model, prompt, 12)]


@pytest.mark.parametrize("kw", [
    dict(attention=["linear", "softmax"], feature_map="elu", positions="rope"),
    dict(attention=["linear"], feature_map="cosformer", positions="rope"),
    dict(attention=["softmax", "linear"], feature_map="taylor", qk_dim=4, positions="learned"),
])
def test_batch_of_different_lengths_equals_each_alone(kw):
    model = lm(**kw)
    alone = [model.generate(p, 10, temperature=0)[0] for p in PROMPTS]
    assert model.generate(PROMPTS, 10, temperature=0) == alone
    assert len({tuple(a) for a in alone}) == 3  # the prompts do lead to different continuations
    sampled_alone = [model.generate(p, 8, temperature=0.8, top_k=20, top_p=0.95, seed=7)[0] for p in PROMPTS]
    assert model.generate(PROMPTS, 8, temperature=0.8, top_k=20, top_p=0.95, seed=7) == sampled_alone


def test_padded_tensor_with_mask_equals_list_input():
    model = lm(attention=["linear", "softmax"])
    ids, mask = prepare_prompts(PROMPTS)
    assert ids.shape == (3, 7) and mask.sum(1).tolist() == [7, 2, 4]
    assert ids[1].tolist() == [0] * 5 + [3, 1]
    assert model.generate(ids, 6, temperature=0, mask=mask) == model.generate(PROMPTS, 6, temperature=0)
    with pytest.raises(ValueError, match="left-padded"):
        model.generate(ids, 3, mask=mask.flip(1))


def test_linear_state_constant_size_softmax_cache_grows():
    model = lm(attention=["linear", "softmax"], feature_map="favor")
    cache = model.new_cache()
    with torch.no_grad():
        model(torch.randint(0, 40, (2, 8)), cache=cache)
        lin0 = [t.shape for t in cache.layers[0].state]
        nb0 = cache.nbytes
        for _ in range(60):
            model(torch.randint(0, 40, (2, 1)), cache=cache)
    assert [t.shape for t in cache.layers[0].state] == lin0
    assert cache.nbytes[0] == nb0[0]  # linear: (kv, z) only
    assert cache.nbytes[1] == nb0[1] * 68 // 8  # softmax: K/V grow with the context
    assert cache.length == 68


def test_stream_matches_generate_and_stop_tokens():
    model = lm(attention=["linear", "softmax"])
    free = model.generate(PROMPTS, 10, temperature=0)
    stop = free[1][3]
    steps = list(model.stream(PROMPTS, 10, temperature=0, stop_tokens=[stop]))
    got = model.generate(PROMPTS, 10, temperature=0, stop_tokens=[stop])
    for i, row in enumerate(free):
        cut = row.index(stop) + 1 if stop in row else len(row)
        assert got[i] == row[:cut]
        assert [s[i] for s in steps][:cut] == row[:cut]
        assert all(s[i] is None for s in steps[cut:])
    assert len(steps) == max(len(r) for r in got)  # ends when every prompt stopped (or at the limit)


def test_sampling_is_seeded_and_model_mode_restored():
    model = lm()
    model.train()
    a = model.generate(PROMPTS[0], 10, temperature=1.0, seed=3)
    b = model.generate(PROMPTS[0], 10, temperature=1.0, seed=3)
    c = model.generate(PROMPTS[0], 10, temperature=1.0, seed=4)
    assert a == b and a != c
    assert model.training
    assert model.generate(PROMPTS[0], 6, top_k=1, seed=1) == model.generate(PROMPTS[0], 6, temperature=0)
    assert model.generate(PROMPTS[0], 0) == [[]]


def test_filter_logits_top_k_and_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.05, 0.3, 0.15]]))
    keep = lambda x: torch.isfinite(x)[0].tolist()  # noqa: E731
    assert keep(filter_logits(logits, top_k=2)) == [True, False, True, False]
    assert keep(filter_logits(logits, top_p=0.5)) == [True, False, False, False]
    assert keep(filter_logits(logits, top_p=0.79)) == [True, False, True, False]
    assert keep(filter_logits(logits, top_p=0.81)) == [True, False, True, True]
    g = [torch.Generator().manual_seed(0)]
    draws = {int(sample_next(logits, 1.0, top_p=0.79, generators=g)) for _ in range(200)}
    assert draws == {0, 2}


@pytest.mark.parametrize("kw, field", [
    (dict(max_new_tokens=-1), "max_new_tokens"),
    (dict(temperature=-0.5), "temperature"),
    (dict(top_k=0), "top_k"),
    (dict(top_p=1.5), "top_p"),
    (dict(temperature=float("nan")), r"temperature .*got nan"),
    (dict(temperature=float("inf")), r"temperature .*got inf"),
    (dict(top_p=float("nan")), r"top_p .*got nan"),
])
def test_bad_generation_arguments(kw, field):
    model = lm()
    args = dict(max_new_tokens=3)
    args.update(kw)
    with pytest.raises(ValueError, match=field):
        model.stream([1, 2], **args)


def test_bad_prompts_and_length_limit():
    model = lm(positions="learned", max_len=16)
    with pytest.raises(ValueError, match="prompt"):
        model.generate([[1, 2], []], 3)
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate([1] * 10, 8)
    assert len(model.generate([1] * 10, 7, temperature=0)[0]) == 7  # positions 0..15 exactly fit


@pytest.mark.parametrize("bad, where", [(300, [1, 2]), (-1, [0, 0])])
def test_out_of_vocabulary_ids_name_the_value_and_vocab_size(bad, where):
    model = lm()  # tiny_config's vocabulary
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    ids[tuple(where)] = bad
    vocab = model.config.vocab_size
    message = f"ids must be token ids in [0, vocab_size={vocab}), got {bad} at ids{where}"
    with pytest.raises(ValueError, match=re.escape(message)):
        model(ids)
    with pytest.raises(ValueError, match=re.escape(message)):
        model.generate(ids.tolist(), 2)
