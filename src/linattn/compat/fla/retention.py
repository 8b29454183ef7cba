"""FLA's retention (RetNet, `fla.ops.retention`): simple GLA with the fixed multi-scale decays of
Sun et al. 2023, γ_h = 1 − 2^(−5−h) for head h = 0 … HV−1 (g_gamma = log γ_h, as FLA builds it):

    S_t = γ_h S_{t−1} + k_t v_tᵀ        o_t = S_tᵀ (scale · q_t)        (scale default K^−1/2)

q, k: [B, T, H, K]; v: [B, T, HV, V] -> o [B, T, HV, V]; states [N, HV, K, V]. With grouped value
heads the decays follow the state's heads (HV); FLA builds them from q's heads, the same when HV = H.
"""

from __future__ import annotations

import torch

from ._edge import hands_over, refuse, take_kwargs
from .gla import _state_layout_alias, run_gated


def retention_decays(heads: int, device=None) -> torch.Tensor:
    """g_gamma [heads] = log(1 − 2^(−5−h)), float64 (the operator casts it to its state dtype)."""
    h = torch.arange(heads, dtype=torch.float64, device=device)
    return torch.log1p(-torch.exp2(-5.0 - h))


def _run_retention(q, k, v, **opts):
    """`run_gated` with g_gamma the decays of v's HV heads (none where v is not [B, T, HV, V]: run_gated
    says what is wrong with it)."""
    gamma = retention_decays(v.shape[2], v.device) if isinstance(v, torch.Tensor) and v.dim() == 4 else None
    return run_gated(q, k, v, None, gamma, per_key=False, **opts)


@hands_over("fla.ops.retention", "chunk_retention")
def chunk_retention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    **kwargs,
):
    """Retention over whole sequences (module docstring); kwargs: chunk_size. Returns (o, final
    state or None)."""
    extra = take_kwargs("chunk_retention", kwargs, ("chunk_size",))
    return _run_retention(q, k, v, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                          state_v_first=False, cu_seqlens=cu_seqlens, **extra)


@hands_over("fla.ops.retention", "fused_recurrent_retention")
def fused_recurrent_retention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    reverse: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    **kwargs,
):
    """The recurrent form of chunk_retention (T = 1 without cu_seqlens is one decoding step);
    reverse=True is refused."""
    refuse("fused_recurrent_retention", reverse=reverse)
    state_v_first = _state_layout_alias("fused_recurrent_retention", state_v_first, kwargs)
    return _run_retention(q, k, v, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                          state_v_first=state_v_first, cu_seqlens=cu_seqlens, step=True)
