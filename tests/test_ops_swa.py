"""linattn.ops.swa: sliding-window softmax attention and the LoLCATs hybrid against their float64
band-mask oracles (forward and gradients), packed sequences, padding, the ring-buffer decoding steps
(parallel == step, past the window; memory flat in context), dtypes and argument errors."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from linattn.ops.swa import (
    HybridState,
    WindowState,
    chunked,
    cpu,
    lolcats_attention,
    lolcats_attention_step,
    reference,
    sliding_window_attention,
    sliding_window_attention_step,
)


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


@pytest.fixture(params=["native", "fused", "torch"])
def swa_path(request, monkeypatch):
    """Runs a test on each CPU path: linattn's kernels (csrc/swa.cpp; fp32/fp64 without a key mask,
    else the flash path), torch's fused flash kernel on blocks (linattn.ops.swa.cpu) and the torch-op
    Function (linattn.ops.swa.chunked, the path of other devices); fused, with a few query blocks per
    kernel call so that the calls' seams are crossed."""
    monkeypatch.setattr(chunked, "FUSED_CPU", request.param != "torch")
    monkeypatch.setattr(cpu, "NATIVE", request.param == "native")
    monkeypatch.setattr(cpu, "GROUP_TOKENS", 24)
    return request.param


def qkv(b, h, n, d, e=None, *, dtype=torch.float64, seed=0, grad=True):
    g = torch.Generator().manual_seed(seed)
    e = d if e is None else e
    out = [torch.randn(b, h, n, x, generator=g, dtype=dtype) for x in (d, d, e)]
    return [t.requires_grad_(grad) for t in out]


def features(b, h, n, f, *, seed=1, grad=True):
    g = torch.Generator().manual_seed(seed)
    return [torch.rand(b, h, n, f, generator=g, dtype=torch.float64).requires_grad_(grad) for _ in range(2)]


def grads(out, inputs, seed=5):
    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    return torch.autograd.grad(out, inputs, cot)


def assert_all_close(xs, ys, **tol):
    for x, y in zip(xs, ys, strict=True):
        torch.testing.assert_close(x, y, **tol)


# (B, H, N, D, E, W, C): N=1, N < W, N not a multiple of C, W = 1, W a multiple of C, W > C, B·H > 1
SHAPES = [
    (1, 1, 1, 4, 4, 8, 4),
    (1, 2, 5, 4, 3, 8, 4),
    (2, 3, 37, 8, 5, 5, 8),
    (2, 2, 30, 6, 6, 1, 8),
    (1, 2, 64, 8, 8, 16, 16),
    (1, 2, 70, 8, 4, 17, 16),
    (2, 1, 45, 4, 4, 40, 8),
]


@pytest.mark.parametrize("b,h,n,d,e,w,c", SHAPES)
def test_swa_matches_the_band_mask_oracle_fp64(b, h, n, d, e, w, c, swa_path):
    q, k, v = qkv(b, h, n, d, e)
    out = sliding_window_attention(q, k, v, window=w, chunk_size=c)
    ref = reference.sliding_window_attention(q, k, v, window=w)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    assert_all_close(grads(out, (q, k, v)), grads(ref, (q, k, v)), rtol=1e-11, atol=1e-11)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 40), w=st.integers(1, 24), c=st.integers(1, 12), bh=st.sampled_from([(1, 1), (2, 3)]),
       scale=st.sampled_from([None, 0.3]))
def test_swa_property_any_window_chunk_and_length(n, w, c, bh, scale):
    q, k, v = qkv(*bh, n, 4, 3, seed=n * 31 + w)
    out = sliding_window_attention(q, k, v, window=w, chunk_size=c, scale=scale)
    ref = reference.sliding_window_attention(q, k, v, window=w, scale=scale)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    assert_all_close(grads(out, (q, k, v)), grads(ref, (q, k, v)), rtol=1e-11, atol=1e-11)


