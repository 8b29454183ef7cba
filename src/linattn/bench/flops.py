"""FLOP counts and the machine's measured matmul peak.

Causal chunked linear attention, forward, per (batch, head), chunk size C (design §3): per token
2·F·E for the inter-chunk product Q̃S and as much again for the chunk state K̃ᵀV, 2·C·F for the
intra-chunk scores Q̃K̃ᵀ and 2·C·E for applying them to V:

    flops_fwd = 2·N·(2·F·E + C·F + C·E)

The backward is counted as 2× the forward (fwd+bwd = 3× forward). The peak is the best that the
machine's matrix products reach on batches of square tiles, measured in the same run: torch.bmm (its
BLAS) and, on the CPU in float32 / float64, the fused kernels' own product (`linattn_cpu::gemm`, the
register tiles of csrc/gemm.h), whichever is faster — on the AMD EPYC of this project's runs MKL's
sgemm reached ~105 GFLOP/s on one core and the tiles ~265, so a peak from torch.bmm alone would let the
kernels pass 100% of "the peak".
"""

from __future__ import annotations

import torch

from ..ops.linear.chunked import DEFAULT_CHUNK_SIZE

from .timing import measure


def chunked_linear_flops(batch: int, heads: int, n: int, feat: int, value_dim: int,
                         chunk: int = DEFAULT_CHUNK_SIZE) -> int:
    """Forward FLOPs of causal chunked linear attention, all heads: B·H·2·N·(2FE + CF + CE)."""
    return batch * heads * 2 * n * (2 * feat * value_dim + chunk * feat + chunk * value_dim)


#: the products a peak can be measured with
KERNELS = ("torch.bmm", "linattn")


def linattn_gemm_available(dtype: torch.dtype, device: torch.device | str = "cpu") -> bool:
    """True where `linattn_cpu::gemm` runs: the CPU, the fused kernels built, float32 / float64, or
    bfloat16 where its AVX512-BF16 tiles run (bf16 operands, float32 results)."""
    if torch.device(device).type != "cpu" or dtype not in (torch.float32, torch.float64, torch.bfloat16):
        return False
    from ..ops import native

    if not (native.enabled() and native.load()):
        return False
    return dtype != torch.bfloat16 or native.bf16_tiles()


def matmul_peak(dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", *, tile: int = 64,
                batches: tuple[int, ...] = (128, 1024), min_run_time: float = 0.2, kernel: str = "torch.bmm") -> dict:
    """Best throughput of `kernel` (torch.bmm, or linattn's own product) on `batch` tiles of
    tile×tile @ tile×tile over the given batch sizes.

    Returns {"gflops", "batch", "tile", "dtype", "kernel"}; gflops = 2·batch·tile³ / median time / 1e9.
    """
    if kernel not in KERNELS:
        raise ValueError(f"kernel: unknown {kernel!r}; choose from {list(KERNELS)}")
    if kernel == "linattn" and not linattn_gemm_available(dtype, device):
        raise ValueError(f"kernel: linattn's product runs on the CPU in float32 / float64 (bfloat16 with "
                         f"AVX512-BF16) with the fused kernels built, not {dtype} on {device}")
    best = {"gflops": 0.0, "batch": None, "tile": tile, "dtype": str(dtype).replace("torch.", ""), "kernel": kernel}
    for b in batches:
        run = peak_workload(dtype, device, tile=tile, batch=b, kernel=kernel)
        t = measure(run, min_run_time=min_run_time, warmup=2)
        gflops = 2 * b * tile**3 / t.median / 1e9
        if gflops > best["gflops"]:
            best.update(gflops=gflops, batch=b)
    return best


def peak_workload(dtype: torch.dtype, device: torch.device | str, *, tile: int, batch: int, kernel: str):
    """run(): `kernel` on `batch` products of tile×tile @ tile×tile (2·batch·tile³ FLOPs), random inputs
    made once, the output written in place (matmul_peak's workload; the kernel is checked there)."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(batch, tile, tile, generator=gen).to(device=device, dtype=dtype)
    y = torch.randn(batch, tile, tile, generator=gen).to(device=device, dtype=dtype)
    wide = kernel == "linattn" and dtype == torch.bfloat16  # bf16 operands, float32 results
    out = torch.empty(batch, tile, tile, device=device, dtype=torch.float32 if wide else dtype)
    if kernel == "linattn":
        def run():
            torch.ops.linattn_cpu.gemm(x, y, out, False, False, 1.0, 0.0)
    else:
        def run():
            torch.bmm(x, y, out=out)
    return run


def best_matmul_peak(dtype: torch.dtype, device: torch.device | str, tiles: dict, min_run_time: float) -> dict:
    """The best matmul_peak over the kernels that run here and `tiles` ({tile: batch sizes}): that
    result, with "by_kernel" {kernel: its best GFLOP/s}."""
    kernels = [k for k in KERNELS if k == "torch.bmm" or linattn_gemm_available(dtype, device)]
    runs = [matmul_peak(dtype, device, tile=t, batches=b, min_run_time=min_run_time, kernel=k)
            for k in kernels for t, b in tiles.items()]
    best = dict(max(runs, key=lambda p: p["gflops"]))
    best["by_kernel"] = {k: max(p["gflops"] for p in runs if p["kernel"] == k) for k in kernels}
    return best
