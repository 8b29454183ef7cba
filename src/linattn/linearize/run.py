"""`linearize(config)`: a softmax teacher turned into a linear-attention model that decodes as an RNN,
in two `linattn.training.train` runs and a report (design §19):

    out/stage1/   attention transfer (recipes with new parameters): a training run folder
    out/stage2/   fine-tuning (LoRA through peft, or every weight): a training run folder
    out/model/    the linearized model, adapters merged: config.json + model.safetensors, a plain
                  linattn LM (`LinearTransformerLM.from_pretrained`, `linattn.hf` converts it)
    out/linearize.{json,md,png}   teacher, naive swap, stage 1, stage 2: bits per byte, the recall
                  probe, decode ms/token and cache bytes by context, the share of the gap recovered

Each stage resumes where it stopped (`resume="auto"` of its run: exact resume, the checkpoint's
data position and RNG), so running the same command again after Ctrl-C continues; a stage that
completed is not run again.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path

from .._checks import check_choice, check_int, check_number
from .._io import atomic_write
from ..models.checkpoint import save_pretrained
from ..models.linearized import DEFAULT_RECIPE, RECIPES, student_from_teacher
from ..training import TrainConfig, train
from ..training.linearize import load_teacher, merge_lora
from . import evaluate as E

__all__ = ["LinearizeConfig", "LinearizeInterrupted", "linearize"]


class LinearizeInterrupted(KeyboardInterrupt):
    """A stage stopped on Ctrl-C (its checkpoint saved); the same call again resumes it."""


#: stage 2's learning rate by mode when none is given: LoRA 3e-3 (on the byte-LM experiment's lolcats
#: seed 0, 150 steps: 1.881 bpb at 1e-3, 1.843 at 3e-3; teacher 1.820), full fine-tuning 1e-3
FINETUNE_LR = {"lora": 3e-3, "full": 1e-3}


@dataclass
class LinearizeConfig:
    """teacher: a linattn checkpoint or run folder whose layers (some or all) are softmax, or a
    transformers Llama / Mistral / Qwen2 / Qwen3 / GPT-2 folder (converted first); recipe: a
    name of linattn.models.linearized.RECIPES; layers: the softmax layers to linearize (None: all);
    out: the output folder. Stage sizes: seq_len, batch_size, transfer_steps / transfer_lr (stage 1),
    finetune_steps / finetune_lr (stage 2; None: FINETUNE_LR of the mode), mode ("lora" / "full";
    None: the recipe's), lora_rank,
    kl_weight (KL to the teacher's next-byte distribution in stage 2). corpus / corpus_max_bytes: the
    byte corpus (None: Python's standard library). Report: eval_batches (validation batches for
    bpb), contexts (decode lengths), recall (probe examples). threads: torch threads (None: as is)."""

    teacher: str
    out: str
    recipe: str = DEFAULT_RECIPE
    layers: list | None = None
    seq_len: int = 512
    batch_size: int = 8
    transfer_steps: int = 200
    transfer_lr: float = 1e-2
    finetune_steps: int = 200
    finetune_lr: float | None = None
    mode: str | None = None
    lora_rank: int = 8
    kl_weight: float = 0.0
    corpus: list | None = None
    corpus_max_bytes: int | None = None
    seed: int = 0
    device: str = "cpu"
    eval_batches: int = 16
    contexts: tuple = (1024, 4096)
    recall: int = 64
    checkpoint_interval: int = 50

    def __post_init__(self):
        check_choice("recipe", self.recipe, tuple(RECIPES))
        for name in ("seq_len", "batch_size", "transfer_steps", "finetune_steps", "lora_rank", "eval_batches",
                     "recall", "checkpoint_interval"):
            check_int(name, getattr(self, name), minimum=1)
        check_choice("mode", self.mode, (None, "lora", "full"))
        if self.finetune_lr is None:
            self.finetune_lr = FINETUNE_LR[self.mode or RECIPES[self.recipe].finetune]
        for name in ("transfer_lr", "finetune_lr"):
            check_number(name, getattr(self, name), minimum=0, low_open=True)
        check_number("kl_weight", self.kl_weight, minimum=0)
        self.contexts = tuple(self.contexts)
        for c in self.contexts:
            check_int("contexts", c, minimum=1)
        self.teacher, self.out = str(self.teacher), str(self.out)


def _stage_config(cfg: LinearizeConfig, task: str, options: dict, steps: int, lr: float, out: Path) -> TrainConfig:
    return TrainConfig(task=task, model={}, task_options={"teacher": cfg.teacher, "recipe": cfg.recipe,
                                                          **({"layers": cfg.layers} if cfg.layers else {}), **options},
                       corpus=cfg.corpus, corpus_max_bytes=cfg.corpus_max_bytes, seq_len=cfg.seq_len,
                       batch_size=cfg.batch_size, steps=steps, lr=lr, warmup_steps=max(1, steps // 10),
                       min_lr_ratio=0.1, weight_decay=0.0, eval_interval=0, eval_batches=cfg.eval_batches,
                       seed=cfg.seed, device=cfg.device, out_dir=str(out), resume="auto",
                       checkpoint_interval=cfg.checkpoint_interval, distributed="off")


def _run_stage(tc: TrainConfig, progress: bool, console):
    res = train(tc, progress=progress, console=console)
    if res.status == "interrupted":
        raise LinearizeInterrupted(f"stopped in {tc.out_dir} at step {res.step} (checkpoint saved): run the same "
                                   "command again to resume")
    if res.status != "completed":
        raise RuntimeError(f"{tc.task} in {tc.out_dir}: {res.status}: {res.message}")
    return res


def _metrics(path: Path) -> list[dict]:
    f = path / "metrics.jsonl"
    if not f.exists():
        return []
    return [json.loads(line) for line in f.read_text(encoding="utf-8").splitlines() if line.strip()]


def linearize(cfg: LinearizeConfig, *, progress: bool = True, console=None) -> dict:
    """Runs (or resumes) both stages, writes out/model and the report; returns the report dict."""
    t0 = time.perf_counter()
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    recipe = RECIPES[cfg.recipe]
    cfg = dataclasses.replace(cfg, teacher=str(prepare_teacher(cfg.teacher, out)))
    teacher = load_teacher(cfg.teacher)
    stages = {}
    student_path = None
    if recipe.transfer:
        stages["stage1"] = _run_stage(_stage_config(cfg, "attention-transfer", {}, cfg.transfer_steps,
                                                    cfg.transfer_lr, out / "stage1"), progress, console)
        student_path = str(out / "stage1")
    options = {"kl_weight": cfg.kl_weight, "lora_rank": cfg.lora_rank, **({"mode": cfg.mode} if cfg.mode else {}),
               **({"student": student_path} if student_path else {})}
    stages["stage2"] = _run_stage(_stage_config(cfg, "linearized-finetune", options, cfg.finetune_steps,
                                                cfg.finetune_lr, out / "stage2"), progress, console)
    final = merge_lora(stages["stage2"].model).eval()
    atomic_write(out / "model", lambda tmp: save_pretrained(final, tmp))

    models = {"teacher": teacher, "naive swap": student_from_teacher(teacher, cfg.recipe, cfg.layers)[0]}
    if recipe.transfer:
        models["stage 1"] = load_teacher(out / "stage1", "stage 1")
    models["stage 2"] = final
    report = evaluate_models(models, cfg)
    report.update(config=dataclasses.asdict(cfg), recipe={"name": recipe.name, "kind": recipe.kind, "cite": recipe.cite,
                                                           "transfer": recipe.transfer, "finetune": cfg.mode or recipe.finetune},
                  tokens={name: res.tokens for name, res in stages.items()},
                  curves={name: _metrics(out / name) for name in stages}, wall_s=time.perf_counter() - t0,
                  parameters={"student": sum(p.numel() for p in final.parameters()),
                              "teacher": sum(p.numel() for p in teacher.parameters())})
    from .report import write_report

    write_report(report, out)
    return report


def prepare_teacher(path, out: Path) -> Path:
    """The teacher as a linattn checkpoint folder: `path` itself, or for a transformers causal-LM
    folder (Llama, Mistral, Qwen2, Qwen3, GPT-2; linattn.hf.teacher) its conversion, written once to
    out/teacher-linattn."""
    from ..hf.teacher import is_transformers_folder

    if not is_transformers_folder(path):
        return Path(path)
    target = out / "teacher-linattn"
    if not (target / "config.json").exists():
        from ..hf.teacher import load_teacher as load_hf

        lm = load_hf(path)
        atomic_write(target, lambda tmp: save_pretrained(lm, tmp))
    return target


def evaluate_models(models: dict, cfg: LinearizeConfig) -> dict:
    """{"rows": [{"model", "bpb", "recall", "recovered"}], "decode": {model: decode_costs}} for the
    teacher and each stage, on the same data."""
    rows = []
    for name, m in models.items():
        m.eval()
        copy = E.recall_accuracy(m, cfg.corpus, cfg.corpus_max_bytes, n_examples=cfg.recall, seed=cfg.seed)
        rows.append({"model": name, "bpb": E.bpb(m, seq_len=cfg.seq_len, corpus=cfg.corpus,
                                                  corpus_max_bytes=cfg.corpus_max_bytes, eval_batches=cfg.eval_batches,
                                                  batch_size=cfg.batch_size),
                     "recall": copy["second"], "recall_gain": copy["gain"]})
    by = {r["model"]: r["bpb"] for r in rows}
    for r in rows:
        r["recovered"] = None if r["model"] in ("teacher", "naive swap") else E.recovered(by["naive swap"], r["bpb"],
                                                                                            by["teacher"])
    decode = {name: E.decode_costs(models[name], cfg.contexts, seed=cfg.seed)
              for name in ("teacher", "stage 2")} if cfg.contexts else {}
    return {"rows": rows, "decode": decode}

