"""Transparent huge pages for a model's weights (Linux): `linattn.models.huge_pages(model)`.

A decoding step at batch 1 streams every weight once, and on small (4 KB) pages a core spends part of
that stream on TLB misses. On one core of this project's AMD EPYC, one pass over a 1.5 GB buffer of
fp32 rows (the fused decoder's matrix-vector loop) took a median 0.89× the time once the buffer sat
on 2 MB pages (12 rounds alternating the two buffers, a stand-alone test, 2026-12-05).

`huge_pages` asks the kernel for huge pages over each large weight: `madvise(MADV_HUGEPAGE)` on the
2 MB-aligned part of the tensor's storage (the pages faulted in later), then `MADV_COLLAPSE` (Linux
≥ 6.1), which moves the pages already there onto huge pages synchronously — once per range: about
2.6 s per GB on that machine the first time, nothing after. Values are unchanged. Opt-in, because of
that one-time cost: worth it before a long decoding run (the bench hf runs use it), not before a few
tokens. Where the kernel refuses (THP set to "never", an older kernel without MADV_COLLAPSE) the range
stays on small pages; off Linux, for CUDA tensors, tensor subclasses (torchao's int8 weights) and
tensors under 2 MB it does nothing.
"""

from __future__ import annotations

import ctypes
import sys

import torch
from torch import nn

__all__ = ["HUGE_PAGE", "huge_pages"]

#: bytes of a transparent huge page on x86-64 and arm64 (4 KB base pages)
HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE, _MADV_COLLAPSE = 14, 25
_libc = None


def _madvise(start: int, length: int, advice: int) -> bool:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _libc.madvise.restype = ctypes.c_int
    return _libc.madvise(start, length, advice) == 0


def huge_pages(model: nn.Module | list, *, collapse: bool = True) -> int:
    """Bytes of `model`'s parameters and buffers (or of a list of tensors) now on huge pages or asked to
    be: each plain CPU tensor's storage, rounded inward to HUGE_PAGE boundaries, gets MADV_HUGEPAGE and,
    with `collapse`, MADV_COLLAPSE. A range the kernel refuses counts 0. Tied weights count once."""
    tensors = list(model.parameters()) + list(model.buffers()) if isinstance(model, nn.Module) else list(model)
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"huge_pages: expected a module or tensors, got a {type(t).__name__}")
    if not sys.platform.startswith("linux"):
        return 0
    done: set = set()
    total = 0
    for t in tensors:
        if t.device.type != "cpu" or type(t.data) is not torch.Tensor:
            continue
        storage = t.untyped_storage()
        start = storage.data_ptr()
        lo = -(-start // HUGE_PAGE) * HUGE_PAGE
        hi = (start + storage.nbytes()) // HUGE_PAGE * HUGE_PAGE
        if hi <= lo or (lo, hi) in done:
            continue
        done.add((lo, hi))
        if not _madvise(lo, hi - lo, _MADV_HUGEPAGE):
            continue
        if not collapse or _madvise(lo, hi - lo, _MADV_COLLAPSE):
            total += hi - lo
    return total
