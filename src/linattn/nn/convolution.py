"""Short causal depthwise convolution (design §14), with its decoding cache.

Channel by channel (depthwise), kernel size K, causal:

    y_t[c] = Σ_{j=0}^{K−1} w[c, j] · x_{t−K+1+j}[c]  (+ b[c]),        x_s = 0 for s before the sequence

so token t sees itself and the K−1 tokens before it: the "previous token" that associative recall
needs, which attention otherwise has to learn with a whole layer. Its recurrent form keeps the last
K−1 inputs (the tail, (B, K−1, C)) and computes the same sum over [tail; x]: a decoding cache of
constant size, like a linear layer's state.

Both forms evaluate the sum above with the same K multiply-adds over shifted views of [tail; x], so
a prefill plus token-by-token steps gives the parallel output exactly (bit for bit, not only up to
rounding). Measured against `F.conv1d(groups=C)` on one thread (B=8, N=512, C=768, K=4, fp32, median
of blocked_autorange): forward 12.6 ms vs 47 ms, forward+backward 71 ms vs 86 ms. On CPU float32 and
float64 tensors the same sums run in csrc/conv.cpp (`_NativeShortConv`: no padded copy, the backward
in one pass, packed rows too; design §14.1); bf16, other devices and forward-mode AD keep the torch ops.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .._checks import check_positive_int
from ..ops import native, packed
from ..ops.autodiff import first_order, has_tangent


class _NativeShortConv(torch.autograd.Function):
    """y = the convolution of x with its tails (None: zeros) by `linattn_cpu::short_conv`, and its
    backward (∂x, ∂tail, ∂w) by `short_conv_backward` (csrc/conv.cpp): no padded copy either way.
    cu_seqlens: x (1, T, C) holds packed sequences, tail (N, K−1, C) one per sequence."""

    @staticmethod
    def forward(ctx, x, tail, weight, cu_seqlens=None):
        ctx.save_for_backward(x, tail, weight, cu_seqlens)
        return torch.ops.linattn_cpu.short_conv(x, tail, weight, cu_seqlens)

    @staticmethod
    @first_order("ShortConvolution")
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x, tail, weight, cu_seqlens = ctx.saved_tensors
        dx, dtail, dw = torch.ops.linattn_cpu.short_conv_backward(dy, x, tail, weight, cu_seqlens)
        if tail is None or not ctx.needs_input_grad[1]:
            dtail = None
        elif dtail is None:  # K = 1: an empty tail
            dtail = torch.zeros_like(tail)
        return dx, dtail, dw, None


def _native_usable(x: torch.Tensor, tail, weight: torch.Tensor) -> bool:
    """csrc/conv.cpp takes the convolution: CPU float32/float64 tensors of one dtype, the kernels built,
    no forward-mode tangent (the torch ops take those)."""
    return (x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64) and weight.dtype == x.dtype
            and (tail is None or tail.dtype == x.dtype) and native._ready()
            and not has_tangent(x, tail, weight))


def depthwise_causal(xp: torch.Tensor, weight: torch.Tensor, n: int) -> torch.Tensor:
    """The K multiply-adds of the module docstring over shifted views of xp = [tail; x] (B, K−1+n, C):
    y_t[c] = Σ_j weight[c, j] · xp_{t+j}[c] for t < n -> y (B, n, C); weight (C, K) in xp's dtype."""
    y = xp[:, :n] * weight[:, 0]
    for j in range(1, weight.shape[1]):
        y = torch.addcmul(y, xp[:, j:j + n], weight[:, j])
    return y


