"""Data for training and evaluation: a byte-level text corpus and synthetic tasks.

Byte-level language modelling
    :func:`load_corpus` / :class:`Corpus` read text files as raw bytes (vocabulary 256, no
    tokenizer). With no paths the corpus is the running interpreter's standard library source
    (see :func:`stdlib_files`). :class:`ByteLMBatches` samples random windows of a byte tensor as
    ``(inputs, targets)`` pairs, deterministically from a seed, and can save and restore its
    position so a resumed run sees exactly the batches an uninterrupted one would have.

Synthetic tasks (generated on the fly from a seed or a ``torch.Generator``)
    * :func:`copy_task` -- the copy task of the Linear Transformer paper (Katharopoulos et al.,
      "Transformers are RNNs", ICML 2020, §4.1), framed for a decoder-only model.
    * :func:`mqar_task` -- multi-query associative recall (Arora et al., "Zoology: Measuring and
      Improving Recall in Efficient Language Models", 2023), following Zoology's generator.
    * :func:`listops_task` -- ListOps (Nangia & Bowman, 2018) as used in the Long Range Arena
      (Tay et al., "Long Range Arena", ICLR 2021), following LRA's generator, scaled down.

    Sequence tasks return a :class:`TaskBatch` whose ``targets`` hold :data:`IGNORE_INDEX`
    (-100, PyTorch's cross-entropy default) wherever no loss/accuracy is counted;
    ListOps returns a :class:`ClassificationBatch`.

Randomness: every generator takes ``seed=`` (an int) or ``generator=`` (a CPU
``torch.Generator``, advanced in place, so successive calls give fresh data). With neither, the
global torch RNG is used, like ``torch.randint``. All tensors are created on the CPU; use
``batch.to(device)``.
"""

from __future__ import annotations

import hashlib
import os
import random
import sysconfig
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Iterator, Sequence, Union

import torch

from .._checks import check_int, check_number

__all__ = [
    "IGNORE_INDEX",
    "MQAR_CONFIGS",
    "LISTOPS_TOKENS",
    "LISTOPS_OPERATORS",
    "LISTOPS_PAD",
    "LISTOPS_CLS",
    "Corpus",
    "ByteLMBatches",
    "TaskBatch",
    "ClassificationBatch",
    "stdlib_files",
    "corpus_files",
    "load_corpus",
    "eval_batches",
    "copy_task",
    "mqar_task",
    "listops_task",
    "listops_expression",
    "listops_decode",
    "listops_evaluate",
    "mix_seed",
]

IGNORE_INDEX = -100
"""Target value for positions that count neither for the loss nor for the accuracy."""

PathLike = Union[str, os.PathLike]


# ----------------------------------------------------------------------------------------------
# Small helpers
# ----------------------------------------------------------------------------------------------


def _generator(seed: int | None, generator: torch.Generator | None) -> torch.Generator | None:
    """The generator to draw from: ``generator`` as is, a fresh one seeded with ``seed``, or
    ``None`` (torch's global RNG) when neither is given."""
    if seed is not None and generator is not None:
        raise ValueError("pass either seed or generator, not both")
    if generator is not None:
        if not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
        if generator.device.type != "cpu":
            raise ValueError(f"generator must be a CPU generator, got one on {generator.device}")
        return generator
    if seed is not None:
        check_int("seed", seed, error=TypeError)
        return torch.Generator().manual_seed(seed)
    return None


