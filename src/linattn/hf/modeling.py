"""LinattnForCausalLM: a linattn LinearTransformerLM as a transformers causal LM (model_type "linattn").

    hf = LinattnForCausalLM.from_linattn(lm)           # wraps lm itself (no copy): same parameters
    lm = hf.to_linattn()                               # the LinearTransformerLM inside
    hf.save_pretrained(d); AutoModelForCausalLM.from_pretrained(d)   # config.json + model.safetensors

The wrapper holds the LinearTransformerLM as its submodule `model`, so its parameters are
linattn's own under the prefix "model." (model.tok_emb.weight, model.blocks.0.attn.qkv.weight, …)
and the logits are LinearTransformerLM's, bit for bit. forward(input_ids (B, N), attention_mask
(B, N) or (B, past + N), cache, labels, logits_to_keep) follows transformers' causal-LM
convention: labels are shifted inside (transformers' ForCausalLMLoss, −100 ignored), the cache is a
LinattnCache holding linattn's per-layer caches, and a left-padded batch is described by its
attention_mask (pads drop out of every numerator, denominator and KV cache, and positions count
from each row's first real token, as in linattn.models.generation).

Decoding steps of one real token per row, without gradients and in eval mode, run through
linattn's fused CPU step (linattn.models.decoding.FusedDecoder) where the model allows it and the rows
have not been reordered since the last step (beam search reorders them at every step and so takes
the eager step): the cache's linattn.models.session.DecodingSession decides, as it does for
linattn's own generate; `fused_decoding = False` on the model forces the eager step.

Loading refuses what linattn's own loader refuses: a checkpoint with tensors missing, unexpected or
of another shape (CheckpointError naming them), and a config.json without its `linattn` object.
"""

from __future__ import annotations

import contextlib
import copy
import json

import torch
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..models.checkpoint import CheckpointError
from ..models import LinearTransformerLM, ModelConfig
from ..ops import packed
from .cache import LinattnCache
from .config import LinattnConfig


class LinattnPreTrainedModel(PreTrainedModel):
    """Base class: LinattnConfig, no transformers re-initialization (linattn initializes its own
    modules, seeded by ModelConfig.seed; checkpoints hold every tensor)."""

    config_class = LinattnConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = True
    _no_split_modules = ["Block", "ConvMixerBlock"]
    _is_stateful = True

    def _init_weights(self, module):
        pass


