"""The model checkpoint format: a directory with `config.json` and `model.safetensors` (design §8).
No pickle.

    config.json        {"format": "linattn", "format_version": 1, "architecture": <class name>,
                        "checkpoint_id": <uuid>, "config": <the model config as a dict>,
                        "weights_sha256": <hex SHA-256 of model.safetensors>}
    model.safetensors  every parameter and persistent buffer (FAVOR+/trig projections ω included),
                       tied weights stored once, in the model's dtypes; header metadata carries the
                       same checkpoint_id.

Saving writes each file to a temporary name in the directory, fsyncs it and renames it over the
final name (linattn._io.atomic_write), weights first, config last: an interrupted save leaves either
the old file or the new one, never a torn one, and the shared checkpoint_id tells a config and
weights from different saves apart. Reading uses JSON and `safetensors.torch.load_file` only.

Nothing in a checkpoint is trusted before it is checked, and every refusal is a CheckpointError
naming the file and the mismatch:
- the safetensors header (names, dtypes, shapes, data offsets) must describe exactly the bytes the
  file holds (a truncated or padded file is refused before any tensor is read);
- the model the config describes is first built on the meta device (`shape_only`: no memory), and
  its tensor names, shapes and dtypes are compared with the header, so a config asking for 10⁷
  layers or 10⁶-wide matrices is refused without allocating them (`check_header`);
- the file's SHA-256 must equal config.json's `weights_sha256` (checkpoints saved before that
  field existed load without the check);
- dtypes are never changed silently: without a requested dtype every tensor must have the dtype of
  the model tensor it fills; with one, floating tensors are cast to it (integer buffers never are).

This module knows the files only. The model classes own their loading
(`LinearTransformerLM.from_pretrained`, `linattn.models.load_pretrained`): they hand their config
class to `read_config` and their module to `load_weights`.
"""

from __future__ import annotations

import contextlib
import json
import math
import struct
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch.overrides import TorchFunctionMode

from .._checks import FLOAT_DTYPES
from .._io import atomic_write, read_json, remove_stale_temporaries, sha256_file

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
FORMAT_VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded into the requested model (names the mismatch)."""


def _alias_names(model: torch.nn.Module) -> set[str]:
    """State-dict names whose tensor is the same as an earlier name's (tied weights)."""
    seen, aliases = {}, set()
    for name, t in model.state_dict(keep_vars=True).items():
        if t.is_meta:  # no storage to compare: the same tensor object
            key = id(t)
        else:
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
    remove_stale_temporaries(directory, lambda name: name in (WEIGHTS_NAME, CONFIG_NAME))  # of killed saves
    ckpt_id = uuid.uuid4().hex
    aliases = _alias_names(model)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items() if k not in aliases}
    meta = {"format": "pt", "linattn_checkpoint_id": ckpt_id, "architecture": type(model).__name__}
    digest = {}

    def write_weights(p: Path) -> None:
        save_file(tensors, str(p), metadata=meta)
        digest["sha256"] = sha256_file(p)

    atomic_write(directory / WEIGHTS_NAME, write_weights)
    doc = {"format": "linattn", "format_version": FORMAT_VERSION, "architecture": type(model).__name__,
           "checkpoint_id": ckpt_id, "config": model.config.to_dict(), "weights_sha256": digest["sha256"]}
    atomic_write(directory / CONFIG_NAME, lambda p: p.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n"))
    return directory


#: safetensors dtype names and the torch dtype of each (the float8 ones where torch has them).
_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool}
_ST_DTYPES.update({n: getattr(torch, a) for n, a in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"))
                   if hasattr(torch, a)})
_MAX_HEADER = 100_000_000


@dataclass(frozen=True)
class TensorHeader:
    """One tensor as a safetensors header describes it: dtype (None when torch has no such dtype;
    `dtype_name` keeps the file's name), shape, and its byte range in the data area."""

    dtype: torch.dtype | None
    dtype_name: str
    shape: tuple[int, ...]
    begin: int
    end: int


