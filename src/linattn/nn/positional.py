"""Positions for linear attention.

RoPE with linear attention (RoFormer §3.4.4): the rotation is applied to the *features* φ(q), φ(k)
in the numerator only,

    V'_i = Σ_j (R_i φ(q_i))ᵀ (R_j φ(k_j)) v_j / Σ_j φ(q_i)ᵀ φ(k_j),

so the kv state accumulates rotated keys and z accumulates plain ones; the chunked and recurrent
forms give the same numbers. Positions are absolute token indices, shape (N,) or (B, N).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from .._checks import check_int


def broadcast_positions(positions: torch.Tensor, ndim: int) -> torch.Tensor:
    """(N,) -> (N, 1); (B, N) -> (B, 1, N, 1): broadcastable against (B, H, N, F) features."""
    if positions.dim() == 1:
        return positions[:, None]
    return positions[:, None, :, None]


def angle_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype RoPE angles are computed in for features of `dtype`: float64 for float64 (a float32
    angle at position 1e5 is off by ~1e-4 rad after rounding the product alone), float32 otherwise (float64
    angles would add ~1.6% to a RoPE forward at N = 4096-16384, and bf16/fp16 features round far more)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _angles(dim: int, base: float, positions: torch.Tensor, dtype: torch.dtype):
    work = angle_dtype(dtype)
    ang = broadcast_positions(positions, 4).to(work) * _inv_freq(dim, base, positions.device).to(work)
    cos, sin = ang.cos(), ang.sin()
    c, s = [cos, cos], [-sin, sin]
    if dim % 2 == 1:
        c.append(torch.ones_like(cos[..., :1]))
        s.append(torch.zeros_like(sin[..., :1]))
    return torch.cat(c, -1).to(dtype), torch.cat(s, -1).to(dtype)


def _inv_freq(dim: int, base: float, device=None) -> torch.Tensor:
    """θ_m = base^(−m/P), m < P = ⌊dim/2⌋, in float64 (whatever dtype a module was cast to)."""
    half = dim // 2
    return base ** (-torch.arange(half, dtype=torch.float64, device=device) / half)


_CACHED_POSITIONS = 16


@functools.lru_cache(maxsize=64)
def _cached_angles(dim, base, shape, values, device, dtype, inference):
    """angles of a few positions, keyed by their values (shared by the layers of one decoding step).
    `inference` keeps inference-mode tensors out of autograd."""
    positions = torch.tensor(values, dtype=torch.long, device=device).view(shape)
    return _angles(dim, base, positions, dtype)


def _rotate(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor, transpose: bool) -> torch.Tensor:
    """x·c + swap(x)·s, where swap exchanges the halves [0, P) and [P, 2P) (P = ⌊F/2⌋) of the last
    dim; with transpose, x·c + swap(x·s) (the adjoint map). Written into one buffer with no cat."""
    p = x.shape[-1] // 2
    if x.shape[-2] == 1 and x.shape[-1] == 2 * p:
        # one token (decoding): swap = roll by P, three ops instead of a dozen slice views
        return torch.add(x * c, (x * s).roll(p, -1)) if transpose else torch.addcmul(x * c, x.roll(p, -1), s)
    out = x * c
    if transpose:
        out[..., :p].addcmul_(x[..., p:2 * p], s[..., p:2 * p])
        out[..., p:2 * p].addcmul_(x[..., :p], s[..., :p])
    else:
        out[..., :p].addcmul_(x[..., p:2 * p], s[..., :p])
        out[..., p:2 * p].addcmul_(x[..., :p], s[..., p:2 * p])
    return out


class _Rotate(torch.autograd.Function):
    """rotate(x) = x·c + swap(x)·s with constant angles (c, s); the gradient is the adjoint map,
    x ↦ x·c + swap(x·s), itself an _Rotate (so double backward works). Autograd through a cat of
    slices would allocate a zero tensor of x's size per slice."""

    @staticmethod
    def forward(ctx, x, c, s, transpose):
        ctx.save_for_backward(c, s)
        ctx.transpose = transpose
        return _rotate(x, c, s, transpose)

    @staticmethod
    def backward(ctx, grad):
        c, s = ctx.saved_tensors
        return _Rotate.apply(grad, c, s, not ctx.transpose), None, None, None


class RotaryEmbedding(nn.Module):
    """Rotary position embedding on the last dim, rotate-half convention.

    rotate(x, positions): x (B, H, N, F), positions (N,) or (B, N) -> (B, H, N, F), pairs
    (x_m, x_{m+P}) with P = ⌊F/2⌋ rotated by angle position·θ_m, θ_m = base^(−m/P). With odd F
    (e.g. Taylor features, F = 1 + D + D²) the last feature is left as it is.
    """

    def __init__(self, dim: int, base: float = 10_000.0):
        super().__init__()
        check_int("RotaryEmbedding dim", dim, minimum=2)
        self.dim = dim
        self.base = float(base)

    def angles(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(c, s), each broadcastable against (B, H, N, F) in `dtype`: c = [cos, cos, 1], s = [−sin, sin, 0]
        of position·θ_m (the trailing 1 / 0 only for odd F), so rotate(x) = x·c + swap(x)·s. The angles
        are computed in `angle_dtype(dtype)` from float64 frequencies, whatever dtype the module has."""
        if positions.numel() <= _CACHED_POSITIONS:  # decoding: every layer asks for the same few positions
            return _cached_angles(self.dim, self.base, tuple(positions.shape),
                                  tuple(positions.tolist() if positions.dim() == 1 else positions.flatten().tolist()),
                                  positions.device, dtype,
                                  torch.is_inference_mode_enabled())
        return _angles(self.dim, self.base, positions, dtype)

    def rotate(self, x: torch.Tensor, positions: torch.Tensor | None = None, *, angles=None) -> torch.Tensor:
        """x (B, H, N, F) rotated at `positions` ((N,) or (B, N)), or with precomputed `angles`."""
        if x.shape[-1] != self.dim:
            raise ValueError(f"RotaryEmbedding(dim={self.dim}) got features of dim {x.shape[-1]}")
        c, s = self.angles(positions, x.dtype) if angles is None else angles
        if x.requires_grad and torch.is_grad_enabled():
            return _Rotate.apply(x, c, s, False)
        return _rotate(x, c, s, False)  # no autograd bookkeeping when decoding

    def extra_repr(self) -> str:
        return f"dim={self.dim}, base={self.base:g}"
