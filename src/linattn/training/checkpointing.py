"""Training checkpoints that resume exactly: the format, atomic writes, checksums, and which
checkpoint a run resumes from.

`out_dir/checkpoints/step-XXXXXXXX/` (`last` -> the latest good one)::

    config.json, model.safetensors   the model (linattn.models.checkpoint.save_pretrained): loadable alone
                                     with LinearTransformerLM.from_pretrained(out_dir/"checkpoints/last")
    trainer.safetensors              optimizer tensors ("optim.<param>.<name>") and RNG states ("rng.*")
    trainer.json                     format, step, the TrainConfig, optimizer hyper-parameters and
                                     scalar state, scheduler state, data position, RNG bookkeeping,
                                     the SHA-256 and size of every other file of the checkpoint, and
                                     "sha256": the SHA-256 of its own content (see doc_checksum)

No pickle anywhere: JSON and safetensors only. A checkpoint folder is written under a temporary
name, every file fsynced, renamed into place (linattn._io.atomic_write), and only then `last` is
switched (an atomic symlink replace, or a one-line text file where there are no symlinks), so a
crash leaves the previous checkpoint intact. Loading checks the manifest and names the file that
is missing or corrupted.

This module takes the run's pieces as they are (a model, a torch optimizer and scheduler, the
task's data position, the config's dict): it imports no other part of linattn.training.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import torch
from torch import nn

from .._io import (ATOMIC_TEMPORARY, atomic_write, fsync_path, read_json, remove_stale_temporaries, sha256_file,
                   write_text_synced)
from ..models.checkpoint import CONFIG_NAME, WEIGHTS_NAME, CheckpointError, load_weights, read_config, save_pretrained

TRAINER_JSON = "trainer.json"
TRAINER_TENSORS = "trainer.safetensors"
CHECKPOINTS = "checkpoints"
LAST = "last"
TRAINER_FORMAT = "linattn-trainer"
TRAINER_FORMAT_VERSION = 1


# ----------------------------------------------------------------------------------------------
# optimizer and RNG state as safetensors + JSON


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


def rng_state() -> dict:
    """The torch RNG states (CPU, and every initialized CUDA device) as named tensors."""
    out = {"rng.torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            out[f"rng.cuda.{i}"] = s
    return out


def set_rng_state(tensors: dict) -> None:
    """rng_state's inverse (CUDA states only when the device count matches)."""
    if "rng.torch_cpu" in tensors:
        torch.set_rng_state(tensors["rng.torch_cpu"])
    cuda = sorted((k for k in tensors if k.startswith("rng.cuda.")), key=lambda k: int(k.rsplit(".", 1)[1]))
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([tensors[k] for k in cuda])


