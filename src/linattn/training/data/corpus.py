"""The byte-level corpus: files read as raw bytes (vocabulary 256), the Python standard library by
default, random windows as (inputs, targets) batches with a resumable position, and validation
windows."""

from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence, Union

import torch

from ..._checks import check_int, check_number
from .base import mix_seed

__all__ = ["ByteLMBatches", "Corpus", "PathLike", "corpus_files", "eval_batches", "load_corpus", "stdlib_files"]

PathLike = Union[str, os.PathLike]

# ----------------------------------------------------------------------------------------------
# Byte-level corpus
# ----------------------------------------------------------------------------------------------

_STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
_STDLIB_TEST_DIRS = frozenset({"test", "tests", "idle_test"})


def stdlib_files(include_tests: bool = False) -> list[Path]:
    """The ``*.py`` files of the running interpreter's standard library, sorted by path.

    The root is ``sysconfig.get_paths()["stdlib"]``. Third-party code (``site-packages``,
    ``dist-packages``) and ``__pycache__`` are always skipped, and so, unless ``include_tests``,
    are directories named ``test``, ``tests`` or ``idle_test`` (CPython's test suite is large,
    repetitive and holds deliberately malformed files). Symbolic links to directories are not
    followed. The result depends on the Python version, so corpus sizes differ between
    interpreters.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = _STDLIB_SKIP_DIRS if include_tests else _STDLIB_SKIP_DIRS | _STDLIB_TEST_DIRS
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in skip]
        out.extend(Path(dirpath) / f for f in filenames if f.endswith(".py"))
    return sorted(out)


def _looks_binary(path: Path) -> bool:
    with open(path, "rb") as fh:
        return b"\0" in fh.read(8192)


def corpus_files(paths: PathLike | Sequence[PathLike] | None = None, suffixes: Sequence[str] | None = None) -> list[Path]:
    """The files a corpus is read from, in reading order.

    ``paths=None`` gives :func:`stdlib_files`. Otherwise each named path, in the order given, is
    either a file (always used, whatever its content) or a directory, which contributes its
    regular files recursively, sorted by path, skipping hidden entries (names starting with
    ``.``, e.g. ``.git``), ``__pycache__``, files that look binary (a NUL byte in the first
    8 KiB) and, when ``suffixes`` is given (e.g. ``(".py", ".md")``), files with other
    suffixes. A file reached twice is used once.

    Raises ``ValueError`` naming the path when a named path does not exist, and when no file is
    found at all.
    """
    if paths is None:
        files = stdlib_files()
        if not files:
            raise ValueError(f"no *.py files found under the standard library at {sysconfig.get_paths()['stdlib']}")
        return files
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    suffix_set = None if suffixes is None else {s if s.startswith(".") else "." + s for s in suffixes}
    out: list[Path] = []
    seen: set[Path] = set()

    def add(p: Path) -> None:
        key = p.resolve()
        if key not in seen:
            seen.add(key)
            out.append(p)

    for raw in paths:
        p = Path(raw)
        if not p.exists():
            raise ValueError(f"corpus path does not exist: {str(raw)!r}")
        if p.is_file():
            add(p)
            continue
        if not p.is_dir():
            raise ValueError(f"corpus path is neither a file nor a directory: {str(raw)!r}")
        found = []
        for dirpath, dirnames, filenames in os.walk(p):
            dirnames[:] = [d for d in dirnames if not d.startswith(".") and d != "__pycache__"]
            for f in filenames:
                fp = Path(dirpath) / f
                if f.startswith(".") or not fp.is_file():
                    continue
                if suffix_set is not None and fp.suffix not in suffix_set:
                    continue
                found.append(fp)
        for fp in sorted(found):
            if not _looks_binary(fp):
                add(fp)
    if not out:
        raise ValueError(f"no usable files found in corpus paths {[str(p) for p in paths]!r}")
    return out


def _read_files(files: Sequence[Path], max_bytes: int | None, starts: list | None = None) -> tuple[bytes, int]:
    """Concatenate the files' bytes (no separator), stopping once ``max_bytes`` are read; the
    last file may be cut. Returns the bytes and the number of files that contributed; ``starts``,
    if given, receives the offset at which each contributing file begins (its documents)."""
    if max_bytes is not None:
        check_int("max_bytes", max_bytes, minimum=1)
    chunks, total, used = [], 0, 0
    for f in files:
        if max_bytes is not None and total >= max_bytes:
            break
        data = f.read_bytes()
        if max_bytes is not None:
            data = data[: max_bytes - total]
        if data:
            if starts is not None:
                starts.append(total)
            chunks.append(data)
            total += len(data)
            used += 1
    return b"".join(chunks), used


def load_corpus(
    paths: PathLike | Sequence[PathLike] | None = None,
    max_bytes: int | None = None,
    suffixes: Sequence[str] | None = None,
) -> bytes:
    """The corpus as one ``bytes`` object: the files of :func:`corpus_files` concatenated in
    order, without separators, cut after ``max_bytes`` bytes if given, e.g.
    ``load_corpus(max_bytes=1000)`` is the first 1000 bytes of the stdlib corpus.
    """
    data, _ = _read_files(corpus_files(paths, suffixes), max_bytes)
    return data


@dataclass(frozen=True)
class Corpus:
    """A byte corpus split into training and validation parts.

    The split is contiguous and deterministic: the concatenated bytes (files in
    :func:`corpus_files` order) are cut so that the last ``val_fraction`` of them (rounded down,
    at least one byte) is the validation part and everything before it the training part. The
    two parts are disjoint and together are the whole corpus. Since files are in sorted order,
    validation text comes from the last files (for the stdlib: the end of the alphabet), so it
    is a held-out set of *files*, apart from at most one file cut by the boundary.

    Fields: ``train`` and ``validation`` (1-D ``torch.uint8``), ``n_files`` (files that
    contributed bytes), ``n_bytes`` (total), ``source`` (what was read, in words),
    ``val_fraction``, ``doc_starts`` (1-D int64: the offset in the concatenation at which each
    file begins, its document boundaries; None when unknown).
    """

    train: torch.Tensor
    validation: torch.Tensor
    n_files: int
    n_bytes: int
    source: str
    val_fraction: float
    doc_starts: torch.Tensor | None = None

    vocab_size = 256

    @classmethod
    def load(
        cls,
        paths: PathLike | Sequence[PathLike] | None = None,
        max_bytes: int | None = None,
        val_fraction: float = 0.05,
        suffixes: Sequence[str] | None = None,
    ) -> "Corpus":
        """Read the corpus (see :func:`corpus_files`, :func:`load_corpus`) and split it."""
        check_number("val_fraction", val_fraction, minimum=0, maximum=1, low_open=True, high_open=True)
        files = corpus_files(paths, suffixes)
        starts: list[int] = []
        data, n_files = _read_files(files, max_bytes, starts)
        if len(data) < 2:
            raise ValueError(f"corpus has {len(data)} bytes; it needs at least 2 to be split")
        if paths is None:
            source = f"Python {sysconfig.get_python_version()} standard library ({sysconfig.get_paths()['stdlib']})"
        else:
            named = [str(paths)] if isinstance(paths, (str, os.PathLike)) else [str(p) for p in paths]
            source = ", ".join(named)
        n_val = min(len(data) - 1, max(1, int(len(data) * val_fraction)))
        tensor = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        split = len(data) - n_val
        return cls(tensor[:split], tensor[split:], n_files, len(data), source, float(val_fraction),
                   torch.tensor(starts, dtype=torch.long))

    def describe(self) -> str:
        """One line: source, files, bytes, and the split."""
        return (
            f"byte corpus from {self.source}: {self.n_files} files, {self.n_bytes:,} bytes "
            f"({self.n_bytes / 2**20:.2f} MiB); train {self.train.numel():,} bytes, "
            f"validation {self.validation.numel():,} bytes (last {self.val_fraction:g})"
        )

    def batches(self, split: str, seq_len: int, batch_size: int, seed: int = 0) -> "ByteLMBatches":
        """A :class:`ByteLMBatches` over ``split`` (``"train"`` or ``"validation"``)."""
        if split not in ("train", "validation"):
            raise ValueError(f"split must be 'train' or 'validation', got {split!r}")
        return ByteLMBatches(getattr(self, split), seq_len, batch_size, seed)


def _as_byte_tensor(data) -> torch.Tensor:
    if isinstance(data, (bytes, bytearray, memoryview)):
        data = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"data must be a 1-D torch.uint8 tensor or bytes, got {type(data).__name__}")
    if data.dtype != torch.uint8 or data.dim() != 1:
        raise ValueError(f"data must be a 1-D torch.uint8 tensor, got dtype {data.dtype} and shape {tuple(data.shape)}")
    return data


class ByteLMBatches:
    """An endless, deterministic stream of random windows of a byte tensor for language modelling.

    Each batch takes ``batch_size`` start offsets uniformly from ``[0, len(data) - seq_len - 1]``
    and returns ``(inputs, targets)``, both ``torch.long`` of shape ``(batch_size, seq_len)``,
    with ``targets[:, t] == inputs[:, t + 1]`` inside the window (``targets`` is the window
    shifted by one byte). Batch number ``k`` depends only on ``(seed, k)``, so the stream can be
    resumed from a saved position (:meth:`state_dict` / :meth:`load_state_dict`) and any batch
    can be recomputed with :meth:`batch`. Usage::

        stream = ByteLMBatches(corpus.train, seq_len=256, batch_size=16, seed=0)
        x, y = next(stream)
        state = stream.state_dict()              # save with the model checkpoint
        later = ByteLMBatches(corpus.train, 256, 16)
        later.load_state_dict(state)             # next(later) == next(stream)
    """

    def __init__(self, data, seq_len: int, batch_size: int, seed: int = 0):
        data = _as_byte_tensor(data)
        check_int("seq_len", seq_len, minimum=1)
        check_int("batch_size", batch_size, minimum=1)
        check_int("seed", seed, error=TypeError)
        if data.numel() < seq_len + 1:
            raise ValueError(
                f"data has {data.numel()} bytes, fewer than seq_len + 1 = {seq_len + 1}: "
                "use a larger corpus or a shorter seq_len"
            )
        self.data = data
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.seed = seed
        self.step = 0
        self._window = torch.arange(seq_len + 1)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch number ``step`` of the stream (does not move the position)."""
        g = torch.Generator().manual_seed(mix_seed(self.seed, step))
        high = self.data.numel() - self.seq_len  # starts in [0, high)
        starts = torch.randint(high, (self.batch_size,), generator=g)
        chunk = self.data[starts[:, None] + self._window].long()
        return chunk[:, :-1], chunk[:, 1:]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.batch(self.step)
        self.step += 1
        return out

    def state_dict(self) -> dict:
        """Position of the stream: seed and step, plus the shape fields checked on restore."""
        return {
            "seed": self.seed,
            "step": self.step,
            "seq_len": self.seq_len,
            "batch_size": self.batch_size,
            "n_bytes": self.data.numel(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore ``seed`` and ``step``. ``seq_len``, ``batch_size`` and the data size must match
        the saved ones (otherwise the batches could not be the same): ValueError if not."""
        for key in ("seq_len", "batch_size", "n_bytes"):
            mine = self.state_dict()[key]
            if key in state and state[key] != mine:
                raise ValueError(f"saved batch-stream state has {key}={state[key]}, this stream has {key}={mine}")
        self.seed = int(state["seed"])
        self.step = int(state["step"])


def eval_batches(data, seq_len: int, batch_size: int, max_batches: int | None = None):
    """Non-overlapping consecutive windows of ``data`` for evaluation, in order.

    Yields ``(inputs, targets)`` like :class:`ByteLMBatches` (the last batch may be smaller);
    window ``i`` starts at byte ``i * seq_len``, and the tail shorter than ``seq_len + 1`` bytes
    is left out. Every predicted byte is predicted once, so the mean loss over all batches is the
    per-byte loss of ``data`` at context length up to ``seq_len``.
    """
    data = _as_byte_tensor(data)
    check_int("seq_len", seq_len, minimum=1)
    check_int("batch_size", batch_size, minimum=1)
    n_windows = (data.numel() - 1) // seq_len
    if n_windows == 0:
        raise ValueError(f"data has {data.numel()} bytes, fewer than seq_len + 1 = {seq_len + 1}")
    window = torch.arange(seq_len + 1)
    for b, first in enumerate(range(0, n_windows, batch_size)):
        if max_batches is not None and b >= max_batches:
            return
        starts = torch.arange(first, min(first + batch_size, n_windows)) * seq_len
        chunk = data[starts[:, None] + window].long()
        yield chunk[:, :-1], chunk[:, 1:]


