"""Checks a benchmark's own numbers for signs that they do not measure what they claim, and picks a
thread count that keeps them stable.

A timing is a median over blocks of calls with the interquartile range (IQR) as its spread
(`timing.measure`). Three signs of a disturbed measurement, each reported as one warning line:

- **unstable**: a point whose IQR exceeds half its median: the blocks disagree so much that any
  difference smaller than that (a ratio between methods, the growth from one size to the next) is
  noise.
- **faster when larger**: in a series whose cost must grow with the size (sequence length, context,
  layers × tokens, batch), a larger size measured faster than a smaller one beyond their spreads
  (its upper quartile below the smaller size's lower quartile; where only single runs exist, 10%
  faster at twice the size or more).
- **flat**: such a series spanning a size range of 8× or more whose time grew by less than the
  spreads of its two ends: the growth the table reports is noise, or something else sets the time.

The usual cause on a shared machine is more compute threads than idle cores. A thread that loses its
core waits for the scheduler's next slice (4 ms at 250 Hz), and a parallel region waits for its
slowest thread, so a per-call time of microseconds becomes a flat multiple of the slice. Measured
on the 2-core development machine with other jobs running (1-minute load 2.7-3.5), softmax attention
of one query against a KV cache, B=1, H=8, D=E=64, fp32, 5 interleaved rounds of median ± IQR:

    threads   ctx 256          ctx 1,024        ctx 4,096        ctx 16,384
    2         11.98 ± 0.1 ms   11.97 ± 0.1 ms   11.96 ± 0.3 ms   11.99 ± 0.1 ms   (every round: flat)
    1         0.04-0.08 ms     0.12-0.21 ms     1.0-1.3 ms       4.8-8.1 ms       (grows with ctx)

and the chunked causal linear forward at N=4,096 took 23.5 ms (IQR 0.4-3.2) on one thread against
28-34 ms (IQR 6-11) on two. Hence `stable_threads`: one thread per idle core (the CPUs this process
may use, less the 1-minute load average of the machine), at least one.
"""

from __future__ import annotations

import os

UNSTABLE_IQR = 0.5  # IQR / median above which a point is called unstable
FLAT_RANGE = 8.0  # size ratio over which a growing series must visibly grow
NO_SPREAD_TOLERANCE = 0.1  # relative slack for comparisons of single measurements


def stable_threads() -> tuple[int, str]:
    """(threads, why): one torch thread per idle core, at least one. Idle cores: the CPUs this
    process may run on, at most the machine's CPU count less its 1-minute load average."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # no load average on this platform
        return usable, f"{usable} usable CPUs (no load average here)"
    idle = (os.cpu_count() or usable) - load
    threads = max(1, min(usable, int(idle + 0.5)))
    return threads, f"{usable} usable CPUs, 1-minute load average {load:.1f}: one thread per idle core"


def _fmt(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"


def unstable(label: str, where: str, median: float | None, iqr: float | None) -> list[str]:
    """A warning when the point's spread exceeds UNSTABLE_IQR of its median."""
    if median is None or iqr is None or median <= 0 or iqr <= UNSTABLE_IQR * median:
        return []
    return [f"{label} at {where}: {_fmt(median)} with an IQR of {_fmt(iqr)} ({iqr / median:.0%} of the median): "
            "the measurement is unstable"]


def growing_series(label: str, size_name: str, points: list[tuple[float, float, float | None]]) -> list[str]:
    """Warnings for a series whose cost must grow with its size: points (size, median_s, iqr_s or
    None), any order. Inversions: with spreads, a size faster than the next smaller one beyond both
    spreads (its upper quartile below the other's lower quartile); without, a size at least twice
    another and more than NO_SPREAD_TOLERANCE faster (single runs at nearby sizes differ by noise
    alone). The largest inversion of the series is reported (with a count of the others), then a
    flat series over a range of FLAT_RANGE or more (when there was no inversion)."""
    pts = sorted((s, m, i) for s, m, i in points if m is not None)
    spread = all(i is not None for _, _, i in pts)
    inversions = []
    for a, (s0, m0, i0) in enumerate(pts):
        later = pts[a + 1:a + 2] if spread else [p for p in pts[a + 1:] if p[0] >= 2 * s0]
        for s1, m1, i1 in later:
            faster = (m1 + i1 / 2 < m0 - i0 / 2) if spread else m1 < (1 - NO_SPREAD_TOLERANCE) * m0
            if s1 > s0 and faster:
                inversions.append((m1 / m0, s0, m0, s1, m1))
    out = []
    if inversions:
        _, s0, m0, s1, m1 = min(inversions)
        more = f" (and {len(inversions) - 1} more such pairs)" if len(inversions) > 1 else ""
        out.append(f"{label}: {size_name}={s1:g} took {_fmt(m1)}, less than {size_name}={s0:g} ({_fmt(m0)}), "
                   f"although the cost grows with it{more}")
    if not inversions and len(pts) >= 2 and pts[-1][0] >= FLAT_RANGE * pts[0][0]:
        (s0, m0, i0), (s1, m1, i1) = pts[0], pts[-1]
        noise = (i0 + i1) if spread else NO_SPREAD_TOLERANCE * m0
        if m1 - m0 <= noise:
            spreads = f", spreads {_fmt(i0)} and {_fmt(i1)}" if spread else ""
            out.append(f"{label}: flat from {size_name}={s0:g} to {s1:g} ({_fmt(m0)} to {_fmt(m1)}{spreads}) "
                       f"although the cost grows with it over a {s1 / s0:g}-fold range")
    return out


def advice(warnings: list[str], threads: int) -> str | None:
    """The closing line of a report with warnings: what to do about them."""
    if not warnings:
        return None
    try:
        load = f"; 1-minute load average now {os.getloadavg()[0]:.1f}"
    except (AttributeError, OSError):
        load = ""
    fewer = "fewer --threads, " if threads > 1 else ""
    return (f"{len(warnings)} inconsistenc{'y' if len(warnings) == 1 else 'ies'} in these numbers ({threads} "
            f"thread{'s' if threads != 1 else ''}{load}): other processes may share the cores; rerun with {fewer}"
            "a longer --min-run-time, or on an idle machine")
