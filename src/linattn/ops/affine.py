"""A recurrent operator over a span of tokens as an affine function of the state it starts from
(design §9): what sequence parallelism exchanges and how a shard uses what it receives.

Gated linear attention and the delta rule are linear in their initial state S_0 (F×E' per batch
and head). Over a span of n tokens, per (batch, head):

    o_t = o⁰_t + S_0ᵀ q̄_t          (normalize: o_t = (n⁰_t + S_0ᵀ q̄_t) / (d⁰_t + z_0 · q̄_t + ε))
    S_n = A S_0 + ΔS

o⁰, ΔS: the outputs and final state of the span run from S_0 = 0; q̄_t (F): the row through which
output t reads the initial state; A: the span's transition — a scalar per head (scalar gates,
A = e^{Σ g}), a vector over the F state rows (per-feature gates) or an F×F matrix (the delta rule,
the ordered product of α_t (I − β_t k̂_t k̂_tᵀ)). With normalize the normalizer z is one more
column of the state (it decays like kv's rows), so S is [kv | z] (F×(E+1)) and o⁰ holds the
numerators n⁰ and, in its last column, the denominators d⁰.

`linattn.ops.gated.gated_affine_form` and `linattn.ops.delta.delta_rule_affine_form` build an
`AffineForm` with the operators themselves; `apply_transition` and `transition_grad` are the
transition's action and its gradient, shared by the forms and the sequence-parallel exchange.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


def apply_transition(A: torch.Tensor, S: torch.Tensor, *, transpose: bool = False) -> torch.Tensor:
    """A S (or Aᵀ S) for a state S (B, H, F, E') and a transition A of shape (B, H) (a scalar per
    head), (B, H, F) (one factor per state row) or (B, H, F, F) (a matrix)."""
    if A.dim() == S.dim():
        return (A.mT if transpose else A) @ S
    if A.dim() == S.dim() - 1:
        return A[..., None] * S
    return A[..., None, None] * S


def transition_grad(A: torch.Tensor, S: torch.Tensor, R: torch.Tensor) -> torch.Tensor:
    """∂⟨R, A S⟩/∂A, shaped like A: R Sᵀ for a matrix, Σ_e R ⊙ S per row, Σ R ⊙ S per head."""
    if A.dim() == S.dim():
        return R @ S.mT
    if A.dim() == S.dim() - 1:
        return (R * S).sum(-1)
    return (R * S).sum((-1, -2))


class AffineForm(NamedTuple):
    """An operator over one span as a function of its initial state (see the module docstring).

    out0: (B, H, n, E') o⁰ in the inputs' dtype (E' = E + 1 with normalize: [n⁰ | d⁰]);
    query: (B, H, n, F) the rows q̄_t; transition: A, (B, H), (B, H, F) or (B, H, F, F), and
    state: ΔS (B, H, F, E'), both in the state dtype; normalize and eps as the operator's."""

    out0: torch.Tensor
    query: torch.Tensor
    transition: torch.Tensor
    state: torch.Tensor
    normalize: bool = False
    eps: float = 0.0

    def output(self, S0: torch.Tensor) -> torch.Tensor:
        """The span's outputs (B, H, n, E) from the initial state S0 (B, H, F, E'), in out0's dtype;
        computed in S0's dtype."""
        o = torch.matmul(self.query.to(S0.dtype), S0).add_(self.out0.to(S0.dtype))
        if self.normalize:
            o = o[..., :-1] / (o[..., -1:] + self.eps)
        return o.to(self.out0.dtype)

    def final(self, S0: torch.Tensor) -> torch.Tensor:
        """The state after the span, A S0 + ΔS."""
        return apply_transition(self.transition, S0) + self.state
