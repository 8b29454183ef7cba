"""Benchmarks of the operators: timing (torch.utils.benchmark), memory (allocation tracking), FLOP
counts and matmul peak, the compared methods, and the `bench ops` / `bench decode` sweeps.

    timing.measure            median and IQR of a callable
    memory.AllocationTracker  live/peak bytes of ATen-op allocations (CPU); memory.peak_memory
    flops                     chunked linear FLOPs, measured matmul peak
    methods                   the implementations compared, measure_method (time + memory of one)
    peers                     optional third-party implementations
    ops, decode               the sweeps behind the CLI, with their tables and plots
"""

from .flops import chunked_linear_flops, matmul_peak
from .memory import AllocationTracker, peak_memory
from .methods import Method, Shape, core_methods, measure_method
from .timing import Timing, measure

__all__ = [
    "AllocationTracker",
    "Method",
    "Shape",
    "Timing",
    "chunked_linear_flops",
    "core_methods",
    "matmul_peak",
    "measure",
    "measure_method",
    "peak_memory",
]
