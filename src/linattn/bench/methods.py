"""The attention implementations the operator benchmark compares, and how one is measured.

Each `Method` maps raw (q, k, v) of shape (B, H, N, D), (B, H, N, E) to an output (B, H, N, E).
The linear ones use the normalized elu+1 feature map unless another is given.

    chunked       linattn.linear_attention(causal=True) — the training/prefill path (fp32, bf16)
    noncausal     linattn.linear_attention(causal=False) — no mask, for scale (not causal)
    recurrent     a Python loop of linattn.linear_attention_step over the tokens (slow; capped)
    quadratic     linattn.ops.linear.reference.kernel_attention on φ(q), φ(k): the N×N oracle (capped)
    softmax       F.scaled_dot_product_attention(is_causal=True)
    gated_scalar  linattn.gated_linear_attention, g = logsigmoid(N(0, 1)) per head and token (simple GLA)
    gated_vector  the same with g per key feature (B, H, N, D)                  (GLA)
    delta         linattn.delta_rule(qk_l2norm=True), β = sigmoid(N(0, 1))      (DeltaNet)
    gated_delta   the same with g = logsigmoid(N(0, 1))                         (Gated DeltaNet)

The gates of the recurrent kinds are fixed tensors in float32, drawn once per shape from a seeded
generator (`fixed_gates`); gradients are taken with respect to q, k and v only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..nn.feature_maps import EluPlusOne
from ..ops import delta_rule, gated_linear_attention, linear_attention, linear_attention_step
from ..ops.linear.chunked import DEFAULT_CHUNK_SIZE
from ..ops.linear.reference import kernel_attention
from .flops import chunked_linear_flops
from .memory import nbytes, peak_memory
from .timing import measure

MODES = ("fwd", "fwd_bwd")
MODE_LABELS = {"fwd": "forward", "fwd_bwd": "forward+backward"}


@dataclass
class Shape:
    """Benchmark problem: batch, heads, head dim D (= F for elu+1), value dim E, chunk size C."""

    batch: int = 1
    heads: int = 8
    head_dim: int = 64
    value_dim: int = 64
    chunk: int = DEFAULT_CHUNK_SIZE


@dataclass
class SweepConfig:
    """What every operator sweep (`bench ops`, `bench decode`) shares: the problem shape, dtype, device,
    seed and `torch.utils.benchmark`'s minimum run time per measurement (s)."""

    shape: Shape = field(default_factory=Shape)
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    seed: int = 0
    min_run_time: float = 0.5


@dataclass
class Method:
    """One implementation. dtype None means the sweep's dtype; max_n caps the lengths it runs at."""

    key: str
    label: str
    run: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    dtype: torch.dtype | None = None
    max_n: int | None = None
    cap_reason: str = ""
    counts_flops: bool = False  # report GFLOP/s with the chunked-linear FLOP count


def short_dtype(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}[dtype]


_GATES: dict = {}


