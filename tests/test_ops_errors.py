"""Bad input gets a ValueError / TypeError that names the argument, the expected and the actual value."""

import pytest
import torch

from linattn.nn.feature_maps import make_feature_map
from linattn.ops import linear_attention, linear_attention_step, softmax_attention
from linattn.nn.positional import RotaryEmbedding


def qkv(b=1, h=2, n=8, d=4, e=4, dtype=torch.float32):
    return torch.rand(b, h, n, d, dtype=dtype), torch.rand(b, h, n, d, dtype=dtype), torch.rand(b, h, n, e, dtype=dtype)


def test_wrong_rank():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"q must have 4 dimensions.*got shape \(2, 8, 4\)"):
        linear_attention(q[0], k, v, causal=True)


def test_not_a_tensor():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="v must be a torch.Tensor, got list"):
        linear_attention(q, k, [1, 2], causal=True)


def test_mismatched_batch_heads_and_lengths():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"k batch and heads.*\(1, 2\).*\(1, 3\)"):
        linear_attention(q, torch.rand(1, 3, 8, 4), v, causal=True)
    with pytest.raises(ValueError, match="v must have the same sequence length as k"):
        linear_attention(q, k, torch.rand(1, 2, 7, 4), causal=False)
    with pytest.raises(ValueError, match="causal linear attention needs q and k of equal length"):
        linear_attention(q[:, :, :5], k, v, causal=True)
    with pytest.raises(ValueError, match="k head dim must equal q's"):
        linear_attention(q, torch.rand(1, 2, 8, 3), v, causal=True)


def test_mismatched_dtype_and_device():
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"k.dtype must equal q.dtype \(torch.float32\), got torch.float64"):
        linear_attention(q, k.double(), v, causal=True)
    with pytest.raises(ValueError, match="v must be on q's device"):
        linear_attention(q, k, v.to("meta"), causal=True)
    with pytest.raises(TypeError, match="q must be a floating tensor"):
        linear_attention(q.long(), k.long(), v.long(), causal=True)


def test_state_feature_dim_mismatch():
    q, k, v = qkv()
    fm = make_feature_map("cosformer", 4, max_len=64)  # F = 8
    bad = (torch.zeros(1, 2, 4, 4), torch.zeros(1, 2, 4))
    with pytest.raises(ValueError, match=r"F of the state 4 != F of the features 8"):
        linear_attention(q, k, v, causal=True, feature_map=fm, initial_state=bad, positions=torch.arange(8))
    with pytest.raises(ValueError, match=r"z must have shape \(B, H, F\)"):
        linear_attention(q, k, v, causal=True, initial_state=(torch.zeros(1, 2, 4, 4), torch.zeros(1, 2, 5)))
    with pytest.raises(TypeError, match="initial_state must be a tuple"):
        linear_attention(q, k, v, causal=True, initial_state=torch.zeros(3))


@pytest.mark.parametrize("chunk", [0, -4, 2.5, True])
def test_bad_chunk_size(chunk):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=f"chunk_size must be a positive int, got {chunk!r}"):
        linear_attention(q, k, v, causal=True, chunk_size=chunk)


def test_bad_mask():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"key_padding_mask must have shape \(B, N\) = \(1, 8\), got \(1, 7\)"):
        linear_attention(q, k, v, causal=True, key_padding_mask=torch.ones(1, 7, dtype=torch.bool))
    with pytest.raises(TypeError, match="key_padding_mask must be a bool tensor"):
        linear_attention(q, k, v, causal=True, key_padding_mask=torch.ones(1, 8))
    with pytest.raises(ValueError, match="key_padding_mask must have shape"):
        softmax_attention(q, k, v, causal=True, key_padding_mask=torch.ones(2, 8, dtype=torch.bool))


def test_cosformer_position_beyond_max_len():
    q, k, v = qkv(n=8)
    fm = make_feature_map("cosformer", 4, max_len=8)
    linear_attention(q, k, v, causal=True, feature_map=fm)  # positions 0..7 fit
    with pytest.raises(ValueError, match=r"positions must lie in \[0, max_len=8\), got range \[5, 12\]"):
        linear_attention(q, k, v, causal=True, feature_map=fm, positions=torch.arange(5, 13))


