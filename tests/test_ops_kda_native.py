"""KDA's fused chunked kernels (linattn_cpu::kda_chunked and kda_chunked_backward, csrc/kda.cpp) against
the float64 token-by-token recurrence (linattn.ops.delta.reference) and the torch-op path: outputs, final
states and the gradients of q, k, v, beta (up to 2), g and the initial state, at edge lengths (N = 1, N
not a multiple of the chunk, several saved blocks), K ≠ V, B·H > 1, gates of −1e30, −1e4, −90, 0 and
strong enough to cut a chunk into many row blocks, bf16, packed sequences with length-1 sequences, the
memory kept for the backward and the refusals of forward mode and double backward. Skipped where the
extension is not built."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from linattn.ops import native
from linattn.ops.delta import fused
from linattn.ops.delta.reference import delta_rule_recurrent
from linattn.ops.kda import kda

from .conftest import raises_on_threads

pytestmark = pytest.mark.skipif(not native.available() or not fused.usable(torch.zeros(1)),
                                reason="the fused CPU kernels could not be built here")

F64 = torch.float64
NAMES = ("o", "S", "dq", "dk", "dv", "dbeta", "dg", "dS0")


def inputs(b=2, h=2, n=19, d=6, e=5, dtype=F64, seed=0, gate_scale=1.0, beta_max=1.0):
    """q, k, v in dtype; beta in (0, beta_max], g ≤ 0 (B, H, N, D) and S0 in the state dtype."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(b, h, n, d, generator=gen, dtype=F64) for _ in range(2))
    v = torch.randn(b, h, n, e, generator=gen, dtype=F64)
    beta = (torch.rand(b, h, n, generator=gen, dtype=F64) * 0.99 + 0.01) * beta_max
    g = torch.nn.functional.logsigmoid(torch.randn(b, h, n, d, generator=gen, dtype=F64) + 2) * gate_scale
    S0 = torch.randn(b, h, d, e, generator=gen, dtype=F64)
    sdt = F64 if dtype == F64 else torch.float32
    return [q.to(dtype), k.to(dtype), v.to(dtype), beta.to(sdt), g.to(sdt), S0.to(sdt)]


