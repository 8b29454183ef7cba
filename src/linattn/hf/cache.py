"""LinattnCache: a transformers Cache that holds a linattn ModelCache (design §8).

transformers' generate() keeps one Cache object across the prefill and the decoding steps and, for
beam search and contrastive batching, selects and reorders its batch rows. LinattnCache carries
linattn's own per-layer caches unchanged — the (kv, z) state of linear layers, the state S of gated
and delta-rule layers, the short-convolution and gated-convolution tails (B, K−1, C), the growing
K/V buffers of softmax layers, and the position counters of left-padded rows — so that
LinattnForCausalLM runs LinearTransformerLM's own prefill and step on them, through the run's
linattn.models.session.DecodingSession: it keeps the fused CPU decoding step (linattn.models.decoding.
FusedDecoder) built for the current batch between steps and drops it after any eager call or row
selection, since the plan reads the cache's buffers in place.

Row selection (reorder_cache(beam_idx), batch_select_indices, batch_repeat_interleave) gathers
dim 0 of every tensor of every layer cache (linattn.models.session.select_rows): every linattn cache
tensor is batch-first.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from ..models import ModelCache
from ..models.session import DecodingSession, first_tensor, select_rows


class LinattnCache(Cache):
    """The decoding cache of a LinattnForCausalLM: `model_cache`, a linattn ModelCache (one entry per
    block), and `layer_types` ("linear_attention" / "full_attention" per layer, transformers' words).

    get_seq_length() is the number of tokens fed so far (pads included, as transformers counts
    them). crop is not supported (a recurrent state cannot be rolled back), except crop(0).
    """

    def __init__(self, model_cache: ModelCache, layer_types: list[str]):
        if not isinstance(model_cache, ModelCache):
            raise TypeError(f"model_cache must be a linattn ModelCache, got {type(model_cache).__name__}")
        if len(layer_types) != len(model_cache.layers):
            raise ValueError(f"layer_types has {len(layer_types)} entries for {len(model_cache.layers)} layers")
        super().__init__(layers=[])
        self.model_cache = model_cache
        self.layer_types = list(layer_types)
        self._session: DecodingSession | None = None

    def session(self, model) -> DecodingSession:
        """The decoding run of `model` (a LinearTransformerLM) on this cache (made at the first call)."""
        if self._session is None or self._session.model is not model:
            self._session = DecodingSession(model, self.model_cache)
        return self._session

    @property
    def decoder(self):
        """The fused decoding step of the current rows (a FusedDecoder), or None."""
        return None if self._session is None else self._session.decoder

    # ---- what transformers asks of a cache
    def __len__(self) -> int:
        return len(self.layer_types)

    def __repr__(self) -> str:
        return f"LinattnCache(length={self.model_cache.length}, layers={self.layer_types})"

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.model_cache.length

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.model_cache.length + query_length, 0

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        return self.model_cache.length > 0

    @property
    def is_linear(self) -> list[bool]:
        return [t == "linear_attention" for t in self.layer_types]

    @property
    def is_sliding(self) -> list[bool]:
        return [False] * len(self.layer_types)

    @property
    def is_dummy(self) -> list[bool]:
        return [False] * len(self.layer_types)

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_croppable(self) -> bool:
        return False

    @property
    def is_initialized(self) -> bool:
        return self.model_cache.length > 0

    @property
    def batch_size(self) -> int:
        t = first_tensor(self.model_cache.layers)
        return -1 if t is None else int(t.shape[0])

    def activate_past_recording(self):
        pass

    # ---- rows
    def batch_select_indices(self, indices: torch.Tensor):
        """Keeps the rows `indices` (B',) of every state, tail, KV buffer and position counter."""
        if not isinstance(indices, torch.Tensor) or indices.dim() != 1:
            raise ValueError(f"indices must be a 1-D tensor of row indices, got {indices!r}")
        if self._session is None:
            select_rows(self.model_cache, indices.long())
        else:
            self._session.select_rows(indices.long())

    def reorder_cache(self, beam_idx: torch.LongTensor):
        """Beam search: row i takes the cache of row beam_idx[i]."""
        self.batch_select_indices(beam_idx)

    def batch_repeat_interleave(self, repeats: int):
        """Each row repeated `repeats` times in place (row i → rows i·repeats … i·repeats + repeats − 1)."""
        b = self.batch_size
        if b < 0:
            return
        self.batch_select_indices(torch.arange(b).repeat_interleave(repeats))

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise ValueError("LinattnCache cannot be cropped: a recurrent state holds no per-token history")

    def reset(self):
        raise ValueError("LinattnCache cannot be reset in place; start a new one (LinattnForCausalLM.new_cache())")

    def offload(self, *args, **kwargs):
        pass

    def prefetch(self, *args, **kwargs):
        pass


__all__ = ["LinattnCache"]
