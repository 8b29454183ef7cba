"""Causality holds for NaN and Inf too: a non-finite value at token j reaches no output, and no gradient
of a loss over outputs < j, before j; a masked key slot reaches nothing, whatever it holds.

The reference for outputs and gradients before j is the float64 oracle run on the tokens before j
alone (by causality those outputs cannot depend on later tokens). Under IEEE arithmetic 0·NaN = NaN,
so a mask applied by multiplying, a product with a masked (zero) entry or a zero cotangent spread a
NaN backwards; linattn treats such zeros as absorbing (see linattn.ops.linear.chunked), and gradients of
tokens that no used output depends on are exactly 0.
"""

import pytest
import torch

from linattn.nn.feature_maps import make_feature_map
from linattn.ops import linear_attention, linear_attention_step, native
from linattn.ops.linear import reference
from linattn.nn.positional import RotaryEmbedding

from .conftest import oracle

DT = torch.float64
BAD = [float("nan"), float("inf"), -float("inf")]


def _inputs(b, h, n, d, e, positive, seed):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(b, h, n, d, dtype=DT, generator=g) for _ in range(2))
    v = torch.randn(b, h, n, e, dtype=DT, generator=g)
    if positive:
        q, k = q.abs() + 0.1, k.abs() + 0.1
    return q, k, v


def _map(name, d):
    if name == "identity":
        return {}
    opts = {"favor": {"num_features": 8}, "hedgehog": {"num_features": 3}}.get(name, {})
    fm = make_feature_map(name, d, **opts).double()
    kw = {"feature_map": fm}
    if name == "favor":
        kw["rope"] = RotaryEmbedding(fm.feature_dim)
    return kw


def _poison(x, at, value):
    """x with `value` at (0, 1, at) of every feature (q, k) or at one value column (v: column 1)."""
    x = x.clone()
    x[0, 1, at, 1 if x.shape[-1] > 1 else 0] = value
    return x


