"""The configuration of a training run: TrainConfig, read from dicts, JSON and TOML files.

Validating a TrainConfig checks every field once, builds the run's task (training.tasks; no data
is read) and the ModelConfig with the task's sizes filled in (one feature-map build, to check its
options); both are kept, so `model_config()` and `make_task()` cost nothing afterwards.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from dataclasses import dataclass, field

from torch import nn

from .._checks import (
    check_bool,
    check_choice,
    check_device,
    check_int,
    check_number,
    check_seed,
    dataclass_from_dict,
    is_number,
)
from .._io import read_config_file
from ..models.checkpoint import CheckpointError
from ..models.lm import ModelConfig
from .linearize import LINEARIZE_TASKS
from .tasks import TASK_CLASSES as BASE_TASKS, BytesTask, Task

#: every task a TrainConfig can name: training.tasks' and the two stages of linearization
TASK_CLASSES = {**BASE_TASKS, **LINEARIZE_TASKS}

TASKS = tuple(TASK_CLASSES)
DTYPES = ("float32", "bfloat16")
DISTRIBUTED = ("auto", "on", "off")

# Fields that may differ between a checkpoint's config and the config that resumes it: they do not
# change the trajectory (grad_accum and the process count keep the global batch) or only extend it.
RESUMABLE_CHANGES = frozenset({
    "steps", "stop_accuracy", "grad_accum", "device", "eval_interval", "eval_batches", "eval_samples", "eval_batch_size",
    "log_interval", "out_dir", "checkpoint_interval", "keep_checkpoints", "resume", "distributed", "backend",
    "dist_timeout_s", "activation_checkpointing",
})


@dataclass
class TrainConfig:
    """Everything that defines a training run. Round-trips through dicts, JSON and TOML files.

    model: ModelConfig fields (a dict). Left unset, `vocab_size` (and `num_classes` for ListOps)
        come from the task, `max_len` is the task's sequence length, `seed` is `seed`.
    task: "bytes" (byte-level LM on `corpus`), "copy", "mqar" (decoder LM), "listops" (encoder
        classifier); task_options go to the generator in linattn.training.data (copy_task: max_len,
        n_symbols, min_len; mqar_task: seq_len, n_pairs, vocab_size, power_a, random_non_queries;
        listops_task: max_depth, max_args, min_len, max_len).
    corpus / corpus_max_bytes / val_fraction / seq_len: the byte corpus (None: the Python standard
        library) and its window length; task "bytes" only.
    packing: pack documents (one corpus file = one document) into full rows and keep them apart
        with cu_seqlens (linattn.training.packing): no padding, no state or prediction across
        documents. None (default): on for task "bytes" (off with sequence_parallel > 1); True is
        for task "bytes" only.
    batch_size: the *global* batch in sequences per optimizer step (over all processes and
        accumulation micro-steps); it must be divisible by world_size · grad_accum.
    lr, min_lr_ratio, warmup_steps: linear warm-up from 0 to lr over warmup_steps, then cosine decay
        to lr·min_lr_ratio at `steps`. weight_decay (matrices and embeddings only; norms, biases
        and 1-D parameters get none), betas, eps: AdamW. grad_clip: max global gradient norm (None: off).
    dtype: "float32", or "bfloat16" for bf16 autocast (weights and optimizer stay float32).
    eval_interval: validate every that many steps (0: only at the end); eval_batches (bytes task:
        number of validation batches) / eval_samples (synthetic tasks: size of the fixed
        validation set) / eval_batch_size (default batch_size).
    stop_accuracy: stop early after the first validation (every eval_interval steps) whose accuracy
        reaches it, in (0, 1] (None: run all `steps`); the run completes there with
        TrainResult.stopped_early set. Needs eval_interval > 0. The schedule is not stretched: the
        run stops where the full run would be at that step.
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
    packing: bool | None = None
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
    stop_accuracy: float | None = None
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
        _check_fields(self)
        if self.sequence_parallel > 1 and not TASK_CLASSES[self.task].shards_sequences:
            lm = ", ".join(name for name, cls in TASK_CLASSES.items() if cls.shards_sequences)
            raise ValueError(f"sequence_parallel > 1 needs an LM task ({lm}); the {self.task} model pools over the "
                             "whole sequence")
        self._task = TASK_CLASSES[self.task].from_config(self)
        self._model_config = self._task.model_config(self.model, self.seed)

    # ---- derived
    def model_config(self) -> ModelConfig:
        """The ModelConfig of the run: `model` with the task's defaults filled in (a copy of the one
        built when the config was validated)."""
        return copy.deepcopy(self._model_config)

    def check_resumable(self, saved: dict, where) -> None:
        """ValueError unless the config `saved` with a checkpoint (at `where`) differs from this one
        only in RESUMABLE_CHANGES; model fields compare after the task's defaults are filled in."""
        try:
            saved_cfg = TrainConfig.from_dict(saved)
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"checkpoint {where}: its training config is not readable: {exc}") from None
        a, b = saved_cfg.to_dict(), self.to_dict()
        a["model"], b["model"] = saved_cfg.model_config().to_dict(), self.model_config().to_dict()
        diff = {k: (a[k], b[k]) for k in a if k not in RESUMABLE_CHANGES and a[k] != b[k]}
        if diff:
            desc = "; ".join(f"{k}: checkpoint {x!r}, now {y!r}" for k, (x, y) in sorted(diff.items()))
            raise ValueError(f"cannot resume from {where} with a different training setup ({desc}). Use the same "
                             f"config (only {', '.join(sorted(RESUMABLE_CHANGES))} may change)")

    # ---- (de)serialization
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        return dataclass_from_dict(cls, d, "training config")

    def __reduce__(self):  # pickled as its fields; the task and model config are rebuilt
        return TrainConfig.from_dict, (self.to_dict(),)

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


