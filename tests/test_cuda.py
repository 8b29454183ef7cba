"""The operators on CUDA (skipped without a GPU; `benchmarks/gpu_check.sh` runs them on one).

linattn's torch paths are device-generic: every fast path is checked on the CPU against float64
oracles by the rest of the suite, so here each operator runs on CUDA in float32 and bfloat16 and is
compared with the same operator in float64 on the CPU — outputs, final states and every input's
gradient. The `linattn.compat.fla` functions run twice on CUDA: linattn's body (`fn.__wrapped__`,
no handover) and, where the `fla` package imports, FLA's own Triton kernel through the handover;
both must equal the float64 result, which checks that the conventions at the edge are FLA's.

Agreement is measured as ‖actual − expected‖ / ‖expected‖ per tensor (bf16 keeps 8 bits of mantissa:
a relative norm error of 2e-2 over a few hundred tokens of accumulated products is its rounding;
float32 with TF32 off: 1e-4).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F

#: where the checked runs go: CUDA; LINATTN_CHECK_DEVICE=cpu runs the same checks on the CPU (the dry run of
#: benchmarks/gpu_check.sh, which checks the harness and the CPU's fp32/bf16 paths)
DEVICE = os.environ.get("LINATTN_CHECK_DEVICE", "cuda")
pytestmark = pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA device")

TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
#: FLA's Triton kernels multiply float32 in TF32 (tl.dot's default precision): 10 bits of mantissa
TOL_FLA = {torch.float32: 5e-3, torch.bfloat16: 3e-2}
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
HAS_FLA = DEVICE != "cpu" and importlib.util.find_spec("fla") is not None


@pytest.fixture(autouse=True)
def _no_tf32():
    if DEVICE == "cpu" or not torch.cuda.is_available():
        yield
        return
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    assert a.shape == e.shape, (tuple(a.shape), tuple(e.shape))
    assert torch.isfinite(a).all()
    return ((a - e).norm() / e.norm().clamp_min(1e-30)).item()


def run(fn, inputs: dict, device, dtype, **kw):
    """(outputs, grads) of fn(**inputs, **kw) on `device` in `dtype`: outputs flattened to tensors, the
    gradient of a fixed random projection of every output wrt every floating input."""
    leaves = {n: (x.detach().to(device=device, dtype=dtype).requires_grad_(x.is_floating_point())
                  if isinstance(x, torch.Tensor) else x) for n, x in inputs.items()}
    out = fn(**leaves, **kw)
    outs = [o for o in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(o, torch.Tensor)]
    gen = torch.Generator().manual_seed(7)
    total = sum((o.double() * torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.device)).sum()
                for o in outs)
    wants = [n for n, x in leaves.items() if isinstance(x, torch.Tensor) and x.requires_grad]
    grads = torch.autograd.grad(total, [leaves[n] for n in wants], allow_unused=True)
    return outs, dict(zip(wants, grads))


def check(fn, inputs: dict, dtype, reference_fn=None, tol=None, **kw):
    """fn on CUDA in dtype against (reference_fn or fn) on the CPU in float64."""
    tol = TOL[dtype] if tol is None else tol
    exp_out, exp_grad = run(reference_fn or fn, inputs, "cpu", torch.float64, **kw)
    got_out, got_grad = run(fn, inputs, DEVICE, dtype, **kw)
    assert len(got_out) == len(exp_out)
    errors = {f"out{i}": rel_err(a, b) for i, (a, b) in enumerate(zip(got_out, exp_out))}
    errors.update({f"d{n}": rel_err(got_grad[n], g) for n, g in exp_grad.items() if g is not None})
    bad = {k: v for k, v in errors.items() if v > tol}
    assert not bad, f"relative errors above {tol}: {bad}"


def _fla_inputs(b=2, t=300, h=4, hv=4, kd=64, vd=32, gate=None, seed=0) -> dict:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    x = dict(q=r(b, t, h, kd), k=r(b, t, h, kd), v=r(b, t, hv, vd))
    if gate == "scalar":
        x["g"] = F.logsigmoid(r(b, t, hv) + 3.0)
    elif gate == "vector":
        x["g"] = F.logsigmoid(r(b, t, hv, kd) + 3.0)
    return x


def _beta(x, seed=1):
    b, t, hv = x["v"].shape[:3]
    return 0.1 + 0.8 * torch.rand(b, t, hv, generator=torch.Generator().manual_seed(seed))


#: (compat function name, inputs, keyword arguments) — shapes with T not a multiple of the chunk, GVA
def _compat_cases():
    delta = _fla_inputs(gate="scalar")
    kda_in = _fla_inputs(gate="vector")
    plain = _fla_inputs()
    unit = dict(use_qk_l2norm_in_kernel=True, output_final_state=True)
    return [
        ("chunk_linear_attn", plain, dict(output_final_state=True, normalize=False)),
        ("chunk_retention", plain, dict(output_final_state=True)),
        ("chunk_simple_gla", _fla_inputs(gate="scalar"), dict(output_final_state=True)),
        ("chunk_gla", _fla_inputs(gate="vector"), dict(output_final_state=True)),
        ("chunk_delta_rule", {**plain, "beta": _beta(plain)}, unit),
        ("chunk_gated_delta_rule", {**delta, "beta": _beta(delta)}, unit),
        ("chunk_kda", {**kda_in, "beta": _beta(kda_in)}, unit),
        ("fused_recurrent_gated_delta_rule", {**delta, "beta": _beta(delta)}, unit),
    ]


CASES = _compat_cases()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name, inputs, kw", CASES, ids=[c[0] for c in CASES])
def test_compat_linattn_path_on_cuda(name, inputs, kw, dtype):
    import linattn.compat.fla as compat

    fn = getattr(compat, name)
    check(getattr(fn, "__wrapped__", fn), inputs, dtype, **kw)


@pytest.mark.skipif(not HAS_FLA, reason="flash-linear-attention is not installed (or no CUDA: it hands over there only)")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name, inputs, kw", CASES, ids=[c[0] for c in CASES])
def test_compat_hands_over_to_flas_kernels_with_the_same_numbers(name, inputs, kw, dtype):
    import linattn.compat.fla as compat

    fn = getattr(compat, name)
    check(fn, inputs, dtype, reference_fn=getattr(fn, "__wrapped__", fn), tol=TOL_FLA[dtype], **kw)


def _bhnd(b=2, h=4, n=300, d=64, e=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return dict(q=torch.randn(b, h, n, d, generator=g), k=torch.randn(b, h, n, d, generator=g),
                v=torch.randn(b, h, n, e, generator=g))


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_attention_on_cuda(dtype):
    from linattn.ops import linear_attention
    from linattn.nn.feature_maps import make_feature_map

    phi = make_feature_map("elu", head_dim=64)
    check(linear_attention, _bhnd(), dtype, causal=True, feature_map=phi, return_state=True)
    check(linear_attention, _bhnd(), dtype, causal=False, feature_map=phi)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("per_channel", [False, True], ids=["scalar", "channel"])
def test_gated_linear_attention_on_cuda(dtype, per_channel):
    from linattn.ops import gated_linear_attention

    x = _bhnd()
    shape = x["q"].shape if per_channel else x["q"].shape[:3]
    x["g"] = F.logsigmoid(torch.randn(shape, generator=torch.Generator().manual_seed(3)) + 3.0)
    check(gated_linear_attention, x, dtype, return_state=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_delta_rule_on_cuda_packed(dtype):
    from linattn.ops import delta_rule

    x = _bhnd(b=1)
    gen = torch.Generator().manual_seed(4)
    x["beta"] = 0.1 + 0.8 * torch.rand(x["q"].shape[:3], generator=gen)
    x["g"] = F.logsigmoid(torch.randn(x["q"].shape[:3], generator=gen) + 3.0)
    cu = torch.tensor([0, 1, 130, 300], device=DEVICE)
    check(lambda cu_seqlens=None, **kw: delta_rule(**kw, qk_l2norm=True, cu_seqlens=cu_seqlens.to(kw["q"].device)),
          x, dtype, cu_seqlens=cu)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sliding_window_and_softmax_on_cuda(dtype):
    from linattn.ops import sliding_window_attention, softmax_attention

    check(sliding_window_attention, _bhnd(e=64), dtype, window=64)
    check(softmax_attention, _bhnd(e=64), dtype, causal=True)
