"""linattn.compat.fla's delta rule and gated delta rule against the peers' own code: transformers'
torch fallbacks of Qwen3.5 (torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule) and FLA's
naive references (naive_recurrent/naive_chunk_gated_delta_rule, delta_rule_recurrence,
delta_rule_chunkwise, naive_gdn_gate). Rule of comparison: tests/compat_fla_peers.py."""

import pytest
import torch
import torch.nn.functional as F

from linattn.compat import fla as C
from linattn.ops.delta.reference import l2_normalize

from .compat_fla_peers import F64, FP32, close, grouped, leaves, loss, make, peer, qwen35


def _inputs(hv_mult=2, l2norm=True, t=37, state=True, seed=0, **kw):
    x = make(hv=2 * hv_mult, t=t, state=state, seed=seed, **kw)
    if not l2norm:  # unnormalized keys make the delta rule unstable; give unit keys instead
        x["k"] = F.normalize(x["k"], dim=-1)
    return x


@pytest.mark.parametrize("hv_mult", [1, 2])
@pytest.mark.parametrize("l2norm", [True, False])
@pytest.mark.parametrize("state", [True, False])
def test_chunk_gated_delta_rule_equals_transformers_chunk(hv_mult, l2norm, state):
    ref = qwen35("torch_chunk_gated_delta_rule")
    x = _inputs(hv_mult, l2norm, state=state)
    o_ref, S_ref = ref(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["h0"], output_final_state=True,
                       use_qk_l2norm_in_kernel=l2norm)
    d = {n: None if t is None else t.double() for n, t in x.items()}
    o, S = C.chunk_gated_delta_rule(d["q"], d["k"], d["v"], d["g"], d["beta"], initial_state=d["h0"],
                                    output_final_state=True, use_qk_l2norm_in_kernel=l2norm)
    assert o.dtype is torch.float64 and S.dtype is torch.float64
    close(o, o_ref, FP32, "o")
    close(S, S_ref, FP32, "final state")
    o32, S32 = C.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["h0"],
                                        output_final_state=True, use_qk_l2norm_in_kernel=l2norm)
    assert o32.dtype is torch.float32 and S32.dtype is torch.float32
    close(o32, o_ref, FP32, "o (float32)")
    close(S32, S_ref, FP32, "final state (float32)")


@pytest.mark.parametrize("hv_mult", [1, 2])
def test_chunk_gated_delta_rule_gradients_equal_transformers(hv_mult):
    ref = qwen35("torch_chunk_gated_delta_rule")
    x = _inputs(hv_mult, t=21, seed=3)
    names = ["q", "k", "v", "g", "beta", "h0"]
    a, b = leaves(x, torch.float32), leaves(x)
    o_ref, S_ref = ref(a["q"], a["k"], a["v"], a["g"], a["beta"], initial_state=a["h0"], output_final_state=True,
                       use_qk_l2norm_in_kernel=True)
    loss(o_ref, S_ref).backward()
    o, S = C.chunk_gated_delta_rule(b["q"], b["k"], b["v"], b["g"], b["beta"], initial_state=b["h0"],
                                    output_final_state=True, use_qk_l2norm_in_kernel=True)
    loss(o, S).backward()
    for n in names:
        close(b[n].grad, a[n].grad, 1e-4, f"d{n}")


@pytest.mark.parametrize("hv_mult", [1, 2])
@pytest.mark.parametrize("t", [1, 9])
def test_fused_recurrent_gated_delta_rule_equals_transformers_recurrent(hv_mult, t):
    """T = 1 from a state is the decoding step (the fused step operator, no gradient)."""
    ref = qwen35("torch_recurrent_gated_delta_rule")
    x = _inputs(hv_mult, t=t, seed=5)
    o_ref, S_ref = ref(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["h0"], output_final_state=True,
                       use_qk_l2norm_in_kernel=True)
    for dtype in (torch.float64, torch.float32):
        d = {n: v.to(dtype) for n, v in x.items()}
        with torch.no_grad():
            o, S = C.fused_recurrent_gated_delta_rule(d["q"], d["k"], d["v"], d["g"], beta=d["beta"],
                                                      initial_state=d["h0"], output_final_state=True,
                                                      use_qk_l2norm_in_kernel=True)
        close(o, o_ref, FP32, f"o {dtype}")
        close(S, S_ref, FP32, f"state {dtype}")