class LinattnForCausalLM(LinattnPreTrainedModel, GenerationMixin):
    """A LinearTransformerLM inside transformers (see the module docstring).

    config: a LinattnConfig. model: an existing LinearTransformerLM to wrap (its config must equal
    config.model_config); None builds a new one from the config.
    """

    _tied_weights_keys = {"model.lm_head.weight": "model.tok_emb.weight"}

    def __init__(self, config: LinattnConfig, model: LinearTransformerLM | None = None):
        if not isinstance(config, LinattnConfig):
            raise TypeError(f"config must be a LinattnConfig, got {type(config).__name__}")
        super().__init__(config)
        # transformers' from_pretrained builds models under torch.device("meta"); linattn's config
        # checks and constructor compute values (seeded random features), so they run on the CPU
        meta = torch.empty(0).device.type == "meta"
        with torch.device("cpu") if meta else contextlib.nullcontext():
            mc = config.model_config
            if model is None:
                model = LinearTransformerLM(mc)
        if not isinstance(model, LinearTransformerLM):
            raise TypeError(f"model must be a linattn LinearTransformerLM, got {type(model).__name__}")
        elif model.config != mc:
            raise ValueError(f"model: its config differs from config.model_config in {sorted(model.config.diff(mc))}")
        self.model = model
        #: None: fused decoding steps where the model allows them; False: always the eager step
        self.fused_decoding: bool | None = None
        self.post_init()

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """transformers' from_pretrained, with linattn's loader's refusal: a checkpoint that lacks
        tensors of the model (transformers initializes them and only logs it; a tied embedding's
        absence it does not even report), holds tensors the model does not have, or tensors of other
        shapes raises a CheckpointError naming them. The names are checked against the safetensors
        files themselves where they are found. output_loading_info=True returns (model, info) as in
        transformers. A config.json without the `linattn` object is refused by LinattnConfig.from_dict."""
        want_info = kwargs.pop("output_loading_info", False)
        model, info = super().from_pretrained(pretrained_model_name_or_path, *args, output_loading_info=True, **kwargs)
        missing = set(info.get("missing_keys") or ())
        if kwargs.get("state_dict") is None:
            names = _checkpoint_names(pretrained_model_name_or_path, kwargs)
            if names is not None:
                missing |= set(_missing_from(model, names))
        parts = [f"{what} {_few(sorted(map(str, found)))}"
                 for found, what in ((missing, "missing tensors"), (info.get("unexpected_keys"), "unexpected tensors"),
                                     (info.get("mismatched_keys"), "tensors of another shape"))
                 if found]
        if parts:
            raise CheckpointError(f"{pretrained_model_name_or_path}: the checkpoint does not match the model of its "
                                  f"config: " + "; ".join(parts) + " (transformers would initialize the missing ones "
                                  "at random)")
        return (model, info) if want_info else model

    # ---- conversion
    @classmethod
    def from_linattn(cls, model: LinearTransformerLM, *, copy_model: bool = False, **config_kwargs):
        """A LinattnForCausalLM around `model` (the same module, sharing its parameters; a deep copy
        with copy_model=True). config_kwargs: further LinattnConfig arguments (pad_token_id, …)."""
        if not isinstance(model, LinearTransformerLM):
            raise TypeError(f"model must be a linattn LinearTransformerLM, got {type(model).__name__}")
        if copy_model:
            model = copy.deepcopy(model)
        dtype = next(model.parameters()).dtype
        config = LinattnConfig(linattn=model.config, dtype=dtype, **config_kwargs)
        hf = cls(config, model=model)
        hf.train(model.training)
        return hf

    def to_linattn(self, *, copy_model: bool = False) -> LinearTransformerLM:
        """The LinearTransformerLM inside (the same module; a deep copy with copy_model=True)."""
        return copy.deepcopy(self.model) if copy_model else self.model

    @property
    def model_config(self) -> ModelConfig:
        return self.model.config

    def get_input_embeddings(self):
        return self.model.tok_emb

    def set_input_embeddings(self, value):
        self.model.tok_emb = value

    def get_output_embeddings(self):
        return self.model.lm_head

    def set_output_embeddings(self, value):
        self.model.lm_head = value

    def new_cache(self) -> LinattnCache:
        """An empty LinattnCache for this model."""
        return LinattnCache(self.model.new_cache(), self.config.layer_types)

    # ---- activation checkpointing (transformers' names)
    def activation_checkpointing_enable(self, activation_checkpointing_kwargs=None, every_n_layers: int = 1,
                                        offload: bool = False):
        """transformers' activation checkpointing (what Trainer(gradient_checkpointing=True) calls) on
        linattn's blocks: LinearTransformerLM.set_activation_checkpointing, every `every_n_layers`-th
        block, torch.utils.checkpoint non-reentrant. activation_checkpointing_kwargs may hold
        use_reentrant=False only; use_reentrant=True and offload=True are refused by name."""
        options = dict(activation_checkpointing_kwargs or {})
        if options.pop("use_reentrant", False) is not False:
            raise ValueError("activation_checkpointing_kwargs: use_reentrant=True is not supported; linattn checkpoints "
                             "its blocks non-reentrant (use_reentrant=False)")
        if options:
            raise ValueError(f"activation_checkpointing_kwargs: linattn takes use_reentrant=False only, got "
                             f"{sorted(options)}")
        if offload:
            raise ValueError("offload=True is not supported: linattn keeps the checkpointed blocks' inputs where the "
                             "model is")
        self.model.set_activation_checkpointing(True, every_n_layers=every_n_layers)

    def activation_checkpointing_disable(self):
        self.model.set_activation_checkpointing(False)

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None, **kwargs):
        """transformers' older name of activation_checkpointing_enable."""
        self.activation_checkpointing_enable(gradient_checkpointing_kwargs, **kwargs)

    def gradient_checkpointing_disable(self):
        self.activation_checkpointing_disable()

    @property
    def is_activation_checkpointing(self) -> bool:
        return self.model.activation_checkpointing

    @property
    def is_gradient_checkpointing(self) -> bool:
        return self.model.activation_checkpointing

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # forward makes its own LinattnCache

    # ---- forward
    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                cache: LinattnCache | None = None, inputs_embeds: torch.Tensor | None = None,
                labels: torch.LongTensor | None = None, use_cache: bool | None = None,
                logits_to_keep: int | torch.Tensor = 0, output_hidden_states: bool | None = None,
                output_attentions: bool | None = None, return_dict: bool | None = None, **kwargs):
        """input_ids (B, N) -> CausalLMOutputWithPast(loss, logits (B, N or kept, V), cache).

        attention_mask: (B, N), or (B, past + N) with a cache (its last N columns describe the new
        tokens), 1 = real token; left padding only. cache: also taken as `past_key_values`, its name
        before transformers 5. logits_to_keep: 0 = every position, k > 0 the
        last k, or a 1-D tensor of positions. position_ids (in kwargs) are taken without a cache
        (linattn's positions, e.g. for a shard); with a cache the positions are counted by it, from
        each row's first real token, as transformers counts them. Packed rows (DataCollatorWithFlattening:
        batch 1, position_ids restarting at each document, or its cu_seq_lens_q) run as packed
        documents (LinearTransformerLM's cu_seqlens: nothing crosses a boundary), without a cache.
        """
        if inputs_embeds is not None:
            raise ValueError("inputs_embeds: LinattnForCausalLM takes input_ids only")
        if output_attentions or output_hidden_states:
            raise ValueError("output_attentions / output_hidden_states: not available for linattn models")
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise ValueError(f"input_ids must be a (B, N) integer tensor, got {input_ids!r:.80}")
        position_ids = kwargs.pop("position_ids", None)
        if kwargs.get("past_key_values") is not None:  # transformers' older name of `cache`
            if cache is not None:
                raise ValueError("pass the cache as `cache` or as `past_key_values`, not both")
            cache = kwargs.pop("past_key_values")
        kwargs.pop("past_key_values", None)
        cu_seqlens = _documents(kwargs, position_ids if input_ids.shape[0] == 1 else None)
        return_dict = self.config.return_dict if return_dict is None else return_dict
        if use_cache is None:
            use_cache = self.config.use_cache and not self.training and cu_seqlens is None
        if cache is not None and not isinstance(cache, LinattnCache):
            raise TypeError(f"cache must be a LinattnCache (LinattnForCausalLM.new_cache()), got {type(cache).__name__}")
        if cu_seqlens is not None and (cache is not None or use_cache):
            raise ValueError("packed rows (position_ids restarting inside the row, or cu_seq_lens_q) take no cache: "
                             "pass use_cache=False, or one document per row to decode")
        if cache is None and use_cache:
            cache = self.new_cache()
        mask = _new_token_mask(attention_mask, input_ids)
        n = input_ids.shape[1]
        if cache is not None:
            if position_ids is not None and mask is None and cache.model_cache.seen is None:
                _check_contiguous_positions(position_ids, cache.model_cache.length, n)
            session = cache.session(self.model)
            session.fused = self.fused_decoding
            if n == 1 and mask is None and labels is None:  # a step: fused where the session can
                logits = session.step(input_ids[:, 0]).clone()[:, None]
            else:
                logits = session.forward(input_ids, mask, last_only=_keep_last(logits_to_keep, labels))
        else:
            positions = None
            if position_ids is not None:
                positions = _positions(position_ids, input_ids, packed=cu_seqlens is not None)
            logits, _ = self.model(input_ids, mask, positions=positions, last_only=_keep_last(logits_to_keep, labels),
                                   cu_seqlens=None if cu_seqlens is None else cu_seqlens.to(input_ids.device))
        logits = _slice_logits(logits, logits_to_keep, labels)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        if not return_dict:
            return tuple(v for v in (loss, logits, cache) if v is not None)
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=cache)