def test_swa_window_at_least_n_is_causal_softmax_attention():
    q, k, v = qkv(2, 2, 19, 8, grad=False)
    full = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(sliding_window_attention(q, k, v, window=19, chunk_size=8), full)
    assert not torch.allclose(sliding_window_attention(q, k, v, window=18, chunk_size=8), full)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 3e-2)])
def test_swa_fp32_and_bf16_within_rounding_of_the_oracle(dtype, tol, swa_path):
    q, k, v = qkv(2, 2, 50, 16, dtype=dtype)
    out = sliding_window_attention(q, k, v, window=12, chunk_size=8)
    assert out.dtype == dtype
    ref = reference.sliding_window_attention(q, k, v, window=12)
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=tol)
    for got, want in zip(grads(out, (q, k, v)), grads(ref.to(dtype), (q, k, v)), strict=True):
        assert got.dtype == dtype
        torch.testing.assert_close(got.double(), want.double(), rtol=0, atol=8 * tol)


def test_swa_saves_no_score_matrix(swa_path):
    """What the backward keeps is O(N·D): the padded q, k, v, the output and lse (and, fused, the
    additive mask of one row's blocks, N·S); never N×N."""
    n, d, w, c = 1024, 8, 16, 16
    q, k, v = qkv(1, 1, n, d, dtype=torch.float32)
    out = sliding_window_attention(q, k, v, window=w, chunk_size=c)
    saved = sum(t.numel() for t in out.grad_fn.saved_tensors)
    fn = {"native": cpu.NativeSlidingWindowAttention, "fused": cpu.FusedSlidingWindowAttention,
          "torch": chunked.SlidingWindowAttentionFunction}[swa_path]
    assert isinstance(out.grad_fn, fn._backward_cls)
    assert saved <= 5 * (n + 2 * c) * d + (n * 2 * c if swa_path == "fused" else 0) < n * n // 4


PACKS = [[0, 5, 6, 20, 33], [0, 1, 2, 3], [0, 17], [0, 0, 9, 9, 21]]


@pytest.mark.parametrize("cu", PACKS)
def test_swa_packed_equals_separate_calls(cu, swa_path):
    n = cu[-1]
    q, k, v = qkv(1, 2, n, 6, 4, seed=len(cu))
    cu_t = torch.tensor(cu)
    out = sliding_window_attention(q, k, v, window=7, chunk_size=4, cu_seqlens=cu_t)
    parts = [sliding_window_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], window=7, chunk_size=4)
             for a, b in zip(cu, cu[1:]) if b > a]
    sep = torch.cat(parts, 2)
    torch.testing.assert_close(out, sep, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out, reference.sliding_window_attention(q, k, v, window=7, cu_seqlens=cu_t))
    assert_all_close(grads(out, (q, k, v)), grads(sep, (q, k, v)), rtol=1e-11, atol=1e-11)


def test_swa_left_padding_leaves_real_tokens_as_alone(swa_path):
    q, k, v = qkv(1, 2, 13, 4, grad=False)
    pad = 5
    qp, kp, vp = (torch.cat((torch.randn(1, 2, pad, 4, dtype=x.dtype) * 9, x), 2) for x in (q, k, v))
    mask = torch.arange(13 + pad)[None] >= pad
    out = sliding_window_attention(qp, kp, vp, window=4, chunk_size=4, key_padding_mask=mask)
    torch.testing.assert_close(out[:, :, pad:], sliding_window_attention(q, k, v, window=4, chunk_size=4))
    assert torch.isfinite(out).all()
    ref = reference.sliding_window_attention(qp, kp, vp, window=4, key_padding_mask=mask)
    torch.testing.assert_close(out, ref)


def _decode(step, state, inputs, splits, **kw):
    outs = []
    for lo, hi in splits:
        o, state = step(state, *(x[:, :, lo:hi] for x in inputs), **kw)
        outs.append(o)
    return torch.cat(outs, 2), state


SPLITS = [(0, 1), (1, 2), (2, 9), (9, 10), (10, 11), (11, 12), (12, 25), (25, 26), (26, 27)] + \
    [(i, i + 1) for i in range(27, 40)]