@pytest.mark.parametrize("scale", [None, 0.3])
@pytest.mark.parametrize("t", [37, 64])
def test_gated_delta_rule_equals_fla_naive(scale, t):
    """FLA's naive references take one head count for q, k and v: q/k are given to them repeated."""
    nv = peer("fla.ops.gated_delta_rule.naive")
    x = _inputs(2, l2norm=False, t=t, seed=7)
    qg, kg = grouped(x["q"], 4), grouped(x["k"], 4)
    o_rec, S_rec = nv.naive_recurrent_gated_delta_rule(qg, kg, x["v"], x["beta"], x["g"], scale=scale,
                                                       initial_state=x["h0"], output_final_state=True)
    o_chk, S_chk = nv.naive_chunk_gated_delta_rule(qg, kg, x["v"], x["g"], x["beta"], scale=scale,
                                                   initial_state=x["h0"], output_final_state=True)
    d = {n: v.double() for n, v in x.items()}
    for fn in (C.chunk_gated_delta_rule, C.fused_recurrent_gated_delta_rule):
        o, S = fn(d["q"], d["k"], d["v"], d["g"], beta=d["beta"], scale=scale, initial_state=d["h0"],
                  output_final_state=True)
        for name, o_ref, S_ref in (("recurrent", o_rec, S_rec), ("chunk", o_chk, S_chk)):
            close(o, o_ref, FP32, f"{fn.__name__} o vs naive {name}")
            close(S, S_ref, FP32, f"{fn.__name__} S vs naive {name}")


def test_use_gate_in_kernel_equals_fla_gate():
    """g ← −exp(A_log)·softplus(g + dt_bias) (FLA's naive_gdn_gate; transformers' Qwen3.5 layer)."""
    gate = peer("fla.ops.gated_delta_rule.gate")
    x = _inputs(2, seed=11)
    raw = torch.randn(x["g"].shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    A_log = torch.linspace(-1.0, 2.0, 4, dtype=torch.float64)
    dt_bias = torch.linspace(-0.5, 0.5, 4, dtype=torch.float64)
    d = {n: v.double() for n, v in x.items()}
    for bias in (dt_bias, None):
        g_ref = gate.naive_gdn_gate(raw, A_log, bias, output_dtype=torch.float64)
        for fn in (C.chunk_gated_delta_rule, C.fused_recurrent_gated_delta_rule):
            o_in, S_in = fn(d["q"], d["k"], d["v"], raw, beta=d["beta"], initial_state=d["h0"], output_final_state=True,
                            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log, dt_bias=bias)
            o, S = fn(d["q"], d["k"], d["v"], g_ref, beta=d["beta"], initial_state=d["h0"], output_final_state=True,
                      use_qk_l2norm_in_kernel=True)
            close(o_in, o, FP32, "o with the gate in the kernel")  # naive_gdn_gate computes in float32
            close(S_in, S, FP32, "state with the gate in the kernel")


def test_beta_sigmoid_and_state_v_first():
    x = {n: v.double() for n, v in _inputs(2, seed=13).items()}
    logits = torch.logit(x["beta"])
    base = C.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["h0"],
                                    output_final_state=True, use_qk_l2norm_in_kernel=True)
    sig = C.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], logits, initial_state=x["h0"],
                                   output_final_state=True, use_qk_l2norm_in_kernel=True,
                                   use_beta_sigmoid_in_kernel=True)
    vf = C.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["h0"].mT,
                                  output_final_state=True, use_qk_l2norm_in_kernel=True, state_v_first=True)
    close(sig[0], base[0], F64, "o, β from logits")
    close(sig[1], base[1], F64, "state, β from logits")
    close(vf[0], base[0], F64, "o, state_v_first")
    close(vf[1].mT, base[1], F64, "state, state_v_first")