def _few(items: list, n: int = 8) -> list:
    return items if len(items) <= n else [*items[:n], f"... and {len(items) - n} more"]


#: from_pretrained's keywords that say where its files are (transformers.utils.cached_file's)
_HUB_KEYS = ("cache_dir", "force_download", "proxies", "local_files_only", "token", "revision", "subfolder")


def _checkpoint_names(path, kwargs: dict) -> set[str] | None:
    """The tensor names of the safetensors checkpoint at `path` (a folder or a hub id, one file or an
    index of shards); None where it has none (another format: transformers' report stands alone)."""
    from safetensors import safe_open
    from transformers.utils import cached_file

    hub = {k: kwargs[k] for k in _HUB_KEYS if k in kwargs}
    found = {name: cached_file(path, name, _raise_exceptions_for_missing_entries=False, **hub)
             for name in ("model.safetensors.index.json", "model.safetensors")}
    if found["model.safetensors.index.json"]:
        with open(found["model.safetensors.index.json"], encoding="utf-8") as f:
            return set(json.load(f)["weight_map"])
    if found["model.safetensors"]:
        with safe_open(found["model.safetensors"], "pt") as f:
            return set(f.keys())
    return None


def _missing_from(model: torch.nn.Module, names: set[str]) -> list[str]:
    """State-dict names of `model` absent from `names`; tied tensors (one parameter under several
    names) count as present when any of their names is."""
    groups: dict[int, list[str]] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(t), []).append(name)
    return [g[0] for g in groups.values() if not any(n in names for n in g)]


