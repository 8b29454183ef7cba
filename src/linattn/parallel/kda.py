"""Sequence-parallel KDA (design §9, §18): as `sequence_parallel_delta_rule` (linattn.parallel.recurrent),
whose exchange it reuses. KDA is linear in its initial state, so each rank's shard is an affine
function of the state entering it (`linattn.ops.kda.kda_affine_form`: its transition is the D×D
product of (I − β_t k̂_t k̂_tᵀ) Diag(α_t) over the shard); one all-gather of (A_r, ΔS_r) gives every
rank the state entering its shard, P·B·H·(D² + D·E) numbers forward, P·B·H·D·E backward."""

from __future__ import annotations

import torch

from ..ops.linear.chunked import DEFAULT_CHUNK_SIZE
from ..ops.kda import kda_affine_form
from ..ops.kda.checks import check_arguments, check_values
from .recurrent import run_delta_family


def sequence_parallel_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor,
    *,
    group=None,
    scale: float | None = None,
    qk_l2norm: bool = False,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> torch.Tensor:
    """KDA (linattn.ops.kda.kda) over a sequence sharded across the ranks of `group`.

    q, k: (B, H, n_r, D), v: (B, H, n_r, E), beta (B, H, n_r), g (B, H, n_r, D) — this rank's
    contiguous shard, shards in rank order (every rank needs ≥ 1 token) -> o (B, H, n_r, E) in q's
    dtype, equal to shard r of kda on the whole sequence. initial_state: S (B, H, D, E) in the state
    dtype, on rank 0 only. Gradients reach q, k, v, beta, g and the initial state.
    """
    def check():
        check_arguments(q, k, v, beta, g, scale, qk_l2norm, initial_state)
        check_values(beta, g)

    return run_delta_family(group, check, chunk_size, ("g (1: per channel)", "qk_l2norm"),
                            (1, int(qk_l2norm is True)), (q, k, v, beta, g, initial_state),
                            lambda: kda_affine_form(q, k, v, beta, g, scale=scale, qk_l2norm=qk_l2norm,
                                                    chunk_size=chunk_size))
