"""The public sliding-window operators: the chunked parallel form and the ring-buffer decoding step.

Causal sliding-window softmax attention with window W (Mistral's SWA; Beltagy et al. 2020's causal
band): token i of a sequence starting at s(i) attends to window(i) = {j : max(s(i), i − W + 1) ≤ j ≤ i},

    o_i = Σ_{j ∈ window(i)} exp(q_iᵀk_j·scale) v_j / Σ_{j ∈ window(i)} exp(q_iᵀk_j·scale).

Its state is the last W keys and values: decoding keeps them in a ring buffer of W slots (token t in
slot t mod W), so memory is flat in the context length.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..autodiff import refuse_forward_ad
from ..precision import without_autocast
from . import chunked, cpu
from .checks import DEFAULT_CHUNK_SIZE, check_common, check_cu_seqlens


def sliding_window_chunked(q, k, v, *, window: int, scale: float | None, chunk: int | None, cu_seqlens=None,
                           key_padding_mask=None) -> torch.Tensor:
    """The chunked operator on checked arguments: on the CPU linattn's kernels (fp32/fp64/bf16, no key mask)
    or torch's fused flash kernel (q, k, v of one head dim; linattn.ops.swa.cpu), elsewhere the torch-op
    Function (linattn.ops.swa.chunked). A window beyond the sequence is the sequence (every query sees
    its whole prefix): it is clamped to N, so that the blocks' key spans are never wider than N.
    chunk None: the path's default block (linattn's kernels: `cpu.native_chunk`, else
    DEFAULT_CHUNK_SIZE). Reverse mode, first order only."""
    refuse_forward_ad("sliding_window_attention", q, k, v)
    window = min(window, q.shape[2])
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if chunked.FUSED_CPU and cpu.native_usable(q, k, v, key_padding_mask):
        chunk = cpu.native_chunk(window) if chunk is None else chunk
        return cpu.NativeSlidingWindowAttention.apply(q, k, v, window, scale, chunk, cu_seqlens)
    chunk = DEFAULT_CHUNK_SIZE if chunk is None else chunk
    fused = cpu.available(q, v) and chunked.FUSED_CPU
    fn = cpu.FusedSlidingWindowAttention if fused else chunked.SlidingWindowAttentionFunction
    return fn.apply(q, k, v, window, scale, chunk, cu_seqlens, key_padding_mask)


@without_autocast
def sliding_window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, window: int,
                             scale: float | None = None, cu_seqlens: torch.Tensor | None = None,
                             key_padding_mask: torch.Tensor | None = None,
                             chunk_size: int | None = None) -> torch.Tensor:
    """Causal softmax attention over the last `window` tokens. q, k: (B, H, N, D), v: (B, H, N, E) ->
    (B, H, N, E), in q's dtype (fp32/fp64/bf16/fp16; computed in float32, float64 for float64).

    scale defaults to 1/√D. cu_seqlens: int tensor [S + 1] of cumulative lengths of S sequences
    packed in one row (batch 1): nothing attends across a boundary. key_padding_mask: (B, N) bool,
    True = real token; a padded key is seen by no real query (a padded query keeps its band, so its
    output, padding anyway, is finite). chunk_size: rows per query block C; time and
    memory O(N·(min(W, N) + C)·D), no N×N matrix (linattn.ops.swa.chunked; None: 64, or on linattn's
    CPU kernels 16 for W ≤ 64 and 32 above, `cpu.native_chunk`). Gradients: first order,
    reverse mode (a gradient penalty or forward-mode AD is refused by name, linattn.ops.autodiff).
    """
    check_common(q, k, v, window, scale, chunk_size, key_padding_mask)
    check_cu_seqlens(cu_seqlens, q.shape[0], q.shape[2], q.device)
    return sliding_window_chunked(q, k, v, window=window, scale=scale, chunk=chunk_size, cu_seqlens=cu_seqlens,
                                  key_padding_mask=key_padding_mask)


class WindowState(NamedTuple):
    """The decoding state of sliding-window attention: a ring buffer of W slots.

    k (B, H, W, D), v (B, H, W, E) in the inputs' dtype; token t lives in slot t mod W. valid (B, W)
    bool, False where a slot holds a padded key (None while no padding was seen); length, the number
    of tokens fed so far (slots ≥ length are empty while length < W).
    """

    k: torch.Tensor
    v: torch.Tensor
    valid: torch.Tensor | None
    length: int

    @property
    def window(self) -> int:
        return self.k.shape[2]

    @property
    def nbytes(self) -> int:
        t = (self.k, self.v) + (() if self.valid is None else (self.valid,))
        return sum(x.numel() * x.element_size() for x in t)

    def ordered(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The filled slots in time order, oldest first (the tokens max(0, length − W) … length − 1):
        (slots (c,), k (B, H, c, D), v (B, H, c, E), real (B, c) bool, False for a padded key)."""
        w = self.window
        c = min(self.length, w)
        slots = torch.arange(self.length - c, self.length, device=self.k.device) % w
        real = (torch.ones(self.k.shape[0], c, dtype=torch.bool, device=self.k.device) if self.valid is None
                else self.valid[:, slots])
        return slots, self.k[:, :, slots], self.v[:, :, slots], real


