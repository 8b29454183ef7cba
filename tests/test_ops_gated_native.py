"""The fused CPU kernels of gated linear attention (csrc/gated*.cpp) where they differ from the torch-op
path: which calls take them, fp32 at the benchmark's shape, bf16 accuracy, the fused step, and the
kernels' own checks. Their agreement with the float64 recurrence is in test_ops_gated.py."""

from __future__ import annotations

import math

import pytest
import torch

from linattn.nn.feature_maps import EluPlusOne, make_feature_map
from linattn.ops import gated_linear_attention, gated_linear_attention_step, native
from linattn.ops.gated.reference import gated_recurrence

from .conftest import raises_on_threads

pytestmark = pytest.mark.skipif(not native.available(), reason="the fused CPU kernels could not be built here")

FUSED, EAGER = "FusedGatedChunkedBackward", "ChunkedGatedLinearAttentionBackward"


def _eager(monkeypatch, fn):
    with monkeypatch.context() as m:
        m.setenv("LINATTN_NATIVE", "0")
        return fn()


def _gates(shape, gen, dtype=torch.float32):
    """GLA-like log-decays: logsigmoid(x)/16 (decays near 1) with a few strong ones."""
    g = torch.nn.functional.logsigmoid(torch.randn(shape, generator=gen)) / 16
    g[..., ::97] -= 3.0
    return g.to(dtype)


def test_the_fused_path_is_taken_where_it_applies(monkeypatch):
    x = torch.randn(1, 2, 8, 4, requires_grad=True)
    g = -torch.rand(1, 2, 8)

    def name(**kw):
        return type(gated_linear_attention(x, x, x, g, **kw).grad_fn).__name__

    assert name(feature_map=EluPlusOne(4)) == FUSED
    assert name() == FUSED
    assert name(feature_map=EluPlusOne(4), normalize=True) == FUSED
    assert name(feature_map=make_feature_map("relu", 4)) == EAGER
    assert name(feature_map=EluPlusOne(4), scale=0.5) == EAGER
    assert name(feature_map=EluPlusOne(4), key_padding_mask=torch.ones(1, 8, dtype=torch.bool)) == EAGER
    assert _eager(monkeypatch, lambda: name(feature_map=EluPlusOne(4))) == EAGER


