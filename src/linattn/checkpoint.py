"""The model checkpoint format: a directory with `config.json` and `model.safetensors` (design §8).
No pickle.

    config.json        {"format": "linattn", "format_version": 1, "architecture": <class name>,
                        "checkpoint_id": <uuid>, "config": <the model config as a dict>}
    model.safetensors  every parameter and persistent buffer (FAVOR+/trig projections ω included),
                       tied weights stored once; header metadata carries the same checkpoint_id.

Saving writes each file to a temporary name in the directory, fsyncs it and renames it over the
final name (linattn._io.atomic_write), weights first, config last: an interrupted save leaves either
the old file or the new one, never a torn one, and the shared checkpoint_id tells a config and
weights from different saves apart. Reading uses JSON and `safetensors.torch.load_file` only, and
checks the format, the tensor names and the shapes, naming whatever does not match.

This module knows the files only. The model classes own their loading
(`LinearTransformerLM.from_pretrained`, `linattn.models.load_pretrained`): they hand their config
class to `read_config` and their module to `load_weights`.
"""

from __future__ import annotations

import json
import struct
import uuid
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ._io import atomic_write, read_json

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
FORMAT_VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded into the requested model (names the mismatch)."""


def _alias_names(model: torch.nn.Module) -> set[str]:
    """State-dict names whose tensor is the same as an earlier name's (tied weights)."""
    seen, aliases = {}, set()
    for name, t in model.state_dict(keep_vars=True).items():
        key = (t.data_ptr(), tuple(t.shape), t.dtype) if t.numel() else None
        if key is not None and key in seen:
            aliases.add(name)
        elif key is not None:
            seen[key] = name
    return aliases


def save_pretrained(model: torch.nn.Module, directory) -> Path:
    """Writes `directory`/config.json and `directory`/model.safetensors (creating the directory).
    `model` is a module with a `.config` that has `to_dict()`."""
    if not hasattr(model, "config") or not hasattr(model.config, "to_dict"):
        raise TypeError(f"save_pretrained needs a linattn model with a .config, got {type(model).__name__}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    ckpt_id = uuid.uuid4().hex
    aliases = _alias_names(model)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items() if k not in aliases}
    meta = {"format": "pt", "linattn_checkpoint_id": ckpt_id, "architecture": type(model).__name__}
    atomic_write(directory / WEIGHTS_NAME, lambda p: save_file(tensors, str(p), metadata=meta))
    doc = {"format": "linattn", "format_version": FORMAT_VERSION, "architecture": type(model).__name__,
           "checkpoint_id": ckpt_id, "config": model.config.to_dict()}
    atomic_write(directory / CONFIG_NAME, lambda p: p.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n"))
    return directory


def _safetensors_metadata(path: Path) -> dict:
    """The `__metadata__` of a safetensors file, read from its JSON header (8-byte length + JSON)."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise CheckpointError(f"{path} is not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", raw)
        if n > 100_000_000:
            raise CheckpointError(f"{path} is not a safetensors file (header length {n})")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{path} has a corrupt safetensors header: {exc}") from None
    return header.get("__metadata__") or {}


def read_config(directory, config_class):
    """(architecture name, config, checkpoint_id) from `directory`/config.json, the config built
    with `config_class.from_dict` (e.g. linattn.models.ModelConfig)."""
    path = Path(directory) / CONFIG_NAME
    if not path.is_file():
        raise FileNotFoundError(f"no {CONFIG_NAME} in {directory}")
    try:
        doc = read_json(path)
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None
    if not isinstance(doc, dict) or doc.get("format") != "linattn":
        raise CheckpointError(f"{path} is not a linattn checkpoint config (no \"format\": \"linattn\")")
    if doc.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path} has format_version {doc.get('format_version')!r}; this linattn reads {FORMAT_VERSION}")
    try:
        config = config_class.from_dict(doc.get("config"))
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: bad model config: {exc}") from None
    return doc.get("architecture"), config, doc.get("checkpoint_id")


def load_state(model: torch.nn.Module, tensors: dict, source: str = "checkpoint") -> None:
    """Copies `tensors` into `model`, after checking names and shapes (tied aliases may be absent)."""
    expected = model.state_dict()
    aliases = _alias_names(model)
    missing = sorted(k for k in expected if k not in tensors and k not in aliases)
    unexpected = sorted(k for k in tensors if k not in expected)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing tensors {missing}")
        if unexpected:
            parts.append(f"unexpected tensors {unexpected}")
        raise CheckpointError(f"{source} does not match the model: " + "; ".join(parts))
    bad = [f"{k!r} has shape {tuple(t.shape)} but the model expects {tuple(expected[k].shape)}"
           for k, t in tensors.items() if tuple(t.shape) != tuple(expected[k].shape)]
    if bad:
        raise CheckpointError(f"{source}: {len(bad)} tensor shape mismatch(es) with the model built from the "
                              f"config: " + "; ".join(bad))
    model.load_state_dict(tensors, strict=False)


def load_weights(directory, model: torch.nn.Module, checkpoint_id: str | None = None) -> None:
    """Loads `directory`/model.safetensors into `model` (see load_state). checkpoint_id: the id
    read from the same directory's config.json; a weights file from another save is refused."""
    directory = Path(directory)
    weights = directory / WEIGHTS_NAME
    if not weights.is_file():
        raise FileNotFoundError(f"no {WEIGHTS_NAME} in {directory}")
    meta_id = _safetensors_metadata(weights).get("linattn_checkpoint_id")
    if checkpoint_id is not None and meta_id is not None and meta_id != checkpoint_id:
        raise CheckpointError(f"{CONFIG_NAME} (checkpoint_id {checkpoint_id}) and {WEIGHTS_NAME} (checkpoint_id "
                              f"{meta_id}) in {directory} come from different saves (an interrupted save?)")
    load_state(model, load_file(str(weights)), source=str(weights))


__all__ = ["CONFIG_NAME", "WEIGHTS_NAME", "CheckpointError", "load_state", "load_weights", "read_config",
           "save_pretrained"]
