"""linattn.compat.fla.kda (chunk_kda, fused_recurrent_kda in FLA's layout) against FLA's own
naive_recurrent_kda and gate functions (skipped without `fla`) and against linattn's float64
recurrence: grouped value heads, the gate inside the op, beta logits, packed sequences, refusals."""

from __future__ import annotations

import warnings

import pytest
import torch

from linattn.compat.fla.kda import chunk_kda, fused_recurrent_kda
from linattn.ops.kda import kda_gate
from linattn.ops.delta.reference import delta_rule_recurrent

B, T, H, HV, K, V = 2, 21, 2, 4, 6, 5


def kda_recurrent(q, k, v, beta, g, **kw):
    return delta_rule_recurrent(q, k, v, beta, g=g, **kw)


def _inputs(seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, T, H, K, generator=gen, dtype=dtype) for _ in range(2))
    v = torch.randn(B, T, HV, V, generator=gen, dtype=dtype)
    graw = torch.randn(B, T, HV, K, generator=gen, dtype=dtype)
    beta = torch.rand(B, T, HV, generator=gen, dtype=dtype) * 0.98 + 0.01
    S0 = torch.randn(B, HV, K, V, generator=gen, dtype=dtype)
    A_log = torch.rand(HV, generator=gen, dtype=dtype)
    dt_bias = torch.randn(HV * K, generator=gen, dtype=dtype)
    return q, k, v, graw, beta, S0, A_log, dt_bias