@pytest.mark.parametrize("vector", [False, True])
@pytest.mark.parametrize("normalize", [False, True])
def test_fused_equals_the_torch_ops_in_float32(monkeypatch, vector, normalize):
    """The benchmark's shape class (B·H = 8, F = E = 64, rows in parallel on the suite's two threads),
    1000 tokens (blocks and a tail), strided inputs, an initial state: outputs, final state and the
    gradients of q, k, v, g and the state."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, 1000, 8, 3 * 64, generator=gen)
    g0 = _gates((1, 8, 1000, *((64,) if vector else ())), gen)
    kv0 = torch.randn(1, 8, 64, 64, generator=gen)
    z0 = torch.rand(1, 8, 64, generator=gen) + 1
    w = torch.randn(1, 8, 1000, 64, generator=gen)
    fm = EluPlusOne(64)

    def run():
        leaves = [t.detach().requires_grad_() for t in (x, g0, kv0, z0)]
        q, k, v = (t.transpose(1, 2) for t in leaves[0].split(64, dim=-1))
        state = (leaves[2], leaves[3]) if normalize else leaves[2]
        o, fin = gated_linear_attention(q, k, v, leaves[1], feature_map=fm, normalize=normalize, initial_state=state,
                                        return_state=True)
        kv = fin[0] if normalize else fin
        loss = (o * w).sum() + kv.sin().sum() + (fin[1].sum() if normalize else 0)
        used = leaves if normalize else leaves[:3]
        return [o, kv, *torch.autograd.grad(loss, used)], type(o.grad_fn).__name__

    fused, name = run()
    eager, name_ref = _eager(monkeypatch, run)
    assert (name, name_ref) == (FUSED, EAGER)
    for a, b_ in zip(fused, eager):
        torch.testing.assert_close(a, b_, rtol=1e-4, atol=1e-4 * b_.abs().max().item())


@pytest.mark.parametrize("vector", [False, True])
def test_bf16_is_as_close_to_float64_as_the_torch_ops(monkeypatch, one_thread, bf16_path, vector):
    """bf16 q, k, v on a float32 state (fp32 scores, states and accumulation), either path: the errors
    of the outputs and of every gradient against the float64 recurrence are within one bf16 ulp of
    the torch-op path's on the same path."""
    if not native.chunked_ready(torch.bfloat16):
        pytest.skip("no bf16 gemm in this torch")
    gen = torch.Generator().manual_seed(2)
    lo = [torch.randn(1, 4, 600, 32, generator=gen).bfloat16() for _ in range(3)]
    g = _gates((1, 4, 600, *((32,) if vector else ())), gen)
    fm = EluPlusOne(32)
    hi = [x.double().requires_grad_() for x in (*lo, g)]
    o_ref, _ = gated_recurrence(fm.double()(hi[0]), fm.double()(hi[1]), hi[2], hi[3])
    w = torch.randn(o_ref.shape, generator=gen, dtype=torch.float64)
    want = [o_ref.detach(), *torch.autograd.grad((o_ref * w).sum(), hi)]

    def run():
        inputs = [x.detach().requires_grad_() for x in (*lo, g)]
        o = gated_linear_attention(*inputs, feature_map=fm)
        return [o, *torch.autograd.grad((o * w.bfloat16()).sum(), inputs)], type(o.grad_fn).__name__

    fused, name = run()
    eager, name_ref = _eager(monkeypatch, run)
    assert (name, name_ref) == (FUSED, EAGER)
    assert fused[0].dtype == torch.bfloat16 and fused[4].dtype == torch.float32
    for a, b_, ref in zip(fused, eager, want):
        ulp = 2.0 ** (math.floor(math.log2(ref.abs().max().item())) - 7)
        err_fused, err_eager = ((x.double() - ref).abs().max().item() for x in (a, b_))
        assert err_fused <= err_eager + ulp, (err_fused, err_eager)


@pytest.mark.parametrize("vector", [False, True])
@pytest.mark.parametrize("normalize", [False, True])
def test_fused_step_equals_the_torch_op_step(monkeypatch, one_thread, vector, normalize):
    """B=2, H=8, F=E=64 from a random state, four steps, without gradients."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 8, 4, 64, generator=gen) for _ in range(3))
    g = _gates((2, 8, 4, *((64,) if vector else ())), gen)
    kv0 = torch.randn(2, 8, 64, 64, generator=gen)
    state = (kv0, torch.rand(2, 8, 64, generator=gen) + 1) if normalize else kv0
    fm = EluPlusOne(64)

    def run():
        with torch.inference_mode():
            outs, st_ = [], state
            for t in range(4):
                o, st_ = gated_linear_attention_step(st_, q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1],
                                                     g[:, :, t:t + 1], feature_map=fm, normalize=normalize)
                outs.append(o)
            return torch.cat(outs, 2), st_

    fused, fused_state = run()
    eager, eager_state = _eager(monkeypatch, run)
    torch.testing.assert_close(fused, eager, rtol=1e-5, atol=1e-5)
    for a, b_ in zip(fused_state if normalize else [fused_state], eager_state if normalize else [eager_state]):
        torch.testing.assert_close(a, b_, rtol=1e-5, atol=1e-5)


def test_the_kernels_name_bad_shapes_and_dtypes():
    q = torch.zeros(1, 2, 3, 4)
    kv, z = torch.zeros(1, 2, 4, 4), torch.zeros(1, 2, 4)
    ops = torch.ops.linattn_cpu
    with pytest.raises(RuntimeError, match=r"g must be \(B, H, N\) or \(B, H, N, F\)"):
        ops.gated_chunked(q, q, q, torch.zeros(1, 2, 2), kv, z, 1, 1e-6, 64, False)
    with pytest.raises(RuntimeError, match="g must have the state's dtype"):
        ops.gated_chunked(q, q, q, torch.zeros(1, 2, 3, dtype=torch.float64), kv, None, 1, 1e-6, 64, False)
    x = torch.zeros(1, 2, 1, 4)
    with pytest.raises(RuntimeError, match="shapes of kv, z, q, k, v, g do not agree"):
        ops.gated_step(kv, z, x, x, x, torch.zeros(1, 2, 1, 3), 1, 1e-6)
    with pytest.raises(RuntimeError, match="g must have kv's dtype"):
        ops.gated_step(kv, None, x, x, x, torch.zeros(1, 2, 1, dtype=torch.float64), 1, 1e-6)
    with pytest.raises(RuntimeError, match="q, k, v must have the state's dtype, or be bf16 on a float32 state"):
        ops.gated_step(kv, None, x.double(), x.double(), x.double(), torch.zeros(1, 2, 1), 1, 1e-6)
    with pytest.raises(ValueError, match=r"g \(the log of the decay\) must be ≤ 0 and finite, got 0.5"):
        ops.gated_step(kv, None, x, x, x, torch.full((1, 2, 1), 0.5), 1, 1e-6)



def _as_one_row(x):
    """(1, H, N, ...) -> (1, 1, H·N, ...): the heads' rows one after the other, as packed sequences."""
    return x.transpose(0, 1).reshape(1, 1, -1, *x.shape[3:])


