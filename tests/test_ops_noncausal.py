"""Non-causal linear attention and the softmax wrapper against the quadratic oracles."""

import pytest
import torch

from linattn.nn.feature_maps import make_feature_map
from linattn.ops import linear_attention, softmax_attention
from linattn.ops.linear import reference
from linattn.nn.positional import RotaryEmbedding

from .conftest import oracle

DT = torch.float64


@pytest.mark.parametrize("name", ["elu", "favor", "cosformer", "taylor", "hedgehog"])
@pytest.mark.parametrize("extras", [{}, {"rope": True, "mask": True, "state": True, "normalize": False}])
def test_noncausal_matches_oracle(name, extras):
    b, h, n, d, e = 2, 3, 1 if extras else 23, 4, 5
    g = torch.Generator().manual_seed(0)
    q, k, v = [torch.randn(b, h, n, x, dtype=DT, generator=g).requires_grad_() for x in (d, d, e)]
    fm = make_feature_map(name, d, **({"max_len": 64} if name == "cosformer" else {})).double()
    kw = dict(feature_map=fm, normalize=extras.get("normalize", True))
    if extras.get("rope"):
        kw["rope"] = RotaryEmbedding(fm.feature_dim)
    if extras.get("mask"):
        kw["key_padding_mask"] = torch.ones(b, n, dtype=torch.bool)
    state = None
    if extras.get("state"):
        state = (torch.rand(b, h, fm.feature_dim, e, dtype=DT, generator=g).requires_grad_(),
                 torch.rand(b, h, fm.feature_dim, dtype=DT, generator=g).requires_grad_())
        kw["positions"] = torch.arange(3, 3 + n)
    o, (kv, z) = linear_attention(q, k, v, causal=False, initial_state=state, return_state=True, **kw)
    ro, (rkv, rz) = oracle(q, k, v, causal=False, initial_state=state, **kw)
    torch.testing.assert_close(o, ro, atol=1e-10, rtol=1e-9)
    torch.testing.assert_close(kv, rkv)
    torch.testing.assert_close(z, rz)
    ins = [q, k, v] + ([] if state is None else list(state))
    w = torch.randn_like(o)
    got = torch.autograd.grad((o * w).sum() + kv.sum() + z.sum(), ins)
    want = torch.autograd.grad((ro * w).sum() + rkv.sum() + rz.sum(), ins)
    for a, b_ in zip(got, want):
        torch.testing.assert_close(a, b_, atol=1e-10, rtol=1e-9)


def test_noncausal_key_mask_removes_key_from_denominator():
    """A masked key contributes nothing: equal to dropping it (v zeroing alone would not be)."""
    g = torch.Generator().manual_seed(1)
    q, k, v = [torch.rand(1, 1, 6, 3, dtype=DT, generator=g) for _ in range(3)]
    mask = torch.tensor([[True, True, False, True, False, True]])
    o = linear_attention(q, k, v, causal=False, key_padding_mask=mask)
    keep = mask[0]
    o_drop = linear_attention(q, k[:, :, keep], v[:, :, keep], causal=False)
    torch.testing.assert_close(o, o_drop)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("n_q", [1, 5, 9])
def test_softmax_attention_matches_reference(causal, n_q):
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 2, n_q, 4, dtype=DT, generator=g)
    k, v = [torch.randn(2, 2, 9, 4, dtype=DT, generator=g) for _ in range(2)]
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, :3] = False  # left padding of the second sequence
    for m in (None, mask):
        o = softmax_attention(q, k, v, causal=causal, key_padding_mask=m)
        ro = reference.softmax_attention_reference(q, k, v, causal=causal, key_padding_mask=m)
        seen = ~ro.isnan().any(-1)  # rows whose query sees at least one real key
        assert seen.float().mean() > 0.5
        torch.testing.assert_close(o[seen], ro[seen])


def test_softmax_attention_decoding_against_cache_equals_last_row():
    g = torch.Generator().manual_seed(3)
    q, k, v = [torch.randn(1, 2, 12, 8, dtype=DT, generator=g) for _ in range(3)]
    full = softmax_attention(q, k, v, causal=True)
    last = softmax_attention(q[:, :, -1:], k, v, causal=True)
    torch.testing.assert_close(last, full[:, :, -1:])
