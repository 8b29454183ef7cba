"""linattn's sliding-window kernels (csrc/swa.cpp, linattn.ops.swa.cpu.NativeSlidingWindowAttention):
one pass of query blocks over their key spans read in place, forward and backward, against the float64
band-mask oracle (outputs and the gradients of q, k, v) for any window, block size, length, scale,
head dims and packed sequences (lengths 0 and 1 among them), and against torch's flash path in fp32;
bf16 inputs (widened to fp32 in the kernels) against the float64 oracle within bf16's rounding and
against the fp32 kernels on the same values within one rounding of the results."""

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
    """fp16 inputs and a key-padding mask take torch's flash kernel; with FUSED_CPU off, the torch ops."""
    q, k, v = _inputs(1, 20, 4, 4, seed=0, dtype=torch.float16)
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


def _bf16_inputs(b, h, n, d, e, seed):
    """bf16 leaves and float64 leaves holding the same values."""
    g = torch.Generator().manual_seed(seed)
    low = [torch.randn(b, h, n, x, generator=g).to(torch.bfloat16) for x in (d, d, e)]
    return [x.requires_grad_() for x in low], [x.double().requires_grad_() for x in low]


@pytest.mark.parametrize("b,h,lengths,window,chunk,packed", [
    (2, 3, [300], 64, 64, False),           # N not a multiple of the block, batch·heads > 1
    (2, 2, [1], 5, None, False),            # N = 1
    (1, 2, [40], 100, 16, False),           # W > N
    (1, 3, [1, 17, 30, 1, 12], 8, 16, True),  # packed, length-1 sequences
    (1, 2, [0, 90, 1, 60], 33, 7, True),    # packed, a length-0 sequence, spans of several blocks
    (2, 2, [257], 100, 16, False),
])
def test_native_swa_bf16_within_rounding_of_the_oracle(b, h, lengths, window, chunk, packed):
    """bf16 o and gradients of q, k, v against float64 on the same values, within bf16's rounding (the
    tolerances of tests/test_ops_swa.py and test_ops_dtypes.py: 3e-2 on o, relative 5e-2 on the gradients)."""
    n = sum(lengths)
    low, wide = _bf16_inputs(b, h, n, 16, 12, seed=n + window)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]) if packed else None
    out = sliding_window_attention(*low, window=window, chunk_size=chunk, cu_seqlens=cu)
    assert isinstance(out.grad_fn, cpu.NativeSlidingWindowAttention._backward_cls) and out.dtype == torch.bfloat16
    ref = reference.sliding_window_attention(*wide, window=window, cu_seqlens=cu)
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=3e-2)
    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    got = torch.autograd.grad(out, low, cot)
    want = torch.autograd.grad(ref, wide, cot.double())
    for a, w in zip(got, want, strict=True):
        assert a.dtype == torch.bfloat16
        assert (a.double() - w).abs().max() <= 5e-2 * w.abs().max()


@settings(max_examples=30, deadline=None)
@given(lengths=st.lists(st.integers(0, 40), min_size=1, max_size=3).filter(lambda ls: sum(ls) > 0),
       window=st.integers(1, 50), chunk=st.integers(1, 24), packed=st.booleans())
def test_native_swa_bf16_is_the_fp32_kernel_rounded(lengths, window, chunk, packed):
    """On the same values the bf16 kernels compute what the fp32 ones do (widened operands, fp32
    sums; D_i = Σ_j P_ij dP_ij from the float P and dP, not from the rounded o) and round o and the
    gradients once: within one bf16 rounding of the fp32 results. Checks the float dK, dV kept over the
    sliding span of bf16 rows against the fp32 kernels' in-place sums."""
    n = sum(lengths)
    low, _ = _bf16_inputs(1, 2, n, 8, 8, seed=3 * n + window)
    f32 = [x.detach().float().requires_grad_() for x in low]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]) if packed else None
    cot = torch.randn(1, 2, n, 8, generator=torch.Generator().manual_seed(n)).to(torch.bfloat16)
    results = []
    for xs in (low, f32):
        out = sliding_window_attention(*xs, window=window, chunk_size=chunk, cu_seqlens=cu)
        assert isinstance(out.grad_fn, cpu.NativeSlidingWindowAttention._backward_cls)
        results.append([out, *torch.autograd.grad(out, xs, cot.to(out.dtype))])
    for a, w in zip(*results, strict=True):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), w, rtol=2 ** -8, atol=1e-5 * max(1.0, w.abs().max().item()))
