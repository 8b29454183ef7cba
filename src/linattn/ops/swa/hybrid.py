"""The LoLCATs hybrid (Zhang et al. 2024, "LoLCATs: On Low-Rank Linearizing of Large Language
Models"): softmax attention over a sliding window of W tokens, linear attention beyond it, and one
normalizer over both parts. Per (batch, head h), with features φ_q(q), φ_k(k) (F) and the window and
beyond sets of linattn.ops.swa.reference:

    a_ij = γ_h exp(q_iᵀk_j·scale − m_i)     j ∈ window(i),   m_i = max_{j ∈ window(i)} q_iᵀk_j·scale
    a_ij = λ_h φ_q(q_i)ᵀφ_k(k_j)            j ∈ beyond(i)
    o_i  = Σ_j a_ij v_j / Σ_j a_ij

The window scores are taken relative to their maximum m_i, as LoLCATs does (so γ_h is the weight of
the window's best key against the linear scores; m_i is part of the function and its gradient flows
to the maximizing score). γ_h and λ_h are per-head factors (LoLCATs: γ_h = sigmoid(θ_h), λ_h = 1).

Chunked form: query blocks of C rows and their key spans as in linattn.ops.swa.chunked; within a span
the window entries take the exp-scores and the entries j ≤ i − W the linear scores; the keys before
the span enter through the linear state S_n = Σ_{blocks m < n − p} φ_k(K_m)ᵀ V_m (and z_n, its
normalizer), an exclusive prefix sum over blocks:

    num_i = Σ_{span} a_ij v_j + λ_h φ_q(q_i)ᵀ S,     den_i = Σ_{span} a_ij + λ_h φ_q(q_i)ᵀ z,   o_i = num_i / den_i.

Gradients come from autograd through these torch ops (memory O(N·(W + C)) scores and O(N/C·F·E)
block states, never N×N). Decoding keeps the window in a ring buffer (keys, their features and
values) and the tokens that left it in the linear state (kv (B, H, F, E), z (B, H, F)).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .api import WindowState, empty_window_state, window_mask, write_window
from .checks import check_common, check_cu_seqlens, check_factor
from .chunked import Layout, MaskTable, compute_dtype


class HybridState(NamedTuple):
    """Decoding state of the LoLCATs hybrid: window, a WindowState ring of k, v (B, H, W, ·);
    kf (B, H, W, F), the key features in the same slots (zero for padded keys); kv (B, H, F, E) and
    z (B, H, F), Σ φ_k(k_j) v_jᵀ and Σ φ_k(k_j) over the tokens that left the window (float32,
    float64 for float64 inputs)."""

    window: WindowState
    kf: torch.Tensor
    kv: torch.Tensor
    z: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.window.nbytes + sum(x.numel() * x.element_size() for x in (self.kf, self.kv, self.z))


def _check_features(qf, kf, q, v) -> None:
    for name, x in (("qf", qf), ("kf", kf)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 4 or tuple(x.shape[:3]) != tuple(q.shape[:3]):
            raise ValueError(f"{name} must have shape (B, H, N, F) with (B, H, N) = {tuple(q.shape[:3])}, "
                             f"got {tuple(x.shape)}")
        if x.dtype != q.dtype or x.device != q.device:
            raise TypeError(f"{name} must have q's dtype and device ({q.dtype}, {q.device}), got "
                            f"{x.dtype}, {x.device}")
    if qf.shape[-1] != kf.shape[-1]:
        raise ValueError(f"qf and kf must have one feature dim F, got {qf.shape[-1]} and {kf.shape[-1]}")


def _spans(flat: torch.Tensor, lay: Layout) -> torch.Tensor:
    """(U, S, ·) spans of a flat (B·H·L, C, ·) tensor as a copy (autograd-friendly: no overlap)."""
    return torch.cat([flat[t:t + lay.u] for t in range(lay.p + 1)], dim=1)


def _beyond_mask(lay: Layout, window: int, device) -> torch.Tensor:
    """(L, C, S) bool: span entry j of query i is a linear (beyond-window) key, 0 ≤ j ≤ i − W."""
    blk = torch.arange(lay.rows, device=device)[:, None]
    i = (blk - lay.p) * lay.c + torch.arange(lay.c, device=device)
    j = (blk - 2 * lay.p) * lay.c + torch.arange(lay.s, device=device)
    return (j[:, None, :] <= i[:, :, None] - window) & (j[:, None, :] >= 0)


def _hybrid_chunked(q, k, qf, kf, v, window, gamma, lam, scale, chunk, key_padding_mask, initial_state):
    """The chunked form on checked arguments; a window beyond the sequence is clamped to N (no key is
    beyond any window then, as with the full window)."""
    b, h, n, _ = q.shape
    window = min(window, n)
    cdt = compute_dtype(q.dtype)
    lay = Layout(b, h, n, chunk, window)
    blocked = MaskTable(lay, window, None, key_padding_mask, q.device)
    if key_padding_mask is not None:  # a padded key leaves the linear part (design §7)
        kf = torch.where(key_padding_mask[:, None, :, None], kf, 0.0)
    qp, kp, vp, qfp, kfp = (lay.pad(x, cdt) for x in (q, k, v, qf, kf))
    p, u = lay.p, lay.u
    heads = ((torch.arange(u, device=q.device) + p) // lay.rows) % h
    gw, lw = gamma.to(cdt).view(h)[heads].view(u, 1, 1), lam.to(cdt).view(h)[heads].view(u, 1, 1)
    qw, qfw, ks, vs = qp[p:], qfp[p:], _spans(kp, lay), _spans(vp, lay)
    if blocked.static is not None:
        mask = blocked.blocked[0, ((torch.arange(u, device=q.device) + p) % lay.rows).clamp(max=blocked.static)]
    else:
        mask = blocked.group(0, u)
    s = (qw @ ks.transpose(1, 2) * scale).masked_fill(mask, float("-inf"))
    a = gw * torch.exp(s - s.amax(-1, keepdim=True))
    beyond = _beyond_mask(lay, window, q.device)[(torch.arange(u, device=q.device) + p) % lay.rows]
    a = a + torch.where(beyond, lw * (qfw @ _spans(kfp, lay).transpose(1, 2)), 0.0)
    num, den = a @ vs, a.sum(-1)
    # linear states before each span: exclusive prefix sums over the blocks of each (batch, head) row
    f, e = kfp.shape[-1], vp.shape[-1]
    parts_kv = (kfp.transpose(1, 2) @ vp).view(b * h, lay.rows, f, e)
    parts_z = kfp.sum(1).view(b * h, lay.rows, f)
    kv0 = torch.zeros_like(parts_kv[:, :1])
    z0 = torch.zeros_like(parts_z[:, :1])
    if initial_state is not None:
        kv0 = kv0 + initial_state[0].to(cdt).reshape(b * h, 1, f, e)
        z0 = z0 + initial_state[1].to(cdt).reshape(b * h, 1, f)
    kv_before = torch.cat((kv0, kv0 + parts_kv[:, :-1].cumsum(1)), 1).view(-1, f, e)[:u]
    z_before = torch.cat((z0, z0 + parts_z[:, :-1].cumsum(1)), 1).view(-1, f)[:u]
    num = num + lw * (qfw @ kv_before)
    den = den + lw[..., 0] * (qfw @ z_before[..., None])[..., 0]
    o = torch.cat((num.new_zeros(p, lay.c, e), num / den[..., None]), 0)
    return lay.unpad(o, q.dtype)


def lolcats_attention(q: torch.Tensor, k: torch.Tensor, qf: torch.Tensor, kf: torch.Tensor, v: torch.Tensor, *,
                      window: int, window_factor, linear_factor=1.0, scale: float | None = None,
                      cu_seqlens: torch.Tensor | None = None, key_padding_mask: torch.Tensor | None = None,
                      chunk_size: int | None = None, initial_state=None) -> torch.Tensor:
    """The LoLCATs hybrid, causal (see the module docstring). q, k (B, H, N, D) for the window scores;
    qf, kf (B, H, N, F) their features φ_q(q), φ_k(k) for the linear part; v (B, H, N, E) ->
    o (B, H, N, E) in q's dtype. window_factor γ, linear_factor λ: positive numbers or (H,) tensors
    (they may require grad). scale defaults to 1/√D. cu_seqlens: sequences packed in one row (each runs
    on its own); key_padding_mask (B, N) bool, True = real token; initial_state (kv (B, H, F, E),
    z (B, H, F)): earlier tokens already beyond every window (decoding continues from it).
    """
    chunk = check_common(q, k, v, window, scale, chunk_size, key_padding_mask)
    check_cu_seqlens(cu_seqlens, q.shape[0], q.shape[2], q.device)
    _check_features(qf, kf, q, v)
    h = q.shape[1]
    gamma, lam = check_factor("window_factor", window_factor, h, q), check_factor("linear_factor", linear_factor, h, q)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if initial_state is not None:
        b, _, _, e = v.shape
        f = qf.shape[-1]
        ok = (isinstance(initial_state, (tuple, list)) and len(initial_state) == 2
              and all(isinstance(x, torch.Tensor) for x in initial_state)
              and tuple(initial_state[0].shape) == (b, h, f, e) and tuple(initial_state[1].shape) == (b, h, f))
        if not ok:
            raise ValueError(f"initial_state must be (kv (B, H, F, E) = {(b, h, f, e)}, z (B, H, F) = {(b, h, f)})")
    if cu_seqlens is not None:
        if initial_state is not None:
            raise ValueError("initial_state does not combine with cu_seqlens in lolcats_attention")
        cu = cu_seqlens.tolist()
        parts = [_hybrid_chunked(*(x[:, :, a:b_] for x in (q, k, qf, kf, v)), window, gamma, lam, scale, chunk,
                                 None if key_padding_mask is None else key_padding_mask[:, a:b_], None)
                 for a, b_ in zip(cu, cu[1:]) if b_ > a]
        return torch.cat(parts, 2) if parts else v.new_zeros(v.shape)
    return _hybrid_chunked(q, k, qf, kf, v, window, gamma, lam, scale, chunk, key_padding_mask, initial_state)


def empty_hybrid_state(q, qf, v, window: int) -> HybridState:
    b, h = q.shape[:2]
    sdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    f, e = qf.shape[-1], v.shape[-1]
    return HybridState(empty_window_state(q, v, window), qf.new_zeros(b, h, window, f),
                       torch.zeros(b, h, f, e, dtype=sdt, device=q.device), torch.zeros(b, h, f, dtype=sdt, device=q.device))


def lolcats_attention_step(state: HybridState | None, q, k, qf, kf, v, *, window: int, window_factor,
                           linear_factor=1.0, scale: float | None = None,
                           key_padding_mask: torch.Tensor | None = None,
                           chunk_size: int | None = None) -> tuple[torch.Tensor, HybridState]:
    """Continues a sequence by n new tokens (q, k (B, H, n, D), qf, kf (B, H, n, F), v (B, H, n, E),
    key_padding_mask (B, n)). state: a HybridState (updated in place, returned) or None.

    One token: the key in slot t mod W (token t − W) leaves the window into (kv, z); the new token
    takes its slot; o = (Σ_slots γ e^{s − m} v + λ φ_q(q)ᵀkv) / (Σ_slots γ e^{s − m} + λ φ_q(q)ᵀz).
    O(W·D + F·E) per token, memory W·(D + F + E) + F·E whatever the context. Several tokens: the
    buffered ones and the new ones run through the chunked form from (kv, z). Returns (o, state)."""
    chunk = check_common(q, k, v, window, scale, chunk_size, key_padding_mask)
    _check_features(qf, kf, q, v)
    h = q.shape[1]
    gamma, lam = check_factor("window_factor", window_factor, h, q), check_factor("linear_factor", linear_factor, h, q)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if state is None:
        state = empty_hybrid_state(q, qf, v, window)
    elif not isinstance(state, HybridState):
        raise TypeError(f"state must be a HybridState or None, got {type(state).__name__}")
    elif state.window.window != window or state.kf.shape[-1] != qf.shape[-1] or state.kv.shape[-1] != v.shape[-1]:
        raise ValueError(f"state holds a window of {state.window.window} and features F = {state.kf.shape[-1]}, "
                         f"values E = {state.kv.shape[-1]}; got window {window}, F = {qf.shape[-1]}, E = {v.shape[-1]}")
    if key_padding_mask is not None:
        kf = torch.where(key_padding_mask[:, None, :, None], kf, 0.0)
    if q.shape[2] == 1:
        return _one_step(state, q, k, qf, kf, v, gamma, lam, scale, key_padding_mask)
    return _several(state, q, k, qf, kf, v, window, gamma, lam, scale, chunk, key_padding_mask)


def _evict(state: HybridState) -> None:
    """Adds the oldest buffered token (slot length mod W, when full) to the linear state, in place."""
    w, t = state.window.window, state.window.length
    if t < w:
        return
    slot = t % w
    kf, v = state.kf[:, :, slot].to(state.kv.dtype), state.window.v[:, :, slot].to(state.kv.dtype)
    if state.window.valid is not None:
        v = torch.where(state.window.valid[:, slot, None, None], v, 0.0)
    state.kv.add_(kf[..., :, None] * v[..., None, :])
    state.z.add_(kf)


def _one_step(state, q, k, qf, kf, v, gamma, lam, scale, key_padding_mask):
    _evict(state)
    win = write_window(state.window, k, v, key_padding_mask, (state.kf, kf))
    cdt = compute_dtype(q.dtype)
    s = (q.to(cdt) @ win.k.to(cdt).transpose(-1, -2)) * scale                   # (B, H, 1, W)
    mask = window_mask(win, key_padding_mask)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    a = gamma.to(cdt) * torch.exp(s - s.amax(-1, keepdim=True))
    qfc = qf.to(cdt)
    num = a @ win.v.to(cdt) + lam.to(cdt) * (qfc @ state.kv.to(cdt))
    den = a.sum(-1, keepdim=True) + lam.to(cdt) * (qfc @ state.z.to(cdt)[..., None])
    return (num / den).to(q.dtype), HybridState(win, state.kf, state.kv, state.z)


def _several(state, q, k, qf, kf, v, window, gamma, lam, scale, chunk, key_padding_mask):
    """n > 1 new tokens: [the c ≤ W buffered tokens; the new ones] through the chunked form, starting
    from (kv, z); then all but the newest W of those c + n tokens enter (kv, z)."""
    slots, kc, vc, real = state.window.ordered()
    c = slots.numel()
    kfc = state.kf[:, :, slots]  # zero for padded keys already
    b, h, n, _ = q.shape
    new = torch.ones(b, n, dtype=torch.bool, device=q.device) if key_padding_mask is None else key_padding_mask
    ka, va, kfa = torch.cat((kc, k), 2), torch.cat((vc, v), 2), torch.cat((kfc, kf), 2)
    qa = torch.cat((q.new_zeros(b, h, c, q.shape[-1]), q), 2)
    qfa = torch.cat((qf.new_zeros(b, h, c, qf.shape[-1]), qf), 2)
    keys = None if key_padding_mask is None and state.window.valid is None else torch.cat((real, new), 1)
    o = _hybrid_chunked(qa, ka, qfa, kfa, va, window, gamma, lam, scale, chunk, keys, (state.kv, state.z))[:, :, c:]
    gone = max(0, c + n - window)  # the oldest tokens of [buffer; new] leave the window into (kv, z)
    old_kf, old_v = kfa[:, :, :gone].to(state.kv.dtype), va[:, :, :gone].to(state.kv.dtype)
    if keys is not None:
        old_v = torch.where(keys[:, None, :gone, None], old_v, 0.0)
    state.kv.add_(old_kf.transpose(-1, -2) @ old_v)
    state.z.add_(old_kf.sum(2))
    win = write_window(state.window, k, v, key_padding_mask, (state.kf, kf))
    return o, HybridState(win, state.kf, state.kv, state.z)
