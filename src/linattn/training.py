"""Training: a config, a loop, checkpoints that resume exactly, data parallelism.

    result = train(TrainConfig(task="bytes", model={"d_model": 128, "n_layers": 2, "n_heads": 4},
                               steps=500, out_dir="runs/demo"))

What one optimizer step does (global batch B sequences, W processes, A accumulation micro-steps):

    batch   = the task's global batch number `step` (a function of (seed, step) only; every process
              draws the same global batch and keeps its rows [r·B/W, (r+1)·B/W))
    for each of A micro-batches of B/(W·A) rows:
        loss_sum = Σ cross-entropy over the scored targets of the micro-batch
        backward(loss_sum · W / n_scored(global batch))       (DDP averages over W: × W undoes it)
    ⇒ the gradient is that of the mean loss over every scored target of the global batch, whatever
      W and A are (equal up to float summation order; tested with W = 2 against W = 1).
    all-reduce [Σ loss_sum, stop flag]; stop on a non-finite loss or gradient norm *before* the update;
    clip the gradient norm, AdamW step, LR schedule step (linear warm-up, cosine decay to min_lr).

Randomness inside a step (dropout) comes from the global torch RNG, re-seeded at every step from
(seed, step, rank) inside `torch.random.fork_rng`, so a resumed run draws the same masks as an
uninterrupted one and the caller's RNG is left as it was.

Checkpoints (`out_dir/checkpoints/step-XXXXXXXX/`, `last` -> the latest good one)::

    config.json, model.safetensors   the model (linattn.checkpoint.save_pretrained): loadable alone
                                     with LinearTransformerLM.from_pretrained(out_dir/"checkpoints/last")
    trainer.safetensors              optimizer tensors ("optim.<param>.<name>") and RNG states ("rng.*")
    trainer.json                     format, step, the TrainConfig, optimizer hyper-parameters and
                                     scalar state, scheduler state, data position, RNG bookkeeping,
                                     and the SHA-256 and size of every other file of the checkpoint

No pickle anywhere: JSON and safetensors only. A checkpoint is written into a temporary folder in
the same parent, every file fsynced, renamed into place, and only then `last` is switched
(an atomic symlink replace), so a crash leaves the previous checkpoint intact. Loading checks the
manifest and names the file that is missing or corrupted.

Stopping: Ctrl-C (SIGINT) sets a flag checked after each step (all processes agree on it through the
per-step all-reduce); the run saves a checkpoint and returns status "interrupted" (CLI exit 130). A
second Ctrl-C interrupts at once. A KeyboardInterrupt raised elsewhere (e.g. from `callback`) is
handled the same way. A non-finite loss or gradient stops the run before the update, writes no
checkpoint for that step, and returns status "diverged" (CLI exit 3) with a message naming the step.

Data parallelism: launched with `torchrun --nproc-per-node N -m linattn.cli train ...` (WORLD_SIZE,
RANK, LOCAL_RANK in the environment) the run uses DistributedDataParallel (gloo on CPU, NCCL on
CUDA); `distributed="off"` ignores the launcher, `"on"` insists. Only rank 0 writes files and shows
progress.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import json
import math
import os
import shutil
import signal
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from ._checks import dataclass_from_dict, is_int, is_number, resolve_device
from ._io import fsync_path, sha256_file
from . import data as D
from .checkpoint import CONFIG_NAME, WEIGHTS_NAME, CheckpointError, load_state, read_config, save_pretrained
from .models import LinearTransformerEncoder, LinearTransformerLM, ModelConfig

__all__ = [
    "TASKS",
    "EXIT_DIVERGED",
    "EXIT_INTERRUPTED",
    "CheckpointError",
    "TrainConfig",
    "TrainResult",
    "StepInfo",
    "build_model",
    "evaluate",
    "find_checkpoint",
    "load_config_file",
    "load_training_checkpoint",
    "make_task",
    "plot_metrics",
    "read_metrics",
    "read_trainer_doc",
    "save_training_checkpoint",
    "train",
]

TASKS = ("bytes", "copy", "mqar", "listops")
DTYPES = ("float32", "bfloat16")
DISTRIBUTED = ("auto", "on", "off")
EXIT_INTERRUPTED = 130
EXIT_DIVERGED = 3

TRAINER_JSON = "trainer.json"
TRAINER_TENSORS = "trainer.safetensors"
CHECKPOINTS = "checkpoints"
LAST = "last"
METRICS = "metrics.jsonl"
LOSS_PNG = "loss.png"
CONFIG_OUT = "train_config.json"
TRAINER_FORMAT = "linattn-trainer"
TRAINER_FORMAT_VERSION = 1

# Fields that may differ between a checkpoint's config and the config that resumes it: they do not
# change the trajectory (grad_accum and the process count keep the global batch) or only extend it.
RESUMABLE_CHANGES = frozenset({
    "steps", "grad_accum", "device", "eval_interval", "eval_batches", "eval_samples", "eval_batch_size",
    "log_interval", "out_dir", "checkpoint_interval", "keep_checkpoints", "resume", "distributed", "backend",
    "dist_timeout_s", "activation_checkpointing",
})


# ----------------------------------------------------------------------------------------------
# configuration
# ----------------------------------------------------------------------------------------------


@dataclass
class TrainConfig:
    """Everything that defines a training run. Round-trips through dicts, JSON and TOML files.

    model: ModelConfig fields (a dict). Left unset, `vocab_size` (and `num_classes` for ListOps)
        come from the task, `max_len` is the task's sequence length, `seed` is `seed`.
    task: "bytes" (byte-level LM on `corpus`), "copy", "mqar" (decoder LM), "listops" (encoder
        classifier); task_options go to the generator in linattn.data (copy_task: max_len,
        n_symbols, min_len; mqar_task: seq_len, n_pairs, vocab_size, power_a, random_non_queries;
        listops_task: max_depth, max_args, min_len, max_len).
    corpus / corpus_max_bytes / val_fraction / seq_len: the byte corpus (None: the Python standard
        library) and its window length; task "bytes" only.
    batch_size: the *global* batch in sequences per optimizer step (over all processes and
        accumulation micro-steps); it must be divisible by world_size · grad_accum.
    lr, min_lr_ratio, warmup_steps: linear warm-up from 0 to lr over warmup_steps, then cosine decay
        to lr·min_lr_ratio at `steps`. weight_decay (matrices and embeddings only; norms, biases
        and 1-D parameters get none), betas, eps: AdamW. grad_clip: max global gradient norm (None: off).
    dtype: "float32", or "bfloat16" for bf16 autocast (weights and optimizer stay float32).
    eval_interval: validate every that many steps (0: only at the end); eval_batches (bytes task:
        number of validation batches) / eval_samples (synthetic tasks: size of the fixed
        validation set) / eval_batch_size (default batch_size).
    out_dir: where metrics.jsonl, loss.png, train_config.json and checkpoints/ go (None: write
        nothing). checkpoint_interval: save every that many steps (0: only at the end and on
        interrupt); keep_checkpoints: how many step-* folders to keep.
    resume: None (fresh; refuses an out_dir that already holds checkpoints), "latest" (out_dir's
        latest checkpoint, which must exist), "auto" (latest if any, else fresh) or a path to a run
        folder or a checkpoint folder.
    distributed: "auto" (DDP when launched by torchrun with WORLD_SIZE > 1), "on", "off";
        backend (None: gloo on CPU, nccl on CUDA), dist_timeout_s.
    sequence_parallel: P processes per sequence (LM tasks): each sequence of the batch is split into
        P contiguous shards and the model runs sequence-parallel over those P processes (only the
        (kv, z) states cross shards, linattn.parallel); the world (torchrun's processes) must be
        a multiple of P, and the data-parallel size is world / P.
    """

    model: dict = field(default_factory=lambda: {"d_model": 128, "n_layers": 2, "n_heads": 4})
    task: str = "bytes"
    task_options: dict = field(default_factory=dict)
    corpus: list | None = None
    corpus_max_bytes: int | None = None
    val_fraction: float = 0.05
    seq_len: int = 256
    batch_size: int = 16
    grad_accum: int = 1
    steps: int = 1000
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    betas: list = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    grad_clip: float | None = 1.0
    dtype: str = "float32"
    activation_checkpointing: bool = False
    device: str = "cpu"
    seed: int = 0
    eval_interval: int = 100
    eval_batches: int = 8
    eval_samples: int = 512
    eval_batch_size: int | None = None
    log_interval: int = 10
    out_dir: str | None = None
    checkpoint_interval: int = 0
    keep_checkpoints: int = 2
    resume: str | None = None
    distributed: str = "auto"
    backend: str | None = None
    dist_timeout_s: float = 300.0
    sequence_parallel: int = 1

    def __post_init__(self):
        if not isinstance(self.model, dict):
            raise ValueError(f"model must be a dict of ModelConfig fields, got {type(self.model).__name__}")
        self.model = dict(self.model)
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {self.task!r}")
        if not isinstance(self.task_options, dict):
            raise ValueError(f"task_options must be a dict, got {type(self.task_options).__name__}")
        self.task_options = dict(self.task_options)
        if self.corpus is not None:
            if isinstance(self.corpus, (str, os.PathLike)):
                self.corpus = [self.corpus]
            if not isinstance(self.corpus, (list, tuple)) or not self.corpus:
                raise ValueError(f"corpus must be None or a non-empty list of paths, got {self.corpus!r}")
            self.corpus = [str(p) for p in self.corpus]
        for name in ("seq_len", "batch_size", "grad_accum", "steps", "eval_batches", "eval_samples", "log_interval",
                     "keep_checkpoints", "sequence_parallel"):
            v = getattr(self, name)
            if not is_int(v) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        for name in ("warmup_steps", "eval_interval", "checkpoint_interval"):
            v = getattr(self, name)
            if not is_int(v) or v < 0:
                raise ValueError(f"{name} must be an int >= 0, got {v!r}")
        for name in ("corpus_max_bytes", "eval_batch_size"):
            v = getattr(self, name)
            if v is not None and (not is_int(v) or v < 1):
                raise ValueError(f"{name} must be None or an int >= 1, got {v!r}")
        if not is_int(self.seed):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        if not (is_number(self.lr) and self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr must be a positive number, got {self.lr!r}")
        if not (is_number(self.min_lr_ratio) and 0 <= self.min_lr_ratio <= 1):
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}")
        if not (is_number(self.val_fraction) and 0 < self.val_fraction < 1):
            raise ValueError(f"val_fraction must be in (0, 1), got {self.val_fraction!r}")
        if not (is_number(self.weight_decay) and self.weight_decay >= 0):
            raise ValueError(f"weight_decay must be a number >= 0, got {self.weight_decay!r}")
        if not (isinstance(self.betas, (list, tuple)) and len(self.betas) == 2
                and all(is_number(b) and 0 <= b < 1 for b in self.betas)):
            raise ValueError(f"betas must be two numbers in [0, 1), got {self.betas!r}")
        self.betas = [float(b) for b in self.betas]
        if not (is_number(self.eps) and self.eps > 0):
            raise ValueError(f"eps must be a positive number, got {self.eps!r}")
        if self.grad_clip == 0 and is_number(self.grad_clip):
            self.grad_clip = None  # TOML has no null: 0 turns clipping off
        if self.grad_clip is not None and not (is_number(self.grad_clip) and self.grad_clip > 0):
            raise ValueError(f"grad_clip must be None (or 0: off) or a positive number, got {self.grad_clip!r}")
        if self.dtype not in DTYPES:
            hint = " (float16 would need loss scaling; use bfloat16)" if self.dtype == "float16" else ""
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}{hint}")
        if not isinstance(self.activation_checkpointing, bool):
            raise ValueError(f"activation_checkpointing must be a bool, got {self.activation_checkpointing!r}")
        if not isinstance(self.device, str) or not self.device:
            raise ValueError(f"device must be a string such as 'cpu', 'cuda', 'cuda:1' or 'auto', got {self.device!r}")
        if self.device != "auto":
            try:
                torch.device(self.device)
            except RuntimeError:
                raise ValueError(f"device must be 'cpu', 'cuda', 'cuda:N' or 'auto', got {self.device!r}") from None
        if self.distributed not in DISTRIBUTED:
            raise ValueError(f"distributed must be one of {DISTRIBUTED}, got {self.distributed!r}")
        if self.backend not in (None, "gloo", "nccl"):
            raise ValueError(f"backend must be None, 'gloo' or 'nccl', got {self.backend!r}")
        if not (is_number(self.dist_timeout_s) and self.dist_timeout_s > 0):
            raise ValueError(f"dist_timeout_s must be a positive number, got {self.dist_timeout_s!r}")
        if self.out_dir is not None:
            self.out_dir = str(self.out_dir)
        if self.resume is not None:
            self.resume = str(self.resume)
        if self.sequence_parallel > 1 and self.task == "listops":
            raise ValueError("sequence_parallel > 1 needs an LM task (bytes, copy, mqar); the ListOps encoder pools "
                             "over the whole sequence")
        self.model_config()  # validates the model fields against the task

    # ---- derived
    def model_config(self) -> ModelConfig:
        """The ModelConfig of the run: `model` with the task's defaults filled in."""
        d = dict(self.model)
        spec = _task_spec(self)
        d.setdefault("vocab_size", spec["vocab_size"])
        d.setdefault("max_len", spec["seq_len"])
        d.setdefault("seed", self.seed)
        if spec["num_classes"] is not None:
            d.setdefault("num_classes", spec["num_classes"])
        try:
            mc = ModelConfig.from_dict(d)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"model: {exc}") from None
        if mc.vocab_size < spec["vocab_size"]:
            raise ValueError(f"model.vocab_size={mc.vocab_size} is smaller than the {self.task} task's vocabulary "
                             f"({spec['vocab_size']} token ids)")
        if spec["num_classes"] is not None and mc.num_classes != spec["num_classes"]:
            raise ValueError(f"model.num_classes={mc.num_classes} but the {self.task} task has "
                             f"{spec['num_classes']} classes")
        if mc.max_positions is not None and mc.max_positions < spec["seq_len"]:
            raise ValueError(f"the model takes at most {mc.max_positions} positions (max_len) but the {self.task} task "
                             f"has sequences of {spec['seq_len']} tokens; raise model.max_len")
        return mc

    # ---- (de)serialization
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        return dataclass_from_dict(cls, d, "training config")

    @classmethod
    def from_file(cls, path) -> "TrainConfig":
        """From a .toml or .json file (see load_config_file)."""
        try:
            return cls.from_dict(load_config_file(path))
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None

    def replace(self, **changes) -> "TrainConfig":
        """A copy with `changes` applied (and validated); `model` / `task_options` dicts are merged."""
        d = self.to_dict()
        for key in ("model", "task_options"):
            if key in changes and changes[key] is not None:
                changes[key] = {**d[key], **changes[key]}
        d.update(changes)
        return TrainConfig.from_dict(d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)


