"""linattn.compat.fla with cu_seqlens (packed sequences in a batch of 1, per-sequence initial and
final states [N, …]) against the peers run on each sequence by itself: FLA's naive references,
transformers' Qwen3.5 fallbacks (gated delta rule, causal convolution with seq_idx). Lengths include
1 and lengths that are not a multiple of any chunk."""

import torch
import torch.nn.functional as F

from linattn.compat import fla as C
from linattn.compat.fla.retention import retention_decays

from .compat_fla_peers import F64, FP32, close, grouped, leaves, loss, make, peer, qwen35

LENGTHS = (7, 1, 40, 16)
CU = torch.tensor([0, 7, 8, 48, 64])


def _packed(hv=4, gate="scalar", seed=0, positive=False, unit_keys=False):
    """One row of T = 64 tokens and per-sequence states h0 [N, HV, K, V]."""
    x = make(b=1, t=int(CU[-1]), hv=hv, gate=gate, seed=seed, state=False)
    x["h0"] = torch.randn(len(LENGTHS), hv, 8, 6, generator=torch.Generator().manual_seed(seed + 1))
    if positive:
        x["q"], x["k"] = x["q"].sigmoid(), x["k"].sigmoid()
    if unit_keys:
        x["k"] = F.normalize(x["k"], dim=-1)
    return x


def _per_sequence(x, run):
    """run(piece, n) -> (o, state) on sequence n's tokens (batch 1) and its state: the outputs
    concatenated along T and the states stacked along N."""
    outs, states = [], []
    for n in range(len(LENGTHS)):
        s, e = int(CU[n]), int(CU[n + 1])
        piece = {k: v[:, s:e] if k != "h0" and v is not None and v.dim() > 1 and v.shape[0] == 1 else v
                 for k, v in x.items()}
        o, S = run(piece, n)
        outs.append(o)
        states.append(S)
    return torch.cat(outs, 1), states


def _double(x):
    return {n: v.double() for n, v in x.items()}


def test_gated_delta_rule_packed_equals_transformers_per_sequence():
    ref = qwen35("torch_chunk_gated_delta_rule")
    x = _packed(seed=1)
    o_ref, S_ref = _per_sequence(x, lambda p, n: ref(p["q"], p["k"], p["v"], p["g"], p["beta"],
                                                     initial_state=x["h0"][n:n + 1], output_final_state=True,
                                                     use_qk_l2norm_in_kernel=True))
    d = _double(x)
    for fn in (C.chunk_gated_delta_rule, C.fused_recurrent_gated_delta_rule):
        o, S = fn(d["q"], d["k"], d["v"], d["g"], beta=d["beta"], initial_state=d["h0"], output_final_state=True,
                  use_qk_l2norm_in_kernel=True, cu_seqlens=CU)
        close(o, o_ref, FP32, f"{fn.__name__} o")
        close(S, torch.cat(S_ref, 0), FP32, f"{fn.__name__} states")


def test_gated_delta_rule_packed_gradients_equal_transformers():
    ref = qwen35("torch_chunk_gated_delta_rule")
    x = _packed(seed=2)
    names = ("q", "k", "v", "g", "beta", "h0")
    a, b = leaves(x, torch.float32), leaves(x)
    o_ref, S_ref = _per_sequence(a, lambda p, n: ref(p["q"], p["k"], p["v"], p["g"], p["beta"],
                                                     initial_state=a["h0"][n:n + 1], output_final_state=True,
                                                     use_qk_l2norm_in_kernel=True))
    loss(o_ref, torch.cat(S_ref, 0)).backward()
    o, S = C.chunk_gated_delta_rule(b["q"], b["k"], b["v"], b["g"], b["beta"], initial_state=b["h0"],
                                    output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=CU)
    loss(o, S).backward()
    for n in names:
        close(b[n].grad, a[n].grad, 1e-4, f"d{n}")