def _new_token_mask(attention_mask, input_ids) -> torch.Tensor | None:
    """The bool key-padding mask (B, N) of the new tokens (None: all real)."""
    if attention_mask is None:
        return None
    b, n = input_ids.shape
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2 or attention_mask.shape[0] != b \
            or attention_mask.shape[1] < n:
        got = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask).__name__
        raise ValueError(f"attention_mask must be a 2-D (B={b}, ≥ N={n}) tensor of 0/1, got {got}")
    mask = attention_mask[:, -n:].bool()
    return None if bool(mask.all()) else mask


def _keep_last(logits_to_keep, labels) -> bool:
    return labels is None and isinstance(logits_to_keep, int) and logits_to_keep == 1


def _slice_logits(logits: torch.Tensor, logits_to_keep, labels) -> torch.Tensor:
    if labels is not None or (isinstance(logits_to_keep, int) and logits_to_keep in (0, 1)):
        return logits
    if isinstance(logits_to_keep, int):
        if logits_to_keep < 0:
            raise ValueError(f"logits_to_keep must be ≥ 0, got {logits_to_keep}")
        return logits[:, -logits_to_keep:]
    if not isinstance(logits_to_keep, torch.Tensor) or logits_to_keep.dim() != 1 \
            or logits_to_keep.is_floating_point() or logits_to_keep.is_complex():
        raise ValueError(f"logits_to_keep must be an int or a 1-D integer tensor of positions, got "
                         f"{logits_to_keep!r:.80}")
    n = logits.shape[1]
    if logits_to_keep.numel() and not (-n <= int(logits_to_keep.min()) and int(logits_to_keep.max()) < n):
        raise ValueError(f"logits_to_keep: positions must lie in [-{n}, {n}) (the {n} logits of this call), got "
                         f"{logits_to_keep.tolist()!r:.80}")
    return logits[:, logits_to_keep.to(logits.device)]


def _documents(kwargs: dict, position_ids) -> torch.Tensor | None:
    """cu_seqlens of a packed row: DataCollatorWithFlattening's cu_seq_lens_q, or the documents of
    position_ids (1, T) restarting at each (linattn.ops.packed); None for unpacked rows. Pops the
    flash-attention keywords (they are not the loss function's)."""
    cu = kwargs.pop("cu_seq_lens_q", None)
    for key in ("cu_seq_lens_k", "max_length_q", "max_length_k"):
        kwargs.pop(key, None)
    if cu is None:
        return packed.cu_seqlens_from_position_ids(position_ids)
    return torch.as_tensor(cu).long()


def _positions(position_ids: torch.Tensor, input_ids: torch.Tensor, packed: bool = False) -> torch.Tensor:
    """transformers' position_ids (B, N) or (1, N) as linattn's positions; positions restarting
    inside a row are refused unless the row is packed (batch 1, cu_seqlens)."""
    b, n = input_ids.shape
    if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2 or position_ids.shape[1] != n \
            or position_ids.shape[0] not in (1, b):
        got = tuple(position_ids.shape) if isinstance(position_ids, torch.Tensor) else type(position_ids).__name__
        raise ValueError(f"position_ids must have shape (B={b}, N={n}) or (1, N), got {got}")
    if not packed and n > 1 and bool((position_ids[:, 1:] < position_ids[:, :-1]).any()):
        raise ValueError("position_ids restart inside a row of a batch of several rows: packed documents go in one "
                         "row (batch 1, as DataCollatorWithFlattening makes them), or one document per row")
    return position_ids[0] if position_ids.shape[0] == 1 else position_ids


def _check_contiguous_positions(position_ids, start: int, n: int) -> None:
    if isinstance(position_ids, torch.Tensor) and position_ids.shape[-1] == n:
        expect = torch.arange(start, start + n, device=position_ids.device)
        if not bool((position_ids == expect).all()):
            raise ValueError(f"position_ids: with a cache the positions are counted by it ({start} … {start + n - 1} "
                             "here); other positions are not supported")


__all__ = ["LinattnForCausalLM", "LinattnPreTrainedModel"]