def load_config_file(path) -> dict:
    """A config file as a dict: TOML (`.toml`, via tomllib, or tomli on Python 3.10) or JSON (any
    other suffix). Top-level keys are TrainConfig fields; `[model]` and `[task_options]` tables."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file not found: {path}")
    text = path.read_text(encoding="utf-8")
    if path.suffix.lower() == ".toml":
        try:
            import tomllib
        except ModuleNotFoundError:  # Python 3.10
            try:
                import tomli as tomllib  # type: ignore[no-redef]
            except ModuleNotFoundError:
                raise ValueError(f"{path}: reading TOML on Python < 3.11 needs the 'tomli' package; "
                                 "install it or use a JSON config") from None
        try:
            return tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"{path} is not valid TOML: {exc}") from None
    try:
        d = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(d, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(d).__name__}")
    return d


# ----------------------------------------------------------------------------------------------
# tasks: global batches as functions of (seed, step), validation sets, losses
# ----------------------------------------------------------------------------------------------


_TASK_DEFAULTS = {
    "copy": {"max_len": 32, "n_symbols": 10, "min_len": 1},
    "mqar": {"seq_len": 64, "n_pairs": 4, "vocab_size": 8192},
    "listops": {"max_depth": 4, "max_args": 5, "min_len": 8, "max_len": 64},
}


def _task_options(cfg: TrainConfig) -> dict:
    if cfg.task == "bytes":
        if cfg.task_options:
            raise ValueError(f"task 'bytes' takes no task_options (use corpus, seq_len), got {cfg.task_options}")
        return {}
    opts = {**_TASK_DEFAULTS[cfg.task], **cfg.task_options}
    gen = {"copy": D.copy_task, "mqar": D.mqar_task, "listops": D.listops_task}[cfg.task]
    try:  # validate the options with one tiny draw
        gen(1, **opts, seed=0)
    except TypeError as exc:
        raise ValueError(f"task_options for {cfg.task!r}: {exc}") from None
    except (ValueError, RuntimeError) as exc:
        raise ValueError(f"task_options for {cfg.task!r} ({opts}): {exc}") from None
    return opts


def _task_spec(cfg: TrainConfig) -> dict:
    """vocab_size, num_classes, sequence length of the task (no data loaded)."""
    opts = _task_options(cfg)
    if cfg.task == "bytes":
        return {"vocab_size": 256, "num_classes": None, "seq_len": cfg.seq_len}
    if cfg.task == "copy":
        return {"vocab_size": opts["n_symbols"] + 2, "num_classes": None, "seq_len": 2 * opts["max_len"] + 1}
    if cfg.task == "mqar":
        return {"vocab_size": opts["vocab_size"], "num_classes": None, "seq_len": opts["seq_len"]}
    return {"vocab_size": len(D.LISTOPS_TOKENS), "num_classes": 10, "seq_len": opts["max_len"] + 1}


_CORPUS_CACHE: dict = {}


def _corpus(cfg: TrainConfig) -> D.Corpus:
    key = (tuple(cfg.corpus) if cfg.corpus else None, cfg.corpus_max_bytes, cfg.val_fraction)
    if key not in _CORPUS_CACHE:
        _CORPUS_CACHE.clear()  # keep one corpus in memory
        _CORPUS_CACHE[key] = D.Corpus.load(cfg.corpus, max_bytes=cfg.corpus_max_bytes, val_fraction=cfg.val_fraction)
    return _CORPUS_CACHE[key]


class Task:
    """A task's data and loss. `kind`: "lm" (batches are data.TaskBatch) or "classification"
    (data.ClassificationBatch). Global batch `step` is a function of (seed, step) only."""

    def __init__(self, cfg: TrainConfig):
        self.name = cfg.task
        self.cfg = cfg
        self.options = _task_options(cfg)
        self.kind = "classification" if cfg.task == "listops" else "lm"
        spec = _task_spec(cfg)
        self.vocab_size, self.num_classes, self.seq_len = spec["vocab_size"], spec["num_classes"], spec["seq_len"]
        self.stream = None
        if self.name == "bytes":
            self.corpus = _corpus(cfg)
            self.stream = D.ByteLMBatches(self.corpus.train, cfg.seq_len, cfg.batch_size, seed=cfg.seed)
        self._validation = None

    def describe(self) -> str:
        if self.name == "bytes":
            return self.corpus.describe()
        return f"{self.name} task {self.options}"

    # ---- data
    def _draw(self, n: int, seed: int):
        if self.name == "copy":
            return D.copy_task(n, **self.options, seed=seed)
        if self.name == "mqar":
            return D.mqar_task(n, **self.options, seed=seed)
        return D.listops_task(n, **self.options, seed=seed)

    def train_batch(self, step: int):
        """The global batch of optimizer step `step` (0-based), on the CPU."""
        if self.name == "bytes":
            x, y = self.stream.batch(step)
            return D.TaskBatch(x, y, 256)
        return self._draw(self.cfg.batch_size, D.mix_seed(self.cfg.seed, "train", step))

    def validation_batches(self, batch_size: int):
        """The fixed validation data in batches of at most `batch_size`."""
        if self.name == "bytes":
            for x, y in D.eval_batches(self.corpus.validation, self.cfg.seq_len, batch_size,
                                       max_batches=self.cfg.eval_batches):
                yield D.TaskBatch(x, y, 256)
            return
        if self._validation is None:
            self._validation = self._draw(self.cfg.eval_samples, D.mix_seed(self.cfg.seed, "validation"))
        for i in range(0, self.cfg.eval_samples, batch_size):
            yield _rows(self._validation, i, i + batch_size)

    def data_state(self, step: int) -> dict:
        """The data position after `step` optimizer steps."""
        if self.stream is not None:
            self.stream.step = step
            return {"task": self.name, **self.stream.state_dict()}
        return {"task": self.name, "step": step, "seed": self.cfg.seed}

    def check_data_state(self, state: dict, step: int) -> None:
        if not isinstance(state, dict) or state.get("task") != self.name:
            got = state.get("task") if isinstance(state, dict) else state
            raise CheckpointError(f"checkpoint data position is for task {got!r}, this run trains {self.name!r}")
        if self.stream is not None:
            try:
                self.stream.load_state_dict(state)
            except (KeyError, ValueError) as exc:
                raise CheckpointError(f"checkpoint data position does not fit this corpus: {exc}") from None
        if int(state.get("step", -1)) != step:
            raise CheckpointError(f"checkpoint data position {state.get('step')} != its step {step}")

    # ---- loss
    def scored(self, batch) -> int:
        if self.kind == "lm":
            return int((batch.targets != D.IGNORE_INDEX).sum())
        return int(batch.labels.numel())

    def tokens(self, batch) -> int:
        return int(batch.inputs.numel())

    def loss_stats(self, model: nn.Module, batch, positions=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(Σ cross-entropy over scored targets (float32, differentiable), number correct)."""
        if self.kind == "lm":
            logits, _ = model(batch.inputs, positions=positions)
            logits = logits.float().flatten(0, 1)
            targets = batch.targets.flatten()
            loss = F.cross_entropy(logits, targets, ignore_index=D.IGNORE_INDEX, reduction="sum")
            keep = targets != D.IGNORE_INDEX
            correct = (logits.detach().argmax(-1)[keep] == targets[keep]).sum()
            return loss, correct
        logits = model(batch.inputs, batch.mask).float()
        loss = F.cross_entropy(logits, batch.labels, reduction="sum")
        return loss, (logits.detach().argmax(-1) == batch.labels).sum()


