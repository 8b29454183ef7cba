"""What every data module shares: IGNORE_INDEX, the batch types, seeds and generators."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, fields

import torch

from ..._checks import check_int
from ...models.lm import IGNORE_INDEX  # the target that counts neither for the loss nor for the accuracy

__all__ = ["ClassificationBatch", "IGNORE_INDEX", "TaskBatch", "mix_seed"]


# ----------------------------------------------------------------------------------------------
# Small helpers
# ----------------------------------------------------------------------------------------------


def check_lengths(min_len, max_len, *, max_len_minimum: int = 1) -> None:
    """A task's range of lengths: ints min_len >= 1, max_len >= max_len_minimum, min_len <= max_len."""
    check_int("min_len", min_len, minimum=1)
    check_int("max_len", max_len, minimum=max_len_minimum)
    if min_len > max_len:
        raise ValueError(f"min_len ({min_len}) must be <= max_len ({max_len})")


def _generator(seed: int | None, generator: torch.Generator | None) -> torch.Generator | None:
    """The generator to draw from: ``generator`` as is, a fresh one seeded with ``seed``, or
    ``None`` (torch's global RNG) when neither is given."""
    if seed is not None and generator is not None:
        raise ValueError("pass either seed or generator, not both")
    if generator is not None:
        if not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
        if generator.device.type != "cpu":
            raise ValueError(f"generator must be a CPU generator, got one on {generator.device}")
        return generator
    if seed is not None:
        check_int("seed", seed, error=TypeError)
        return torch.Generator().manual_seed(seed)
    return None


def mix_seed(*parts: int | str) -> int:
    """A 63-bit seed derived from ints and strings (BLAKE2b of their repr); distinct tuples give
    unrelated seeds. The one seed mixer of linattn: data streams, task batches and per-step RNGs."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1



# ----------------------------------------------------------------------------------------------
# Batches of synthetic tasks
# ----------------------------------------------------------------------------------------------


@dataclass
class TaskBatch:
    """A batch of a next-token task.

    ``inputs``: ``(n, T)`` long token ids. ``targets``: ``(n, T)`` long, the token to predict
    after each position, :data:`IGNORE_INDEX` where the position counts neither for the loss
    nor the accuracy (so ``F.cross_entropy(logits.flatten(0, 1), targets.flatten())`` works
    as is). ``vocab_size``: the number of token ids.
    """

    inputs: torch.Tensor
    targets: torch.Tensor
    vocab_size: int

    @property
    def loss_mask(self) -> torch.Tensor:
        """``(n, T)`` bool, True where the position is scored."""
        return self.targets != IGNORE_INDEX

    def to(self, device) -> "TaskBatch":
        return TaskBatch(self.inputs.to(device), self.targets.to(device), self.vocab_size)


@dataclass
class ClassificationBatch:
    """A batch of a sequence classification task.

    ``inputs``: ``(n, T)`` long token ids, right-padded. ``mask``: ``(n, T)`` bool, True for
    real tokens (CLS included), False for padding. ``labels``: ``(n,)`` long in
    ``[0, num_classes)``. ``cls_index``: ``(n,)`` long, the position of the CLS token in each row
    (read the classifier from there, or pool over ``mask``). ``vocab_size``, ``num_classes``:
    sizes for the embedding and the output layer.
    """

    inputs: torch.Tensor
    mask: torch.Tensor
    labels: torch.Tensor
    cls_index: torch.Tensor
    vocab_size: int
    num_classes: int

    def to(self, device) -> "ClassificationBatch":
        return ClassificationBatch(
            **{f.name: (getattr(self, f.name).to(device) if isinstance(getattr(self, f.name), torch.Tensor)
                        else getattr(self, f.name)) for f in fields(self)}
        )


