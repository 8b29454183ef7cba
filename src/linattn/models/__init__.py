"""The model: its config, the kinds table, the LM and the encoder, the checkpoint format, generation and
fused decoding.

    from linattn.models import KINDS, ModelConfig, LinearTransformerLM
"""

from .config import ATTENTION_KINDS, BLOCKS, POSITIONS, RECURRENT_KINDS, ModelConfig
from .kinds import KINDS, Kind, kind_of
from .lm import LinearTransformerEncoder, LinearTransformerLM, ModelCache, load_pretrained
from .pages import huge_pages

__all__ = ["ATTENTION_KINDS", "BLOCKS", "KINDS", "POSITIONS", "RECURRENT_KINDS", "Kind", "LinearTransformerEncoder",
           "LinearTransformerLM", "ModelCache", "ModelConfig", "huge_pages", "kind_of", "load_pretrained"]
