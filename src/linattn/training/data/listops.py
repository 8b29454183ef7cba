"""ListOps (Nangia & Bowman 2018) as in the Long Range Arena, scaled down: expressions, their
values, and ClassificationBatches."""

from __future__ import annotations

import random

import torch

from ..._checks import check_int
from .base import ClassificationBatch, _generator, check_lengths

__all__ = ["LISTOPS_CLS", "LISTOPS_OPERATORS", "LISTOPS_PAD", "LISTOPS_TOKENS", "listops_decode", "listops_evaluate",
           "listops_expression", "listops_task"]

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
    check_lengths(min_len, max_len, max_len_minimum=4)
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
