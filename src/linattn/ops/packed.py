"""Packed variable-length sequences (design §17): N sequences laid end to end along the time axis of
one row (batch 1), described by `cu_seqlens`, the LongTensor [N+1] of cumulative lengths
(FlashAttention's `flash_attn_varlen_func` convention, and flash-linear-attention's):

    sequence n = tokens cu_seqlens[n] … cu_seqlens[n+1] − 1,   cu_seqlens[0] = 0,   cu_seqlens[N] = T

Every recurrent state starts afresh (or from initial_state[n]) at cu_seqlens[n]; the final states
come back one per sequence, stacked on a leading dim N where the unpacked operators have B.
Nothing crosses a boundary: the fused kernels walk each (sequence, head) as a row of its own, and
`run` evaluates each sequence by itself — its tokens are sliced out of the row and given to the
unpacked operator, sequences of equal length stacked as the rows of one batch (which the operators
keep apart row by row) — so either way a chunk never holds two sequences and a NaN in one cannot
reach another. Sequences of length 0 (their final state is their initial state) and 1 are
allowed.

The helpers here know nothing of the operator families: the operators (linattn.ops.linear, .gated, .delta with
KDA) call `boundaries` once to check cu_seqlens (the one validator of it). Where a call takes the fused CPU
kernels (and `IN_KERNELS`), the whole packed row is one kernel call that is given cu_seqlens: each (sequence,
head) is a row of the kernel, walked from its own initial state, its chunks cut at the sequence's end
(csrc/rows.h). Elsewhere (other devices, options the kernels do not take, a NaN or Inf that needs an exact
pass) they call `run` with a function that evaluates one sequence; `per_sequence` is `run` for the exact
passes of the fused backwards. `positions` and `sequence_ids` serve the models (positions restarting at
each document) and the short convolution.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

_INT_DTYPES = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)

#: Whether a packed call that the fused CPU kernels take runs as one kernel call over the whole row
#: (cu_seqlens inside the kernels; True) or as one call per distinct length (`run`; False, the path of
#: the other devices). Same numbers either way; benchmarks and tests switch it to compare the two.
IN_KERNELS = True


def boundaries(cu_seqlens, *, batch: int, length: int, name: str = "cu_seqlens") -> list[tuple[int, int]]:
    """Checks cu_seqlens against a (batch, …, length, …) input and returns the N (start, end) pairs.

    cu_seqlens: a 1-D integer tensor [N+1], N ≥ 1, cu_seqlens[0] = 0, non-decreasing,
    cu_seqlens[-1] = length; batch must be 1 (ValueError / TypeError naming the argument)."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"{name} must be a 1-D integer torch.Tensor [N+1], got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in _INT_DTYPES:
        raise TypeError(f"{name} must be an integer tensor (int32 or int64), got dtype {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"{name} must be 1-D with N+1 ≥ 2 entries (N sequences), got shape {tuple(cu_seqlens.shape)}")
    if batch != 1:
        raise ValueError(f"with {name}, the batch must be 1 (batch size must be 1: the sequences are packed along "
                         f"the time axis of one row), got batch size {batch}")
    cu = [int(x) for x in cu_seqlens.tolist()]
    if cu[0] != 0:
        raise ValueError(f"{name}[0] must be 0, got {cu[0]}")
    steps = [b - a for a, b in zip(cu, cu[1:])]
    if min(steps) < 0:
        at = steps.index(min(steps))
        raise ValueError(f"{name} must be non-decreasing, got {cu[at]} then {cu[at + 1]} at index {at}")
    if cu[-1] != length:
        raise ValueError(f"{name}[-1] must equal the number of tokens T={length}, got {cu[-1]}")
    return list(zip(cu, cu[1:]))


def check_state_count(state, count: int, name: str = "initial_state") -> None:
    """A per-sequence state (a tensor or a tuple of tensors) must have `count` = N entries on its
    leading dim (one per sequence of cu_seqlens, where the unpacked operator has the batch)."""
    parts = state if isinstance(state, (tuple, list)) else (state,)
    for i, x in enumerate(parts):
        if x is None:
            continue
        what = name if len(parts) == 1 else f"{name}[{i}]"
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() < 1 or x.shape[0] != count:
            raise ValueError(f"with cu_seqlens, {what} must have one entry per sequence on its leading dim "
                             f"(N={count}), got shape {tuple(x.shape)}")


def select_state(state, index):
    """The states of the sequences `index` (an int n, or a list of them) from a per-sequence state
    (a tensor, a tuple of tensors or None, or None): leading dim 1, or len(index)."""
    if state is None:
        return None
    if isinstance(state, (tuple, list)):
        return tuple(select_state(x, index) for x in state)
    if isinstance(index, int):
        return state[index:index + 1]
    if len(index) == 1:
        return state[index[0]:index[0] + 1]
    return state.index_select(0, torch.tensor(index, device=state.device))


def stack_states(states: Sequence):
    """Per-sequence states (each with a leading dim: 1, or a group's G) concatenated on it; tuples
    element by element (None stays None)."""
    first = states[0]
    if isinstance(first, (tuple, list)):
        return tuple(None if first[i] is None else torch.cat([s[i] for s in states], 0) for i in range(len(first)))
    return torch.cat(list(states), 0)


def gather(x, spans: list[tuple[int, int]], dim: int):
    """The tokens of `spans` (sequences of one length L) of x (1, …, T, …) on the time axis `dim`,
    stacked on the batch axis: (len(spans), …, L, …); a 1-D x (T,) (positions) is read as (1, T).
    None stays None."""
    if x is None:
        return None
    if x.dim() == 1:
        x, dim = x[None], 1
    dim = dim % x.dim()
    start, length = spans[0][0], spans[0][1] - spans[0][0]
    if len(spans) == 1:
        return x.narrow(dim, start, length)
    if _consecutive(spans):  # a view: (1, …, G·L, …) -> (G, …, L, …)
        return x.narrow(dim, start, len(spans) * length).unflatten(dim, (len(spans), length)).movedim(dim, 0).squeeze(1)
    return torch.cat([x.narrow(dim, s, e - s) for s, e in spans], 0)


def _consecutive(spans) -> bool:
    """The spans (of one length) follow each other without a gap, in order."""
    return all(a[1] == b[0] for a, b in zip(spans, spans[1:]))


def run(one: Callable, bounds: list[tuple[int, int]], initial_state, empty_state: Callable, empty_output: Callable):
    """Evaluates a packed call: the sequences of each length L run as one batch (the unpacked
    operator on G rows of L tokens, which never mix), then the row is put back together.

    one(spans, state) -> (o (G, H, L, E), final state (leading dim G)): the operator on the G
        sequences `spans` [(start, end), …] of one length L, stacked on the batch axis (`gather`),
        from `state` (their initial states, leading dim G, or None).
    initial_state: the per-sequence states (leading dim N, checked by `check_state_count`) or None.
    empty_state(state) -> the final state of an empty sequence that starts from `state` (state
        itself, or zeros where it is None).
    empty_output() -> the (1, H, 0, E) output of a row with no tokens at all.
    Returns (o (1, H, T, E), final states with leading dim N)."""
    by_length: dict[int, list[int]] = {}
    for n, (s, e) in enumerate(bounds):
        by_length.setdefault(e - s, []).append(n)
    blocks: list = []  # (first token, output (1, H, tokens, E)) of runs of consecutive sequences
    finals: list = []  # final states (leading dim G) of the groups, in the order of `order`
    order: list[int] = []
    for length, index in by_length.items():
        state = select_state(initial_state, index)
        order.extend(index)
        if length == 0:
            finals.extend(empty_state(select_state(state, i)) for i in range(len(index)))
            continue
        spans = [bounds[n] for n in index]
        o, final = one(spans, state)
        if len(index) == 1:
            blocks.append((spans[0][0], o))
        elif _consecutive(spans):  # (G, H, L, E) -> (1, H, G·L, E)
            blocks.append((spans[0][0], o.movedim(0, -3).flatten(-3, -2).unsqueeze(0)))
        else:
            blocks.extend((s, o[i:i + 1]) for i, (s, _) in enumerate(spans))
        finals.append(final)
    blocks.sort(key=lambda b: b[0])
    o = empty_output() if not blocks else blocks[0][1] if len(blocks) == 1 else torch.cat([b[1] for b in blocks], 2)
    final = finals[0] if len(finals) == 1 else stack_states(finals)
    if order != sorted(order):  # back to the sequences' order
        inverse = [0] * len(order)
        for i, n in enumerate(order):
            inverse[n] = i
        final = select_state(final, inverse)
    return o, final


def per_sequence(fn: Callable, bounds: list[tuple[int, int]], tokens: Sequence, states: Sequence, empty_output: Callable):
    """A packed call as separate calls: fn(*token_tensors, *states) -> (o, *final states) evaluates the G
    sequences of one length stacked on the batch axis (their tokens `gather`ed from `tokens`, each
    (1, H, T, …) or None, their states selected from `states`, each with leading dim N or None).
    Returns (o (1, H, T, E), the tuple of the final states (leading dim N), one per entry of `states`,
    None where fn returns none, e.g. for a state given as None). For the exact passes of the
    fused kernels' backwards, which run the torch-op Functions sequence by sequence."""

    def one(spans, state):
        o, *final = fn(*(gather(x, spans, 2) for x in tokens), *state)
        return o, tuple(final) + (None,) * (len(state) - len(final))  # as many as `states` (None: no such state)

    return run(one, bounds, tuple(states), lambda state: state, empty_output)


def positions(cu_seqlens: torch.Tensor, length: int | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
    """(T,) int64: each token's index inside its own sequence (0 at every cu_seqlens[n]); the
    positions of RoPE and learned position embeddings in a packed row. cu_seqlens is checked.

    mask: (1, T) bool, True = real token: positions then count the real tokens of each sequence, as
    `linattn.nn.attention.token_positions` does for a padded batch: p_j = #{real tokens of j's
    sequence up to j} − 1, clamped at 0 (pads before a sequence's first real token get 0)."""
    length = int(cu_seqlens[-1]) if length is None and isinstance(cu_seqlens, torch.Tensor) else length
    bounds = boundaries(cu_seqlens, batch=1, length=length)
    device = cu_seqlens.device
    if not bounds:
        return torch.zeros(0, dtype=torch.long, device=device)
    starts = torch.tensor([s for s, _ in bounds], dtype=torch.long, device=device)
    lengths = torch.tensor([e - s for s, e in bounds], dtype=torch.long, device=device)
    if mask is None:
        return torch.arange(length, device=device) - starts.repeat_interleave(lengths, output_size=length)
    real = mask.reshape(-1).to(device=device, dtype=torch.long)
    seen = real.cumsum(0)  # real tokens up to and including j
    before = (seen - real)[starts]  # real tokens before each sequence
    return (seen - before.repeat_interleave(lengths, output_size=length) - 1).clamp_min(0)


def sequence_ids(cu_seqlens: torch.Tensor, length: int | None = None) -> torch.Tensor:
    """(T,) int64: the index n of the sequence each token belongs to. cu_seqlens is checked."""
    length = int(cu_seqlens[-1]) if length is None and isinstance(cu_seqlens, torch.Tensor) else length
    bounds = boundaries(cu_seqlens, batch=1, length=length)
    lengths = torch.tensor([e - s for s, e in bounds], dtype=torch.long, device=cu_seqlens.device)
    return torch.arange(len(bounds), device=cu_seqlens.device).repeat_interleave(lengths, output_size=length)


def cu_seqlens_from_lengths(lengths: Sequence[int], device=None) -> torch.Tensor:
    """cu_seqlens (int64 [N+1]) of sequences of the given lengths: [0, l_0, l_0 + l_1, …]."""
    cu = [0]
    for n, length in enumerate(lengths):
        if int(length) < 0:
            raise ValueError(f"lengths[{n}] must be ≥ 0, got {length}")
        cu.append(cu[-1] + int(length))
    return torch.tensor(cu, dtype=torch.long, device=device)


def cu_seqlens_from_position_ids(position_ids) -> torch.Tensor | None:
    """cu_seqlens [N+1] (int64) of the documents of one packed row described by transformers'
    position_ids (1, T), which restart at each document (DataCollatorWithFlattening): a document
    starts wherever a position is not its predecessor + 1. None when the row holds one sequence
    (positions counting on from any offset, as a cache's do) or the batch has more rows."""
    if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2 or position_ids.shape[0] != 1:
        return None
    p = position_ids[0]
    if p.numel() < 2:
        return None
    starts = torch.nonzero(p[1:] != p[:-1] + 1).flatten() + 1
    if starts.numel() == 0:
        return None
    t = p.numel()
    return torch.cat([starts.new_zeros(1), starts, starts.new_full((1,), t)]).long()


__all__ = ["IN_KERNELS", "boundaries", "check_state_count", "cu_seqlens_from_lengths", "cu_seqlens_from_position_ids",
           "gather", "per_sequence", "positions", "run", "select_state", "sequence_ids", "stack_states"]
