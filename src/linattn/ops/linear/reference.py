"""Quadratic oracles: the definitions, written the slow and obvious way. Tests and benchmarks only.

All take (B, H, N, ·) tensors and materialize the N×N matrix.
"""

from __future__ import annotations

import math

import torch


def kernel_attention(
    qf: torch.Tensor,
    kf: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    normalize: bool = True,
    eps: float = 1e-6,
    key_padding_mask: torch.Tensor | None = None,
    initial_state=None,
    qf_den: torch.Tensor | None = None,
    kf_den: torch.Tensor | None = None,
):
    """Masked kernel attention on given features.

    qf, kf: (B, H, N, F) numerator features; qf_den, kf_den: denominator features (default: the
    same); v: (B, H, N, E); initial_state (kv (B, H, F, E), z (B, H, F)) stands for earlier keys.

        U_i = qf_iᵀ kv0 + Σ_{j (≤ i)} (qf_iᵀ kf_j) v_j,   d_i = qd_iᵀ z0 + Σ_{j (≤ i)} qd_iᵀ kd_j
        O_i = U_i / (d_i + ε)  (normalize) or U_i

    A masked key (key_padding_mask False) leaves the sums whatever its features and value hold. Masks
    select (where) instead of multiplying by 0, and with a non-finite value anywhere the causal sum is
    taken row by row over j ≤ i only: 0·NaN = NaN would otherwise carry a later token's NaN or Inf into
    earlier rows. Returns (O, (kv_final, z_final)).
    """
    qd = qf if qf_den is None else qf_den
    kd = kf if kf_den is None else kf_den
    if key_padding_mask is not None:
        drop = ~key_padding_mask[:, None, :, None]
        kf, kd, v = kf.masked_fill(drop, 0), kd.masked_fill(drop, 0), v.masked_fill(drop, 0)
    n_q, n_k = qf.shape[-2], kf.shape[-2]
    a = qf @ kf.transpose(-1, -2)
    ad = qd @ kd.transpose(-1, -2)
    if causal:
        keep = torch.ones(n_q, n_k, dtype=torch.bool, device=qf.device).tril(n_k - n_q)
        a, ad = a.masked_fill(~keep, 0), ad.masked_fill(~keep, 0)
    if causal and not bool(torch.isfinite(v).all()):
        last = range(n_k - n_q, n_k)  # the last key each query sees
        u = torch.cat([a[..., i:i + 1, :j + 1] @ v[..., :j + 1, :] for i, j in enumerate(last)], -2)
    else:
        u = a @ v
    d = ad.sum(-1)
    kv = kf.transpose(-1, -2) @ v
    z = kd.sum(-2)
    if initial_state is not None:
        kv0, z0 = initial_state
        u = u + qf @ kv0.to(qf.dtype)
        d = d + (qd * z0.to(qd.dtype)[:, :, None, :]).sum(-1)
        kv, z = kv + kv0.to(kv.dtype), z + z0.to(z.dtype)
    o = u / (d[..., None] + eps) if normalize else u
    return o, (kv, z)


def softmax_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    scale: float | None = None,
    key_padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(q kᵀ·scale + mask) v with scale = 1/√D by default; causal is bottom-right aligned
    (query i of Nq sees keys j ≤ i + Nk − Nq)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = (q @ k.transpose(-1, -2)) * scale
    n_q, n_k = q.shape[-2], k.shape[-2]
    if causal:
        keep = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril(n_k - n_q)
        s = s.masked_fill(~keep, float("-inf"))
    if key_padding_mask is not None:
        s = s.masked_fill(~key_padding_mask[:, None, None, :], float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def exp_kernel(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The softmax kernel exp(qᵀk/√D): (…, Nq, D), (…, Nk, D) -> (…, Nq, Nk)."""
    return torch.exp(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]))