@pytest.mark.parametrize("w", [1, 3, 8])
def test_swa_step_equals_parallel_past_the_window_fp64(w):
    q, k, v = qkv(2, 3, 40, 4, 5, grad=False)
    full = sliding_window_attention(q, k, v, window=w, chunk_size=4)
    rec, state = _decode(sliding_window_attention_step, None, (q, k, v), SPLITS, window=w, chunk_size=4)
    torch.testing.assert_close(rec, full, rtol=1e-12, atol=1e-12)
    assert isinstance(state, WindowState) and state.length == 40 and state.k.shape == (2, 3, w, 4)


def test_swa_step_memory_is_flat_in_context():
    q, k, v = qkv(1, 2, 60, 4, grad=False)
    state, sizes = None, []
    for t in range(60):
        _, state = sliding_window_attention_step(state, q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1],
                                                 window=6)
        sizes.append(state.nbytes)
    assert len(set(sizes)) == 1 and sizes[0] == 2 * 6 * (4 + 4) * 8


def test_swa_step_with_left_padding_equals_parallel():
    q, k, v = qkv(2, 2, 20, 4, grad=False)
    mask = torch.ones(2, 20, dtype=torch.bool)
    mask[0, :6] = False
    full = sliding_window_attention(q, k, v, window=5, chunk_size=4, key_padding_mask=mask)
    state, outs = None, []
    for lo, hi in [(0, 8), (8, 9), (9, 13)] + [(i, i + 1) for i in range(13, 20)]:
        o, state = sliding_window_attention_step(state, q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi], window=5,
                                                 chunk_size=4, key_padding_mask=mask[:, lo:hi])
        outs.append(o)
    rec = torch.cat(outs, 2)
    torch.testing.assert_close(rec, full, rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------------------------
# LoLCATs hybrid


def hybrid_inputs(b, h, n, d, e, f, seed=0):
    q, k, v = qkv(b, h, n, d, e, seed=seed)
    qf, kf = features(b, h, n, f, seed=seed + 1)
    gamma = torch.rand(h, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + 2)) + 0.05
    lam = torch.rand(h, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + 3)) + 0.5
    return q, k, qf, kf, v, gamma.requires_grad_(), lam.requires_grad_()


@pytest.mark.parametrize("b,h,n,d,e,w,c", SHAPES)
def test_lolcats_matches_the_oracle_fp64(b, h, n, d, e, w, c):
    q, k, qf, kf, v, gamma, lam = hybrid_inputs(b, h, n, d, e, 6)
    out = lolcats_attention(q, k, qf, kf, v, window=w, window_factor=gamma, linear_factor=lam, chunk_size=c)
    ref = reference.lolcats_attention(q, k, qf, kf, v, window=w, window_factor=gamma, linear_factor=lam)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    inputs = (q, k, qf, kf, v, gamma, lam)
    assert_all_close(grads(out, inputs), grads(ref, inputs), rtol=1e-10, atol=1e-10)


def test_lolcats_is_window_softmax_plus_linear_attention_in_the_limits():
    """N ≤ W: pure softmax attention (whatever γ); γ → 0 with W = 1: linear attention beyond the
    diagonal plus ... the diagonal term vanishes only in the limit, so compare at γ = 1e-12."""
    q, k, qf, kf, v, _, _ = hybrid_inputs(1, 2, 12, 4, 4, 5)
    out = lolcats_attention(q, k, qf, kf, v, window=12, window_factor=0.3, chunk_size=4)
    full = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, full)
    out = lolcats_attention(q, k, qf, kf, v, window=1, window_factor=1e-12, chunk_size=4)
    a = torch.tril(qf @ kf.transpose(-1, -2), -1)
    lin = (a @ v) / a.sum(-1, keepdim=True)
    torch.testing.assert_close(out[:, :, 1:], lin[:, :, 1:], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 3e-2)])