def test_the_oracle_is_causal_for_nonfinite_values():
    """The oracle used to mask by multiplying by 0, and a masked key's v still entered A·V as 0·NaN."""
    q, k, v = _inputs(1, 2, 12, 3, 4, positive=True, seed=0)
    for which in range(3):
        for value in BAD:
            x = [q, k, v]
            x[which] = _poison(x[which], 7, value)
            o, _ = reference.kernel_attention(*x, causal=True)
            want, _ = reference.kernel_attention(q[:, :, :7], k[:, :, :7], v[:, :, :7], causal=True)
            torch.testing.assert_close(o[:, :, :7], want, rtol=1e-12, atol=1e-12)
            assert not torch.isfinite(o[0, 1, 7]).all()
    mask = torch.ones(1, 12, dtype=torch.bool)
    mask[0, 4] = False
    for value in BAD + [1e300]:
        o, (kv, z) = reference.kernel_attention(q, _poison(k, 4, value), _poison(v, 4, value), causal=True,
                                                key_padding_mask=mask)
        want, (kv0, z0) = reference.kernel_attention(q, k, v, causal=True, key_padding_mask=mask)
        torch.testing.assert_close(o, want, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(kv, kv0, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", ["identity", "elu"])
@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("value", BAD)
@pytest.mark.parametrize("normalize", [True, False])
def test_nothing_before_a_nonfinite_token_changes_forward_or_backward(op_path, name, which, value, normalize):
    """Outputs before j and the gradients of a loss over them, on both CPU paths (identity and elu+1
    take the fused kernels), against the oracle on the tokens before j; gradients at j and after are 0."""
    _check_prefix(name, which, value, normalize, n=37, j=21, chunk=8)


@pytest.mark.parametrize("name", ["favor", "hedgehog"])
@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_nonfinite_values_with_rope_and_trainable_maps(name, which, monkeypatch):
    """The autograd-chained backward (RoPE, φ with parameters: Hedgehog's W gets a finite gradient too)."""
    monkeypatch.setenv("LINATTN_NATIVE", "0")
    _check_prefix(name, which, float("nan"), True, n=30, j=13, chunk=4)


@pytest.mark.parametrize("j", [0, 5, 63, 64, 100, 139])
def test_nonfinite_values_at_chunk_and_block_edges(op_path, j, monkeypatch):
    import linattn.ops.linear.chunked as chunked

    monkeypatch.setattr(chunked, "BLOCK_ELEMENTS", 512)  # several blocks on the torch-op path
    _check_prefix("elu", "v", float("nan"), True, n=140, j=j, chunk=16)


def _check_prefix(name, which, value, normalize, n, j, chunk):
    d = 4
    q, k, v = _inputs(2, 2, n, d, 3, positive=name == "identity", seed=j)
    kw = _map(name, d)
    bad = dict(q=q, k=k, v=v)
    bad[which] = _poison(bad[which], j, value)
    g = torch.Generator().manual_seed(1)
    feat = kw["feature_map"].feature_dim if "feature_map" in kw else d
    state = (torch.rand(2, 2, feat, 3, dtype=DT, generator=g), torch.rand(2, 2, feat, dtype=DT, generator=g) + 1)
    ins = [x.clone().requires_grad_() for x in (bad["q"], bad["k"], bad["v"], *state)]
    params = list(kw["feature_map"].parameters()) if "feature_map" in kw else []
    pos = torch.arange(n) + 3
    o = linear_attention(*ins[:3], causal=True, normalize=normalize, initial_state=tuple(ins[3:]), chunk_size=chunk,
                         positions=pos, **kw)
    ref_ins = [x[:, :, :j].clone().requires_grad_() for x in (q, k, v)] + [s.clone().requires_grad_() for s in state]
    want = oracle(*ref_ins[:3], causal=True, normalize=normalize, initial_state=tuple(ref_ins[3:]),
                  positions=pos[:j], **kw)[0] if j else None
    if j:
        torch.testing.assert_close(o[:, :, :j], want, rtol=1e-9, atol=1e-9)
    # the token itself sees the value (a NaN/Inf in q reaches only its own row; elu+1 maps -inf to 1)
    sees = o[0, 1, j] if which != "v" else o[0, 1, j, 1]
    if not (name == "elu" and which != "v" and value == -float("inf")):
        assert not torch.isfinite(sees).all()
    w = torch.randn(o[:, :, :j].shape, dtype=DT, generator=g)
    got = torch.autograd.grad((o[:, :, :j] * w).sum(), ins + params, allow_unused=True)
    if j:
        ref = torch.autograd.grad((want * w).sum(), ref_ins + params, allow_unused=True)
    else:
        ref = [torch.zeros_like(x[:, :, :0]) for x in ins[:3]] + [torch.zeros_like(x) for x in ins[3:] + params]
    for i, (a, r) in enumerate(zip(got, ref)):
        a = torch.zeros_like(ins[i] if i < len(ins) else params[i - len(ins)]) if a is None else a
        r = torch.zeros_like(a if i >= 3 else a[:, :, :j]) if r is None else r
        if i < 3:  # q, k, v: the oracle's gradient before j, exactly 0 from j on
            torch.testing.assert_close(a[:, :, :j], r, rtol=1e-9, atol=1e-9)
            assert (a[:, :, j:] == 0).all(), (i, a[:, :, j:])
        else:  # the initial state and φ's parameters
            torch.testing.assert_close(a, r, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("name", ["identity", "elu", "favor", "hedgehog"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), 1e30])
def test_masked_key_slots_holding_garbage_change_nothing(name, causal, value):
    """A padded slot's k and v, whatever they hold, leave outputs and gradients as zeros there would;
    the gradients of the slot itself are 0."""
    d, n = 4, 19
    q, k, v = _inputs(2, 2, n, d, 3, positive=name == "identity", seed=3)
    kw = _map(name, d)
    mask = torch.rand(2, n, generator=torch.Generator().manual_seed(2)) > 0.3
    mask[:, 0] = True
    drop = ~mask[:, None, :, None]
    kb, vb = k.masked_fill(drop, value), v.masked_fill(drop, value)
    kc, vc = k.masked_fill(~mask[:, None, :, None], 0), v.masked_fill(~mask[:, None, :, None], 0)
    ins, clean = [x.requires_grad_() for x in (q.clone(), kb, vb)], [x.requires_grad_() for x in (q.clone(), kc, vc)]
    o = linear_attention(*ins, causal=causal, key_padding_mask=mask, chunk_size=4, **kw)
    want = oracle(*clean, causal=causal, key_padding_mask=mask, **kw)[0]
    torch.testing.assert_close(o, want, rtol=1e-9, atol=1e-9)
    w = torch.randn(o.shape, dtype=DT, generator=torch.Generator().manual_seed(4))
    got = torch.autograd.grad((o * w).sum(), ins)
    ref = torch.autograd.grad((want * w).sum(), clean)
    for a, r in zip(got, ref):
        torch.testing.assert_close(a, r, rtol=1e-9, atol=1e-9)
    for a in got[1:]:
        assert (a.transpose(1, 2)[~mask] == 0).all()


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("name,dtype", [("taylor", torch.float32), ("trig", torch.float32), ("elu", torch.float16),
                                        ("favor", torch.bfloat16), ("hedgehog", torch.float16)])
def test_masked_key_slots_holding_huge_values_in_low_precision(name, dtype, causal):
    """1e30 in a padded slot overflowed φ (Taylor's and trig's squares in fp32; fp16 cannot hold it):
    Inf·0 = NaN reached every row. Now the call equals the one with zeros there, to the bit."""
    q, k, v = (torch.randn(2, 2, 11, 4, generator=torch.Generator().manual_seed(s)).to(dtype) for s in range(3))
    fm = make_feature_map(name, 4)
    mask = torch.ones(2, 11, dtype=torch.bool)
    mask[0, 3] = mask[1, 9] = False
    drop, huge = ~mask[:, None, :, None], torch.tensor(1e30).to(dtype)  # fp16: Inf
    o = linear_attention(q, k.masked_fill(drop, huge), v.masked_fill(drop, huge), causal=causal, feature_map=fm,
                         key_padding_mask=mask, chunk_size=4)
    want = linear_attention(q, k.masked_fill(drop, 0), v.masked_fill(drop, 0), causal=causal, feature_map=fm,
                            key_padding_mask=mask, chunk_size=4)
    assert torch.isfinite(want).all()
    torch.testing.assert_close(o, want, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["identity", "elu", "hedgehog"])
def test_recurrent_steps_skip_masked_garbage(name):
    """Token by token (and one block of tokens) with a key mask: a padded token's NaN / Inf / 1e30
    leaves the state and every output as a zero k, v would."""
    d, n = 4, 9
    q, k, v = _inputs(1, 2, n, d, 3, positive=name == "identity", seed=5)
    kw = _map(name, d)
    mask = torch.tensor([[True, False, True, True, False, False, True, True, False]])
    kb, vb = k.clone(), v.clone()
    kb[0, :, 1], vb[0, :, 1] = float("nan"), float("nan")
    kb[0, :, 4], vb[0, :, 4] = float("inf"), -float("inf")
    kb[0, :, 5], vb[0, :, 5] = 1e30, 1e30
    kb[0, :, 8], vb[0, :, 8] = float("nan"), 1e30
    kc, vc = k.masked_fill(~mask[:, None, :, None], 0), v.masked_fill(~mask[:, None, :, None], 0)
    want, (kv_want, z_want) = oracle(q, kc, vc, causal=True, key_padding_mask=mask, **kw)
    state, outs = None, []
    for t in range(n):
        o, state = linear_attention_step(state, q[:, :, t:t + 1], kb[:, :, t:t + 1], vb[:, :, t:t + 1],
                                         key_padding_mask=mask[:, t:t + 1], **kw)
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs, 2), want, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(state[0], kv_want, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(state[1], z_want, rtol=1e-9, atol=1e-9)
    block, _ = linear_attention_step(None, q, kb, vb, key_padding_mask=mask, **kw)
    torch.testing.assert_close(block, want, rtol=1e-9, atol=1e-9)


def test_noncausal_rows_other_than_a_nonfinite_query_are_unaffected():
    q, k, v = _inputs(1, 2, 10, 4, 3, positive=False, seed=6)
    fm = make_feature_map("elu", 4).double()
    o = linear_attention(_poison(q, 3, float("nan")), k, v, causal=False, feature_map=fm)
    want = oracle(q, k, v, causal=False, feature_map=fm)[0]
    keep = torch.ones(10, dtype=torch.bool)
    keep[3] = False
    torch.testing.assert_close(o[0, 1, keep], want[0, 1, keep], rtol=1e-12, atol=1e-12)
    assert torch.isnan(o[0, 1, 3]).all()


def test_strong_products_against_their_definition():
    """strong_bmm: Σ over the terms whose factors are both nonzero; non-finite where such a term is."""
    from linattn.ops.nonfinite import strong_bmm

    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(3, 5, 6, dtype=DT, generator=g), torch.randn(3, 6, 4, dtype=DT, generator=g)
    for t in (x, y):
        pick = torch.rand(t.shape, generator=g)
        t[pick < 0.25] = 0
        t[(pick >= 0.25) & (pick < 0.32)] = float("nan")
        t[(pick >= 0.32) & (pick < 0.36)] = float("inf")
    got = strong_bmm(x, y)
    for bi in range(3):
        for i in range(5):
            for j in range(4):
                terms = [x[bi, i, k] * y[bi, k, j] for k in range(6) if x[bi, i, k] != 0 and y[bi, k, j] != 0]
                want = sum(terms, torch.zeros((), dtype=DT))
                if torch.isfinite(want):
                    torch.testing.assert_close(got[bi, i, j], want, rtol=1e-12, atol=1e-12)
                else:
                    assert not torch.isfinite(got[bi, i, j])
    clean = torch.randn(2, 3, 4, generator=g)
    torch.testing.assert_close(strong_bmm(clean, clean.mT), torch.bmm(clean, clean.mT), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_rows_before_a_nan_keep_their_values(op_path, dtype):
    """fp32 and bf16 (fused where built): the rows before a NaN in v equal those of the same call on
    the tokens before it, and the gradients before it are the same too."""
    q, k, v = (x.to(dtype) for x in _inputs(1, 2, 150, 8, 8, positive=False, seed=8))
    fm = make_feature_map("elu", 8)
    j = 97
    vb = _poison(v, j, float("nan"))
    ins = [x.clone().requires_grad_() for x in (q, k, vb)]
    o = linear_attention(*ins, causal=True, feature_map=fm)
    cut = [x[:, :, :j].clone().requires_grad_() for x in (q, k, v)]
    want = linear_attention(*cut, causal=True, feature_map=fm)
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # the NaN sends the call to another path (ops.chunked)
    torch.testing.assert_close(o[:, :, :j].float(), want.float(), rtol=tol, atol=tol)
    assert torch.isnan(o[0, 1, j:, 1]).all() and torch.isfinite(o[0, 0]).all()
    w = torch.randn(want.shape, generator=torch.Generator().manual_seed(9)).to(dtype)
    got = torch.autograd.grad((o[:, :, :j] * w).sum(), ins)
    ref = torch.autograd.grad((want * w).sum(), cut)
    for a, r in zip(got, ref):
        torch.testing.assert_close(a[:, :, :j].float(), r.float(), rtol=tol, atol=tol * r.abs().max().item())
        assert (a[:, :, j:] == 0).all()
