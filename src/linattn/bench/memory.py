"""Peak memory of a computation, on CPU and CUDA.

CPU has no allocator statistics, so `AllocationTracker` watches ATen ops instead: a TorchDispatchMode
that, for every op output whose storage is new (not one of the op's inputs' storages, so views,
in-place and out= ops are not counted again), adds the storage's nbytes to the live total and
registers a weakref finalizer on the storage that subtracts them when it is freed. It keeps the
peak of the live total.

What it counts: storages allocated by ATen ops while the mode is active, forward and backward
(autograd runs the backward under the same mode). What it does not: tensors that existed before
(inputs, parameters), allocations inside an op that never come out of it (an op's scratch buffers),
and memory held by the allocator's caches. On CUDA `peak_memory` uses torch.cuda.max_memory_allocated
instead, which does include op scratch.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class AllocationTracker(TorchDispatchMode):
    """Counts live bytes of storages created by ATen ops inside the mode; `.peak`, `.live` in bytes."""

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: weakref.WeakSet = weakref.WeakSet()

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes

    def track(self, storage: torch.UntypedStorage) -> None:
        """Counts `storage` from now until it is freed (once, however often it is seen)."""
        if storage in self._seen:
            return
        nbytes = storage.nbytes()
        self._seen.add(storage)
        if nbytes == 0:
            return
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, nbytes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = {id(t.untyped_storage()) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                st = t.untyped_storage()
                if id(st) not in inputs:
                    self.track(st)
        return out


def peak_memory(fn, device: torch.device | str = "cpu"):
    """Runs `fn()` once; returns (peak bytes allocated above what was live before, fn's result).

    CPU: AllocationTracker (ATen op outputs). CUDA: torch.cuda.max_memory_allocated. Whatever `fn`
    returns is still alive at the end, so callers can subtract the result's own size.
    """
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        result = fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base, result
    with AllocationTracker() as tracker:
        result = fn()
    return tracker.peak, result


def nbytes(*tensors) -> int:
    """Total bytes of the given tensors' elements (None entries ignored)."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)
