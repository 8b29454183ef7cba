"""The record of an operator family as the layers run it (design §10.1).

`Attention.forward` (linattn.nn.base) resolves what every layer shares — the mask's checks, the
projections and short convolution, the token positions, packing and sequence parallelism — once,
asks the kind for its family's operands (`mix`), and hands them to one entry point of its family:

    full(mix, mask) -> o                   the whole sequence at once (chunked causal, or non-causal)
    packed(mix, mask, cu_seqlens) -> o     sequences packed in one row, kept apart (design §17)
    sequence_parallel(mix, group) -> o     this rank's shard of one sequence (design §9); None: not yet
    step(cache, mix, mask) -> o            continues the cache's state by the new tokens (one or
                                           several), updating it in place (the layer then advances
                                           the cache's position count)
    new_state() -> LayerCache              an empty cache of the family (linattn.nn.caches)

mix: the family's operands, a dataclass of its module (q, k, v (B, H, N, ·) after the kind's
activations, gates, features and rotation, and the operator's options); mask (B, N) bool or None,
True = real token; o (B, H, N, E). counts_positions: the family's operator counts the positions
itself when no padding or cache says otherwise (the layer then passes None, and a packed call can
share one arange among its sequences of one length).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Family:
    """One operator family's entry points (see the module docstring). name: its name in
    linattn.models.kinds.FAMILIES."""

    name: str
    new_state: Callable
    full: Callable
    packed: Callable
    step: Callable
    sequence_parallel: Callable | None = None
    counts_positions: bool = False


def mean_of(name: str, first: Family, second: Family, new_state: Callable) -> Family:
    """A family whose output is the mean of two others', o = (o₁ + o₂) / 2, on a pair of operands
    (mix₁, mix₂) and one cache that holds both states (each family's step writes its own field)."""

    def mean(a, b):
        return 0.5 * (a + b.to(a.dtype))

    return Family(
        name, new_state,
        full=lambda mix, mask: mean(first.full(mix[0], mask), second.full(mix[1], mask)),
        packed=lambda mix, mask, cu: mean(first.packed(mix[0], mask, cu), second.packed(mix[1], mask, cu)),
        step=lambda cache, mix, mask: mean(first.step(cache, mix[0], mask), second.step(cache, mix[1], mask)),
    )


__all__ = ["Family", "mean_of"]