def doc_checksum(doc: dict) -> str:
    """SHA-256 of a trainer.json document without its "sha256" entry, in a canonical form (sorted
    keys, no spaces): it survives re-indentation but not a changed value. Stored in the document."""
    body = {k: v for k, v in doc.items() if k != "sha256"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return hashlib.sha256(text.encode("ascii")).hexdigest()


# ----------------------------------------------------------------------------------------------
# saving


def _step_name(step: int) -> str:
    return f"step-{step:08d}"


def save_training_checkpoint(ckpt_root: Path, step: int, model: nn.Module, opt, sched, task, cfg,
                             extra: dict | None = None, keep: int = 2) -> Path:
    """Writes ckpt_root/step-XXXXXXXX atomically and points ckpt_root/last at it; keeps the newest
    `keep` step folders. task: gives `data_state(step)`; cfg: gives `to_dict()`. Returns the folder."""
    from safetensors.torch import save_file

    ckpt_root = Path(ckpt_root)
    ckpt_root.mkdir(parents=True, exist_ok=True)
    remove_interrupted_saves(ckpt_root)

    def write(tmp: Path) -> None:
        save_pretrained(model, tmp)  # config.json + model.safetensors, each fsynced
        tensors, opt_meta = _optimizer_to_flat(opt)
        tensors.update(rng_state())
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
        doc["sha256"] = doc_checksum(doc)
        write_text_synced(tmp / TRAINER_JSON, json.dumps(doc, indent=2, allow_nan=False) + "\n")

    final = atomic_write(ckpt_root / _step_name(step), write)  # re-saving a step replaces its folder
    _point_last(ckpt_root, final.name)
    _prune(ckpt_root, keep, final.name)
    return final


#: Temporaries of earlier linattn versions: `.tmp-step-XXXXXXXX-<pid>-<hex>` and `.last-<hex>`.
_OLD_TEMPORARIES = (re.compile(r"^\.tmp-step-\d{8}-(?P<pid>\d+)-[0-9a-f]{8}$"), re.compile(r"^\.last-[0-9a-f]{8}$"))
_STEP = re.compile(r"^step-\d{8}$")


def remove_interrupted_saves(ckpt_root) -> list[Path]:
    """Removes what killed saves left in a checkpoints/ folder: the temporaries of step folders and
    of the `last` pointer whose writer is gone (see linattn._io.remove_stale_temporaries). Complete
    checkpoints (step-XXXXXXXX) and `last` itself are never touched. Returns the removed paths."""
    return remove_stale_temporaries(ckpt_root, lambda name: name == LAST or _STEP.match(name) is not None,
                                    (ATOMIC_TEMPORARY, *_OLD_TEMPORARIES))


def _point_last(ckpt_root: Path, name: str) -> None:
    """Atomically make ckpt_root/last refer to `name`: a relative symlink, or where symlinks are not
    available a small text file holding the name."""
    def write(tmp: Path) -> None:
        try:
            os.symlink(name, tmp, target_is_directory=True)
        except (OSError, NotImplementedError):
            tmp.write_text(name + "\n", encoding="utf-8")

    atomic_write(ckpt_root / LAST, write)


def _prune(ckpt_root: Path, keep: int, current: str) -> None:
    steps = sorted(p for p in ckpt_root.glob("step-*") if p.is_dir())
    for p in steps[:-keep] if keep > 0 else []:
        if p.name != current:
            shutil.rmtree(p, ignore_errors=True)


class Checkpointer:
    """The checkpoints of one run: saves into `root` (None: nothing is saved) on the main process,
    at most once per step; `last` is the newest checkpoint (the one resumed from, at first)."""

    def __init__(self, root: Path | None, keep: int, *, main: bool, resumed_from: Path | None = None,
                 resumed_step: int = -1):
        self.root, self.keep, self.main = root, keep, main
        self.last, self.last_step = resumed_from, resumed_step
        if main and root is not None:
            remove_interrupted_saves(root)  # of an earlier run of this folder that was killed mid-save

    def save(self, step: int, model: nn.Module, opt, sched, task, cfg) -> None:
        if self.main and self.root is not None and step != self.last_step:
            self.last = save_training_checkpoint(self.root, step, model, opt, sched, task, cfg, keep=self.keep)
            self.last_step = step


# ----------------------------------------------------------------------------------------------
# finding and loading


def _has_last(ckpt_root: Path) -> bool:
    return (ckpt_root / LAST).is_symlink() or (ckpt_root / LAST).exists()


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
            try:
                target = link.parent / link.read_text(encoding="utf-8").strip()
            except UnicodeDecodeError:
                raise CheckpointError(f"{link} is corrupted: a pointer file should hold a checkpoint folder's name "
                                      "as UTF-8 text") from None
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


def resume_point(resume: str | None, out_dir: Path | None) -> tuple[Path | None, Path | None]:
    """(the checkpoint a run resumes from or None, the run folder it writes to) for TrainConfig's
    `resume` and `out_dir`: "latest" needs a checkpoint in out_dir, "auto" takes one if there is
    one, a path names one (and, without out_dir, the run folder it belongs to); a fresh run refuses
    an out_dir that already holds checkpoints."""
    ckpt_root = out_dir / CHECKPOINTS if out_dir is not None else None
    if resume is None:
        if ckpt_root is not None and _has_last(ckpt_root):
            raise ValueError(f"{out_dir} already holds checkpoints ({ckpt_root / LAST}): resume the run "
                             "(resume='latest', CLI --resume) or choose another out_dir")
        return None, out_dir
    if resume in ("latest", "auto"):
        if out_dir is None:
            raise ValueError(f"resume={resume!r} needs out_dir (the run folder holding checkpoints/)")
        if _has_last(ckpt_root):
            return find_checkpoint(ckpt_root), out_dir  # a broken `last` is an error, also for "auto"
        if resume == "latest":
            raise FileNotFoundError(f"nothing to resume: no checkpoint in {ckpt_root} (expected {ckpt_root / LAST})")
        return None, out_dir
    path = find_checkpoint(resume)
    if out_dir is None and path.parent.name == CHECKPOINTS:  # continue writing into the checkpoint's run
        out_dir = path.parent.parent
    return path, out_dir


def read_trainer_doc(ckpt) -> dict:
    """The trainer.json of checkpoint folder `ckpt`, checked for format and required entries."""
    ckpt = Path(ckpt)
    doc_path = ckpt / TRAINER_JSON
    if not doc_path.is_file():
        raise FileNotFoundError(f"checkpoint {ckpt} is incomplete: {TRAINER_JSON} is missing")
    try:
        doc = read_json(doc_path)
    except ValueError as exc:
        raise CheckpointError(f"checkpoint {ckpt} is corrupted: {exc}") from None
    if not isinstance(doc, dict) or doc.get("format") != TRAINER_FORMAT:
        got = doc.get("format") if isinstance(doc, dict) else None
        raise CheckpointError(f"{doc_path} is not a linattn training checkpoint (format {got!r})")
    if doc.get("format_version") != TRAINER_FORMAT_VERSION:
        raise CheckpointError(f"{doc_path} has format_version {doc.get('format_version')!r}; this linattn reads "
                              f"{TRAINER_FORMAT_VERSION}")
    if "sha256" in doc and doc["sha256"] != doc_checksum(doc):  # checkpoints before the field: unchecked
        raise CheckpointError(f"checkpoint {ckpt} is corrupted: {TRAINER_JSON} does not match the checksum it "
                              "records (a changed value); resume from an earlier checkpoint")
    for key in ("step", "train_config", "optimizer", "scheduler", "data", "files"):
        if key not in doc:
            raise CheckpointError(f"checkpoint {ckpt} is corrupted: {TRAINER_JSON} has no {key!r} entry")
    if not isinstance(doc["files"], dict):
        raise CheckpointError(f"checkpoint {ckpt} is corrupted: {TRAINER_JSON} 'files' is not a table")
    return doc


def _verify_files(ckpt: Path, files: dict, checksums: bool) -> None:
    for name, info in files.items():
        f = ckpt / name
        if not f.is_file():
            raise FileNotFoundError(f"checkpoint {ckpt} is incomplete: {name} is missing")
        if checksums:
            size = f.stat().st_size
            if size != info.get("bytes") or sha256_file(f) != info.get("sha256"):
                raise CheckpointError(f"checkpoint {ckpt} is corrupted: {name} does not match the checksum recorded "
                                      f"in {TRAINER_JSON} ({size} bytes, expected {info.get('bytes')}); resume from "
                                      "an earlier checkpoint")


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
    _verify_files(ckpt, doc["files"], verify)
    try:
        arch, saved_config, ckpt_id = read_config(ckpt, type(model.config))
        if arch != type(model).__name__:
            raise CheckpointError(f"checkpoint {ckpt} holds a {arch}, this run trains a {type(model).__name__}")
        diff = model.config.diff(saved_config)
        if diff:
            desc = ", ".join(f"{k}: run has {a!r}, checkpoint has {b!r}" for k, (a, b) in sorted(diff.items()))
            raise CheckpointError(f"checkpoint {ckpt} was trained with another model config: {desc}")
        load_weights(ckpt, model, ckpt_id)
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
        set_rng_state(rng)
    doc["path"] = str(ckpt)
    doc["rng"] = rng
    return doc

