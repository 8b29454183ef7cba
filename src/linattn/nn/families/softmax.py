"""The softmax family: o_i = Σ_j softmax_j(q_iᵀk_j / √D) v_j (j ≤ i when causal) through SDPA
(linattn.ops.softmax_attention); decoding appends to a KV cache (KVCache), O(T) per token; the
sharded form all-gathers K and V (linattn.parallel.sequence_parallel_softmax_attention)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...ops import packed as packing, softmax_attention
from ...parallel import sequence_parallel_softmax_attention
from ..caches import KVCache
from .record import Family


@dataclass
class SoftmaxMix:
    """q (B, H, N, D), k (B, H, N, D), v (B, H, N, E) (rotated already, if at all); causal; the dropout
    probability of the attention weights (0 in eval)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    causal: bool
    dropout_p: float = 0.0


def _attend(q, k, v, key_mask, causal: bool, dropout_p: float):
    if key_mask is None:  # a single new query sees every cached key: no mask to build
        return softmax_attention(q, k, v, causal=causal and q.shape[2] > 1, dropout_p=dropout_p)
    return padded_softmax_attention(q, k, v, key_mask, causal, dropout_p)


def _full(m: SoftmaxMix, mask):
    return _attend(m.q, m.k, m.v, mask, m.causal, m.dropout_p)


def _step(cache: KVCache, m: SoftmaxMix, mask):
    k, v, key_mask = cache.append(m.k, m.v, mask)
    return _attend(m.q, k, v, key_mask, m.causal, m.dropout_p)


def _sequence_parallel(m: SoftmaxMix, group):
    return sequence_parallel_softmax_attention(m.q, m.k, m.v, group=group, causal=m.causal, scale=None)


def _packed(m: SoftmaxMix, key_mask, cu_seqlens):
    """softmax attention on packed sequences (q, k, v (1, H, T, ·)): query i sees key j only in its
    own sequence. Without a key mask the sequences of each length run as the rows of one SDPA call
    (O(Σ L²) work, not O(T²)); with one (1, T), a block-diagonal boolean mask of real keys, a query
    that would see no key at all (padding) seeing itself."""
    q, k, v, causal, dropout_p = m.q, m.k, m.v, m.causal, m.dropout_p
    n = q.shape[2]
    if key_mask is None:
        bounds = packing.boundaries(cu_seqlens, batch=q.shape[0], length=n)
        by_length: dict[int, list[tuple[int, int]]] = {}
        for s, e in bounds:
            if e > s:
                by_length.setdefault(e - s, []).append((s, e))
        o = q.new_empty(*q.shape[:3], v.shape[-1])
        for spans in by_length.values():
            part = F.scaled_dot_product_attention(*(packing.gather(x, spans, 2) for x in (q, k, v)),
                                                  is_causal=causal and spans[0][1] - spans[0][0] > 1,
                                                  dropout_p=dropout_p)
            for i, (s, e) in enumerate(spans):
                o[:, :, s:e] = part[i:i + 1]
        return o
    seq = packing.sequence_ids(cu_seqlens, n).to(q.device)
    allowed = seq[:, None] == seq[None, :]
    if causal:
        allowed = allowed & torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    allowed = (allowed & key_mask[0][None, :]) | torch.eye(n, dtype=torch.bool, device=q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=dropout_p)


def padded_softmax_attention(q, k, v, key_mask, causal: bool, dropout_p: float):
    """softmax attention with a key-padding mask (B, Nk) whose last Nq entries describe the queries.

    A padded query whose every visible key is padding (left padding + causal) would give a row of
    −∞ and NaN; such query rows (padding anyway) are let see every key instead, so all values stay
    finite and real tokens are unaffected.
    """
    n_q, n_k = q.shape[2], k.shape[2]
    allowed = key_mask[:, None, None, :]
    if causal:
        allowed = allowed & torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril(n_k - n_q)
    allowed = allowed | ~key_mask[:, None, -n_q:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=dropout_p)


SOFTMAX = Family("softmax", KVCache, full=_full, packed=_packed, step=_step, sequence_parallel=_sequence_parallel)

__all__ = ["SOFTMAX", "SoftmaxMix", "padded_softmax_attention"]
