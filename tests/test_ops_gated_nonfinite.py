"""Causality of gated linear attention holds for NaN and Inf too: a non-finite value at token j reaches no
output before j, and no gradient of a loss over outputs < j (q, k, v and g before j, the initial state,
φ's parameters); a masked key slot reaches nothing, whatever it holds.

The reference is the float64 recurrence (linattn.ops.gated.reference) run on the tokens before j alone:
by causality those outputs cannot depend on later tokens. The gradients of the tokens from j on, which
no output in the loss depends on, are exactly 0.
"""

import pytest
import torch

from linattn.nn.feature_maps import EluPlusOne, make_feature_map
from linattn.ops import gated_linear_attention

from .test_ops_gated import _one_thread, oracle  # noqa: F401  (fixture: one thread)

DT = torch.float64
BAD = [float("nan"), float("inf"), -float("inf")]


def _inputs(n, f, e, *, vector, positive, seed, dtype=DT):
    """q, k (2, 2, n, f), v (2, 2, n, e), g ≤ 0 (scalar or per feature) and a (kv, z) state."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(2, 2, n, f, generator=gen, dtype=DT) for _ in range(2))
    v = torch.randn(2, 2, n, e, generator=gen, dtype=DT)
    if positive:
        q, k = q.abs() + 0.1, k.abs() + 0.1
    g = -torch.rand(2, 2, n, *((f,) if vector else ()), generator=gen, dtype=DT)
    state = (torch.randn(2, 2, f, e, generator=gen, dtype=DT), torch.rand(2, 2, f, generator=gen, dtype=DT) + 1)
    return [x.to(dtype) for x in (q, k, v, g)], state


def _poison(x, at, value):
    """x with `value` at (0, 1, at) in one feature (q, k) or value column (v)."""
    x = x.clone()
    x[0, 1, at, 1] = value
    return x


def _check_prefix(fm, which, value, *, vector, normalize, n, j, chunk, positive=False):
    feat = 4 if fm is None else fm.feature_dim
    (q, k, v, g), (kv0, z0) = _inputs(n, 4, 3, vector=vector, positive=positive, seed=j)
    if vector and feat != 4:
        g = g[..., :1].expand(2, 2, n, feat).contiguous()
    kv0, z0 = kv0[:, :, :1].expand(2, 2, feat, 3).contiguous(), z0[:, :, :1].expand(2, 2, feat).contiguous()
    bad = dict(q=q, k=k, v=v)
    bad[which] = _poison(bad[which], j, value)
    state = (kv0, z0) if normalize else kv0
    states = list(state) if normalize else [state]
    ins = [x.clone().requires_grad_() for x in (bad["q"], bad["k"], bad["v"], g, *states)]
    st0 = tuple(ins[4:]) if normalize else ins[4]
    params = [] if fm is None else [p for p in fm.parameters() if p.requires_grad]
    o = gated_linear_attention(*ins[:4], feature_map=fm, normalize=normalize, initial_state=st0, chunk_size=chunk)
    ref_ins = [x[:, :, :j].clone().requires_grad_() for x in (q, k, v, g)] + [s.clone().requires_grad_() for s in states]
    ref_st0 = tuple(ref_ins[4:]) if normalize else ref_ins[4]
    want = oracle(*ref_ins[:4], fm, normalize=normalize, initial_state=ref_st0)[0] if j else None
    if j:
        torch.testing.assert_close(o[:, :, :j], want, rtol=1e-9, atol=1e-9)
    # the token itself sees the value (NaN/Inf in q reaches its own row only; elu+1 maps -inf to 0)
    if not (fm is not None and which != "v" and value == -float("inf")):
        assert not torch.isfinite(o[0, 1, j]).all()
    w = torch.randn(o[:, :, :j].shape, dtype=DT, generator=torch.Generator().manual_seed(1))
    got = torch.autograd.grad((o[:, :, :j] * w).sum(), ins + params, allow_unused=True)
    if j:
        ref = torch.autograd.grad((want * w).sum(), ref_ins + params, allow_unused=True)
    else:
        ref = [None] * len(got)
    for i, (a, r) in enumerate(zip(got, ref)):
        like = ins[i] if i < len(ins) else params[i - len(ins)]
        a = torch.zeros_like(like) if a is None else a
        if i < 4:  # q, k, v, g: the reference's gradient before j, exactly 0 from j on
            r = torch.zeros_like(a[:, :, :j]) if r is None else r
            torch.testing.assert_close(a[:, :, :j], r, rtol=1e-9, atol=1e-9)
            assert (a[:, :, j:] == 0).all(), (i, a[:, :, j:])
        else:  # the initial state and φ's parameters
            torch.testing.assert_close(a, torch.zeros_like(a) if r is None else r, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("elu", [False, True])
@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("value", BAD)
@pytest.mark.parametrize("vector", [False, True])
@pytest.mark.parametrize("normalize", [False, True])
def test_nothing_before_a_nonfinite_token_changes_forward_or_backward(op_path, elu, which, value, vector, normalize):
    """Both CPU paths (identity and elu+1 take the fused kernels), scalar and vector gates."""
    fm = EluPlusOne(4).double() if elu else None
    _check_prefix(fm, which, value, vector=vector, normalize=normalize, n=37, j=21, chunk=8, positive=not elu)


@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("vector", [False, True])
def test_nonfinite_values_with_a_trainable_map(which, vector):
    """The autograd-chained backward (Hedgehog: its W gets the reference's gradient too)."""
    fm = make_feature_map("hedgehog", 4, num_features=3).double()
    _check_prefix(fm, which, float("nan"), vector=vector, normalize=True, n=30, j=13, chunk=4)


@pytest.mark.parametrize("j", [0, 5, 63, 64, 100, 139])
@pytest.mark.parametrize("vector", [False, True])
def test_nonfinite_values_at_chunk_and_block_edges(op_path, j, vector, monkeypatch):
    import linattn.ops.linear.chunked as chunked

    monkeypatch.setattr(chunked, "BLOCK_ELEMENTS", 512)  # several blocks and segments on the torch-op path
    monkeypatch.setattr("linattn.ops.gated.chunked.BLOCK_ELEMENTS", 512)
    _check_prefix(EluPlusOne(4).double(), "v", float("nan"), vector=vector, normalize=True, n=140, j=j, chunk=16)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 1e30])
