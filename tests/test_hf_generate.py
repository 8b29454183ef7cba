"""linattn.hf: generate() through LinattnCache — greedy, sampling, beam search, left padding."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

import linattn.hf as H  # noqa: E402
from linattn.models import KINDS, LinearTransformerLM, ModelConfig  # noqa: E402

CASES = {kind: dict(attention=[kind]) for kind in KINDS}  # every kind of the kinds table
CASES["hybrid"] = dict(attention="gated_deltanet,softmax", n_layers=2)
CASES["conv_mixer"] = dict(attention="gla,softmax", block="conv_mixer", n_layers=2)
#: the window kinds with a window shorter than the prompts, so that their ring buffers wrap
CASES["short_windows"] = dict(attention="swa,lolcats", n_layers=2, kind_options={"swa": {"window": 3},
                                                                                  "lolcats": {"window": 3}})


def model(name: str, **over) -> tuple[LinearTransformerLM, H.LinattnForCausalLM]:
    kw = {**dict(vocab_size=64, d_model=16, n_layers=1, n_heads=2, seed=5, chunk_size=4), **CASES[name]}
    kw.update(over)
    lm = LinearTransformerLM(ModelConfig(**kw)).eval()
    return lm, H.LinattnForCausalLM.from_linattn(lm)


def prompt(n=7, seed=0, vocab=64):
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("fused", [None, False])
@pytest.mark.parametrize("name", sorted(CASES))
def test_greedy_equals_linattn_generate(name, fused):
    lm, hf = model(name)
    hf.fused_decoding = fused
    p = prompt()
    want = lm.generate(p[0].tolist(), 12, temperature=0, fused=fused)[0]
    out = hf.generate(p, max_new_tokens=12, do_sample=False)
    assert out[0, :7].tolist() == p[0].tolist()
    assert out[0, 7:].tolist() == want


def test_fused_step_is_used_and_matches_eager_logits():
    lm, hf = model("hybrid")
    p = prompt()
    with torch.no_grad():
        first = hf(p, use_cache=True)
        cache = first.cache
        tok = first.logits[:, -1].argmax(-1, keepdim=True)
        eager_cache = hf.new_cache()
        hf(p, cache=eager_cache)
        a = hf(tok, cache=cache).logits           # steady cache: the fused step
        assert cache.decoder is not None
        hf.fused_decoding = False
        b = hf(tok, cache=eager_cache).logits
    assert torch.allclose(a, b, atol=1e-5, rtol=1e-5)


def test_left_padded_batch_continues_like_each_prompt_alone():
    lm, hf = model("hybrid")
    a, b = prompt(4, seed=1), prompt(9, seed=2)
    batch = torch.cat([torch.cat([torch.zeros(1, 5, dtype=torch.long), a], 1), b])
    mask = torch.ones_like(batch)
    mask[0, :5] = 0
    out = hf.generate(batch, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    alone_a = hf.generate(a, max_new_tokens=10, do_sample=False)[0, 4:]
    alone_b = hf.generate(b, max_new_tokens=10, do_sample=False)[0, 9:]
    assert out[0, 9:].tolist() == alone_a.tolist()
    assert out[1, 9:].tolist() == alone_b.tolist()
    # and linattn's own batched generation agrees
    want = lm.generate([a[0].tolist(), b[0].tolist()], 10, temperature=0)
    assert [out[0, 9:].tolist(), out[1, 9:].tolist()] == want


@pytest.mark.parametrize("name", ["hybrid", "linear", "conv_mixer", "swa", "lolcats", "short_windows"])
def test_beam_search_best_score_is_its_log_probability(name):
    """swa and lolcats since issue 37 item 9 (reorder_cache turned their WindowState / HybridState into
    plain tuples: TypeError)."""
    lm, hf = model(name)
    p = prompt(6, seed=3)
    out = hf.generate(p, max_new_tokens=6, num_beams=3, num_return_sequences=3, do_sample=False,
                      length_penalty=0.0, early_stopping=True, return_dict_in_generate=True, output_scores=True)
    assert out.sequences.shape == (3, 12)
    with torch.no_grad():
        logp = torch.log_softmax(lm(out.sequences)[0].double(), -1)
    gen = out.sequences[:, 6:]
    scores = logp[:, 5:-1].gather(-1, gen[..., None]).squeeze(-1).sum(-1)
    # sequences_scores (length_penalty 0) is the sum of the generated tokens' log-probabilities
    assert torch.allclose(out.sequences_scores.double(), scores, atol=1e-4, rtol=1e-4)
    assert bool((out.sequences_scores[:-1] >= out.sequences_scores[1:]).all())  # best first


@pytest.mark.parametrize("name", ["hybrid", "short_windows"])
def test_beam_reorder_matches_separate_rows(name):
    """reorder_cache(idx) gives each row the cache of row idx[i]: the next step equals those rows'."""
    lm, hf = model(name)
    x = torch.cat([prompt(5, seed=s) for s in range(3)])
    idx = torch.tensor([2, 0, 0])
    with torch.no_grad():
        cache = hf(x, use_cache=True).cache
        cache.reorder_cache(idx)
        nxt = torch.tensor([[1], [2], [3]])
        got = hf(nxt, cache=cache).logits[:, -1]
        want = torch.stack([hf(torch.cat([x[j:j + 1], nxt[i:i + 1]], 1)).logits[0, -1] for i, j in enumerate(idx)])
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    assert cache.batch_size == 3 and cache.get_seq_length() == 6


def test_sampling_is_seeded_and_top_k_1_is_greedy():
    lm, hf = model("gated_deltanet")
    p = prompt()
    transformers.set_seed(0)
    a = hf.generate(p, max_new_tokens=10, do_sample=True, top_k=0, temperature=1.5)
    transformers.set_seed(0)
    b = hf.generate(p, max_new_tokens=10, do_sample=True, top_k=0, temperature=1.5)
    assert torch.equal(a, b) and int(a.max()) < 64
    top1 = hf.generate(p, max_new_tokens=10, do_sample=True, top_k=1)
    assert torch.equal(top1, hf.generate(p, max_new_tokens=10, do_sample=False))


def test_cache_refuses_crop():
    lm, hf = model("deltanet")
    cache = hf(prompt(), use_cache=True).cache
    cache.crop(0)
    with pytest.raises(ValueError, match="crop"):
        cache.crop(1)
