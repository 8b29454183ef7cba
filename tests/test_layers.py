"""linattn.nn.attention: attention layers (parallel == recurrent, masks, RoPE), norms, FFN, block."""

import math

import pytest
import torch
import torch.nn.functional as F

from linattn.nn.families import linear as linear_family, softmax as softmax_family
from linattn.nn.feature_maps import FEATURE_MAPS
from linattn.nn.attention import LinearAttention, SoftmaxAttention
from linattn.nn.blocks import Block, FeedForward
from linattn.nn.caches import KVCache, token_positions
from linattn.nn.norms import RMSNorm, make_norm

from .conftest import spread


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def _spread(module, seed=0, scale=0.4):
    return spread(module, seed, scale)


def _qk_dim(fm):
    return 4 if fm == "taylor" else 8


def _linear_layer(fm, rope, causal=True, seed=0):
    layer = LinearAttention(16, 2, feature_map=fm, rope=rope, causal=causal, qk_dim=_qk_dim(fm),
                            feature_map_options={"max_len": 64} if fm == "cosformer" else None)
    return _spread(layer, seed).double().eval()


@pytest.mark.parametrize("rope", [False, True])
@pytest.mark.parametrize("fm", sorted(FEATURE_MAPS))
def test_linear_attention_recurrent_equals_parallel(fm, rope):
    """Prefill a few tokens, then token by token and a block of 3: same outputs as one parallel pass."""
    torch.manual_seed(0)
    layer = _linear_layer(fm, rope)
    x = torch.randn(2, 11, 16, dtype=torch.float64)
    full, none = layer(x)
    assert none is None
    cache = layer.new_cache()
    parts = []
    y, cache = layer(x[:, :4], cache=cache)
    parts.append(y)
    for t in range(4, 8):
        y, cache = layer(x[:, t:t + 1], cache=cache)
        parts.append(y)
    y, cache = layer(x[:, 8:], cache=cache)  # a block of 3 tokens continuing from the state
    parts.append(y)
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-10, atol=1e-12)
    assert cache.length == 11


def _naive_linear(layer, x, positions):
    """The definition with explicit sums (one φ, RoPE on the numerator features only)."""
    b, n, _ = x.shape
    q, k, v = layer._project(x)
    fq = layer.feature_map(q, is_query=True, positions=positions)
    fk = layer.feature_map(k, is_query=False, positions=positions)
    rq = fq if layer.rope is None else layer.rope.rotate(fq, positions)
    rk = fk if layer.rope is None else layer.rope.rotate(fk, positions)
    num = rq @ rk.transpose(-1, -2)
    den = fq @ fk.transpose(-1, -2)
    if layer.causal:
        keep = torch.ones(n, n, dtype=torch.bool).tril()
        num, den = num * keep, den * keep
    o = (num @ v) / (den.sum(-1, keepdim=True) + layer.eps)
    return layer.out(o.transpose(1, 2).reshape(b, n, -1))


@pytest.mark.parametrize("fm", ["elu", "favor", "cosformer"])
@pytest.mark.parametrize("causal", [True, False])
def test_linear_attention_matches_definition(fm, causal):
    torch.manual_seed(1)
    layer = _linear_layer(fm, rope=True, causal=causal)
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    y, _ = layer(x)
    torch.testing.assert_close(y, _naive_linear(layer, x, torch.arange(9)), rtol=1e-10, atol=1e-12)


def test_rope_makes_linear_attention_relative():
    """With RoPE on φ features, shifting every position by a constant changes nothing (R_iᵀR_j = R_{j−i})."""
    torch.manual_seed(2)
    layer = _linear_layer("elu", rope=True)
    x = torch.randn(1, 7, 16, dtype=torch.float64)
    a, _ = layer(x, positions=torch.arange(7))
    b, _ = layer(x, positions=torch.arange(7) + 13)
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    plain = _linear_layer("elu", rope=False)
    c, _ = plain(x)
    assert (a - c).abs().max() > 1e-3  # RoPE does change the output


@pytest.mark.parametrize("kind", ["linear", "softmax"])
def test_left_padding_equals_unpadded(kind):
    """A left-padded row gives, at its real tokens, the output of the unpadded sequence."""
    torch.manual_seed(3)
    layer = (_linear_layer("cosformer", rope=True) if kind == "linear"
             else _spread(SoftmaxAttention(16, 2, rope=True)).double().eval())
    x = torch.randn(1, 6, 16, dtype=torch.float64)
    alone, _ = layer(x)
    padded = torch.cat((torch.randn(1, 3, 16, dtype=torch.float64) * 5, x), 1)
    mask = torch.tensor([[False] * 3 + [True] * 6])
    y, _ = layer(padded, mask=mask)
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y[:, 3:], alone, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("rope", [False, True])
@pytest.mark.parametrize("fm", ["elu", "taylor", "favor"])
def test_linear_decoding_with_padding_mask_equals_parallel(fm, rope):
    """Token-by-token decoding with a (B, 1) padding mask per step (the one-token paths: q and k
    featurized together for symmetric φ, the op-level step otherwise) equals one masked parallel pass."""
    torch.manual_seed(6)
    layer = _linear_layer(fm, rope)
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    mask = torch.tensor([[False, False, True, True, False, True, True], [True] * 7])
    full, _ = layer(x, mask=mask)
    cache = layer.new_cache()
    steps = [layer(x[:, t:t + 1], mask=mask[:, t:t + 1], cache=cache)[0] for t in range(7)]
    real = mask[:, :, None].expand_as(full)
    torch.testing.assert_close(torch.cat(steps, 1)[real], full[real], rtol=1e-10, atol=1e-12)


