"""Fused CPU kernels, compiled from C++ on first use with torch.utils.cpp_extension.

One decoding step of linear attention is a dozen tiny tensor ops when written with torch ops, and on
a CPU its time goes to operator dispatch rather than arithmetic. `csrc/decode.cpp` does the whole
step (φ = elu+1 or identity, optional RoPE, state update, output) in one operator,
`linattn_cpu::step`, and RMSNorm (about six ops inside F.rms_norm) in one, `linattn_cpu::rms_norm`.
In `csrc/chunked.cpp`, `linattn_cpu::chunked` runs the causal chunked forward row by row with the
state and the chunk scores kept in cache, its products by the BLAS gemm that torch itself links; for
training it also saves the denominators and block states, and `linattn_cpu::chunked_backward` walks
the rows back. `csrc/gated.cpp` and `csrc/gated_backward.cpp` are the gated form's kernels
(linattn.ops.gated.fused), `csrc/delta.cpp` and `csrc/kda.cpp` the delta family's
(linattn.ops.delta.fused: chunked forward and backward without a gate or with one decay per head in
delta.cpp, with one per key channel, KDA's, in kda.cpp; the one-token step of every gate form in
delta.cpp), `csrc/swa.cpp` sliding-window attention's (linattn.ops.swa.cpu), `csrc/conv.cpp` the short
convolution's (linattn.nn.convolution, forward and backward without the padded copy). The files
share headers: `csrc/common.h` (φ, bf16 conversions, work buffers, the ISA clones), `csrc/blas.h`
(the one row-major product `gemm_rm`: `csrc/gemm.h`'s float/double register tiles and `csrc/gemm_bf16.h`'s
AVX512-BF16 ones where the CPU has them, else torch's BLAS), `csrc/flop_count.h` (the FLOPs the
products execute, `executed_flops`), `csrc/prefetch.h` (cache hints spread over a chunk's products),
`csrc/pool.h` (the one pool of result buffers), `csrc/chunked.h` (the pieces of the
ungated and gated chunk loops), `csrc/delta.h` (those of the delta family's chunk loops), `csrc/rows.h`
(the rows a chunked kernel walks: (batch, head), or with cu_seqlens (sequence, head): packed sequences
in one call, design §17).

bf16 inputs: the ungated and gated chunked kernels multiply them in bf16 (linattn's AVX512-BF16 tiles,
or MKL's bf16 gemm with AMX), else widen each block to fp32 in cache and use the fp32 gemm
(`bf16_choice`, the rule of linattn.ops.precision; LINATTN_BF16_PATH=bf16|fp32 forces either); the
delta family and the sliding window always widen. Either way accumulations are float32 and the
outputs bf16 (in bf16 gemms, the scores and states are rounded to bf16 as operands). The steps always widen bf16 q, k, v to the float32
state's dtype (a rank-1 update and a matrix-vector product: nothing for a bf16 gemm to speed up).

The extension is built the first time a kernel can be used (about 15 s) into a folder named after a
hash of its sources and flags, under torch's extension cache (~/.cache/torch_extensions, or
TORCH_EXTENSIONS_DIR): two checkouts or versions of linattn keep one build each instead of
rebuilding over each other. Where it cannot be built (no C++
compiler or no ninja) linattn warns once, and with `LINATTN_NATIVE=0` it stays off; either way the
torch-op paths run, with the same numbers up to rounding (tests/test_ops_native.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
import warnings
from pathlib import Path

import torch

from . import packed, precision
from .features import kernel_featurizer, native_code
from .linear.chunked import ChunkedCausalLinearAttention
from .autodiff import first_order
from .nonfinite import all_finite

_CSRC = Path(__file__).with_name("csrc")
_SOURCES = [str(_CSRC / name)
            for name in ("decode.cpp", "chunked.cpp", "gated.cpp", "gated_backward.cpp", "delta.cpp", "kda.cpp",
                         "model_step.cpp", "swa.cpp", "conv.cpp")]
_CFLAGS = ["-O3", "-fopenmp", "-fno-trapping-math"]
_lock = threading.Lock()
_state: dict = {"loaded": None, "error": None}
_OFF = ("0", "false", "off", "no")
_DTYPES = (torch.float32, torch.float64)


def _environ_reader(name: str):
    """A function returning the environment variable `name` or None, read at each call. os.environ.get
    raises and catches a KeyError inside when the variable is unset, ~0.7 µs that every one-token step
    paid (`enabled`); CPython's os.environ keeps its encoded keys in a dict (`_data`), looked up
    without one. Elsewhere os.environ.get."""
    data, encode, decode = (getattr(os.environ, a, None) for a in ("_data", "encodekey", "decodevalue"))
    if not (isinstance(data, dict) and callable(encode) and callable(decode)):
        return lambda: os.environ.get(name)
    key = encode(name)

    def read():
        value = data.get(key)
        return None if value is None else decode(value)

    return read


_native_switch = _environ_reader("LINATTN_NATIVE")


def enabled() -> bool:
    """False when the environment variable LINATTN_NATIVE is 0 / false / off / no."""
    value = _native_switch()
    return value is None or value.lower() not in _OFF


def load() -> bool:
    """Builds (first time) and loads the extension; True when `linattn_cpu::step` is available."""
    if _state["loaded"] is not None:
        return _state["loaded"]
    with _lock:
        if _state["loaded"] is None:
            try:
                from torch.utils.cpp_extension import load as build

                folder = _build_directory()
                with _build_guard(folder):
                    build("linattn_cpu", sources=_SOURCES, extra_cflags=_CFLAGS, extra_ldflags=["-fopenmp"],
                          build_directory=folder, is_python_module=False, verbose=False)
                _state["loaded"] = hasattr(torch.ops.linattn_cpu, "step")
            except Exception as exc:  # no compiler, no ninja, a failed build: keep the torch-op path
                _state["loaded"], _state["error"] = False, build_failure(exc)
                warnings.warn(f"linattn: the fused CPU kernels could not be built ({_state['error']}); "
                              "torch ops run instead (same numbers, slower). Set LINATTN_NATIVE=0 to silence.",
                              RuntimeWarning, stacklevel=3)
    return _state["loaded"]


def build_failure(exc: BaseException, lines: int = 6, width: int = 240) -> str:
    """What made a build fail, in a few short lines: the error's text without the compiler and linker
    command lines and ninja's progress lines (which fill the first hundreds of characters), repeated
    lines once, the last `lines` kept, each cut at `width` characters, e.g. "RuntimeError: Error building
    extension 'linattn_cpu': /bin/sh: 1: c++: not found; ninja: build stopped: subcommand failed."."""
    head, *rest = str(exc).splitlines() or [""]
    head = head.partition(": [")[0]  # torch: "Error building extension 'x': [1/3] <command line>"
    kept: list[str] = []
    for line in rest:
        line = line.strip()
        words = line.split()
        is_command = sum(w.startswith("-") for w in words) >= 4  # a compiler or linker invocation
        if line and not is_command and not line.startswith(("FAILED:", "[")) and line not in kept:
            kept.append(line)
    cause = "; ".join(x if len(x) <= width else x[:width] + "..." for x in kept[-lines:])
    head = head if len(head) <= width else head[:width] + "..."
    return f"{type(exc).__name__}: {head}" + (f": {cause}" if cause else "")


