"""Wall-clock timing with torch.utils.benchmark: median and interquartile range of blocked runs."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils import benchmark


@dataclass
class Timing:
    """Seconds per call: median and IQR over the measured blocks, and how many blocks."""

    median: float
    iqr: float
    blocks: int

    def as_dict(self) -> dict:
        return {"median_s": self.median, "iqr_s": self.iqr, "blocks": self.blocks}


def measure(fn, *, min_run_time: float = 0.5, warmup: int = 0) -> Timing:
    """Times `fn()` with `Timer.blocked_autorange(min_run_time)` on all torch threads.

    blocked_autorange already makes untimed calls to size its blocks (a warm-up); `warmup` adds more.
    CUDA work is synchronized by the Timer.
    """
    for _ in range(warmup):
        fn()
    timer = benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    m = timer.blocked_autorange(min_run_time=min_run_time)
    return Timing(median=float(m.median), iqr=float(m.iqr), blocks=len(m.times))
