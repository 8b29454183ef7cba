"""The kinds table: one record per attention kind, read by everything that lists kinds.

A kind is what `ModelConfig.attention` names per layer. Its record says which layer class builds it
(linattn.nn), how it is labelled in tables and plots, whether it decodes as an RNN (a fixed-size
state) or with a KV cache, whether it is causal only, its default short convolution and output
gate, the positions its paper uses, the options its layer takes from `ModelConfig.kind_options`,
and the mixer of the fused decoder that runs its step — or None, and then generation takes the eager
step for models with that kind (and says so once). Every kind has one today: a family's kinds share
their family's mixer ("linear", "softmax", "gated" (HGRN2 with the key decay and its tied input
gate), "delta", in csrc/model_mixers.h; "window", csrc/model_window.h: swa's ring buffer alone,
LoLCATs' with the linear state of the tokens that left it, Liger's with the gated state).

Adding a kind (docs/design.md §10.1): its layer in linattn.nn (its parameters, its operator family's
record and `mix`; to decode fused, `plan_mixer`, the arguments of its family's C++ mixer), and one
row here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from torch import nn

from ..nn.attention import LinearAttention, SoftmaxAttention
from ..nn.decay import DT_INIT_RANGE
from ..nn.feature_maps import FEATURE_MAPS
from ..nn.hgrn2 import HGRN2Attention
from ..nn.kda import KDA_DT_INIT_RANGE, KimiDeltaAttention
from ..nn.liger import LigerAttention
from ..nn.lolcats import LoLCATsAttention
from ..nn.swa import DEFAULT_WINDOW, SlidingWindowAttention
from ..nn.recurrent import (
    DeltaNetAttention,
    GatedDeltaNetAttention,
    GLAAttention,
    RetNetAttention,
    SimpleGLAAttention,
)

#: the operator families a kind belongs to (linattn.ops)
FAMILIES = ("linear", "softmax", "gated", "delta", "window")
#: the softmax kind's options of multi-head latent attention (linattn.nn.mla; off by default)
MLA_OPTIONS = {"q_lora_rank": None, "kv_lora_rank": None, "shared_k_dim": 0, "latent_eps": 1e-6}
#: the mixers of the fused decoder a kind can name (csrc/model_mixers.h, csrc/model_window.h; the table in
#: csrc/model_step.cpp, DecodePlan.mixers())
FUSED_MIXERS = ("linear", "softmax", "gated", "delta", "window")


def _chunked(config, layer: int, causal: bool) -> dict:
    return {"chunk_size": config.chunk_size}


def _linear(config, layer: int, causal: bool) -> dict:
    return {"feature_map": config.feature_map, "feature_map_options": config.feature_map_options_for(layer),
            "causal": causal, "chunk_size": config.chunk_size}


def _softmax(config, layer: int, causal: bool) -> dict:
    return {"causal": causal}


def _windowed(config, layer: int, causal: bool) -> dict:
    return {"causal": causal, "chunk_size": config.chunk_size}


@dataclass(frozen=True)
class Kind:
    """One attention kind.

    name: the value of ModelConfig.attention; layer: the nn.Module class, built as
        layer(d_model, n_heads, **build(config, layer_index, causal), **common options, **kind options);
    label: its name in tables and plots; family: its operator family (FAMILIES: "linear", "softmax",
        "gated" decaying state, "delta" delta-rule state, "window" sliding-window softmax, linattn.ops.swa);
        rnn: decodes with a fixed-size state (O(1) per token), else
        a KV cache; causal_only: has no bidirectional form (the encoder refuses it);
    short_conv / output_gate: defaults of ModelConfig.short_conv / output_gate for its layers;
    positions: what its paper uses when it runs alone ("rope", "none"; None: the config's);
    options: {name: default} of the layer options ModelConfig.kind_options may set for it;
    fused: the fused decoder's mixer (FUSED_MIXERS) or None (eager step).
    """

    name: str
    layer: type[nn.Module]
    label: str
    family: str
    rnn: bool
    causal_only: bool = False
    short_conv: int = 0
    output_gate: bool = False
    positions: str | None = None
    options: dict = field(default_factory=dict)
    fused: str | None = None
    build: Callable[..., dict] = _chunked

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"kind {self.name!r}: family must be one of {FAMILIES}, got {self.family!r}")
        record = getattr(self.layer, "family", None)  # the layer's linattn.nn.families record
        if record is not None and record.name != self.family:
            raise ValueError(f"kind {self.name!r}: family {self.family!r}, but its layer runs the {record.name!r} family")
        if self.fused is not None and self.fused not in FUSED_MIXERS:
            raise ValueError(f"kind {self.name!r}: fused must be one of {FUSED_MIXERS} or None, got {self.fused!r}")


_ROWS = (
    Kind("linear", LinearAttention, "linear", "linear", rnn=True, fused="linear", build=_linear),
    Kind("softmax", SoftmaxAttention, "softmax", "softmax", rnn=False, fused="softmax", build=_softmax,
         options=dict(MLA_OPTIONS)),
    Kind("retnet", RetNetAttention, "RetNet", "gated", rnn=True, causal_only=True, output_gate=True, positions="rope",
         fused="gated"),
    Kind("simple_gla", SimpleGLAAttention, "simple GLA", "gated", rnn=True, causal_only=True, output_gate=True,
         positions="none", options={"dt_init_range": DT_INIT_RANGE}, fused="gated"),
    Kind("gla", GLAAttention, "GLA", "gated", rnn=True, causal_only=True, output_gate=True, positions="none", fused="gated"),
    Kind("deltanet", DeltaNetAttention, "DeltaNet", "delta", rnn=True, causal_only=True, short_conv=4, output_gate=True,
         positions="none", fused="delta"),
    Kind("gated_deltanet", GatedDeltaNetAttention, "Gated DeltaNet", "delta", rnn=True, causal_only=True, short_conv=4,
         output_gate=True, positions="none", options={"dt_init_range": DT_INIT_RANGE}, fused="delta"),
    Kind("kda", KimiDeltaAttention, "KDA", "delta", rnn=True, causal_only=True, short_conv=4, output_gate=True,
         positions="none", options={"dt_init_range": KDA_DT_INIT_RANGE}, fused="delta"),
    Kind("hgrn2", HGRN2Attention, "HGRN2", "gated", rnn=True, causal_only=True, output_gate=True, positions="none",
         fused="gated"),
    Kind("swa", SlidingWindowAttention, "sliding window", "window", rnn=True, causal_only=True, positions="rope",
         options={"window": DEFAULT_WINDOW}, fused="window", build=_windowed),
    Kind("lolcats", LoLCATsAttention, "LoLCATs (window + linear)", "window", rnn=True, causal_only=True,
         positions="rope", options={"window": DEFAULT_WINDOW, "feature_map": "hedgehog"}, fused="window",
         build=_windowed),
    Kind("liger", LigerAttention, "Liger (window + gated)", "window", rnn=True, causal_only=True, positions="rope",
         options={"window": DEFAULT_WINDOW}, fused="window", build=_windowed),
)

#: kind name -> Kind, in table order
KINDS: dict[str, Kind] = {k.name: k for k in _ROWS}
_BY_LAYER = {k.layer: k for k in _ROWS}


def kind_of(layer: nn.Module) -> Kind | None:
    """The Kind whose layer class is exactly type(layer) (None for any other module)."""
    return _BY_LAYER.get(type(layer))


def label(name: str) -> str:
    """The display label of a kind or of a feature map (a linear layer with that φ)."""
    if name in KINDS:
        return KINDS[name].label
    if name in FEATURE_MAPS:
        return FEATURE_MAPS[name].label
    raise ValueError(f"unknown kind or feature map {name!r}; choose from {', '.join([*KINDS, *FEATURE_MAPS])}")


__all__ = ["FAMILIES", "FUSED_MIXERS", "KINDS", "Kind", "kind_of", "label"]
