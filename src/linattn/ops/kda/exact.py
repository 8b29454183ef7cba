"""KDA's exact pass for inputs holding NaN or Inf: causality for non-finite values, as the delta
rule's (linattn.ops.delta.exact, whose pieces and per-piece backward it reuses): the sequence is cut
around every token that is non-finite in some row while that row's state is still finite, each piece
runs the fast operator from the state the previous one left, and a row whose cotangents are all
exactly zero gets exactly zero gradients (instead of 0·NaN)."""

from __future__ import annotations

import torch

from ..delta.exact import Run, _pieces, _Piece


def _bad_tokens(q, k, v, beta, g) -> torch.Tensor:
    """Token indices where a cut is needed: non-finite in a row whose state is still finite there."""
    poisons = ~(torch.isfinite(k).all(-1) & torch.isfinite(v).all(-1) & torch.isfinite(beta)
                & torch.isfinite(g).all(-1))  # (B, H, N)
    n = q.shape[2]
    pos = torch.arange(n, device=q.device)
    first = torch.where(poisons, pos, n).amin(-1, keepdim=True)  # (B, H, 1): the row's first poisoning token
    bad = (poisons | ~torch.isfinite(q).all(-1)) & (pos <= first)
    return bad.any(1).any(0).nonzero().flatten()


def exact_kda(run: Run, q, k, v, beta, g, S0) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, S_N) of `run(q, k, v, beta, g, S0)` (a differentiable fast form of KDA, shapes as in `kda`),
    run piece by piece so that non-finite values respect causality."""
    outs, S = [], S0
    for s, t in _pieces(q.shape[2], _bad_tokens(q, k, v, beta, g)):
        o, S = _Piece.apply(run, q[:, :, s:t], k[:, :, s:t], v[:, :, s:t], beta[:, :, s:t], g[:, :, s:t], S)
        outs.append(o)
    return torch.cat(outs, 2), S
