"""linattn.compat.fla's linear attention and retention against FLA's own references
(fla.ops.linear_attn.naive, fla.ops.retention.naive, and naive_recurrent_simple_gla for retention's
states). Rule of comparison: tests/compat_fla_peers.py."""

import pytest
import torch

from linattn.compat import fla as C
from linattn.compat.fla.retention import retention_decays

from .compat_fla_peers import F64, FP32, close, grouped, leaves, loss, make, peer


def _positive(x):
    """Normalized linear attention wants non-negative q, k (FLA leaves the feature map to the caller)."""
    x = dict(x)
    x["q"], x["k"] = x["q"].sigmoid(), x["k"].sigmoid()
    return x


@pytest.mark.parametrize("fn", ["chunk_linear_attn", "fused_recurrent_linear_attn"])
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("hv", [2, 4])
@pytest.mark.parametrize("scale", [None, 0.5])
def test_linear_attn_equals_fla_naive_recurrent(fn, normalize, hv, scale):
    nv = peer("fla.ops.linear_attn.naive")
    x = _positive(make(hv=hv, seed=1))
    z0 = x["k"].new_empty(2, 1, hv, 8).uniform_(0.0, 3.0)
    init = (x["h0"], z0) if normalize else x["h0"]
    o_ref, st_ref = nv.naive_recurrent_linear_attn(grouped(x["q"], hv), grouped(x["k"], hv), x["v"], scale=scale,
                                                   initial_state=init, output_final_state=True, normalize=normalize)
    d = {n: v.double() for n, v in x.items()}
    init = (d["h0"], z0.double()) if normalize else d["h0"]
    o, st = getattr(C, fn)(d["q"], d["k"], d["v"], scale=scale, initial_state=init, output_final_state=True,
                           normalize=normalize)
    close(o, o_ref, FP32, "o")
    if normalize:
        close(st[0], st_ref[0], FP32, "S")
        close(st[1], st_ref[1], FP32, "z")
    else:
        close(st, st_ref, FP32, "S")


def test_linear_attn_step_and_none_state_pair():
    """T = 1 (the decoding step) and FLA's pair (None, z) when output_final_state is False."""
    nv = peer("fla.ops.linear_attn.naive")
    x = _positive(make(t=1, hv=4, seed=2))
    z0 = torch.rand(2, 1, 4, 8)
    o_ref, (S_ref, z_ref) = nv.naive_recurrent_linear_attn(grouped(x["q"], 4), grouped(x["k"], 4), x["v"],
                                                           initial_state=(x["h0"], z0), output_final_state=True,
                                                           normalize=True)
    with torch.no_grad():
        o, (S, z) = C.fused_recurrent_linear_attn(x["q"], x["k"], x["v"], initial_state=(x["h0"], z0),
                                                  output_final_state=True, normalize=True)
    close(o, o_ref, FP32, "o")
    close(S, S_ref, FP32, "S")
    close(z, z_ref, FP32, "z")
    o, (S, z) = C.chunk_linear_attn(x["q"], x["k"], x["v"], initial_state=(x["h0"], z0))
    assert S is None and z.shape == (2, 1, 4, 8)


@pytest.mark.parametrize("normalize", [True, False])
def test_chunk_linear_attn_equals_fla_naive_chunk_in_float64(normalize):
    """naive_chunk_linear_attn keeps float64 (T a multiple of 64, no states)."""
    nv = peer("fla.ops.linear_attn.naive")
    x = {n: v.double() for n, v in _positive(make(t=128, hv=2, seed=3)).items()}
    o_ref = nv.naive_chunk_linear_attn(x["q"], x["k"], x["v"], normalize=normalize)
    o, _ = C.chunk_linear_attn(x["q"], x["k"], x["v"], normalize=normalize)
    close(o, o_ref, F64, "o")


def test_linear_attn_gradients_equal_fla_naive():
    nv = peer("fla.ops.linear_attn.naive")
    x = _positive(make(t=19, hv=2, seed=4))
    x["z0"] = torch.rand(2, 1, 2, 8)
    a, b = leaves(x, torch.float32), leaves(x)
    o_ref, (S_ref, z_ref) = nv.naive_recurrent_linear_attn(a["q"], a["k"], a["v"], initial_state=(a["h0"], a["z0"]),
                                                           output_final_state=True, normalize=True)
    (loss(o_ref, S_ref) + loss(z_ref, None, seed=2)).backward()
    o, (S, z) = C.chunk_linear_attn(b["q"], b["k"], b["v"], initial_state=(b["h0"], b["z0"]),
                                    output_final_state=True)
    (loss(o, S) + loss(z, None, seed=2)).backward()
    for n in ("q", "k", "v", "h0", "z0"):
        close(b[n].grad, a[n].grad, 1e-4, f"d{n}")


def test_chunk_retention_equals_fla_naive_retention():
    """naive_retention is head-first (B, H, T, D), quadratic, float32, with FLA's decays 1 − 2^(−5−h)."""
    nv = peer("fla.ops.retention.naive")
    x = make(t=45, hv=2, h=2, seed=5, state=False)
    o_ref = nv.naive_retention(*(x[n].transpose(1, 2) for n in ("q", "k", "v"))).transpose(1, 2)
    o, S = C.chunk_retention(*(x[n].double() for n in ("q", "k", "v")))
    assert S is None
    close(o, o_ref, FP32, "o")


@pytest.mark.parametrize("fn", ["chunk_retention", "fused_recurrent_retention"])
@pytest.mark.parametrize("t", [1, 33])
def test_retention_states_equal_fla_simple_gla_recurrence(fn, t):
    """Initial and final states, GVA: FLA's recurrent simple-GLA reference with g = log γ_h."""
    nv = peer("fla.ops.simple_gla.naive")
    x = make(t=t, hv=4, seed=6)
    g = retention_decays(4).float().expand(2, t, 4)
    o_ref, S_ref = nv.naive_recurrent_simple_gla(grouped(x["q"], 4), grouped(x["k"], 4), x["v"], g,
                                                 initial_state=x["h0"], output_final_state=True)
    d = {n: v.double() for n, v in x.items()}
    with torch.no_grad():
        o, S = getattr(C, fn)(d["q"], d["k"], d["v"], initial_state=d["h0"], output_final_state=True)
    close(o, o_ref, FP32, "o")
    close(S, S_ref, FP32, "S")


def test_retention_decays_are_flas():
    """FLA's chunk_retention builds g_gamma = log(1 − 2^(−5 − arange(H))) in float32."""
    fla_gamma = (1 - 2.0 ** (-5.0 - torch.arange(6, dtype=torch.float))).log()
    close(retention_decays(6), fla_gamma, 1e-7, "g_gamma")
