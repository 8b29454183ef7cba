"""The training loop: `train(config)` runs (or resumes) a run and returns a TrainResult.

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

With sequence parallelism each process keeps, of its rows, the contiguous shard of every sequence
that linattn.parallel.shard_bounds gives it, and passes the shard's global positions to the model.

Randomness inside a step (dropout) comes from the global torch RNG, re-seeded at every step from
(seed, step, rank) inside `torch.random.fork_rng`, so a resumed run draws the same masks as an
uninterrupted one and the caller's RNG is left as it was.

Stopping: Ctrl-C (SIGINT) sets a flag checked after each step (all processes agree on it through the
per-step all-reduce); the run saves a checkpoint and returns status "interrupted" (CLI exit 130). A
second Ctrl-C interrupts at once (inside the optimizer update: no checkpoint, the state would be
half-updated). A KeyboardInterrupt raised elsewhere (e.g. from `callback`) is handled the same way.
With `stop_accuracy`, the run also ends, as "completed" with `stopped_early`, after the first
validation whose accuracy reaches it (rank 0 validates; every process learns the answer).
A non-finite loss or gradient stops the run before the update, writes no checkpoint for that step,
and returns status "diverged" (CLI exit 3) with a message naming the step.

Data parallelism: launched with `torchrun --nproc-per-node N -m linattn.cli train ...` the run uses
DistributedDataParallel (training.processes); only rank 0 writes files and reports progress.
"""

from __future__ import annotations

import contextlib
import math
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from .data import mix_seed
from ..parallel import shard_bounds
from .checkpointing import (CHECKPOINTS, Checkpointer, load_training_checkpoint, read_trainer_doc, resume_point,
                            set_rng_state)
from .config import TrainConfig, make_task
from .metrics import LOSS_PNG, METRICS, MetricsLog, plot_metrics, read_metrics
from .optim import make_optimizer
from .processes import Processes, processes_for
from .progress import ProgressDisplay, Reporter, RunInfo
from .tasks import autocast, evaluate

EXIT_INTERRUPTED = 130
EXIT_DIVERGED = 3
CONFIG_OUT = "train_config.json"


@dataclass
class StepInfo:
    """What `callback` receives after every optimizer step (step = steps done so far)."""

    step: int
    loss: float
    lr: float
    grad_norm: float
    model: nn.Module
    validation: dict | None = None
    tokens_per_s: float = 0.0


