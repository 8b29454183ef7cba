"""linattn: linear attention for PyTorch — operators, feature maps, models and tools.

    from linattn import linear_attention, make_feature_map, ModelConfig, LinearTransformerLM
"""

from .nn.feature_maps import FEATURE_MAPS, make_feature_map
from .models import KINDS, LinearTransformerEncoder, LinearTransformerLM, ModelConfig
from .ops import (
    delta_rule,
    delta_rule_step,
    gated_linear_attention,
    gated_linear_attention_step,
    linear_attention,
    linear_attention_step,
    softmax_attention,
)
from .nn.positional import RotaryEmbedding

__version__ = "0.1.0"

__all__ = [
    "FEATURE_MAPS",
    "KINDS",
    "LinearTransformerEncoder",
    "LinearTransformerLM",
    "ModelConfig",
    "RotaryEmbedding",
    "delta_rule",
    "delta_rule_step",
    "gated_linear_attention",
    "gated_linear_attention_step",
    "linear_attention",
    "linear_attention_step",
    "make_feature_map",
    "softmax_attention",
]
