"""The attention kinds `linattn eval` trains, their labels, and the ModelConfig fields of each
(shared by the presets, the recall presets and the reports)."""

from __future__ import annotations

from ..models import KINDS
from ..models.kinds import label

__all__ = ["EVAL_KINDS", "FEATURE_KINDS", "HIGHER_IS_BETTER", "KIND_LABELS", "METRIC_LABELS", "MIXER_KINDS",
           "kind_model"]

#: feature maps evaluated as a linear layer of their own
FEATURE_KINDS = ("elu", "relu", "favor", "cosformer", "taylor", "hedgehog")
#: eval kinds that are a kind of linattn.models.KINDS of their own (causal only), not a feature map
MIXER_KINDS = tuple(k.name for k in KINDS.values() if k.causal_only)
EVAL_KINDS = ("softmax", *FEATURE_KINDS, "hybrid", *MIXER_KINDS)
KIND_LABELS = {**{k: label(k) for k in EVAL_KINDS if k != "hybrid"}, "hybrid": "hybrid (elu+1/softmax)"}
METRIC_LABELS = {"loss": "loss", "accuracy": "acc", "bpb": "bpb"}
HIGHER_IS_BETTER = {"accuracy": True, "loss": False, "bpb": False}


def kind_model(kind: str, base: dict, kind_options: dict | None = None) -> dict:
    """The ModelConfig fields of attention kind `kind` on top of `base`."""
    if kind not in EVAL_KINDS:
        raise ValueError(f"unknown attention kind {kind!r}; choose from {', '.join(EVAL_KINDS)}")
    m = dict(base)
    extra = dict((kind_options or {}).get(kind, {}))
    if kind == "softmax":
        m["attention"] = ["softmax"]
    elif kind == "hybrid":
        n = int(m.get("n_layers", 4))
        m["feature_map"] = "elu"
        m["attention"] = ["linear", "linear", "linear", "softmax"] if n % 4 == 0 else ["linear"] * (n - 1) + ["softmax"]
    elif kind in MIXER_KINDS:
        m["attention"] = [kind]
        m["positions"] = KINDS[kind].positions or m.get("positions", "rope")
    else:
        m["attention"] = ["linear"]
        m["feature_map"] = kind
    m.update(extra)
    return m
