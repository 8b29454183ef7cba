"""How an operator turns raw q/k into the features it multiplies: scale, φ, key mask, RoPE.

Shared by the chunked, non-causal and recurrent paths so they see exactly the same numbers, and
re-run inside the chunked backward (block by block) so no N-sized feature tensor is kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Featurizer:
    """Turns a slice [start, end) of q or k into (numerator features, denominator features).

    The denominator features are None when they equal the numerator ones (no RoPE).
    q: (B, H, n, D) -> (B, H, n, F).
    """

    feature_map: object = None  # nn.Module (x, *, is_query, positions) -> features, or None
    rope: object = None  # RotaryEmbedding or None
    scale: float | None = None  # multiplies q before φ
    positions: torch.Tensor | None = None  # (N,) or (B, N) absolute indices
    key_padding_mask: torch.Tensor | None = None  # (B, N) bool, True = keep
    _angles: tuple | None = None  # RoPE (start, end, dtype, cos, sin), shared by q and k of a slice

    def __call__(self, x: torch.Tensor, start: int, end: int, is_query: bool):
        pos = None if self.positions is None else self.positions[..., start:end]
        if is_query and self.scale is not None:
            x = x * self.scale
        drop = None
        if not is_query and self.key_padding_mask is not None:
            # selected, not multiplied by 0 (0·NaN = NaN), before φ too: whatever a masked slot holds,
            # no NaN, Inf or overflow comes out of it, and no gradient flows into it or φ's parameters
            drop = ~self.key_padding_mask[:, None, start:end, None]
            x = x.masked_fill(drop, 0)
        f = x if self.feature_map is None else self.feature_map(x, is_query=is_query, positions=pos)
        if drop is not None:
            f = f.masked_fill(drop, 0)
        if self.rope is None:
            return f, None
        if self._angles is None or self._angles[:3] != (start, end, f.dtype):
            self._angles = (start, end, f.dtype, *self.rope.angles(pos, f.dtype))
        return self.rope.rotate(f, angles=self._angles[3:]), f

    def values(self, v: torch.Tensor) -> torch.Tensor:
        """v (B, H, N, E) with the masked key slots set to 0 (selected: a NaN or Inf there would reach
        the state as 0·NaN through the zeroed key features), or v itself without a mask."""
        if self.key_padding_mask is None:
            return v
        return v.masked_fill(~self.key_padding_mask[:, None, :, None], 0)

    @property
    def local_grad(self) -> bool:
        """True when ∂L/∂x follows elementwise from the features and ∂L/∂(features) alone, so the
        chunked backward needs no autograd graph: no RoPE, and φ the identity or a map without
        trainable parameters that gives its derivative from its output (`derivative_from_output_`)."""
        fm = self.feature_map
        return self.rope is None and (fm is None or (hasattr(fm, "derivative_from_output_") and not self.parameters))

    def input_grad(self, f: torch.Tensor, grad: torch.Tensor, start: int, end: int, is_query: bool, out=None):
        """∂L/∂x of the slice [start, end) of q or k from its features f = self(x, …)[0] and grad = ∂L/∂f,
        written into `out` when given. Only when `local_grad`. Overwrites f (when φ is not the identity).

        φ: φ'(x) from f (a masked key has f = 0, so elu+1's min(f, 1) gives it 0). Identity: the mask."""
        d = None
        if self.feature_map is not None:
            d = self.feature_map.derivative_from_output_(f)
        elif not is_query and self.key_padding_mask is not None:
            d = self.key_padding_mask[:, None, start:end, None]
        if is_query and self.scale is not None:
            d = self.scale if d is None else d.mul_(self.scale)
        if d is None:
            return grad if out is None else out.copy_(grad)
        return torch.mul(grad, d, out=out)

    @property
    def parameters(self) -> tuple:
        if self.feature_map is None:
            return ()
        return tuple(p for p in self.feature_map.parameters() if p.requires_grad)