def empty_window_state(q: torch.Tensor, v: torch.Tensor, window: int) -> WindowState:
    b, h, _, d = q.shape
    return WindowState(q.new_zeros(b, h, window, d), v.new_zeros(b, h, window, v.shape[-1]), None, 0)


def write_window(state: WindowState, k: torch.Tensor, v: torch.Tensor, key_padding_mask=None,
                 *extra: tuple[torch.Tensor, torch.Tensor]) -> WindowState:
    """Writes n new tokens into their slots (in place; only the last W of them survive) and returns
    the state with length + n. extra: (buffer (B, H, W, ·), rows (B, H, n, ·)) pairs written alike."""
    w, n, start = state.window, k.shape[2], state.length
    keep = min(n, w)
    slots = (torch.arange(start + n - keep, start + n, device=k.device)) % w
    src = slice(n - keep, n)
    state.k[:, :, slots] = k[:, :, src]
    state.v[:, :, slots] = v[:, :, src]
    for buf, rows in extra:
        buf[:, :, slots] = rows[:, :, src]
    valid = state.valid
    if key_padding_mask is not None and valid is None:
        valid = torch.ones(k.shape[0], w, dtype=torch.bool, device=k.device)
    if valid is not None:
        valid[:, slots] = True if key_padding_mask is None else key_padding_mask[:, src]
    return WindowState(state.k, state.v, valid, start + n)


def window_mask(state: WindowState, key_padding_mask) -> torch.Tensor | None:
    """The (B, 1, 1, W) mask of the slots one new query (already written) may see, or None when it
    sees all W: filled slots with real keys; a padded query sees every filled slot."""
    w = state.window
    if state.length >= w and state.valid is None:
        return None
    filled = (torch.arange(w, device=state.k.device) < state.length)[None]
    allowed = filled if state.valid is None else filled & state.valid
    if key_padding_mask is not None:
        allowed = allowed | (filled & ~key_padding_mask[:, -1:])
    return allowed[:, None, None, :]


def sliding_window_attention_step(state: WindowState | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                  *, window: int, scale: float | None = None,
                                  key_padding_mask: torch.Tensor | None = None,
                                  chunk_size: int | None = None) -> tuple[torch.Tensor, WindowState]:
    """Continues a sequence by n new tokens. state: a WindowState (updated in place and returned with
    the new length) or None to start one; q, k (B, H, n, D), v (B, H, n, E); key_padding_mask (B, n).

    One token (n = 1): write k, v into slot t mod W, then o = softmax over the filled slots, through
    torch's scaled_dot_product_attention: O(W·D) time, W·(D + E) memory whatever the context.
    Several: the (up to W) buffered tokens in time order and the new ones run through the chunked operator,
    whose outputs for the new queries are kept. Returns (o (B, H, n, E), state).
    """
    check_common(q, k, v, window, scale, chunk_size, key_padding_mask)
    if state is None:
        state = empty_window_state(q, v, window)
    elif not isinstance(state, WindowState):
        raise TypeError(f"state must be a WindowState or None, got {type(state).__name__}")
    elif state.window != window or state.k.shape[:2] != q.shape[:2] or state.k.dtype != q.dtype \
            or state.k.shape[-1] != q.shape[-1] or state.v.shape[-1] != v.shape[-1]:
        raise ValueError(f"state holds a window of {state.window} keys of shape (B, H, ·, D) = "
                         f"{tuple(state.k.shape)} {state.k.dtype}; got window {window} and q {tuple(q.shape)} "
                         f"{q.dtype}")
    n = q.shape[2]
    if n == 1:
        state = write_window(state, k, v, key_padding_mask)
        mask = window_mask(state, key_padding_mask)
        o = F.scaled_dot_product_attention(q, state.k, state.v, attn_mask=mask, scale=scale)
        return o, state
    slots, kc, vc, real = state.ordered()
    c = slots.numel()
    new = (torch.ones(q.shape[0], n, dtype=torch.bool, device=q.device) if key_padding_mask is None
           else key_padding_mask)
    mask = None if key_padding_mask is None and state.valid is None else torch.cat((real, new), 1)
    qa = torch.cat((q.new_zeros(q.shape[0], q.shape[1], c, q.shape[-1]), q), 2)
    o = sliding_window_chunked(qa, torch.cat((kc, k), 2), torch.cat((vc, v), 2), window=window, scale=scale,
                               chunk=chunk_size, key_padding_mask=mask)
    return o[:, :, c:], write_window(state, k, v, key_padding_mask)