def make_task(cfg: TrainConfig) -> Task:
    return Task(cfg)


def _rows(batch, start: int, end: int):
    """Rows [start, end) of a TaskBatch / ClassificationBatch."""
    if isinstance(batch, D.TaskBatch):
        return D.TaskBatch(batch.inputs[start:end], batch.targets[start:end], batch.vocab_size)
    return D.ClassificationBatch(batch.inputs[start:end], batch.mask[start:end], batch.labels[start:end],
                                 batch.cls_index[start:end], batch.vocab_size, batch.num_classes)


def _sequence_shard(batch, rank: int, world: int):
    """This process's contiguous slice of every sequence of an LM TaskBatch (inputs and their
    already-shifted targets), as linattn.parallel.shard_bounds splits it, and the slice's global
    positions."""
    from .parallel import shard_bounds

    start, end = shard_bounds(batch.inputs.shape[1], rank, world)
    return D.TaskBatch(batch.inputs[:, start:end], batch.targets[:, start:end], batch.vocab_size), (start, end)


def build_model(cfg: TrainConfig) -> nn.Module:
    """The model of the run: LinearTransformerEncoder for ListOps, LinearTransformerLM otherwise."""
    mc = cfg.model_config()
    return LinearTransformerEncoder(mc) if cfg.task == "listops" else LinearTransformerLM(mc)