def test_linear_padding_mask_removes_key_from_denominator():
    """Right padding in a non-causal layer: the pad keys leave numerator and denominator."""
    torch.manual_seed(4)
    layer = _linear_layer("elu", rope=False, causal=False)
    x = torch.randn(1, 5, 16, dtype=torch.float64)
    alone, _ = layer(x)
    padded = torch.cat((x, torch.randn(1, 2, 16, dtype=torch.float64)), 1)
    y, _ = layer(padded, mask=torch.tensor([[True] * 5 + [False] * 2]))
    torch.testing.assert_close(y[:, :5], alone, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("causal", [True, False])
def test_softmax_attention_matches_definition(causal):
    torch.manual_seed(5)
    layer = _spread(SoftmaxAttention(16, 2, rope=True, causal=causal, qk_dim=6)).double().eval()
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    y, _ = layer(x)
    q, k, v = layer._project(x)
    pos = torch.arange(7)
    q, k = layer.rope.rotate(q, pos), layer.rope.rotate(k, pos)
    s = q @ k.transpose(-1, -2) / math.sqrt(6)
    if causal:
        s = s.masked_fill(~torch.ones(7, 7, dtype=torch.bool).tril(), float("-inf"))
    o = torch.softmax(s, -1) @ v
    ref = layer.out(o.transpose(1, 2).reshape(2, 7, 16))
    torch.testing.assert_close(y, ref, rtol=1e-10, atol=1e-12)


def test_softmax_kv_cache_equals_parallel_and_grows():
    torch.manual_seed(6)
    layer = _spread(SoftmaxAttention(16, 2, rope=True)).double().eval()
    x = torch.randn(2, 40, 16, dtype=torch.float64)
    full, _ = layer(x)
    cache = layer.new_cache()
    parts = [layer(x[:, :3], cache=cache)[0]]
    sizes = []
    for t in range(3, 40):
        parts.append(layer(x[:, t:t + 1], cache=cache)[0])
        sizes.append(cache.nbytes)
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-10, atol=1e-12)
    assert sizes[-1] > sizes[0] and cache.length == 40


def test_linear_state_size_independent_of_length():
    layer = _linear_layer("favor", rope=True)
    cache = layer.new_cache()
    layer(torch.randn(1, 5, 16, dtype=torch.float64), cache=cache)
    shapes, size = [t.shape for t in cache.state], cache.nbytes
    for _ in range(50):
        layer(torch.randn(1, 1, 16, dtype=torch.float64), cache=cache)
    assert [t.shape for t in cache.state] == shapes and cache.nbytes == size
    assert shapes[0] == (1, 2, layer.feature_map.feature_dim, 8)


def test_kv_cache_buffer_growth_keeps_contents():
    cache = KVCache()
    ks, vs = [], []
    for n in (5, 1, 30, 1, 100):
        k, v = torch.randn(1, 2, n, 3), torch.randn(1, 2, n, 4)
        ks.append(k)
        vs.append(v)
        kall, vall, m = cache.append(k, v, None)
        cache.advance(n, None)
        torch.testing.assert_close(kall, torch.cat(ks, 2), rtol=0, atol=0)
        torch.testing.assert_close(vall, torch.cat(vs, 2), rtol=0, atol=0)
        assert m is None
    assert cache.k.shape[2] >= cache.length == 137


def test_token_positions():
    assert token_positions(3, offset=4).tolist() == [4, 5, 6]
    mask = torch.tensor([[False, False, True, True], [True, True, True, True]])
    assert token_positions(4, mask).tolist() == [[0, 0, 0, 1], [0, 1, 2, 3]]
    assert token_positions(2, None, seen=torch.tensor([2, 4])).tolist() == [[2, 3], [4, 5]]


def test_rmsnorm_and_layernorm():
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    norm = RMSNorm(8).double()
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 2, 8, dtype=torch.float64))
    ref = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5) * torch.linspace(0.5, 2, 8, dtype=torch.float64)
    torch.testing.assert_close(norm(x), ref, rtol=1e-12, atol=1e-12)
    assert isinstance(make_norm("layernorm", 8), torch.nn.LayerNorm)
    with pytest.raises(ValueError, match="norm"):
        make_norm("batchnorm", 8)


