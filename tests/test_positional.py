"""RoPE on features: the rotation against its pairwise definition, its custom gradient, the angle cache."""

from __future__ import annotations

import pytest
import torch

from linattn.positional import RotaryEmbedding


def _explicit_rotation(x, positions, base=10_000.0):
    """Pairs (x_m, x_{m+P}), P = ⌊F/2⌋, rotated by position·base^(−m/P); an odd last feature kept."""
    f = x.shape[-1]
    p = f // 2
    out = x.clone()
    for m in range(p):
        theta = positions.double() * base ** (-m / p)
        c, s = torch.cos(theta)[:, None], torch.sin(theta)[:, None]
        a, b = x[..., :, m], x[..., :, m + p]
        out[..., :, m] = a * c[:, 0] - b * s[:, 0]
        out[..., :, m + p] = a * s[:, 0] + b * c[:, 0]
    return out


@pytest.mark.parametrize("n", [1, 5])  # one token takes its own (roll) path for even F
@pytest.mark.parametrize("f", [2, 3, 8, 9])
def test_rotate_matches_pairwise_definition_and_gradients(f, n):
    torch.manual_seed(0)
    rope = RotaryEmbedding(f).double()
    x = torch.randn(2, 3, n, f, dtype=torch.float64, requires_grad=True)
    pos = torch.arange(n) + 7
    torch.testing.assert_close(rope.rotate(x, pos), _explicit_rotation(x.detach(), pos), rtol=1e-6, atol=1e-6)
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
