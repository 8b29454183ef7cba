"""The Liger layer (linattn.nn.liger) against its definition written token by token in float64, packed
sequences against separate ones, padding, decoding; and the T2R feature map against its formula."""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from linattn.nn.feature_maps import T2R, make_feature_map
from linattn.nn.liger import LigerAttention

from .conftest import explicit_rotation, spread


def layer(d=12, h=2, window=4, seed=0, rope=True, chunk=3):
    torch.manual_seed(seed)
    m = LigerAttention(d, h, window=window, rope=rope, chunk_size=chunk).double()
    spread(m, seed=seed)
    return m


def definition(m: LigerAttention, x: torch.Tensor) -> torch.Tensor:
    """y of one sequence x (N, d), token by token: the window's softmax over the last W rotated keys,
    the gated recurrence on softmax features with g = logsigmoid(k)/16, their mean, then W_o."""
    n, d = x.shape
    hd = m.head_dim
    qkv = x @ m.qkv.weight.T + (m.qkv.bias if m.qkv.bias is not None else 0)
    q, k, v = qkv.split(hd * m.n_heads, dim=-1)
    q, k, v = (t.view(n, m.n_heads, hd).transpose(0, 1) for t in (q, k, v))  # (H, N, D)
    pos = torch.arange(n)
    rq = explicit_rotation(q, pos) if m.rope is not None else q
    rk = explicit_rotation(k, pos) if m.rope is not None else k
    out = torch.zeros(m.n_heads, n, hd, dtype=x.dtype)
    for h in range(m.n_heads):
        S = torch.zeros(hd, hd, dtype=x.dtype)
        for t in range(n):
            lo = max(0, t - m.window + 1)
            s = rk[h, lo:t + 1] @ rq[h, t] / math.sqrt(hd)
            win = torch.softmax(s, 0) @ v[h, lo:t + 1]
            g = F.logsigmoid(k[h, t]) / 16
            S = torch.exp(g)[:, None] * S + torch.outer(torch.softmax(k[h, t], 0), v[h, t])
            lin = S.T @ torch.softmax(q[h, t], 0)
            out[h, t] = (win + lin) / 2
    o = out.transpose(0, 1).reshape(n, m.n_heads * hd)
    return o @ m.out.weight.T + (m.out.bias if m.out.bias is not None else 0)


@settings(max_examples=12, deadline=None)
@given(n=st.integers(1, 11), window=st.integers(1, 6), chunk=st.integers(1, 5), rope=st.booleans())
def test_forward_equals_the_definition(n, window, chunk, rope):
    m = layer(window=window, chunk=chunk, rope=rope)
    x = torch.randn(2, n, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(n))
    y, _ = m(x)
    for b in range(2):
        torch.testing.assert_close(y[b], definition(m, x[b]), atol=1e-10, rtol=1e-10)


def test_gradients_equal_the_definitions():
    m = layer()
    x = torch.randn(1, 9, 12, dtype=torch.float64, requires_grad=True)
    gx = torch.autograd.grad(m(x)[0].square().sum(), x)[0]
    x2 = x.detach().clone().requires_grad_()
    ref = torch.autograd.grad(definition(m, x2[0]).square().sum(), x2)[0]
    torch.testing.assert_close(gx, ref, atol=1e-10, rtol=1e-10)


def test_decoding_token_by_token_and_in_blocks_equals_the_forward():
    m = layer(window=3)
    x = torch.randn(2, 10, 12, dtype=torch.float64)
    full, _ = m(x)
    cache = m.new_cache()
    outs = []
    for a, b in ((0, 4), (4, 5), (5, 6), (6, 10)):
        y, cache = m(x[:, a:b], cache=cache)
        outs.append(y)
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=1e-10, rtol=1e-10)
    assert cache.nbytes > 0 and cache.state.shape == (2, 2, 6, 6)


def test_packed_sequences_equal_separate_calls_and_length_one():
    m = layer()
    lengths = [1, 5, 7]
    x = torch.randn(1, sum(lengths), 12, dtype=torch.float64)
    cu = torch.tensor([0, 1, 6, 13])
    packed, _ = m(x, cu_seqlens=cu)
    alone = torch.cat([m(x[:, a:b])[0] for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())], 1)
    torch.testing.assert_close(packed, alone, atol=1e-10, rtol=1e-10)


def test_left_padding_gives_the_unpadded_outputs():
    m = layer()
    x = torch.randn(1, 6, 12, dtype=torch.float64)
    padded = torch.cat([torch.randn(1, 3, 12, dtype=torch.float64), x], 1)
    mask = torch.tensor([[False] * 3 + [True] * 6])
    y, _ = m(padded, mask=mask)
    torch.testing.assert_close(y[:, 3:], m(x)[0], atol=1e-10, rtol=1e-10)
    cache = m.new_cache()
    y1, cache = m(padded[:, :5], mask=mask[:, :5], cache=cache)
    y2, cache = m(padded[:, 5:], mask=mask[:, 5:], cache=cache)
    torch.testing.assert_close(torch.cat([y1, y2], 1)[:, 3:], m(x)[0], atol=1e-10, rtol=1e-10)


def test_t2r_is_a_learned_relu_projection():
    phi = make_feature_map("t2r", 8, num_features=5, seed=3)
    assert isinstance(phi, T2R) and phi.feature_dim == 5
    with torch.no_grad():
        phi.bias.copy_(torch.randn(5))
    x = torch.randn(2, 3, 4, 8, dtype=torch.float64)
    ref = torch.clamp_min(torch.einsum("...d,md->...m", x, phi.weight.double()) + phi.bias.double(), 0)
    torch.testing.assert_close(phi(x), ref)
    assert {n for n, p in phi.named_parameters() if p.requires_grad} == {"weight", "bias"}
    with pytest.raises(ValueError, match="num_features"):
        make_feature_map("t2r", 8, num_features=0)
