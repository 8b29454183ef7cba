"""Packed sequences (cu_seqlens, design §16) above the operators: the short convolution (no tap crosses
a boundary, a decoding tail per sequence) and the models (every attention kind, RoPE and learned
positions restarting at each document, both block layouts): a packed call equals the N separate
calls, outputs and gradients, in float64."""

from __future__ import annotations

import math

import pytest
import torch

from linattn.nn.convolution import ShortConvolution
from linattn.models import ATTENTION_KINDS, LinearTransformerLM
from linattn.ops import packed

from .conftest import spread, tiny_config

DT = torch.float64
TOL = 1e-10
LENGTHS = [7, 1, 0, 12, 3]


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def _close(got, want, what):
    torch.testing.assert_close(got, want, atol=TOL * max(1.0, want.abs().max().item()), rtol=0,
                               msg=lambda m: f"{what}: {m}")


def _spans(lengths):
    cu = packed.cu_seqlens_from_lengths(lengths)
    return cu, [(s, e) for s, e in zip(cu[:-1].tolist(), cu[1:].tolist())]


# ---------------------------------------------------------------------------------------------------------
# short convolution


@pytest.mark.parametrize("kernel", [1, 2, 4])
def test_conv_packed_equals_separate(kernel):
    conv = ShortConvolution(5, kernel, bias=True).double()
    with torch.no_grad():
        conv.bias.normal_()
    cu, spans = _spans(LENGTHS)
    x = torch.randn(1, sum(LENGTHS), 5, dtype=DT, requires_grad=True)
    y = conv(x, cu_seqlens=cu)
    want = torch.cat([conv(x[:, s:e]) for s, e in spans if e > s], 1)
    assert torch.equal(y, want)  # the same sums in the same order: bit for bit
    w = torch.randn(y.shape, dtype=DT)
    got = torch.autograd.grad((y * w).sum(), [x, conv.weight, conv.bias])
    ref = torch.autograd.grad((want * w).sum(), [x, conv.weight, conv.bias])
    for name, a, b in zip(("x", "weight", "bias"), got, ref):
        _close(a, b, name)


def test_conv_packed_tails_per_sequence():
    """With tails in and out: tail (N, K−1, C) continues each sequence, tail' is each one's last K−1 inputs."""
    conv = ShortConvolution(3, 4).double()
    cu, spans = _spans(LENGTHS)
    x = torch.randn(1, sum(LENGTHS), 3, dtype=DT)
    tail = torch.randn(len(LENGTHS), 3, 3, dtype=DT)
    y, tail_out = conv(x, tail=tail, return_tail=True, cu_seqlens=cu)
    assert tail_out.shape == (len(LENGTHS), 3, 3)
    for n, (s, e) in enumerate(spans):
        if e == s:
            assert torch.equal(tail_out[n], tail[n])
            continue
        y_n, t_n = conv(x[:, s:e], tail=tail[n:n + 1], return_tail=True)
        assert torch.equal(y[:, s:e], y_n) and torch.equal(tail_out[n:n + 1], t_n)
    y0, t0 = conv(x, return_tail=True, cu_seqlens=cu)  # no tail in: zeros before each sequence
    assert torch.equal(y0, conv(x, cu_seqlens=cu))
    assert torch.equal(t0[1], torch.cat((torch.zeros(2, 3, dtype=DT), x[0, 7:8])))
    with pytest.raises(ValueError, match=r"tail must have shape \(N, K−1, C\)"):
        conv(x, tail=tail[:2], cu_seqlens=cu)


def test_conv_nan_stays_in_its_sequence():
    conv = ShortConvolution(3, 4).double()
    cu = torch.tensor([0, 5, 9])
    x = torch.randn(1, 9, 3, dtype=DT)
    x[0, 4] = math.nan  # the last token of sequence 0
    x.requires_grad_()
    y = conv(x, cu_seqlens=cu)
    assert torch.isfinite(y[0, 5:]).all() and torch.isnan(y[0, 4]).all()
    y[0, 5:].sum().backward()  # a loss over sequence 1: its inputs' gradients stay finite, sequence 0's are 0
    assert torch.isfinite(x.grad[0, 5:]).all() and not x.grad[0, :5].any()


# ---------------------------------------------------------------------------------------------------------
# models


def _lm(**kw):
    return spread(LinearTransformerLM(tiny_config(**kw))).to(DT).eval()


