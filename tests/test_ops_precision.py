"""How bf16 inputs are multiplied (linattn.ops.precision, native.bf16_choice): the rule, the
environment switch, and the fp32 path of the fused kernels (blocks widened in cache, fp32 gemms,
outputs rounded once) against the fp32 kernels on the widened inputs and against the bf16 path."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from linattn.nn.feature_maps import EluPlusOne
from linattn.ops import gated_linear_attention, gated_linear_attention_step, linear_attention, linear_attention_step
from linattn.ops import native, precision
from linattn.ops.linear.chunked import compute_dtype
from linattn.ops.gated import fused as gated_fused
from linattn.ops.gated.reference import gated_recurrence
from linattn.nn.positional import RotaryEmbedding

from .conftest import oracle

needs_native = pytest.mark.skipif(not native.available(), reason="the fused CPU kernels could not be built here")
BF16, FP32 = torch.bfloat16, torch.float32


def _never():
    raise AssertionError("the flags decide here: the probe must not run")


def test_the_flags_decide_where_they_can_and_a_probe_elsewhere():
    amx = precision.choose({"amx": True, "dot": True}, _never, "the gemm")
    assert (amx.dtype, amx.reason, amx.speedup, amx.forced) == (BF16, "AMX", None, False)
    none = precision.choose({"amx": False, "dot": False}, _never, "the gemm")
    assert none.dtype == FP32 and "no bf16 instructions" in none.reason
    fast = precision.choose({"amx": False, "dot": True}, lambda: 2.5, "the gemm")
    assert (fast.dtype, fast.speedup) == (BF16, 2.5) and fast.reason == "no AMX; the gemm measured 2.5× faster than fp32"
    slow = precision.choose({"amx": False, "dot": True}, lambda: 0.4, "the gemm")
    assert slow.dtype == FP32 and slow.reason == "no AMX; the gemm measured 2.5× slower than fp32"
    tie = precision.choose({"amx": None, "dot": None}, lambda: 1.0, "the gemm")  # unknown flags: probed; a tie: fp32
    assert tie.dtype == FP32 and tie.reason.startswith("CPU flags unknown")
    untimed = precision.choose({"amx": False, "dot": True}, None, "the gemm")  # no probe: fp32 without AMX
    assert (untimed.dtype, untimed.speedup) == (FP32, None)
    assert untimed.reason == "no AMX; the gemm is faster than fp32 only with AMX"
    assert precision.choose({"amx": True, "dot": True}, None, "the gemm").dtype == BF16

    def broken():
        raise RuntimeError("no")

    failed = precision.choose({"amx": False, "dot": True}, broken, "the gemm")
    assert failed.dtype == FP32 and "timing the gemm failed (RuntimeError)" in failed.reason


def test_the_environment_forces_either_path_unless_there_is_no_bf16_gemm():
    fp32 = precision.choose({"amx": True, "dot": True}, _never, "the gemm", "fp32")
    assert (fp32.dtype, fp32.forced, fp32.reason) == (FP32, True, "forced by LINATTN_BF16_PATH=fp32")
    bf16 = precision.choose({"amx": False, "dot": False}, _never, "the gemm", "bf16")
    assert (bf16.dtype, bf16.forced, bf16.label) == (BF16, True, "bf16 gemms")
    absent = precision.choose({"amx": True, "dot": True}, _never, "MKL's bf16 gemm", "bf16", available=False)
    assert absent.dtype == FP32 and absent.reason == "MKL's bf16 gemm is not available" and absent.label == "fp32 gemms"


def test_mode_reads_the_environment_and_names_it_when_wrong(monkeypatch):
    monkeypatch.delenv("LINATTN_BF16_PATH", raising=False)
    assert precision.mode() == "auto"
    monkeypatch.setenv("LINATTN_BF16_PATH", " FP32 ")
    assert precision.mode() == "fp32"
    monkeypatch.setenv("LINATTN_BF16_PATH", "fast")
    with pytest.raises(ValueError, match=r"LINATTN_BF16_PATH must be one of \('auto', 'bf16', 'fp32'\), got 'fast'"):
        precision.mode()
    with pytest.raises(ValueError, match="LINATTN_BF16_PATH"):
        compute_dtype(BF16, torch.device("cpu"))


def test_a_choice_is_made_once_per_process_and_mode(monkeypatch):
    monkeypatch.setattr(precision, "_cache", {})
    made = []

    def make(m):
        made.append(m)
        return precision.choose({"amx": False, "dot": True}, lambda: 3.0, "x", m)

    monkeypatch.delenv("LINATTN_BF16_PATH", raising=False)
    assert precision.cached_choice("k", make).dtype == BF16
    assert precision.cached_choice("k", make).dtype == BF16
    monkeypatch.setenv("LINATTN_BF16_PATH", "fp32")
    assert precision.cached_choice("k", make).dtype == FP32
    assert precision.cached_choice("k", make).dtype == FP32
    assert made == ["auto", "fp32"]


def test_the_cpu_features_agree_with_proc_cpuinfo_with_and_without_torch_capabilities(monkeypatch):
    flags = precision._proc_cpu_flags()
    if flags is None or "fpu" not in flags:
        pytest.skip("no x86 /proc/cpuinfo here")
    want = {"amx": "amx_bf16" in flags and "amx_tile" in flags}
    want["dot"] = want["amx"] or "avx512_bf16" in flags
    assert precision.cpu_bf16_features() == want
    monkeypatch.delattr(torch.cpu, "get_capabilities", raising=False)  # torch before get_capabilities
    assert precision.cpu_bf16_features() == want


def test_compute_dtype_follows_the_choice_on_the_cpu_and_keeps_bf16_on_cuda(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    for mode, want in (("bf16", BF16), ("fp32", FP32)):
        monkeypatch.setenv("LINATTN_BF16_PATH", mode)
        assert compute_dtype(BF16, cpu) == want
        assert compute_dtype(BF16, cuda) == BF16
        assert compute_dtype(torch.float16, cpu) == compute_dtype(torch.float16, cuda) == FP32
        assert compute_dtype(FP32, cpu) == FP32 and compute_dtype(torch.float64, cpu) == torch.float64


@needs_native
def test_native_reports_and_exposes_its_choice(monkeypatch):
    monkeypatch.setenv("LINATTN_BF16_PATH", "fp32")
    assert native.bf16_compute() == FP32 and native.wide(torch.zeros(1, dtype=BF16))
    assert not native.wide(torch.zeros(1))
    s = native.bf16_summary()
    assert s["mode"] == "fp32" and s["fused"]["dtype"] == "float32" and s["torch_ops"]["path"] == "fp32 gemms"
    assert s["line"] == ("bf16 → fused kernels: fp32 gemms (forced by LINATTN_BF16_PATH=fp32); "
                         "torch ops: fp32 gemms (forced by LINATTN_BF16_PATH=fp32)")
    monkeypatch.setenv("LINATTN_BF16_PATH", "bf16")
    tiles = native.bf16_tiles()
    has = bool(torch.ops.linattn_cpu.has_blas_bf16()) or tiles
    assert native.bf16_compute() == (BF16 if has else FP32)
    monkeypatch.setenv("LINATTN_BF16_PATH", "auto")
    auto = native.bf16_choice()
    feats = precision.cpu_bf16_features()
    assert auto.speedup is None and not auto.forced  # the fused kernels' choice is never timed
    # bf16 gemms: linattn's own tiles where the CPU has AVX512-BF16, else MKL's with AMX
    assert tiles == bool(feats["dot"] and torch.ops.linattn_cpu.uses_tile_gemm())
    assert auto.dtype == (BF16 if tiles or (feats["amx"] and has) else FP32)
    assert auto.reason == ("AVX512-BF16: linattn's bf16 register tiles" if tiles else "AMX" if auto.dtype == BF16
                           else auto.reason)


def _bf16(*shape, gen, positive=False):
    x = torch.randn(*shape, generator=gen)
    return (x.abs() + 0.1 if positive else x).bfloat16()


def _rounded_once(low: torch.Tensor, ref: torch.Tensor) -> None:
    """low (bf16) is ref (fp32, from the same inputs by the fp32 kernel) rounded once: within half a
    bf16 ulp of it (2⁻⁸ relative), allowing fp32-level differences of the gemms' summation order."""
    assert low.dtype == BF16
    err = (low.double() - ref.double()).abs()
    bound = ref.double().abs() * 2.0 ** -8 + 1e-6 * ref.abs().max().item()
    assert (err <= bound).all(), (err - bound).max().item()