def test_lolcats_fp32_and_bf16_within_rounding_of_the_oracle(dtype, tol):
    q, k, qf, kf, v, gamma, _ = (x.detach() for x in hybrid_inputs(1, 2, 40, 8, 8, 6))
    args = [x.to(dtype) for x in (q, k, qf, kf, v)]
    out = lolcats_attention(*args, window=6, window_factor=gamma.to(dtype), chunk_size=8)
    assert out.dtype == dtype
    ref = reference.lolcats_attention(*args, window=6, window_factor=gamma.to(dtype))
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=tol)
    o1, state = lolcats_attention_step(None, *(x[:, :, :39] for x in args), window=6, window_factor=gamma.to(dtype))
    o2, state = lolcats_attention_step(state, *(x[:, :, 39:] for x in args), window=6, window_factor=gamma.to(dtype))
    assert state.kv.dtype == torch.float32 and o2.dtype == dtype
    torch.testing.assert_close(o2.double(), ref[:, :, 39:], rtol=0, atol=tol)


@pytest.mark.parametrize("cu", PACKS[:2])
def test_lolcats_packed_equals_separate_calls(cu):
    q, k, qf, kf, v, gamma, lam = hybrid_inputs(1, 2, cu[-1], 4, 3, 5)
    opts = dict(window=3, window_factor=gamma, chunk_size=4)
    out = lolcats_attention(q, k, qf, kf, v, cu_seqlens=torch.tensor(cu), **opts)
    sep = torch.cat([lolcats_attention(*(x[:, :, a:b] for x in (q, k, qf, kf, v)), **opts)
                     for a, b in zip(cu, cu[1:])], 2)
    torch.testing.assert_close(out, sep, rtol=1e-12, atol=1e-12)
    ref = reference.lolcats_attention(q, k, qf, kf, v, cu_seqlens=torch.tensor(cu), window=3, window_factor=gamma)
    torch.testing.assert_close(out, ref)


@pytest.mark.parametrize("w", [1, 4, 9])
def test_lolcats_step_equals_parallel_past_the_window_fp64(w):
    q, k, qf, kf, v, gamma, lam = hybrid_inputs(2, 3, 40, 4, 5, 6)
    opts = dict(window=w, window_factor=gamma.detach(), linear_factor=lam.detach(), chunk_size=4)
    with torch.no_grad():
        full = lolcats_attention(q, k, qf, kf, v, **opts)
        rec, state = _decode(lolcats_attention_step, None, (q, k, qf, kf, v), SPLITS, **opts)
    torch.testing.assert_close(rec, full, rtol=1e-12, atol=1e-12)
    assert isinstance(state, HybridState) and state.window.length == 40
    # the linear state holds exactly the tokens that left the window
    kv = kf[:, :, :40 - w].transpose(-1, -2) @ v[:, :, :40 - w]
    torch.testing.assert_close(state.kv, kv.detach())


