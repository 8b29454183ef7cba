"""Sliding-window softmax attention as a layer (the `swa` kind), with the interface of every
kind (linattn.nn.base.Attention):

    forward(x, mask=None, cache=None, positions=None) -> (y, cache)

    y_i = W_o · concat_h [ Σ_{j ∈ window(i)} softmax_j(q̂_iᵀ k̂_j / √qk_dim) v_j ],
    window(i) = the last W tokens up to i (itself included),

q̂, k̂ the RoPE-rotated q, k when rope=True. Training runs linattn.ops.swa.sliding_window_attention
(chunked, O(N·W)); decoding keeps a ring buffer of the last W rotated keys and values
(SlidingWindowCache), so its memory is flat in the context length, unlike SoftmaxAttention's KV cache.
"""

from __future__ import annotations

from .._checks import check_int
from ..ops.linear.chunked import DEFAULT_CHUNK_SIZE
from .base import Attention
from .caches import LoLCATsCache, SlidingWindowCache
from .families import WINDOW, WindowMix
from .positional import RotaryEmbedding

#: The window of LoLCATs and of the `swa` kind when the config does not choose one.
DEFAULT_WINDOW = 64


def _check_window(window) -> int:
    check_int("window", window, minimum=1)
    return window


def ring_of(cache):
    """The ring buffer (linattn.ops.swa.WindowState) of a window kind's cache: SlidingWindowCache's and
    LigerCache's `window`, LoLCATsCache's `state.window`; None before the prefill."""
    if isinstance(cache, LoLCATsCache):
        return None if cache.state is None else cache.state.window
    return cache.window


def _advance_ring(cache) -> None:
    """After a fused step (which wrote the token into the ring in place): the ring's WindowState, a
    NamedTuple, counts it, as the eager step's write_window does."""
    ring = ring_of(cache)
    ring = ring._replace(length=ring.length + 1)
    if isinstance(cache, LoLCATsCache):
        cache.state = cache.state._replace(window=ring)
    else:
        cache.window = ring


class SlidingWindowAttention(Attention):
    """Multi-head causal sliding-window softmax attention (Mistral, Longformer's causal band).

    window: W, the tokens each query sees (itself and the W − 1 before). chunk_size: the query block
    of the chunked operator. The other arguments are SoftmaxAttention's; causal must stay True, and
    dropout applies to the output projection only (the operator has no attention-weight dropout).
    """

    kind = "swa"
    family = WINDOW

    def __init__(self, d_model: int, n_heads: int, *, window: int = DEFAULT_WINDOW, causal: bool = True,
                 rope: bool = False, rope_base: float = 10_000.0, qk_dim: int | None = None, dropout: float = 0.0,
                 bias: bool = False, chunk_size: int = DEFAULT_CHUNK_SIZE, short_conv: int = 0,
                 output_gate: bool = False, norm_eps: float = 1e-5):
        if causal is not True:
            raise ValueError(f"causal must be True: sliding-window attention is causal, got {causal!r}")
        super().__init__(d_model, n_heads, qk_dim, causal, dropout, bias, short_conv=short_conv,
                         output_gate=output_gate, norm_eps=norm_eps)
        self.window = _check_window(window)
        check_int("chunk_size", chunk_size, minimum=1)
        self.chunk_size = chunk_size
        self.rope = RotaryEmbedding(self.qk_dim, rope_base) if rope else None

    def mix(self, x, q, k, v, positions) -> WindowMix:
        q, k = self.rotate(q, k, positions)
        return WindowMix(q, k, v, self.window, self.chunk_size)

    def plan_window(self, plan, cache, tensors: dict, ints: dict) -> None:
        """What the window mixer (csrc/model_window.h) reads for every window kind: the ring buffer's
        keys, values and validity mask (updated in place), the RoPE tables of q and k, and the ring's
        token count relative to the cache's (0, unless the cache's position counters were moved on alone,
        as `linattn bench decode` does to time long contexts: the eager step then also writes the ring
        by its own count); after each fused step the ring's WindowState is moved on by one token
        (`plan.after_step`)."""
        ring = ring_of(cache)
        if ring is None:
            raise ValueError("fused decoding: a window cache is empty; run the prefill first")
        if not (ring.k.is_contiguous() and ring.v.is_contiguous()):
            raise ValueError("fused decoding: the window's ring buffer must be contiguous")
        tensors.update(window_k=ring.k, window_v=ring.v)
        ints["ring_offset"] = ring.length - cache.length
        if ring.valid is not None:
            tensors["window_valid"] = ring.valid
        self.plan_qk_rope(plan, tensors)
        plan.after_step(lambda: _advance_ring(cache))

    def plan_mixer(self, plan, cache, tensors: dict, ints: dict, floats: dict) -> None:
        """The ring buffer (`plan_window`), nothing beyond the window."""
        self.plan_window(plan, cache, tensors, ints)

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, n_heads={self.n_heads}, qk_dim={self.qk_dim}, window={self.window}, "
                f"rope={self.rope is not None}")


__all__ = ["DEFAULT_WINDOW", "SlidingWindowAttention", "SlidingWindowCache", "ring_of"]
