"""linattn.nn.swa.SlidingWindowAttention and linattn.nn.lolcats.LoLCATsAttention: the parallel forward
equals token-by-token decoding (float64, RoPE, past the window, padded prompts), the cache stays the
same size whatever the context, the limits (window ≥ N is softmax attention) hold, gradients reach
the new parameters, and a model with `swa` layers decodes like its parallel forward."""

import pytest
import torch

from linattn import models
from linattn.nn.attention import SoftmaxAttention
from linattn.nn.lolcats import LoLCATsAttention, LoLCATsCache
from linattn.nn.swa import SlidingWindowAttention, SlidingWindowCache

from .conftest import spread, tiny_config


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def x_of(b, n, d=16, seed=0):
    return torch.randn(b, n, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


SPLITS = [(0, 1), (1, 2), (2, 7), (7, 8), (8, 9), (9, 15)] + [(i, i + 1) for i in range(15, 30)]


def decode(layer, x, splits, mask=None):
    cache, outs = layer.new_cache(), []
    for lo, hi in splits:
        y, cache = layer(x[:, lo:hi], None if mask is None else mask[:, lo:hi], cache)
        outs.append(y)
    return torch.cat(outs, 1), cache


def make(cls, **kw):
    return spread(cls(16, 2, **kw)).double().eval()


LAYERS = [
    (SlidingWindowAttention, dict(window=4, rope=True, chunk_size=4)),
    (SlidingWindowAttention, dict(window=1, chunk_size=2)),
    (SlidingWindowAttention, dict(window=6, rope=True, short_conv=3, output_gate=True, qk_dim=4, chunk_size=4)),
    (LoLCATsAttention, dict(window=4, rope=True, chunk_size=4)),
    (LoLCATsAttention, dict(window=3, feature_map="elu", qk_dim=4, short_conv=2, chunk_size=8)),
]


@pytest.mark.parametrize("cls,kw", LAYERS)
def test_parallel_equals_token_by_token_decoding_past_the_window_fp64(cls, kw):
    layer = make(cls, **kw)
    x = x_of(2, 30)
    with torch.no_grad():
        full, none = layer(x)
        rec, cache = decode(layer, x, SPLITS)
    assert none is None
    torch.testing.assert_close(rec, full, rtol=1e-10, atol=1e-10)
    assert isinstance(cache, (SlidingWindowCache, LoLCATsCache)) and cache.length == 30


@pytest.mark.parametrize("cls,kw", [LAYERS[0], LAYERS[3]])
def test_left_padded_prompts_decode_like_the_parallel_forward(cls, kw):
    layer = make(cls, **kw)
    x = x_of(2, 30, seed=3)
    mask = torch.ones(2, 30, dtype=torch.bool)
    mask[0, :5] = False
    with torch.no_grad():
        full, _ = layer(x, mask)
        rec, _ = decode(layer, x, SPLITS, mask)
        alone, _ = layer(x[:1, 5:])
    torch.testing.assert_close(rec, full, rtol=1e-10, atol=1e-10)
    # the padded row's real tokens see what they would see alone (positions count real tokens)
    torch.testing.assert_close(full[:1, 5:], alone, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("cls", [SlidingWindowAttention, LoLCATsAttention])
def test_cache_memory_is_flat_in_context(cls):
    layer = make(cls, window=5)
    x = x_of(1, 40)
    cache, sizes = layer.new_cache(), []
    with torch.no_grad():
        for t in range(40):
            _, cache = layer(x[:, t:t + 1], cache=cache)
            sizes.append(cache.nbytes)
    assert len(set(sizes)) == 1 and sizes[0] > 0
    # the softmax layer's KV cache, for contrast, grows with every token
    soft, kv = make(SoftmaxAttention), None
    with torch.no_grad():
        _, kv = soft(x[:, :10], cache=soft.new_cache())
        small = kv.nbytes
        _, kv = soft(x[:, 10:40], cache=kv)
    assert kv.nbytes > 3 * small


@pytest.mark.parametrize("cls", [SlidingWindowAttention, LoLCATsAttention])
def test_window_covering_the_sequence_is_softmax_attention(cls):
    layer = make(cls, window=12, rope=True, chunk_size=4)
    soft = SoftmaxAttention(16, 2, rope=True).double().eval()
    soft.load_state_dict(layer.state_dict(), strict=False)
    x = x_of(2, 12, seed=4)
    with torch.no_grad():
        torch.testing.assert_close(layer(x)[0], soft(x)[0], rtol=1e-10, atol=1e-10)
        shorter = cls(16, 2, window=11, rope=True, chunk_size=4).double()
        shorter.load_state_dict(layer.state_dict())
        assert not torch.allclose(shorter(x)[0], soft(x)[0])


def test_lolcats_trains_its_feature_maps_and_window_factors():
    layer = make(LoLCATsAttention, window=3, chunk_size=4)
    assert torch.allclose(torch.sigmoid(LoLCATsAttention(16, 2).window_factor_logit), torch.tensor(0.1))
    y, _ = layer(x_of(2, 20, seed=5))
    y.square().sum().backward()
    for name in ("feature_map_q.weight", "feature_map_k.weight", "window_factor_logit", "qkv.weight"):
        grad = dict(layer.named_parameters())[name].grad
        assert grad is not None and grad.abs().sum() > 0, name


def test_layer_arguments_are_checked():
    with pytest.raises(ValueError, match="window"):
        SlidingWindowAttention(16, 2, window=0)
    with pytest.raises(ValueError, match="causal"):
        SlidingWindowAttention(16, 2, causal=False)
    with pytest.raises(ValueError, match="causal"):
        LoLCATsAttention(16, 2, causal=False)
    with pytest.raises(ValueError, match="feature_map"):
        LoLCATsAttention(16, 2, feature_map=3)


@pytest.mark.parametrize("kind,cache_cls", [("swa", SlidingWindowCache), ("lolcats", LoLCATsCache)])
def test_a_model_with_these_layers_decodes_like_its_parallel_forward(kind, cache_cls):
    """Rows of the kinds table, the window from kind_options (8, so 70 tokens run far past it):
    decoding = the parallel forward, and greedy generation (the eager path) repeats the parallel
    argmax."""
    cfg = tiny_config(attention=[kind, "linear"], max_len=80, kind_options={kind: {"window": 8}})
    model = spread(models.LinearTransformerLM(cfg)).double().eval()
    assert model.blocks[0].attn.window == 8
    ids = torch.randint(0, 40, (2, 70), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full, _ = model(ids)
        cache, outs = model.new_cache(), []
        for lo, hi in [(0, 50)] + [(i, i + 1) for i in range(50, 70)]:
            logits, cache = model(ids[:, lo:hi], cache=cache)
            outs.append(logits)
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-9, atol=1e-9)
    assert isinstance(cache.layers[0], cache_cls) and cache.layers[0].nbytes > 0
    model = model.float()
    seq = ids[0, :60].tolist()
    with torch.no_grad():
        for _ in range(8):
            seq.append(int(model(torch.tensor([seq]))[0][0, -1].argmax()))
    assert model.generate(ids[0, :60].tolist(), 8, temperature=0) == [seq[60:]]
