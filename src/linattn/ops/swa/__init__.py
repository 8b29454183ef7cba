"""Sliding-window softmax attention and the LoLCATs hybrid of a window and linear attention
(design §19).

    api.py        sliding_window_attention (chunked, O(N·W)), sliding_window_attention_step (the
                  ring-buffer decoding step, WindowState)
    hybrid.py     lolcats_attention and lolcats_attention_step: softmax over the window and linear
                  attention beyond it, one normalizer (Zhang et al. 2024)
    chunked.py    the chunked algorithm in torch ops, with its memory-bounded backward (block
                  layout, masks); the path of non-CPU devices
    cpu.py        the CPU paths: linattn's kernels (csrc/swa.cpp, fp32/fp64 without a key mask; design
                  §21), else torch's fused flash-attention kernel on the same blocks and spans
    checks.py     argument checks (window, cu_seqlens, per-head factors)
    reference.py  the oracles: the definitions with the N×N band mask, float64
"""

from . import reference
from .api import WindowState, sliding_window_attention, sliding_window_attention_step
from .hybrid import HybridState, lolcats_attention, lolcats_attention_step

__all__ = ["HybridState", "WindowState", "lolcats_attention", "lolcats_attention_step", "reference",
           "sliding_window_attention", "sliding_window_attention_step"]