def _compare_model(model, lengths):
    """Logits and the gradients of a float64 functional of them (every parameter) equal the N
    separate calls'; the packed loss (cross-entropy in float32, as `loss`) equals the
    target-weighted mean of the separate losses."""
    cu, spans = _spans(lengths)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (1, sum(lengths)), generator=gen)
    logits, _ = model(ids, cu_seqlens=cu)
    want = torch.cat([model(ids[:, s:e])[0] for s, e in spans if e > s], 1)
    _close(logits, want, "logits")
    params = [p for p in model.parameters() if p.requires_grad]
    w = torch.randn(logits.shape, generator=gen, dtype=DT)
    got = torch.autograd.grad((logits * w).sum(), params, allow_unused=True)
    exp = torch.autograd.grad((want * w).sum(), params, allow_unused=True)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    for name, a, b in zip(names, got, exp):
        if b is None:
            assert a is None or not a.any(), name
        else:
            _close(a, b, f"d{name}")
    with torch.no_grad():
        loss = model.loss(ids, cu_seqlens=cu)
        n_targets = sum(max(e - s - 1, 0) for s, e in spans)
        ref = sum(model.loss(ids[:, s:e]) * (e - s - 1) for s, e in spans if e - s > 1) / n_targets
    torch.testing.assert_close(loss, ref.to(loss.dtype), rtol=1e-5, atol=0)


@pytest.mark.parametrize("kind", ATTENTION_KINDS)
def test_model_packed_equals_separate(kind):
    """Every kind (lolcats since issue 37 item 8), RoPE restarting at each document (the default
    positions), a short convolution on q, k, v."""
    _compare_model(_lm(attention=[kind], short_conv=3, chunk_size=4), LENGTHS)


@pytest.mark.parametrize("kind", ["linear", "softmax", "gated_deltanet"])
def test_model_packed_learned_positions_and_conv_mixer(kind):
    _compare_model(_lm(attention=[kind], positions="learned", block="conv_mixer", chunk_size=4), LENGTHS)


def test_model_packed_hybrid_with_favor():
    """Sequences of one length (5, 5) run as the rows of one batch, in the linear and softmax layers alike."""
    _compare_model(_lm(attention=["linear", "softmax"], feature_map="favor", chunk_size=4), [5, 9, 5, 1])


@pytest.mark.parametrize("causal", [True, False])
def test_softmax_layer_packed_with_key_mask(causal):
    """A key mask on the packed axis: the block-diagonal masked path equals the separate masked calls at
    the real tokens."""
    from linattn.nn.attention import SoftmaxAttention

    layer = spread(SoftmaxAttention(16, 2, causal=causal, rope=True)).double().eval()
    cu, spans = _spans([6, 4, 6])
    x = torch.randn(1, 16, 16, dtype=DT)
    mask = torch.ones(1, 16, dtype=torch.bool)
    mask[0, [2, 7, 12]] = False
    y, _ = layer(x, mask, cu_seqlens=cu)
    for s, e in spans:
        # packed positions count each sequence's real tokens, as the unpacked layer's (issue 37 item 5)
        y_n, _ = layer(x[:, s:e], mask[:, s:e])
        real = mask[0, s:e]
        _close(y[:, s:e][:, real], y_n[:, real], f"tokens {s}..{e}")


@pytest.mark.parametrize("kind, positions", [("linear", "learned"), ("linear", "rope"), ("softmax", "rope"),
                                             ("gated_deltanet", "rope"), ("swa", "rope"), ("softmax", "learned"),
                                             ("lolcats", "rope")])
def test_model_packed_with_pads_counts_positions_as_unpacked(kind, positions):
    """Issue 37 item 5: with a padding mask, the packed path counted pads as positions and the unpacked
    one skips them, so a left-padded document differed from itself alone (0.25 with learned positions;
    with RoPE where pads sit inside a document). Now positions count each document's real tokens in
    both: the packed logits at real tokens equal the separate masked calls', and a left-padded
    document's equal its own unpadded call's."""
    model = _lm(attention=[kind], positions=positions, chunk_size=4)
    cu, spans = _spans([5, 7, 6])
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, model.config.vocab_size, (1, 18), generator=gen)
    mask = torch.ones(1, 18, dtype=torch.bool)
    mask[0, [5, 6, 14]] = False  # document 1 left-padded by two, document 2 with a pad inside
    logits, _ = model(ids, mask, cu_seqlens=cu)
    for s, e in spans:
        want, _ = model(ids[:, s:e], mask[:, s:e])
        real = mask[0, s:e]
        _close(logits[:, s:e][:, real], want[:, real], f"document {s}..{e}")
    alone, _ = model(ids[:, 7:12])
    _close(logits[:, 7:12], alone, "the left-padded document")


def test_model_packed_errors():
    model = _lm(attention=["linear"])
    ids = torch.zeros(2, 6, dtype=torch.long)
    with pytest.raises(ValueError, match="batch size must be 1"):
        model(ids, cu_seqlens=torch.tensor([0, 6]))
    with pytest.raises(ValueError, match=r"cu_seqlens\[-1\]"):
        model(ids[:1], cu_seqlens=torch.tensor([0, 5]))
    with pytest.raises(ValueError, match="cache"):
        model(ids[:1], cache=model.new_cache(), cu_seqlens=torch.tensor([0, 6]))