def test_positions_required_when_resuming_with_positional_features():
    q, k, v = qkv()
    fm = make_feature_map("cosformer", 4, max_len=64)
    _, st = linear_attention(q, k, v, causal=True, feature_map=fm, return_state=True)
    with pytest.raises(ValueError, match="positions are required"):
        linear_attention(q, k, v, causal=True, feature_map=fm, initial_state=st)
    with pytest.raises(ValueError, match="positions"):
        linear_attention_step(st, q[:, :, :1], k[:, :, :1], v[:, :, :1], feature_map=fm)


def test_bad_positions_shape_and_rope_dim():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"positions must have shape \(N,\)"):
        linear_attention(q, k, v, causal=True, rope=RotaryEmbedding(4), positions=torch.arange(9))
    with pytest.raises(ValueError, match="rope dim must equal the feature dim F=4, got 6"):
        linear_attention(q, k, v, causal=True, rope=RotaryEmbedding(6))


def test_feature_map_head_dim_mismatch_and_unknown_name():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="feature_map expects head dim 6, q/k have 4"):
        linear_attention(q, k, v, causal=True, feature_map=make_feature_map("elu", 6))
    with pytest.raises(ValueError, match="unknown feature map 'softplus'"):
        make_feature_map("softplus", 4)
    with pytest.raises(TypeError, match="bad options for feature map 'elu'"):
        make_feature_map("elu", 4, num_features=3)
    with pytest.raises(ValueError, match="num_features must be a positive int"):
        make_feature_map("favor", 4, num_features=0)


def test_empty_sequence():
    q, k, v = qkv(n=0)
    with pytest.raises(ValueError, match="at least one token"):
        linear_attention(q, k, v, causal=True)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("native_env", ["1", "0"])
def test_zero_sized_dims_are_refused(monkeypatch, causal, native_env):
    """D = 0 or E = 0 once gave uninitialized memory (fused path) or a bare reshape error (torch ops)."""
    monkeypatch.setenv("LINATTN_NATIVE", native_env)
    x = torch.rand(1, 2, 8, 4)
    with pytest.raises(ValueError, match=r"q and k must have a head dim D >= 1, got shape \(1, 2, 8, 0\)"):
        linear_attention(x[..., :0], x[..., :0], x, causal=causal)
    with pytest.raises(ValueError, match=r"v must have a value dim E >= 1, got shape \(1, 2, 8, 0\)"):
        linear_attention(x, x, x[..., :0], causal=causal)
    with pytest.raises(ValueError, match=r"q, k, v must have batch B >= 1 and heads H >= 1, got shape \(0, 2, 8, 4\)"):
        linear_attention(x[:0], x[:0], x[:0], causal=causal)
    with pytest.raises(ValueError, match=r"v must have a value dim E >= 1"):
        linear_attention_step(None, x[:, :, :1], x[:, :, :1], x[:, :, :1, :0])


@pytest.mark.parametrize("bad", [-1e-6, float("nan"), float("inf"), "1e-6", None, True])
def test_bad_eps_is_refused(bad):
    q, k, v = qkv()
    error = TypeError if isinstance(bad, (str, bool)) or bad is None else ValueError
    with pytest.raises(error, match=f"eps must be a finite float >= 0, got {bad!r}"):
        linear_attention(q, k, v, causal=True, eps=bad)
    with pytest.raises(error, match="eps must be a finite float >= 0"):
        linear_attention(q, k, v, causal=False, eps=bad)
    with pytest.raises(error, match="eps must be a finite float >= 0"):
        linear_attention_step(None, q[:, :, :1], k[:, :, :1], v[:, :, :1], eps=bad)
    with pytest.raises(error, match="eps must be a finite float >= 0"):
        make_feature_map("relu", 4, eps=bad)


def test_flags_must_be_bools():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="causal must be a bool, got str 'False'"):
        linear_attention(q, k, v, causal="False")
    with pytest.raises(TypeError, match="normalize must be a bool, got int 0"):
        linear_attention(q, k, v, causal=True, normalize=0)
    with pytest.raises(TypeError, match="return_state must be a bool, got NoneType None"):
        linear_attention(q, k, v, causal=True, return_state=None)
    with pytest.raises(TypeError, match="normalize must be a bool"):
        linear_attention_step(None, q[:, :, :1], k[:, :, :1], v[:, :, :1], normalize="yes")
    with pytest.raises(TypeError, match="causal must be a bool, got str 'False'"):
        softmax_attention(q, k, v, causal="False")