@dataclass
class TrainResult:
    """What `train` returns.

    status: "completed", "interrupted" (Ctrl-C / KeyboardInterrupt; a checkpoint was saved when
    out_dir is set) or "diverged" (non-finite loss or gradient; nothing saved for that step).
    step: optimizer steps done in total (resumed steps included). losses: the training loss of each
    step run by this call, in order (losses[i] belongs to step start_step + i + 1).
    validation: [{"step", "loss", "accuracy", ("bpb")}, ...]; final: the last one (metrics of the
    returned model at the end of a completed run). model: the trained model (unwrapped).
    stopped_early: the run completed before `steps` because a validation reached stop_accuracy
    (status "completed", step < config.steps).
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
    stopped_early: bool = False

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


class _Diverged(Exception):
    """A non-finite loss or gradient norm: the run stops before the update of the step."""

    def __init__(self, what: str, detail: str = "", hint: str = "."):
        super().__init__(what)
        self.what, self.detail, self.hint = what, detail, hint

    def message(self, step: int, last: Path | None) -> str:
        kept = f"the last good checkpoint is {last}" if last is not None else "no checkpoint was written"
        return f"{self.what} at step {step + 1}{self.detail}: stopped before the update; {kept}{self.hint}"


class _UpdateInterrupted(KeyboardInterrupt):
    """Ctrl-C inside the optimizer update: the parameters may be half-updated."""


def _forward_backward(model: nn.Module, task, batch, cfg: TrainConfig, procs: Processes, device, stop) -> tuple:
    """Accumulates in .grad the gradient of the mean loss over every scored target of the global
    `batch` (this process's rows, or with sequence parallelism its shard of them, in grad_accum
    micro-batches). Returns (that mean loss over all processes, whether any process asked to stop)."""
    n_scored = max(1, task.scored(batch))
    per_rank = cfg.batch_size // procs.dp_size
    micro = per_rank // cfg.grad_accum
    mine = task.rows(batch, procs.dp_rank * per_rank, (procs.dp_rank + 1) * per_rank)
    positions = None
    if procs.groups is not None:
        start, end = shard_bounds(mine.inputs.shape[1], procs.groups.sp_rank, procs.groups.sp_size)
        mine, positions = task.columns(mine, start, end), torch.arange(start, end, device=device)
    loss_sum = torch.zeros((), dtype=torch.float64)
    for m in range(cfg.grad_accum):
        mb = task.rows(mine, m * micro, (m + 1) * micro).to(device)
        sync = not procs.ddp or m == cfg.grad_accum - 1  # DDP all-reduces the gradients once, at the last
        with contextlib.nullcontext() if sync else model.no_sync():
            with autocast(device, cfg.dtype):
                s, _ = task.loss_stats(model, mb, positions)
            (s * (procs.world / n_scored)).backward()
        loss_sum += s.detach().double().cpu()
    total, stops = procs.sum([float(loss_sum), 1.0 if stop.requested else 0.0], device)
    return total / n_scored, stops > 0


def _grad_norm(params: list, clip: float | None) -> float:
    """The global gradient norm, after clipping it to `clip` (None: no clipping)."""
    if clip is not None:
        return float(torch.nn.utils.clip_grad_norm_(params, clip))
    return float(torch.linalg.vector_norm(torch.stack(
        [torch.linalg.vector_norm(p.grad.float()) for p in params if p.grad is not None])))


def _update(opt, sched) -> None:
    try:
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    except KeyboardInterrupt as exc:
        raise _UpdateInterrupted from exc


def _resume(path: Path, cfg: TrainConfig, model, opt, sched, task) -> tuple[int, dict]:
    """Loads checkpoint `path` into the run (weights, optimizer, schedule, data position) after
    checking that it was written by the same setup; returns (its step, its RNG state)."""
    cfg.check_resumable(read_trainer_doc(path)["train_config"], path)
    doc = load_training_checkpoint(path, model, opt, sched, restore_rng=False)
    step = int(doc["step"])
    task.check_data_state(doc["data"], step)
    if step > cfg.steps:
        raise ValueError(f"checkpoint {path} is at step {step}, beyond steps={cfg.steps}")
    return step, doc["rng"]


def _check_fits(cfg: TrainConfig, procs: Processes, device: torch.device) -> None:
    """The global batch splits into the replicas' micro-batches; bf16 runs on this device."""
    if cfg.batch_size % (procs.dp_size * cfg.grad_accum):
        raise ValueError(f"batch_size={cfg.batch_size} (global) must be divisible by data-parallel replicas × "
                         f"grad_accum = {procs.dp_size} × {cfg.grad_accum}")
    if cfg.dtype == "bfloat16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ValueError("dtype='bfloat16' but this GPU does not support bf16; use float32")


class _Validation:
    """The run's validations: rank 0 evaluates whole sequences, alone (sequence parallelism is
    switched off meanwhile), logs and reports the metrics; `records` holds them by step."""

    def __init__(self, model, task, procs: Processes, device, dtype: str, log: MetricsLog, reporter: Reporter):
        self.model, self.task, self.procs, self.device, self.dtype = model, task, procs, device, dtype
        self.log, self.reporter, self.records = log, reporter, []

    def __call__(self, step: int) -> dict | None:
        if not self.procs.main:
            return None
        groups = self.procs.groups
        self.model.set_sequence_parallel_group(None)
        try:
            metrics = evaluate(self.model, self.task, device=self.device, dtype=self.dtype)
        finally:
            self.model.set_sequence_parallel_group(None if groups is None else groups.sequence)
        self.records.append({"step": step, "split": "validation", **metrics})
        self.log.write(self.records[-1])
        self.reporter.validation(step, metrics)
        return metrics


def _reached(metrics: dict | None, target: float | None, procs: Processes, device) -> bool:
    """Whether the validation `metrics` (rank 0's; None elsewhere) reached accuracy `target`: every
    process gets rank 0's answer (one all-reduce with DDP). False when target is None."""
    if target is None:
        return False
    reached = metrics is not None and metrics["accuracy"] >= target
    return procs.sum([1.0 if reached else 0.0], device)[0] > 0