def test_delta_rule_packed_equals_fla_recurrence_per_sequence():
    nv = peer("fla.ops.delta_rule.naive")
    x = _packed(seed=3, unit_keys=True)

    def one(p, n):
        hf = [grouped(p["q"], 4), grouped(p["k"], 4), p["v"], p["beta"]]
        o, S = nv.delta_rule_recurrence(*(t.transpose(1, 2) for t in hf), initial_state=x["h0"][n:n + 1],
                                        output_final_state=True)
        return o.transpose(1, 2), S

    o_ref, S_ref = _per_sequence(x, one)
    d = _double(x)
    for fn in (C.chunk_delta_rule, C.fused_recurrent_delta_rule):
        o, S = fn(d["q"], d["k"], d["v"], d["beta"], initial_state=d["h0"], output_final_state=True, cu_seqlens=CU)
        close(o, o_ref, FP32, f"{fn.__name__} o")
        close(S, torch.cat(S_ref, 0), FP32, f"{fn.__name__} states")


def test_simple_gla_gla_retention_packed_equal_fla_per_sequence():
    sgla, gla = peer("fla.ops.simple_gla.naive"), peer("fla.ops.gla.naive")
    for name, gate in (("simple_gla", "scalar"), ("gla", "vector"), ("retention", None)):
        x = _packed(seed=4, gate=gate or "scalar")
        gamma = retention_decays(4).float()

        def one(p, n):
            q, k = grouped(p["q"], 4), grouped(p["k"], 4)
            h0 = x["h0"][n:n + 1]
            if name == "gla":
                return gla.naive_recurrent_gla(q, k, p["v"], p["g"], initial_state=h0, output_final_state=True)
            g = p["g"] if name == "simple_gla" else gamma.expand(1, q.shape[1], 4)
            return sgla.naive_recurrent_simple_gla(q, k, p["v"], g, initial_state=h0, output_final_state=True)

        o_ref, S_ref = _per_sequence(x, one)
        d = _double(x)
        chunk, rec = {"simple_gla": (C.chunk_simple_gla, C.fused_recurrent_simple_gla),
                      "gla": (C.chunk_gla, C.fused_recurrent_gla),
                      "retention": (C.chunk_retention, C.fused_recurrent_retention)}[name]
        gates = () if name == "retention" else (d["g"],)
        for fn in (chunk, rec):
            o, S = fn(d["q"], d["k"], d["v"], *gates, initial_state=d["h0"], output_final_state=True, cu_seqlens=CU)
            close(o, o_ref, FP32, f"{fn.__name__} o")
            close(S, torch.cat(S_ref, 0), FP32, f"{fn.__name__} states")


def test_linear_attn_packed_equals_fla_per_sequence():
    nv = peer("fla.ops.linear_attn.naive")
    x = _packed(seed=5, positive=True)
    z0 = torch.rand(len(LENGTHS), 1, 4, 8)
    o_ref, st = _per_sequence(x, lambda p, n: nv.naive_recurrent_linear_attn(
        grouped(p["q"], 4), grouped(p["k"], 4), p["v"], initial_state=(x["h0"][n:n + 1], z0[n:n + 1]),
        output_final_state=True, normalize=True))
    d = _double(x)
    for fn in (C.chunk_linear_attn, C.fused_recurrent_linear_attn):
        o, (S, z) = fn(d["q"], d["k"], d["v"], initial_state=(d["h0"], z0.double()), output_final_state=True,
                       normalize=True, cu_seqlens=CU)
        close(o, o_ref, FP32, f"{fn.__name__} o")
        close(S, torch.cat([s[0] for s in st], 0), FP32, f"{fn.__name__} S")
        close(z, torch.cat([s[1] for s in st], 0), FP32, f"{fn.__name__} z")


def test_causal_conv1d_seq_idx_equals_transformers_per_sequence():
    """seq_idx (Dao's packed form): each run of equal ids convolved by itself, in float64."""
    ref = qwen35("causal_conv1d_fn")
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(2, 5, 64, generator=gen, dtype=torch.float64)
    weight, bias = torch.randn(5, 4, generator=gen, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    ids = torch.repeat_interleave(torch.arange(len(LENGTHS)), torch.tensor(LENGTHS)).int()
    seq_idx = torch.stack((ids, torch.zeros_like(ids)))  # row 1: one sequence
    out = C.causal_conv1d_fn(x, weight, bias, seq_idx=seq_idx, activation="silu")
    pieces = [ref(x[:1, :, int(CU[n]):int(CU[n + 1])], weight, bias, activation="silu") for n in range(len(LENGTHS))]
    close(out[:1], torch.cat(pieces, -1), F64, "row of four sequences")
    close(out[1:], ref(x[1:], weight, bias, activation="silu"), F64, "row of one sequence")
