"""The copy task (Katharopoulos et al. 2020, §4.1) and multi-query associative recall (Zoology's
generator), as TaskBatches."""

from __future__ import annotations

import torch

from ..._checks import check_int
from .base import IGNORE_INDEX, TaskBatch, _generator, check_lengths

__all__ = ["MQAR_CONFIGS", "copy_task", "mqar_task"]

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
    check_int("n_symbols", n_symbols, minimum=1)
    check_lengths(min_len, max_len)
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