def _weights(o_shape, S_shape, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(o_shape, generator=gen, dtype=F64), torch.randn(S_shape, generator=gen, dtype=F64)


def run(monkeypatch, path, xs, chunk=64, cu_seqlens=None, **kw):
    """(o, S, dq, dk, dv, dbeta, dg, dS0) of Σ w·o + Σ w'·S on one path ("fused", "torch" or "reference",
    the float64 recurrence on the same inputs)."""
    leaves = [x.detach().clone().requires_grad_() for x in xs]
    if path == "reference":
        o, S = delta_rule_recurrent(*(x.double() for x in leaves[:4]), g=leaves[4].double(),
                                    initial_state=leaves[5].double(), **kw)
    else:
        with monkeypatch.context() as m:
            m.setenv("LINATTN_NATIVE", "1" if path == "fused" else "0")
            o, S = kda(*leaves[:5], initial_state=leaves[5], return_state=True, chunk_size=chunk,
                       cu_seqlens=cu_seqlens, **kw)
    wo, wS = _weights(o.shape, S.shape)
    grads = torch.autograd.grad((o.double() * wo).sum() + (S.double() * wS).sum(), leaves)
    return [o.detach(), S.detach(), *grads]


def assert_close(got, want, tol, what=""):
    """Every tensor within tol of `want`, relative to the largest entry of `want` (or to 1e-3 where all are
    smaller: a gradient that cancels to ~0, e.g. through the normalization of D = 1 rows, or the state's
    after gates that clamp to e^{−80} where the recurrence gives e^{−1e4})."""
    for name, a, b in zip(NAMES, got, want):
        assert torch.isfinite(a).all(), f"{what} {name}: not finite"
        scale = max(b.double().abs().max().item(), 1e-3)
        err = (a.double() - b.double()).abs().max().item() / scale
        assert err <= tol, f"{what} {name}: relative error {err:.2e} > {tol:.0e}"


def test_the_fused_kernels_are_taken(monkeypatch):
    """A per-channel g on the CPU in fp32, fp64 and bf16 runs kda_chunked forward and its backward;
    LINATTN_NATIVE=0 runs the torch ops."""
    for dtype in (torch.float32, F64, torch.bfloat16):
        xs = inputs(n=20, dtype=dtype)
        with torch.profiler.profile() as prof:
            run(monkeypatch, "fused", xs, chunk=8, qk_l2norm=True)
        names = {e.key for e in prof.key_averages()}
        assert {"linattn_cpu::kda_chunked", "linattn_cpu::kda_chunked_backward"} <= names, dtype
    with torch.profiler.profile() as prof:
        run(monkeypatch, "torch", inputs(n=20), chunk=8, qk_l2norm=True)
    assert not any("kda_chunked" in e.key for e in prof.key_averages())


@pytest.mark.parametrize("n,chunk,d,e,bh", [(1, 64, 4, 3, (1, 1)), (19, 64, 6, 5, (2, 2)), (19, 4, 6, 5, (1, 3)),
                                            (70, 16, 5, 7, (2, 1)), (300, 32, 8, 3, (1, 2)), (9, 1, 3, 2, (2, 2)),
                                            (600, 64, 4, 4, (1, 1))])
@pytest.mark.parametrize("l2norm,scale", [(True, 0.4), (False, None)])
def test_matches_recurrence_fp64(monkeypatch, n, chunk, d, e, bh, l2norm, scale):
    """N = 1, N not a multiple of the chunk, chunks of 1, K ≠ V, B·H > 1, more than one saved block
    of 256 tokens (N = 300, 600), with and without the normalization."""
    xs = inputs(b=bh[0], h=bh[1], n=n, d=d, e=e, seed=n + chunk)
    if not l2norm:  # β‖k‖² ≤ 2 keeps the recurrence stable
        xs[1] = torch.nn.functional.normalize(xs[1], dim=-1)
    kw = dict(qk_l2norm=l2norm, scale=scale)
    assert_close(run(monkeypatch, "fused", xs, chunk, **kw), run(monkeypatch, "reference", xs, **kw), 1e-11)


@pytest.mark.parametrize("strong", [-1e30, -1e4, -200.0, -90.0])
@pytest.mark.parametrize("chunk", [64, 7])
def test_strong_gates_reset_channels_exactly(monkeypatch, strong, chunk):
    """Gates far below any useful decay at some (token, channel) places: outputs, states and every
    gradient exact and finite in fp64; the gradient of a g below the floor (−80) is 0."""
    xs = inputs(n=45, seed=3)
    g = xs[4]
    g[:, :, 15, :3] = strong
    g[:, :, 30, 2:] = strong
    g[0, 0, 44, 0] = strong
    got = run(monkeypatch, "fused", xs, chunk, qk_l2norm=True, scale=0.5)
    assert_close(got, run(monkeypatch, "reference", xs, qk_l2norm=True, scale=0.5), 1e-11, f"g={strong}")
    assert (got[6][g < -80] == 0).all()


def test_every_gate_strong_or_zero(monkeypatch):
    """g = −1e4 on every token and channel (every row a block of its own: only the current token is
    remembered) and g = 0 (DeltaNet), fp64."""
    xs = inputs(n=21, seed=5)
    for g in (torch.full_like(xs[4], -1e4), torch.zeros_like(xs[4])):
        ys = xs[:4] + [g, xs[5]]
        assert_close(run(monkeypatch, "fused", ys, 8, qk_l2norm=True), run(monkeypatch, "reference", ys, qk_l2norm=True),
                     1e-11)


@pytest.mark.parametrize("dtype,tol", [(F64, 1e-11), (torch.float32, 2e-5)])
def test_strong_decay_cuts_chunks_into_row_blocks(monkeypatch, dtype, tol):
    """Gates of about −5 per token and channel: a chunk of 64 spans ~300 in log-decay and its scores are
    formed in row blocks of a few rows (design §13.8); still the recurrence, in fp64 and fp32."""
    xs = inputs(n=200, d=16, e=8, dtype=dtype, seed=6)
    xs[4] = xs[4] - 10.0 * torch.rand(xs[4].shape, generator=torch.Generator().manual_seed(1), dtype=F64).to(xs[4].dtype)
    kw = dict(qk_l2norm=True, scale=0.25)
    assert_close(run(monkeypatch, "fused", xs, 64, **kw), run(monkeypatch, "reference", xs, **kw), tol)


def test_a_block_spanning_nearly_40_stays_fp32_exact(monkeypatch):
    """g ≈ −0.62 on every channel: a chunk of 64 decays by ~39, one row block whose factors e^{b_i − b_a}
    near its end are ~e^{−39}; their ratios (the scores of neighbouring rows, O(1)) must stay exact to
    fp32 rounding (the two-part exponent of kda.cpp's block_factors), not 39·2⁻²⁴ off."""
    xs = inputs(b=1, h=2, n=256, d=32, e=32, dtype=torch.float32, seed=3)
    xs[4] = -0.62 + 0.01 * torch.rand(xs[4].shape, generator=torch.Generator().manual_seed(2))
    ref = run(monkeypatch, "reference", [x.double() for x in xs], qk_l2norm=True)
    assert_close(run(monkeypatch, "fused", xs, 64, qk_l2norm=True), ref, 1e-6)


@pytest.mark.parametrize("beta_max", [2.0, 1.0])
def test_beta_up_to_two_and_zero(monkeypatch, beta_max):
    """β in (0, 2] (negative eigenvalues of the transition), with β = 0 and β = 2 exactly at a few tokens."""
    xs = inputs(n=50, seed=7, beta_max=beta_max)
    xs[3][:, :, 5] = 0.0
    xs[3][:, :, 17] = beta_max
    kw = dict(qk_l2norm=True, scale=0.5)
    assert_close(run(monkeypatch, "fused", xs, 16, **kw), run(monkeypatch, "reference", xs, **kw), 1e-11)


def test_fused_equals_the_torch_ops_in_float32(monkeypatch):
    """The benchmark's shape (D = E = 64, chunks of 64) over 600 tokens (3 saved blocks and a tail), K ≠ V
    in a second call: every output and gradient within fp32 rounding of the torch-op path."""
    for e in (64, 48):
        xs = inputs(b=2, h=2, n=600, d=64, e=e, dtype=torch.float32, seed=8)
        kw = dict(qk_l2norm=True, scale=0.125)
        assert_close(run(monkeypatch, "fused", xs, **kw), run(monkeypatch, "torch", xs, **kw), 2e-5, f"E={e}")


def test_bf16_is_as_close_to_float64_as_the_torch_ops(monkeypatch):
    """bf16 q, k, v (widened to fp32 inside): output and gradients as close to the float64 recurrence
    on the same rounded inputs as the torch-op path, within an output ulp; o bf16, the state float32."""
    xs = inputs(b=1, h=2, n=150, d=32, e=32, dtype=torch.bfloat16, seed=9)
    kw = dict(qk_l2norm=True, scale=0.2)
    fused_, torch_ = run(monkeypatch, "fused", xs, 32, **kw), run(monkeypatch, "torch", xs, 32, **kw)
    ref = run(monkeypatch, "reference", xs, **kw)
    assert fused_[0].dtype == torch.bfloat16 and fused_[1].dtype == torch.float32
    for name, a, b, r in zip(NAMES, fused_, torch_, ref):
        ulp = 2.0 ** -8 * r.abs().max().item()
        ea, eb = ((x.double() - r).abs().max().item() for x in (a, b))
        assert ea <= eb + ulp, (name, ea, eb, ulp)


def test_packed_sequences_with_length_one(monkeypatch):
    """cu_seqlens with sequences of length 1 (one call per sequence on the fused path): the torch path
    and the float64 recurrence of each sequence alone."""
    lengths = [1, 13, 1, 70, 7, 1]
    xs = inputs(b=1, n=sum(lengths), seed=10)
    xs[5] = torch.randn(len(lengths), 2, 6, 5, dtype=F64)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    kw = dict(qk_l2norm=True, scale=0.6)
    got = run(monkeypatch, "fused", xs, 8, cu_seqlens=cu, **kw)
    assert_close(got, run(monkeypatch, "torch", xs, 8, cu_seqlens=cu, **kw), 1e-11, "packed vs torch ops")
    leaves = [x.detach().clone().requires_grad_() for x in xs]
    outs, states = [], []
    for i in range(len(lengths)):
        s, t = int(cu[i]), int(cu[i + 1])
        o, S = delta_rule_recurrent(*(x[:, :, s:t] for x in leaves[:4]), g=leaves[4][:, :, s:t],
                                    initial_state=leaves[5][i:i + 1], **kw)
        outs.append(o)
        states.append(S)
    o, S = torch.cat(outs, 2), torch.cat(states, 0)
    wo, wS = _weights(o.shape, S.shape)
    ref = [o.detach(), S.detach(), *torch.autograd.grad((o * wo).sum() + (S * wS).sum(), leaves)]
    assert_close(got, ref, 1e-11, "packed vs recurrence")


@settings(max_examples=12, deadline=None)
@given(n=st.integers(1, 80), chunk=st.integers(1, 40), d=st.integers(1, 9), e=st.integers(1, 6),
       bh=st.sampled_from([(1, 1), (2, 1), (1, 3)]), seed=st.integers(0, 10_000),
       strength=st.sampled_from([0.0, 1.0, 8.0, 60.0]), beta_max=st.sampled_from([1.0, 2.0]))
def test_property_fused_matches_recurrence(n, chunk, d, e, bh, seed, strength, beta_max):
    """Random lengths, chunks, widths, gate strengths (none, mild, a few row blocks per chunk, a block
    per row) and β up to 2, fp64."""
    with pytest.MonkeyPatch.context() as mp:
        xs = inputs(b=bh[0], h=bh[1], n=n, d=d, e=e, seed=seed, gate_scale=max(strength, 1.0), beta_max=beta_max)
        if strength == 0.0:
            xs[4] = torch.zeros_like(xs[4])
        kw = dict(qk_l2norm=True, scale=0.7)
        assert_close(run(mp, "fused", xs, chunk, **kw), run(mp, "reference", xs, **kw), 1e-10)


def test_backward_keeps_one_state_per_block(monkeypatch):
    """Saved for the backward: the inputs and one state per 256 tokens (nothing of size N·D·E or N·C)."""
    xs = inputs(b=1, h=2, n=1000, d=16, e=16, dtype=torch.float32, seed=11)
    leaves = [x.clone().requires_grad_() for x in xs]
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    monkeypatch.setenv("LINATTN_NATIVE", "1")
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        kda(*leaves[:5], initial_state=leaves[5], qk_l2norm=True)
    inputs_numel = sum(x.numel() for x in xs[:5])
    blocks = 2 * 4 * 16 * 16  # B·H·⌈1000/256⌉·D·E
    assert sum(saved) <= inputs_numel + blocks, (saved, inputs_numel, blocks)


def test_forward_mode_and_double_backward_are_refused(monkeypatch):
    """The fused path keeps the delta family's refusals (linattn.ops.autodiff), naming KDA."""
    monkeypatch.setenv("LINATTN_NATIVE", "1")
    q, k, v, beta, g, S0 = inputs(n=12, dtype=torch.float32)
    with torch.autograd.forward_ad.dual_level():
        dual = torch.autograd.forward_ad.make_dual(q, torch.ones_like(q))
        with pytest.raises(NotImplementedError, match="KDA"):
            kda(dual, k, v, beta, g, qk_l2norm=True)
    qq = q.clone().requires_grad_()
    o = kda(qq, k, v, beta, g, qk_l2norm=True)
    (dq,) = torch.autograd.grad(o.sum(), qq, create_graph=False)
    assert torch.isfinite(dq).all()
    o = kda(qq, k, v, beta, g, qk_l2norm=True)
    with pytest.raises(RuntimeError, match="KDA.*not twice differentiable"):
        torch.autograd.grad(o.sum(), qq, create_graph=True)


def test_the_kernels_name_bad_shapes():
    q = torch.zeros(1, 2, 5, 4)
    beta, S0 = torch.ones(1, 2, 5), torch.zeros(1, 2, 4, 4)
    with pytest.raises(RuntimeError, match="kda_chunked: beta must be .B, H, N. and g .B, H, N, D."):
        torch.ops.linattn_cpu.kda_chunked(q, q, q, beta, q[..., 0], S0, 1.0, False, 8, False)
    with pytest.raises(RuntimeError, match="kda_chunked expects q, k"):
        torch.ops.linattn_cpu.kda_chunked(q, q[..., :3], q, beta, q, S0, 1.0, False, 8, False)
    with pytest.raises(RuntimeError, match="the saved block states do not match"):
        torch.ops.linattn_cpu.kda_chunked_backward(q, q, q, beta, q, torch.zeros(3), q, None, 1.0, False, 8)


@pytest.mark.parametrize("bad", [0.3, float("nan"), float("-inf"), float("inf")])
@pytest.mark.parametrize("where", [0, 7, 8, 18])
def test_the_kernel_checks_every_gate_it_reads(bad, where):
    """The chunked kernel checks the per-channel g as it reads it (no separate pass over B·H·N·D values):
    one value out of range in any chunk raises delta_rule's ValueError, with or without a gradient,
    packed or not, on 1 and 2 threads."""
    q, k, v, beta, g, S0 = inputs(dtype=torch.float32)
    g[1, 0, where, 3] = bad
    msg = r"g must be a finite log-decay ≤ 0 \(α = e\^g in \(0, 1\]\), got " + ("nan" if bad != bad else str(bad))
    rows = [x.reshape(1, 1, 2 * 2 * 19, *x.shape[3:]) for x in (q, k, v, beta, g)]  # 4 sequences
    raises_on_threads(ValueError, msg, [
        lambda: kda(q, k, v, beta, g, initial_state=S0, chunk_size=8),
        lambda: kda(q.clone().requires_grad_(), k, v, beta, g, initial_state=S0, chunk_size=8),
        lambda: kda(*rows, chunk_size=8, cu_seqlens=torch.arange(0, 77, 19))])


def test_a_float64_gate_beyond_float32_is_a_full_reset_not_an_error():
    """KDA's float64 g for float32 inputs: −1e300 is checked and clamped before rounding (it resets the
    channel, as −1e30 does), −∞ is still refused."""
    q, k, v, beta, g, S0 = inputs(dtype=torch.float32)
    g = g.double()
    g[0, 1, 5, 2] = -1e300
    got = kda(q, k, v, beta, g, initial_state=S0, chunk_size=8)
    g30 = g.clone()
    g30[0, 1, 5, 2] = -1e30
    torch.testing.assert_close(got, kda(q, k, v, beta, g30, initial_state=S0, chunk_size=8), rtol=0, atol=0)
    ref, _ = delta_rule_recurrent(q.double(), k.double(), v.double(), beta.double(), g=g, initial_state=S0.double())
    torch.testing.assert_close(got.double(), ref, rtol=2e-5, atol=2e-5)  # the float64 recurrence, e^{−1e300} = 0
    g[0, 1, 6, 2] = float("-inf")
    with pytest.raises(ValueError, match="g must be a finite log-decay ≤ 0"):
        kda(q, k, v, beta, g, initial_state=S0, chunk_size=8)
