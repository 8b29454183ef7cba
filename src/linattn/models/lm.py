"""The decoder-only LM and the bidirectional encoder (design §8); their config is linattn.models.config.

    ids (B, N) ─ tok_emb (+ pos_emb) ─ dropout ─ Block × n_layers ─ Norm ─ head

Each Block is pre-norm, `x ← x + Attn(Norm(x)); x ← x + FFN(Norm(x))` (block="transformer"), or
`x ← x + GatedConv(Norm(x)); x ← x + Attn(Norm(x))` without FFN (block="conv_mixer", Zoology's
layout), and its attention kind is chosen per layer by `ModelConfig.attention` (a name of the kinds
table linattn.models.kinds.KINDS: linear, softmax, the gated and delta-rule kinds, …), so a hybrid of
three Gated DeltaNet layers and one softmax layer (repeated over the layers) is a config value.

The LM decodes recurrently: `forward(ids, cache=model.new_cache())` prefills (chunked parallel
path) and returns the per-layer caches; each further call with that cache costs O(1) per token in
linear, gated and delta-rule layers (state update) and O(context) in softmax layers (KV cache). See
linattn.models.generation.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .._checks import check_positions, check_positive_int
from ..nn.base import OutputGate
from ..ops.cross_entropy import linear_cross_entropy
from ..nn.blocks import Block, ConvMixerBlock
from ..nn.caches import PositionCounter, token_positions
from ..nn.linear import Linear
from ..nn.norms import make_norm
from ..ops import packed
from .checkpoint import CONFIG_NAME, CheckpointError, load_model, read_config, save_pretrained
from .config import ModelConfig
from .kinds import KINDS


#: the target that scores nothing (torch's ignore_index): padding, a document's last token, an unscored position
IGNORE_INDEX = -100


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
        self.checkpoint_every = 1
        self.sequence_parallel_group = None

    def _block(self, i: int, kind: str) -> nn.Module:
        c = self.config
        own = c.layer_options_for(kind)
        common = dict(rope=c.positions == "rope", rope_base=c.rope_base, qk_dim=own["qk_dim"], dropout=c.dropout,
                      bias=c.bias, short_conv=c.short_conv_for(kind), output_gate=own["output_gate"],
                      norm_eps=c.norm_eps)
        for name in ("v_dim", "allow_neg_eigval"):  # only when set: not every kind's layer takes them
            if own[name] is not None:
                common[name] = own[name]
        row = KINDS[kind]
        attn = row.layer(c.d_model, own["n_heads"], **row.build(c, i, self.causal), **common,
                         **c.kind_options_for(kind))
        if own["rope_dim"] is not None and c.positions == "rope":
            attn.set_rope_dim(own["rope_dim"])
        if c.qkv_bias is not None:
            attn.set_qkv_bias(c.qkv_bias)
        if own["qk_norm"]:
            attn.set_qk_norm(c.norm_eps, across_heads=own["qk_norm"] == "all")
        if own["output_gate_eps"] is not None:
            if not isinstance(attn.output_gate, OutputGate):
                raise ValueError(f"kind_options[{kind!r}]['output_gate_eps']: its layers have no normalizing output "
                                 "gate (output_gate=True)")
            attn.output_gate.norm.eps = float(own["output_gate_eps"])
        if c.block == "conv_mixer":
            if own["post_norm"]:
                raise ValueError(f"kind_options[{kind!r}]['post_norm']: conv_mixer blocks are pre-norm")
            return ConvMixerBlock(attn, c.conv_mixer_kernel, norm=c.norm, norm_eps=c.norm_eps)
        return Block(attn, c.ffn_dim, activation=c.activation, norm=c.norm, norm_eps=c.norm_eps, dropout=c.dropout,
                     bias=c.bias, moe=c.moe_for(i), post_norm=own["post_norm"])

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
        """Writes `directory`/config.json and model.safetensors (linattn.models.checkpoint's format)."""
        return save_pretrained(self, directory)

    @classmethod
    def from_pretrained(cls, directory, *, config: ModelConfig | None = None, device="cpu", dtype=None):
        """The model saved in `directory` (by save_pretrained or a training checkpoint), on `device`,
        in `dtype` (None: the saved dtype). config: the expected ModelConfig; if given and different,
        a CheckpointError lists the fields. See load_pretrained."""
        return load_pretrained(directory, cls, config=config, device=device, dtype=dtype)

    def set_activation_checkpointing(self, enabled: bool = True, *, every_n_layers: int = 1) -> None:
        """Recompute the activations of blocks 0, n, 2n, … (n = every_n_layers; 1: every block) in the
        backward (torch.utils.checkpoint, non-reentrant) in training; the others keep theirs."""
        check_positive_int("every_n_layers", every_n_layers)
        self.activation_checkpointing = bool(enabled)
        self.checkpoint_every = every_n_layers

    def _apply_block(self, i: int, x, mask, cache, positions, cu_seqlens=None):
        """Block i on x -> (x, its cache), checkpointed when set_activation_checkpointing says so."""
        block = self.blocks[i]
        kw = {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens}
        if cache is None and self.activation_checkpointing and self.training and i % self.checkpoint_every == 0:
            return checkpoint(block, x, mask, None, positions, use_reentrant=False,
                              context_fn=lambda: (contextlib.nullcontext(), _no_redraw(block)), **kw)
        return block(x, mask, cache, positions, **kw)

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

    def _trunk(self, ids, mask=None, cache: ModelCache | None = None, positions=None, cu_seqlens=None):
        """ids (B, N) -> hidden (B, N, d) after the final norm; advances the cache. positions: (N,) or
        (B, N) global token indices (default: counted from each row's first real token, or by the
        cache; required under sequence parallelism). cu_seqlens: packed sequences (see
        LinearTransformerLM.forward)."""
        self._check_ids(ids, mask)
        n = ids.shape[1]
        if cu_seqlens is not None:
            return self._packed_trunk(ids, mask, cache, positions, cu_seqlens)
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
        x = self._embed(ids, positions)
        for i in range(len(self.blocks)):
            x, _ = self._apply_block(i, x, mask, None if cache is None else cache.layers[i], positions)
        if cache is not None:
            cache.advance(n, mask)
        return self.norm(x)

    def _embed(self, ids, positions):
        """The token embeddings (+ the learned positions' at `positions`), then the dropout."""
        x = self.tok_emb(ids)
        if self.pos_emb is not None:
            if not torch.compiler.is_compiling() and int(positions.max()) >= self.config.max_len:
                raise ValueError(f"position {int(positions.max())} is beyond max_len={self.config.max_len}")
            x = x + self.pos_emb(positions)
        if self.drop.p and self.training:
            x = self.drop(x)
        return x

    def _packed_trunk(self, ids, mask, cache, positions, cu_seqlens):
        """_trunk on N documents packed in one row (ids (1, T)): every layer keeps them apart and
        positions (default) restart at 0 at each document (linattn.ops.packed; the layers derive
        them where they need them, so that a linear layer's operator can share one arange(L) among
        the sequences of one length)."""
        if cache is not None or self.sequence_parallel_group is not None:
            raise ValueError("cu_seqlens (packed sequences) takes neither a cache nor sequence parallelism")
        n = ids.shape[1]
        packed.boundaries(cu_seqlens, batch=ids.shape[0], length=n)
        if positions is not None:
            check_positions(positions, ids.shape[0], n, ids.device)
        pos = positions
        if self.pos_emb is not None and positions is None:
            pos = packed.positions(cu_seqlens, n, mask).to(ids.device)
        x = self._embed(ids, pos)
        for i in range(len(self.blocks)):
            x, _ = self._apply_block(i, x, mask, None, positions, cu_seqlens)
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
    targets: the ids each logit should predict, of the logits' shape without V (IGNORE_INDEX: not
    scored); then forward returns (logits, Σ cross-entropy in float32, float64 in a float64 model) instead of (logits, cache) —
    the loss the training tasks use (`loss` takes its mean over the next-token targets of ids). With
    return_logits=False it returns (the number of scored targets that are their logits' argmax, that
    loss) and the (…, V) logits are never held: linattn.ops.cross_entropy runs the head and the loss
    over row blocks (the plain logits path under autocast or with a wrapped head, e.g. LoRA).
    cu_seqlens: packed documents (design §17, linattn.ops.packed): ids (1, T) holds N documents end to
    end, cu_seqlens the 1-D integer tensor [N+1] of their cumulative lengths. Every layer keeps them
    apart (states reset, convolution taps and softmax attention stay inside a document) and RoPE and
    learned positions restart at 0 at each document (with a mask they count its real tokens, as the
    unpacked path does); the logits equal those of N separate calls.
    """

    causal = True

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.lm_head = Linear(config.d_model, config.vocab_size, bias=False)
        self._init_weights()
        if config.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight

    def new_cache(self) -> ModelCache:
        """An empty cache: pass it to forward for the prefill, then the returned one per step."""
        return ModelCache(layers=[block.new_cache() for block in self.blocks])

    def forward(self, ids: torch.Tensor, mask: torch.Tensor | None = None, cache: ModelCache | None = None,
                last_only: bool = False, positions: torch.Tensor | None = None,
                logits_at: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
                targets: torch.Tensor | None = None, return_logits: bool = True):
        if not return_logits and targets is None:
            raise ValueError("return_logits=False: pass targets (it returns their loss instead of the logits)")
        if logits_at is not None:
            if last_only:
                raise ValueError("pass last_only or logits_at, not both")
            logits_at = _check_logits_at(logits_at, ids)
        if targets is not None and cache is not None:
            raise ValueError("targets: the loss is of a forward without a cache; pass targets or a cache")
        h = self._trunk(ids, mask, cache, positions, cu_seqlens)
        if last_only:
            h = h[:, -1:]
        elif logits_at is not None:
            h = h.gather(1, logits_at[..., None].expand(-1, -1, h.shape[-1]))
        if not return_logits and type(self.lm_head) in (nn.Linear, Linear) and not torch.is_autocast_enabled(h.device.type):
            loss, correct = linear_cross_entropy(h, self.lm_head.weight, self.lm_head.bias, targets,
                                                 ignore_index=IGNORE_INDEX)
            return correct, loss
        logits = self.lm_head(h)
        if targets is None:
            return logits, cache
        loss = summed_cross_entropy(logits, targets)
        return (logits, loss) if return_logits else (correct_predictions(logits, targets), loss)

    def loss(self, ids: torch.Tensor, mask: torch.Tensor | None = None,
             cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        """Mean next-token cross-entropy over the real targets: predict ids[:, 1:] from ids[:, :-1]
        (mask (B, N): True = real token; a target counts when it and its input are real).
        cu_seqlens: N documents packed in ids (1, T): every token predicts the next one of its own
        document (a document's last token predicts nothing), so the loss is that of the documents
        trained one by one, over their T − N targets."""
        if cu_seqlens is None:
            inputs, inputs_mask, targets = ids[:, :-1], None if mask is None else mask[:, :-1], ids[:, 1:]
            if mask is not None:
                targets = targets.masked_fill(~(mask[:, 1:] & mask[:, :-1]), IGNORE_INDEX)
        else:
            inputs, inputs_mask, targets = ids, mask, _packed_targets(ids, cu_seqlens, mask)
        _, total = self(inputs, inputs_mask, cu_seqlens=cu_seqlens, targets=targets)
        return total / (targets != IGNORE_INDEX).sum()

    def generate(self, prompt_ids, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 top_p: float | None = None, seed: int | None = None, stop_tokens=None, *, mask=None,
                 fused: bool | None = None):
        """Generated token ids per prompt (list of lists); see linattn.models.generation.generate (fused: the
        fused decoding step, linattn.models.decoding)."""
        from .generation import generate

        return generate(self, prompt_ids, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                        seed=seed, stop_tokens=stop_tokens, mask=mask, fused=fused)

    def stream(self, prompt_ids, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
               top_p: float | None = None, seed: int | None = None, stop_tokens=None, *, mask=None,
               fused: bool | None = None):
        """Iterator over steps, each a list (one entry per prompt) of the new token id or None once
        that prompt has stopped; see linattn.models.generation.stream."""
        from .generation import stream

        return stream(self, prompt_ids, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                      seed=seed, stop_tokens=stop_tokens, mask=mask, fused=fused)


def correct_predictions(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """How many of the scored targets (≠ IGNORE_INDEX) are the argmax of their logits (…, V)."""
    keep = targets != IGNORE_INDEX
    return (logits.detach().argmax(-1)[keep] == targets[keep]).sum()


def summed_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Σ cross-entropy of logits (…, V) against targets (…) over the targets ≠ IGNORE_INDEX, in float32
    (float64 for float64 logits):
    the loss of a model's forward with targets (the training tasks divide by their count)."""
    if not isinstance(targets, torch.Tensor) or tuple(targets.shape) != tuple(logits.shape[:-1]):
        got = tuple(targets.shape) if isinstance(targets, torch.Tensor) else type(targets).__name__
        raise ValueError(f"targets must be a tensor of the logits' shape without V, {tuple(logits.shape[:-1])}, "
                         f"got {got}")
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction="sum")


