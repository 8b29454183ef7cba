"""Wall-clock timing with torch.utils.benchmark: median and interquartile range of blocked runs, and
rounds that alternate several functions (a machine whose speed drifts is compared within a round)."""

from __future__ import annotations

import statistics
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


def alternate(fns: dict, *, rounds: int, min_run_time: float) -> dict[str, list[Timing]]:
    """{name: [Timing of each round]}: `rounds` rounds, each measuring every function of `fns` in turn for
    `min_run_time / rounds` seconds, so that a drift of the machine's speed falls on all of them alike."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    per_round: dict[str, list[Timing]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            per_round[name].append(measure(fn, min_run_time=min_run_time / rounds))
    return per_round


def median_round(ts: list[Timing]) -> Timing:
    """The round whose median is the median of the rounds' (its IQR with it), blocks summed."""
    mid = sorted(ts, key=lambda t: t.median)[len(ts) // 2]
    return Timing(median=mid.median, iqr=mid.iqr, blocks=sum(t.blocks for t in ts))


def round_ratio(per_round: dict[str, list[Timing]], a: str, b: str) -> float:
    """The median over the rounds of a's time over b's within the round."""
    return statistics.median(x.median / y.median for x, y in zip(per_round[a], per_round[b]))
