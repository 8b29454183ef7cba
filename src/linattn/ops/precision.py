"""How bf16 inputs are multiplied on this machine (design §2, Precision).

A bf16 matrix product is only faster than an fp32 one where the processor multiplies bf16 natively
and the library uses it: AMX tiles (Intel Sapphire Rapids and later), or AVX512-BF16 / Arm BF16 dot
products when the BLAS in use has kernels for them. Elsewhere a bf16 gemm converts its operands and
runs fp32 arithmetic anyway, and is slower than the fp32 gemm: on the 2-core AMD EPYC development
machine (AVX512-BF16, no AMX) MKL's bf16 gemm at 64×64×64, the fused kernels' product size, took
2.6× the time of its fp32 gemm. There bf16 inputs are better widened to fp32 block by block (in
cache) and multiplied in fp32, rounding only the outputs; that also rounds less.

One choice is made per process for each of the two places that multiply:

- `fused`: linattn's own CPU kernels (csrc/, products by torch's BLAS: MKL's gemm_bf16bf16f32 or
  sgemm), asked through `linattn.ops.native.bf16_compute()`;
- `torch`: the torch-op paths on the CPU (torch.bmm / matmul, oneDNN for bf16), through
  `compute_dtype` (linattn.ops.linear.chunked). On CUDA bf16 always stays bf16 (tensor cores).

The rule (`choose`): the environment variable LINATTN_BF16_PATH=bf16|fp32 forces either (for tests
and comparisons; auto, the default, decides). Otherwise the CPU's flags decide where they are
conclusive: AMX → bf16 products; no bf16 instructions at all → fp32. In between (AVX512-BF16 or Arm
BF16 without AMX, or flags that cannot be read) it depends on the library:

- the fused kernels take fp32: MKL's bf16 gemm without AMX was slower than its fp32 gemm on both
  processors measured (the fused forward 0.6–0.7× fp32's speed on a Xeon with AVX512-BF16, issue 18;
  0.8× on the AMD EPYC above), while the widened form costs only the conversions (O(N·D) against the
  gemms' O(N·D·C));
- the torch ops time both forms once (a few ms, `torch_bmm_speedup`) and take bf16 only when it
  measured faster: oneDNN's bf16 bmm on the AMD EPYC was 2.5× faster than fp32 bmm, on the Xeon of
  issue 18 2.3× slower, so the flags alone cannot tell.

The flags come first because a timing on a busy machine is noisy and the choice changes the rounding
of every bf16 result: where the flags settle it, the same machine always computes the same way.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

ENV = "LINATTN_BF16_PATH"
MODES = ("auto", "bf16", "fp32")
_lock = threading.Lock()
_cache: dict = {}


@dataclass(frozen=True)
class Bf16Choice:
    """The dtype bf16 inputs are multiplied in (torch.bfloat16 or torch.float32), and why: `reason`
    in words, `speedup` the probe's measured time of the fp32 form / time of the bf16 form (None when
    the flags or LINATTN_BF16_PATH decided), `forced` True when LINATTN_BF16_PATH decided."""

    dtype: torch.dtype
    reason: str
    speedup: float | None = None
    forced: bool = False

    @property
    def label(self) -> str:
        """'bf16 gemms' or 'fp32 gemms' (bf16 inputs widened to fp32 in cache)."""
        return "bf16 gemms" if self.dtype == torch.bfloat16 else "fp32 gemms"


def mode() -> str:
    """LINATTN_BF16_PATH: 'auto' (unset or empty), 'bf16' or 'fp32'; anything else is a ValueError."""
    value = os.environ.get(ENV, "").strip().lower() or "auto"
    if value not in MODES:
        raise ValueError(f"the environment variable {ENV} must be one of {MODES}, got {value!r}")
    return value


def cpu_bf16_features() -> dict[str, bool | None]:
    """What the CPU offers for bf16 products: {'amx': AMX tiles with bf16, 'dot': bf16 dot-product
    instructions (AVX512-BF16, or Arm BF16)}; None where it cannot be told. From
    torch.cpu.get_capabilities() where torch has it, else /proc/cpuinfo's flags (Linux)."""
    caps = getattr(getattr(torch, "cpu", None), "get_capabilities", None)
    if caps is not None:
        try:
            c = caps()
            if "amx_bf16" in c or "bf16" in c:
                amx = bool(c.get("amx_bf16", False) and c.get("amx_tile", False))
                return {"amx": amx, "dot": bool(c.get("avx512_bf16", False) or c.get("bf16", False) or amx)}
        except Exception:  # an old or partial torch: read the flags below
            pass
    flags = _proc_cpu_flags()
    if flags is None:
        return {"amx": None, "dot": None}
    amx = "amx_bf16" in flags and "amx_tile" in flags
    return {"amx": amx, "dot": amx or "avx512_bf16" in flags or "bf16" in flags}