def _interrupted(step: int, ckpts: Checkpointer, during_update: bool) -> str:
    if during_update:
        return (f"interrupted during the update of step {step + 1}; the state is inconsistent so no checkpoint was "
                "written" + (f" (the last good one is {ckpts.last})" if ckpts.last else ""))
    saved = f"; checkpoint saved to {ckpts.last}" if ckpts.last is not None else "; no out_dir, nothing saved"
    resume = ". Resume with --resume (resume='latest')" if ckpts.root is not None else ""
    return f"interrupted at step {step}{saved}{resume}"


def _run_info(cfg: TrainConfig, model, task, procs: Processes, device, resumed_from, start_step) -> RunInfo:
    return RunInfo(type(model).__name__, sum(p.numel() for p in model.parameters()), task.describe(), procs.world,
                   None if procs.groups is None else f"{procs.dp_size} data × {cfg.sequence_parallel} sequence parallel",
                   str(device), cfg.batch_size, None if resumed_from is None else str(resumed_from), start_step,
                   cfg.steps)


def _completed(step: int, cfg: TrainConfig, final: dict | None, checkpoint, stopped_early: bool) -> str:
    """The message of a completed run (stopped early at stop_accuracy or not)."""
    where = f"; checkpoint {checkpoint}" if checkpoint is not None else ""
    if not stopped_early:
        return f"completed {step} steps{where}"
    reached = f" {final['accuracy']:.4f}" if final is not None else ""  # rank 0 validated
    return (f"stopped early after {step} of {cfg.steps} steps: validation accuracy{reached} >= "
            f"stop_accuracy {cfg.stop_accuracy:g}{where}")


def _plot(out_dir: Path, task, reporter) -> None:
    """The loss curves of the metrics log, drawn next to it; a failure is a note, never a lost run."""
    try:
        plot_metrics(read_metrics(out_dir / METRICS), out_dir / LOSS_PNG, bits=task.bits,
                     title=f"linattn train: {task.name}")
    except Exception as exc:
        reporter.note(f"could not draw {LOSS_PNG}: {exc}")


