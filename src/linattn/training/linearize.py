"""The two training stages of linearization as tasks of the training loop (design §19), so that each
stage is a `linattn.training.train` run: packed documents, progress with time left, validation,
checkpoints and exact resume come with it. Both read the byte corpus as the `bytes` task does.

    attention-transfer  (stage 1) the student's new parameters (feature maps, window factors) learn
        to reproduce each linearized layer's softmax output on the teacher's own hidden states:
            loss = Σ_layers mean over features of (y_student(x_l) − y_teacher(x_l))², per token,
        where x_l is the input the teacher's layer l sees (captured by a forward hook; the teacher
        runs once per batch, no grad, nothing N×N kept) and every student layer runs on it, so the
        layers train in parallel. Only the recipe's new parameters take gradients.
    linearized-finetune (stage 2) next-token cross-entropy of the student (+ kl_weight · KL(teacher ‖
        student) on the next-byte distributions), with LoRA adapters (peft, rank r on the fused q/k/v
        projection and the output projection of every attention layer; the base weights frozen) or
        every weight trainable ("full"). `merge_lora` folds the adapters back into plain weights.

task_options: teacher (a linattn checkpoint folder with softmax layers), recipe (linattn.models.
linearized.RECIPES), layers (indices to linearize; default every softmax layer); stage 2 also
student (the stage-1 checkpoint or run folder; default: the naive swap), mode ("lora" / "full";
default the recipe's), lora_rank (8), lora_alpha (2·rank), kl_weight (0). The TrainConfig's `model`
is not used: the model is the teacher's with its layers changed.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..models.checkpoint import CheckpointError
from ..models.config import ModelConfig
from ..models.linearized import DEFAULT_RECIPE, RECIPES, linearized_layers, student_config, student_from_teacher
from ..models.lm import LinearTransformerLM, correct_predictions
from . import data as D, packing as P
from .tasks import BytesTask

#: the modules LoRA adapts: the fused q/k/v projection and the output projection of every layer
LORA_TARGETS = r"blocks\.\d+\.attn\.(qkv|out)"


def model_folder(path) -> Path:
    """The folder holding config.json and the weights: `path` itself, or the last checkpoint of a run
    folder (`linattn train --out`)."""
    from .checkpointing import find_checkpoint

    p = Path(path)
    return p if (p / "config.json").exists() else find_checkpoint(p)


def load_teacher(path, what: str = "teacher") -> LinearTransformerLM:
    """A linattn model from a checkpoint or run folder, in eval mode with no gradients."""
    try:
        model = LinearTransformerLM.from_pretrained(model_folder(path))
    except (FileNotFoundError, CheckpointError, ValueError, TypeError) as exc:
        raise ValueError(f"{what}: cannot load a linattn LM from {str(path)!r}: {exc}") from None
    model.eval().requires_grad_(False)
    return model


def _options(cfg, allowed: tuple) -> dict:
    opts = dict(cfg.task_options)
    unknown = sorted(set(opts) - set(allowed))
    if unknown:
        raise ValueError(f"task_options for {cfg.task!r}: unknown {unknown}; it takes {list(allowed)}")
    if "teacher" not in opts:
        raise ValueError(f"task_options for {cfg.task!r}: 'teacher' (a linattn checkpoint folder) is required")
    recipe = opts.get("recipe", DEFAULT_RECIPE)
    if recipe not in RECIPES:
        raise ValueError(f"task_options recipe must be one of {sorted(RECIPES)}, got {recipe!r}")
    return opts


class _LinearizeTask(BytesTask):
    """Shared by the two stages: the teacher, the recipe, the student's config."""

    bits = False
    shards_sequences = False
    allowed: tuple = ()

    def __init__(self, *, teacher, recipe=DEFAULT_RECIPE, layers=None, **kw):
        super().__init__(**kw)
        self.teacher_path, self.recipe, self.layers = str(teacher), recipe, layers
        self._teacher = None

    @classmethod
    def from_config(cls, cfg):
        opts = _options(cfg, cls.allowed)
        return cls(seq_len=cfg.seq_len, batch_size=cfg.batch_size, seed=cfg.seed, eval_batches=cfg.eval_batches,
                   corpus=cfg.corpus, corpus_max_bytes=cfg.corpus_max_bytes, val_fraction=cfg.val_fraction,
                   eval_batch_size=cfg.eval_batch_size, packing=True if cfg.packing is None else cfg.packing, **opts)

    @property
    def teacher(self) -> LinearTransformerLM:
        if self._teacher is None:
            self._teacher = load_teacher(self.teacher_path)
        return self._teacher

    def model_config(self, fields: dict, seed: int) -> ModelConfig:
        from ..models.checkpoint import read_config

        try:
            _, teacher_cfg, _ = read_config(model_folder(self.teacher_path), ModelConfig)
        except (FileNotFoundError, CheckpointError, ValueError, TypeError) as exc:
            raise ValueError(f"teacher: cannot read a linattn model config from {self.teacher_path!r}: {exc}") from None
        cfg = student_config(teacher_cfg, self.recipe, self.layers)
        if cfg.max_positions is not None and cfg.max_positions < self.seq_len:
            raise ValueError(f"the teacher takes at most {cfg.max_positions} positions, seq_len is {self.seq_len}")
        return cfg

    def describe(self) -> str:
        return f"{self.name}: recipe {self.recipe}, teacher {self.teacher_path}; " + super().describe()

    def _teacher_to(self, device) -> LinearTransformerLM:
        t = self.teacher
        if next(t.parameters()).device != device:
            t.to(device)
        return t


