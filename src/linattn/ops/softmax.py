"""Softmax attention through torch's scaled_dot_product_attention, with the linattn argument names."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .._checks import check_bool, check_key_padding_mask, check_qkv


def softmax_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    scale: float | None = None,
    key_padding_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """softmax(q kᵀ·scale) v. q: (B, H, Nq, D), k: (B, H, Nk, D), v: (B, H, Nk, E) -> (B, H, Nq, E).

    scale defaults to 1/√D. With causal=True and Nq < Nk (decoding against a KV cache) the mask is
    bottom-right aligned: query i sees keys j ≤ i + Nk − Nq. key_padding_mask: (B, Nk) bool, True =
    keep.
    """
    check_qkv(q, k, v)
    check_bool("causal", causal, error=TypeError)
    check_key_padding_mask(key_padding_mask, k.shape[0], k.shape[2], k.device)
    n_q, n_k = q.shape[2], k.shape[2]
    if causal and n_q > n_k:
        raise ValueError(f"causal softmax attention needs Nq <= Nk, got q length {n_q} and k length {n_k}")
    mask = None
    if key_padding_mask is not None:
        mask = key_padding_mask[:, None, None, :]
        if causal:
            keep = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril(n_k - n_q)
            mask = mask & keep
    elif causal and n_q != n_k:
        mask = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril(n_k - n_q)
    is_causal = causal and mask is None
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale)