def _autocast(device: torch.device, dtype: str):
    if dtype == "bfloat16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


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
        for batch in task.validation_batches(batch_size or task.cfg.eval_batch_size or task.cfg.batch_size):
            batch = batch.to(device)
            with _autocast(device, dtype):
                loss, right = task.loss_stats(model, batch)
            total += float(loss)
            correct += int(right)
            count += task.scored(batch)
    finally:
        model.train(was_training)
    loss = total / max(count, 1)
    out = {"loss": loss, "accuracy": correct / max(count, 1), "count": count}
    if task.name == "bytes":
        out["bpb"] = loss / math.log(2)
    return out


# ----------------------------------------------------------------------------------------------
# optimizer, schedule
# ----------------------------------------------------------------------------------------------


def _param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on ≥2-D parameters (matrices, embeddings), none on norms, biases, 1-D ones."""
    decay, no_decay, seen = [], [], set()
    for _, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Multiplier of cfg.lr at optimizer step `step` (0-based): linear warm-up over warmup_steps
    ((step+1)/warmup_steps), then cosine from 1 to min_lr_ratio at cfg.steps."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def _make_optimizer(model: nn.Module, cfg: TrainConfig):
    opt = torch.optim.AdamW(_param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg))
    return opt, sched


# ----------------------------------------------------------------------------------------------
# checkpoints
# ----------------------------------------------------------------------------------------------


def _jsonable(value) -> bool:
    try:
        json.dumps(value, allow_nan=False)
        return True
    except (TypeError, ValueError):
        return False


def _optimizer_to_flat(opt: torch.optim.Optimizer) -> tuple[dict, dict]:
    """optimizer.state_dict() -> (tensors for safetensors, JSON-able rest)."""
    sd = opt.state_dict()
    tensors, scalars = {}, {}
    for pid, st in sd["state"].items():
        for name, val in st.items():
            if isinstance(val, torch.Tensor):
                tensors[f"optim.{pid}.{name}"] = val.detach().to("cpu").contiguous()
            else:
                scalars.setdefault(str(pid), {})[name] = val
    groups = []
    for g in sd["param_groups"]:
        groups.append({k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()})
    return tensors, {"param_groups": groups, "scalar_state": scalars}


def _optimizer_from_flat(tensors: dict, meta: dict) -> dict:
    state: dict[int, dict] = {}
    for key, val in tensors.items():
        if not key.startswith("optim."):
            continue
        _, pid, name = key.split(".", 2)
        state.setdefault(int(pid), {})[name] = val
    for pid, st in meta.get("scalar_state", {}).items():
        state.setdefault(int(pid), {}).update(st)
    groups = []
    for g in meta["param_groups"]:
        g = dict(g)
        if "betas" in g:
            g["betas"] = tuple(g["betas"])
        groups.append(g)
    return {"state": state, "param_groups": groups}


def _rng_tensors() -> dict:
    out = {"rng.torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            out[f"rng.cuda.{i}"] = s
    return out


def _restore_rng(tensors: dict) -> None:
    if "rng.torch_cpu" in tensors:
        torch.set_rng_state(tensors["rng.torch_cpu"])
    cuda = sorted((k for k in tensors if k.startswith("rng.cuda.")), key=lambda k: int(k.rsplit(".", 1)[1]))
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([tensors[k] for k in cuda])


def _step_name(step: int) -> str:
    return f"step-{step:08d}"


def save_training_checkpoint(ckpt_root: Path, step: int, model: nn.Module, opt, sched, task: Task,
                             cfg: TrainConfig, extra: dict | None = None, keep: int = 2) -> Path:
    """Writes ckpt_root/step-XXXXXXXX atomically and points ckpt_root/last at it. Returns its path."""
    from safetensors.torch import save_file

    ckpt_root.mkdir(parents=True, exist_ok=True)
    final = ckpt_root / _step_name(step)
    tmp = ckpt_root / f".tmp-{_step_name(step)}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        save_pretrained(model, tmp)  # config.json + model.safetensors, each fsynced
        tensors, opt_meta = _optimizer_to_flat(opt)
        tensors.update(_rng_tensors())
        save_file(tensors, str(tmp / TRAINER_TENSORS), metadata={"format": "pt", "step": str(step)})
        fsync_path(tmp / TRAINER_TENSORS)
        sched_state = {k: v for k, v in sched.state_dict().items() if k != "lr_lambdas" and _jsonable(v)}
        manifest = {name: {"sha256": sha256_file(tmp / name), "bytes": (tmp / name).stat().st_size}
                    for name in (CONFIG_NAME, WEIGHTS_NAME, TRAINER_TENSORS)}
        doc = {
            "format": TRAINER_FORMAT,
            "format_version": TRAINER_FORMAT_VERSION,
            "step": step,
            "saved_at": _dt.datetime.now().isoformat(timespec="seconds"),
            "train_config": cfg.to_dict(),
            "optimizer": opt_meta,
            "scheduler": sched_state,
            "data": task.data_state(step),
            "rng": {"torch_cpu": True, "cuda_devices": sum(k.startswith("rng.cuda.") for k in tensors),
                    "per_step_seed": "mix(seed, 'step', step, rank)"},
            "files": manifest,
            **(extra or {}),
        }
        with open(tmp / TRAINER_JSON, "w", encoding="utf-8") as f:
            f.write(json.dumps(doc, indent=2, allow_nan=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        fsync_path(tmp)
        if final.exists():  # re-saving the same step (e.g. interrupt right after a periodic save)
            shutil.rmtree(final)
        os.replace(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    fsync_path(ckpt_root)
    _point_last(ckpt_root, final.name)
    _prune(ckpt_root, keep, final.name)
    return final


def _point_last(ckpt_root: Path, name: str) -> None:
    """Atomically make ckpt_root/last refer to `name`: a relative symlink, or where symlinks are not
    available a small text file holding the name."""
    link = ckpt_root / LAST
    tmp = ckpt_root / f".{LAST}-{uuid.uuid4().hex[:8]}"
    try:
        os.symlink(name, tmp, target_is_directory=True)
    except (OSError, NotImplementedError):
        tmp.write_text(name + "\n", encoding="utf-8")
    os.replace(tmp, link)
    fsync_path(ckpt_root)


def _prune(ckpt_root: Path, keep: int, current: str) -> None:
    steps = sorted(p for p in ckpt_root.glob("step-*") if p.is_dir())
    for p in steps[:-keep] if keep > 0 else []:
        if p.name != current:
            shutil.rmtree(p, ignore_errors=True)


def find_checkpoint(path) -> Path:
    """The training checkpoint folder `path` refers to: a checkpoint folder itself (holds
    trainer.json), or a folder with a `last` pointer (a checkpoints/ folder), or a run folder (its
    checkpoints/last). FileNotFoundError saying what is missing when there is none."""
    p = Path(path)
    if (p / TRAINER_JSON).is_file():
        return p
    for link in (p / LAST, p / CHECKPOINTS / LAST):
        if not (link.is_symlink() or link.exists()):
            continue
        if link.is_symlink():
            target = link.parent / os.readlink(link)
        elif link.is_file():  # text-file pointer (no symlinks on this filesystem)
            target = link.parent / link.read_text(encoding="utf-8").strip()
        else:
            target = link
        if not target.is_dir():
            raise FileNotFoundError(f"{link} points to {target}, which does not exist")
        if not (target / TRAINER_JSON).is_file():
            raise FileNotFoundError(f"checkpoint {target} is incomplete: {TRAINER_JSON} is missing")
        return target
    if (p / CONFIG_NAME).is_file():
        raise FileNotFoundError(f"{p} holds a model but no {TRAINER_JSON}: it is not a training checkpoint "
                                "(or its save was interrupted); resume from another checkpoint")
    raise FileNotFoundError(f"no training checkpoint at {p} (looked for {TRAINER_JSON} in it, a `{LAST}` pointer "
                            f"and {CHECKPOINTS}/{LAST})")


def read_trainer_doc(ckpt) -> dict:
    """The trainer.json of checkpoint folder `ckpt`, checked for format and required entries."""
    ckpt = Path(ckpt)
    doc_path = ckpt / TRAINER_JSON
    if not doc_path.is_file():
        raise FileNotFoundError(f"checkpoint {ckpt} is incomplete: {TRAINER_JSON} is missing")
    try:
        doc = json.loads(doc_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"checkpoint {ckpt} is corrupted: {TRAINER_JSON} is not valid JSON ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != TRAINER_FORMAT:
        got = doc.get("format") if isinstance(doc, dict) else None
        raise CheckpointError(f"{doc_path} is not a linattn training checkpoint (format {got!r})")
    if doc.get("format_version") != TRAINER_FORMAT_VERSION:
        raise CheckpointError(f"{doc_path} has format_version {doc.get('format_version')!r}; this linattn reads "
                              f"{TRAINER_FORMAT_VERSION}")
    for key in ("step", "train_config", "optimizer", "scheduler", "data", "files"):
        if key not in doc:
            raise CheckpointError(f"checkpoint {ckpt} is corrupted: {TRAINER_JSON} has no {key!r} entry")
    if not isinstance(doc["files"], dict):
        raise CheckpointError(f"checkpoint {ckpt} is corrupted: {TRAINER_JSON} 'files' is not a table")
    return doc


def load_training_checkpoint(path, model: nn.Module, opt=None, sched=None, *, verify: bool = True,
                             restore_rng: bool = True) -> dict:
    """Loads a training checkpoint into `model` (and `opt`, `sched` when given) and, with
    restore_rng, the torch RNG states; returns the trainer.json document (plus "path", and "rng":
    the saved RNG tensors). Raises FileNotFoundError when a file is missing and CheckpointError
    (a ValueError) naming the file when one is corrupted or does not fit the model."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    ckpt = find_checkpoint(path)
    doc = read_trainer_doc(ckpt)
    for name, info in doc["files"].items():
        f = ckpt / name
        if not f.is_file():
            raise FileNotFoundError(f"checkpoint {ckpt} is incomplete: {name} is missing")
        if verify:
            size = f.stat().st_size
            if size != info.get("bytes") or sha256_file(f) != info.get("sha256"):
                raise CheckpointError(f"checkpoint {ckpt} is corrupted: {name} does not match the checksum recorded "
                                      f"in {TRAINER_JSON} ({size} bytes, expected {info.get('bytes')}); resume from "
                                      "an earlier checkpoint")
    try:
        arch, saved_config, _ = read_config(ckpt, type(model.config))
        if arch != type(model).__name__:
            raise CheckpointError(f"checkpoint {ckpt} holds a {arch}, this run trains a {type(model).__name__}")
        diff = model.config.diff(saved_config)
        if diff:
            desc = ", ".join(f"{k}: run has {a!r}, checkpoint has {b!r}" for k, (a, b) in sorted(diff.items()))
            raise CheckpointError(f"checkpoint {ckpt} was trained with another model config: {desc}")
        load_state(model, load_file(str(ckpt / WEIGHTS_NAME)), source=str(ckpt / WEIGHTS_NAME))
        tensors = load_file(str(ckpt / TRAINER_TENSORS))
    except SafetensorError as exc:
        raise CheckpointError(f"checkpoint {ckpt} is corrupted: {exc}") from None
    if opt is not None:
        try:
            opt.load_state_dict(_optimizer_from_flat(tensors, doc["optimizer"]))
        except (KeyError, ValueError, TypeError) as exc:
            raise CheckpointError(f"checkpoint {ckpt}: optimizer state does not fit this model/optimizer: "
                                  f"{exc}") from None
    if sched is not None:
        sched.load_state_dict({**sched.state_dict(), **doc["scheduler"]})
    rng = {k: v for k, v in tensors.items() if k.startswith("rng.")}
    if restore_rng:
        _restore_rng(rng)
    doc["path"] = str(ckpt)
    doc["rng"] = rng
    return doc