def _lm_inputs(batch):
    """(ids, forward kwargs) of an LM batch: a packed batch as one row with cu_seqlens."""
    if isinstance(batch, P.PackedBatch):
        return batch.inputs.reshape(1, -1), {"cu_seqlens": batch.cu_seqlens()}
    return batch.inputs, {}


class AttentionTransferTask(_LinearizeTask):
    """Stage 1 (module docstring)."""

    name = "attention-transfer"
    allowed = ("teacher", "recipe", "layers")

    def build_model(self, config: ModelConfig) -> nn.Module:
        student, new = student_from_teacher(self.teacher, self.recipe, self.layers)
        if not new:
            raise ValueError(f"recipe {self.recipe!r} adds no parameter: it has no attention-transfer stage")
        if student.config.to_dict() != config.to_dict():
            raise ValueError("the student built from the teacher differs from the run's model config")
        wanted = set(new)
        for n, p in student.named_parameters():
            p.requires_grad_(n in wanted)
        self.linearized = linearized_layers(self.teacher.config, self.layers)
        return student

    def scored(self, batch) -> int:
        return int((batch.targets != D.IGNORE_INDEX).sum())

    def loss_stats(self, model, batch, positions=None):
        student = getattr(model, "module", model)
        device = batch.inputs.device
        teacher = self._teacher_to(device)
        layers = getattr(self, "linearized", None) or linearized_layers(teacher.config, self.layers)
        seen: dict = {}
        hooks = [teacher.blocks[i].attn.register_forward_hook(
            lambda mod, args, kwargs, out, i=i: seen.__setitem__(i, (args, kwargs, out[0])), with_kwargs=True)
            for i in layers]
        ids, kw = _lm_inputs(batch)
        try:
            with torch.no_grad():
                teacher(ids, **kw)
        finally:
            for h in hooks:
                h.remove()
        keep = (batch.targets != D.IGNORE_INDEX).reshape(ids.shape)
        total = torch.zeros((), dtype=torch.float32, device=device)
        for i in layers:
            args, kwargs, target = seen[i]
            y, _ = student.blocks[i].attn(*args, **kwargs)
            err = (y.float() - target.float()).square().mean(-1)  # (B, N)
            total = total + err[keep].sum()
        return total, torch.zeros((), dtype=torch.long)

    def metrics(self, loss: float, correct: int, count: int) -> dict:
        return {"loss": loss, "mse": loss, "count": count}


