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
        f = x if self.feature_map is None else self.feature_map(x, is_query=is_query, positions=pos)
        if not is_query and self.key_padding_mask is not None:
            f = f * self.key_padding_mask[:, None, start:end, None].to(f.dtype)
        if self.rope is None:
            return f, None
        if self._angles is None or self._angles[:3] != (start, end, f.dtype):
            self._angles = (start, end, f.dtype, *self.rope.angles(pos, f.dtype))
        return self.rope.rotate(f, angles=self._angles[3:]), f

    @property
    def parameters(self) -> tuple:
        if self.feature_map is None:
            return ()
        return tuple(p for p in self.feature_map.parameters() if p.requires_grad)