@pytest.mark.parametrize("act", ["gelu", "swiglu"])
def test_feedforward(act):
    ffn = FeedForward(8, 12, act).double()
    x = torch.randn(2, 3, 8, dtype=torch.float64)
    h = x @ ffn.up.weight.T
    if act == "swiglu":
        gate, up = h[..., :12], h[..., 12:]
        h = F.silu(gate) * up
    else:
        h = F.gelu(h)
    torch.testing.assert_close(ffn(x), h @ ffn.down.weight.T, rtol=1e-12, atol=1e-12)


def test_block_is_prenorm_residual():
    torch.manual_seed(7)
    attn = LinearAttention(16, 2, feature_map="elu")
    block = _spread(Block(attn, 32, activation="gelu", norm="layernorm")).double()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    y, _ = block(x)
    h = x + block.attn(block.norm1(x))[0]
    ref = h + block.ffn(block.norm2(h))
    torch.testing.assert_close(y, ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kwargs, field", [
    (dict(d_model=10, n_heads=3), "d_model"),
    (dict(d_model=16, n_heads=0), "n_heads"),
    (dict(d_model=16, n_heads=2, dropout=1.5), "dropout"),
    (dict(d_model=16, n_heads=2, qk_dim=-1), "qk_dim"),
    (dict(d_model=16, n_heads=2, feature_map="nope"), "feature map"),
])
def test_bad_layer_arguments(kwargs, field):
    with pytest.raises(ValueError, match=field):
        LinearAttention(**kwargs)


def test_bad_forward_arguments():
    layer = LinearAttention(16, 2)
    with pytest.raises(ValueError, match="d_model"):
        layer(torch.randn(1, 3, 8))
    with pytest.raises(ValueError, match="mask"):
        layer(torch.randn(1, 3, 16), mask=torch.ones(1, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="causal"):
        LinearAttention(16, 2, causal=False)(torch.randn(1, 3, 16), cache=KVCache())
    with pytest.raises(ValueError, match="activation"):
        FeedForward(8, 8, "relu6")


def test_sequence_parallel_hook(monkeypatch):
    """With a group set and no cache, the layers call linattn.parallel's functions."""
    calls = {}

    def sp_linear(q, k, v, **kw):
        calls["linear"] = kw
        return torch.zeros_like(v)

    def sp_softmax(q, k, v, **kw):
        calls["softmax"] = kw
        return torch.zeros_like(v)

    monkeypatch.setattr(linear_family, "sequence_parallel_linear_attention", sp_linear)
    monkeypatch.setattr(softmax_family, "sequence_parallel_softmax_attention", sp_softmax)
    lin, soft = LinearAttention(16, 2, rope=True), SoftmaxAttention(16, 2)
    for layer in (lin, soft):
        layer.sequence_parallel_group = "GROUP"
        y, _ = layer(torch.randn(1, 4, 16))
        assert torch.equal(y, layer.out(torch.zeros(1, 4, 16)))
    assert set(calls["linear"]) >= {"group", "causal", "feature_map", "normalize", "eps", "scale", "rope", "chunk_size"}
    assert calls["linear"]["group"] == "GROUP" and calls["linear"]["rope"] is lin.rope
    assert calls["softmax"] == {"group": "GROUP", "causal": True, "scale": None}
    # decoding with a cache stays local
    y, cache = lin(torch.randn(1, 2, 16), cache=lin.new_cache())
    assert cache.length == 2 and y.abs().sum() > 0


def test_projection_weights_stored_column_major_survive_to_and_load():
    """Projection weights are (out, in) tensors laid out as the transpose of a contiguous (in, out)
    one (fast one-token products); .to(), load_state_dict and optimizers keep that layout."""
    layer = LinearAttention(16, 2)
    ffn = FeedForward(16, 24)
    for w in (layer.qkv.weight, layer.out.weight, ffn.up.weight, ffn.down.weight):
        assert w.stride() == (1, w.shape[0])
    moved = LinearAttention(16, 2).double()
    moved.load_state_dict({k: v.double() for k, v in layer.state_dict().items()})
    assert moved.qkv.weight.stride() == (1, moved.qkv.weight.shape[0])
    torch.testing.assert_close(moved.qkv.weight, layer.qkv.weight.double())


@pytest.mark.parametrize("qk_dim", [None, 3])  # equal to the head dim (one view of [q | k | v]) or not (split)
def test_projection_gives_heads_of_q_k_v_in_the_fused_weight_order(qk_dim):
    torch.manual_seed(0)
    layer = LinearAttention(16, 2, qk_dim=qk_dim)
    x = torch.randn(2, 5, 16)
    q, k, v = layer._project(x)
    y = layer.qkv(x)
    dq = layer.qk_dim
    want = [y[..., :2 * dq].view(2, 5, 2, dq), y[..., 2 * dq:4 * dq].view(2, 5, 2, dq), y[..., 4 * dq:].view(2, 5, 2, 8)]
    for got, w in zip((q, k, v), want):
        torch.testing.assert_close(got, w.transpose(1, 2), rtol=0, atol=0)
