"""FLA's linear attention (`fla.ops.linear_attn`) on `linattn.linear_attention`.

Per (batch, value head), with q̂_t = scale · q_t (scale default K^−1/2) and no feature map (q and k
are used as they come, as in FLA):

    S_t = S_{t−1} + k_t v_tᵀ                       o_t = S_tᵀ q̂_t
    normalize:  z_t = z_{t−1} + k_t                o_t = S_tᵀ q̂_t / (q̂_t · z_t + 1e-10)

q, k: [B, T, H, K]; v: [B, T, HV, V] (HV a multiple of H: grouped value heads) -> o [B, T, HV, V].
States: S [N, HV, K, V]; with normalize FLA's state is the pair (S, z) with z [N, 1, HV, K] (the
running key sum), and the pair comes back even without output_final_state, as (None, z).
"""

from __future__ import annotations

import torch

from ...ops import linear_attention, linear_attention_step
from ...ops.linear.chunked import state_dtype
from ._edge import common_dtype, fla_inputs, hands_over, layout_hint, packed, refuse, state_out

#: FLA's normalizer epsilon (fla.ops.linear_attn: `... + 1e-10`)
EPS = 1e-10


@hands_over("fla.ops.linear_attn", "chunk_linear_attn")
def chunk_linear_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | tuple | None = None,
    output_final_state: bool = False,
    normalize: bool = True,
    cu_seqlens: torch.LongTensor | None = None,
):
    """Causal linear attention over whole sequences (module docstring for the maths and shapes).

    initial_state: S [N, HV, K, V], or with normalize the pair (S, z [N, 1, HV, K]) (a tensor alone:
        z starts at 0). cu_seqlens: LongTensor [N+1] of packed sequences in a batch of 1.
    Returns (o, S or None); with normalize (o, (S or None, z)).
    """
    return run_linear(q, k, v, scale, initial_state, output_final_state, normalize, cu_seqlens)


@hands_over("fla.ops.linear_attn", "fused_recurrent_linear_attn")
def fused_recurrent_linear_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | tuple | None = None,
    output_final_state: bool = False,
    reverse: bool = False,
    normalize: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
):
    """The recurrent form of chunk_linear_attn (same maths; normalize defaults to False here, as in
    FLA). T = 1 without cu_seqlens is one decoding step (`linattn.linear_attention_step`).
    reverse=True is refused (ValueError)."""
    refuse("fused_recurrent_linear_attn", reverse=reverse)
    return run_linear(q, k, v, scale, initial_state, output_final_state, normalize, cu_seqlens, step=True)


def run_linear(q, k, v, scale, initial_state, output_final_state: bool, normalize: bool, cu_seqlens,
               step: bool = False):
    """Both names on linattn's operator: checks in FLA's layout, GVA, scale, states in and out. Mixed
    dtypes run in their promotion; o comes back in FLA's dtype (`fla_output_dtype`, promoted with
    q's and k's by the normalizing division, as FLA divides by q·Σk)."""
    x = fla_inputs(q, k, v, cu_seqlens, o_like_q=step, normalize=normalize)
    if normalize:  # FLA divides by q·Σk
        x.out_dtype = common_dtype(q, k, x.out_dtype)
    if normalize and isinstance(initial_state, (tuple, list)):
        if len(initial_state) != 2:
            raise ValueError(f"initial_state must be the pair (S, z) with normalize=True, got {len(initial_state)} items")
        kv0, z0 = initial_state
    else:
        kv0, z0 = initial_state, None
    if isinstance(kv0, (tuple, list)):
        raise TypeError("initial_state must be the tensor S [N, HV, K, V] with normalize=False, got a "
                        f"{type(kv0).__name__} (the (S, z) pair of normalize=True)")
    n, hv, kd, vd = x.n, x.hv, x.q.shape[-1], x.v.shape[-1]
    kv0 = x.state(kv0)
    z0 = None if z0 is None else _z_in(z0, x.q, n, hv, kd)
    state = None
    if kv0 is not None or z0 is not None:
        sdt = (kv0 if kv0 is not None else z0).dtype
        kv0 = kv0 if kv0 is not None else x.q.new_zeros(n, hv, kd, vd, dtype=sdt)
        z0 = z0 if z0 is not None else x.q.new_zeros(n, hv, kd, dtype=sdt)
        state = (kv0, z0)
    q, k, v = x.heads_first()
    qs = q * x.scale(scale)
    with layout_hint():
        if step and x.q.shape[1] == 1 and cu_seqlens is None:
            o, (kv, z) = linear_attention_step(state, qs, k, v, normalize=normalize, eps=EPS)
        else:
            o, (kv, z) = linear_attention(qs, k, v, causal=True, normalize=normalize, eps=EPS, initial_state=state,
                                          return_state=True, **packed(cu_seqlens))
    o = x.output(o)
    if normalize:
        return o, (state_out(kv, output_final_state), z.unsqueeze(1))
    return o, state_out(kv, output_final_state)


def _z_in(z0, q, n: int, hv: int, kd: int):
    """FLA's normalizer state z [N, 1, HV, K] as linattn's (N, HV, K), in the state dtype."""
    if not isinstance(z0, torch.Tensor) or tuple(z0.shape) != (n, 1, hv, kd):
        got = tuple(z0.shape) if isinstance(z0, torch.Tensor) else type(z0).__name__
        raise ValueError(f"initial_state[1] (z) must be a tensor [N, 1, HV, K] = {(n, 1, hv, kd)}, got {got}")
    if not z0.is_floating_point():  # cast below: an integer z would pass silently
        raise TypeError(f"initial_state[1] (z) must be floating, got {z0.dtype}")
    return z0[:, 0].to(state_dtype(q.dtype))
