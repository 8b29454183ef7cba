"""Models: one config, a decoder-only LM and a bidirectional encoder (design §8).

    ids (B, N) ─ tok_emb (+ pos_emb) ─ dropout ─ Block × n_layers ─ Norm ─ head

Each Block is pre-norm, `x ← x + Attn(Norm(x)); x ← x + FFN(Norm(x))` (block="transformer"), or
`x ← x + GatedConv(Norm(x)); x ← x + Attn(Norm(x))` without FFN (block="conv_mixer", Zoology's
layout), and its attention kind is chosen per layer by `ModelConfig.attention` (ATTENTION_KINDS:
linear, softmax, and the gated / delta-rule kinds of linattn.gated_layers), so a hybrid such as
["gated_deltanet", "gated_deltanet", "gated_deltanet", "softmax"] (repeated over the layers) is a
config value.

The LM decodes recurrently: `forward(ids, cache=model.new_cache())` prefills (chunked parallel
path) and returns the per-layer caches; each further call with that cache costs O(1) per token in
linear, gated and delta-rule layers (state update) and O(context) in softmax layers (KV cache). See
linattn.generation.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ._checks import (
    check_bool,
    check_choice,
    check_int,
    check_number,
    check_positions,
    check_positive_int,
    dataclass_from_dict,
)
from .checkpoint import CONFIG_NAME, CheckpointError, load_model, read_config, save_pretrained
from .feature_maps import FEATURE_MAPS, make_feature_map
from .gated_layers import (
    DeltaNetAttention,
    GatedDeltaNetAttention,
    GLAAttention,
    RetNetAttention,
    SimpleGLAAttention,
)
from .layers import (
    ACTIVATIONS,
    NORMS,
    Block,
    ConvMixerBlock,
    LinearAttention,
    PositionCounter,
    SoftmaxAttention,
    make_norm,
    token_positions,
)
from .ops.chunked import DEFAULT_CHUNK_SIZE
from .positional import RotaryEmbedding

#: attention kind -> layer class (linattn.layers, linattn.gated_layers)
ATTENTION_LAYERS = {
    "linear": LinearAttention,
    "softmax": SoftmaxAttention,
    "retnet": RetNetAttention,
    "simple_gla": SimpleGLAAttention,
    "gla": GLAAttention,
    "deltanet": DeltaNetAttention,
    "gated_deltanet": GatedDeltaNetAttention,
}
ATTENTION_KINDS = tuple(ATTENTION_LAYERS)
#: the kinds with a decaying or corrected state (linattn.gated_layers): causal only, output gate on by default
RECURRENT_KINDS = ("retnet", "simple_gla", "gla", "deltanet", "gated_deltanet")
#: short convolution kernel on q, k, v when ModelConfig.short_conv is None (DeltaNet and Gated DeltaNet use 4)
DEFAULT_SHORT_CONV = {"deltanet": 4, "gated_deltanet": 4}
POSITIONS = ("rope", "learned", "none")
POOLINGS = ("mean", "first")
BLOCKS = ("transformer", "conv_mixer")


@dataclass
class ModelConfig:
    """Everything that defines a model; round-trips through JSON (to_json / from_json).

    attention: per-layer kinds, a list of "linear" / "softmax" of length n_layers, or a shorter
        pattern repeated to fill the layers (n_layers must be a multiple of its length); a string
        is one kind ("linear") or a comma-separated pattern ("linear,linear,linear,softmax").
    feature_map / feature_map_options: φ of the linear layers and its options (JSON values), see
        linattn.feature_maps. A "seed" option (FAVOR+, trig, Hedgehog) is offset per layer so layers
        draw different projections; cosFormer's max_len defaults to `max_len`.
    qk_dim: per-head q/k dim (default d_model / n_heads); values always have d_model / n_heads.
    positions: "rope" (on φ features in linear layers, design §6; on q/k in softmax layers),
        "learned" (absolute embeddings, at most max_len positions) or "none".
    d_ff: FFN hidden width (default 4·d_model). num_classes / pooling: the encoder's head.
    seed: seeds the weight initialization (and, by default, the random feature maps).
    chunk_size: rows per chunk C of the chunked causal operators (linear, gated, delta rule; design
        §3, §12–13); any positive int, the sequence length need not be a multiple. Numbers equal up
        to rounding.
    short_conv: kernel size K of the causal depthwise convolution on q, k and v after their
        projection (design §14), in every layer; 0 = none; None (default) = each kind's own: 4 for
        deltanet and gated_deltanet, none for the others.
    output_gate: per-head RMSNorm of the attention output and swish gate, o = RMSNorm(o) ⊙ swish(W_g x),
        in every layer; None (default) = each kind's own: on for the gated and delta-rule kinds, off
        for linear and softmax.
    block: "transformer" (pre-norm attention + FFN) or "conv_mixer" (pre-norm gated short convolution
        + attention, no FFN: Zoology's BaseConv layout for recall); conv_mixer_kernel: the kernel of
        that gated convolution (3, as in Zoology).
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
    output_gate: bool | None = None
    block: str = "transformer"
    conv_mixer_kernel: int = 3

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "max_len", "chunk_size", "conv_mixer_kernel"):
            check_positive_int(name, getattr(self, name))
        for name in ("d_ff", "qk_dim", "num_classes"):
            check_positive_int(name, getattr(self, name), allow_none=True)
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
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
            check_bool("output_gate", self.output_gate)
        check_number("dropout", self.dropout, minimum=0, maximum=1, high_open=True)
        for name in ("rope_base", "norm_eps"):
            check_number(name, getattr(self, name), minimum=0, low_open=True)
        for name in ("tie_embeddings", "bias"):
            check_bool(name, getattr(self, name))
        check_int("seed", self.seed)
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
        return DEFAULT_SHORT_CONV.get(kind, 0) if self.short_conv is None else self.short_conv

    def output_gate_for(self, kind: str) -> bool:
        """Whether a layer of `kind` normalizes and gates its output."""
        return kind in RECURRENT_KINDS if self.output_gate is None else self.output_gate

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