@needs_native
@settings(max_examples=12, deadline=None)
@given(b=st.integers(1, 2), h=st.integers(1, 3), n=st.one_of(st.integers(1, 80), st.integers(500, 700)),
       f=st.integers(1, 40), e=st.integers(1, 40), chunk=st.sampled_from([7, 64]), elu=st.booleans(),
       normalize=st.booleans(), seed=st.integers(0, 2**16))
def test_the_fp32_path_is_the_fp32_kernel_on_the_widened_inputs(b, h, n, f, e, chunk, elu, normalize, seed):
    """linattn_cpu::chunked and chunked_backward with wide=True on bf16 q, k, v: outputs and input
    gradients are the fp32 kernels' on q.float(), … rounded once; states, denominators, saved block
    states and the initial state's gradients equal theirs (up to the gemms' summation order)."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (_bf16(b, h, n, f, gen=gen, positive=not elu) for _ in range(2))
    v, do = (_bf16(b, h, n, e, gen=gen) for _ in range(2))
    kv0, z0 = torch.randn(b, h, f, e, generator=gen), torch.rand(b, h, f, generator=gen) + 1
    dkv, dz = torch.randn(b, h, f, e, generator=gen), torch.randn(b, h, f, generator=gen)
    phi, ops = int(elu), torch.ops.linattn_cpu
    low = ops.chunked(q, k, v, kv0, z0, phi, normalize, 1e-6, chunk, True, True)
    ref = ops.chunked(q.float(), k.float(), v.float(), kv0, z0, phi, normalize, 1e-6, chunk, True)
    _rounded_once(low[0], ref[0])
    for a, r in zip(low[1:], ref[1:]):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-5 * max(1.0, r.abs().max().item() if r.numel() else 1.0))
    o, den, sb, zb = low[0], low[3], low[4], low[5]
    g_low = ops.chunked_backward(q, k, v, o, do, den, sb, zb, dkv, dz, phi, normalize, chunk, True)
    g_ref = ops.chunked_backward(q.float(), k.float(), v.float(), o.float(), do.float(), den, sb, zb, dkv, dz, phi,
                                 normalize, chunk)
    for a, r in zip(g_low[:3], g_ref[:3]):
        _rounded_once(a, r)
    for a, r in zip(g_low[3:], g_ref[3:]):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-5 * r.abs().max().item())


@needs_native
@pytest.mark.parametrize("vector", [False, True])
@pytest.mark.parametrize("normalize", [False, True])
def test_the_gated_fp32_path_is_the_fp32_kernel_on_the_widened_inputs(vector, normalize):
    """linattn_cpu::gated_chunked and its backward with wide=True, B·H = 6, N = 700 (two blocks and a
    short chunk), F ≠ E, scalar and vector gates with a few strong decays: as the ungated test."""
    gen = torch.Generator().manual_seed(5)
    b, h, n, f, e = 2, 3, 700, 24, 40
    q, k = (_bf16(b, h, n, f, gen=gen) for _ in range(2))
    v, do = (_bf16(b, h, n, e, gen=gen) for _ in range(2))
    g = torch.nn.functional.logsigmoid(torch.randn(b, h, n, *((f,) if vector else ()), generator=gen)) / 8
    g[:, :, ::97] -= 30.0  # strong decays: vector chunks cut into pieces
    kv0 = torch.randn(b, h, f, e, generator=gen)
    z0 = torch.rand(b, h, f, generator=gen) + 1 if normalize else None
    dkv = torch.randn(b, h, f, e, generator=gen)
    dz = torch.randn(b, h, f, generator=gen) if normalize else None
    ops = torch.ops.linattn_cpu
    low = ops.gated_chunked(q, k, v, g, kv0, z0, 1, 1e-6, 64, True, True)
    ref = ops.gated_chunked(q.float(), k.float(), v.float(), g, kv0, z0, 1, 1e-6, 64, True)
    _rounded_once(low[0], ref[0])
    for a, r in zip(low[1:], ref[1:]):
        if r.numel():
            torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-5 * r.abs().max().item())
    o, kv, z, den, sb, zb = low
    grads = [ops.gated_chunked_backward(x[0], x[1], x[2], g, x[3], x[4], den, sb, zb, kv, z if normalize else None,
                                        dkv, dz, 1, 64, *w)
             for x, w in (((q, k, v, o, do), (True,)), (tuple(t.float() for t in (q, k, v, o, do)), ()))]
    for a, r in zip(grads[0][:3], grads[1][:3]):
        _rounded_once(a, r)
    for a, r in zip(grads[0][3:], grads[1][3:]):
        if r.numel():
            torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-5 * r.abs().max().item())


def _max_errors(outs, refs):
    return [(a.double() - r).abs().max().item() for a, r in zip(outs, refs)]


@needs_native
@pytest.mark.parametrize("kind", ["ungated", "scalar", "vector"])
def test_the_fp32_path_is_no_less_accurate_than_the_bf16_path(monkeypatch, kind):
    """Through the public operators, forward and gradients against the float64 definitions (quadratic
    oracle, gated recurrence), fused kernels and torch ops alike: each error of the fp32 path is at
    most the bf16 path's (plus 1/8 of a bf16 ulp of the largest value, for ties)."""
    gen = torch.Generator().manual_seed(3)
    lo = [torch.randn(2, 4, 300, 32, generator=gen).bfloat16() for _ in range(3)]
    fm = EluPlusOne(32)
    g = None if kind == "ungated" else -torch.rand(2, 4, 300, *((32,) if kind == "vector" else ()), generator=gen) / 8
    hi = [x.double().requires_grad_() for x in lo]
    if g is None:
        ref = oracle(*hi, causal=True, feature_map=fm.double())[0]
    else:
        ref = gated_recurrence(fm.double()(hi[0]), fm.double()(hi[1]), hi[2], g.double())[0]
    w = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    want = [ref.detach(), *torch.autograd.grad((ref * w).sum(), hi)]

    def run():
        xs = [x.detach().requires_grad_() for x in lo]
        o = linear_attention(*xs, causal=True, feature_map=fm) if g is None else gated_linear_attention(
            *xs, g, feature_map=fm)
        return [o, *torch.autograd.grad((o * w.bfloat16()).sum(), xs)]

    has_bf16_gemm = native.available() and bool(torch.ops.linattn_cpu.has_blas_bf16())
    errors = {}
    for native_on in ("1", "0"):
        for mode in ("bf16", "fp32"):
            if native_on == "1" and mode == "bf16" and not has_bf16_gemm:
                continue
            monkeypatch.setenv("LINATTN_NATIVE", native_on)
            monkeypatch.setenv("LINATTN_BF16_PATH", mode)
            errors[native_on, mode] = _max_errors(run(), want)
    for native_on in ("1", "0"):
        if (native_on, "bf16") not in errors:
            continue
        for e32, e16, r in zip(errors[native_on, "fp32"], errors[native_on, "bf16"], want):
            ulp = 2.0 ** (math.floor(math.log2(r.abs().max().item())) - 7)
            assert e32 <= e16 + ulp / 8, (native_on, e32, e16)


