"""The delta rule's exact pass for inputs holding NaN or Inf: causality for non-finite values.

A NaN or Inf in k, v, β or g (per head or per key channel) at token j makes S_t non-finite for every t ≥ j of
that (batch, head) row; one in q reaches o_j alone. The chunked forms keep the outputs before j exact (they
only read earlier states), but their backward multiplies the zero cotangents of unused outputs by those
non-finite factors (0·NaN = NaN), so a loss over o_{<j} gets NaN gradients everywhere. Mathematically every
gradient of such a loss is finite and those of the tokens from j on are exactly 0.

The exact pass cuts the sequence around every token that is non-finite in some row while that row's
state is still finite (later ones change nothing that is not already non-finite), runs each piece with
the fast operator from the state the previous one left, and gives each piece a backward that treats a
row whose cotangents are all exactly zero as contributing exactly zero (its true gradients, linear in
those cotangents) instead of 0·NaN. Pieces: at most 2·(cut tokens) + 1. The normal call pays a check
of the final state and, when gradients are wanted, of q (`delta_rule`).
"""

from __future__ import annotations

from typing import Callable

import torch

from ..autodiff import first_order
from .checks import op_name

Run = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def _bad_tokens(q, k, v, beta, g) -> torch.Tensor:
    """Token indices where a cut is needed: non-finite in a row whose state is still finite there."""
    poisons = ~(torch.isfinite(k).all(-1) & torch.isfinite(v).all(-1) & torch.isfinite(beta))  # (B, H, N)
    if g is not None:
        poisons |= ~(torch.isfinite(g) if g.dim() == 3 else torch.isfinite(g).all(-1))  # per head or per channel
    n = q.shape[2]
    pos = torch.arange(n, device=q.device)
    first = torch.where(poisons, pos, n).amin(-1, keepdim=True)  # (B, H, 1): the row's first poisoning token
    bad = (poisons | ~torch.isfinite(q).all(-1)) & (pos <= first)
    return bad.any(1).any(0).nonzero().flatten()


def _pieces(n: int, bad: torch.Tensor) -> list[tuple[int, int]]:
    """[0, N) split so that every bad token is a piece of its own."""
    cuts = sorted({0, n, *(int(i) for i in bad), *(int(i) + 1 for i in bad)})
    return list(zip(cuts[:-1], cuts[1:]))


def exact_delta_rule(run: Run, q, k, v, beta, g, S0) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, S_N) of `run(q, k, v, beta, g, S0)` (a differentiable fast form of the operator, shapes as
    in `delta_rule`), run piece by piece so that non-finite values respect causality (module doc)."""
    outs, S = [], S0
    for s, t in _pieces(q.shape[2], _bad_tokens(q, k, v, beta, g)):
        o, S = _Piece.apply(run, q[:, :, s:t], k[:, :, s:t], v[:, :, s:t], beta[:, :, s:t],
                            None if g is None else g[:, :, s:t], S)
        outs.append(o)
    return torch.cat(outs, 2), S


class _Piece(torch.autograd.Function):
    """run on one piece; in the backward, the gradients of a (batch, head) row whose cotangents (do and
    dS) are all exactly zero are exactly zero."""

    @staticmethod
    def forward(ctx, run: Run, q, k, v, beta, g, S0):
        ctx.run, ctx.op_name = run, op_name(g)
        ctx.save_for_backward(q, k, v, beta, g, S0)
        with torch.no_grad():
            return run(q, k, v, beta, g, S0)

    @staticmethod
    @first_order("delta_rule")  # named by ctx.op_name
    @torch.autograd.function.once_differentiable
    def backward(ctx, do, dS):
        inputs = ctx.saved_tensors
        wanted = [i for i, x in enumerate(inputs) if x is not None and ctx.needs_input_grad[i + 1]]
        grads = [None] * len(inputs)
        if not wanted:
            return None, *grads
        with torch.enable_grad():
            xs = [None if x is None else x.detach().requires_grad_(i in wanted) for i, x in enumerate(inputs)]
            o, S = ctx.run(*xs)
            do = torch.zeros_like(o) if do is None else do
            dS = torch.zeros_like(S) if dS is None else dS
            got = torch.autograd.grad((o, S), [xs[i] for i in wanted], (do, dS), allow_unused=True)
        unused = ((do == 0).flatten(2).all(-1) & (dS == 0).flatten(2).all(-1))  # (B, H)
        for i, gr in zip(wanted, got):
            gr = torch.zeros_like(inputs[i]) if gr is None else gr
            mask = unused.view(*unused.shape, *(1,) * (gr.dim() - 2))
            grads[i] = torch.where(mask, torch.zeros((), dtype=gr.dtype, device=gr.device), gr)
        return None, *grads