def mix_seed(*parts: int | str) -> int:
    """A 63-bit seed derived from ints and strings (BLAKE2b of their repr); distinct tuples give
    unrelated seeds. The one seed mixer of linattn: data streams, task batches and per-step RNGs."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


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


# ----------------------------------------------------------------------------------------------
# Batches of synthetic tasks
# ----------------------------------------------------------------------------------------------


@dataclass
class TaskBatch:
    """A batch of a next-token task.

    ``inputs``: ``(n, T)`` long token ids. ``targets``: ``(n, T)`` long, the token to predict
    after each position, :data:`IGNORE_INDEX` where the position counts neither for the loss
    nor the accuracy (so ``F.cross_entropy(logits.flatten(0, 1), targets.flatten())`` works
    as is). ``vocab_size``: the number of token ids.
    """

    inputs: torch.Tensor
    targets: torch.Tensor
    vocab_size: int

    @property
    def loss_mask(self) -> torch.Tensor:
        """``(n, T)`` bool, True where the position is scored."""
        return self.targets != IGNORE_INDEX

    def to(self, device) -> "TaskBatch":
        return TaskBatch(self.inputs.to(device), self.targets.to(device), self.vocab_size)


@dataclass
class ClassificationBatch:
    """A batch of a sequence classification task.

    ``inputs``: ``(n, T)`` long token ids, right-padded. ``mask``: ``(n, T)`` bool, True for
    real tokens (CLS included), False for padding. ``labels``: ``(n,)`` long in
    ``[0, num_classes)``. ``cls_index``: ``(n,)`` long, the position of the CLS token in each row
    (read the classifier from there, or pool over ``mask``). ``vocab_size``, ``num_classes``:
    sizes for the embedding and the output layer.
    """

    inputs: torch.Tensor
    mask: torch.Tensor
    labels: torch.Tensor
    cls_index: torch.Tensor
    vocab_size: int
    num_classes: int

    def to(self, device) -> "ClassificationBatch":
        return ClassificationBatch(
            **{f.name: (getattr(self, f.name).to(device) if isinstance(getattr(self, f.name), torch.Tensor)
                        else getattr(self, f.name)) for f in fields(self)}
        )


# ----------------------------------------------------------------------------------------------
# Copy task
# ----------------------------------------------------------------------------------------------


def copy_task(
    n: int,
    max_len: int = 128,
    n_symbols: int = 10,
    min_len: int = 1,
    *,
    seed: int | None = None,
    generator: torch.Generator | None = None,
) -> TaskBatch:
    """The copy task (Katharopoulos et al., 2020, §4.1), as next-token prediction.

    Each row draws a length ``L`` uniformly from ``[min_len, max_len]`` and ``L`` symbols
    uniformly from ``n_symbols``; the sequence is the symbols, a separator, then the symbols
    again, right-padded to ``T = 2 * max_len + 1``. The loss counts only the copy: the target at
    the separator is the first symbol, and so on up to the last copied symbol.

    Token ids: PAD = 0, symbols ``1..n_symbols``, SEP = ``n_symbols + 1``;
    ``vocab_size = n_symbols + 2``. Example (``n_symbols=10``, symbols 3 7 2, ``max_len=4``)::

        inputs:  3    7    2    11  3  7  2    0    0
        targets: -100 -100 -100 3   7  2  -100 -100 -100

    (The paper trains on sequences of up to 128 symbols from 10 with a separator.)
    """
    check_int("n", n, minimum=1)
    check_int("max_len", max_len, minimum=1)
    check_int("n_symbols", n_symbols, minimum=1)
    check_int("min_len", min_len, minimum=1)
    if min_len > max_len:
        raise ValueError(f"min_len ({min_len}) must be <= max_len ({max_len})")
    g = _generator(seed, generator)
    pad, sep = 0, n_symbols + 1
    lengths = torch.randint(min_len, max_len + 1, (n, 1), generator=g)
    symbols = torch.randint(1, n_symbols + 1, (n, max_len), generator=g)
    T = 2 * max_len + 1
    t = torch.arange(T).expand(n, T)
    in_source = t < lengths
    in_copy = (t > lengths) & (t <= 2 * lengths)
    src_index = torch.where(in_copy, t - lengths - 1, t).clamp(max=max_len - 1)
    inputs = torch.gather(symbols, 1, src_index)
    inputs = torch.where(in_source | in_copy, inputs, torch.full_like(inputs, pad))
    inputs = torch.where(t == lengths, torch.full_like(inputs, sep), inputs)
    # position t predicts token t + 1; scored from the separator (t == L) to the next-to-last copy
    targets = torch.full_like(inputs, IGNORE_INDEX)
    scored = (t >= lengths) & (t < 2 * lengths)
    targets[:, :-1] = torch.where(scored[:, :-1], inputs[:, 1:], targets[:, :-1])
    return TaskBatch(inputs, targets, n_symbols + 2)


# ----------------------------------------------------------------------------------------------
# Multi-query associative recall
# ----------------------------------------------------------------------------------------------

MQAR_CONFIGS: tuple[tuple[int, int], ...] = ((64, 4), (128, 8), (256, 16))
"""The ``(seq_len, n_pairs)`` settings used here (Zoology's standard MQAR settings)."""


def _distinct_ints(n: int, k: int, low: int, high: int, g: torch.Generator | None) -> torch.Tensor:
    """``(n, k)`` rows of ``k`` distinct ints from ``[low, high)``, uniform over ordered tuples."""
    m = high - low
    if 4 * k * k > m:  # collisions likely: take the first k of a random permutation
        return torch.rand(n, m, generator=g).argsort(dim=1)[:, :k] + low
    out = torch.randint(low, high, (n, k), generator=g)
    while True:  # resample whole rows that have a repeat (rare: < 1/4 of rows per round)
        s = out.sort(dim=1).values
        bad = (s[:, 1:] == s[:, :-1]).any(dim=1)
        n_bad = int(bad.sum())
        if n_bad == 0:
            return out
        out[bad] = torch.randint(low, high, (n_bad, k), generator=g)


def mqar_task(
    n: int,
    seq_len: int = 64,
    n_pairs: int = 4,
    vocab_size: int = 8192,
    *,
    power_a: float = 0.01,
    random_non_queries: bool = True,
    seed: int | None = None,
    generator: torch.Generator | None = None,
) -> TaskBatch:
    """Multi-query associative recall (MQAR; Arora et al., 2023, "Zoology"), as in Zoology's
    ``multiquery_ar`` generator.

    Each row starts with ``n_pairs`` key-value pairs (``k1 v1 k2 v2 ...``): distinct keys from
    ``[1, vocab_size // 2)`` and distinct values from ``[vocab_size // 2, vocab_size)``. The
    remaining ``seq_len - 2 * n_pairs`` positions hold every key once more as a query, in random
    order, at even offsets ``2 * g`` from the end of the pairs; the ``n_pairs`` distinct slots
    ``g`` in ``[0, (seq_len - 2 * n_pairs) // 2)`` are drawn without replacement with weights
    ``g' ** (power_a - 1)`` (``g' = g + 1``; ``power_a = 0.01`` is Zoology's default and puts
    most queries soon after the pairs). The target at a query position is the value paired with
    that key; all other targets are :data:`IGNORE_INDEX`. The remaining positions are 0, or,
    with ``random_non_queries`` (Zoology's default), uniform random tokens from the whole
    vocabulary (which may repeat keys or values; they are never scored).

    Zoology's docstring example (``vocab_size=12, n_pairs=2, seq_len=16,
    random_non_queries=False``)::

                 key  val  key  val            query                        query
        inputs:  2    8    4    7    0    0    4    0    0    0    0    0    2    0    0    0
        targets: -100 -100 -100 -100 -100 -100 7    -100 -100 -100 -100 -100 8    -100 -100 -100

    Configurations used in Zoology and here: :data:`MQAR_CONFIGS` = (64, 4), (128, 8),
    (256, 16), with ``vocab_size=8192``. Requires ``seq_len >= 4 * n_pairs`` and
    ``vocab_size // 2 - 1 >= n_pairs``.
    """
    check_int("n", n, minimum=1)
    check_int("seq_len", seq_len, minimum=1)
    check_int("n_pairs", n_pairs, minimum=1)
    check_int("vocab_size", vocab_size, minimum=1)
    if 4 * n_pairs > seq_len:
        raise ValueError(f"seq_len ({seq_len}) must be >= 4 * n_pairs ({4 * n_pairs}) to fit the pairs and the queries")
    half = vocab_size // 2
    if half - 1 < n_pairs:
        raise ValueError(f"vocab_size {vocab_size} has only {max(half - 1, 0)} key ids, fewer than n_pairs={n_pairs}")
    if not power_a > 0:
        raise ValueError(f"power_a must be > 0, got {power_a!r}")
    g = _generator(seed, generator)
    ctx = 2 * n_pairs
    keys = _distinct_ints(n, n_pairs, 1, half, g)
    values = _distinct_ints(n, n_pairs, half, vocab_size, g)
    space = (seq_len - ctx) // 2
    p = torch.arange(1, space + 1, dtype=torch.float64) ** (power_a - 1)
    gaps = torch.multinomial((p / p.sum()).expand(n, space).contiguous(), n_pairs, replacement=False, generator=g)
    query_pos = ctx + 2 * gaps

    inputs = torch.zeros(n, seq_len, dtype=torch.long)
    inputs[:, 0:ctx:2] = keys
    inputs[:, 1:ctx:2] = values
    inputs.scatter_(1, query_pos, keys)
    targets = torch.full((n, seq_len), IGNORE_INDEX, dtype=torch.long)
    targets.scatter_(1, query_pos, values)
    if random_non_queries:
        noise = torch.randint(vocab_size, (n, seq_len), generator=g)
        inputs = torch.where(inputs == 0, noise, inputs)
    return TaskBatch(inputs, targets, vocab_size)


# ----------------------------------------------------------------------------------------------
# ListOps
# ----------------------------------------------------------------------------------------------

LISTOPS_OPERATORS = ("[MIN", "[MAX", "[MED", "[SM")
"""Operator tokens as LRA writes them (the opening bracket is part of the token; SM = SUM_MOD)."""
LISTOPS_TOKENS = ("<pad>", "<cls>") + tuple(str(d) for d in range(10)) + LISTOPS_OPERATORS + ("]",)
"""Token id -> string: PAD 0, CLS 1, digits 2..11, operators 12..15, ']' 16."""
LISTOPS_PAD = 0
LISTOPS_CLS = 1
_LISTOPS_ID = {tok: i for i, tok in enumerate(LISTOPS_TOKENS)}
_LISTOPS_VALUE_P = 0.25  # LRA's VALUE_P: below max depth a node is an operator with probability 0.25


def _listops_apply(op: str, args: list[int]) -> int:
    if op == "[MIN":
        return min(args)
    if op == "[MAX":
        return max(args)
    if op == "[MED":  # LRA: int(np.median(args)), i.e. the mean of the middle two rounded down
        s = sorted(args)
        m = len(s) // 2
        return s[m] if len(s) % 2 else (s[m - 1] + s[m]) // 2
    return sum(args) % 10  # "[SM"


class _TooLong(Exception):
    pass


def _listops_tree(rng: random.Random, max_depth: int, max_args: int, max_len: int) -> tuple[list[str], int] | None:
    """One expression as LRA's ``generate_tree(1, max_depth, max_args)``, with the root forced to
    be an operator; ``None`` as soon as it exceeds ``max_len`` tokens (it would be rejected)."""
    tokens: list[str] = []

    def node(depth: int, force_op: bool = False) -> int:
        if not force_op and (depth >= max_depth or rng.random() > _LISTOPS_VALUE_P):
            v = rng.randrange(10)
            tokens.append(str(v))
        else:
            op = rng.choice(LISTOPS_OPERATORS)
            tokens.append(op)
            args = [node(depth + 1) for _ in range(rng.randint(2, max_args))]
            tokens.append("]")
            v = _listops_apply(op, args)
        if len(tokens) > max_len:
            raise _TooLong
        return v

    try:
        value = node(1, force_op=True)
    except _TooLong:
        return None
    return tokens, value


def _listops_max_length(max_depth: int, max_args: int) -> int:
    length = 1  # a node at depth max_depth is a digit
    for _ in range(max_depth - 1):
        length = 2 + max_args * length
    return length


def _listops_sample(rng: random.Random, max_depth: int, max_args: int, min_len: int, max_len: int,
                    max_tries: int) -> tuple[list[str], int]:
    for _ in range(max_tries):
        out = _listops_tree(rng, max_depth, max_args, max_len)
        if out is not None and len(out[0]) >= min_len:
            return out
    raise RuntimeError(
        f"no ListOps expression with {min_len} <= length <= {max_len} in {max_tries} tries "
        f"(max_depth={max_depth}, max_args={max_args}); widen the length range or change the limits"
    )


def _listops_check(max_depth: int, max_args: int, min_len: int, max_len: int) -> None:
    check_int("max_depth", max_depth, minimum=2)
    check_int("max_args", max_args, minimum=2)
    check_int("min_len", min_len, minimum=1)
    check_int("max_len", max_len, minimum=4)
    if min_len > max_len:
        raise ValueError(f"min_len ({min_len}) must be <= max_len ({max_len})")
    longest = _listops_max_length(max_depth, max_args)
    if min_len > longest:
        raise ValueError(
            f"min_len={min_len} is longer than any expression with max_depth={max_depth}, "
            f"max_args={max_args} (at most {longest} tokens)"
        )


def _python_rng(generator: torch.Generator | None) -> random.Random:
    # A Python RNG seeded from the torch generator: one draw per call keeps the result a function
    # of the torch seed while the recursive generation runs at Python speed.
    return random.Random(int(torch.randint(2**62, (), generator=generator)))


def listops_expression(
    max_depth: int = 10,
    max_args: int = 10,
    min_len: int = 16,
    max_len: int = 128,
    *,
    seed: int | None = None,
    generator: torch.Generator | None = None,
) -> tuple[str, int]:
    """One ListOps expression as an LRA-format string and its value, e.g.
    ``("[MAX 4 3 [MIN 2 3 ] 1 0 ]", 4)``. Parameters as in :func:`listops_task`."""
    _listops_check(max_depth, max_args, min_len, max_len)
    rng = _python_rng(_generator(seed, generator))
    tokens, value = _listops_sample(rng, max_depth, max_args, min_len, max_len, 10_000)
    return " ".join(tokens), value


def listops_task(
    n: int,
    max_depth: int = 10,
    max_args: int = 10,
    min_len: int = 16,
    max_len: int = 128,
    *,
    cls_position: str = "last",
    seed: int | None = None,
    generator: torch.Generator | None = None,
) -> ClassificationBatch:
    """ListOps (Nangia & Bowman, 2018) as in the Long Range Arena (Tay et al., 2021): classify the
    value (0-9) of a nested expression of MIN, MAX, MED (median) and SM (sum modulo 10) over digits.

    Generation follows LRA's ``listops.py``: starting at depth 1, a node below ``max_depth`` is
    an operator with probability 0.25 (else a uniform digit), a node at depth ``max_depth`` is a
    digit, an operator takes ``randint(2, max_args)`` arguments; expressions whose length (number
    of tokens, e.g. 10 for ``[MAX 4 3 [MIN 2 3 ] 1 0 ]``) is outside ``[min_len, max_len]`` are
    rejected and redrawn. So brackets nest at most ``max_depth - 1`` deep. Differences from
    LRA: the length bounds are inclusive (LRA: ``min_length < length < max_length``); the root
    is always an operator (a bare digit has length 1, which LRA's bounds reject anyway);
    samples are not deduplicated; and the defaults are scaled down for CPU (LRA: ``max_depth=10,
    max_args=10``, lengths 500-2000). MED is LRA's ``int(np.median(args))``: the middle value,
    or for an even count the mean of the two middle values rounded down (so MED of 1 4 is 2,
    unlike ``statistics.median_low``).

    Token ids (:data:`LISTOPS_TOKENS`): PAD 0, CLS 1, digits ``d -> d + 2``, ``[MIN`` 12,
    ``[MAX`` 13, ``[MED`` 14, ``[SM`` 15, ``]`` 16; ``vocab_size = 17``, ``num_classes = 10``.
    Each row is the expression plus one CLS token -- after it with ``cls_position="last"``
    (the default, usable by causal models), before it with ``"first"`` -- right-padded with
    PAD to ``T = max_len + 1``. Example, ``[MAX 4 3 [MIN 2 3 ] 1 0 ]`` (value 4), ``max_len=12``::

        inputs: 13 6 5 12 4 5 16 3 2 16 1 0 0      labels: 4
        mask:   1  1 1 1  1 1 1  1 1 1  1 0 0      cls_index: 10
    """
    check_int("n", n, minimum=1)
    _listops_check(max_depth, max_args, min_len, max_len)
    if cls_position not in ("first", "last"):
        raise ValueError(f"cls_position must be 'first' or 'last', got {cls_position!r}")
    rng = _python_rng(_generator(seed, generator))
    T = max_len + 1
    inputs = torch.full((n, T), LISTOPS_PAD, dtype=torch.long)
    labels = torch.empty(n, dtype=torch.long)
    lengths = torch.empty(n, dtype=torch.long)
    rows = []
    for i in range(n):
        tokens, value = _listops_sample(rng, max_depth, max_args, min_len, max_len, 10_000)
        ids = [_LISTOPS_ID[t] for t in tokens]
        rows.append([LISTOPS_CLS] + ids if cls_position == "first" else ids + [LISTOPS_CLS])
        labels[i] = value
        lengths[i] = len(ids) + 1
    for i, row in enumerate(rows):
        inputs[i, : len(row)] = torch.tensor(row)
    mask = torch.arange(T) < lengths[:, None]
    cls_index = torch.zeros(n, dtype=torch.long) if cls_position == "first" else lengths - 1
    return ClassificationBatch(inputs, mask, labels, cls_index, len(LISTOPS_TOKENS), 10)


def listops_decode(ids) -> str:
    """Token ids (a 1-D tensor or a list) back to the LRA string, PAD and CLS dropped."""
    if isinstance(ids, torch.Tensor):
        ids = ids.tolist()
    return " ".join(LISTOPS_TOKENS[i] for i in ids if i not in (LISTOPS_PAD, LISTOPS_CLS))


def listops_evaluate(expression: str) -> int:
    """The value of an LRA-format ListOps string (the generator's own semantics)."""
    tokens = expression.split()
    stack: list[tuple[str, list[int]]] = []
    result = None
    for tok in tokens:
        if tok in LISTOPS_OPERATORS:
            stack.append((tok, []))
            continue
        if tok == "]":
            op, args = stack.pop()
            v = _listops_apply(op, args)
        else:
            v = int(tok)
        if stack:
            stack[-1][1].append(v)
        else:
            result = v
    if stack or result is None:
        raise ValueError(f"malformed ListOps expression: {expression!r}")
    return result
