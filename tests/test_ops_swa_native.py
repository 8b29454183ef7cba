"""linattn's sliding-window kernels (csrc/swa.cpp, linattn.ops.swa.cpu.NativeSlidingWindowAttention):
one pass of query blocks over their key spans read in place, forward and backward, against the float64
band-mask oracle (outputs and the gradients of q, k, v) for any window, block size, length, scale,
head dims and packed sequences (lengths 0 and 1 among them), and against torch's flash path in fp32."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from linattn.ops import native
from linattn.ops.swa import chunked, cpu, reference, sliding_window_attention

pytestmark = pytest.mark.skipif(not native.available(), reason="the fused CPU kernels could not be built here")


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def _inputs(h, n, d, e, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, h, n, x, generator=g, dtype=dtype).requires_grad_() for x in (d, d, e)]


def _check_against_oracle(q, k, v, window, chunk, scale=None, cu=None):
    out = sliding_window_attention(q, k, v, window=window, chunk_size=chunk, scale=scale, cu_seqlens=cu)
    assert isinstance(out.grad_fn, cpu.NativeSlidingWindowAttention._backward_cls)
    ref = reference.sliding_window_attention(q, k, v, window=window, scale=scale, cu_seqlens=cu)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(5), dtype=out.dtype)
    for got, want in zip(torch.autograd.grad(out, (q, k, v), cot), torch.autograd.grad(ref, (q, k, v), cot)):
        torch.testing.assert_close(got, want, rtol=1e-11, atol=1e-11)


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(0, 30), min_size=1, max_size=4).filter(lambda ls: sum(ls) > 0),
       window=st.integers(1, 40), chunk=st.integers(1, 20), heads=st.integers(1, 3), de=st.sampled_from([(4, 4), (5, 3)]),
       scale=st.sampled_from([None, 0.3, 2.5]), packed=st.booleans())
def test_native_swa_matches_the_oracle(lengths, window, chunk, heads, de, scale, packed):
    n = sum(lengths)
    q, k, v = _inputs(heads, n, *de, seed=n * 7 + window)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]) if packed else None
    _check_against_oracle(q, k, v, window, chunk, scale, cu)


@pytest.mark.parametrize("n,window,chunk", [(300, 64, 64), (300, 64, 32), (257, 100, 16), (130, 1, 64), (90, 500, 64)])
def test_native_swa_long_rows_and_wide_windows(n, window, chunk):
    """Many blocks per row, windows wider than a block (spans of several blocks), W = 1, W > N."""
    q, k, v = _inputs(2, n, 8, 8, seed=n)
    _check_against_oracle(q, k, v, window, chunk)


def test_native_swa_agrees_with_the_flash_path_in_fp32(monkeypatch):
    q, k, v = _inputs(4, 700, 32, 32, seed=3, dtype=torch.float32)
    cot = torch.randn(1, 4, 700, 32, generator=torch.Generator().manual_seed(1))
    results = []
    for use_native in (True, False):
        monkeypatch.setattr(cpu, "NATIVE", use_native)
        out = sliding_window_attention(q, k, v, window=64)
        results.append([out, *torch.autograd.grad(out, (q, k, v), cot)])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5 * max(1.0, b.abs().max().item()))


def test_native_swa_saves_o_and_lse_only():
    n, d = 2048, 8
    q, k, v = _inputs(1, n, d, d, seed=0, dtype=torch.float32)
    out = sliding_window_attention(q, k, v, window=64)
    assert isinstance(out.grad_fn, cpu.NativeSlidingWindowAttention._backward_cls)
    assert sum(t.numel() for t in out.grad_fn.saved_tensors) == 4 * n * d + n


def test_what_the_native_kernels_do_not_take_runs_the_flash_path():
    """bf16 inputs and a key-padding mask take torch's flash kernel; with FUSED_CPU off, the torch ops."""
    q, k, v = _inputs(1, 20, 4, 4, seed=0, dtype=torch.bfloat16)
    out = sliding_window_attention(q, k, v, window=5)
    assert isinstance(out.grad_fn, cpu.FusedSlidingWindowAttention._backward_cls)
    q, k, v = _inputs(1, 20, 4, 4, seed=0)
    mask = torch.ones(1, 20, dtype=torch.bool)
    out = sliding_window_attention(q, k, v, window=5, key_padding_mask=mask)
    assert isinstance(out.grad_fn, cpu.FusedSlidingWindowAttention._backward_cls)
    chunked.FUSED_CPU = False
    try:
        out = sliding_window_attention(q, k, v, window=5)
        assert isinstance(out.grad_fn, chunked.SlidingWindowAttentionFunction._backward_cls)
    finally:
        chunked.FUSED_CPU = True
