"""Feature maps: definitions, the estimates they promise, randomness handling."""

import math

import pytest
import torch

from linattn.nn.feature_maps import FEATURE_MAPS, FavorPlus, make_feature_map
from linattn.ops import linear_attention, linear_attention_step
from linattn.ops.linear import reference
from linattn.nn.positional import RotaryEmbedding

from .conftest import explicit_rotation, oracle

DT = torch.float64


@pytest.mark.parametrize("name", sorted(FEATURE_MAPS))
def test_output_dim_and_shape(name):
    fm = make_feature_map(name, 8)
    x = torch.randn(2, 3, 5, 8)
    f = fm(x, is_query=True, positions=torch.arange(5))
    assert f.shape == (2, 3, 5, fm.feature_dim)
    assert torch.isfinite(f).all()


@pytest.mark.parametrize("name", ["elu", "relu", "favor", "cosformer", "taylor", "hedgehog"])
def test_positive_maps_give_non_negative_kernels(name):
    fm = make_feature_map(name, 8, **({} if name != "relu" else {"eps": 0.0}))
    q, k = torch.randn(1, 1, 50, 8) * 2, torch.randn(1, 1, 50, 8) * 2
    kern = fm(q, is_query=True) @ fm(k, is_query=False).transpose(-1, -2)
    assert (kern >= 0).all()


