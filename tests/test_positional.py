"""RoPE on features: the rotation against its pairwise definition, its custom gradient, the angle cache."""

from __future__ import annotations

import pytest
import torch

from linattn.nn.positional import RotaryEmbedding

from .conftest import explicit_rotation


@pytest.mark.parametrize("n", [1, 5])  # one token takes its own (roll) path for even F
@pytest.mark.parametrize("f", [2, 3, 8, 9])
def test_rotate_matches_pairwise_definition_and_gradients(f, n):
    torch.manual_seed(0)
    rope = RotaryEmbedding(f).double()
    x = torch.randn(2, 3, n, f, dtype=torch.float64, requires_grad=True)
    pos = torch.arange(n) + 7
    torch.testing.assert_close(rope.rotate(x, pos), explicit_rotation(x.detach(), pos), rtol=1e-6, atol=1e-6)
    assert torch.autograd.gradcheck(lambda t: rope.rotate(t, pos), (x,))
    assert torch.autograd.gradgradcheck(lambda t: rope.rotate(t, pos), (x,))


def test_cached_angles_of_few_positions_equal_computed_ones_and_work_with_autograd():
    rope = RotaryEmbedding(8)
    few, many = torch.tensor([3]), torch.arange(40)
    with torch.inference_mode():
        c_inf, _ = rope.angles(few, torch.float32)  # cached, as an inference tensor
    c_few, s_few = rope.angles(few, torch.float32)
    c_all, s_all = rope.angles(many, torch.float32)  # long: computed, not cached
    torch.testing.assert_close(c_few[0], c_all[3], rtol=0, atol=0)
    torch.testing.assert_close(s_few[0], s_all[3], rtol=0, atol=0)
    assert c_inf.is_inference() and not c_few.is_inference()
    x = torch.randn(1, 1, 1, 8, requires_grad=True)
    rope.rotate(x, few).sum().backward()  # cached angles outside inference mode can be saved for backward
    assert x.grad is not None and torch.isfinite(x.grad).all()


@pytest.mark.parametrize("n", [3, 40])  # a few positions take the cached path, many the computed one
@pytest.mark.parametrize("start", [10**5, 10**6])
def test_float64_rotation_is_float64_at_large_positions(n, start):
    """The angles were float32 for float64 inputs: an error of 1e-4 at position 1e5."""
    rope = RotaryEmbedding(8)
    x = torch.randn(2, 3, n, 8, dtype=torch.float64)
    pos = torch.arange(start, start + n)
    torch.testing.assert_close(rope.rotate(x, pos), explicit_rotation(x, pos), rtol=1e-11, atol=1e-11)
    torch.testing.assert_close(rope.rotate(x, pos[None].expand(2, n)), explicit_rotation(x, pos), rtol=1e-11,
                               atol=1e-11)


@pytest.mark.parametrize("n", [3, 40])
def test_low_precision_modules_keep_float32_frequencies(n):
    """A model cast to bf16 (or fp16) once cast RoPE's frequencies too: 3 significant digits, an angle
    error of ~1 rad at position 2000. Angles are float32 for every dtype but float64."""
    x = torch.randn(1, 2, n, 16)
    pos = torch.arange(2000, 2000 + n)
    want = explicit_rotation(x.double(), pos)
    for module_dtype in (torch.bfloat16, torch.float16, torch.float32):
        rope = RotaryEmbedding(16).to(module_dtype)
        torch.testing.assert_close(rope.rotate(x, pos).double(), want, rtol=0, atol=2e-3)
        low = rope.rotate(x.bfloat16(), pos).double()  # bf16 features: within bf16 rounding of the result
        torch.testing.assert_close(low, want, rtol=0, atol=0.05)


@pytest.mark.parametrize("native_env", ["1", "0"])
def test_operators_with_rope_are_float64_at_large_positions(monkeypatch, native_env):
    """The parallel op and the (fused, when built) recurrent step against a float64 reference rotated pair by pair."""
    from linattn.nn.feature_maps import make_feature_map
    from linattn.ops import linear_attention, linear_attention_step
    from linattn.ops.linear import reference

    monkeypatch.setenv("LINATTN_NATIVE", native_env)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 20, 6, dtype=torch.float64, generator=g) for _ in range(3))
    fm, rope, pos = make_feature_map("elu", 6), RotaryEmbedding(6), torch.arange(10**5, 10**5 + 20)
    qf, kf = fm(q), fm(k)
    want, _ = reference.kernel_attention(explicit_rotation(qf, pos), explicit_rotation(kf, pos), v, causal=True,
                                         qf_den=qf, kf_den=kf)
    got = linear_attention(q, k, v, causal=True, feature_map=fm, rope=rope, positions=pos, chunk_size=8)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    state, outs = None, []
    with torch.inference_mode():
        for t in range(20):
            o, state = linear_attention_step(state, q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1],
                                             feature_map=fm, rope=rope, positions=pos[t:t + 1])
            outs.append(o)
    torch.testing.assert_close(torch.cat(outs, 2), want, rtol=1e-10, atol=1e-10)
