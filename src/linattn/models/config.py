"""ModelConfig: everything that defines a model, round-tripping through JSON (design §8).

The attention kind of each layer is a name of the kinds table (linattn.models.kinds.KINDS), whose
record gives the layer class and the defaults of short convolutions and output gates.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
from dataclasses import dataclass, field

from .._checks import (
    check_bool,
    check_choice,
    check_int,
    check_number,
    check_positive_int,
    check_seed,
    dataclass_from_dict,
)
from ..nn.base import OUTPUT_GATES, check_output_gate
from ..nn.blocks import ACTIVATIONS
from ..nn.norms import NORMS
from ..nn.feature_maps import FEATURE_MAPS, make_feature_map
from ..nn.moe import check_moe
from ..nn.positional import RotaryEmbedding
from ..ops.linear.chunked import DEFAULT_CHUNK_SIZE
from .kinds import KINDS

#: the layer settings every kind takes in ModelConfig.kind_options, overriding the config's for its layers
LAYER_OPTIONS = ("n_heads", "qk_dim", "v_dim", "qk_norm", "output_gate", "rope_dim", "short_conv", "post_norm",
                 "output_gate_eps", "allow_neg_eigval")


def _takes(layer: type, name: str) -> bool:
    """Whether layer(...) accepts the keyword `name` (its __init__ or, through **kwargs, a parent's)."""
    for klass in layer.__mro__:
        if "__init__" in vars(klass):
            params = inspect.signature(klass.__init__).parameters
            if name in params:
                return True
            if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
                return False
    return False


def _check_layer_option(kind: str, name: str, value) -> None:
    where = f"kind_options[{kind!r}][{name!r}]"
    if name == "qk_norm":
        if value != "all":
            check_bool(where, value)
    elif name == "post_norm":
        check_bool(where, value)
    elif name == "allow_neg_eigval":
        check_bool(where, value)
        if not _takes(KINDS[kind].layer, name):
            raise ValueError(f"{where}: the {kind} layer takes no allow_neg_eigval (the delta-rule kinds do)")
    elif name == "output_gate_eps":
        check_number(where, value, minimum=0, low_open=True)
    elif name == "output_gate":
        try:
            check_output_gate(value)
        except ValueError:
            raise ValueError(f"{where} must be one of {OUTPUT_GATES}, got {value!r}") from None
    elif name == "short_conv":
        check_int(where, value, minimum=0)
    elif name == "rope_dim":
        check_int(where, value, minimum=0, allow_none=True)
        if kind == "linear" and value is not None:
            raise ValueError(f"{where}: the linear kind's RoPE rotates φ's features, not q and k; leave it unset")
        if value is not None and value % 2:
            raise ValueError(f"{where} must be even (RoPE rotates pairs of features), got {value}")
    else:
        check_positive_int(where, value, allow_none=name != "n_heads")
        if name == "v_dim" and value is not None and not _takes(KINDS[kind].layer, "v_dim"):
            raise ValueError(f"{where}: the {kind} layer takes no v_dim (its values have d_model / n_heads features)")


#: the attention kinds (names of KINDS)
ATTENTION_KINDS = tuple(KINDS)
#: the kinds with a decaying or corrected state: causal only, output gate on by default
RECURRENT_KINDS = tuple(k.name for k in KINDS.values() if k.causal_only)
POSITIONS = ("rope", "learned", "none")
POOLINGS = ("mean", "first")
BLOCKS = ("transformer", "conv_mixer")


@dataclass
class ModelConfig:
    """Everything that defines a model; round-trips through JSON (to_json / from_json).

    attention: per-layer kinds (names of linattn.models.kinds.KINDS: "linear", "softmax",
        the gated and delta-rule kinds, …), a list of length n_layers, or a shorter pattern repeated to fill the
        layers (n_layers must be a multiple of its length); a string is one kind ("linear") or a
        comma-separated pattern ("linear,linear,linear,softmax").
    feature_map / feature_map_options: φ of the linear layers and its options (JSON values), see
        linattn.nn.feature_maps. A "seed" option (FAVOR+, trig, Hedgehog) is offset per layer so layers
        draw different projections; cosFormer's max_len defaults to `max_len`.
    qk_dim: per-head q/k dim (default the value head dim, v_dim or d_model / n_heads).
    positions: "rope" (on φ features in linear layers, design §6; on q/k in softmax layers),
        "learned" (absolute embeddings, at most max_len positions) or "none".
    d_ff: FFN hidden width (default 4·d_model). num_classes / pooling: the encoder's head.
    seed: seeds the weight initialization (and, by default, the random feature maps).
    chunk_size: rows per chunk C of the chunked causal operators (linear, gated, delta rule; design
        §3, §12–13); any positive int, the sequence length need not be a multiple. Numbers equal up
        to rounding.
    short_conv: kernel size K of the causal depthwise convolution on q, k and v after their
        projection (design §14), in every layer; 0 = none; None (default) = each kind's own: 4 for
        Kind.short_conv (4 for the delta-rule kinds, none for the others).
    output_gate: per-head RMSNorm of the attention output and swish gate, o = RMSNorm(o) ⊙ swish(W_g x),
        in every layer (True), none (False), or gated attention's o ⊙ sigmoid(W_g x) ("sigmoid");
        None (default) = each kind's own: on for the gated and delta-rule kinds, off for linear and
        softmax.
    block: "transformer" (pre-norm attention + FFN) or "conv_mixer" (pre-norm gated short convolution
        + attention, no FFN: Zoology's BaseConv layout for recall); conv_mixer_kernel: the kernel of
        that gated convolution (3, as in Zoology).
    kind_options: {kind: {option: value}}, the options of a kind's layers that its KINDS record
        lists (`Kind.options`, with their defaults), e.g. a window size, or the softmax kind's
        multi-head latent attention (kv_lora_rank, q_lora_rank, shared_k_dim, latent_eps: Kimi
        Linear's MLA, linattn.nn.mla); JSON values. Besides, every
        kind takes the layer settings of LAYER_OPTIONS, which override the config's for its layers
        (a hybrid whose softmax and delta-rule layers differ, as Qwen3.5's): n_heads, qk_dim, v_dim,
        qk_norm (True: per head; "all": one RMSNorm across the heads, OLMo2's),
        short_conv, post_norm (OLMo2's block x ← x + Norm₁(Attn(x)), x ← x + Norm₂(FFN(x))),
        output_gate_eps (the output gate's RMSNorm eps; default norm_eps),
        allow_neg_eigval (delta-rule kinds: β = 2·sigmoid(·)), output_gate (True,
        False or "sigmoid": gated attention's o ⊙ sigmoid(W_g x), no norm) and rope_dim (with
        positions="rope": rotate only the first rope_dim q/k features, partial RoPE as transformers'
        partial_rotary_factor; 0: no RoPE in that kind's layers; None: all; not for the linear
        kind, whose RoPE turns φ's features).
    v_dim: per-head value dim (default d_model / n_heads, which must then divide d_model); the
        heads' outputs, n_heads·v_dim wide, are projected back to d_model.
    moe: {} (dense FFNs) or a mixture-of-experts FFN in the layers it names (linattn.nn.moe,
        Qwen3-Next's and Qwen3.5-MoE's): {"num_experts", "top_k", "d_expert", "shared_d_ff" (0: no shared expert),
        "norm_topk_prob", "layers" (None: every layer; else the MoE layers' indices)}, optionally
        the router's "router" ("softmax"; "sigmoid": Kimi Linear's grouped router with a score bias),
        "n_group", "topk_group", "routed_scaling_factor" and "shared_gate" (nn.moe.MOE_DEFAULTS); SwiGLU
        experts.
    qkv_bias: a bias on the fused q/k/v projection (None: as `bias`; Qwen2 has it with bias off).
    qk_norm: a per-head RMSNorm on q and k after the projection, before RoPE, with a gain of the head
        dim shared by the heads (Qwen3).
    activation: "swiglu", "gelu" (exact) or "gelu_tanh" (GPT-2's tanh approximation; eager decoding).
    """

    vocab_size: int = 256
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 8
    d_ff: int | None = None
    attention: list = field(default_factory=lambda: ["linear"])
    feature_map: str = "elu"
    feature_map_options: dict = field(default_factory=dict)
    qk_dim: int | None = None
    positions: str = "rope"
    rope_base: float = 10_000.0
    max_len: int = 2048
    dropout: float = 0.0
    tie_embeddings: bool = True
    norm: str = "rmsnorm"
    norm_eps: float = 1e-5
    activation: str = "swiglu"
    bias: bool = False
    num_classes: int | None = None
    pooling: str = "mean"
    seed: int = 0
    chunk_size: int = DEFAULT_CHUNK_SIZE
    short_conv: int | None = None
    output_gate: bool | str | None = None
    block: str = "transformer"
    conv_mixer_kernel: int = 3
    kind_options: dict = field(default_factory=dict)
    qkv_bias: bool | None = None
    qk_norm: bool = False
    v_dim: int | None = None
    moe: dict = field(default_factory=dict)

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "max_len", "chunk_size", "conv_mixer_kernel"):
            check_positive_int(name, getattr(self, name))
        for name in ("d_ff", "qk_dim", "num_classes", "v_dim"):
            check_positive_int(name, getattr(self, name), allow_none=True)
        if self.v_dim is None and self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads}) (or set v_dim)")
        if isinstance(self.attention, str):
            self.attention = [a.strip() for a in self.attention.split(",")]
        if not isinstance(self.attention, (list, tuple)) or not self.attention:
            raise ValueError(f"attention must be a non-empty list of kinds or a pattern string, got {self.attention!r}")
        self.attention = list(self.attention)
        for kind in self.attention:
            check_choice("attention", kind, ATTENTION_KINDS)
        if self.n_layers % len(self.attention):
            raise ValueError(f"attention pattern of length {len(self.attention)} does not divide "
                             f"n_layers={self.n_layers}")
        check_choice("feature_map", self.feature_map, tuple(sorted(FEATURE_MAPS)))
        check_choice("positions", self.positions, POSITIONS)
        check_choice("norm", self.norm, NORMS)
        check_choice("activation", self.activation, ACTIVATIONS)
        check_choice("pooling", self.pooling, POOLINGS)
        check_choice("block", self.block, BLOCKS)
        check_int("short_conv", self.short_conv, minimum=0, allow_none=True)
        # a kernel of K taps reads the K − 1 tokens before each one: beyond the longest sequence it only costs
        for name, kernel in (("short_conv", self.short_conv),
                             ("conv_mixer_kernel", self.conv_mixer_kernel if self.block == "conv_mixer" else None)):
            if kernel is not None and kernel > self.max_len:
                raise ValueError(f"{name}={kernel} is longer than max_len={self.max_len}, the longest sequence of this "
                                 "config: no sequence can use such a kernel; pass a kernel <= max_len (DeltaNet uses 4)")
        if self.output_gate is not None:
            check_output_gate(self.output_gate)
        check_number("dropout", self.dropout, minimum=0, maximum=1, high_open=True)
        for name in ("rope_base", "norm_eps"):
            check_number(name, getattr(self, name), minimum=0, low_open=True)
        for name in ("tie_embeddings", "bias", "qk_norm"):
            check_bool(name, getattr(self, name))
        if self.qkv_bias is not None:
            check_bool("qkv_bias", self.qkv_bias)
        check_seed("seed", self.seed)
        self._check_kind_options()
        check_moe(self.moe, self.n_layers)
        if self.moe and self.activation != "swiglu":
            raise ValueError(f"moe: the experts are SwiGLU; activation={self.activation!r} is not")
        if self.v_dim is not None:
            for kind in set(self.attention):
                if "v_dim" not in self.kind_options.get(kind, {}) and not _takes(KINDS[kind].layer, "v_dim"):
                    raise ValueError(f"v_dim: the {kind} layer takes no v_dim (its values have d_model / n_heads "
                                     "features)")
        if not isinstance(self.feature_map_options, dict):
            raise ValueError(f"feature_map_options must be a dict, got {type(self.feature_map_options).__name__}")
        try:
            self.feature_map_options = json.loads(json.dumps(self.feature_map_options))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"feature_map_options must hold JSON values: {exc}") from None
        if self.positions == "rope" and self.head_qk_dim < 2 and any(k != "linear" for k in self.attention):
            raise ValueError(f"positions='rope' rotates pairs of q/k features: it needs a q/k head dim >= 2, got "
                             f"{self.head_qk_dim} (qk_dim, or d_model / n_heads); use fewer heads, a larger qk_dim "
                             "or positions='none'")
        if "linear" in self.attention:  # build φ (and RoPE on its features) once to check the options
            try:
                fm = make_feature_map(self.feature_map, self.head_qk_dim, **self.feature_map_options_for(0))
                if self.positions == "rope":
                    RotaryEmbedding(fm.feature_dim, self.rope_base)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"feature_map={self.feature_map!r} with feature_map_options="
                                 f"{self.feature_map_options} and positions={self.positions!r}: {exc}") from None

    def _check_kind_options(self) -> None:
        if not isinstance(self.kind_options, dict):
            raise ValueError(f"kind_options must be a dict of {{kind: {{option: value}}}}, got "
                             f"{type(self.kind_options).__name__}")
        for kind, options in self.kind_options.items():
            check_choice("kind_options key", kind, ATTENTION_KINDS)
            if not isinstance(options, dict):
                raise ValueError(f"kind_options[{kind!r}] must be a dict of options, got {type(options).__name__}")
            known = KINDS[kind].options
            for name, value in options.items():
                if name in LAYER_OPTIONS:
                    _check_layer_option(kind, name, value)
                elif name not in known:
                    raise ValueError(f"kind_options[{kind!r}]: unknown option {name!r}; the {kind} layer takes "
                                     f"{', '.join([*known, *LAYER_OPTIONS])}")
        try:
            self.kind_options = json.loads(json.dumps(self.kind_options))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"kind_options must hold JSON values: {exc}") from None

    # ---- derived values
    @property
    def head_qk_dim(self) -> int:
        return self.qk_dim or self.d_model // self.n_heads

    @property
    def ffn_dim(self) -> int:
        """d_ff, or by default 4·d_model for GELU and the parameter-matched 8/3·d_model (rounded up
        to a multiple of 32) for SwiGLU, whose three matrices then hold as many weights as GELU's two."""
        if self.d_ff is not None:
            return self.d_ff
        if self.activation == "swiglu":
            return -(-8 * self.d_model // 96) * 32  # ⌈8·d/3 / 32⌉·32
        return 4 * self.d_model

    @property
    def layer_kinds(self) -> list[str]:
        """The attention kind of every layer: the pattern repeated to n_layers."""
        return self.attention * (self.n_layers // len(self.attention))

    def short_conv_for(self, kind: str) -> int:
        """The short convolution kernel of a layer of `kind` (0: none)."""
        own = self.kind_options.get(kind, {})
        if "short_conv" in own:
            return own["short_conv"]
        return KINDS[kind].short_conv if self.short_conv is None else self.short_conv

    def output_gate_for(self, kind: str) -> bool | str:
        """The output gate of a layer of `kind`: kind_options', the config's, else the kind's own
        (True: RMSNorm and swish gate; "sigmoid": gated attention's; False: none)."""
        own = self.kind_options.get(kind, {})
        if "output_gate" in own:
            return own["output_gate"]
        return KINDS[kind].output_gate if self.output_gate is None else self.output_gate

    def moe_for(self, layer: int) -> dict | None:
        """The MoE options of layer `layer` (moe less "layers"), None when its FFN is dense."""
        if not self.moe or (self.moe["layers"] is not None and layer not in self.moe["layers"]):
            return None
        return {k: v for k, v in self.moe.items() if k != "layers"}

    def kind_options_for(self, kind: str) -> dict:
        """The options of the layers of `kind` its record lists: the defaults, updated by kind_options
        (the layer settings of LAYER_OPTIONS are `layer_options_for`'s)."""
        own = {k: v for k, v in self.kind_options.get(kind, {}).items() if k not in LAYER_OPTIONS}
        return {**KINDS[kind].options, **own}

    def layer_options_for(self, kind: str) -> dict:
        """The settings of LAYER_OPTIONS for the layers of `kind`: kind_options', else the config's
        (rope_dim None: every q/k feature rotated)."""
        own = self.kind_options.get(kind, {})
        default = dict(n_heads=self.n_heads, qk_dim=self.qk_dim, v_dim=self.v_dim, qk_norm=self.qk_norm,
                       output_gate=self.output_gate_for(kind), rope_dim=None, post_norm=False,
                       output_gate_eps=None, allow_neg_eigval=None)
        return {name: own.get(name, value) for name, value in default.items()}

    def feature_map_options_for(self, layer: int) -> dict:
        opts = dict(self.feature_map_options)
        if self.feature_map in ("favor", "trig", "hedgehog"):
            opts["seed"] = int(opts.get("seed", self.seed)) + 1_000_003 * layer
        if self.feature_map == "cosformer":
            opts.setdefault("max_len", self.max_len)
        return opts

    @property
    def max_positions(self) -> int | None:
        """Positions a model of this config can take (None: unbounded)."""
        limits = []
        if self.positions == "learned":
            limits.append(self.max_len)
        if self.feature_map == "cosformer" and "linear" in self.attention:
            limits.append(int(self.feature_map_options_for(0)["max_len"]))
        return min(limits) if limits else None

    # ---- serialization
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        return dataclass_from_dict(cls, d, "model config")

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "ModelConfig":
        try:
            d = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"model config is not valid JSON: {exc}") from None
        return cls.from_dict(d)

    def diff(self, other: "ModelConfig") -> dict:
        """{field: (self's value, other's value)} for every field that differs."""
        a, b = self.to_dict(), other.to_dict()
        return {k: (a[k], b[k]) for k in a if a[k] != b[k]}


__all__ = ["ATTENTION_KINDS", "BLOCKS", "LAYER_OPTIONS", "POOLINGS", "POSITIONS", "RECURRENT_KINDS", "ModelConfig"]