@pytest.mark.parametrize("vector", [False, True])
@pytest.mark.parametrize("name", ["identity", "elu", "hedgehog"])
def test_masked_key_slots_holding_garbage_change_nothing(name, vector, value):
    """A padded slot's k and v, whatever they hold, leave outputs, final state and gradients as zeros
    there would; the gradients of the slot's k and v are 0."""
    n = 19
    (q, k, v, g), _ = _inputs(n, 4, 3, vector=vector, positive=name == "identity", seed=3)
    fm = None if name == "identity" else make_feature_map(name, 4, **({"num_features": 2} if name == "hedgehog"
                                                                      else {})).double()
    mask = torch.rand(2, n, generator=torch.Generator().manual_seed(2)) > 0.3
    mask[:, 0] = True
    drop = ~mask[:, None, :, None]
    ins = [x.requires_grad_() for x in (q.clone(), k.masked_fill(drop, value), v.masked_fill(drop, value), g.clone())]
    clean = [x.requires_grad_() for x in (q.clone(), k.masked_fill(drop, 0), v.masked_fill(drop, 0), g.clone())]
    o, (kv, z) = gated_linear_attention(*ins, feature_map=fm, normalize=True, key_padding_mask=mask, chunk_size=4,
                                        return_state=True)
    want, (kv_w, z_w) = oracle(*clean, fm, normalize=True, key_padding_mask=mask)
    for a, r in ((o, want), (kv, kv_w), (z, z_w)):
        torch.testing.assert_close(a, r, rtol=1e-9, atol=1e-9)
    w = torch.randn(o.shape, dtype=DT, generator=torch.Generator().manual_seed(4))
    got = torch.autograd.grad((o * w).sum() + kv.sum(), ins)
    ref = torch.autograd.grad((want * w).sum() + kv_w.sum(), clean)
    for a, r in zip(got, ref):
        torch.testing.assert_close(a, r, rtol=1e-9, atol=1e-9)
    for a in got[1:3]:
        assert (a.transpose(1, 2)[~mask] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vector", [False, True])
def test_low_precision_rows_before_a_nan_keep_their_values(op_path, dtype, vector):
    """fp32 and bf16 (fused where built): the rows before a NaN in v equal those of the same call on
    the tokens before it, and so do the gradients before it; those after it are 0."""
    (q, k, v, g), _ = _inputs(150, 8, 8, vector=vector, positive=False, seed=8, dtype=dtype)
    g = g.float()
    fm = make_feature_map("elu", 8)
    j = 97
    ins = [x.clone().requires_grad_() for x in (q, k, _poison(v, j, float("nan")), g)]
    o = gated_linear_attention(*ins, feature_map=fm)
    cut = [x[:, :, :j].clone().requires_grad_() for x in (q, k, v, g)]
    want = gated_linear_attention(*cut, feature_map=fm)
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # the NaN sends the call to another path (the exact pass)
    # unnormalized outputs reach ~80: bf16 rounds them by up to 0.25, relative to the largest
    torch.testing.assert_close(o[:, :, :j].float(), want.float(), rtol=tol, atol=tol * want.abs().max().item())
    assert torch.isnan(o[0, 1, j:, 1]).all() and torch.isfinite(o[0, 0]).all()
    w = torch.randn(want.shape, generator=torch.Generator().manual_seed(9)).to(dtype)
    got = torch.autograd.grad((o[:, :, :j] * w).sum(), ins)
    ref = torch.autograd.grad((want * w).sum(), cut)
    for a, r in zip(got, ref):
        torch.testing.assert_close(a[:, :, :j].float(), r.float(), rtol=tol, atol=tol * max(1.0, r.abs().max().item()))
        assert (a[:, :, j:] == 0).all()