def _favor_attention_error(m, orthogonal, seeds, d=16, n=128):
    """Mean relative error of FAVOR+ non-causal attention against exact softmax (Performer Fig. 4 setting)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = [torch.randn(1, 1, n, d, dtype=DT, generator=g) * 0.7 for _ in range(3)]
    exact = reference.softmax_attention_reference(q, k, v, causal=False)
    errs = []
    for s in seeds:
        fm = FavorPlus(d, m, orthogonal=orthogonal, seed=s).double()
        approx = linear_attention(q, k, v, causal=False, feature_map=fm)
        errs.append(((approx - exact) ** 2).mean().item())
    return sum(errs) / len(errs)


def test_favor_estimate_improves_with_more_features():
    errs = [_favor_attention_error(m, True, range(16)) for m in (8, 32, 128, 512)]
    assert all(a > b for a, b in zip(errs, errs[1:])), errs
    assert errs[-1] < errs[0] / 4, errs


def test_favor_orthogonal_beats_iid_at_equal_features():
    for m in (16, 32):
        ortho = _favor_attention_error(m, True, range(30))
        iid = _favor_attention_error(m, False, range(30))
        assert ortho < iid, (m, ortho, iid)


def test_favor_kernel_is_unbiased():
    """With many features (an average over many orthogonal blocks), φ(q)ᵀφ(k) (unstabilized)
    estimates exp(qᵀk/√d)."""
    d = 4
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(3, d, dtype=DT, generator=g) * 0.5, torch.randn(3, d, dtype=DT, generator=g) * 0.5
    for orthogonal in (True, False):
        fm = FavorPlus(d, 200_000, orthogonal=orthogonal, seed=0, stabilize=False).double()
        est = fm(q, is_query=True) @ fm(k, is_query=False).T
        torch.testing.assert_close(est, reference.exp_kernel(q, k), rtol=2e-2, atol=0)


def test_favor_stabilization_is_exact_in_normalized_attention():
    d = 8
    g = torch.Generator().manual_seed(2)
    q, k, v = [torch.randn(1, 2, 40, d, dtype=DT, generator=g) for _ in range(3)]
    a = linear_attention(q, k, v, causal=True, eps=0.0, feature_map=FavorPlus(d, 32, seed=3, stabilize=True).double())
    b = linear_attention(q, k, v, causal=True, eps=0.0, feature_map=FavorPlus(d, 32, seed=3, stabilize=False).double())
    torch.testing.assert_close(a, b)


def _favor_definition(fm, x):
    """φ(x) = exp(ωx − ‖x‖²/2)/√m with x scaled by D^(−1/4), in float64, from the formula."""
    xs = x.double() * fm.head_dim ** -0.25
    return torch.exp(xs @ fm.omega.double().T - 0.5 * (xs * xs).sum(-1, keepdim=True)) / math.sqrt(fm.num_features)


def _favor_rope_reference(fm, q, k, v, causal, pos):
    """Normalized attention with RoPE on the numerator features, quadratic, with no ε (the op's ε sees
    the stabilizer's constants, the definition's does not): Σ_j (R_i φ(q_i))ᵀ(R_j φ(k_j)) v_j / Σ_j φ(q_i)ᵀφ(k_j)."""
    qf, kf = _favor_definition(fm, q), _favor_definition(fm, k)
    num = explicit_rotation(qf, pos) @ explicit_rotation(kf, pos).mT
    den = qf @ kf.mT
    if causal:
        keep = torch.ones(num.shape[-2:], dtype=torch.bool).tril()
        num, den = num.masked_fill(~keep, 0), den.masked_fill(~keep, 0)
    return (num @ v) / den.sum(-1, keepdim=True)


@pytest.mark.parametrize("m", [16, 15, 40])  # odd m: RoPE leaves the last feature alone
@pytest.mark.parametrize("causal", [True, False])
def test_favor_with_rope_computes_the_favor_kernel(m, causal):
    """The stabilizer scaled feature i of queries by e^{+‖ω_i‖²/2} and of keys by e^{−‖ω_i‖²/2}, which
    RoPE (mixing feature i with i+⌊m/2⌋) did not cancel: max|o| ≈ 700 for |v| ≲ 1.5 (issue 13)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 65, 16, dtype=DT, generator=g) * 0.5 for _ in range(3))
    fm, rope, pos = make_feature_map("favor", 16, num_features=m), RotaryEmbedding(m), torch.arange(65)
    want = _favor_rope_reference(fm, q, k, v, causal, pos)
    got = linear_attention(q, k, v, causal=causal, feature_map=fm, rope=rope, eps=0.0, chunk_size=16)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    assert got.abs().max() <= 2 * v.abs().max()
    default_eps = linear_attention(q, k, v, causal=causal, feature_map=fm, rope=rope)
    torch.testing.assert_close(default_eps, want, rtol=1e-4, atol=1e-4)
    if causal:  # token by token from the recurrent step
        state, outs = None, []
        for t in range(65):
            o, state = linear_attention_step(state, q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], feature_map=fm,
                                             rope=rope, eps=0.0, positions=pos[t:t + 1])
            outs.append(o)
        torch.testing.assert_close(torch.cat(outs, 2), want, rtol=1e-9, atol=1e-9)


def test_favor_with_rope_gradients_follow_the_definition():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 23, 8, dtype=DT, generator=g).requires_grad_() for _ in range(3))
    fm, rope, pos = make_feature_map("favor", 8, num_features=12), RotaryEmbedding(12), torch.arange(23)
    w = torch.randn(1, 2, 23, 8, dtype=DT, generator=g)
    got = torch.autograd.grad((linear_attention(q, k, v, causal=True, feature_map=fm, rope=rope, eps=0.0,
                                                chunk_size=8) * w).sum(), (q, k, v))
    want = torch.autograd.grad((_favor_rope_reference(fm, q, k, v, True, pos) * w).sum(), (q, k, v))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-9)


def test_favor_stabilized_keys_cannot_overflow():
    fm = FavorPlus(16, 32, seed=0)
    big = torch.randn(1, 1, 10, 16) * 60
    assert torch.isfinite(fm(big, is_query=False)).all() and (fm(big, is_query=False) <= math.exp(30)).all()
    assert torch.isfinite(fm(big, is_query=True)).all()


