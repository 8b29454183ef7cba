"""The operator families as the layers run them: one record each (`Family`: full, packed,
sequence_parallel, step, new_state) and the dataclass of its operands (design §10.1)."""

from .delta import DELTA, DeltaMix
from .gated import GATED, GatedMix
from .linear import LINEAR, LinearMix
from .record import Family, mean_of
from .softmax import SOFTMAX, SoftmaxMix
from .window import WINDOW, WINDOW_GATED, WINDOW_LINEAR, HybridMix, WindowMix

__all__ = ["DELTA", "GATED", "LINEAR", "SOFTMAX", "WINDOW", "WINDOW_GATED", "WINDOW_LINEAR", "DeltaMix", "Family",
           "GatedMix", "HybridMix", "LinearMix", "SoftmaxMix", "WindowMix", "mean_of"]