@pytest.mark.parametrize("t", [1, 29])
def test_delta_rule_equals_fla_recurrence(t):
    """delta_rule_recurrence is head-first (B, H, T, D), scale K^−1/2, float32."""
    nv = peer("fla.ops.delta_rule.naive")
    x = _inputs(2, l2norm=False, t=t, seed=17)
    hf = {n: v.transpose(1, 2) for n, v in x.items() if n in ("q", "k", "v", "beta")}
    hf["q"], hf["k"] = grouped(x["q"], 4).transpose(1, 2), grouped(x["k"], 4).transpose(1, 2)
    o_ref, S_ref = nv.delta_rule_recurrence(hf["q"], hf["k"], hf["v"], hf["beta"], initial_state=x["h0"],
                                            output_final_state=True)
    o_ones, S_ones = nv.delta_rule_recurrence(hf["q"], hf["k"], hf["v"], torch.ones_like(hf["beta"]),
                                              initial_state=x["h0"], output_final_state=True)
    d = {n: v.double() for n, v in x.items()}
    with torch.no_grad():
        for fn in (C.chunk_delta_rule, C.fused_recurrent_delta_rule):
            o, S = fn(d["q"], d["k"], d["v"], d["beta"], initial_state=d["h0"], output_final_state=True)
            close(o, o_ref.transpose(1, 2), FP32, f"{fn.__name__} o")
            close(S, S_ref, FP32, f"{fn.__name__} S")
        o, S = C.fused_recurrent_delta_rule(d["q"], d["k"], d["v"], initial_state=d["h0"], output_final_state=True)
        close(o, o_ones.transpose(1, 2), FP32, "beta=None is β = 1")
        close(S, S_ones, FP32, "beta=None is β = 1 (state)")


def test_chunk_delta_rule_equals_fla_chunkwise_in_float64():
    """delta_rule_chunkwise keeps float64 (T a multiple of its chunk of 32, zero initial state)."""
    nv = peer("fla.ops.delta_rule.naive")
    x = {n: v.double() for n, v in _inputs(1, l2norm=False, t=64, state=False, seed=19).items() if v is not None}
    o_ref, S_ref = nv.delta_rule_chunkwise(*(x[n].transpose(1, 2) for n in ("q", "k", "v", "beta")), chunk_size=32)
    o, S = C.chunk_delta_rule(x["q"], x["k"], x["v"], x["beta"], output_final_state=True)
    close(o, o_ref.transpose(1, 2), F64, "o")
    close(S, S_ref, F64, "S")


def test_delta_rule_gva_equals_transformers_with_zero_decay():
    """GVA of the plain delta rule: transformers' gated fallback with g = 0 (α = 1) reads it alike."""
    ref = qwen35("torch_chunk_gated_delta_rule")
    x = _inputs(2, seed=23)
    o_ref, S_ref = ref(x["q"], x["k"], x["v"], torch.zeros_like(x["g"]), x["beta"], initial_state=x["h0"],
                       output_final_state=True, use_qk_l2norm_in_kernel=True)
    d = {n: v.double() for n, v in x.items()}
    o, S = C.chunk_delta_rule(d["q"], d["k"], d["v"], d["beta"], initial_state=d["h0"], output_final_state=True,
                              use_qk_l2norm_in_kernel=True)
    close(o, o_ref, FP32, "o")
    close(S, S_ref, FP32, "S")