def _check_fields(cfg: TrainConfig) -> None:
    """Checks every field of `cfg` (normalizing corpus, betas, grad_clip 0, out_dir and resume)."""
    if not isinstance(cfg.model, dict):
        raise ValueError(f"model must be a dict of ModelConfig fields, got {type(cfg.model).__name__}")
    cfg.model = dict(cfg.model)
    check_choice("task", cfg.task, TASKS)
    if not isinstance(cfg.task_options, dict):
        raise ValueError(f"task_options must be a dict, got {type(cfg.task_options).__name__}")
    cfg.task_options = dict(cfg.task_options)
    if cfg.corpus is not None:
        if isinstance(cfg.corpus, (str, os.PathLike)):
            cfg.corpus = [cfg.corpus]
        if not isinstance(cfg.corpus, (list, tuple)) or not cfg.corpus:
            raise ValueError(f"corpus must be None or a non-empty list of paths, got {cfg.corpus!r}")
        cfg.corpus = [str(p) for p in cfg.corpus]
    for name in ("seq_len", "batch_size", "grad_accum", "steps", "eval_batches", "eval_samples", "log_interval",
                 "keep_checkpoints", "sequence_parallel"):
        check_int(name, getattr(cfg, name), minimum=1)
    for name in ("warmup_steps", "eval_interval", "checkpoint_interval"):
        check_int(name, getattr(cfg, name), minimum=0)
    for name in ("corpus_max_bytes", "eval_batch_size"):
        check_int(name, getattr(cfg, name), minimum=1, allow_none=True)
    check_seed("seed", cfg.seed)
    check_number("lr", cfg.lr, minimum=0, low_open=True)
    check_number("min_lr_ratio", cfg.min_lr_ratio, minimum=0, maximum=1)
    check_number("val_fraction", cfg.val_fraction, minimum=0, maximum=1, low_open=True, high_open=True)
    check_number("weight_decay", cfg.weight_decay, minimum=0)
    check_number("stop_accuracy", cfg.stop_accuracy, minimum=0, maximum=1, low_open=True, allow_none=True)
    if cfg.stop_accuracy is not None and cfg.eval_interval == 0:
        raise ValueError(f"stop_accuracy={cfg.stop_accuracy} needs validations during the run: set eval_interval > 0 "
                         "(it is 0: only a final validation)")
    if not (isinstance(cfg.betas, (list, tuple)) and len(cfg.betas) == 2
            and all(is_number(b) and 0 <= b < 1 for b in cfg.betas)):
        raise ValueError(f"betas must be two numbers in [0, 1), got {cfg.betas!r}")
    cfg.betas = [float(b) for b in cfg.betas]
    check_number("eps", cfg.eps, minimum=0, low_open=True)
    if cfg.grad_clip == 0 and is_number(cfg.grad_clip):
        cfg.grad_clip = None  # TOML has no null: 0 turns clipping off
    if cfg.grad_clip is not None and not (is_number(cfg.grad_clip) and cfg.grad_clip > 0):
        raise ValueError(f"grad_clip must be None (or 0: off) or a positive number, got {cfg.grad_clip!r}")
    if cfg.dtype not in DTYPES:
        hint = " (float16 would need loss scaling; use bfloat16)" if cfg.dtype == "float16" else ""
        raise ValueError(f"dtype must be one of {DTYPES}, got {cfg.dtype!r}{hint}")
    check_bool("activation_checkpointing", cfg.activation_checkpointing)
    if cfg.packing is not None:
        check_bool("packing", cfg.packing)
        if cfg.packing and not issubclass(TASK_CLASSES.get(cfg.task, Task), BytesTask):
            raise ValueError(f"packing=True is for task 'bytes' and the linearization stages (documents of a "
                             f"corpus), got task {cfg.task!r}")
        if cfg.packing and cfg.sequence_parallel > 1:
            raise ValueError("packing=True does not combine with sequence_parallel > 1 (cu_seqlens takes no shards)")
    check_device("device", cfg.device)
    check_choice("distributed", cfg.distributed, DISTRIBUTED)
    check_choice("backend", cfg.backend, (None, "gloo", "nccl"))
    check_number("dist_timeout_s", cfg.dist_timeout_s, minimum=0, low_open=True)
    if cfg.out_dir is not None:
        cfg.out_dir = str(cfg.out_dir)
    if cfg.resume is not None:
        cfg.resume = str(cfg.resume)


def load_config_file(path) -> dict:
    """A config file as a dict: TOML (`.toml`, via tomllib, or tomli on Python 3.10) or JSON (any
    other suffix). Top-level keys are TrainConfig fields; `[model]` and `[task_options]` tables."""
    return read_config_file(path)


def make_task(cfg: TrainConfig) -> Task:
    """The run's task (built once, when the config was validated)."""
    return cfg._task


def build_model(cfg: TrainConfig) -> nn.Module:
    """The model of the run: LinearTransformerEncoder for ListOps, LinearTransformerLM otherwise."""
    return make_task(cfg).build_model(cfg.model_config())