class LinearizedFinetuneTask(_LinearizeTask):
    """Stage 2 (module docstring)."""

    name = "linearized-finetune"
    bits = True
    allowed = ("teacher", "recipe", "layers", "student", "mode", "lora_rank", "lora_alpha", "kl_weight")

    def __init__(self, *, student=None, mode=None, lora_rank=8, lora_alpha=None, kl_weight=0.0, **kw):
        super().__init__(**kw)
        self.student_path = None if student is None else str(student)
        self.mode = RECIPES[self.recipe].finetune if mode is None else mode
        if self.mode not in ("lora", "full"):
            raise ValueError(f"task_options mode must be 'lora' or 'full', got {self.mode!r}")
        if isinstance(lora_rank, bool) or not isinstance(lora_rank, int) or lora_rank < 1:
            raise ValueError(f"task_options lora_rank must be a positive integer, got {lora_rank!r}")
        self.lora_rank, self.lora_alpha = lora_rank, float(2 * lora_rank if lora_alpha is None else lora_alpha)
        if not (isinstance(kl_weight, (int, float)) and not isinstance(kl_weight, bool) and kl_weight >= 0):
            raise ValueError(f"task_options kl_weight must be a number >= 0, got {kl_weight!r}")
        self.kl_weight = float(kl_weight)

    def build_model(self, config: ModelConfig) -> nn.Module:
        if self.student_path is None:
            student, _ = student_from_teacher(self.teacher, self.recipe, self.layers)
        else:
            student = load_teacher(self.student_path, "student").requires_grad_(True).train()
        if student.config.to_dict() != config.to_dict():
            raise ValueError(f"student: {self.student_path} is not the {self.recipe} student of this teacher "
                             f"(its config differs)")
        if self.mode == "lora":
            student = add_lora(student, self.lora_rank, self.lora_alpha, seed=self.seed)
        else:
            student.requires_grad_(True)
        return student

    def loss_stats(self, model, batch, positions=None):
        ids, kw = _lm_inputs(batch)
        targets = batch.targets.reshape(ids.shape)
        if not (self.kl_weight and model.training):
            correct, loss = model(ids, targets=targets, return_logits=False, **kw)
            return loss, correct
        logits, loss = model(ids, targets=targets, **kw)
        keep = targets.flatten() != D.IGNORE_INDEX
        with torch.no_grad():
            t_logits, _ = self._teacher_to(ids.device)(ids, **kw)
        t_logp = F.log_softmax(t_logits.float().flatten(0, 1)[keep], -1)
        s_logp = F.log_softmax(logits.float().flatten(0, 1)[keep], -1)
        loss = loss + self.kl_weight * F.kl_div(s_logp, t_logp, log_target=True, reduction="sum")
        return loss, correct_predictions(logits, targets)


def add_lora(model: nn.Module, rank: int, alpha: float, seed: int = 0) -> nn.Module:
    """LoRA adapters (peft) of rank `rank` on LORA_TARGETS, the base weights frozen, in place. The
    adapters' A matrices are drawn from `seed` (B starts at 0, so the model is unchanged), so that a
    run and its resumption build the same model."""
    try:
        from peft import LoraConfig, inject_adapter_in_model
    except ImportError as exc:  # pragma: no cover - peft is a dependency of the linearize extra
        raise ImportError("LoRA needs the peft package: pip install 'linattn[linearize]'") from exc
    model.requires_grad_(False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        inject_adapter_in_model(LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=LORA_TARGETS),
                                model)
    for n, p in model.named_parameters():
        p.requires_grad_("lora_" in n)
    return model


def merge_lora(model: nn.Module) -> nn.Module:
    """Folds every LoRA adapter into its base weight and puts the plain layer back (in place): the
    model is again the student with plain weights, W ← W + (α/r)·B A."""
    from peft.tuners.lora import LoraLayer

    for name, module in list(model.named_modules()):
        if isinstance(module, LoraLayer):
            module.merge()
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, module.get_base_layer())
    return model


#: the linearization tasks a TrainConfig names
LINEARIZE_TASKS = {cls.name: cls for cls in (AttentionTransferTask, LinearizedFinetuneTask)}

__all__ = ["AttentionTransferTask", "LINEARIZE_TASKS", "LORA_TARGETS", "LinearizedFinetuneTask", "add_lora",
           "load_teacher", "merge_lora", "model_folder"]
