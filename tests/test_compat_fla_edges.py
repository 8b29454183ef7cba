"""linattn.compat.fla on the inputs of issue 37: mixed dtypes as FLA runs them (item 14), non-finite
scales and integer convolution states (item 18), and arguments whose errors did not name them
(item 19: cu_seqlens as a list, the meta device, K = 0, a wrong final_states_out). References: FLA's
own naive modules (rule of comparison: tests/compat_fla_peers.py)."""

import math

import pytest
import torch

from linattn.compat import fla as C
from linattn.compat.fla.retention import retention_decays

from .compat_fla_peers import FP32, close, make, peer

#: name -> (FLA's naive reference family, the gate the call takes)
GATED = {"chunk_simple_gla": "scalar", "fused_recurrent_simple_gla": "scalar", "chunk_gla": "vector",
         "fused_recurrent_gla": "vector", "chunk_retention": None, "fused_recurrent_retention": None,
         "chunk_linear_attn": None, "fused_recurrent_linear_attn": None}
NAMES = list(GATED)


def _call(name, q, k, v, g, **kw):
    fn = getattr(C, name)
    return fn(q, k, v, g, **kw) if GATED[name] else fn(q, k, v, **kw)


def _reference(name, q, k, v, g, h0, normalize):
    """FLA's naive recurrence of the family, float32 in and out."""
    if "linear_attn" in name:
        nv = peer("fla.ops.linear_attn.naive")
        return nv.naive_recurrent_linear_attn(q, k, v, initial_state=h0, output_final_state=True, normalize=normalize)
    if GATED[name] == "vector":
        return peer("fla.ops.gla.naive").naive_recurrent_gla(q, k, v, g, initial_state=h0, output_final_state=True)
    if GATED[name] is None:  # retention: simple GLA with FLA's fixed decays
        g = retention_decays(v.shape[2]).float().expand(*v.shape[:3])
    return peer("fla.ops.simple_gla.naive").naive_recurrent_simple_gla(q, k, v, g, initial_state=h0,
                                                                      output_final_state=True)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("v_dtype", [torch.float16, torch.bfloat16])
def test_mixed_dtypes_run_with_flas_output_dtype(name, v_dtype):
    """Item 14: q/k float32 with v (and the gates) in half precision were refused ("v.dtype must equal
    q.dtype"); FLA runs them. Its chunk kernels write o in v's dtype (torch.empty_like(v)), its
    fused_recurrent ones in q's, the final state is float32; normalized linear attention divides
    by a denominator of q and k's dtype. Values: FLA's naive recurrence on the same numbers; the
    gradients come back in each input's dtype."""
    x = make(t=19, h=2, hv=2, gate=GATED[name] or "scalar", seed=7)
    if "linear_attn" in name:
        x["q"], x["k"] = x["q"].sigmoid(), x["k"].sigmoid()
    v, g = x["v"].to(v_dtype), x["g"].to(v_dtype)
    q, k = (t.clone().requires_grad_() for t in (x["q"], x["k"]))
    v = v.clone().requires_grad_()
    for normalize in ((False, True) if "linear_attn" in name else (None,)):
        kw = {} if normalize is None else {"normalize": normalize}
        o, S = _call(name, q, k, v, g, initial_state=x["h0"], output_final_state=True, **kw)
        S = S[0] if normalize else S
        want = v_dtype if name.startswith("chunk") else torch.float32
        assert o.dtype == (torch.float32 if normalize else want) and S.dtype == torch.float32
        o_ref, S_ref = _reference(name, x["q"], x["k"], v.detach().float(), g.float(), x["h0"], bool(normalize))
        S_ref = S_ref[0] if normalize else S_ref
        close(o, o_ref.to(o.dtype), 2 ** -7 if o.dtype == torch.bfloat16 else 2 ** -10, f"{name} o")
        close(S, S_ref, FP32, f"{name} S")
        (o.float().sum() + S.sum()).backward()
        assert (q.grad.dtype, k.grad.dtype, v.grad.dtype) == (torch.float32, torch.float32, v_dtype)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_non_finite_scale_is_refused_by_name(name, bad):
    """Item 18: scale NaN or ±inf returned all-NaN outputs (the delta rule refused it already)."""
    x = make(t=5, hv=2, gate=GATED[name] or "scalar")
    with pytest.raises(ValueError, match="scale must be finite"):
        _call(name, x["q"], x["k"], x["v"], x["g"], scale=bad)


def test_an_integer_conv_state_is_refused():
    """Item 18: causal_conv1d_update wrote the new inputs into an int64 conv_state, truncated (the later
    steps were off by 1.6); Dao's kernel takes a floating state only."""
    x, w = torch.randn(2, 4), torch.randn(4, 3)
    state = torch.zeros(2, 4, 2, dtype=torch.int64)
    with pytest.raises(TypeError, match="conv_state must be a floating tensor"):
        C.causal_conv1d_update(x, state, w)
    assert not state.any()


