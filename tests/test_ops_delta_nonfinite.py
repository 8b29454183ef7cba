"""Causality of the delta rule holds for NaN and Inf too: a non-finite value at token j of one (batch,
head) row reaches no output before j, and no gradient of a loss over outputs before j (q, k, v, beta,
g before j, the initial state); other rows keep every value and gradient.

The reference is the float64 recurrence (linattn.ops.delta.reference) run on the tokens before j alone:
by causality those outputs cannot depend on later tokens. Gradients of tokens from j on are exactly 0.
"""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from linattn.ops import delta_rule
from linattn.ops.delta.reference import delta_rule_recurrent

from .test_ops_delta import _both_paths, make_inputs  # noqa: F401  (autouse fixture: both CPU paths)

DT = torch.float64
NAMES = ("q", "k", "v", "beta", "g", "initial_state")


def _check(n, j, which, value, *, gated, l2norm, chunk, seed, clean_row_loss):
    """Poison `which` at (0, 1, j); loss over every row's outputs before j (plus, with clean_row_loss,
    all of row (1, 0)'s outputs and final state, which the poisoned row must not disturb)."""
    q, k, v, beta, g, S0 = make_inputs(2, 2, n, 5, 3, gated=gated, l2norm=l2norm, seed=seed, state=True)
    bad = dict(q=q, k=k, v=v)
    bad[which] = bad[which].clone()
    bad[which][0, 1, j, 2] = value
    leaves = [None if x is None else x.clone().requires_grad_() for x in (bad["q"], bad["k"], bad["v"], beta, g, S0)]
    o, S = delta_rule(*leaves[:4], g=leaves[4], initial_state=leaves[5], qk_l2norm=l2norm, chunk_size=chunk,
                      return_state=True)
    ref = [None if x is None else x.clone().requires_grad_() for x in (q, k, v, beta, g, S0)]
    cut = [None if x is None else x[:, :, :j] for x in ref[:5]]
    ro = delta_rule_recurrent(*cut[:4], g=cut[4], initial_state=ref[5], qk_l2norm=l2norm)[0] if j else o[:, :, :0]
    full_o, full_S = delta_rule_recurrent(*ref[:4], g=ref[4], initial_state=ref[5], qk_l2norm=l2norm)
    torch.testing.assert_close(o[:, :, :j], ro, rtol=1e-10, atol=1e-10)
    for row in ((0, 0), (1, 0), (1, 1)):  # rows without the bad value: everything equals the recurrence
        torch.testing.assert_close(o[row], full_o[row], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(S[row], full_S[row], rtol=1e-10, atol=1e-10)
    assert not torch.isfinite(o[0, 1, j]).all()
    w = torch.randn(o[:, :, :j].shape, dtype=DT, generator=torch.Generator().manual_seed(1))
    loss, ref_loss = (o[:, :, :j] * w).sum(), (ro * w).sum()
    if clean_row_loss:
        loss = loss + o[1, 0].sum() + S[1, 0].sum()
        ref_loss = ref_loss + full_o[1, 0].sum() + full_S[1, 0].sum()
    wrt = [x for x in leaves if x is not None]
    got = torch.autograd.grad(loss, wrt)
    if ref_loss.requires_grad:
        want = torch.autograd.grad(ref_loss, [x for x in ref if x is not None], allow_unused=True)
    else:  # j = 0 and only the poisoned prefix in the loss: every gradient is 0
        want = [None] * len(wrt)
    names = [nm for nm, x in zip(NAMES, leaves) if x is not None]
    for name, a, r in zip(names, got, want):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a, torch.zeros_like(a) if r is None else r, rtol=1e-9, atol=1e-9,
                                   msg=lambda m: f"d{name}: {m}")
        if name != "initial_state" and not clean_row_loss:
            assert (a[:, :, j:] == 0).all(), name


@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("gated", [False, True])
def test_nothing_before_a_nonfinite_token_changes(which, value, gated):
    _check(37, 21, which, value, gated=gated, l2norm=False, chunk=8, seed=0, clean_row_loss=False)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(1, 70), data=st.data(), which=st.sampled_from("qkv"), gated=st.booleans(),
       l2norm=st.booleans(), chunk=st.sampled_from([1, 4, 16, 64]), clean_row_loss=st.booleans())
def test_any_position_chunk_and_normalization(n, data, which, gated, l2norm, chunk, clean_row_loss):
    """Edges included: j = 0, j = N − 1, j on a chunk border, N = 1; other rows keep full gradients."""
    j = data.draw(st.integers(0, n - 1))
    _check(n, j, which, float("nan"), gated=gated, l2norm=l2norm, chunk=chunk, seed=n, clean_row_loss=clean_row_loss)


def test_many_nonfinite_tokens_in_several_rows():
    """NaN in q of row (0, 0) at 3 and 9, in k of row (1, 1) at 5: outputs before 3 and their gradients
    match the recurrence; row (1, 0), untouched, keeps everything."""
    q, k, v, beta, g, S0 = make_inputs(2, 2, 20, 4, 4, gated=True, l2norm=False, seed=3, state=True)
    qb, kb = q.clone(), k.clone()
    qb[0, 0, 3, 0] = qb[0, 0, 9, 1] = float("nan")
    kb[1, 1, 5, 2] = float("inf")
    leaves = [x.clone().requires_grad_() for x in (qb, kb, v, beta, g, S0)]
    o, S = delta_rule(*leaves[:4], g=leaves[4], initial_state=leaves[5], chunk_size=4, return_state=True)
    ref = [x.clone().requires_grad_() for x in (q, k, v, beta, g, S0)]
    ro, rS = delta_rule_recurrent(*ref[:4], g=ref[4], initial_state=ref[5])
    torch.testing.assert_close(o[:, :, :3], ro[:, :, :3], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(o[1, 0], ro[1, 0], rtol=1e-10, atol=1e-10)
    got = torch.autograd.grad(o[:, :, :3].sum() + o[1, 0].sum() + S[1, 0].sum(), leaves)
    want = torch.autograd.grad(ro[:, :, :3].sum() + ro[1, 0].sum() + rS[1, 0].sum(), ref)
    for name, a, r in zip(NAMES, got, want):
        torch.testing.assert_close(a, r, rtol=1e-9, atol=1e-9, msg=lambda m: f"d{name}: {m}")
