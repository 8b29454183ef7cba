"""The oracles of sliding-window attention and of the LoLCATs hybrid: the definitions with the N×N band
mask, in float64. Tests and benchmarks only; they never use the chunk form.

Per (batch, head), token i of a sequence that starts at s(i) (0, or its cu_seqlens start) sees

    window(i) = { j : max(s(i), i − W + 1) ≤ j ≤ i }          (the last W tokens, itself included)
    beyond(i) = { j : s(i) ≤ j ≤ i − W }                      (the tokens that left the window)

and a key-padding mask (True = real token) removes a padded key from beyond(i), and from window(i)
for real queries; a padded query keeps its band whatever the mask holds (its output is padding, but
stays finite).
"""

from __future__ import annotations

import math

import torch


def band_masks(n: int, window: int, *, cu_seqlens: torch.Tensor | None = None,
               key_padding_mask: torch.Tensor | None = None, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(window, beyond) as bool masks of shape (B', 1, N, N) (B' = B with a key-padding mask, else 1),
    entry [i, j] True when query i sees key j in that part."""
    i = torch.arange(n, device=device)[:, None]
    j = torch.arange(n, device=device)[None, :]
    start = torch.zeros(n, dtype=torch.long, device=device)
    if cu_seqlens is not None:
        cu = cu_seqlens.to(device=device, dtype=torch.long)
        seq = torch.searchsorted(cu, torch.arange(n, device=device), right=True) - 1
        start = cu[seq]
    same = j >= start[:, None]
    win = (j <= i) & (j > i - window) & same
    beyond = (j <= i - window) & same
    win, beyond = win[None, None], beyond[None, None]
    if key_padding_mask is not None:
        real = key_padding_mask[:, None, None, :]
        win, beyond = win & (real | ~key_padding_mask[:, None, :, None]), beyond & real
    return win, beyond


def sliding_window_attention(q, k, v, *, window: int, scale: float | None = None,
                             cu_seqlens: torch.Tensor | None = None,
                             key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
    """softmax over window(i) of q_iᵀk_j·scale, times v: (B, H, N, D), (B, H, N, D), (B, H, N, E) ->
    (B, H, N, E) float64. scale defaults to 1/√D."""
    q, k, v = q.double(), k.double(), v.double()
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    win, _ = band_masks(q.shape[2], window, cu_seqlens=cu_seqlens, key_padding_mask=key_padding_mask,
                        device=q.device)
    s = torch.where(win, (q @ k.transpose(-1, -2)) * scale, float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def lolcats_attention(q, k, qf, kf, v, *, window: int, window_factor, linear_factor=1.0,
                      scale: float | None = None, cu_seqlens: torch.Tensor | None = None,
                      key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The LoLCATs hybrid (Zhang et al. 2024), one normalizer over both parts:

        a_ij = γ_h exp(q_iᵀk_j·scale − m_i)   j ∈ window(i),   m_i = max_{j ∈ window(i)} q_iᵀk_j·scale
        a_ij = λ_h φ(q_i)ᵀφ(k_j)              j ∈ beyond(i)
        y_i  = Σ_j a_ij v_j / Σ_j a_ij

    q, k (B, H, N, D); qf, kf (B, H, N, F) the features; v (B, H, N, E); window_factor γ and
    linear_factor λ broadcast against (H,) (tensors or numbers). Returns (B, H, N, E) float64.
    """
    q, k, qf, kf, v = (x.double() for x in (q, k, qf, kf, v))
    h = q.shape[1]
    gamma = torch.as_tensor(window_factor, dtype=torch.float64, device=q.device).expand(h).view(1, h, 1, 1)
    lam = torch.as_tensor(linear_factor, dtype=torch.float64, device=q.device).expand(h).view(1, h, 1, 1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    win, beyond = band_masks(q.shape[2], window, cu_seqlens=cu_seqlens, key_padding_mask=key_padding_mask,
                             device=q.device)
    s = torch.where(win, (q @ k.transpose(-1, -2)) * scale, float("-inf"))
    a_win = gamma * torch.exp(s - s.amax(-1, keepdim=True))
    a_lin = torch.where(beyond, lam * (qf @ kf.transpose(-1, -2)), 0.0)
    a = a_win + a_lin
    return (a @ v) / a.sum(-1, keepdim=True)