@pytest.mark.parametrize("name", NAMES + ["chunk_gated_delta_rule", "fused_recurrent_delta_rule"])
def test_errors_name_the_argument(name):
    """Item 19: cu_seqlens as a list (AttributeError), tensors on the meta device
    (NotImplementedError / a raw .item() error) and K = 0 (ZeroDivisionError) now name what is wrong."""
    x = make(t=6, hv=2, gate=GATED.get(name) or "scalar")
    q, k, v, g, beta = x["q"][:1], x["k"][:1], x["v"][:1], x["g"][:1], x["beta"][:1]
    call = (lambda *a, **kw: getattr(C, name)(*a, g, beta, **kw)) if "gated_delta" in name else \
        (lambda *a, **kw: getattr(C, name)(*a, beta, **kw)) if "delta" in name else \
        (lambda *a, **kw: _call(name, *a, g, **kw))
    with pytest.raises(TypeError, match="cu_seqlens must be a torch.Tensor"):
        call(q, k, v, cu_seqlens=[0, 2, 6])
    with pytest.raises(ValueError, match="meta device"):
        call(q.to("meta"), k.to("meta"), v.to("meta"))
    if GATED.get(name) != "vector":  # a per-key gate of K = 0 fails its own shape check first
        with pytest.raises(ValueError, match=r"head dim K must be ≥ 1"):
            call(q[..., :0], k[..., :0], v)


def test_a_wrong_final_states_out_is_refused_by_name():
    """Item 19: causal_conv1d_fn copied its final states into a final_states_out of the wrong shape with
    a raw size-mismatch error (after computing everything)."""
    x, w = torch.randn(2, 4, 7), torch.randn(4, 3)
    out, final = C.causal_conv1d_fn(x, w, return_final_states=True, final_states_out=torch.empty(2, 4, 2))
    assert final.shape == (2, 4, 2)
    for bad in (torch.empty(2, 4, 3), torch.empty(2, 4, 2, dtype=torch.int64), "buffer"):
        with pytest.raises((ValueError, TypeError), match="final_states_out"):
            C.causal_conv1d_fn(x, w, return_final_states=True, final_states_out=bad)


#: the delta family's names -> (o's dtype comes from v (False) or q (True), the gate: None, "scalar", "vector")
DELTA = {"chunk_delta_rule": (False, None), "fused_recurrent_delta_rule": (True, None),
         "chunk_gated_delta_rule": (False, "scalar"), "fused_recurrent_gated_delta_rule": (False, "scalar"),
         "chunk_kda": (False, "vector"), "fused_recurrent_kda": (False, "vector")}


@pytest.mark.parametrize("name", list(DELTA))
@pytest.mark.parametrize("v_dtype", [torch.float16, torch.bfloat16])
def test_mixed_dtypes_run_in_the_delta_family(name, v_dtype):
    """Item 14 for the delta rule, Gated DeltaNet and KDA: q/k float32 with v, β and the gate in half
    precision run in their promotion (float32), as FLA's kernels do; o comes back as FLA allocates
    it (like v, except fused_recurrent_delta_rule: like q), the final state in float32. Values: FLA's
    naive recurrence (KDA's, or the gated delta rule's with g = 0 for the plain rule) on the same
    (rounded) numbers; gradients come back in each input's dtype."""
    like_q, gate = DELTA[name]
    x = make(t=19, h=2, hv=2, gate=gate or "scalar", seed=11)
    v, beta, g = (x[n].to(v_dtype) for n in ("v", "beta", "g"))
    q, k = (x[n].clone().requires_grad_() for n in ("q", "k"))
    v = v.clone().requires_grad_()
    fn = getattr(C, name)
    gargs = () if gate is None else (g,)
    kw = {"beta": beta} if gate == "scalar" or gate is None else {}
    args = (q, k, v, *gargs) if gate != "vector" else (q, k, v, g, beta)
    o, S = fn(*args, **kw, initial_state=x["h0"], output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert o.dtype == (torch.float32 if like_q else v_dtype) and S.dtype == torch.float32
    qn, kn = (torch.nn.functional.normalize(t, dim=-1, eps=1e-6) for t in (x["q"], x["k"]))
    gf = g.float() if gate else torch.zeros(x["v"].shape[:3])
    if gate == "vector":
        o_ref, S_ref = peer("fla.ops.kda.naive").naive_recurrent_kda(
            qn, kn, v.detach().float(), gf, beta.float(), initial_state=x["h0"], output_final_state=True)
    else:
        o_ref, S_ref = peer("fla.ops.gated_delta_rule.naive").naive_recurrent_gated_delta_rule(
            qn, kn, v.detach().float(), beta.float(), gf, initial_state=x["h0"], output_final_state=True)
    close(o, o_ref.to(o.dtype), 2 ** -7 if o.dtype == torch.bfloat16 else 2 ** -10, f"{name} o")
    close(S, S_ref, FP32, f"{name} S")
    (o.float().sum() + S.sum()).backward()
    assert (q.grad.dtype, k.grad.dtype, v.grad.dtype) == (torch.float32, torch.float32, v_dtype)