def _proc_cpu_flags() -> set[str] | None:
    """The flags (x86) or Features (Arm) of the first processor in /proc/cpuinfo, or None."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip().lower() in ("flags", "features"):
                    return set(value.split())
    except OSError:
        pass
    return None


def choose(features: dict, probe: Callable[[], float] | None, what: str, forced: str = "auto", *,
           available: bool = True, faster: str | None = None) -> Bf16Choice:
    """The rule of the module doc for one place (`what`, e.g. "MKL's bf16 gemm").

    features: `cpu_bf16_features()`; probe: measures time(fp32 form) / time(bf16 form) (> 1: bf16
    faster), called only when the flags are inconclusive; None: there fp32 is taken untimed;
    forced: the LINATTN_BF16_PATH mode; available: False when no bf16 form exists here (→ fp32);
    faster: the reason, when a bf16 form here is known to beat fp32 without AMX (linattn's AVX512-BF16
    tiles): then bf16 is taken as with AMX."""
    if not available:
        return Bf16Choice(torch.float32, f"{what} is not available", forced=forced != "auto")
    if forced == "bf16":
        return Bf16Choice(torch.bfloat16, f"forced by {ENV}=bf16", forced=True)
    if forced == "fp32":
        return Bf16Choice(torch.float32, f"forced by {ENV}=fp32", forced=True)
    if faster is not None:
        return Bf16Choice(torch.bfloat16, faster)
    if features.get("amx"):
        return Bf16Choice(torch.bfloat16, "AMX")
    if features.get("dot") is False:
        return Bf16Choice(torch.float32, "no bf16 instructions (no AVX512-BF16, AMX or Arm BF16)")
    cpu = "no AMX" if features.get("dot") else "CPU flags unknown"
    if probe is None:
        return Bf16Choice(torch.float32, f"{cpu}; {what} is faster than fp32 only with AMX")
    try:
        speedup = float(probe())
    except Exception as exc:  # a failed probe decides nothing: fp32 is never the slow guess by much
        return Bf16Choice(torch.float32, f"{cpu}; timing {what} failed ({type(exc).__name__})")
    if speedup > 1.0:
        return Bf16Choice(torch.bfloat16, f"{cpu}; {what} measured {speedup:.1f}× faster than fp32", speedup)
    return Bf16Choice(torch.float32, f"{cpu}; {what} measured {1 / speedup:.1f}× slower than fp32", speedup)


def cached_choice(key: str, make: Callable[[str], Bf16Choice]) -> Bf16Choice:
    """The choice for `key` under the current LINATTN_BF16_PATH, made once per process and mode by
    make(mode) (a probe runs at most once per place)."""
    m = mode()
    hit = _cache.get((key, m))
    if hit is not None:
        return hit
    with _lock:
        if (key, m) not in _cache:
            _cache[(key, m)] = make(m)
    return _cache[(key, m)]


def torch_choice() -> Bf16Choice:
    """How the torch-op paths multiply bf16 inputs on the CPU (cached; see the module doc)."""
    return cached_choice("torch", lambda m: choose(cpu_bf16_features(), torch_bmm_speedup, "torch.bmm in bf16", m))


def compute_dtype_cpu(dtype: torch.dtype) -> torch.dtype:
    """The matmul dtype of the CPU torch-op paths for inputs of `dtype` (bf16: `torch_choice`)."""
    return torch_choice().dtype if dtype == torch.bfloat16 else dtype


def torch_bmm_speedup(rounds: int = 5, batch: int = 64, tile: int = 64) -> float:
    """time(fp32) / time(bf16) of torch.bmm on (batch, tile, tile) operands (the torch-op path's chunk
    products: 64 chunks of 64 rows in a block), median over interleaved rounds of a few calls each."""
    from torch.utils import benchmark

    gen = torch.Generator().manual_seed(0)
    x, y = (torch.randn(batch, tile, tile, generator=gen) for _ in range(2))
    pairs = {torch.float32: (x, y), torch.bfloat16: (x.bfloat16(), y.bfloat16())}
    ratios = []
    with torch.no_grad():
        for a, b in pairs.values():
            torch.bmm(a, b)  # first call: allocation, oneDNN set-up
        for _ in range(rounds):
            t = {dt: benchmark.Timer("torch.bmm(a, b)", globals={"torch": torch, "a": a, "b": b}).timeit(3).median
                 for dt, (a, b) in pairs.items()}
            ratios.append(t[torch.float32] / t[torch.bfloat16])
    return sorted(ratios)[len(ratios) // 2]


def describe(fused: Bf16Choice | None, torch_ops: Bf16Choice) -> str:
    """One line for reports, e.g. "bf16 → fused kernels: fp32 gemms (no AMX; MKL's bf16 gemm is faster
    than fp32 only with AMX); torch ops: bf16 gemms (no AMX; torch.bmm in bf16 measured 2.5× faster
    than fp32)"."""
    parts = [] if fused is None else [f"fused kernels: {fused.label} ({fused.reason})"]
    parts.append(f"torch ops: {torch_ops.label} ({torch_ops.reason})")
    return "bf16 → " + "; ".join(parts)


def without_autocast(op: Callable) -> Callable:
    """`op` run with autocast off on the devices where it is on. The operators choose their compute
    and state dtypes from their inputs' (bf16 inputs, float32 states and accumulators): autocast
    would cast their inner matmuls to bf16 against float32 `out=` buffers (a RuntimeError) or lose
    the float32 accumulation. Inputs come in as autocast's layers made them; outputs keep the rule
    of each op (q's dtype)."""

    @functools.wraps(op)
    def run(*args, **kwargs):
        on = [d for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)]
        if not on:
            return op(*args, **kwargs)
        with contextlib.ExitStack() as stack:
            for d in on:
                stack.enter_context(torch.autocast(d, enabled=False))
            return op(*args, **kwargs)

    return run
