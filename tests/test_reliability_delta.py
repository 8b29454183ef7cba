"""The delta rule after a strong forget gate (issue 23, item 1; design §13.3, "b after a strong gate").

One token with g = −1e4, −1e8 or −1e30 (a "reset": α = e^g underflows to 0) among mild gates: the
chunked forms must still equal the float64 recurrence written from the definition
(linattn.ops.delta.reference), outputs, final state and gradients, on both CPU paths. Before the
fix the in-chunk cumulative sum b was held in the state dtype and b_i − b_j lost the small gates
after the reset (relative error 3e-4 at −1e4 in fp32, 0.4 at −1e8, 0.3 at −1e30 in float64).
"""

import pytest
import torch

from linattn.ops import delta_rule, delta_rule_step
from linattn.ops.delta.reference import delta_rule_recurrent

from .test_ops_delta import _both_paths  # noqa: F401  (autouse fixture: both CPU paths)

STRONG = [-1e4, -1e8, -1e30]
TOL = {torch.float32: 2e-5, torch.float64: 1e-12}


def reset_inputs(n, d, e, where, strength, *, dtype, seed=0, bh=(1, 1)):
    """q, v random, k L2-normalized, β ∈ [0.05, 0.95], g ∈ [−0.1, 0] with g = strength at `where`."""
    gen = torch.Generator().manual_seed(seed)
    b, h = bh
    q = torch.randn(b, h, n, d, generator=gen, dtype=torch.float64)
    k = torch.nn.functional.normalize(torch.randn(b, h, n, d, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(b, h, n, e, generator=gen, dtype=torch.float64)
    beta = torch.rand(b, h, n, generator=gen, dtype=torch.float64) * 0.9 + 0.05
    g = -0.1 * torch.rand(b, h, n, generator=gen, dtype=torch.float64)
    g[..., list(where)] = strength
    return [x.to(dtype) for x in (q, k, v, beta, g)]


def rel_err(got, want):
    return float((got.detach().double() - want.detach()).abs().max() / want.detach().abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("strength", STRONG)
def test_one_reset_in_a_chunk_matches_the_recurrence(dtype, strength):
    """The issue's reproducer: 64 tokens, one chunk, the reset at token 20."""
    q, k, v, beta, g = reset_inputs(64, 8, 4, [20], strength, dtype=dtype)
    o, S = delta_rule(q, k, v, beta, g=g, return_state=True)
    ro, rS = delta_rule_recurrent(*(x.double() for x in (q, k, v, beta)), g=g.double())
    assert rel_err(o, ro) <= TOL[dtype]
    assert rel_err(S, rS) <= TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("strength", STRONG)
def test_prefill_equals_decoding_after_a_reset(dtype, strength):
    """The chunked call and 64 calls of delta_rule_step agree (before the fix only the step was right)."""
    q, k, v, beta, g = reset_inputs(64, 8, 4, [20], strength, dtype=dtype, seed=1)
    o = delta_rule(q, k, v, beta, g=g)
    state, outs = None, []
    for t in range(64):
        o_t, state = delta_rule_step(state, q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1],
                                     beta[:, :, t:t + 1], g=g[:, :, t:t + 1])
        outs.append(o_t)
    ro, _ = delta_rule_recurrent(*(x.double() for x in (q, k, v, beta)), g=g.double())
    assert rel_err(torch.cat(outs, 2), ro) <= TOL[dtype]
    assert rel_err(o, ro) <= TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("strength", STRONG)
def test_resets_at_chunk_edges_with_gradients(dtype, strength):
    """Several resets (first and last token of a chunk, two in a row, one in the tail of N = 70 with
    chunks of 32), B·H = 2·2, the normalization inside the op; gradients of q, k, v, β, g and the
    initial state against autograd of the float64 recurrence (the gradient of a reset's g is 0 there)."""
    q, k, v, beta, g = reset_inputs(70, 6, 5, [0, 31, 32, 40, 41, 66], strength, dtype=dtype, seed=2, bh=(2, 2))
    S0 = torch.randn(2, 2, 6, 5, generator=torch.Generator().manual_seed(3), dtype=dtype)
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, beta, g, S0)]
    ref_leaves = [x.detach().double().requires_grad_() for x in (q, k, v, beta, g, S0)]
    o, S = delta_rule(*leaves[:4], g=leaves[4], qk_l2norm=True, initial_state=leaves[5], return_state=True,
                      chunk_size=32)
    ro, rS = delta_rule_recurrent(*ref_leaves[:4], g=ref_leaves[4], qk_l2norm=True, initial_state=ref_leaves[5])
    assert rel_err(o, ro) <= TOL[dtype] and rel_err(S, rS) <= TOL[dtype]
    gen = torch.Generator().manual_seed(4)
    wo, wS = torch.randn(o.shape, generator=gen, dtype=torch.float64), torch.randn(S.shape, generator=gen,
                                                                                  dtype=torch.float64)
    got = torch.autograd.grad((o * wo.to(dtype)).sum() + (S * wS.to(dtype)).sum(), leaves)
    want = torch.autograd.grad((ro * wo).sum() + (rS * wS).sum(), ref_leaves)
    for name, a, b in zip(("q", "k", "v", "beta", "g", "initial_state"), got, want):
        assert torch.isfinite(a).all(), name
        err = float((a.double() - b).abs().max() / max(1.0, b.abs().max().item()))
        assert err <= 10 * TOL[dtype], f"d{name}: {err}"
