"""Recurrent form and state passing: token-by-token steps and split sequences equal one call."""

import pytest
import torch

from linattn.nn.feature_maps import make_feature_map
from linattn.ops import linear_attention, linear_attention_step
from linattn.nn.positional import RotaryEmbedding

DT = torch.float64


def _qkv(b, h, n, d, e, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, n, x, dtype=DT, generator=g) for x in (d, d, e)]


@pytest.mark.parametrize("name", ["elu", "relu", "favor", "cosformer", "taylor", "hedgehog"])
@pytest.mark.parametrize("use_rope", [False, True])
def test_steps_reproduce_chunked_output(name, use_rope):
    b, h, n, d, e = 2, 2, 19, 4, 3
    fm = make_feature_map(name, d, **({"max_len": 64} if name == "cosformer" else {})).double()
    rope = RotaryEmbedding(fm.feature_dim) if use_rope else None
    q, k, v = _qkv(b, h, n, d, e, seed=1)
    o, (kv, z) = linear_attention(q, k, v, causal=True, feature_map=fm, rope=rope, chunk_size=5, return_state=True)
    state = None
    for t in range(n):
        ot, state = linear_attention_step(state, q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], feature_map=fm,
                                          rope=rope, positions=torch.tensor([t]))
        torch.testing.assert_close(ot, o[:, :, t:t + 1], atol=1e-10, rtol=1e-9)
    torch.testing.assert_close(state[0], kv, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(state[1], z, atol=1e-10, rtol=1e-10)


def test_step_accepts_a_block_of_tokens():
    q, k, v = _qkv(1, 3, 12, 4, 4, seed=2)
    fm = make_feature_map("elu", 4).double()
    o = linear_attention(q, k, v, causal=True, feature_map=fm)
    o1, st = linear_attention_step(None, q[:, :, :5], k[:, :, :5], v[:, :, :5], feature_map=fm)
    o2, st = linear_attention_step(st, q[:, :, 5:], k[:, :, 5:], v[:, :, 5:], feature_map=fm)
    torch.testing.assert_close(torch.cat([o1, o2], 2), o, atol=1e-12, rtol=1e-10)


def test_step_does_not_modify_the_state():
    q, k, v = _qkv(1, 1, 1, 3, 3, seed=3)
    kv, z = torch.rand(1, 1, 3, 3, dtype=DT), torch.rand(1, 1, 3, dtype=DT)
    before = (kv.clone(), z.clone())
    linear_attention_step((kv, z), q.abs(), k.abs(), v)
    assert torch.equal(kv, before[0]) and torch.equal(z, before[1])


def test_step_from_a_non_contiguous_state():
    """A state held as a transposed view (B·H > 1, F ≠ E) gives the step the same numbers."""
    q, k, v = _qkv(2, 3, 1, 5, 7, seed=6)
    fm = make_feature_map("elu", 5).double()
    kv_t, z = torch.rand(2, 3, 7, 5, dtype=DT), torch.rand(2, 3, 5, dtype=DT)
    kv = kv_t.transpose(-1, -2)
    assert not kv.is_contiguous()
    o, (kv1, z1) = linear_attention_step((kv, z), q, k, v, feature_map=fm)
    o_ref, (kv_ref, z_ref) = linear_attention(q, k, v, causal=True, feature_map=fm, initial_state=(kv.contiguous(), z),
                                              return_state=True)
    torch.testing.assert_close(o, o_ref, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(kv1, kv_ref, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(z1, z_ref, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("split", [1, 7, 16, 30])
@pytest.mark.parametrize("name", ["elu", "cosformer"])
def test_split_sequence_with_state_equals_one_call(split, name):
    """Outputs and gradients of q, k, v are the same whether the sequence runs in one call or two."""
    b, h, n, d, e = 2, 2, 31, 4, 5
    fm = make_feature_map(name, d, **({"max_len": 64} if name == "cosformer" else {})).double()
    rope = RotaryEmbedding(fm.feature_dim)
    q, k, v = _qkv(b, h, n, d, e, seed=4)
    # keep relu-based features away from all-zero rows (tiny denominators amplify rounding)
    q, k, v = [x.requires_grad_() for x in (q.abs() + 0.2, k.abs() + 0.2, v)]
    w = torch.randn(b, h, n, e, dtype=DT)
    o = linear_attention(q, k, v, causal=True, feature_map=fm, rope=rope, chunk_size=8)
    g_full = torch.autograd.grad((o * w).sum(), (q, k, v))
    o1, st = linear_attention(q[:, :, :split], k[:, :, :split], v[:, :, :split], causal=True, feature_map=fm,
                              rope=rope, chunk_size=8, return_state=True)
    o2 = linear_attention(q[:, :, split:], k[:, :, split:], v[:, :, split:], causal=True, feature_map=fm, rope=rope,
                          chunk_size=8, initial_state=st, positions=torch.arange(split, n))
    o_split = torch.cat([o1, o2], 2)
    g_split = torch.autograd.grad((o_split * w).sum(), (q, k, v))
    torch.testing.assert_close(o_split, o, atol=1e-12, rtol=1e-10)
    for a, b_ in zip(g_split, g_full):
        torch.testing.assert_close(a, b_, atol=1e-11, rtol=1e-9)


def test_fp32_state_for_low_precision_inputs():
    q, k, v = [x.to(torch.bfloat16) for x in _qkv(1, 2, 9, 4, 4, seed=5)]
    fm = make_feature_map("elu", 4)
    _, (kv, z) = linear_attention(q, k, v, causal=True, feature_map=fm, return_state=True)
    assert kv.dtype == torch.float32 and z.dtype == torch.float32
    o, (kv2, z2) = linear_attention_step((kv, z), q[:, :, :1], k[:, :, :1], v[:, :, :1], feature_map=fm)
    assert o.dtype == torch.bfloat16 and kv2.dtype == torch.float32 and z2.dtype == torch.float32


def test_state_size_is_independent_of_length():
    fm = make_feature_map("elu", 4)
    sizes = set()
    for n in (1, 50, 400):
        q, k, v = [x.float() for x in _qkv(1, 2, n, 4, 3, seed=n)]
        _, (kv, z) = linear_attention(q, k, v, causal=True, feature_map=fm, return_state=True)
        sizes.add((kv.shape, z.shape))
    assert sizes == {((1, 2, 4, 3), (1, 2, 4))}
