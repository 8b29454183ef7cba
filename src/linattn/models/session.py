"""One decoding run of a model: its cache, its fused step and the lifecycle they share (design §15.1).

A decoding run keeps a ModelCache between calls and, where the model allows it, a fused step
(linattn.models.decoding.FusedDecoder) whose plan reads and writes that cache in place. Generation
(linattn.models.generation: `generate`, `stream`), transformers' generate through linattn.hf's
LinattnCache (greedy, sampling, beam search) and linearize's decoding costs all run the same
lifecycle, owned here:

    session = DecodingSession(model, fused=None)     # a new ModelCache (or cache=... to continue one)
    logits = session.forward(ids (B, N), mask)       # the prefill, or any eager call: (B, N or 1, V)
    session.reserve(n)                               # n more tokens to come: room in the KV caches
    logits = session.step(tok (B,))                  # one token per row, fused or eager: (B, V)
    session.select_rows(index (B',))                 # beam search: rows gathered, the plan dropped

- The plan is built once, at the first step after the rows have settled (an eager call since the
  last row selection: beam search selects rows at every step, and a plan would not pay off), with
  room in the softmax layers' KV caches for the tokens `reserve` announced (none announced: as many
  as the context so far, at least 64); it is rebuilt when that room is used, and after an eager
  call or a row selection (both change the tensors it reads).
- `fused`: None takes the fused step where `fused_decoding_obstacle(model)` is None, True requires
  it (a ValueError here says why not), False never. With gradients enabled or the model in training
  mode the step is eager whatever `fused` says.
- `step` returns the logits of the new tokens (B, V); the fused step's are its buffer, which the
  next step overwrites (clone them to keep them).
"""

from __future__ import annotations

import dataclasses

import torch

from .._checks import check_bool
from ..nn.caches import first_tensor
from .decoding import FusedDecoder, fused_decoding_obstacle

#: KV room of a plan built without an announced number of tokens (at least; else the context so far)
_MIN_ROOM = 64


def select_rows(obj, index: torch.Tensor):
    """obj with dim 0 of every tensor it holds (dataclass fields, lists, tuples, nested) gathered at
    `index` (B',) long; tensors are replaced, not written in place; named tuples keep their class and
    their other fields (a WindowState's length). Every linattn cache tensor is batch-first."""
    if isinstance(obj, torch.Tensor):
        return obj.index_select(0, index.to(obj.device)) if obj.dim() else obj
    if isinstance(obj, tuple):  # a NamedTuple (WindowState, HybridState) keeps its type
        rows = (select_rows(t, index) for t in obj)
        return type(obj)(*rows) if hasattr(obj, "_fields") else tuple(rows)
    if isinstance(obj, list):
        obj[:] = [select_rows(t, index) for t in obj]
        return obj
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            setattr(obj, f.name, select_rows(getattr(obj, f.name), index))
    return obj


class DecodingSession:
    """The decoding run of `model` on `cache` (a ModelCache; None: a new one), see the module doc.

    Attributes: `model`, `cache`, `fused` (the policy, which a caller may change between calls) and
    `decoder` (the FusedDecoder of the current plan, or None)."""

    def __init__(self, model, cache=None, *, fused: bool | None = None):
        if fused is not None:
            check_bool("fused (None, True or False)", fused)
        if fused:
            obstacle = fused_decoding_obstacle(model)
            if obstacle is not None:
                raise ValueError(f"fused=True: {obstacle}")
        self.model = model
        self.cache = model.new_cache() if cache is None else cache
        self.fused = fused
        self.decoder: FusedDecoder | None = None
        self._room = 0  # fused steps the plan's KV caches have room for
        self._expected = 0  # tokens `reserve` announced that have not come yet
        self._steady = False  # an eager call since the last row selection

    def forward(self, ids: torch.Tensor, mask: torch.Tensor | None = None, *, last_only: bool = True) -> torch.Tensor:
        """The model's eager call on the cache (the prefill, or several tokens at once): logits (B, N, V),
        or (B, 1, V) with last_only. Rows as they are: the next step may build the plan."""
        self.decoder = None
        logits, _ = self.model(ids, mask, self.cache, last_only=last_only)
        self._steady = True
        return logits

    def reserve(self, tokens: int) -> None:
        """`tokens` more steps to come: the plan built next makes room for them in the KV caches."""
        self._expected = tokens
        if self.decoder is not None and self._room < tokens:
            self.decoder = None

    def step(self, tok: torch.Tensor) -> torch.Tensor:
        """tok (B,) (or (B, 1)) token ids -> logits (B, V) of the next tokens; advances the cache."""
        if self._fused_now():
            logits = self.decoder.step(tok)
            self._room -= 1
        else:
            logits = self.forward(tok.reshape(-1, 1), last_only=True)[:, -1]
        self._expected = max(self._expected - 1, 0)
        return logits

    def select_rows(self, index: torch.Tensor) -> None:
        """Keeps the rows `index` (B',) long of every state, tail, KV buffer and position counter (row i
        takes row index[i]'s); the plan is dropped and the next step is eager."""
        self.decoder, self._steady = None, False
        select_rows(self.cache, index)

    @property
    def batch_size(self) -> int:
        """The rows of the cache (−1 before the first call)."""
        t = first_tensor(self.cache.layers)
        return -1 if t is None else int(t.shape[0])

    def _fused_now(self) -> bool:
        """Whether this step runs through the plan (built here when it can be and is needed)."""
        if self.fused is False or torch.is_grad_enabled() or self.model.training:
            return False
        if self.decoder is not None and self._room > 0:
            return True
        if not self._steady or self.cache.length == 0 or fused_decoding_obstacle(self.model) is not None:
            return False
        room = self._expected or max(_MIN_ROOM, self.cache.length)
        self.decoder, self._room = FusedDecoder(self.model, self.cache, reserve=room), room
        return True


__all__ = ["DecodingSession", "first_tensor", "select_rows"]