def test_lolcats_step_memory_flat_and_left_padding():
    q, k, qf, kf, v, gamma, _ = hybrid_inputs(2, 2, 24, 4, 4, 6)
    mask = torch.ones(2, 24, dtype=torch.bool)
    mask[1, :7] = False
    opts = dict(window=5, window_factor=gamma.detach(), chunk_size=4, key_padding_mask=mask)
    with torch.no_grad():
        full = lolcats_attention(q, k, qf, kf, v, **opts)
        state, outs, sizes = None, [], []
        for lo, hi in [(0, 9)] + [(i, i + 1) for i in range(9, 24)]:
            o, state = lolcats_attention_step(state, *(x[:, :, lo:hi] for x in (q, k, qf, kf, v)),
                                              **{**opts, "key_padding_mask": mask[:, lo:hi]})
            outs.append(o)
            sizes.append(state.nbytes)
    torch.testing.assert_close(torch.cat(outs, 2), full, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(full, reference.lolcats_attention(q, k, qf, kf, v, window=5, window_factor=gamma,
                                                                 key_padding_mask=mask))
    assert len(set(sizes)) == 1


# --------------------------------------------------------------------------------------------
# errors


def test_bad_arguments_name_the_argument():
    q, k, v = qkv(1, 2, 8, 4, grad=False)
    for kw, err, name in [(dict(window=0), ValueError, "window"), (dict(window=2.0), ValueError, "window"),
                          (dict(window=2, chunk_size=0), ValueError, "chunk_size"),
                          (dict(window=2, scale=-1.0), ValueError, "scale"),
                          (dict(window=2, cu_seqlens=torch.tensor([0, 3, 7])), ValueError, "cu_seqlens"),
                          (dict(window=2, cu_seqlens=torch.tensor([0.0, 8.0])), TypeError, "cu_seqlens"),
                          (dict(window=2, key_padding_mask=torch.ones(1, 7, dtype=torch.bool)), ValueError,
                           "key_padding_mask")]:
        with pytest.raises(err, match=name):
            sliding_window_attention(q, k, v, **kw)
    with pytest.raises(ValueError, match="cu_seqlens"):
        sliding_window_attention(q.expand(2, -1, -1, -1), k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1),
                                 window=2, cu_seqlens=torch.tensor([0, 8]))
    with pytest.raises(ValueError, match="sequence length"):
        sliding_window_attention(q, k[:, :, :5], v[:, :, :5], window=2)
    qf, kf = features(1, 2, 8, 3, grad=False)
    with pytest.raises(ValueError, match="window_factor"):
        lolcats_attention(q, k, qf, kf, v, window=2, window_factor=torch.ones(3))
    with pytest.raises(ValueError, match="qf"):
        lolcats_attention(q, k, qf[:, :, :4], kf, v, window=2, window_factor=0.5)
    _, state = sliding_window_attention_step(None, q[:, :, :1], k[:, :, :1], v[:, :, :1], window=3)
    with pytest.raises(ValueError, match="window"):
        sliding_window_attention_step(state, q[:, :, :1], k[:, :, :1], v[:, :, :1], window=4)


# --------------------------------------------------------------------------------------------
# issue 37: a window far beyond the sequence (item 12), second order (item 4)


@pytest.mark.parametrize("window", [10**6, 2**40])
def test_a_window_far_beyond_the_sequence_is_the_sequence(window, swa_path):
    """Item 12: window 65,536 on 8 tokens took 71 s and 13 GB, 10^6 tried to allocate 125 GB. A window
    of at least N is causal attention over the whole prefix: the op clamps it to N (swa and lolcats)."""
    q, k, v = qkv(1, 2, 8, 4)
    out = sliding_window_attention(q, k, v, window=window)
    ref = reference.sliding_window_attention(q, k, v, window=8)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    assert_all_close(grads(out, (q, k, v)), grads(ref, (q, k, v)), rtol=1e-11, atol=1e-11)
    qf, kf = features(1, 2, 8, 3)
    out = lolcats_attention(q, k, qf, kf, v, window=window, window_factor=0.7)
    ref = reference.lolcats_attention(q, k, qf, kf, v, window=8, window_factor=0.7)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


def test_a_gradient_penalty_through_swa_is_refused_by_name(swa_path):
    """Item 4: the backward is first order only (a custom Function); with create_graph=True its
    second-order term was silently wrong (0.76–1.17 relative on the torch path) or failed with an
    error about aten internals (fused). It now refuses by name, as the linear, gated and delta ops do;
    forward-mode AD too. The one-token step is torch's SDPA and stays twice differentiable."""
    q, k, v = qkv(1, 2, 10, 4)
    o = sliding_window_attention(q, k, v, window=3, chunk_size=4)
    with pytest.raises(RuntimeError, match="sliding_window_attention.*not twice differentiable"):
        (dq,) = torch.autograd.grad(o.pow(2).sum(), q, create_graph=True)
        dq.pow(2).sum().backward()
    with pytest.raises(NotImplementedError, match="sliding_window_attention.*forward-mode AD"):
        torch.func.jvp(lambda x: sliding_window_attention(x, k, v, window=3), (q.detach(),), (torch.ones_like(q),))
    (o.pow(2).sum()).backward()  # first order still runs
    assert all(x.grad is not None and torch.isfinite(x.grad).all() for x in (q, k, v))