def test_trig_features_estimate_the_softmax_kernel():
    d = 4
    g = torch.Generator().manual_seed(4)
    q, k = torch.randn(3, d, dtype=DT, generator=g) * 0.5, torch.randn(3, d, dtype=DT, generator=g) * 0.5
    fm = make_feature_map("trig", d, num_features=200_000, seed=0, stabilize=False).double()
    est = fm(q, is_query=True) @ fm(k, is_query=False).T
    torch.testing.assert_close(est, reference.exp_kernel(q, k), rtol=3e-2, atol=0)


def test_random_features_are_seeded_saved_and_redrawn_only_on_request():
    a, b = FavorPlus(8, 16, seed=5), FavorPlus(8, 16, seed=5)
    assert torch.equal(a.omega, b.omega)
    assert not torch.equal(a.omega, FavorPlus(8, 16, seed=6).omega)
    assert "omega" in a.state_dict()
    before = a.omega.clone()
    x = torch.randn(1, 1, 4, 8)
    a.eval()
    for _ in range(5):
        a(x, is_query=True)
    assert torch.equal(a.omega, before)
    a.redraw()
    assert not torch.equal(a.omega, before)
    b.redraw()
    assert torch.equal(a.omega, b.omega)  # the k-th draw is reproducible


def test_random_features_redraw_on_interval_in_training_only():
    fm = FavorPlus(8, 16, seed=0, redraw_interval=3).train()
    q, k, v = torch.randn(3, 1, 2, 700, 8).unbind(0)
    seen = []
    for _ in range(7):
        # one redraw tick per operator call, however many blocks the op walks and including its backward
        q.requires_grad_()
        linear_attention(q, k, v, causal=True, feature_map=fm, chunk_size=16).sum().backward()
        seen.append(fm.omega.clone())
    changes = [i for i in range(1, 7) if not torch.equal(seen[i], seen[i - 1])]
    assert changes == [3, 6]
    fm.eval()
    linear_attention(q, k, v, causal=True, feature_map=fm)
    assert torch.equal(fm.omega, seen[-1])


def test_no_redraw_between_forward_and_backward(monkeypatch):
    """The backward recomputes φ with the ω the forward used (several blocks, redraw every call)."""
    import linattn.ops.linear.chunked as chunked

    monkeypatch.setattr(chunked, "BLOCK_ELEMENTS", 256)
    fm = FavorPlus(4, 8, seed=0, redraw_interval=1).double().train()
    fm.advance_schedule()  # the next call would redraw
    q, k, v = [torch.randn(1, 2, 40, 4, dtype=DT, requires_grad=True) for _ in range(3)]
    o = linear_attention(q, k, v, causal=True, feature_map=fm, chunk_size=4)
    omega = fm.omega.clone()
    got = torch.autograd.grad(o.sum(), (q, k, v))
    assert torch.equal(fm.omega, omega)
    fm.eval()
    ro, _ = oracle(q, k, v, causal=True, feature_map=fm)
    want = torch.autograd.grad(ro.sum(), (q, k, v))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_orthogonal_blocks_and_chi_norms():
    from linattn.nn.feature_maps import orthogonal_gaussian

    w = orthogonal_gaussian(24, 8, orthogonal=True, generator=torch.Generator().manual_seed(0))
    for blk in w.split(8):
        u = blk / blk.norm(dim=1, keepdim=True)
        torch.testing.assert_close(u @ u.T, torch.eye(8, dtype=w.dtype), atol=1e-10, rtol=0)
    norms = orthogonal_gaussian(4096, 8, orthogonal=True, generator=torch.Generator().manual_seed(1)).norm(dim=1)
    assert abs((norms ** 2).mean().item() - 8) < 0.4  # chi(d)² has mean d


