"""Argument checks of the sliding-window operators: each error names the argument."""

from __future__ import annotations

import torch

from ..._checks import check_int, check_key_padding_mask, check_number, check_qkv

#: Rows per query block C when the caller does not choose (benchmarks/swa.py measured 32, 64, 128).
DEFAULT_CHUNK_SIZE = 64


def check_common(q, k, v, window, scale, chunk_size, key_padding_mask) -> int:
    """q, k (B, H, N, D), v (B, H, N, E) of one sequence length; window an int ≥ 1; scale None or
    a positive number; chunk_size None or an int ≥ 1. Returns the chunk size to use."""
    check_qkv(q, k, v)
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"k must have q's sequence length ({q.shape[2]}): sliding-window attention is "
                         f"self-attention, got k length {k.shape[2]}")
    check_int("window", window, minimum=1, error=ValueError)
    check_number("scale", scale, minimum=0, low_open=True, allow_none=True)
    check_int("chunk_size", chunk_size, minimum=1, allow_none=True)
    check_key_padding_mask(key_padding_mask, q.shape[0], q.shape[2], q.device)
    return DEFAULT_CHUNK_SIZE if chunk_size is None else chunk_size


def check_cu_seqlens(cu_seqlens, batch: int, length: int, device: torch.device) -> None:
    """cu_seqlens: a 1-D int tensor [S + 1] of cumulative lengths, 0 first, N last, non-decreasing,
    on q's device, with batch 1 (design §17)."""
    if cu_seqlens is None:
        return
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cu_seqlens must be an int32 or int64 tensor, got dtype {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D with at least 2 entries, got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.device != device:
        raise ValueError(f"cu_seqlens must be on q's device ({device}), got {cu_seqlens.device}")
    if batch != 1:
        raise ValueError(f"cu_seqlens needs the sequences packed in one row (batch 1), got batch {batch}")
    cu = cu_seqlens.tolist()
    if cu[0] != 0 or cu[-1] != length or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens must start at 0, end at the sequence length {length} and not decrease, "
                         f"got {cu}")


def check_factor(name: str, value, heads: int, like: torch.Tensor) -> torch.Tensor:
    """A per-head factor: a number, or a tensor of H (or 1) entries; returned as (1, H, 1, 1) in
    like's dtype (it may carry a gradient)."""
    if isinstance(value, torch.Tensor):
        if value.numel() not in (1, heads) or value.dim() > 1:
            raise ValueError(f"{name} must be a number or a tensor of shape (H,) = ({heads},), "
                             f"got shape {tuple(value.shape)}")
        if not value.is_floating_point():
            raise TypeError(f"{name} must be a floating tensor, got dtype {value.dtype}")
        return value.to(like.dtype).reshape(-1).expand(heads).view(1, heads, 1, 1)
    check_number(name, value, minimum=0, low_open=True)
    return torch.full((1, heads, 1, 1), float(value), dtype=like.dtype, device=like.device)