def _reference(q, k, v, g, beta, S0, l2norm=True):
    """linattn's float64 recurrence with FLA's conventions written out: GVA by repeat_interleave, scale K^−1/2."""
    t = lambda x: x.transpose(1, 2)  # noqa: E731
    rep = lambda x: t(x.repeat_interleave(HV // H, dim=2))  # noqa: E731
    o, S = kda_recurrent(rep(q), rep(k), t(v), beta.transpose(1, 2), t(g), scale=K ** -0.5, qk_l2norm=l2norm,
                         initial_state=S0)
    return o.transpose(1, 2), S


@pytest.mark.parametrize("fn", [chunk_kda, fused_recurrent_kda])
def test_gva_gate_in_kernel_against_the_recurrence(fn):
    q, k, v, graw, beta, S0, A_log, dt_bias = _inputs()
    g = kda_gate(graw, A_log, dt_bias)
    o, S = fn(q, k, v, graw, beta, A_log=A_log, dt_bias=dt_bias, initial_state=S0, output_final_state=True,
              use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True)
    ro, rS = _reference(q, k, v, g, beta, S0)
    torch.testing.assert_close(o, ro, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(S, rS, atol=1e-10, rtol=1e-10)
    o2, none = fn(q, k, v, g, torch.logit(beta), use_beta_sigmoid_in_kernel=True, initial_state=S0,
                  use_qk_l2norm_in_kernel=True)
    assert none is None
    torch.testing.assert_close(o2, ro, atol=1e-10, rtol=1e-10)


def test_against_fla_naive_recurrent():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        naive = pytest.importorskip("fla.ops.kda.naive")
        gate = pytest.importorskip("fla.ops.kda.gate")
    q, k, v, graw, beta, S0, A_log, dt_bias = (x.float() for x in _inputs(seed=1))
    k = torch.nn.functional.normalize(k, dim=-1)
    g = gate.naive_kda_gate(graw, A_log, dt_bias)
    ro, rS = naive.naive_recurrent_kda(q, k, v, g, beta, initial_state=S0, output_final_state=True)
    for fn in (chunk_kda, fused_recurrent_kda):
        o, S = fn(q, k, v, graw, beta, A_log=A_log, dt_bias=dt_bias, use_gate_in_kernel=True, initial_state=S0,
                  output_final_state=True)
        torch.testing.assert_close(o, ro, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(S, rS, atol=1e-4, rtol=1e-4)
    g = gate.naive_kda_lowerbound_gate(graw, A_log, dt_bias, lower_bound=-5.0)
    ro, _ = naive.naive_recurrent_kda(q, k, v, g, beta, initial_state=S0)
    o, _ = chunk_kda(q, k, v, graw, beta, A_log=A_log, dt_bias=dt_bias, use_gate_in_kernel=True, safe_gate=True,
                     lower_bound=-5.0, initial_state=S0)
    torch.testing.assert_close(o, ro, atol=1e-4, rtol=1e-4)


def test_packed_sequences():
    q, k, v, graw, beta, S0, A_log, dt_bias = _inputs(seed=2)
    g = kda_gate(graw, A_log, dt_bias)
    flat = lambda x: x.reshape(1, B * T, *x.shape[2:])  # noqa: E731
    cu = torch.tensor([0, T, 2 * T])
    o, S = chunk_kda(flat(q), flat(k), flat(v), flat(g), flat(beta), initial_state=S0, output_final_state=True,
                     use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
    ro, rS = _reference(q, k, v, g, beta, S0)
    torch.testing.assert_close(o, flat(ro), atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(S, rS, atol=1e-10, rtol=1e-10)


def test_refusals_name_the_option():
    q, k, v, graw, beta, S0, A_log, dt_bias = _inputs()
    g = kda_gate(graw, A_log, dt_bias)
    for kw in (dict(allow_neg_eigval=True), dict(cp_context=object()), dict(use_graph=True)):
        with pytest.raises(ValueError, match=next(iter(kw))):
            chunk_kda(q, k, v, g, beta, **kw)
    with pytest.raises(TypeError, match="unexpected"):
        chunk_kda(q, k, v, g, beta, bogus=1)
    with pytest.raises(ValueError, match="A_log"):
        fused_recurrent_kda(q, k, v, graw, beta, use_gate_in_kernel=True)
    with pytest.raises(ValueError, match="multiple"):
        chunk_kda(q, k, v[:, :, :3], g[:, :, :3], beta[:, :, :3])


@pytest.mark.parametrize("fn", [chunk_kda, fused_recurrent_kda])
def test_allow_neg_eigval_and_masked_tokens_against_fla_naive(fn):
    """allow_neg_eigval with use_beta_sigmoid_in_kernel: β = 2·sigmoid(logits) ∈ [0, 2] as FLA computes it,
    against FLA's naive_recurrent_kda given that β; logits of −200 (sigmoid underflows to 0: a masked
    token) run too. Before, allow_neg_eigval and β = 0 were refused."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        naive = pytest.importorskip("fla.ops.kda.naive")
    q, k, v, graw, beta, S0, A_log, dt_bias = (x.float() for x in _inputs(seed=4))
    k = torch.nn.functional.normalize(k, dim=-1)
    g = kda_gate(graw, A_log, dt_bias)
    logits = 3 * torch.randn(beta.shape, generator=torch.Generator().manual_seed(5))
    logits[:, 3] = 30.0  # β = 2 exactly
    logits[:, 7] = -200.0  # β = 0 exactly
    ro, rS = naive.naive_recurrent_kda(q, k, v, g, 2 * logits.sigmoid(), initial_state=S0, output_final_state=True)
    o, S = fn(q, k, v, g, logits, initial_state=S0, output_final_state=True, use_beta_sigmoid_in_kernel=True,
              allow_neg_eigval=True)
    torch.testing.assert_close(o, ro, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(S, rS, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="allow_neg_eigval=True requires use_beta_sigmoid_in_kernel"):
        fn(q, k, v, g, beta, allow_neg_eigval=True)


@pytest.mark.parametrize("fn", [chunk_kda, fused_recurrent_kda])
def test_state_v_first_and_its_deprecated_alias(fn):
    """state_v_first=True (states [N, HV, V, K]) and FLA's deprecated transpose_state_layout=True (a
    DeprecationWarning; with state_v_first too, a ValueError), as FLA's chunk_kda / fused_recurrent_kda
    take them (issue 37 items 13, 15; before: refused, and a TypeError)."""
    q, k, v, graw, beta, S0, A_log, dt_bias = _inputs(seed=6)
    g = kda_gate(graw, A_log, dt_bias)
    ro, rS = _reference(q, k, v, g, beta, S0)
    o, S = fn(q, k, v, g, beta, initial_state=S0.mT, output_final_state=True, use_qk_l2norm_in_kernel=True,
              state_v_first=True)
    torch.testing.assert_close(o, ro, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(S, rS.mT, atol=1e-10, rtol=1e-10)
    with pytest.warns(DeprecationWarning, match="transpose_state_layout"):
        o2, S2 = fn(q, k, v, g, beta, initial_state=S0.mT, output_final_state=True, use_qk_l2norm_in_kernel=True,
                    transpose_state_layout=True)
    torch.testing.assert_close(o2, ro, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(S2, rS.mT, atol=1e-10, rtol=1e-10)
    with pytest.raises(ValueError, match="not both"):
        fn(q, k, v, g, beta, state_v_first=True, transpose_state_layout=True)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("v_first", [False, True])
def test_return_intermediate_states(packed, v_first):
    """return_intermediate_states=True, under torch.inference_mode() as FLA requires: (o, final state, h),
    h [B, NT, HV, K, V] (V-first with state_v_first) in k's dtype, h[:, i] the state entering chunk i
    of 16 tokens (packed: each sequence's chunks from its own start, B = 1), against the float64
    recurrence stopped at each chunk start (issue 37 item 15; before: refused)."""
    q, k, v, graw, beta, S0, A_log, dt_bias = _inputs(seed=8)
    g = kda_gate(graw, A_log, dt_bias)
    flat = lambda x: x.reshape(1, B * T, *x.shape[2:])  # noqa: E731
    args = [flat(x) for x in (q, k, v, g, beta)] if packed else [q, k, v, g, beta]
    extra = dict(cu_seqlens=torch.tensor([0, T, 2 * T])) if packed else {}
    with torch.inference_mode():
        o, S, h = chunk_kda(*args, initial_state=S0.mT if v_first else S0, output_final_state=True,
                            use_qk_l2norm_in_kernel=True, return_intermediate_states=True, state_v_first=v_first,
                            chunk_size=16, **extra)
    ro, rS = _reference(q, k, v, g, beta, S0)
    starts = list(range(0, T, 16))
    want = torch.stack([S0 if t == 0 else _reference(*(x[:, :t] for x in (q, k, v, g, beta)), S0)[1]
                        for t in starts], 1)  # (B, NT, HV, K, V)
    if packed:
        want = want.reshape(1, B * len(starts), *want.shape[2:])
    assert h.dtype == q.dtype and h.shape == (want.mT if v_first else want).shape
    torch.testing.assert_close(h, want.mT if v_first else want, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(o, flat(ro) if packed else ro, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(S, rS.mT if v_first else rS, atol=1e-10, rtol=1e-10)
    with pytest.raises(ValueError, match="inference_mode"):
        chunk_kda(q, k, v, g, beta, return_intermediate_states=True)


def test_bad_scale_and_empty_batch_name_the_argument():
    """A non-finite scale is refused by name and B = 0 gets a clear error, as the delta rule's (issue 37
    items 18, 19; before: NaN outputs, and a raw aminmax error)."""
    q, k, v, graw, beta, S0, A_log, dt_bias = _inputs(seed=9)
    g = kda_gate(graw, A_log, dt_bias)
    for fn in (chunk_kda, fused_recurrent_kda):
        for bad in (float("nan"), float("inf")):
            with pytest.raises(ValueError, match="scale must be finite"):
                fn(q, k, v, g, beta, scale=bad)
        with pytest.raises(ValueError, match="batch B >= 1"):
            fn(q[:0], k[:0], v[:0], g[:0], beta[:0])