@needs_native
@pytest.mark.parametrize("use_rope,normalize", [(False, True), (True, True), (False, False)])
def test_a_bf16_step_runs_fused_as_the_fp32_step_on_the_widened_inputs(monkeypatch, use_rope, normalize):
    """bf16 q, k, v on a float32 state take the fused step (one operator, no torch-op fallback): its
    output is the fp32 step's on q.float(), … rounded once, its state the fp32 step's."""
    gen = torch.Generator().manual_seed(4)
    q, k, v = (_bf16(2, 8, 1, 16, gen=gen) for _ in range(3))
    state = (torch.randn(2, 8, 16, 16, generator=gen), torch.rand(2, 8, 16, generator=gen) + 1)
    fm, rope, pos = EluPlusOne(16), (RotaryEmbedding(16) if use_rope else None), torch.tensor([5])
    calls = []
    fused_step = native.step
    monkeypatch.setattr(native, "step", lambda *a, **kw: calls.append(1) or fused_step(*a, **kw))
    with torch.inference_mode():
        o, (kv, z) = linear_attention_step(state, q, k, v, feature_map=fm, rope=rope, positions=pos, normalize=normalize)
        o32, (kv32, z32) = linear_attention_step(state, q.float(), k.float(), v.float(), feature_map=fm, rope=rope,
                                                 positions=pos, normalize=normalize)
    assert calls == [1, 1] and kv.dtype == z.dtype == FP32
    _rounded_once(o, o32)
    torch.testing.assert_close(kv, kv32, rtol=0, atol=0)
    torch.testing.assert_close(z, z32, rtol=0, atol=0)


