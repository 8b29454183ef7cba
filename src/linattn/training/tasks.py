"""Training tasks: what a run learns, the model that learns it, and the loss.

A task turns a step number into a global batch (a function of (seed, step) only, so a resumed run
sees exactly the batches an uninterrupted one would), holds fixed validation data, fills the
task's sizes into the model config, builds the model and scores it:

    BytesTask     byte-level LM on a text corpus (vocabulary 256)      -> LinearTransformerLM
    CopyTask      the copy task (linattn.training.data.copy_task)               -> LinearTransformerLM
    MqarTask      multi-query associative recall (data.mqar_task)      -> LinearTransformerLM
    ListOpsTask   ListOps classification (data.listops_task)           -> LinearTransformerEncoder

Each class is built from plain values; `from_config` reads them from a TrainConfig. Building a task
loads no data: a byte corpus is read on first use (or by `load_data`), a generated task checks its
options with one draw of a single example.

The loss of a batch is the model's (its forward with `targets`, linattn.models.lm.summed_cross_entropy):
Σ cross-entropy over the scored targets in float32 (LM targets already shifted, IGNORE_INDEX where
not scored; ListOps: one label per sequence); the task adds the count of correct predictions.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

from . import data as D, packing as P
from ..models.checkpoint import CheckpointError
from .data import mix_seed
from ..models.lm import LinearTransformerEncoder, LinearTransformerLM, ModelConfig, correct_predictions

_CORPUS_CACHE: dict = {}


def _corpus(paths, max_bytes, val_fraction) -> D.Corpus:
    """The byte corpus, read once per process (one corpus kept in memory)."""
    key = (tuple(paths) if paths else None, max_bytes, val_fraction)
    if key not in _CORPUS_CACHE:
        _CORPUS_CACHE.clear()
        _CORPUS_CACHE[key] = D.Corpus.load(paths, max_bytes=max_bytes, val_fraction=val_fraction)
    return _CORPUS_CACHE[key]


def autocast(device: torch.device, dtype: str):
    """bf16 autocast on `device` for dtype "bfloat16", nothing for "float32"."""
    if dtype == "bfloat16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


class Task:
    """A task's data and loss. Global batch `step` is a function of (seed, step) only.

    Subclasses set `name`, `vocab_size`, `seq_len` (the model's sequence length) and, for
    classification, `num_classes`; they implement train_batch and validation_batches.
    """

    name = ""
    num_classes: int | None = None
    vocab_size: int
    seq_len: int
    #: losses are per byte: metrics add bits per byte, plots show bits
    bits = False
    #: a sequence can be split over processes (sequence parallelism; LM tasks)
    shards_sequences = False

    def __init__(self, *, batch_size: int, seed: int, eval_batch_size: int | None = None):
        self.batch_size, self.seed = batch_size, seed
        self.eval_batch_size = eval_batch_size or batch_size

    # ---- the model this task trains
    def model_config(self, fields: dict, seed: int) -> ModelConfig:
        """ModelConfig from `fields` with the task's defaults filled in (vocab_size, max_len = the
        task's sequence length, seed, num_classes), checked against the task's sizes."""
        d = dict(fields)
        d.setdefault("vocab_size", self.vocab_size)
        d.setdefault("max_len", self.seq_len)
        d.setdefault("seed", seed)
        if self.num_classes is not None:
            d.setdefault("num_classes", self.num_classes)
        try:
            mc = ModelConfig.from_dict(d)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"model: {exc}") from None
        if mc.vocab_size < self.vocab_size:
            raise ValueError(f"model.vocab_size={mc.vocab_size} is smaller than the {self.name} task's vocabulary "
                             f"({self.vocab_size} token ids)")
        if self.num_classes is not None and mc.num_classes != self.num_classes:
            raise ValueError(f"model.num_classes={mc.num_classes} but the {self.name} task has "
                             f"{self.num_classes} classes")
        kernels = {"short_conv": mc.short_conv, "conv_mixer_kernel": mc.conv_mixer_kernel if mc.block == "conv_mixer"
                   else None}
        for name, kernel in kernels.items():
            if kernel is not None and kernel > self.seq_len:
                raise ValueError(f"model.{name}={kernel} is longer than the {self.name} task's sequences "
                                 f"({self.seq_len} tokens): no sequence can use such a kernel; pass one <= {self.seq_len}")
        if mc.max_positions is not None and mc.max_positions < self.seq_len:
            raise ValueError(f"the model takes at most {mc.max_positions} positions (max_len) but the {self.name} task "
                             f"has sequences of {self.seq_len} tokens; raise model.max_len")
        return mc

    def build_model(self, config: ModelConfig) -> nn.Module:
        raise NotImplementedError

    # ---- data
    def load_data(self) -> None:
        """Reads what the task needs from disk now (errors early); nothing for generated tasks."""

    def describe(self) -> str:
        raise NotImplementedError

    def train_batch(self, step: int):
        """The global batch of optimizer step `step` (0-based), on the CPU."""
        raise NotImplementedError

    def validation_batches(self, batch_size: int):
        """The fixed validation data in batches of at most `batch_size`."""
        raise NotImplementedError

    def data_state(self, step: int) -> dict:
        """The data position after `step` optimizer steps (stored in a checkpoint)."""
        return {"task": self.name, "step": step, "seed": self.seed}

    def check_data_state(self, state: dict, step: int) -> None:
        """Takes a checkpoint's data position; CheckpointError when it belongs to another task or step."""
        if not isinstance(state, dict) or state.get("task") != self.name:
            got = state.get("task") if isinstance(state, dict) else state
            raise CheckpointError(f"checkpoint data position is for task {got!r}, this run trains {self.name!r}")
        if int(state.get("step", -1)) != step:
            raise CheckpointError(f"checkpoint data position {state.get('step')} != its step {step}")

    # ---- loss
    def tokens(self, batch) -> int:
        return int(batch.inputs.numel())

    def scored(self, batch) -> int:
        """The number of targets the loss of `batch` sums over."""
        raise NotImplementedError

    def loss_stats(self, model: nn.Module, batch, positions=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(Σ cross-entropy over scored targets (float32, differentiable), number correct)."""
        raise NotImplementedError

    def rows(self, batch, start: int, end: int):
        """Rows [start, end) of a batch."""
        raise NotImplementedError

    def metrics(self, loss: float, correct: int, count: int) -> dict:
        """Validation metrics from the summed loss, the correct predictions and the scored count."""
        out = {"loss": loss, "accuracy": correct / max(count, 1), "count": count}
        if self.bits:
            out["bpb"] = loss / math.log(2)
        return out


class LMTask(Task):
    """Next-token prediction with a decoder LM; batches are data.TaskBatch."""

    shards_sequences = True

    def build_model(self, config: ModelConfig) -> nn.Module:
        return LinearTransformerLM(config)

    def scored(self, batch) -> int:
        return int((batch.targets != D.IGNORE_INDEX).sum())

    def loss_stats(self, model, batch, positions=None):
        if isinstance(batch, P.PackedBatch):  # the rows as one row of packed documents
            targets = batch.targets.reshape(1, -1)
            correct, loss = model(batch.inputs.reshape(1, -1), cu_seqlens=batch.cu_seqlens(), targets=targets,
                                  return_logits=False)
        else:
            correct, loss = model(batch.inputs, positions=positions, targets=batch.targets, return_logits=False)
        return loss, correct

    def rows(self, batch, start, end):
        if isinstance(batch, P.PackedBatch):
            return batch.rows(start, end)
        return D.TaskBatch(batch.inputs[start:end], batch.targets[start:end], batch.vocab_size)

    def columns(self, batch, start: int, end: int):
        """Tokens [start, end) of every sequence (inputs and their already-shifted targets): a
        sequence-parallel shard."""
        return D.TaskBatch(batch.inputs[:, start:end], batch.targets[:, start:end], batch.vocab_size)


class BytesTask(LMTask):
    """Byte-level language modelling on a corpus (None: the Python standard library): random
    windows of seq_len + 1 bytes (data.ByteLMBatches), validation on the first `eval_batches`
    batches of consecutive windows of the held-out part. Metrics add bpb = loss / ln 2. With
    packing (training.packing), the same windows with the documents (files) kept apart."""

    name = "bytes"
    vocab_size = 256
    bits = True

    def __init__(self, *, seq_len: int, batch_size: int, seed: int, eval_batches: int, corpus=None,
                 corpus_max_bytes: int | None = None, val_fraction: float = 0.05, eval_batch_size=None,
                 packing: bool = False):
        super().__init__(batch_size=batch_size, seed=seed, eval_batch_size=eval_batch_size)
        self.seq_len, self.eval_batches, self.packing = seq_len, eval_batches, bool(packing)
        self.paths, self.max_bytes, self.val_fraction = corpus, corpus_max_bytes, val_fraction
        self._stream = None

    @classmethod
    def from_config(cls, cfg) -> "BytesTask":
        if cfg.task_options:
            raise ValueError(f"task 'bytes' takes no task_options (use corpus, seq_len), got {cfg.task_options}")
        return cls(seq_len=cfg.seq_len, batch_size=cfg.batch_size, seed=cfg.seed, eval_batches=cfg.eval_batches,
                   corpus=cfg.corpus, corpus_max_bytes=cfg.corpus_max_bytes, val_fraction=cfg.val_fraction,
                   eval_batch_size=cfg.eval_batch_size,
                   packing=cfg.sequence_parallel == 1 if cfg.packing is None else cfg.packing)

    @property
    def corpus(self) -> D.Corpus:
        return _corpus(self.paths, self.max_bytes, self.val_fraction)

    @property
    def stream(self) -> D.ByteLMBatches:
        if self._stream is None:
            self._stream = D.ByteLMBatches(self.corpus.train, self.seq_len, self.batch_size, seed=self.seed)
        return self._stream

    def load_data(self) -> None:
        self.stream  # noqa: B018 - reads the corpus

    def describe(self) -> str:
        return self.corpus.describe() + ("; documents (files) packed into full rows" if self.packing else "")

    def train_batch(self, step):
        if self.packing:
            return P.packed_stream_batch(self.stream, step, P.split_starts(self.corpus, "train"))
        x, y = self.stream.batch(step)
        return D.TaskBatch(x, y, 256)

    def validation_batches(self, batch_size):
        if self.packing:
            yield from P.packed_eval_batches(self.corpus.validation, self.seq_len, batch_size,
                                             P.split_starts(self.corpus, "validation"), self.eval_batches)
            return
        for x, y in D.eval_batches(self.corpus.validation, self.seq_len, batch_size, max_batches=self.eval_batches):
            yield D.TaskBatch(x, y, 256)

    def data_state(self, step):
        self.stream.step = step
        return {"task": self.name, **self.stream.state_dict()}

    def check_data_state(self, state, step):
        if isinstance(state, dict) and state.get("task") == self.name:
            try:
                self.stream.load_state_dict(state)
            except (KeyError, ValueError) as exc:
                raise CheckpointError(f"checkpoint data position does not fit this corpus: {exc}") from None
        super().check_data_state(state, step)


class _GeneratedTask:
    """Data drawn by a generator of linattn.training.data: training batch `step` from the seed
    mix_seed(seed, "train", step), a fixed validation set of `eval_samples` examples from
    mix_seed(seed, "validation"). `options` go to the generator over `defaults`."""

    generate = None  # a linattn.training.data generator: (n, **options, seed) -> batch
    defaults: dict = {}

    @staticmethod
    def sizes(options: dict) -> tuple[int, int]:
        """(vocab_size, seq_len) of the task's examples under `options`."""
        raise NotImplementedError

    def __init__(self, options: dict | None = None, *, batch_size: int, seed: int, eval_samples: int,
                 eval_batch_size: int | None = None):
        super().__init__(batch_size=batch_size, seed=seed, eval_batch_size=eval_batch_size)
        self.options = {**self.defaults, **(options or {})}
        self.eval_samples = eval_samples
        try:  # check the options with one tiny draw
            self._draw(1, 0)
        except TypeError as exc:
            raise ValueError(f"task_options for {self.name!r}: {exc}") from None
        except (ValueError, RuntimeError) as exc:
            raise ValueError(f"task_options for {self.name!r} ({self.options}): {exc}") from None
        self.vocab_size, self.seq_len = self.sizes(self.options)
        self._validation = None

    @classmethod
    def from_config(cls, cfg):
        return cls(cfg.task_options, batch_size=cfg.batch_size, seed=cfg.seed, eval_samples=cfg.eval_samples,
                   eval_batch_size=cfg.eval_batch_size)

    def _draw(self, n: int, seed: int):
        return self.generate(n, **self.options, seed=seed)

    def describe(self) -> str:
        return f"{self.name} task {self.options}"

    def train_batch(self, step):
        return self._draw(self.batch_size, mix_seed(self.seed, "train", step))

    def validation_batches(self, batch_size):
        if self._validation is None:
            self._validation = self._draw(self.eval_samples, mix_seed(self.seed, "validation"))
        for i in range(0, self.eval_samples, batch_size):
            yield self.rows(self._validation, i, i + batch_size)


class CopyTask(_GeneratedTask, LMTask):
    """The copy task: symbols, a separator, the symbols again; scored on the copy."""

    name = "copy"
    generate = staticmethod(D.copy_task)
    defaults = {"max_len": 32, "n_symbols": 10, "min_len": 1}
    sizes = staticmethod(lambda options: (options["n_symbols"] + 2, 2 * options["max_len"] + 1))


class MqarTask(_GeneratedTask, LMTask):
    """Multi-query associative recall; scored at the query positions."""

    name = "mqar"
    generate = staticmethod(D.mqar_task)
    defaults = {"seq_len": 64, "n_pairs": 4, "vocab_size": 8192}
    sizes = staticmethod(lambda options: (options["vocab_size"], options["seq_len"]))

    def loss_stats(self, model, batch, positions=None):
        """As LMTask's, with logits computed only at the query positions (Zoology's cheap logits: P =
        n_pairs rows of (B, P, V) instead of (B, N, V)). Every MQAR row has exactly n_pairs scored
        targets, so their indices form a (B, P) tensor for model(..., logits_at=); a sequence-parallel
        shard whose rows hold different numbers of them takes LMTask's full-logits path."""
        keep = batch.targets != D.IGNORE_INDEX
        per_row = keep.sum(dim=1)
        if per_row.numel() == 0 or bool((per_row != per_row[0]).any()):
            return super().loss_stats(model, batch, positions)
        index = keep.nonzero()[:, 1].view(keep.shape[0], -1)  # nonzero is row-major: each row's in order
        targets = batch.targets.gather(1, index)
        correct, loss = model(batch.inputs, positions=positions, logits_at=index, targets=targets, return_logits=False)
        return loss, correct


class ListOpsTask(_GeneratedTask, Task):
    """ListOps: the value (0-9) of a nested expression, by an encoder with a pooled head;
    batches are data.ClassificationBatch."""

    name = "listops"
    generate = staticmethod(D.listops_task)
    defaults = {"max_depth": 4, "max_args": 5, "min_len": 8, "max_len": 64}
    vocab_size = len(D.LISTOPS_TOKENS)
    num_classes = 10

    sizes = staticmethod(lambda options: (len(D.LISTOPS_TOKENS), options["max_len"] + 1))

    def build_model(self, config):
        return LinearTransformerEncoder(config)

    def scored(self, batch):
        return int(batch.labels.numel())

    def loss_stats(self, model, batch, positions=None):
        logits, loss = model(batch.inputs, batch.mask, targets=batch.labels)
        return loss, correct_predictions(logits, batch.labels)

    def rows(self, batch, start, end):
        return D.ClassificationBatch(batch.inputs[start:end], batch.mask[start:end], batch.labels[start:end],
                                     batch.cls_index[start:end], batch.vocab_size, batch.num_classes)


#: The tasks a TrainConfig names, by name.
TASK_CLASSES = {cls.name: cls for cls in (BytesTask, CopyTask, MqarTask, ListOpsTask)}


@torch.no_grad()
def evaluate(model: nn.Module, task: Task, *, batch_size: int | None = None, device=None,
             dtype: str = "float32") -> dict:
    """Validation metrics of `model` on the task's fixed validation data.

    LM tasks: loss (mean cross-entropy in nats over scored targets) and accuracy (argmax equals the
    target, over scored targets: the copied half for copy, the query positions for MQAR); the
    bytes task adds bpb = loss / ln 2 (bits per byte). ListOps: loss and accuracy over sequences.
    """
    device = torch.device(device) if device is not None else next(model.parameters()).device
    was_training = model.training
    model.eval()
    total, correct, count = 0.0, 0, 0
    try:
        for batch in task.validation_batches(batch_size or task.eval_batch_size):
            batch = batch.to(device)
            with autocast(device, dtype):
                loss, right = task.loss_stats(model, batch)
            total += float(loss)
            correct += int(right)
            count += task.scored(batch)
    finally:
        model.train(was_training)
    return task.metrics(total / max(count, 1), correct, count)