@pytest.mark.parametrize("dtype,state", [(torch.float32, torch.bfloat16), (torch.float32, torch.float64),
                                         (torch.bfloat16, torch.bfloat16), (torch.float64, torch.float32)])
def test_state_of_the_wrong_dtype_is_refused(dtype, state):
    """The state is float32 (float64 for float64 inputs): a bf16 state would accumulate in bf16."""
    q, k, v = qkv(dtype=dtype)
    st = (torch.zeros(1, 2, 4, 4, dtype=state), torch.zeros(1, 2, 4, dtype=state))
    want = torch.float64 if dtype == torch.float64 else torch.float32
    msg = rf"initial_state must be \(kv, z\) in {want} for {dtype} inputs, got kv {state} and z {state}"
    with pytest.raises(TypeError, match=msg):
        linear_attention_step(st, q[:, :, :1], k[:, :, :1], v[:, :, :1])
    with pytest.raises(TypeError, match=msg):
        linear_attention(q, k, v, causal=True, initial_state=st)


_HUGE_CHUNK = """
import torch
from linattn.nn.feature_maps import make_feature_map
from linattn.ops import linear_attention
torch.manual_seed(0)
q = torch.rand(1, 2, 70, 8)
for fm in (None, make_feature_map("elu", 8)):
    want = linear_attention(q, q, q, causal=True, feature_map=fm, chunk_size=70)
    for chunk in (2**31, 2**62):
        o = linear_attention(q, q, q, causal=True, feature_map=fm, chunk_size=chunk)
        torch.testing.assert_close(o, want)
        qg = q.clone().requires_grad_()
        linear_attention(qg, qg, qg, causal=True, feature_map=fm, chunk_size=chunk).sum().backward()
        assert torch.isfinite(qg.grad).all()
from linattn.ops import gated_linear_attention
g = -torch.rand(1, 2, 70, 8)
for gates in (g[..., 0], g):
    want = gated_linear_attention(q, q, q, gates, feature_map=make_feature_map("elu", 8), chunk_size=70)
    for chunk in (2**31, 2**62):
        qg = q.clone().requires_grad_()
        o = gated_linear_attention(qg, qg, qg, gates, feature_map=make_feature_map("elu", 8), chunk_size=chunk)
        torch.testing.assert_close(o, want)
        o.sum().backward()
        assert torch.isfinite(qg.grad).all()
from linattn.ops import native
if native.available():  # the kernels themselves clamp the chunk too
    st = (torch.zeros(1, 2, 8, 8), torch.zeros(1, 2, 8))
    o, *_ = torch.ops.linattn_cpu.chunked.default(q, q, q, *st, 1, True, 1e-6, 2**62, True)
    torch.testing.assert_close(o, linear_attention(q, q, q, causal=True, feature_map=make_feature_map("elu", 8)))
    o, *_ = torch.ops.linattn_cpu.gated_chunked.default(q, q, q, g, st[0], st[1], 1, 1e-6, 2**62, True)
    torch.testing.assert_close(o, gated_linear_attention(q, q, q, g, feature_map=make_feature_map("elu", 8),
                                                         normalize=True))
print("ok")
"""


@pytest.mark.parametrize("native_env", ["1", "0"])
def test_a_huge_chunk_size_is_one_chunk_not_a_crash(native_env):
    """chunk_size=2**31 (2**62 with elu+1) overflowed chunk² in the fused kernel and killed the interpreter;
    run in a subprocess so that a crash fails this test instead of ending pytest."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "LINATTN_NATIVE": native_env}
    res = subprocess.run([sys.executable, "-c", _HUGE_CHUNK], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), (res.returncode, res.stderr[-2000:])


def test_meta_tensors_are_refused_by_name_in_every_operator():
    """Issue 37 item 19: the operators on meta tensors raised a raw `.item()` error."""
    import torch.nn.functional as F

    from linattn.ops import delta_rule, gated_linear_attention, linear_attention, sliding_window_attention

    q, k, v = (torch.empty(1, 2, 5, 4, device="meta") for _ in range(3))
    g = torch.empty(1, 2, 5, device="meta")
    calls = [lambda: linear_attention(q, k, v, causal=True), lambda: gated_linear_attention(q, k, v, g),
             lambda: delta_rule(q, k, v, F.sigmoid(g)), lambda: sliding_window_attention(q, k, v, window=2)]
    for call in calls:
        with pytest.raises(ValueError, match="meta device"):
            call()