@needs_native
@pytest.mark.parametrize("vector", [False, True])
def test_a_bf16_gated_step_runs_fused_with_bf16_gates(monkeypatch, vector):
    """bf16 q, k, v and g on a float32 state: the fused gated step, equal to the fp32 step on the
    widened inputs (output rounded once); g's values are still checked."""
    gen = torch.Generator().manual_seed(6)
    q, k, v = (_bf16(2, 4, 1, 16, gen=gen) for _ in range(3))
    g = (-torch.rand(2, 4, 1, *((16,) if vector else ()), generator=gen)).bfloat16()
    kv0 = torch.randn(2, 4, 16, 16, generator=gen)
    calls = []
    fused_step = gated_fused.step
    monkeypatch.setattr(gated_fused, "step", lambda *a, **kw: calls.append(1) or fused_step(*a, **kw))
    fm = EluPlusOne(16)
    with torch.inference_mode():
        o, kv = gated_linear_attention_step(kv0, q, k, v, g, feature_map=fm)
        o32, kv32 = gated_linear_attention_step(kv0, q.float(), k.float(), v.float(), g.float(), feature_map=fm)
        with pytest.raises(ValueError, match="must be ≤ 0 and finite"):
            gated_linear_attention_step(kv0, q, k, v, g.abs() + 1, feature_map=fm)
    assert calls[:2] == [1, 1] and kv.dtype == FP32
    _rounded_once(o, o32)
    torch.testing.assert_close(kv, kv32, rtol=0, atol=0)