def fixed_gates(q: torch.Tensor, seed: int = 0, per_feature: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """β = sigmoid(N(0, 1)) of shape (B, H, N) and g = logsigmoid(N(0, 1)) of shape (B, H, N), or (B, H,
    N, D) with per_feature, float32 on q's device, drawn once per shape and device (then reused, so
    timings do not include the draw)."""
    b, h, n, d = q.shape
    key = (tuple(q.shape), str(q.device), seed, per_feature)
    if key not in _GATES:
        if len(_GATES) > 16:
            _GATES.clear()
        gen = torch.Generator().manual_seed(seed * 1_000_003 + n)
        beta = torch.sigmoid(torch.randn(b, h, n, generator=gen)).to(q.device)
        g_shape = (b, h, n, d) if per_feature else (b, h, n)
        _GATES[key] = beta, F.logsigmoid(torch.randn(g_shape, generator=gen)).to(q.device)
    return _GATES[key]


def recurrent_methods(*, chunk: int = DEFAULT_CHUNK_SIZE) -> list[Method]:
    """The operators of the recurrent attention kinds (gated linear attention, delta rule) as rows of
    the operator sweep."""

    def gated_scalar(q, k, v):
        return gated_linear_attention(q, k, v, fixed_gates(q)[1], chunk_size=chunk)

    def gated_vector(q, k, v):
        return gated_linear_attention(q, k, v, fixed_gates(q, per_feature=True)[1], chunk_size=chunk)

    def delta(q, k, v):
        beta, _ = fixed_gates(q)
        return delta_rule(q, k, v, beta, qk_l2norm=True, chunk_size=chunk)

    def gated_delta(q, k, v):
        beta, g = fixed_gates(q)
        return delta_rule(q, k, v, beta, g=g, qk_l2norm=True, chunk_size=chunk)

    return [Method("gated_scalar", "gated, scalar g", gated_scalar), Method("gated_vector", "GLA, vector g", gated_vector),
            Method("delta", "DeltaNet", delta), Method("gated_delta", "Gated DeltaNet", gated_delta)]


def core_methods(dtype: torch.dtype = torch.float32, *, feature_map=None, head_dim: int = 64,
                 chunk: int = DEFAULT_CHUNK_SIZE, recurrent_max: int | None = 2048, quadratic_max: int | None = 4096,
                 bf16: bool = True) -> list[Method]:
    """The linattn implementations plus SDPA. `bf16` adds a bf16 chunked column (if dtype isn't bf16)."""
    fm = EluPlusOne(head_dim) if feature_map is None else feature_map

    def chunked(q, k, v):
        return linear_attention(q, k, v, causal=True, feature_map=fm, chunk_size=chunk)

    def noncausal(q, k, v):
        return linear_attention(q, k, v, causal=False, feature_map=fm)

    def recurrent(q, k, v):
        state, outs = None, []
        for t in range(q.shape[2]):
            o, state = linear_attention_step(state, q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1],
                                             feature_map=fm)
            outs.append(o)
        return torch.cat(outs, dim=2)

    def quadratic(q, k, v):
        return kernel_attention(fm(q, is_query=True), fm(k, is_query=False), v, causal=True)[0]

    def softmax(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    name = short_dtype(dtype)
    methods = [Method("chunked", f"chunked {name}", chunked, counts_flops=True)]
    if bf16 and dtype != torch.bfloat16:
        methods.append(Method("chunked_bf16", "chunked bf16", chunked, dtype=torch.bfloat16, counts_flops=True))
    methods += [
        Method("noncausal", "non-causal linear", noncausal),
        Method("recurrent", "recurrent loop", recurrent, max_n=recurrent_max,
               cap_reason="token-by-token Python loop is slow"),
        Method("quadratic", "quadratic reference", quadratic, max_n=quadratic_max,
               cap_reason="materializes N×N: memory"),
        Method("softmax", "softmax SDPA", softmax),
    ]
    return methods + recurrent_methods(chunk=chunk)


def make_inputs(shape: Shape, n: int, dtype: torch.dtype, device, *, seed: int = 0, requires_grad: bool = False):
    """q, k, v and an output gradient `do`, drawn from N(0, 1) with a fixed seed per length."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + n)
    b, h, d, e = shape.batch, shape.heads, shape.head_dim, shape.value_dim
    q, k = (torch.randn(b, h, n, d, generator=gen) for _ in range(2))
    v, do = (torch.randn(b, h, n, e, generator=gen) for _ in range(2))
    q, k, v, do = (x.to(device=device, dtype=dtype) for x in (q, k, v, do))
    if requires_grad:
        for x in (q, k, v):
            x.requires_grad_(True)
    return q, k, v, do


def forward_fn(method: Method, q, k, v):
    """A no-grad forward call (inference cost)."""

    def fn():
        with torch.no_grad():
            return method.run(q, k, v)

    return fn


def fwd_bwd_fn(method: Method, q, k, v, do):
    """Forward, then the gradients of (o · do) w.r.t. q, k, v. Returns (o, dq, dk, dv)."""

    def fn():
        o = method.run(q, k, v)
        return (o, *torch.autograd.grad(o, (q, k, v), do))

    return fn


def measure_method(method: Method, shape: Shape, n: int, *, dtype: torch.dtype, device, seed: int = 0,
                   min_run_time: float = 0.5, modes=MODES, memory: bool = True,
                   peaks: dict | None = None) -> dict:
    """Times one method at one length (median/IQR per mode) and measures fwd+bwd peak memory.

    Returns {"method", "n", "dtype", "fwd": {...}|None, "fwd_bwd": {...}|None, "memory": {...}|None,
    "skipped": None or the reason}. With `peaks` ({dtype name: GFLOP/s}) and a FLOP-counted method,
    each timing also gets "gflops" and "pct_peak" (backward counted as 2× forward).
    """
    dt = method.dtype or dtype
    row = {"method": method.key, "n": n, "dtype": short_dtype(dt), "skipped": None}
    for mode in MODES:
        row[mode] = None
    row["memory"] = None
    if method.max_n is not None and n > method.max_n:
        row["skipped"] = f"N > {method.max_n} ({method.cap_reason})"
        return row
    try:
        flops = chunked_linear_flops(shape.batch, shape.heads, n, shape.head_dim, shape.value_dim, shape.chunk)
        peak = None if peaks is None else peaks.get(str(dt).replace("torch.", ""))
        if "fwd" in modes:
            q, k, v, _ = make_inputs(shape, n, dt, device, seed=seed)
            row["fwd"] = _with_rate(measure(forward_fn(method, q, k, v), min_run_time=min_run_time).as_dict(),
                                    flops if method.counts_flops else None, peak)
        if "fwd_bwd" in modes or memory:
            q, k, v, do = make_inputs(shape, n, dt, device, seed=seed, requires_grad=True)
            fb = fwd_bwd_fn(method, q, k, v, do)
            if "fwd_bwd" in modes:
                row["fwd_bwd"] = _with_rate(measure(fb, min_run_time=min_run_time).as_dict(),
                                            3 * flops if method.counts_flops else None, peak)
            if memory:
                row["memory"] = fwd_bwd_memory(fb, q, device)
    except (RuntimeError, MemoryError, ValueError, TypeError) as exc:
        row["skipped"] = f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    return row


def fwd_bwd_memory(fb, q, device) -> dict:
    """Peak memory of one fwd+bwd call beyond its output and input gradients (which must exist anyway),
    in bytes and as a multiple of q's size."""
    peak, result = peak_memory(fb, device)
    kept = nbytes(*result)
    extra = max(0, peak - kept)
    return {"peak_bytes": peak, "output_and_grads_bytes": kept, "extra_bytes": extra,
            "extra_x_q": extra / nbytes(q)}


def _with_rate(timing: dict, flops: int | None, peak_gflops: float | None) -> dict:
    if flops is not None:
        timing["gflops"] = flops / timing["median_s"] / 1e9
        timing["pct_peak"] = None if not peak_gflops else 100.0 * timing["gflops"] / peak_gflops
    return timing
