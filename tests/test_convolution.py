"""linattn.nn.convolution.ShortConvolution and layers.GatedConvolution: the definition, parallel ==
recurrent (exactly), padding, gradients, argument checks."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from linattn.nn.convolution import ShortConvolution
from linattn.nn.blocks import GatedConvolution


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def _definition(x, w, bias=None):
    """y_t[c] = Σ_j w[c, j] x_{t−K+1+j}[c], zeros before the sequence, one term at a time in float64."""
    b, n, c = x.shape
    k = w.shape[1]
    y = torch.zeros(b, n, c, dtype=torch.float64)
    for t in range(n):
        for j in range(k):
            s = t - k + 1 + j
            if s >= 0:
                y[:, t] += w[:, j].double() * x[:, s].double()
    return y if bias is None else y + bias.double()


def _conv(channels, k, bias=False, seed=0):
    conv = ShortConvolution(channels, k, bias=bias).double()
    with torch.no_grad():
        conv.weight.copy_(torch.randn(conv.weight.shape, generator=torch.Generator().manual_seed(seed),
                                      dtype=torch.float64))
        if bias:
            conv.bias.uniform_(-1, 1)
    return conv


@settings(max_examples=12, deadline=None)
@given(k=st.integers(1, 5), n=st.integers(1, 9), c=st.integers(1, 6), b=st.integers(1, 2), bias=st.booleans())
def test_matches_definition_and_conv1d(k, n, c, b, bias):
    conv = _conv(c, k, bias)
    x = torch.randn(b, n, c, dtype=torch.float64)
    y = conv(x)
    torch.testing.assert_close(y, _definition(x, conv.weight, conv.bias), rtol=1e-12, atol=1e-12)
    ref = F.conv1d(F.pad(x.transpose(1, 2), (k - 1, 0)), conv.weight[:, None, :], conv.bias, groups=c)
    torch.testing.assert_close(y, ref.transpose(1, 2), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_prefill_then_steps_equals_parallel_exactly(k, dtype):
    conv = _conv(5, k, bias=True).to(dtype)
    x = torch.randn(2, 11, 5, dtype=dtype)
    full = conv(x)
    parts, tail = [], None
    for lo, hi in ((0, 1), (1, 4), (4, 5), (5, 6), (6, 9), (9, 10), (10, 11)):  # N = 1 first, blocks, steps
        y, tail = conv(x[:, lo:hi], tail=tail, return_tail=True)
        assert tail.shape == (2, k - 1, 5)
        parts.append(y)
    assert torch.equal(torch.cat(parts, 1), full)
    torch.testing.assert_close(tail, x[:, 11 - (k - 1):], rtol=0, atol=0)


def test_left_padding_equals_the_row_alone():
    conv = _conv(3, 4)
    x = torch.randn(1, 6, 3, dtype=torch.float64)
    padded = torch.cat((torch.randn(1, 3, 3, dtype=torch.float64) * 9, x), 1)
    mask = torch.tensor([[False] * 3 + [True] * 6])
    y = conv(padded, mask)
    torch.testing.assert_close(y[:, 3:], conv(x), rtol=0, atol=0)
    y2, tail = conv(padded[:, :5], mask[:, :5], return_tail=True)  # the tail holds the pads as zeros
    assert torch.equal(tail[:, :1], torch.zeros(1, 1, 3, dtype=torch.float64))
    y3 = conv(padded[:, 5:], mask[:, 5:], tail=tail)
    torch.testing.assert_close(torch.cat((y2, y3), 1)[:, 3:], conv(x), rtol=0, atol=0)


def test_gradients_match_autograd_of_the_definition():
    conv = _conv(4, 3, bias=True)
    x = torch.randn(2, 7, 4, dtype=torch.float64, requires_grad=True)
    tail = torch.randn(2, 2, 4, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(2, 7, 4, dtype=torch.float64)
    got = torch.autograd.grad((conv(x, tail=tail) * dy).sum(), (x, tail, conv.weight, conv.bias))
    full = torch.cat((tail, x), 1)
    want_y = _definition(full, conv.weight, conv.bias)[:, 2:]
    want = torch.autograd.grad((want_y * dy).sum(), (x, tail, conv.weight, conv.bias))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_init_is_seeded_and_bounded():
    a, b = ShortConvolution(8, 4), ShortConvolution(8, 4)
    a.init_parameters(torch.Generator().manual_seed(3))
    b.init_parameters(torch.Generator().manual_seed(3))
    assert torch.equal(a.weight, b.weight)
    assert a.weight.abs().max() <= 0.5 and a.weight.std() > 0.1  # U(−1/√K, 1/√K), K = 4


def test_gated_convolution_is_baseconv():
    """y = conv(u) ⊙ (W u + b) + u, and its tail continues it (up to the rounding of the projection,
    whose matmul blocks by the number of rows)."""
    torch.manual_seed(0)
    layer = GatedConvolution(6, 3).double()
    for p in layer.parameters():
        torch.nn.init.normal_(p)
    u = torch.randn(2, 8, 6, dtype=torch.float64)
    want = _definition(u, layer.conv.weight, layer.conv.bias) * (u @ layer.proj.weight.T + layer.proj.bias) + u
    torch.testing.assert_close(layer(u), want, rtol=1e-12, atol=1e-12)
    y1, tail = layer(u[:, :5], return_tail=True)
    y2, _ = layer(u[:, 5:], tail=tail, return_tail=True)
    torch.testing.assert_close(torch.cat((y1, y2), 1), layer(u), rtol=1e-13, atol=1e-13)


def test_bad_arguments():
    with pytest.raises(ValueError, match="kernel_size"):
        ShortConvolution(4, 0)
    with pytest.raises(ValueError, match="channels"):
        ShortConvolution(0, 3)
    conv = ShortConvolution(4, 3)
    with pytest.raises(ValueError, match=r"x must have shape \(B, N, C=4\)"):
        conv(torch.randn(2, 5, 3))
    with pytest.raises(ValueError, match="tail must have shape"):
        conv(torch.randn(2, 5, 4), tail=torch.zeros(2, 3, 4))


# ---- the fused CPU kernels (csrc/conv.cpp) against the torch ops they replace


@settings(max_examples=25, deadline=None)
@given(b=st.integers(1, 3), n=st.integers(1, 9), c=st.integers(1, 19), k=st.integers(1, 5), with_tail=st.booleans(),
       threads=st.sampled_from([1, 2]), seed=st.integers(0, 2**16))
def test_native_convolution_equals_the_torch_ops_forward_and_gradients(b, n, c, k, with_tail, threads, seed):
    import linattn.nn.convolution as conv
    from linattn.ops import native

    if not (native.enabled() and native.load()):
        pytest.skip("the fused CPU kernels are off or not built")
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, n, c, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(c, k, generator=g, dtype=torch.float64, requires_grad=True)
    tail = torch.randn(b, k - 1, c, generator=g, dtype=torch.float64, requires_grad=True) if with_tail else None
    assert conv._native_usable(x, tail, w)
    up = torch.randn(b, n, c, generator=g, dtype=torch.float64)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        y = conv._NativeShortConv.apply(x, tail, w)
    finally:
        torch.set_num_threads(before)
    # the definition on [tail; x] (zeros before it), its outputs at x's positions, and autograd through it
    ref = _definition(x if tail is None else torch.cat((tail, x), 1), w)[:, 0 if tail is None else k - 1:]
    torch.testing.assert_close(y, ref, rtol=1e-12, atol=1e-12)
    leaves = [x, w] + ([tail] if tail is not None else [])
    got = torch.autograd.grad(y, leaves, up)
    want = torch.autograd.grad(ref, leaves, up)
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)


def test_native_convolution_gradcheck_and_float32():
    import linattn.nn.convolution as conv
    from linattn.ops import native

    if not (native.enabled() and native.load()):
        pytest.skip("the fused CPU kernels are off or not built")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 5, 3, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 3, generator=g, dtype=torch.float64, requires_grad=True)
    tail = torch.randn(2, 2, 3, generator=g, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda x, t, w: conv._NativeShortConv.apply(x, t, w), (x, tail, w))
    m = ShortConvolution(24, 4)
    x32 = torch.randn(3, 11, 24, generator=g)
    assert conv._native_usable(x32, None, m.weight)
    ref = conv.depthwise_causal(F.pad(x32, (0, 0, 3, 0)), m.weight.detach(), 11)
    torch.testing.assert_close(m(x32), ref, rtol=1e-6, atol=1e-6)
    assert not conv._native_usable(x32.bfloat16(), None, m.weight.bfloat16())  # bf16 keeps the torch ops


@settings(max_examples=20, deadline=None)
@given(lengths=st.lists(st.integers(0, 6), min_size=1, max_size=5).filter(lambda ls: sum(ls) > 0),
       c=st.integers(1, 9), k=st.integers(1, 5), with_tail=st.booleans(), seed=st.integers(0, 2**16))
def test_native_packed_convolution_equals_the_torch_ops(lengths, c, k, with_tail, seed):
    """Packed sequences (lengths 0 and 1 included) through csrc/conv.cpp against the torch-op path and,
    per sequence, the definition on its [tail; x]."""
    import linattn.nn.convolution as conv
    from linattn.ops import native

    if not (native.enabled() and native.load()):
        pytest.skip("the fused CPU kernels are off or not built")
    g = torch.Generator().manual_seed(seed)
    m = ShortConvolution(c, k, bias=True).double()
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()))
    x = torch.randn(1, sum(lengths), c, generator=g, dtype=torch.float64, requires_grad=True)
    tail = torch.randn(len(lengths), k - 1, c, generator=g, dtype=torch.float64, requires_grad=True) if with_tail else None
    up = torch.randn(1, sum(lengths), c, generator=g, dtype=torch.float64)
    leaves = [x, m.weight] + ([tail] if with_tail else [])
    y, tail_out = m(x, tail=tail, return_tail=True, cu_seqlens=cu)
    got = torch.autograd.grad(y, leaves, up, allow_unused=True)
    got = [torch.zeros_like(leaf) if a is None else a for a, leaf in zip(got, leaves)]
    usable = conv._native_usable
    conv._native_usable = lambda *a: False
    try:
        y_ref, tail_ref = m(x, tail=tail, return_tail=True, cu_seqlens=cu)
    finally:
        conv._native_usable = usable
    want = torch.autograd.grad(y_ref, leaves, up, allow_unused=True)  # K = 1: y does not read the empty tails
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        before = tail[i:i + 1] if with_tail else torch.zeros(1, k - 1, c, dtype=torch.float64)
        own = _definition(torch.cat((before, x[:, s:e]), 1), m.weight, m.bias)[:, k - 1:]
        torch.testing.assert_close(y[:, s:e], own, rtol=1e-12, atol=1e-12)
    assert torch.equal(tail_out, tail_ref)
    for a, e, leaf in zip(got, want, leaves):
        torch.testing.assert_close(a, torch.zeros_like(leaf) if e is None else e, rtol=1e-12, atol=1e-12)
