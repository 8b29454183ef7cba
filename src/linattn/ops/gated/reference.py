"""The oracle of gated linear attention: its recurrence, token by token, in float64, written from the
definition (design §12). Tests only; it never uses the chunk form.

Per (batch, head), with features q̃_t, k̃_t (F), values v_t (E) and the log-decay g_t ≤ 0 (a scalar,
or one per feature):

    S_t = diag(e^{g_t}) S_{t−1} + k̃_t v_tᵀ          z_t = e^{g_t} ⊙ z_{t−1} + k̃_t
    o_t = S_tᵀ q̃_t                                   (normalize: o_t = S_tᵀ q̃_t / (q̃_t · z_t + ε))

A token whose key is masked out (key_padding_mask False) leaves the state as it was: no key, no decay.
"""

from __future__ import annotations

import torch


def gated_recurrence(qf, kf, v, g, *, normalize: bool = False, eps: float = 1e-6, initial_state=None,
                     key_padding_mask=None):
    """qf, kf: (B, H, N, F) features; v: (B, H, N, E); g: (B, H, N) or (B, H, N, F);
    initial_state: kv (B, H, F, E), or (kv, z (B, H, F)) with normalize; key_padding_mask: (B, N) bool.

    Returns (o (B, H, N, E), final state in the form of initial_state), all float64."""
    qf, kf, v, g = (x.double() for x in (qf, kf, v, g))
    b, h, n, f = qf.shape
    e = v.shape[-1]
    if initial_state is None:
        kv, z = qf.new_zeros(b, h, f, e), qf.new_zeros(b, h, f)
    elif normalize:
        kv, z = (x.double() for x in initial_state)
    else:
        kv, z = initial_state.double(), qf.new_zeros(b, h, f)
    outs = []
    for t in range(n):
        decay = torch.exp(g[:, :, t])
        decay = decay[..., None].expand(b, h, f) if g.dim() == 3 else decay
        kv_next = decay[..., None] * kv + kf[:, :, t, :, None] * v[:, :, t, None, :]
        z_next = decay * z + kf[:, :, t]
        if key_padding_mask is not None:
            keep = key_padding_mask[:, t].view(b, 1, 1)
            kv_next = torch.where(keep[..., None], kv_next, kv)
            z_next = torch.where(keep, z_next, z)
        kv, z = kv_next, z_next
        num = torch.einsum("bhf,bhfe->bhe", qf[:, :, t], kv)
        if normalize:
            num = num / ((qf[:, :, t] * z).sum(-1, keepdim=True) + eps)
        outs.append(num)
    o = torch.stack(outs, 2)
    return o, ((kv, z) if normalize else kv)