@contextlib.contextmanager
def _build_guard(folder: str):
    """Holds an OS lock on `folder` while torch builds or loads the extension there, and removes torch's
    own lock file ("lock") once it holds it. torch waits for that file to disappear, forever, and a
    build killed midway (Ctrl-C, SIGKILL) leaves it behind; the OS lock is released when its holder
    dies, so whoever holds it knows that any "lock" left in the folder is stale."""
    try:
        import fcntl
    except ImportError:  # not POSIX: torch's own lock alone
        yield
        return
    with open(Path(folder) / ".linattn-build.lock", "a") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        try:
            (Path(folder) / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(guard, fcntl.LOCK_UN)


def _build_directory() -> str:
    """<torch extension cache>/linattn_cpu-<hash of the sources, their folder, flags, torch version and headers' path>."""
    from torch.utils.cpp_extension import get_default_build_root

    from torch.utils.cpp_extension import include_paths

    # the build's command lines name torch's headers and the sources' paths: two environments, or two
    # checkouts of the same sources, get two folders (in one folder torch would rebuild at every switch)
    digest = hashlib.sha256(" ".join(_CFLAGS + [torch.__version__, *include_paths(), str(_CSRC)]).encode())
    for path in sorted(_CSRC.iterdir()):
        if path.suffix in (".cpp", ".h"):
            digest.update(path.name.encode() + path.read_bytes())
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
    folder = root / f"linattn_cpu-{digest.hexdigest()[:16]}"
    folder.mkdir(parents=True, exist_ok=True)
    return str(folder)


def available() -> bool:
    """The fused kernels are enabled and built (builds them on the first call)."""
    return enabled() and load()


def tile_gemm() -> bool:
    """The fused kernels are built and their gemm runs by register tiles (csrc/gemm.h: an AVX-512 CPU,
    LINATTN_GEMM not "blas", read once); LINATTN_NATIVE=0 turns it off like the other kernels."""
    if not available():
        return False
    if "tiles" not in _state:
        _state["tiles"] = bool(torch.ops.linattn_cpu.uses_tile_gemm())
    return _state["tiles"]


#: linattn.nn.Linear's float32 products run on the tiles only where they are at least this much faster than
#: torch's BLAS on a layer-sized product, measured once per process (`linear_gemm`, design §23)
LINEAR_TILES_MARGIN = 1.15
LINEAR_GEMMS = ("tiles", "blas")


def pick_linear_gemm(tiles_s: float, blas_s: float) -> str:
    """"tiles" where the tiles took at most 1 / LINEAR_TILES_MARGIN of the BLAS's time, else "blas"."""
    return "tiles" if blas_s >= LINEAR_TILES_MARGIN * tiles_s else "blas"


def _time_linear_products() -> tuple[float, float]:
    """Seconds of one float32 product of a linear layer's shape (128 × 1024 by (1024 × 1024)ᵀ) by the tiles
    and by F.linear (torch's BLAS), each the best of 3 alternated timings of 4 calls on torch's threads."""
    from torch.utils import benchmark

    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(128, 1024, generator=gen), torch.randn(1024, 1024, generator=gen)
    threads = torch.get_num_threads()
    tiles = benchmark.Timer("gemm(x, w, tb=True)", globals={"gemm": gemm, "x": x, "w": w}, num_threads=threads)
    blas = benchmark.Timer("linear(x, w)", globals={"linear": torch.nn.functional.linear, "x": x, "w": w},
                           num_threads=threads)
    runs: dict = {"tiles": [], "blas": []}
    for _ in range(3):
        runs["tiles"].append(tiles.timeit(4).median)
        runs["blas"].append(blas.timeit(4).median)
    return min(runs["tiles"]), min(runs["blas"])


def linear_gemm() -> str:
    """Where linattn.nn.Linear's float32 products run: "tiles" (csrc/gemm.h) or "blas" (F.linear), decided
    once per process: LINATTN_LINEAR_GEMM=tiles|blas forces either; where the tiles do not run
    (`tile_gemm`), "blas"; else `pick_linear_gemm` on one timing of each (~0.1 s). On an AMD EPYC with
    full-width 512-bit FMAs the tiles ran a layer's products ~2× faster than MKL's sgemm; on a Zen 4 EPYC
    (512-bit operations in 256-bit halves) MKL's ran them as fast, and in the model faster (design §23)."""
    if "linear" in _state:
        return _state["linear"]
    forced = os.environ.get("LINATTN_LINEAR_GEMM")
    if forced is not None and forced not in LINEAR_GEMMS:
        raise ValueError(f"LINATTN_LINEAR_GEMM must be one of {', '.join(LINEAR_GEMMS)}, got {forced!r}")
    tiles = tile_gemm()  # before the lock: it may build the kernels, which takes it
    with _lock:
        if "linear" not in _state:
            _state["linear"] = (forced or pick_linear_gemm(*_time_linear_products())) if tiles else "blas"
    return _state["linear"]


def tile_operands(*tensors) -> bool:
    """The tiled gemm runs here (`tile_gemm`) and takes these operands: plain tensors (no subclass such
    as torchao's) on the CPU, all float32 or all float64; None entries are skipped."""
    given = [t for t in tensors if t is not None]
    if not given or any(type(t) not in (torch.Tensor, torch.nn.Parameter) or t.device.type != "cpu" for t in given):
        return False
    dtype = given[0].dtype
    return dtype in (torch.float32, torch.float64) and all(t.dtype == dtype for t in given) and tile_gemm()


def gemm(a: torch.Tensor, b: torch.Tensor, *, ta: bool = False, tb: bool = False, out: torch.Tensor | None = None,
         beta: float = 0.0) -> torch.Tensor:
    """out = op(a) op(b) + beta·out for 2-D contiguous float32 / float64 CPU tensors by the kernels'
    product (`linattn_cpu::gemm`; op(x) = xᵀ with ta / tb; beta = 0 does not read out, a new tensor
    when None). The columns are split between torch's threads."""
    rows, cols = a.shape[1] if ta else a.shape[0], b.shape[0] if tb else b.shape[1]
    if out is None:
        out = a.new_empty(rows, cols)
    torch.ops.linattn_cpu.gemm(a[None], b[None], out[None], ta, tb, 1.0, beta)
    return out


def executed_flops() -> int | None:
    """The floating-point operations the fused kernels' products (gemms, and the delta family's
    triangular solves) have executed in this process so far (csrc/flop_count.h); None when the kernels
    are not built. The difference across a call is the matmul work that call ran."""
    return int(torch.ops.linattn_cpu.executed_flops()) if available() else None


def _ready() -> bool:
    """torch.compile is not tracing, and the kernels are enabled and built."""
    return not torch.compiler.is_compiling() and available()


def _inference(*tensors) -> bool:
    """No gradient is wanted of `tensors`, and the kernels are ready (`_ready`)."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    return _ready()


def fused_phi(feature_map, scale, key_padding_mask, state, q, k, v, *, bf16: bool = True, train: bool = False):
    """The kernels' φ code when a call can take a fused operator, else None: CPU tensors of the
    state's floating dtype (fp32/fp64; unless bf16=False also bf16 q, k, v on a float32 state), φ the
    identity or elu+1 (neither has parameters), no scale, no mask, and no gradient wanted unless
    train=True (the chunked forward has a fused backward; the step has none)."""
    phi = native_code(feature_map)
    if phi not in (0, 1):
        return None
    kv, z = state
    low = bf16 and q.dtype is torch.bfloat16 and kv.dtype is torch.float32
    if (scale is not None or key_padding_mask is not None or not q.is_cpu or kv.dtype not in _DTYPES
            or not (q.dtype is k.dtype is v.dtype) or kv.dtype is not z.dtype or (q.dtype is not kv.dtype and not low)):
        return None
    return phi if (_ready() if train else _inference(q, k, v, kv, z)) else None


def step(state, q, k, v, *, phi: int, normalize: bool, eps: float, angles=None, inplace: bool = False):
    """linattn_cpu::step on (B, H, 1, ·) tensors: returns (o (B, H, 1, E), (kv', z')); with inplace (kv
    and z contiguous) linattn_cpu::step_, and (kv', z') are kv and z, updated in place.

    angles: RoPE (c, s) broadcastable to (B, H, 1, F), one row per batch entry or one for all."""
    kv, z = state
    c, s = (None, None) if angles is None else angles
    if inplace:
        return torch.ops.linattn_cpu.step_.default(kv, z, q, k, v, phi, normalize, eps, c, s, kv.shape[1]), state
    o, kv_new, z_new = torch.ops.linattn_cpu.step.default(kv, z, q, k, v, phi, normalize, eps, c, s, kv.shape[1])
    return o, (kv_new, z_new)


def bf16_choice() -> precision.Bf16Choice:
    """How the fused chunked kernels multiply bf16 inputs on this machine: bf16 gemms where the CPU has
    AVX512-BF16 (linattn's own bf16 register tiles, csrc/gemm_bf16.h) or AMX (MKL's
    gemm_bf16bf16f32), else fp32 gemms on blocks widened in cache (linattn.ops.precision's rule;
    LINATTN_BF16_PATH=bf16|fp32 forces either). Made once per process (and mode).

    The bf16 gemms round the operands the kernels form (scores, the chunk state) to bf16; the fp32
    path rounds only the inputs and outputs. On the 2-core AMD EPYC development machine (one core,
    1 × 16 × 2048 × 128 × 128, bf16), the tiles against the widened path: forward 1.23× (linear),
    1.28× (scalar gates), 1.50× (GLA); fwd+bwd 1.31×, 1.29×, 1.03× (the delta family and the sliding
    window widen their blocks on either path)."""
    return precision.cached_choice("fused", _fused_choice)


def bf16_tiles() -> bool:
    """The fused kernels multiply bf16 operands by their own AVX512-BF16 tiles (csrc/gemm_bf16.h);
    read once, like `tile_gemm`."""
    if not available():
        return False
    if "bf16_tiles" not in _state:
        _state["bf16_tiles"] = bool(torch.ops.linattn_cpu.uses_bf16_tiles())
    return _state["bf16_tiles"]


def _fused_choice(mode: str) -> precision.Bf16Choice:
    tiles = bf16_tiles()
    ok = tiles or (available() and bool(torch.ops.linattn_cpu.has_blas_bf16()))
    return precision.choose(precision.cpu_bf16_features(), None, "MKL's bf16 gemm", mode, available=ok,
                            faster="AVX512-BF16: linattn's bf16 register tiles" if tiles else None)


def bf16_compute() -> torch.dtype:
    """The dtype in which linattn's CPU matrix products of bf16 inputs run on this machine: the fused
    kernels' (`bf16_choice`) where they are built, else the torch ops' (precision.torch_choice).
    torch.bfloat16 or torch.float32; for code that multiplies bf16 operands itself (a model-level
    decode, say) and should follow the same rule: with torch.float32, widen bf16 operands block by
    block and multiply in fp32, rounding only the results."""
    return bf16_choice().dtype if available() else precision.torch_choice().dtype


def bf16_summary() -> dict:
    """What bf16 inputs take on this CPU, for reports: {"mode": LINATTN_BF16_PATH's mode, "cpu": the
    bf16 features (precision.cpu_bf16_features), "fused" and "torch_ops": {"path", "dtype", "reason",
    "speedup"} ("fused" None without the extension), "line": one sentence}."""
    fused = bf16_choice() if available() else None
    torch_ops = precision.torch_choice()

    def as_dict(c):
        return None if c is None else {"path": c.label, "dtype": str(c.dtype).replace("torch.", ""),
                                       "reason": c.reason, "speedup": c.speedup}

    return {"mode": precision.mode(), "cpu": precision.cpu_bf16_features(), "fused": as_dict(fused),
            "torch_ops": as_dict(torch_ops), "line": precision.describe(fused, torch_ops)}


def wide(q: torch.Tensor) -> bool:
    """The fused kernels widen these inputs to fp32 for their products (bf16 on the fp32 path)."""
    return q.dtype == torch.bfloat16 and bf16_choice().dtype == torch.float32


def chunked_ready(dtype: torch.dtype) -> bool:
    """The fused chunked kernels found a gemm for inputs of `dtype`: torch's BLAS for fp32/fp64, and for
    bf16 their own bf16 tiles or MKL's bf16 gemm, or the fp32 one where bf16 takes the fp32 path
    (`bf16_choice`)."""
    low = dtype == torch.bfloat16 and bf16_choice().dtype == torch.bfloat16
    key = "blas_bf16" if low else "blas"
    if _state.get(key) is None:
        ops = torch.ops.linattn_cpu
        _state[key] = (bool(ops.has_blas_bf16()) or bf16_tiles()) if low else bool(ops.has_blas())
    return _state[key]


def chunked(q, k, v, state, *, phi: int, normalize: bool, eps: float, chunk: int, cu_seqlens=None):
    """The causal chunked forward as fused operators: linattn_cpu::chunked alone when no gradient is
    wanted, else through `FusedChunkedCausal` (its backward is linattn_cpu::chunked_backward).
    cu_seqlens (checked by the caller): packed sequences in one call (batch 1, a state per sequence).
    Returns (o, (kv, z))."""
    kv0, z0 = state
    w = wide(q)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, kv0, z0)):
        o, kv, z = FusedChunkedCausal.apply(q, k, v, kv0, z0, phi, normalize, eps, chunk, w, cu_seqlens)
    else:
        o, kv, z, *_ = torch.ops.linattn_cpu.chunked.default(q, k, v, kv0, z0, phi, normalize, eps, chunk, False, w,
                                                             cu_seqlens)
    return o, (kv, z)


class FusedChunkedCausal(torch.autograd.Function):
    """apply(q, k, v, kv0, z0, phi, normalize, eps, chunk, wide, cu_seqlens) -> (o, kv, z), fused forward and
    backward (wide: bf16 inputs on the fp32 path, `wide`; the backward takes the forward's path; cu_seqlens:
    packed sequences, or None).

    Saved for the backward: q, k, v, o, the denominators d + ε (B·H·N floats) and the state entering
    every block of 512 tokens (B·H·⌈N/512⌉·F·E floats); the backward recomputes φ and the chunk states
    of one block at a time. Not twice differentiable."""

    @staticmethod
    def forward(ctx, q, k, v, kv0, z0, phi, normalize, eps, chunk, wide, cu_seqlens=None):
        o, kv, z, den, S_blocks, z_blocks = torch.ops.linattn_cpu.chunked.default(q, k, v, kv0, z0, phi, normalize,
                                                                                 eps, chunk, True, wide, cu_seqlens)
        ctx.save_for_backward(q, k, v, o, den, S_blocks, z_blocks, kv0, z0)
        ctx.phi, ctx.normalize, ctx.eps, ctx.chunk, ctx.wide, ctx.cu = phi, normalize, eps, chunk, wide, cu_seqlens
        ctx.set_materialize_grads(False)  # unused outputs get None, not zero tensors
        return o, kv, z

    @staticmethod
    @first_order("linear_attention")
    @torch.autograd.function.once_differentiable
    def backward(ctx, do, dkv, dz):
        q, k, v, o, den, S_blocks, z_blocks, kv0, z0 = ctx.saved_tensors
        dq, dk, dv, dkv0, dz0 = torch.ops.linattn_cpu.chunked_backward.default(
            q, k, v, o, torch.zeros_like(o) if do is None else do, den, S_blocks, z_blocks, dkv, dz, ctx.phi,
            ctx.normalize, ctx.chunk, ctx.wide, ctx.cu)
        if not all_finite(dkv0, dz0):  # a NaN or Inf among the factors: the torch ops' exact pass
            dq, dk, dv, dkv0, dz0 = _exact_backward(ctx, (q, k, v, kv0, z0), (do, dkv, dz))
        return dq, dk, dv, dkv0.to(kv0.dtype), dz0.to(z0.dtype), None, None, None, None, None, None


def _exact_backward(ctx, inputs, grads):
    """Gradients of (q, k, v, kv0, z0) from the torch-op chunked Function's exact pass (run again
    here; sequence by sequence when packed), for a backward whose products met a NaN or Inf
    (linattn.ops.linear.chunked)."""
    fz = kernel_featurizer(ctx.phi)

    def exact(*xs):
        return ChunkedCausalLinearAttention.apply(fz, ctx.chunk, ctx.normalize, ctx.eps, True, *xs)

    with torch.enable_grad():
        xs = [x.detach().requires_grad_() for x in inputs]
        outs = exact(*xs) if ctx.cu is None else packed_exact(exact, ctx.cu, xs[:3], xs[3:])
        used = [(out, g) for out, g in zip(outs, grads) if g is not None]
        res = torch.autograd.grad([u[0] for u in used], xs, [u[1] for u in used], allow_unused=True)
    return [torch.zeros_like(x) if r is None else r for x, r in zip(xs, res)]


def packed_exact(exact, cu_seqlens, tokens, states):
    """exact(*tokens, *states) -> (o, *final states), an unpacked torch-op Function, run on the packed
    sequences of cu_seqlens one length at a time (linattn.ops.packed.per_sequence); returns (o, *final
    states) of the whole packed row, as the fused kernel given cu_seqlens does."""
    q = tokens[0]
    bounds = packed.boundaries(cu_seqlens, batch=q.shape[0], length=q.shape[2])
    e = tokens[2].shape[-1]
    o, final = packed.per_sequence(exact, bounds, tokens, states, lambda: q.new_zeros(1, q.shape[1], 0, e))
    return (o, *final)


def release_pool() -> int:
    """Frees the buffers that the fused kernels keep for reuse; returns the bytes freed.

    Results of 8 MiB and more (o, dq, dk, dv of long sequences) are taken from a pool of freed
    buffers, at most LINATTN_POOL_MB (default 512) MiB held, 0 to turn the pool off: glibc returns
    such buffers to the OS on free, and a fresh one costs page faults and zeroing on every call."""
    return int(torch.ops.linattn_cpu.release_pool()) if available() else 0


def rms_norm_fusable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """RMSNorm of x can take the fused operator: CPU, fp32/fp64 x of weight's dtype, no gradient wanted."""
    return x.device.type == "cpu" and x.dtype in _DTYPES and weight.dtype is x.dtype and _inference(x, weight)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / √(mean(x²) + eps) · weight over the last dim (squares summed in float64)."""
    return torch.ops.linattn_cpu.rms_norm.default(x, weight, eps)
