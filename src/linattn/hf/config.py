"""LinattnConfig: a transformers configuration holding a linattn ModelConfig (model_type "linattn").

The whole linattn config travels as one JSON object, `linattn` (ModelConfig.to_dict(): every
attention kind and hybrid pattern that ModelConfig takes), beside the names transformers' own
utilities read. Those mirrors are kept in step with it:

    vocab_size ↔ vocab_size        hidden_size ↔ d_model          num_hidden_layers ↔ n_layers
    num_attention_heads ↔ n_heads  tie_word_embeddings ↔ tie_embeddings

A mirror set after construction (e.g. `config.vocab_size = 300` before building a model) wins over
the `linattn` object; `model_config` returns the ModelConfig with the mirrors applied. Keyword
arguments named like ModelConfig fields go into the linattn config:
`LinattnConfig(d_model=64, n_layers=2, attention="gated_deltanet,softmax")`.
"""

from __future__ import annotations

import dataclasses

from transformers import PretrainedConfig

from ..models import ModelConfig

#: transformers' attribute name -> ModelConfig field
MIRRORS = {
    "vocab_size": "vocab_size",
    "hidden_size": "d_model",
    "num_hidden_layers": "n_layers",
    "num_attention_heads": "n_heads",
    "tie_word_embeddings": "tie_embeddings",
}
_FIELDS = frozenset(f.name for f in dataclasses.fields(ModelConfig))


class LinattnConfig(PretrainedConfig):
    """A transformers config around a linattn ModelConfig.

    linattn: a ModelConfig, its dict (ModelConfig.to_dict()) or None (ModelConfig's defaults).
    pad_token_id / bos_token_id / eos_token_id: generation's special tokens (None: none; the byte
    LM has no special tokens, see linattn.hf.ByteTokenizer). use_cache: whether forward returns a
    LinattnCache outside training (generate always uses one).
    """

    model_type = "linattn"
    keys_to_ignore_at_inference = ["cache"]

    linattn: dict | None = None
    vocab_size: int | None = None
    hidden_size: int | None = None
    num_hidden_layers: int | None = None
    num_attention_heads: int | None = None
    tie_word_embeddings: bool | None = None
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self, **kwargs):
        base = self.linattn
        if isinstance(base, ModelConfig):
            base = base.to_dict()
        elif base is None:
            base = {}
        elif not isinstance(base, dict):
            raise TypeError(f"linattn must be a ModelConfig, a dict or None, got {type(base).__name__}")
        own = {k: kwargs.pop(k) for k in list(kwargs) if k in _FIELDS}
        merged = {**base, **own}
        for hf_name, field in MIRRORS.items():
            value = getattr(self, hf_name)
            if value is not None:
                merged[field] = value
        model_config = ModelConfig.from_dict(merged)
        if model_config.num_classes is not None:
            raise ValueError("linattn: num_classes belongs to LinearTransformerEncoder; a causal LM takes None")
        self.linattn = model_config.to_dict()
        for hf_name, field in MIRRORS.items():
            setattr(self, hf_name, getattr(model_config, field))
        super().__post_init__(**kwargs)

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs):
        """transformers' reader of a config.json (from_pretrained, AutoConfig): refuses a dict without
        the `linattn` object (and no ModelConfig field of its own), which would otherwise build
        linattn's default architecture around the mirrors without a word. LinattnConfig() in code
        keeps the defaults."""
        own = (_FIELDS - set(MIRRORS.values())) & set(config_dict)
        if "linattn" not in config_dict and "linattn" not in kwargs and not own:
            raise ValueError("linattn: the config has no 'linattn' object (linattn's ModelConfig: attention kinds, "
                             "feature maps, positions, …) and no ModelConfig field, so the model it describes is "
                             "unknown; save it with LinattnConfig / LinattnForCausalLM.save_pretrained, or add the "
                             "object (ModelConfig.to_dict())")
        return super().from_dict(config_dict, **kwargs)

    @property
    def model_config(self) -> ModelConfig:
        """The linattn ModelConfig, with the transformers mirrors (vocab_size, hidden_size, …) applied."""
        d = dict(self.linattn)
        for hf_name, field in MIRRORS.items():
            d[field] = getattr(self, hf_name)
        return ModelConfig.from_dict(d)

    @property
    def layer_types(self) -> list[str]:
        """Every layer in transformers' words: "full_attention" for softmax layers (a KV cache),
        "linear_attention" for the others (a fixed-size state); linattn's own kinds are
        `model_config.layer_kinds`."""
        return ["full_attention" if k == "softmax" else "linear_attention" for k in self.model_config.layer_kinds]


__all__ = ["LinattnConfig", "MIRRORS"]