def _packed_targets(ids: torch.Tensor, cu_seqlens: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Next-token targets of documents packed in ids (1, T): IGNORE_INDEX at each document's last token
    and, with a mask, where a token or the next one is padding."""
    bounds = packed.boundaries(cu_seqlens, batch=ids.shape[0], length=ids.shape[1])
    targets = torch.cat((ids[:, 1:], ids.new_full((ids.shape[0], 1), IGNORE_INDEX)), 1)
    last = torch.tensor([e - 1 for s, e in bounds if e > s], dtype=torch.long, device=ids.device)
    targets[:, last] = IGNORE_INDEX
    if mask is not None:
        nxt = torch.cat((mask[:, 1:], mask.new_zeros(mask.shape[0], 1)), 1)
        targets = targets.masked_fill(~(mask & nxt), IGNORE_INDEX)
    return targets


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
        causal_only = sorted({k for k in config.attention if KINDS[k].causal_only})
        if causal_only:
            raise ValueError(f"attention: the kind(s) {', '.join(causal_only)} are causal only; a "
                             "LinearTransformerEncoder (bidirectional) takes 'linear' and 'softmax' layers")
        super().__init__(config)
        self.head = Linear(config.d_model, config.num_classes)
        self._init_weights()

    def encode(self, ids: torch.Tensor, mask: torch.Tensor | None = None,
               positions: torch.Tensor | None = None) -> torch.Tensor:
        return self._trunk(ids, mask, positions=positions)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor | None = None, targets: torch.Tensor | None = None):
        """logits (B, num_classes); with targets (B,) class labels, (logits, Σ cross-entropy in float32)."""
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
        logits = self.head(pooled)
        return logits if targets is None else (logits, summed_cross_entropy(logits, targets))


def load_pretrained(directory, cls=None, *, config: ModelConfig | None = None, device="cpu", dtype=None):
    """Builds the model saved in `directory` and loads its weights (JSON + safetensors only).

    cls: the expected model class (None: the one recorded in config.json). config: an expected
    ModelConfig; if given and different, a CheckpointError lists the differing fields. dtype: the
    floating dtype of the model; None keeps the dtype the weights were saved in (a file holding
    several floating dtypes is refused), a torch dtype casts the floating tensors to it; integer
    buffers keep theirs. The config is checked against the weights file's header before the model
    is built (linattn.models.checkpoint.load_model).
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
    "IGNORE_INDEX",
    "LinearTransformerEncoder",
    "LinearTransformerLM",
    "ModelCache",
    "ModelConfig",
    "load_pretrained",
    "correct_predictions",
    "summed_cross_entropy",
]