def test_bf16_inputs_follow_transformers():
    """bf16 q/k/v with float32 gates and state, as a bf16 model passes them: output in bf16, state
    in float32, within bf16 rounding of transformers' fallback (which computes in float32)."""
    ref = qwen35("torch_chunk_gated_delta_rule")
    x = _inputs(2, seed=29)
    qb, kb, vb = (x[n].bfloat16() for n in ("q", "k", "v"))
    o_ref, S_ref = ref(qb, kb, vb, x["g"], x["beta"], initial_state=x["h0"], output_final_state=True,
                       use_qk_l2norm_in_kernel=True)
    o, S = C.chunk_gated_delta_rule(qb, kb, vb, x["g"], x["beta"], initial_state=x["h0"], output_final_state=True,
                                    use_qk_l2norm_in_kernel=True)
    assert o.dtype is torch.bfloat16 and S.dtype is torch.float32
    close(o, o_ref, 2e-2, "o")
    close(S, S_ref, 2e-2, "S")


def olmo_hybrid(name: str):
    """transformers' torch fallback `name` of OLMo-Hybrid (the model of linear_allow_neg_eigval), undecorated."""
    import inspect

    mod = peer("transformers.models.olmo_hybrid.modeling_olmo_hybrid")
    return inspect.unwrap(getattr(mod, name))


@pytest.mark.parametrize("t", [1, 37])
def test_allow_neg_eigval_equals_the_peers(t):
    """allow_neg_eigval with use_beta_sigmoid_in_kernel: β = 2·sigmoid(logits) ∈ (0, 2), as FLA's kernels
    compute it; against OLMo-Hybrid's torch rules (fed 2·sigmoid, as its layer does) and FLA's naive
    recurrence, outputs, states and (chunked) gradients. Before, allow_neg_eigval was refused."""
    x = _inputs(2, t=t, seed=31)
    logits = 3 * torch.randn(x["beta"].shape, generator=torch.Generator().manual_seed(1))
    logits[..., 0, :] = 30.0  # β = 2 exactly in float32
    beta = 2 * logits.sigmoid()
    assert (beta > 1).any() and (beta == 2).any()
    chunk, rec = olmo_hybrid("torch_chunk_gated_delta_rule"), olmo_hybrid("torch_recurrent_gated_delta_rule")
    nv = peer("fla.ops.gated_delta_rule.naive")
    a, b = leaves(dict(x, beta=beta), torch.float32), leaves(dict(x, beta=logits))
    o_ref, S_ref = chunk(a["q"], a["k"], a["v"], a["g"], a["beta"], initial_state=a["h0"], output_final_state=True,
                         use_qk_l2norm_in_kernel=True)
    o_rec, S_rec = rec(x["q"], x["k"], x["v"], x["g"], beta, initial_state=x["h0"], output_final_state=True,
                       use_qk_l2norm_in_kernel=True)
    qn, kn = (l2_normalize(grouped(x[n], 4)) for n in ("q", "k"))
    o_nv, S_nv = nv.naive_recurrent_gated_delta_rule(qn, kn, x["v"], beta, x["g"], initial_state=x["h0"],
                                                     output_final_state=True)
    o, S = C.chunk_gated_delta_rule(b["q"], b["k"], b["v"], b["g"], b["beta"], initial_state=b["h0"],
                                    output_final_state=True, use_qk_l2norm_in_kernel=True,
                                    use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True)
    for name, (o2, S2) in (("OLMo-Hybrid chunk", (o_ref, S_ref)), ("OLMo-Hybrid recurrent", (o_rec, S_rec)),
                           ("FLA naive", (o_nv, S_nv))):
        close(o, o2, FP32 if name != "FLA naive" else 1e-4, f"o vs {name}")
        close(S, S2, FP32 if name != "FLA naive" else 1e-4, f"S vs {name}")
    loss(o, S).backward()
    loss(o_ref, S_ref).backward()
    for n in ("q", "k", "v", "g", "h0"):
        close(b[n].grad, a[n].grad, 1e-4, f"d{n}")
    close(b["beta"].grad, a["beta"].grad * 2 * logits.sigmoid() * (1 - logits.sigmoid()), 1e-4, "d logits")
    with torch.no_grad():
        o_s, S_s = C.fused_recurrent_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], beta=logits,
                                                      initial_state=x["h0"], output_final_state=True,
                                                      use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                                                      allow_neg_eigval=True)
    close(o_s, o_rec, FP32, "fused_recurrent o")
    close(S_s, S_rec, FP32, "fused_recurrent S")