class ShortConvolution(nn.Module):
    """Causal depthwise convolution over the last dim of x (B, N, C), kernel `kernel_size` (K ≥ 1).

    forward(x, mask=None, tail=None, return_tail=False) -> y (B, N, C), or (y, tail') with return_tail.
        mask: (B, N) bool, True = real token; padded inputs enter the sum as zeros, so a left-padded
            row gives, at its real tokens, the output of the row alone.
        tail: (B, K−1, C), the last K−1 inputs of the tokens before x (None: the sequence starts
            here, zeros before it); tail' is the tail after x, for the next call.
        cu_seqlens: packed sequences (design §17, linattn.ops.packed): x (1, T, C) holds N sequences
            end to end, cu_seqlens the 1-D integer tensor [N+1] of their cumulative lengths; no tap
            crosses a boundary (each sequence reads zeros, or its own tail, before its first token)
            and tail, tail' are per sequence, (N, K−1, C).
    Weights: w (C, K), initialized like torch's Conv1d, U(−1/√K, 1/√K); optional bias (C).
    """

    def __init__(self, channels: int, kernel_size: int, bias: bool = False):
        super().__init__()
        check_positive_int("channels", channels)
        check_positive_int("kernel_size", kernel_size)
        self.channels, self.kernel_size = channels, kernel_size
        self.weight = nn.Parameter(torch.empty(channels, kernel_size))
        self.bias = nn.Parameter(torch.zeros(channels)) if bias else None
        self.init_parameters()

    @torch.no_grad()
    def init_parameters(self, generator: torch.Generator | None = None) -> None:
        """w ~ U(−1/√K, 1/√K) drawn from `generator` (torch's Conv1d default for a depthwise kernel),
        bias 0."""
        bound = 1.0 / math.sqrt(self.kernel_size)
        w = torch.rand(self.weight.shape, generator=generator, dtype=torch.float64) * (2 * bound) - bound
        self.weight.copy_(w)
        if self.bias is not None:
            self.bias.zero_()

    def new_tail(self, batch: int, *, dtype=None, device=None) -> torch.Tensor:
        """The tail before any token: zeros (B, K−1, C)."""
        return torch.zeros(batch, self.kernel_size - 1, self.channels, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, tail: torch.Tensor | None = None,
                return_tail: bool = False, *, cu_seqlens: torch.Tensor | None = None):
        if x.dim() != 3 or x.shape[-1] != self.channels:
            raise ValueError(f"x must have shape (B, N, C={self.channels}), got {tuple(x.shape)}")
        if cu_seqlens is not None:
            return self._packed(x, mask, tail, return_tail, cu_seqlens)
        b, n, _ = x.shape
        if mask is not None:
            x = x.masked_fill(~mask[..., None], 0.0)
        k = self.kernel_size
        if tail is not None:
            if tuple(tail.shape) != (b, k - 1, self.channels):
                raise ValueError(f"tail must have shape (B, K−1, C) = {(b, k - 1, self.channels)}, "
                                 f"got {tuple(tail.shape)}")
            tail = tail.to(x.dtype)
        w = self.weight if self.weight.dtype == x.dtype else self.weight.to(x.dtype)
        if _native_usable(x, tail, w):
            y = _NativeShortConv.apply(x, tail, w)
            xp = None
        else:
            xp = F.pad(x, (0, 0, k - 1, 0)) if tail is None else torch.cat((tail, x), 1)
            y = depthwise_causal(xp, w, n)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        if not return_tail:
            return y
        if xp is None:  # the last K−1 rows of [tail; x] (zeros before the sequence), a new tensor
            before = x.new_zeros(b, k - 1, self.channels) if tail is None else tail
            return y, torch.cat((before[:, min(n, k - 1):], x[:, max(0, n - (k - 1)):]), 1)
        return y, xp[:, xp.shape[1] - (k - 1):].clone()  # a copy: the cache must not keep xp alive

    def _packed(self, x, mask, tail, return_tail: bool, cu_seqlens):
        """forward on N packed sequences, in one pass whatever N: csrc/conv.cpp where it runs (each sequence
        reads its own tail), else the convolution of the whole row, then
        the first K−1 tokens of every sequence (whose taps reached into the sequence before) replaced by
        their sums over the sequence's own inputs and, before its first token, its tail (zeros without
        one): each tap is gathered from a source that holds the tails and the row, so nothing of another
        sequence is read, and the replaced values get no gradient (a NaN in one sequence reaches no
        other). tail' (return_tail) is each sequence's last K−1 inputs, gathered from the same source
        (for a sequence shorter than K−1, the end of its tail, then its inputs). The sums are the ones
        of separate calls, bit for bit."""
        bounds = packed.boundaries(cu_seqlens, batch=x.shape[0], length=x.shape[1])
        k, count, n = self.kernel_size, len(bounds), x.shape[1]
        if tail is not None and tuple(tail.shape) != (count, k - 1, self.channels):
            raise ValueError(f"tail must have shape (N, K−1, C) = {(count, k - 1, self.channels)} with "
                             f"cu_seqlens, got {tuple(tail.shape)}")
        if mask is not None:
            x = x.masked_fill(~mask[..., None], 0.0)
        w = self.weight if self.weight.dtype == x.dtype else self.weight.to(x.dtype)
        tail = None if tail is None else tail.to(x.dtype)
        # the source of every tap: the N tails (N·(K−1) rows, zeros without them), then the row's T inputs;
        # extended index m of sequence s (its tail, then its tokens) is row s·(K−1) + m of the tails for
        # m < K−1, else row N·(K−1) + start_s + m − (K−1)
        device = x.device
        starts = torch.tensor([s for s, _ in bounds], dtype=torch.long, device=device)

        def source():
            tails = x.new_zeros(count * (k - 1), self.channels) if tail is None else tail.reshape(-1, self.channels)
            return torch.cat((tails, x[0]), 0)

        def rows(seq, m):  # source rows of the extended indices m (…) of the sequences seq (…)
            return torch.where(m < k - 1, seq * (k - 1) + m, count * (k - 1) + starts[seq] + m - (k - 1))

        if _native_usable(x, tail, w):  # csrc/conv.cpp keeps the sequences apart itself
            y = _NativeShortConv.apply(x, tail, w, cu_seqlens)
        else:
            y = depthwise_causal(F.pad(x, (0, 0, k - 1, 0)), w, n)
            pos = packed.positions(cu_seqlens, n).to(device)  # index of each token in its sequence
            fix = (pos < k - 1).nonzero().reshape(-1)  # the tokens whose taps reach before their sequence
            if k > 1 and fix.numel():  # their sums again, over the sequence's tail and inputs
                seq = packed.sequence_ids(cu_seqlens, n).to(device)[fix]
                taps = source()[rows(seq[:, None], pos[fix][:, None] + torch.arange(k, device=device))]  # (M, K, C)
                y_fix = taps[:, 0] * w[:, 0]
                for j in range(1, k):
                    y_fix = torch.addcmul(y_fix, taps[:, j], w[:, j])
                y = y.index_put((torch.zeros_like(fix), fix), y_fix)  # replaces (its gradient there is 0)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        if not return_tail:
            return y
        lengths = torch.tensor([e - s for s, e in bounds], dtype=torch.long, device=device)
        seq = torch.arange(count, device=device)[:, None]
        last = lengths[:, None] + torch.arange(k - 1, device=device)  # the last K−1 extended indices
        return y, source()[rows(seq, last)]

    def extra_repr(self) -> str:
        return f"channels={self.channels}, kernel_size={self.kernel_size}, bias={self.bias is not None}"


__all__ = ["ShortConvolution", "depthwise_causal"]
