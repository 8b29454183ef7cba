"""The short convolution on packed sequences in one pass (linattn.nn.ShortConvolution with cu_seqlens),
with decoding tails in and out: equal to the N separate calls bit for bit (outputs and tails) and in
every gradient (x, the tails, weight, bias), float64, with sequences of length 0, 1 and shorter than the
kernel, a key mask, and a NaN in one sequence reaching no other."""

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from linattn.nn.convolution import ShortConvolution
from linattn.ops import packed

DT = torch.float64


def _separate(conv, x, mask, tail, cu):
    ys, tails = [], []
    for n, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        t_n = tail[n:n + 1]
        if e == s:
            tails.append(t_n)
            continue
        y_n, t_n = conv(x[:, s:e], None if mask is None else mask[:, s:e], t_n, True)
        ys.append(y_n)
        tails.append(t_n)
    return torch.cat(ys, 1), torch.cat(tails, 0)


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(0, 9), min_size=1, max_size=6).filter(lambda ls: sum(ls) > 0),
       kernel=st.integers(1, 5), masked=st.booleans(), seed=st.integers(0, 2**16))
def test_packed_conv_with_tails_equals_separate_calls(lengths, kernel, masked, seed):
    gen = torch.Generator().manual_seed(seed)
    conv = ShortConvolution(3, kernel, bias=True).double()
    with torch.no_grad():
        conv.bias.normal_(generator=gen)
    cu = packed.cu_seqlens_from_lengths(lengths)
    x = torch.randn(1, sum(lengths), 3, generator=gen, dtype=DT, requires_grad=True)
    tail = torch.randn(len(lengths), kernel - 1, 3, generator=gen, dtype=DT, requires_grad=True)
    mask = torch.rand(1, sum(lengths), generator=gen) > 0.3 if masked else None
    y, t = conv(x, mask, tail, True, cu_seqlens=cu)
    y_ref, t_ref = _separate(conv, x, mask, tail, cu)
    assert torch.equal(y, y_ref) and torch.equal(t, t_ref)  # the same sums in the same order: bit for bit
    wy, wt = torch.randn(y.shape, generator=gen, dtype=DT), torch.randn(t.shape, generator=gen, dtype=DT)
    leaves = [x, tail, conv.weight, conv.bias]
    got = torch.autograd.grad((y * wy).sum() + (t * wt).sum(), leaves, allow_unused=True)
    want = torch.autograd.grad((y_ref * wy).sum() + (t_ref * wt).sum(), leaves, allow_unused=True)
    for name, a, b in zip(("x", "tail", "weight", "bias"), got, want):
        if b is None:
            assert a is None or not a.any(), name
            continue
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0, msg=lambda m: f"d{name}: {m}")


def test_a_nan_in_one_sequence_reaches_no_other_with_tails():
    conv = ShortConvolution(2, 4).double()
    lengths = [5, 2, 6]
    cu = packed.cu_seqlens_from_lengths(lengths)
    x = torch.randn(1, 13, 2, dtype=DT)
    x[:, 6] = math.nan  # the last token of sequence 1
    x.requires_grad_()
    tail = torch.randn(3, 3, 2, dtype=DT, requires_grad=True)
    y, t = conv(x, tail=tail, return_tail=True, cu_seqlens=cu)
    assert torch.isfinite(y[:, :5]).all() and torch.isfinite(y[:, 7:]).all()
    assert torch.isfinite(t[[0, 2]]).all() and not torch.isfinite(t[1]).all()
    dx, dtail = torch.autograd.grad(y[:, :5].sum() + y[:, 7:].sum() + t[[0, 2]].sum(), (x, tail))
    assert torch.isfinite(dx).all() and torch.isfinite(dtail).all()
