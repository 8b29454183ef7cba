"""linattn.ops.stepcheck: the steps check a call signature once, and a call that differs in anything
the checks read is checked again (the errors still name the argument)."""

import pytest
import torch

from linattn.nn.positional import RotaryEmbedding
from linattn.ops import gated_linear_attention_step, linear_attention_step, stepcheck


def _inputs(h=2, d=4, e=3):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 1, x, generator=g) for x in (d, d, e))
    return q, k, v, torch.randn(1, h, d, e, generator=g)


def test_a_checked_signature_is_remembered_and_a_different_one_is_checked():
    stepcheck.clear()
    q, k, v, s = _inputs()
    g = torch.full((1, 2, 1), -0.1)
    gated_linear_attention_step(s, q, k, v, g)
    assert len(stepcheck._SEEN) == 1
    gated_linear_attention_step(s + 1, q, k, v, g)  # same signature: nothing new to remember
    assert len(stepcheck._SEEN) == 1
    with pytest.raises(ValueError, match="state must have shape"):
        gated_linear_attention_step(torch.zeros(1, 2, 4, 5), q, k, v, g)
    with pytest.raises(ValueError, match="g must have shape"):
        gated_linear_attention_step(s, q, k, v, torch.zeros(1, 3, 1))
    with pytest.raises(ValueError, match="must be ≤ 0"):  # values are checked at every call
        gated_linear_attention_step(s, q, k, v, torch.full((1, 2, 1), 0.5))


def test_linear_step_rechecks_a_rope_of_another_size():
    stepcheck.clear()
    q, k, v, s = _inputs()
    state = (s, torch.ones(1, 2, 4))
    pos = torch.tensor([3])
    linear_attention_step(state, q, k, v, rope=RotaryEmbedding(4), positions=pos)
    with pytest.raises(ValueError, match="rope dim"):
        linear_attention_step(state, q, k, v, rope=RotaryEmbedding(2), positions=pos)


def test_the_cache_is_bounded():
    stepcheck.clear()
    for n in range(stepcheck.SIZE + 10):
        stepcheck.remember(("x", n))
    assert len(stepcheck._SEEN) == stepcheck.SIZE and not stepcheck.seen(("x", 0)) and stepcheck.seen(("x", n))


def test_signatures_tell_apart_what_the_checks_read():
    """The flat signature keeps each part's boundaries: a state tuple is not its tensors passed
    alone, 1 is not True, None is not a missing tensor; shape, dtype and requires_grad count."""
    a, b = torch.zeros(2, 3), torch.zeros(3)
    sig = stepcheck.signature
    assert sig((a, b), None) != sig(a, b, None) and sig((a, b), None) != sig((a,), b)
    assert sig(a, 1) != sig(a, True) and sig(a, None) != sig(a, 0.0) and sig(a, 1e-6) != sig(a, 1e-5)
    assert sig(a) != sig(a.double()) and sig(a) != sig(a.T) and sig(a) != sig(a.clone().requires_grad_())
    assert sig(a, [b]) != sig(a, (b,)) and sig(a, b) == sig(a.clone(), b + 1)
    assert sig(RotaryEmbedding(4)) != sig(RotaryEmbedding(2))


def test_a_noted_kernel_choice_follows_linattn_native(monkeypatch):
    """The linear step notes the fused kernel's φ code beside its signature; LINATTN_NATIVE=0 set later
    still keeps the step off the fused kernel (same values from the torch ops)."""
    from linattn.ops import native

    if not native.available():
        pytest.skip("the fused CPU kernels are not built")
    stepcheck.clear()
    q, k, v, s = _inputs()
    state = (s, torch.ones(1, 2, 4))
    with torch.no_grad():
        fused = [linear_attention_step(state, q.abs(), k.abs(), v) for _ in range(2)][-1][0]
        monkeypatch.setenv("LINATTN_NATIVE", "0")
        monkeypatch.setattr(native, "step", lambda *a, **kw: pytest.fail("the fused step ran with LINATTN_NATIVE=0"))
        eager = linear_attention_step(state, q.abs(), k.abs(), v)[0]
    torch.testing.assert_close(eager, fused)