def train(config: TrainConfig, *, progress: bool = True, callback: Callable[[StepInfo], Any] | None = None,
          console=None) -> TrainResult:
    """Runs (or resumes) the training described by `config`; see the module docstring.

    progress: show a progress bar (loss, tokens/s, ETA) and messages on rank 0 (on `console`; see
    training.progress). callback(StepInfo) runs after each optimizer step (after its checkpoint, if
    one was due); raising KeyboardInterrupt from it stops the run like Ctrl-C. Returns a TrainResult
    (status, losses, validation metrics, the model, the checkpoint path); a run that stops early
    returns too, with status "interrupted" or "diverged" and a message.
    """
    if not isinstance(config, TrainConfig):
        raise TypeError(f"config must be a TrainConfig, got {type(config).__name__}")
    cfg = config
    with processes_for(cfg) as procs:
        device = procs.device(cfg.device)
        _check_fits(cfg, procs, device)
        resumed_from, out_dir = resume_point(cfg.resume, None if cfg.out_dir is None else Path(cfg.out_dir))

        # config -> task -> model, optimizer (-> the checkpoint's state when resuming)
        task = make_task(cfg)
        task.load_data()
        model = task.build_model(cfg.model_config()).to(device)
        opt, sched = make_optimizer(model, cfg)
        start_step, resume_rng = 0, None
        if resumed_from is not None:
            start_step, resume_rng = _resume(resumed_from, cfg, model, opt, sched, task)
        model.set_activation_checkpointing(cfg.activation_checkpointing)
        model.train()
        if procs.groups is not None:
            model.set_sequence_parallel_group(procs.groups.sequence)
        step_model = procs.wrap(model, device)
        params = [p for p in model.parameters() if p.requires_grad]

        # what the run writes and shows
        writes = procs.main and out_dir is not None
        if writes:
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / CONFIG_OUT).write_text(cfg.to_json() + "\n", encoding="utf-8")
        log = MetricsLog(out_dir / METRICS if writes else None, start_step if resumed_from is not None else None)
        ckpts = Checkpointer(None if out_dir is None else out_dir / CHECKPOINTS, cfg.keep_checkpoints, main=procs.main,
                             resumed_from=resumed_from, resumed_step=start_step if resumed_from is not None else -1)
        reporter = ProgressDisplay(console) if progress and procs.main else Reporter()
        reporter.start(_run_info(cfg, model, task, procs, device, resumed_from, start_step))
        validate = _Validation(model, task, procs, device, cfg.dtype, log, reporter)
        step, losses, tokens, train_time = start_step, [], 0, 0.0
        stopped_early = False
        status, message = "completed", ""
        t_start = time.perf_counter()
        with _StopFlag() as stop:  # installed through the final validation and save
            try:
                with torch.random.fork_rng(devices=[device.index] if device.type == "cuda" else []):
                    if resume_rng:
                        set_rng_state(resume_rng)
                    while step < cfg.steps:
                        t0 = time.perf_counter()
                        torch.manual_seed(mix_seed(cfg.seed, "step", step, procs.rank))  # dropout masks
                        batch = task.train_batch(step)
                        loss, stop_all = _forward_backward(step_model, task, batch, cfg, procs, device, stop)
                        if not math.isfinite(loss):
                            raise _Diverged(f"non-finite training loss ({loss})",
                                            hint=". Lower lr, enable grad_clip, or use float32.")
                        grad_norm = _grad_norm(params, cfg.grad_clip)
                        if not math.isfinite(grad_norm):
                            raise _Diverged("non-finite gradient norm", detail=f" (loss {loss:.4g})")
                        lr = opt.param_groups[0]["lr"]
                        _update(opt, sched)
                        step += 1
                        losses.append(loss)
                        train_time += time.perf_counter() - t0
                        tokens += task.tokens(batch)
                        info = StepInfo(step, loss, lr, grad_norm, model,
                                        tokens_per_s=tokens / train_time if train_time > 0 else 0.0)
                        if step % cfg.log_interval == 0 or step == cfg.steps:
                            log.write({"step": step, "split": "train", "loss": loss, "lr": lr, "grad_norm": grad_norm,
                                       "tokens": tokens, "tokens_per_s": info.tokens_per_s,
                                       "elapsed_s": time.perf_counter() - t_start})
                        reporter.step(info)
                        if cfg.eval_interval and step % cfg.eval_interval == 0 and step != cfg.steps:
                            info.validation = validate(step)
                            stopped_early = _reached(info.validation, cfg.stop_accuracy, procs, device)
                        if cfg.checkpoint_interval and step % cfg.checkpoint_interval == 0:
                            ckpts.save(step, model, opt, sched, task, cfg)
                        if stop_all:
                            raise KeyboardInterrupt
                        if callback is not None:
                            callback(info)
                        if stopped_early:
                            break
            except _Diverged as exc:
                opt.zero_grad(set_to_none=True)
                status, message = "diverged", exc.message(step, ckpts.last)
            except _UpdateInterrupted:  # the parameters may be half-updated: no checkpoint
                status, message = "interrupted", _interrupted(step, ckpts, during_update=True)
            except KeyboardInterrupt:
                opt.zero_grad(set_to_none=True)
                ckpts.save(step, model, opt, sched, task, cfg)
                status, message = "interrupted", _interrupted(step, ckpts, during_update=False)
            finally:
                reporter.close()

            final = None
            if status == "completed":
                done = validate.records
                final = validate(step) if (not done or done[-1]["step"] != step) else done[-1]
                ckpts.save(step, model, opt, sched, task, cfg)
                message = _completed(step, cfg, final if stopped_early else None, ckpts.last, stopped_early)
            elif status == "diverged":
                log.write({"step": step + 1, "split": "train", "loss": float("nan"), "event": "diverged"})
            if writes:
                _plot(out_dir, task, reporter)
            reporter.finish(status, message)
            return TrainResult(status=status, step=step, start_step=start_step, losses=losses,
                               validation=validate.records, final=final, model=model, config=cfg, out_dir=out_dir,
                               checkpoint=ckpts.last, message=message, elapsed_s=train_time, tokens=tokens,
                               world_size=procs.world, rank=procs.rank, stopped_early=stopped_early)
