"""Packed documents for byte-level LM training (design §17): full rows, no padding, no leaks.

The byte corpus is the concatenation of its files, and one file is one document (data.Corpus
records where each begins). A training row is a window of seq_len + 1 consecutive bytes, as in
data.ByteLMBatches, so it holds the end of one document and the beginnings of the next ones: every
token is real, none is padding. The model keeps the documents apart (`cu_seqlens`: states,
convolutions and softmax attention reset at every document start and at every row start, positions
restart at 0), and the last byte of a document predicts nothing (its target, the next document's
first byte, is IGNORE_INDEX). Without packing the same window would carry one file's state into the
next and ask the model to predict a file's first byte from another's text.

    PackedBatch          a TaskBatch with `starts` (n, T) bool: True where a document begins
    pack_windows         windows of a byte tensor -> PackedBatch (document starts known)
    packed_stream_batch  batch `step` of a ByteLMBatches stream, packed
    packed_eval_batches  data.eval_batches' consecutive windows, packed
    split_starts         a Corpus's document starts inside its train / validation parts
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import data as D


@dataclass
class PackedBatch(D.TaskBatch):
    """A next-token batch of packed rows: inputs, targets (n, T) as in data.TaskBatch (targets
    IGNORE_INDEX at every document's last token) and `starts` (n, T) bool, True where a document
    begins (column 0 always: rows are sequences of their own too)."""

    starts: torch.Tensor = None

    def cu_seqlens(self) -> torch.Tensor:
        """cu_seqlens (int64 [N+1]) of all rows laid end to end as one row of n·T tokens, the
        model's packed input `inputs.reshape(1, -1)`."""
        flat = self.starts.reshape(-1)
        begin = flat.nonzero().reshape(-1)
        return torch.cat((begin, begin.new_tensor([flat.numel()])))

    def rows(self, start: int, end: int) -> "PackedBatch":
        return PackedBatch(self.inputs[start:end], self.targets[start:end], self.vocab_size, self.starts[start:end])

    def to(self, device) -> "PackedBatch":
        return PackedBatch(self.inputs.to(device), self.targets.to(device), self.vocab_size, self.starts.to(device))


def split_starts(corpus: D.Corpus, split: str) -> torch.Tensor:
    """The document starts of corpus part `split` ("train" or "validation"), relative to it: 1-D
    int64, increasing, beginning with 0 (the part after the split begins a document of its own).
    A corpus without recorded starts is one document."""
    n_train = corpus.train.numel()
    starts = corpus.doc_starts if corpus.doc_starts is not None else torch.zeros(1, dtype=torch.long)
    if split == "train":
        return starts[starts < n_train]
    if split == "validation":
        rest = starts[starts > n_train] - n_train
        return torch.cat((rest.new_zeros(1), rest))
    raise ValueError(f"split must be 'train' or 'validation', got {split!r}")


def pack_windows(data: torch.Tensor, window_starts: torch.Tensor, seq_len: int, doc_starts: torch.Tensor,
                 vocab_size: int = 256) -> PackedBatch:
    """Rows data[a : a + seq_len + 1] for each a of window_starts, as a PackedBatch: inputs the first
    seq_len bytes, targets the last seq_len, IGNORE_INDEX where the target begins a document;
    `starts` marks the inputs that begin one (and column 0)."""
    window = window_starts[:, None] + torch.arange(seq_len + 1)
    chunk = data[window].long()
    begins = torch.isin(window, doc_starts)  # (n, seq_len + 1): byte begins a document
    targets = chunk[:, 1:].masked_fill(begins[:, 1:], D.IGNORE_INDEX)
    starts = begins[:, :-1].clone()
    starts[:, 0] = True
    return PackedBatch(chunk[:, :-1], targets, vocab_size, starts)


def packed_stream_batch(stream: D.ByteLMBatches, step: int, doc_starts: torch.Tensor) -> PackedBatch:
    """Batch `step` of `stream` (the same windows as stream.batch(step)), packed."""
    g = torch.Generator().manual_seed(D.mix_seed(stream.seed, step))
    high = stream.data.numel() - stream.seq_len
    window_starts = torch.randint(high, (stream.batch_size,), generator=g)
    return pack_windows(stream.data, window_starts, stream.seq_len, doc_starts)


def packed_eval_batches(data: torch.Tensor, seq_len: int, batch_size: int, doc_starts: torch.Tensor,
                        max_batches: int | None = None):
    """The windows of data.eval_batches (consecutive, window i at byte i·seq_len), packed."""
    n_windows = (data.numel() - 1) // seq_len
    if n_windows == 0:
        raise ValueError(f"data has {data.numel()} bytes, fewer than seq_len + 1 = {seq_len + 1}")
    for b, first in enumerate(range(0, n_windows, batch_size)):
        if max_batches is not None and b >= max_batches:
            return
        starts = torch.arange(first, min(first + batch_size, n_windows)) * seq_len
        yield pack_windows(data, starts, seq_len, doc_starts)


def padded_document_batch(data: torch.Tensor, window_starts: torch.Tensor, seq_len: int,
                          doc_starts: torch.Tensor, vocab_size: int = 256) -> tuple[D.TaskBatch, torch.Tensor]:
    """The padded alternative to packing, for comparisons: each row holds one document only — the
    window from a up to the end of a's document, the rest padding (mask False, targets
    IGNORE_INDEX). Returns (batch, mask (n, seq_len) bool)."""
    window = window_starts[:, None] + torch.arange(seq_len + 1)
    chunk = data[window].long()
    begins = torch.isin(window, doc_starts)
    begins[:, 0] = False
    inside = begins.cumsum(1) == 0  # before the window's next document start
    mask = inside[:, :-1]
    targets = chunk[:, 1:].masked_fill(~inside[:, 1:], D.IGNORE_INDEX)
    inputs = chunk[:, :-1].masked_fill(~mask, 0)
    return D.TaskBatch(inputs, targets, vocab_size), mask


__all__ = ["PackedBatch", "pack_windows", "packed_eval_batches", "packed_stream_batch", "padded_document_batch",
           "split_starts"]
