"""The operators as affine functions of their initial state (linattn.ops.affine, gated_affine_form,
delta_rule_affine_form), against the float64 token-by-token recurrences: one form, evaluated at two
random initial states S0, gives o = form.output(S0) and form.final(S0) equal to the recurrence run
from each S0, with the gradients of q, k, v, g / beta and both S0; the transitions equal their
definitions (e^{Σg}; the ordered product of α_t (I − β_t k̂_t k̂_tᵀ)), on both CPU paths, with
contiguous and strided inputs."""

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from linattn.nn.feature_maps import make_feature_map
from linattn.ops import native
from linattn.ops.affine import apply_transition, transition_grad
from linattn.ops.delta import delta_rule_affine_form
from linattn.ops.delta.reference import delta_rule_recurrent, l2_normalize
from linattn.ops.gated import gated_affine_form
from linattn.ops.gated.reference import gated_recurrence

DT = torch.float64
TOL = 1e-10


def _close(got, want, what):
    torch.testing.assert_close(got, want, atol=TOL * max(1.0, want.abs().max().item()), rtol=0,
                               msg=lambda m: f"{what}: {m}")


def _randn(gen, strided, b, h, n, d):
    """(b, h, n, d) float64 normal; strided: a transposed view of a (b, n, h, d) tensor."""
    if strided:
        return torch.randn(b, n, h, d, generator=gen, dtype=DT).transpose(1, 2)
    return torch.randn(b, h, n, d, generator=gen, dtype=DT)


def _check_grads(leaves, names, got_out, want_out):
    """Gradients of the same random functional of (o, S_n) through the form and through the oracle."""
    gen = torch.Generator().manual_seed(5)
    ws = [torch.randn(x.shape, generator=gen, dtype=DT) for x in want_out]
    wrt = [x for x in leaves if x is not None]
    got = torch.autograd.grad(sum((x * w).sum() for x, w in zip(got_out, ws)), wrt)
    want = torch.autograd.grad(sum((x * w).sum() for x, w in zip(want_out, ws)), wrt)
    for name, a, b in zip([n for n, x in zip(names, leaves) if x is not None], got, want):
        _close(a, b, f"d{name}")


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(b=st.integers(1, 2), h=st.integers(1, 2), n=st.integers(1, 40), d=st.integers(1, 9), e=st.integers(1, 9),
       chunk=st.sampled_from([1, 4, 16]), vector=st.booleans(), normalize=st.booleans(), elu=st.booleans(),
       mask=st.booleans(), scale=st.sampled_from([None, 0.5]), strided=st.booleans(), seed=st.integers(0, 2**16))
@example(b=1, h=1, n=1, d=3, e=2, chunk=16, vector=False, normalize=False, elu=False, mask=False, scale=None,
         strided=False, seed=0)  # one token
@example(b=2, h=2, n=17, d=5, e=3, chunk=16, vector=True, normalize=True, elu=True, mask=True, scale=0.5,
         strided=True, seed=1)  # a one-token tail, F ≠ E, B·H = 4, everything on
def test_gated_affine_form_matches_the_recurrence(op_path, b, h, n, d, e, chunk, vector, normalize, elu, mask, scale,
                                                  strided, seed):
    gen = torch.Generator().manual_seed(seed)
    q, k = (_randn(gen, strided, b, h, n, d) for _ in range(2))
    v = _randn(gen, strided, b, h, n, e)
    g = torch.nn.functional.logsigmoid(torch.randn(b, h, n, *((d,) if vector else ()), generator=gen, dtype=DT) + 1)
    S0s = [torch.randn(b, h, d, e + normalize, generator=gen, dtype=DT) for _ in range(2)]
    if normalize:  # a positive normalizer, as φ = elu+1 features give
        for S0 in S0s:
            S0[..., -1] = S0[..., -1].abs() + 1
        q, k = q.abs(), k.abs()
    kpm = torch.rand(b, n, generator=gen) > 0.3 if mask else None
    fmap = make_feature_map("elu", d) if elu else None
    leaves = [x.detach().requires_grad_() for x in (q, k, v, g, *S0s)]
    qq, kk, vv, gg = leaves[:4]
    form = gated_affine_form(qq, kk, vv, gg, feature_map=fmap, normalize=normalize, scale=scale, chunk_size=chunk,
                             key_padding_mask=kpm)
    qs = qq if scale is None else qq * scale
    qf, kf = (qs, kk) if fmap is None else (fmap(qs, is_query=True), fmap(kk, is_query=False))
    got, want = [], []
    for i, SS in enumerate(leaves[4:]):
        o, S = form.output(SS), form.final(SS)
        init = (SS[..., :-1], SS[..., -1]) if normalize else SS
        ro, rS = gated_recurrence(qf, kf, vv, gg, normalize=normalize, initial_state=init, key_padding_mask=kpm)
        if normalize:
            rS = torch.cat((rS[0], rS[1][..., None]), -1)
        _close(o, ro, f"output from S0 #{i}")
        _close(S, rS, f"final state from S0 #{i}")
        got += [o, S]
        want += [ro, rS]
    gm = g if kpm is None else g.masked_fill(~kpm.view(b, 1, n, *((1,) if vector else ())), 0)
    _close(form.transition, gm.sum(2).exp(), "transition e^{Σg}")
    _check_grads(leaves, ("q", "k", "v", "g", "S0 #0", "S0 #1"), got, want)