@dataclass
class ModelCache(PositionCounter):
    """Per-layer decoding caches (LinearAttentionCache or KVCache, one per block) and the position
    counter of the model (used by learned position embeddings). Updated in place by forward."""

    layers: list = field(default_factory=list)

    @property
    def nbytes(self) -> list[int]:
        return [c.nbytes for c in self.layers]


@contextlib.contextmanager
def _no_redraw(module: nn.Module):
    """Suspends the redraw schedule of random feature maps (FAVOR+, trig) inside `module`, so that
    the recomputation of activation checkpointing sees the ω its forward used."""
    paused = [m for m in module.modules() if getattr(m, "redraw_interval", None) is not None]
    saved = [m.redraw_interval for m in paused]
    for m in paused:
        m.redraw_interval = None
    try:
        yield
    finally:
        for m, r in zip(paused, saved):
            m.redraw_interval = r


class _Transformer(nn.Module):
    """Embeddings, blocks and final norm shared by the LM and the encoder."""

    causal = True

    def __init__(self, config: ModelConfig):
        super().__init__()
        if not isinstance(config, ModelConfig):
            raise TypeError(f"config must be a ModelConfig, got {type(config).__name__}")
        c = self.config = config
        self.tok_emb = nn.Embedding(c.vocab_size, c.d_model)
        self.pos_emb = nn.Embedding(c.max_len, c.d_model) if c.positions == "learned" else None
        self.drop = nn.Dropout(c.dropout)
        self.blocks = nn.ModuleList(self._block(i, kind) for i, kind in enumerate(c.layer_kinds))
        self.norm = make_norm(c.norm, c.d_model, c.norm_eps)
        self.activation_checkpointing = False
        self.sequence_parallel_group = None

    def _block(self, i: int, kind: str) -> nn.Module:
        c = self.config
        common = dict(rope=c.positions == "rope", rope_base=c.rope_base, qk_dim=c.qk_dim, dropout=c.dropout,
                      bias=c.bias, short_conv=c.short_conv_for(kind), output_gate=c.output_gate_for(kind),
                      norm_eps=c.norm_eps)
        if kind == "linear":
            attn = LinearAttention(c.d_model, c.n_heads, feature_map=c.feature_map, causal=self.causal,
                                   feature_map_options=c.feature_map_options_for(i), chunk_size=c.chunk_size, **common)
        elif kind == "softmax":
            attn = SoftmaxAttention(c.d_model, c.n_heads, causal=self.causal, **common)
        else:
            attn = ATTENTION_LAYERS[kind](c.d_model, c.n_heads, chunk_size=c.chunk_size, **common)
        if c.block == "conv_mixer":
            return ConvMixerBlock(attn, c.conv_mixer_kernel, norm=c.norm, norm_eps=c.norm_eps)
        return Block(attn, c.ffn_dim, activation=c.activation, norm=c.norm, norm_eps=c.norm_eps, dropout=c.dropout,
                     bias=c.bias)

    @torch.no_grad()
    def _init_weights(self) -> None:
        """GPT-2 style, seeded by config.seed: N(0, 0.02) for linear and embedding weights, residual
        output projections scaled by 1/√(2·n_layers), zero biases; norms at 1; φ keeps its own.
        Modules with their own scheme (`init_parameters(generator)`: short convolutions, Mamba2-style
        decays) draw from the same generator."""
        g = torch.Generator().manual_seed(self.config.seed)
        resid = 0.02 / math.sqrt(2 * self.config.n_layers)
        for name, mod in self.named_modules():
            if isinstance(mod, (nn.Linear, nn.Embedding)):
                std = resid if name.endswith((".attn.out", ".ffn.down")) else 0.02
                mod.weight.copy_(torch.randn(mod.weight.shape, generator=g) * std)
                if getattr(mod, "bias", None) is not None:
                    mod.bias.zero_()
            elif hasattr(mod, "init_parameters"):
                mod.init_parameters(g)

    def save_pretrained(self, directory) -> Path:
        """Writes `directory`/config.json and model.safetensors (linattn.checkpoint's format)."""
        return save_pretrained(self, directory)

    @classmethod
    def from_pretrained(cls, directory, *, config: ModelConfig | None = None, device="cpu", dtype=None):
        """The model saved in `directory` (by save_pretrained or a training checkpoint), on `device`,
        in `dtype` (None: the saved dtype). config: the expected ModelConfig; if given and different,
        a CheckpointError lists the fields. See load_pretrained."""
        return load_pretrained(directory, cls, config=config, device=device, dtype=dtype)

    def set_activation_checkpointing(self, enabled: bool = True) -> None:
        """Recompute each block's activations in the backward (torch.utils.checkpoint) in training."""
        self.activation_checkpointing = bool(enabled)

    def set_sequence_parallel_group(self, group) -> None:
        """Run every attention layer sequence-parallel over `group` (a torch.distributed process
        group; None: local) when no cache is used. Each rank then passes its contiguous shard of
        every sequence, in rank order, with `positions` = the global indices of the shard's tokens
        (start + arange(n), see linattn.parallel.shard_bounds), and gets the logits of its shard.
        Every attention kind runs sequence-parallel (linattn.parallel: linear and softmax layers,
        the gated and delta-rule kinds), and short convolutions and conv_mixer blocks take the K−1
        inputs before the shard from the earlier ranks (a halo exchange); design §9."""
        self.sequence_parallel_group = group
        for block in self.blocks:
            block.attn.sequence_parallel_group = group
            if isinstance(block, ConvMixerBlock):
                block.sequence_parallel_group = group

    def _check_ids(self, ids, mask):
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype not in (torch.int32, torch.int64):
            got = f"{tuple(ids.shape)} {ids.dtype}" if isinstance(ids, torch.Tensor) else type(ids).__name__
            raise ValueError(f"ids must be an integer tensor of shape (B, N), got {got}")
        if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool
                                 or mask.shape != ids.shape):
            raise ValueError(f"mask must be a bool tensor of ids' shape {tuple(ids.shape)} (True = real token)")
        if ids.numel() and not torch.compiler.is_compiling():  # one reduction; an embedding lookup would fail obscurely
            low, high = (int(x) for x in torch.aminmax(ids))
            if low < 0 or high >= self.config.vocab_size:
                bad = low if low < 0 else high
                where = tuple(int(i) for i in (ids == bad).nonzero()[0])
                raise ValueError(f"ids must be token ids in [0, vocab_size={self.config.vocab_size}), got {bad} at "
                                 f"ids{list(where)}")

    def _trunk(self, ids, mask=None, cache: ModelCache | None = None, positions=None):
        """ids (B, N) -> hidden (B, N, d) after the final norm; advances the cache. positions: (N,) or
        (B, N) global token indices (default: counted from each row's first real token, or by the
        cache; required under sequence parallelism)."""
        self._check_ids(ids, mask)
        n = ids.shape[1]
        if positions is not None:
            if cache is not None:
                raise ValueError("positions: a cache counts the positions itself; pass positions or a cache")
            check_positions(positions, ids.shape[0], n, ids.device)
        if cache is not None:
            positions = cache.next_positions(n, mask, ids.device)
        elif self.sequence_parallel_group is not None:
            if mask is not None:
                raise ValueError("sequence parallelism does not take a padding mask")
            if positions is None:
                raise ValueError("positions: under sequence parallelism pass the global indices of this shard's "
                                 "tokens (start + arange(n), start from linattn.parallel.shard_bounds)")
        elif positions is None and (mask is not None or self.pos_emb is not None):
            positions = token_positions(n, mask, device=ids.device)
        x = self.tok_emb(ids)
        if self.pos_emb is not None:
            if not torch.compiler.is_compiling() and int(positions.max()) >= self.config.max_len:
                raise ValueError(f"position {int(positions.max())} is beyond max_len={self.config.max_len}")
            x = x + self.pos_emb(positions)
        if self.drop.p and self.training:
            x = self.drop(x)
        for i, block in enumerate(self.blocks):
            if cache is None and self.activation_checkpointing and self.training:
                x, _ = checkpoint(block, x, mask, None, positions, use_reentrant=False,
                                  context_fn=lambda b=block: (contextlib.nullcontext(), _no_redraw(b)))
            else:
                x, _ = block(x, mask, None if cache is None else cache.layers[i], positions)
        if cache is not None:
            cache.advance(n, mask)
        return self.norm(x)