def test_cosformer_equals_its_quadratic_definition():
    d, n, max_len = 4, 12, 32
    g = torch.Generator().manual_seed(5)
    q, k, v = [torch.randn(1, 2, n, d, dtype=DT, generator=g) for _ in range(3)]
    fm = make_feature_map("cosformer", d, max_len=max_len)
    pos = torch.arange(n, dtype=DT)
    weight = torch.cos(math.pi * (pos[:, None] - pos[None, :]) / (2 * max_len))
    scores = (torch.relu(q) @ torch.relu(k).transpose(-1, -2)) * weight
    for causal in (True, False):
        s = scores.tril() if causal else scores
        want = (s @ v) / (s.sum(-1, keepdim=True) + 1e-6)
        got = linear_attention(q, k, v, causal=causal, feature_map=fm)
        torch.testing.assert_close(got, want)


def test_taylor_is_the_second_order_expansion_of_exp():
    d = 16
    fm = make_feature_map("taylor", d).double()
    assert fm.feature_dim == 1 + d + d * d
    g = torch.Generator().manual_seed(6)
    q, k = torch.randn(20, d, dtype=DT, generator=g), torch.randn(20, d, dtype=DT, generator=g)
    s = q @ k.T / math.sqrt(d)
    kern = fm(q, is_query=True) @ fm(k, is_query=False).T
    torch.testing.assert_close(kern, 1 + s + s ** 2 / 2)
    # and it approximates exp(s) to second order: error shrinks like |s|³ as s -> 0
    small = 1e-2
    kern_small = fm(q * small, is_query=True) @ fm(k, is_query=False).T
    s_small = s * small
    # Lagrange remainder |s|³/6·e^|s|, plus the rounding of a float64 dot product of F terms
    # (|error| ≤ F·u·Σ|a_i b_i|, u = 2⁻⁵³), which depends on the BLAS summation order
    fq, fk = fm(q * small, is_query=True), fm(k, is_query=False)
    rounding = fm.feature_dim * 2.0 ** -53 * (fq.abs() @ fk.abs().T)
    remainder = s_small.abs() ** 3 / 6 * torch.exp(s_small.abs())
    assert ((kern_small - torch.exp(s_small)).abs() <= remainder + rounding).all()
    assert (rounding < 1e-12).all()  # the bound stays far below the terms it checks at larger |s|


def test_hedgehog_is_learnable_and_spiky():
    fm = make_feature_map("hedgehog", 8)
    x = torch.randn(1, 1, 5, 8)
    f = fm(x, is_query=True)
    torch.testing.assert_close(f[..., :8].sum(-1), torch.ones(1, 1, 5))
    f[..., 0].sum().backward()
    assert fm.weight.grad is not None and fm.weight.grad.abs().sum() > 0


def test_relu_eps_keeps_denominators_positive():
    fm = make_feature_map("relu", 4, eps=1e-3)
    q, k, v = -torch.rand(1, 1, 6, 4), -torch.rand(1, 1, 6, 4), torch.rand(1, 1, 6, 4)
    o = linear_attention(q, k, v, causal=True, feature_map=fm, eps=1e-12)
    assert torch.isfinite(o).all()
    # all features equal eps: every query weighs the visible keys equally (a causal mean of v)
    want = v.cumsum(2) / torch.arange(1, 7).view(1, 1, 6, 1)
    torch.testing.assert_close(o, want, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("rows", [7, 2000])
def test_elu_plus_one_matches_torch_elu_with_gradients(rows):
    fm = make_feature_map("elu", 5).double()
    x = torch.randn(3, rows, 5, dtype=DT, requires_grad=True)
    x.data[0, 0, :3] = torch.tensor([0.0, -800.0, 60.0], dtype=DT)  # zero, underflow of exp, large positive
    with torch.no_grad():
        torch.testing.assert_close(fm(x), torch.nn.functional.elu(x) + 1, rtol=1e-15, atol=1e-15)
    torch.testing.assert_close(fm(x), torch.nn.functional.elu(x) + 1, rtol=1e-15, atol=1e-15)
    if rows == 7:
        assert torch.autograd.gradcheck(lambda t: fm(t), (x,))