def _explicit_product(k, beta, g, l2norm):
    """Π_t α_t (I − β_t k̂_t k̂_tᵀ), the latest token leftmost, as matrices (B, H, D, D)."""
    if l2norm:
        k = l2_normalize(k)
    b, h, n, d = k.shape
    A = torch.eye(d, dtype=DT).expand(b, h, d, d)
    for t in range(n):
        kt = k[:, :, t]
        T = torch.eye(d, dtype=DT) - beta[:, :, t, None, None] * kt[..., :, None] * kt[..., None, :]
        if g is not None:
            T = T * g[:, :, t, None, None].exp()
        A = T @ A
    return A


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(b=st.integers(1, 2), h=st.integers(1, 2), n=st.integers(1, 40), d=st.integers(1, 9), e=st.integers(1, 9),
       chunk=st.sampled_from([1, 4, 16]), gated=st.booleans(), l2norm=st.booleans(),
       scale=st.sampled_from([None, 0.5]), strided=st.booleans(), seed=st.integers(0, 2**16))
@example(b=1, h=1, n=1, d=3, e=2, chunk=16, gated=False, l2norm=False, scale=None, strided=False, seed=0)
@example(b=2, h=2, n=17, d=5, e=3, chunk=16, gated=True, l2norm=True, scale=0.5, strided=True, seed=1)
def test_delta_affine_form_matches_the_recurrence_and_the_explicit_product(op_path, b, h, n, d, e, chunk, gated, l2norm,
                                                                            scale, strided, seed):
    gen = torch.Generator().manual_seed(seed)
    q, k = (_randn(gen, strided, b, h, n, d) for _ in range(2))
    if not l2norm:
        k = torch.nn.functional.normalize(k, dim=-1)
    v = _randn(gen, strided, b, h, n, e)
    beta = torch.rand(b, h, n, generator=gen, dtype=DT) * 0.98 + 0.01
    g = torch.nn.functional.logsigmoid(torch.randn(b, h, n, generator=gen, dtype=DT) + 2) if gated else None
    S0s = [torch.randn(b, h, d, e, generator=gen, dtype=DT) for _ in range(2)]
    leaves = [None if x is None else x.detach().requires_grad_() for x in (q, k, v, beta, g, *S0s)]
    qq, kk, vv, bb, gg = leaves[:5]
    form = delta_rule_affine_form(qq, kk, vv, bb, g=gg, scale=scale, qk_l2norm=l2norm, chunk_size=chunk)
    got, want = [], []
    for i, SS in enumerate(leaves[5:]):
        o, S = form.output(SS), form.final(SS)
        ro, rS = delta_rule_recurrent(qq, kk, vv, bb, g=gg, scale=scale, qk_l2norm=l2norm, initial_state=SS)
        _close(o, ro, f"output from S0 #{i}")
        _close(S, rS, f"final state from S0 #{i}")
        got += [o, S]
        want += [ro, rS]
    _close(form.transition, _explicit_product(k, beta, g, l2norm), "transition A (explicit product)")
    assert form.transition.shape == (b, h, d, d) and form.state.shape == (b, h, d, e)
    _check_grads(leaves, ("q", "k", "v", "beta", "g", "S0 #0", "S0 #1"), got, want)


@pytest.mark.parametrize("shape", [(2, 3), (2, 3, 4), (2, 3, 4, 4)], ids=["scalar", "vector", "matrix"])
def test_transition_action_and_gradient(shape):
    """apply_transition (and its transpose) against the explicit matrix, transition_grad against autograd."""
    gen = torch.Generator().manual_seed(1)
    A = torch.randn(shape, generator=gen, dtype=DT, requires_grad=True)
    S, R = (torch.randn(2, 3, 4, 5, generator=gen, dtype=DT) for _ in range(2))
    M = {2: lambda a: a[..., None, None] * torch.eye(4, dtype=DT), 3: torch.diag_embed,
         4: lambda a: a}[len(shape)](A)
    _close(apply_transition(A, S), M @ S, "A S")
    _close(apply_transition(A, S, transpose=True), M.mT @ S, "Aᵀ S")
    (want,) = torch.autograd.grad((apply_transition(A, S) * R).sum(), A)
    _close(transition_grad(A, S, R), want, "∂⟨R, A S⟩/∂A")
