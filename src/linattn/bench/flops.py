"""FLOP counts and the machine's measured matmul peak.

Causal chunked linear attention, forward, per (batch, head), chunk size C (design §3): per token
2·F·E for the inter-chunk product Q̃S and as much again for the chunk state K̃ᵀV, 2·C·F for the
intra-chunk scores Q̃K̃ᵀ and 2·C·E for applying them to V:

    flops_fwd = 2·N·(2·F·E + C·F + C·E)

The backward is counted as 2× the forward (fwd+bwd = 3× forward). The peak is what torch.bmm reaches
on the op's own tile shape: batches of C×F @ F×E (64×64 @ 64×64) matrices, measured in the same run.
"""

from __future__ import annotations

import torch

from ..ops.linear.chunked import DEFAULT_CHUNK_SIZE

from .timing import measure


def chunked_linear_flops(batch: int, heads: int, n: int, feat: int, value_dim: int,
                         chunk: int = DEFAULT_CHUNK_SIZE) -> int:
    """Forward FLOPs of causal chunked linear attention, all heads: B·H·2·N·(2FE + CF + CE)."""
    return batch * heads * 2 * n * (2 * feat * value_dim + chunk * feat + chunk * value_dim)


def matmul_peak(dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", *, tile: int = 64,
                batches: tuple[int, ...] = (128, 1024), min_run_time: float = 0.2) -> dict:
    """Best torch.bmm throughput on `batch` tiles of tile×tile @ tile×tile over the given batch sizes.

    Returns {"gflops", "batch", "tile", "dtype"}; gflops = 2·batch·tile³ / median time / 1e9.
    """
    best = {"gflops": 0.0, "batch": None, "tile": tile, "dtype": str(dtype).replace("torch.", "")}
    gen = torch.Generator(device="cpu").manual_seed(0)
    for b in batches:
        x = torch.randn(b, tile, tile, generator=gen).to(device=device, dtype=dtype)
        y = torch.randn(b, tile, tile, generator=gen).to(device=device, dtype=dtype)
        out = torch.empty(b, tile, tile, device=device, dtype=dtype)
        t = measure(lambda: torch.bmm(x, y, out=out), min_run_time=min_run_time, warmup=2)
        gflops = 2 * b * tile**3 / t.median / 1e9
        if gflops > best["gflops"]:
            best.update(gflops=gflops, batch=b)
    return best