class LinearTransformerLM(_Transformer):
    """Decoder-only language model with linear (and optionally softmax) attention layers.

    forward(ids (B, N), mask=None, cache=None, last_only=False, positions=None, logits_at=None)
        -> (logits (B, N, V), cache)
    With last_only, logits are (B, 1, V) for the last position only (generation). With logits_at, an
    int tensor (B, P) or (P,) of indices into the N tokens (e.g. the query positions of a recall task),
    logits are (B, P, V) for those positions only: the output projection runs on P rows instead of N.
    positions: the tokens' global indices, needed under sequence parallelism (see
    set_sequence_parallel_group).
    """

    causal = True

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self._init_weights()
        if config.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight

    def new_cache(self) -> ModelCache:
        """An empty cache: pass it to forward for the prefill, then the returned one per step."""
        return ModelCache(layers=[block.new_cache() for block in self.blocks])

    def forward(self, ids: torch.Tensor, mask: torch.Tensor | None = None, cache: ModelCache | None = None,
                last_only: bool = False, positions: torch.Tensor | None = None,
                logits_at: torch.Tensor | None = None):
        if logits_at is not None:
            if last_only:
                raise ValueError("pass last_only or logits_at, not both")
            logits_at = _check_logits_at(logits_at, ids)
        h = self._trunk(ids, mask, cache, positions)
        if last_only:
            h = h[:, -1:]
        elif logits_at is not None:
            h = h.gather(1, logits_at[..., None].expand(-1, -1, h.shape[-1]))
        return self.lm_head(h), cache

    def loss(self, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Mean next-token cross-entropy over real targets: predict ids[:, 1:] from ids[:, :-1]."""
        logits, _ = self(ids[:, :-1], None if mask is None else mask[:, :-1])
        targets = ids[:, 1:]
        if mask is not None:
            targets = targets.masked_fill(~(mask[:, 1:] & mask[:, :-1]), -100)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), ignore_index=-100)

    def generate(self, prompt_ids, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 top_p: float | None = None, seed: int | None = None, stop_tokens=None, *, mask=None,
                 fused: bool | None = None):
        """Generated token ids per prompt (list of lists); see linattn.generation.generate (fused: the
        fused decoding step, linattn.decoding)."""
        from .generation import generate

        return generate(self, prompt_ids, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                        seed=seed, stop_tokens=stop_tokens, mask=mask, fused=fused)

    def stream(self, prompt_ids, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
               top_p: float | None = None, seed: int | None = None, stop_tokens=None, *, mask=None,
               fused: bool | None = None):
        """Iterator over steps, each a list (one entry per prompt) of the new token id or None once
        that prompt has stopped; see linattn.generation.stream."""
        from .generation import stream

        return stream(self, prompt_ids, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                      seed=seed, stop_tokens=stop_tokens, mask=mask, fused=fused)


def _check_logits_at(index, ids: torch.Tensor) -> torch.Tensor:
    """logits_at as (B, P) long indices into ids' N tokens (a (P,) index is shared by the rows)."""
    b, n = ids.shape
    if not isinstance(index, torch.Tensor) or index.dtype not in (torch.int32, torch.int64) or index.dim() not in (1, 2):
        got = f"{tuple(index.shape)} {index.dtype}" if isinstance(index, torch.Tensor) else type(index).__name__
        raise ValueError(f"logits_at must be an integer tensor of shape (B, P) or (P,) of token indices, got {got}")
    if index.dim() == 2 and index.shape[0] != b:
        raise ValueError(f"logits_at must have shape (B={b}, P) or (P,), got {tuple(index.shape)}")
    if index.device != ids.device:
        raise ValueError(f"logits_at must be on ids' device ({ids.device}), got {index.device}")
    if index.numel() and not torch.compiler.is_compiling():
        lo, hi = int(index.min()), int(index.max())
        if lo < 0 or hi >= n:
            raise ValueError(f"logits_at indices must lie in [0, {n}) (the tokens of ids), got {lo} … {hi}")
    index = index.long()
    return index.expand(b, -1) if index.dim() == 1 else index


class LinearTransformerEncoder(_Transformer):
    """Bidirectional encoder with a classification head (e.g. ListOps).

    encode(ids (B, N), mask, positions=None) -> hidden (B, N, d); forward(ids, mask) -> logits (B, num_classes) from
    the mean of the real tokens' hidden states (pooling="mean") or the first real token ("first").
    With a mask, positions count real tokens only, so left- or right-padding leaves the output as is.
    """

    causal = False

    def __init__(self, config: ModelConfig):
        if config.num_classes is None:
            raise ValueError("num_classes must be set in the config of a LinearTransformerEncoder")
        causal_only = sorted({k for k in config.attention if k in RECURRENT_KINDS})
        if causal_only:
            raise ValueError(f"attention: the kind(s) {', '.join(causal_only)} are causal only; a "
                             "LinearTransformerEncoder (bidirectional) takes 'linear' and 'softmax' layers")
        super().__init__(config)
        self.head = nn.Linear(config.d_model, config.num_classes)
        self._init_weights()

    def encode(self, ids: torch.Tensor, mask: torch.Tensor | None = None,
               positions: torch.Tensor | None = None) -> torch.Tensor:
        return self._trunk(ids, mask, positions=positions)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        if self.sequence_parallel_group is not None:
            raise ValueError("the pooled head needs the whole sequence: under sequence parallelism call encode() "
                             "and pool across the ranks")
        h = self.encode(ids, mask)
        if self.config.pooling == "first":
            first = torch.zeros_like(ids[:, 0]) if mask is None else mask.long().argmax(1)  # first real token
            pooled = h[torch.arange(ids.shape[0], device=ids.device), first]
        elif mask is None:
            pooled = h.mean(1)
        else:
            m = mask.to(h.dtype).unsqueeze(-1)
            pooled = (h * m).sum(1) / m.sum(1).clamp_min(1)
        return self.head(pooled)


def load_pretrained(directory, cls=None, *, config: ModelConfig | None = None, device="cpu", dtype=None):
    """Builds the model saved in `directory` and loads its weights (JSON + safetensors only).

    cls: the expected model class (None: the one recorded in config.json). config: an expected
    ModelConfig; if given and different, a CheckpointError lists the differing fields. dtype: the
    floating dtype of the model; None keeps the dtype the weights were saved in (a file holding
    several floating dtypes is refused), a torch dtype casts the floating tensors to it; integer
    buffers keep theirs. The config is checked against the weights file's header before the model
    is built (linattn.checkpoint.load_model).
    """
    directory = Path(directory)
    arch, saved, ckpt_id = read_config(directory, ModelConfig)
    classes = {c.__name__: c for c in (LinearTransformerLM, LinearTransformerEncoder)}
    if cls is None:
        if arch not in classes:
            raise CheckpointError(f"unknown architecture {arch!r} in {directory / CONFIG_NAME}; "
                                  f"known: {sorted(classes)}")
        cls = classes[arch]
    elif arch != cls.__name__:
        shown = arch if isinstance(arch, str) and arch.isprintable() else repr(arch)  # no raw control characters
        raise CheckpointError(f"{directory} holds a {shown}, not a {cls.__name__}")
    if config is not None:
        diff = config.diff(saved)
        if diff:
            desc = ", ".join(f"{k}: expected {a!r}, checkpoint has {b!r}" for k, (a, b) in sorted(diff.items()))
            raise CheckpointError(f"config mismatch with {directory / CONFIG_NAME}: {desc}")
    model = load_model(directory, lambda: cls(saved), checkpoint_id=ckpt_id, dtype=dtype,
                       layers=("blocks.", saved.n_layers))
    return model.to(device)


__all__ = [
    "ATTENTION_KINDS",
    "BLOCKS",
    "RECURRENT_KINDS",
    "POSITIONS",
    "LinearTransformerEncoder",
    "LinearTransformerLM",
    "ModelCache",
    "ModelConfig",
    "load_pretrained",
]