@pytest.mark.parametrize("vector", [False, True])
@pytest.mark.parametrize("bad", [0.25, float("nan"), float("-inf"), float("inf")])
@pytest.mark.parametrize("where", [0, 63, 64, 130, 199])
def test_the_chunked_kernel_checks_every_gate_it_reads(vector, bad, where):
    """The chunked kernel reads g once and checks it there (no separate pass over g): one value out of
    range anywhere (a chunk's first row, its last, a piece's start after a cut, the sequence's end)
    raises the ValueError of the Python check, with or without a gradient, packed or not, on 1 and 2
    threads."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 200, 8, generator=gen) for _ in range(3))
    g = _gates((1, 2, 200, 8) if vector else (1, 2, 200), gen)
    if vector:
        g[0, 1, 100:110] = -5.0  # pieces cut inside the second chunk
    g[0, 1, where] = bad
    msg = r"g \(the log of the decay\) must be ≤ 0 and finite, got " + ("nan" if math.isnan(bad) else str(bad))
    packed = [_as_one_row(x) for x in (q, k, v, g)]
    raises_on_threads(ValueError, msg, [
        lambda: gated_linear_attention(q, k, v, g, chunk_size=64),
        lambda: gated_linear_attention(q.detach().requires_grad_(), k, v, g, chunk_size=64),
        lambda: gated_linear_attention(*packed, chunk_size=64, cu_seqlens=torch.tensor([0, 150, 200, 400]))])


@pytest.mark.parametrize("vector", [False, True])
def test_a_float64_gate_beyond_float32_is_a_full_reset_not_an_error(vector, monkeypatch):
    """A float64 g for float32 inputs is checked in Python and clamped before it is rounded: −1e300 (finite,
    below float32's range) forgets everything as on the torch-op path, and −∞ is still refused."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 70, 8, generator=gen) for _ in range(3))
    g = _gates((1, 2, 70, 8) if vector else (1, 2, 70), gen).double()
    g[0, 1, 40] = -1e300
    got = gated_linear_attention(q, k, v, g, chunk_size=32)
    want = _eager(monkeypatch, lambda: gated_linear_attention(q, k, v, g, chunk_size=32))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    ref, _ = gated_recurrence(q, k, v, g)  # the float64 recurrence: e^{−1e300} = 0
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)
    g[0, 1, 41] = float("-inf")
    with pytest.raises(ValueError, match="must be ≤ 0 and finite, got -inf"):
        gated_linear_attention(q, k, v, g, chunk_size=32)