def _header_entry(path: Path, name: str, entry) -> TensorHeader:
    def bad(what: str):
        return CheckpointError(f"{path} has a corrupt safetensors header: tensor {name!r} {what}")

    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= set(entry):
        raise bad("lacks dtype, shape or data_offsets")
    shape, offsets, dtype_name = entry["shape"], entry["data_offsets"], entry["dtype"]
    if not (isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
        raise bad(f"has shape {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        raise bad(f"has data_offsets {offsets!r}")
    dtype = _ST_DTYPES.get(dtype_name)
    if dtype is not None:
        expected = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if offsets[1] - offsets[0] != expected:
            raise bad(f"of dtype {dtype_name} and shape {tuple(shape)} needs {expected} bytes, its data_offsets "
                      f"span {offsets[1] - offsets[0]}")
    return TensorHeader(dtype, str(dtype_name), tuple(shape), offsets[0], offsets[1])


def read_header(path) -> tuple[dict[str, TensorHeader], dict]:
    """({name: TensorHeader}, metadata) of a safetensors file, read from its header alone (8-byte
    little-endian length + JSON) and checked against the file: the tensors' byte ranges must tile the
    data area exactly, so a truncated, padded or overlapping file is a CheckpointError naming it."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise CheckpointError(f"{path} is not a safetensors file (too short: {size} bytes)")
        (n,) = struct.unpack("<Q", raw)
        if n > min(_MAX_HEADER, size - 8):
            raise CheckpointError(f"{path} is not a safetensors file or is truncated (header length {n}, "
                                  f"file {size} bytes)")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{path} has a corrupt safetensors header: {exc}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path} has a corrupt safetensors header (not a JSON object)")
    metadata = header.pop("__metadata__", None) or {}
    tensors = {name: _header_entry(path, name, entry) for name, entry in header.items()}
    data = size - 8 - n
    at = 0
    for name, t in sorted(tensors.items(), key=lambda kv: (kv[1].begin, kv[1].end)):
        if t.begin != at:
            raise CheckpointError(f"{path} has a corrupt safetensors header: tensor {name!r} starts at byte {t.begin} "
                                  f"of the data, expected {at} (tensors overlap or leave gaps)")
        at = t.end
    if at != data:
        what = "is truncated" if at > data else "has trailing bytes"
        raise CheckpointError(f"{path} {what}: its header describes {at} bytes of tensor data, the file holds {data}")
    return tensors, metadata


class _ScalarReadsOnMeta(TorchFunctionMode):
    """Answers a Python scalar read of a meta tensor (int(t), float(t), bool(t), t.item()) with 0, so
    that a module whose constructor reads a value (FAVOR+ reads its draw counter) can be built on the
    meta device. Only the shapes and dtypes of such a build are used."""

    _READS = {"__int__": 0, "__index__": 0, "__float__": 0.0, "__bool__": False, "item": 0}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", None)
        if name in self._READS and args and isinstance(args[0], torch.Tensor) and args[0].is_meta:
            return self._READS[name]
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def shape_only():
    """Builds modules and tensors on the meta device: shapes and dtypes, no memory, no values.
    (The first build in a process costs about a second of CPU: torch imports torch._dynamo for the
    meta kernels it writes in Python.)"""
    with torch.device("meta"), _ScalarReadsOnMeta():
        yield


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
        with shape_only():  # the config's checks may build a feature map: sized by the config, so no memory
            config = config_class.from_dict(doc.get("config"))
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: bad model config: {exc}") from None
    return doc.get("architecture"), config, doc.get("checkpoint_id")


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def _mismatches(model: torch.nn.Module, found: dict, source: str, cast: bool) -> None:
    """Raises a CheckpointError naming every tensor of `found` ({name: (shape, dtype or None, dtype
    name)}) that `model` lacks, every model tensor it lacks (tied aliases may be absent), every shape
    that differs and every dtype that differs (floating to floating allowed with `cast`)."""
    expected = model.state_dict()
    aliases = _alias_names(model)
    missing = sorted(k for k in expected if k not in found and k not in aliases)
    unexpected = sorted(k for k in found if k not in expected)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing tensors {_few(missing)}")
        if unexpected:
            parts.append(f"unexpected tensors {_few(unexpected)}")
        raise CheckpointError(f"{source} does not match the model: " + "; ".join(parts))
    bad = [f"{k!r} has shape {shape} but the model expects {tuple(expected[k].shape)}"
           for k, (shape, _, _) in found.items() if shape != tuple(expected[k].shape)]
    if bad:
        raise CheckpointError(f"{source}: {len(bad)} tensor shape mismatch(es) with the model built from the "
                              f"config: " + "; ".join(_few(bad)))
    bad = []
    for k, (_, dtype, name) in found.items():
        want = expected[k].dtype
        if dtype == want or (cast and dtype is not None and dtype.is_floating_point and want.is_floating_point):
            continue
        bad.append(f"{k!r} is {_dtype_name(dtype) if dtype is not None else name} but the model's is {_dtype_name(want)}")
    if bad:
        hint = "" if cast else " (pass dtype= to load floating tensors in another dtype)"
        raise CheckpointError(f"{source}: {len(bad)} tensor dtype mismatch(es) with the model{hint}: "
                              + "; ".join(_few(bad)))


def _few(items: list, n: int = 6) -> list:
    return items if len(items) <= n else [*items[:n], f"... and {len(items) - n} more"]


def check_header(model: torch.nn.Module, header: dict, source: str, *, cast: bool = False) -> None:
    """Checks a weights file's header (read_header) against `model` (often a meta-device build, see
    shape_only): the same names, shapes and dtypes (floating dtypes may differ with `cast`)."""
    _mismatches(model, {k: (h.shape, h.dtype, h.dtype_name) for k, h in header.items()}, source, cast)


def load_state(model: torch.nn.Module, tensors: dict, source: str = "checkpoint", *, cast: bool = False) -> None:
    """Copies `tensors` into `model`, after checking names, shapes and dtypes (tied aliases may be
    absent; with `cast`, floating tensors are converted to the model's floating dtypes)."""
    _mismatches(model, {k: (tuple(t.shape), t.dtype, _dtype_name(t.dtype)) for k, t in tensors.items()}, source,
                cast)
    model.load_state_dict(tensors, strict=False)


def weights_dtype(header: dict, dtype: torch.dtype | None, source) -> torch.dtype:
    """The floating dtype a model is loaded in: `dtype` when given, else the one floating dtype of
    the file's tensors (a CheckpointError when they have several: pass dtype= to choose)."""
    if dtype is not None:
        if dtype not in FLOAT_DTYPES:
            raise TypeError(f"dtype must be None or one of {[_dtype_name(d) for d in FLOAT_DTYPES]}, got {dtype!r}")
        return dtype
    floats = {}
    for name, h in header.items():
        if h.dtype is not None and h.dtype.is_floating_point:
            floats.setdefault(h.dtype, name)
    if len(floats) > 1:
        desc = ", ".join(f"{_dtype_name(d)} ({k!r}, ...)" for d, k in floats.items())
        raise CheckpointError(f"{source} holds floating tensors of several dtypes: {desc}; pass dtype= to load the "
                              "model in one of them")
    return next(iter(floats), torch.float32)


def _recorded_sha256(directory: Path) -> str | None:
    try:
        doc = read_json(directory / CONFIG_NAME)
    except (FileNotFoundError, ValueError):
        return None
    sha = doc.get("weights_sha256") if isinstance(doc, dict) else None
    return sha if isinstance(sha, str) else None


def load_weights(directory, model: torch.nn.Module, checkpoint_id: str | None = None, *, cast: bool = False) -> None:
    """Loads `directory`/model.safetensors into `model` (see load_state). checkpoint_id: the id
    read from the same directory's config.json; a weights file from another save is refused. The
    header is checked against the model before any tensor is read, and the file's SHA-256 against
    config.json's `weights_sha256` when it records one. cast: see load_state."""
    directory = Path(directory)
    weights = directory / WEIGHTS_NAME
    if not weights.is_file():
        raise FileNotFoundError(f"no {WEIGHTS_NAME} in {directory}")
    header, meta = read_header(weights)
    meta_id = meta.get("linattn_checkpoint_id")
    if checkpoint_id is not None and meta_id is not None and meta_id != checkpoint_id:
        raise CheckpointError(f"{CONFIG_NAME} (checkpoint_id {checkpoint_id}) and {WEIGHTS_NAME} (checkpoint_id "
                              f"{meta_id}) in {directory} come from different saves (an interrupted save?)")
    check_header(model, header, str(weights), cast=cast)
    recorded = _recorded_sha256(directory)
    if recorded is not None and sha256_file(weights) != recorded:
        raise CheckpointError(f"{weights} does not match the SHA-256 recorded in {directory / CONFIG_NAME}: the file "
                              "is corrupted or was changed after the save")
    try:
        tensors = load_file(str(weights))
    except SafetensorError as exc:
        raise CheckpointError(f"{weights} cannot be read: {exc}") from None
    load_state(model, tensors, source=str(weights), cast=cast)


def load_model(directory, build: Callable[[], torch.nn.Module], *, checkpoint_id: str | None = None,
               dtype: torch.dtype | None = None, layers: tuple[str, int] | None = None) -> torch.nn.Module:
    """The model `build()` makes, with the weights of `directory`, in `dtype` (None: the dtype the
    weights were saved in; given: floating tensors are cast to it). Before anything is allocated the
    header is checked: `layers` = (prefix, n), e.g. ("blocks.", config.n_layers), must match the
    number of distinct "<prefix><i>." indices in the file (so a config asking for 10⁷ layers is
    refused before they are built), then `build()` runs on the meta device (shape_only) and its
    names, shapes and dtypes are compared with the header. Only then is the model built and loaded."""
    directory = Path(directory)
    weights = directory / WEIGHTS_NAME
    if not weights.is_file():
        raise FileNotFoundError(f"no {WEIGHTS_NAME} in {directory}")
    header, _ = read_header(weights)
    if layers is not None:
        prefix, n = layers
        held = {k[len(prefix):].split(".", 1)[0] for k in header if k.startswith(prefix)}
        if len(held) != n:
            raise CheckpointError(f"{directory / CONFIG_NAME} describes {n} layers but {weights} holds {len(held)}")
    chosen = weights_dtype(header, dtype, weights)
    with shape_only():
        skeleton = build().to(chosen)
    check_header(skeleton, header, str(weights), cast=dtype is not None)
    del skeleton
    model = build().to(chosen)
    load_weights(directory, model, checkpoint_id, cast=dtype is not None)
    return model


__all__ = ["CONFIG_NAME", "WEIGHTS_NAME", "CheckpointError", "TensorHeader", "check_header", "load_model",
           "load_state", "load_weights", "read_config", "read_header", "save_pretrained", "shape_only",
           "weights_dtype"]