def _check_resumable(saved: dict, cfg: TrainConfig, ckpt: Path) -> None:
    try:
        saved_cfg = TrainConfig.from_dict(saved)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {ckpt}: its training config is not readable: {exc}") from None
    a, b = saved_cfg.to_dict(), cfg.to_dict()
    a["model"], b["model"] = saved_cfg.model_config().to_dict(), cfg.model_config().to_dict()
    diff = {k: (a[k], b[k]) for k in a if k not in RESUMABLE_CHANGES and a[k] != b[k]}
    if diff:
        desc = "; ".join(f"{k}: checkpoint {x!r}, now {y!r}" for k, (x, y) in sorted(diff.items()))
        raise ValueError(f"cannot resume from {ckpt} with a different training setup ({desc}). Use the same config "
                         f"(only {', '.join(sorted(RESUMABLE_CHANGES))} may change)")


# ----------------------------------------------------------------------------------------------
# metrics log and plot
# ----------------------------------------------------------------------------------------------


def read_metrics(path) -> list[dict]:
    """The records of a metrics.jsonl file (train records have "loss", eval records "split")."""
    out = []
    p = Path(path)
    if not p.is_file():
        return out
    for line in p.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if line:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a torn last line after a crash
    return out


def plot_metrics(records: list[dict], path, *, title: str = "training", bits: bool = False) -> Path:
    """Loss curve PNG: training loss per logged step and validation loss (and accuracy) per eval.
    bits: plot in bits (÷ ln 2), e.g. bits per byte for byte-level LM."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    scale = 1 / math.log(2) if bits else 1.0
    train = [(r["step"], r["loss"] * scale) for r in records if r.get("split") == "train" and r.get("loss") is not None]
    evals = [r for r in records if r.get("split") == "validation"]
    val = [(r["step"], r["loss"] * scale) for r in evals if r.get("loss") is not None]
    acc = [(r["step"], r["accuracy"]) for r in evals if r.get("accuracy") is not None]
    fig = Figure(figsize=(7.0, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    if train:
        ax.plot(*zip(*train), label="train", linewidth=1)
    if val:
        ax.plot(*zip(*val), marker="o", markersize=3, label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("bits per byte" if bits else "loss (nats)")
    ax.grid(True, alpha=0.3)
    if acc and not bits:
        ax2 = ax.twinx()
        ax2.plot(*zip(*acc), color="tab:green", linestyle="--", marker=".", label="validation accuracy")
        ax2.set_ylabel("accuracy")
        ax2.set_ylim(0, 1.02)
        ax2.legend(loc="upper center", fontsize=8)
    if train or val:
        ax.legend(loc="upper right", fontsize=8)
    ax.set_title(title)
    path = Path(path)
    fig.savefig(path, dpi=110)
    return path


class _MetricsLog:
    def __init__(self, path: Path | None, resume_step: int | None):
        self.path = path
        if path is None:
            return
        if resume_step is None:
            path.write_text("", encoding="utf-8")
        else:  # keep the history up to the checkpoint, drop what a crashed run logged after it
            keep = [r for r in read_metrics(path) if r.get("step", 0) <= resume_step]
            path.write_text("".join(json.dumps(r) + "\n" for r in keep), encoding="utf-8")

    def write(self, record: dict) -> None:
        if self.path is None:
            return
        record = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")


# ----------------------------------------------------------------------------------------------
# the loop
# ----------------------------------------------------------------------------------------------


@dataclass
class StepInfo:
    """What `callback` receives after every optimizer step (step = steps done so far)."""

    step: int
    loss: float
    lr: float
    grad_norm: float
    model: nn.Module
    validation: dict | None = None


@dataclass
class TrainResult:
    """What `train` returns.

    status: "completed", "interrupted" (Ctrl-C / KeyboardInterrupt; a checkpoint was saved when
    out_dir is set) or "diverged" (non-finite loss or gradient; nothing saved for that step).
    step: optimizer steps done in total (resumed steps included). losses: the training loss of each
    step run by this call, in order (losses[i] belongs to step start_step + i + 1).
    validation: [{"step", "loss", "accuracy", ("bpb")}, ...]; final: the last one (metrics of the
    returned model at the end of a completed run). model: the trained model (unwrapped).
    """

    status: str
    step: int
    start_step: int
    losses: list
    validation: list
    final: dict | None
    model: nn.Module
    config: TrainConfig
    out_dir: Path | None
    checkpoint: Path | None
    message: str
    elapsed_s: float
    tokens: int
    world_size: int = 1
    rank: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def exit_code(self) -> int:
        return {"completed": 0, "interrupted": EXIT_INTERRUPTED, "diverged": EXIT_DIVERGED}[self.status]


class _StopFlag:
    """SIGINT handler: the first Ctrl-C asks the loop to stop after the current step; a second one
    raises KeyboardInterrupt at once. Installed only in the main thread, restored afterwards."""

    def __init__(self):
        self.requested = False
        self._old = None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            try:
                self._old = signal.signal(signal.SIGINT, self._handle)
            except ValueError:  # pragma: no cover - not the main interpreter
                self._old = None
        return self

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc):
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)
        return False


def _setup_distributed(cfg: TrainConfig, device_name: str):
    """-> (use_ddp, rank, world, local_rank, created_group, groups); groups is a
    linattn.parallel.ParallelGroups when sequence_parallel > 1, else None."""
    import torch.distributed as dist

    env_world = int(os.environ.get("WORLD_SIZE", "1"))
    want = cfg.distributed == "on" or (cfg.distributed == "auto" and (env_world > 1 or
                                                                     (dist.is_available() and dist.is_initialized())))
    if not want:
        if cfg.sequence_parallel > 1:
            raise ValueError(f"sequence_parallel={cfg.sequence_parallel} needs that many processes: launch with "
                             f"torchrun --nproc-per-node {cfg.sequence_parallel} (or a multiple of it)")
        return False, 0, 1, 0, False, None
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    created = not dist.is_initialized()
    if created:
        from .parallel import init_distributed

        dev = resolve_device(device_name, local_rank)
        backend = cfg.backend or ("nccl" if dev.type == "cuda" else "gloo")
        init_distributed(backend, timeout_s=cfg.dist_timeout_s)
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = None
    if cfg.sequence_parallel > 1:
        from .parallel import make_parallel_groups

        if world % cfg.sequence_parallel:
            raise ValueError(f"sequence_parallel={cfg.sequence_parallel} must divide the number of processes ({world})")
        groups = make_parallel_groups(cfg.sequence_parallel)
    return True, rank, world, local_rank, created, groups


def train(config: TrainConfig, *, progress: bool = True, callback: Callable[[StepInfo], Any] | None = None,
          console=None) -> TrainResult:
    """Runs (or resumes) the training described by `config`; see the module docstring.

    progress: show a progress bar (loss, tokens/s, ETA) and messages on rank 0. callback(StepInfo)
    runs after each optimizer step (after its checkpoint, if one was due); raising
    KeyboardInterrupt from it stops the run like Ctrl-C. Returns a TrainResult (status, losses,
    validation metrics, the model, the checkpoint path); a run that stops early returns too, with
    status "interrupted" or "diverged" and a message.
    """
    if not isinstance(config, TrainConfig):
        raise TypeError(f"config must be a TrainConfig, got {type(config).__name__}")
    cfg = config
    use_ddp, rank, world, local_rank, created_group, groups = _setup_distributed(cfg, cfg.device)
    try:
        return _train(cfg, progress=progress and rank == 0, callback=callback, console=console, use_ddp=use_ddp,
                      rank=rank, world=world, local_rank=local_rank, groups=groups)
    finally:
        if created_group:
            import torch.distributed as dist

            with contextlib.suppress(Exception):
                dist.barrier()
            dist.destroy_process_group()


def _train(cfg: TrainConfig, *, progress: bool, callback, console, use_ddp: bool, rank: int, world: int,
           local_rank: int, groups=None) -> TrainResult:
    import torch.distributed as dist

    # data parallelism over dp_size replicas; with sequence parallelism each replica is sp_size processes
    dp_rank, dp_size = (rank, world) if groups is None else (groups.dp_rank, groups.dp_size)
    if cfg.batch_size % (dp_size * cfg.grad_accum):
        raise ValueError(f"batch_size={cfg.batch_size} (global) must be divisible by data-parallel replicas × "
                         f"grad_accum = {dp_size} × {cfg.grad_accum}")
    device = resolve_device(cfg.device, local_rank)
    if cfg.dtype == "bfloat16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ValueError("dtype='bfloat16' but this GPU does not support bf16; use float32")
    is_main = rank == 0
    out_dir = Path(cfg.out_dir) if cfg.out_dir is not None else None
    ckpt_root = out_dir / CHECKPOINTS if out_dir is not None else None

    # ---- what to resume from
    resume_path = None
    if cfg.resume is not None:
        if cfg.resume in ("latest", "auto"):
            if out_dir is None:
                raise ValueError(f"resume={cfg.resume!r} needs out_dir (the run folder holding checkpoints/)")
            if (ckpt_root / LAST).is_symlink() or (ckpt_root / LAST).exists():
                resume_path = find_checkpoint(ckpt_root)  # a broken `last` is an error, also for "auto"
            elif cfg.resume == "latest":
                raise FileNotFoundError(f"nothing to resume: no checkpoint in {ckpt_root} "
                                        f"(expected {ckpt_root / LAST})")
        else:
            resume_path = find_checkpoint(cfg.resume)
            if out_dir is None:  # continue writing into the run the checkpoint belongs to
                run = resume_path.parent.parent if resume_path.parent.name == CHECKPOINTS else None
                if run is not None:
                    out_dir, ckpt_root = run, run / CHECKPOINTS
    elif ckpt_root is not None and ((ckpt_root / LAST).exists() or (ckpt_root / LAST).is_symlink()):
        raise ValueError(f"{out_dir} already holds checkpoints ({ckpt_root / LAST}): resume the run (resume='latest', "
                         "CLI --resume) or choose another out_dir")

    task = Task(cfg)
    model = build_model(cfg).to(device)
    opt, sched = _make_optimizer(model, cfg)
    start_step = 0
    resume_rng = None
    if resume_path is not None:
        _check_resumable(read_trainer_doc(resume_path)["train_config"], cfg, resume_path)
        doc = load_training_checkpoint(resume_path, model, opt, sched, restore_rng=False)
        resume_rng = doc["rng"]
        start_step = int(doc["step"])
        task.check_data_state(doc["data"], start_step)
        if start_step > cfg.steps:
            raise ValueError(f"checkpoint {resume_path} is at step {start_step}, beyond steps={cfg.steps}")
    model.set_activation_checkpointing(cfg.activation_checkpointing)
    model.train()
    if groups is not None:
        model.set_sequence_parallel_group(groups.sequence)

    ddp_model = model
    if use_ddp:
        from torch.nn.parallel import DistributedDataParallel as DDP

        ddp_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)

    if is_main and out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / CONFIG_OUT).write_text(cfg.to_json() + "\n", encoding="utf-8")
    log = _MetricsLog(out_dir / METRICS if (is_main and out_dir is not None) else None,
                      start_step if resume_path is not None else None)

    con = console
    if progress and con is None:
        from .report import make_console

        con = make_console()
    say = (lambda msg: con.print(msg)) if progress else (lambda msg: None)
    if progress:
        say(f"[bold]linattn train[/]: {type(model).__name__} "
            f"{sum(p.numel() for p in model.parameters()):,} parameters, {task.describe()}, "
            f"{world} process(es)" + (f" ({dp_size} data × {cfg.sequence_parallel} sequence parallel)"
                                      if groups is not None else "") + f", device {device}, global batch {cfg.batch_size}"
            + (f", resuming from {resume_path} (step {start_step})" if resume_path is not None else ""))

    per_rank = cfg.batch_size // dp_size
    micro = per_rank // cfg.grad_accum
    eval_bs = cfg.eval_batch_size or cfg.batch_size
    losses, validation = [], []
    status, message = "completed", ""
    last_ckpt = resume_path
    tokens, train_time = 0, 0.0
    step = start_step
    params = [p for p in model.parameters() if p.requires_grad]
    last_saved_step = start_step if resume_path is not None else -1

    def save(at_step: int) -> None:
        nonlocal last_ckpt, last_saved_step
        if is_main and ckpt_root is not None and at_step != last_saved_step:
            last_ckpt = save_training_checkpoint(ckpt_root, at_step, model, opt, sched, task, cfg,
                                                 keep=cfg.keep_checkpoints)
            last_saved_step = at_step

    def run_eval(at_step: int) -> dict | None:
        if not is_main:
            return None
        if groups is not None:  # rank 0 evaluates the whole sequences alone
            model.set_sequence_parallel_group(None)
        try:
            m = evaluate(model, task, batch_size=eval_bs, device=device, dtype=cfg.dtype)
        finally:
            if groups is not None:
                model.set_sequence_parallel_group(groups.sequence)
        rec = {"step": at_step, "split": "validation", **m}
        validation.append(rec)
        log.write(rec)
        extra = f", bpb {m['bpb']:.4f}" if "bpb" in m else f", accuracy {m['accuracy']:.4f}"
        say(f"step {at_step}: validation loss {m['loss']:.4f}{extra}")
        return m

    bar = None
    if progress:
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                   TimeRemainingColumn)

        bar = Progress(TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
                       TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[tps]} tok/s"),
                       TextColumn("ETA"), TimeRemainingColumn(), TimeElapsedColumn(), console=con, transient=False)
        bar_task = bar.add_task("train", total=cfg.steps, completed=start_step, loss="—", tps="—")
        bar.start()

    stats_device = device if (use_ddp and dist.get_backend() == "nccl") else torch.device("cpu")
    t_start = time.perf_counter()
    rng_devices = [device.index] if device.type == "cuda" else []
    phase = "idle"
    # the SIGINT flag stays installed through the final validation and save
    with _StopFlag() as stop:
        try:
            with torch.random.fork_rng(devices=rng_devices):
                if resume_rng:
                    _restore_rng(resume_rng)
                while step < cfg.steps:
                    t0 = time.perf_counter()
                    torch.manual_seed(D.mix_seed(cfg.seed, "step", step, rank))
                    batch = task.train_batch(step)
                    n_scored = max(1, task.scored(batch))
                    mine = _rows(batch, dp_rank * per_rank, (dp_rank + 1) * per_rank)
                    positions = None
                    if groups is not None:
                        mine, (start, end) = _sequence_shard(mine, groups.sp_rank, groups.sp_size)
                        positions = torch.arange(start, end, device=device)
                    phase = "forward-backward"
                    loss_sum = torch.zeros((), dtype=torch.float64)
                    for m in range(cfg.grad_accum):
                        mb = _rows(mine, m * micro, (m + 1) * micro).to(device)
                        sync = not use_ddp or m == cfg.grad_accum - 1
                        with (contextlib.nullcontext() if sync else ddp_model.no_sync()):
                            with _autocast(device, cfg.dtype):
                                s, _ = task.loss_stats(ddp_model, mb, positions)
                            (s * (world / n_scored)).backward()
                        loss_sum += s.detach().double().cpu()
                    flags = torch.tensor([float(loss_sum), 1.0 if stop.requested else 0.0], dtype=torch.float64,
                                         device=stats_device)
                    if use_ddp:
                        dist.all_reduce(flags)
                    loss = float(flags[0]) / n_scored
                    if not math.isfinite(loss):
                        status = "diverged"
                        message = (f"non-finite training loss ({loss}) at step {step + 1}: stopped before the update; "
                                   + (f"the last good checkpoint is {last_ckpt}" if last_ckpt is not None
                                      else "no checkpoint was written") +
                                   ". Lower lr, enable grad_clip, or use float32.")
                        opt.zero_grad(set_to_none=True)
                        break
                    if cfg.grad_clip is not None:
                        gnorm = float(torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip))
                    else:
                        gnorm = float(torch.linalg.vector_norm(torch.stack(
                            [torch.linalg.vector_norm(p.grad.float()) for p in params if p.grad is not None])))
                    if not math.isfinite(gnorm):
                        status = "diverged"
                        message = (f"non-finite gradient norm at step {step + 1} (loss {loss:.4g}): stopped before the "
                                   "update; " + (f"the last good checkpoint is {last_ckpt}" if last_ckpt is not None
                                                 else "no checkpoint was written") + ".")
                        opt.zero_grad(set_to_none=True)
                        break
                    lr = opt.param_groups[0]["lr"]
                    phase = "update"
                    opt.step()
                    sched.step()
                    opt.zero_grad(set_to_none=True)
                    phase = "idle"
                    step += 1
                    losses.append(loss)
                    dt = time.perf_counter() - t0
                    train_time += dt
                    tokens += task.tokens(batch)
                    tps = tokens / train_time if train_time > 0 else 0.0
                    if step % cfg.log_interval == 0 or step == cfg.steps:
                        log.write({"step": step, "split": "train", "loss": loss, "lr": lr, "grad_norm": gnorm,
                                   "tokens": tokens, "tokens_per_s": tps, "elapsed_s": time.perf_counter() - t_start})
                    if bar is not None:
                        bar.update(bar_task, completed=step, loss=f"{loss:.4f}", tps=f"{tps:,.0f}")
                    val = None
                    if cfg.eval_interval and step % cfg.eval_interval == 0 and step != cfg.steps:
                        val = run_eval(step)
                    if cfg.checkpoint_interval and step % cfg.checkpoint_interval == 0:
                        save(step)
                    if float(flags[1]) > 0:
                        raise KeyboardInterrupt
                    if callback is not None:
                        callback(StepInfo(step, loss, lr, gnorm, model, val))
        except KeyboardInterrupt:
            if phase == "update":  # interrupted inside optimizer.step: the parameters may be half-updated
                status = "interrupted"
                message = (f"interrupted during the update of step {step + 1}; the state is inconsistent so no "
                           f"checkpoint was written" + (f" (the last good one is {last_ckpt})" if last_ckpt else ""))
            else:
                opt.zero_grad(set_to_none=True)
                status = "interrupted"
                save(step)
                saved = f"; checkpoint saved to {last_ckpt}" if last_ckpt is not None else "; no out_dir, nothing saved"
                message = (f"interrupted at step {step}{saved}"
                           + (". Resume with --resume (resume='latest')" if ckpt_root is not None else ""))
        finally:
            if bar is not None:
                bar.stop()

        final = None
        if status == "completed":
            final = run_eval(step) if (not validation or validation[-1]["step"] != step) else validation[-1]
            save(step)
            message = f"completed {step} steps" + (f"; checkpoint {last_ckpt}" if last_ckpt is not None else "")
        elif status == "diverged":
            log.write({"step": step + 1, "split": "train", "loss": float("nan"), "event": "diverged"})
        if is_main and out_dir is not None:
            try:
                plot_metrics(read_metrics(out_dir / METRICS), out_dir / LOSS_PNG, bits=task.name == "bytes",
                             title=f"linattn train: {task.name}")
            except Exception as exc:  # a plot must not lose a finished run
                say(f"[yellow]could not draw {LOSS_PNG}: {exc}[/]")
        if progress:
            colour = {"completed": "green", "interrupted": "yellow", "diverged": "red"}[status]
            say(f"[{colour}]{message}[/]")
        return TrainResult(status=status, step=step, start_step=start_step, losses=losses, validation=validation,
                           final=final, model=model, config=cfg, out_dir=out_dir, checkpoint=last_ckpt, message=message,
                           elapsed_s=train_time, tokens=tokens, world_size=world, rank=rank)