def test_allow_neg_eigval_needs_the_sigmoid_and_beta_zero_is_a_masked_token():
    """As FLA: allow_neg_eigval without use_beta_sigmoid_in_kernel is a ValueError naming both, while a
    β already in [0, 2] runs as given. β = 0 exactly, or logits so negative that sigmoid(·) underflows
    to 0 (≤ −104 in float32), is a masked token (issue 37 item 16; before: refused)."""
    x = {n: v.double() for n, v in _inputs(2, seed=37).items()}
    for fn in (C.chunk_gated_delta_rule, C.fused_recurrent_gated_delta_rule):
        with pytest.raises(ValueError, match="allow_neg_eigval=True requires use_beta_sigmoid_in_kernel"):
            fn(x["q"], x["k"], x["v"], x["g"], beta=x["beta"], allow_neg_eigval=True)
    beta = x["beta"].clone()
    beta[:, 5] = 0.0
    logits = torch.logit(x["beta"].float())
    logits[:, 5] = -200.0
    assert (logits.sigmoid()[:, 5] == 0).all()
    o, S = C.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], beta, initial_state=x["h0"],
                                    output_final_state=True, use_qk_l2norm_in_kernel=True)
    o2, S2 = C.fused_recurrent_gated_delta_rule(x["q"].float(), x["k"].float(), x["v"].float(), x["g"].float(),
                                                beta=logits, initial_state=x["h0"].float(), output_final_state=True,
                                                use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)
    o3, S3 = C.chunk_delta_rule(x["q"], x["k"], x["v"], beta, initial_state=x["h0"], output_final_state=True)
    ref = qwen35("torch_chunk_gated_delta_rule")
    o_ref, S_ref = ref(x["q"], x["k"], x["v"], x["g"], beta, initial_state=x["h0"], output_final_state=True,
                       use_qk_l2norm_in_kernel=True)
    close(o, o_ref, FP32, "o, β = 0 at one token")
    close(S, S_ref, FP32, "S, β = 0 at one token")
    close(o2, o_ref, 1e-4, "o, logits −200 at one token")
    close(S2, S_ref, 1e-4, "S, logits −200 at one token")
    o_ref3, S_ref3 = ref(x["q"], x["k"], x["v"], torch.zeros_like(x["g"]), beta, initial_state=x["h0"],
                         output_final_state=True)
    close(o3, o_ref3, FP32, "chunk_delta_rule o, β = 0")
    close(S3, S_ref3, FP32, "chunk_delta_rule S, β = 0")


@pytest.mark.parametrize("fn", ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"])
def test_transpose_state_layout_is_state_v_first(fn):
    """FLA's deprecated transpose_state_layout=True is state_v_first=True, with a DeprecationWarning, and
    both at once a ValueError, as in FLA's gated delta rule (issue 37 item 13; before: a TypeError)."""
    x = {n: v.double() for n, v in _inputs(2, seed=41).items()}
    f = getattr(C, fn)
    base = f(x["q"], x["k"], x["v"], x["g"], beta=x["beta"], initial_state=x["h0"], output_final_state=True,
             use_qk_l2norm_in_kernel=True)
    with pytest.warns(DeprecationWarning, match="transpose_state_layout"):
        alias = f(x["q"], x["k"], x["v"], x["g"], beta=x["beta"], initial_state=x["h0"].mT, output_final_state=True,
                  use_qk_l2norm_in_kernel=True, transpose_state_layout=True)
    close(alias[0], base[0], F64, "o")
    close(alias[1].mT, base[1], F64, "state, V-first")
    with pytest.raises(ValueError, match="not both"):
        f(x["q"], x["k"], x["v"], x["g"], beta=x["beta"], state_v_first=True, transpose_state_layout=True)
