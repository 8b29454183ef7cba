"""Shard arithmetic and the collectives of sequence parallelism, with their byte accounting.

Every collective of linattn.parallel goes through this module: one place for torch-version
differences, for turning a failed or timed-out collective into an error that says so, and for
`comm_stats`, the count of the bytes that landed on this rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .._checks import FLOAT_DTYPES, check_int, check_positive_int, check_tensor
from ..ops.linear.chunked import state_dtype
from .groups import ShardGroup

_META_LEN = 7  # at least [ok, n_local, B, H, F (or D), E, dtype code]

# --------------------------------------------------------------------------------------------
# shards


def shard_bounds(n: int, rank: int, world_size: int) -> tuple[int, int]:
    """[start, end) of rank's contiguous shard of n tokens; the first n mod P shards get one extra."""
    check_positive_int("world_size", world_size)
    check_int("n", n, minimum=0)
    check_int("rank", rank, minimum=0, below=world_size)
    base, extra = divmod(n, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def shard_sequence(x: torch.Tensor, rank: int, world_size: int, dim: int = 2) -> torch.Tensor:
    """Rank's contiguous shard of x along `dim` (a view): lengths differ by at most one, the first
    N mod P ranks holding the extra tokens. x: (…, N, …) -> (…, n_rank, …)."""
    check_tensor("x", x)
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim must index one of x's {x.dim()} dimensions, got {dim}")
    start, end = shard_bounds(x.shape[dim], rank, world_size)
    return x.narrow(dim, start, end - start)


# --------------------------------------------------------------------------------------------
# communication accounting


@dataclass
class CommStats:
    """Bytes that landed on this rank from the collectives of linattn.parallel, by kind.

    A collective's bytes are the size of its result buffer: P·payload for an all-gather, the
    payload for an all-reduce. Kinds: "state_forward", "state_backward" (linear attention),
    "meta" (shard lengths / shape check), "kv_forward", "kv_backward" (softmax K/V gather).
    """

    bytes: dict = field(default_factory=dict)
    calls: dict = field(default_factory=dict)

    def add(self, kind: str, nbytes: int) -> None:
        self.bytes[kind] = self.bytes.get(kind, 0) + int(nbytes)
        self.calls[kind] = self.calls.get(kind, 0) + 1

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()

    @property
    def total(self) -> int:
        return sum(self.bytes.values())


#: Process-wide counter (reset it before the calls you want to measure).
comm_stats = CommStats()


def state_exchange_bytes(batch: int, heads: int, feature_dim: int, value_dim: int, world_size: int, *,
                         causal: bool = True, dtype: torch.dtype = torch.float32) -> int:
    """Bytes of one state exchange (one layer, one direction) on each rank, independent of N:
    causal (all-gather) P·B·H·(F·E + F)·s, non-causal (all-reduce) B·H·(F·E + F)·s, with s the
    state element size (4: float32 for fp32/bf16/fp16 inputs; 8 for float64)."""
    for name, val in (("batch", batch), ("heads", heads), ("feature_dim", feature_dim), ("value_dim", value_dim),
                      ("world_size", world_size)):
        check_positive_int(name, val)
    size = torch.tensor([], dtype=state_dtype(dtype)).element_size()
    payload = batch * heads * (feature_dim * value_dim + feature_dim) * size
    return world_size * payload if causal else payload


# --------------------------------------------------------------------------------------------
# collectives

_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _run(what: str, fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except RuntimeError as exc:  # DistBackendError and timeouts are RuntimeErrors
        raise RuntimeError(
            f"sequence parallelism: the {what} failed (a rank of the group died, timed out or did not make "
            f"the same call): {exc}"
        ) from exc


def all_gather(x: torch.Tensor, group, world: int, what: str) -> torch.Tensor:
    """x (any shape) -> (P, *x.shape), row s from rank s."""
    x = x.contiguous()
    out = torch.empty((world, *x.shape), dtype=x.dtype, device=x.device)
    _run(what, _all_gather_flat, out.view(world * x.shape[0], *x.shape[1:]) if x.dim() else out, x, group=group)
    return out


def _all_reduce(x: torch.Tensor, group, what: str) -> torch.Tensor:
    x = x.contiguous().clone()
    _run(what, dist.all_reduce, x, group=group)
    return x


def sum_scatter(stacked: torch.Tensor, group, rank: int, what: str) -> torch.Tensor:
    """stacked (P, *s) on every rank -> Σ over ranks of row `rank` (a reduce-scatter)."""
    if dist.get_backend(group) == "nccl":
        out = torch.empty(stacked.shape[1:], dtype=stacked.dtype, device=stacked.device)
        _run(what, _reduce_scatter_flat, out, stacked.contiguous(), group=group)
        return out
    return _all_reduce(stacked, group, what)[rank]  # portable: gloo builds may lack reduce_scatter


def sum_over_ranks(flat: torch.Tensor, shard: ShardGroup, kind: str) -> torch.Tensor:
    """Σ_s flat_s over every rank of the group (one all-reduce)."""
    comm_stats.add(kind, flat.numel() * flat.element_size())
    return _all_reduce(flat, shard.group, f"state all-reduce ({kind})")


def sum_before_rank(flat: torch.Tensor, shard: ShardGroup, kind: str) -> torch.Tensor:
    """Σ_{s<r} flat_s on rank r (one all-gather; zeros on rank 0)."""
    return _gathered_sum(flat, shard, kind, lambda rows: rows[:shard.rank])


def sum_after_rank(flat: torch.Tensor, shard: ShardGroup, kind: str) -> torch.Tensor:
    """Σ_{s>r} flat_s on rank r (one all-gather; zeros on the last rank)."""
    return _gathered_sum(flat, shard, kind, lambda rows: rows[shard.rank + 1:])


def _gathered_sum(flat, shard: ShardGroup, kind: str, pick):
    gathered = all_gather(flat, shard.group, shard.world, f"state all-gather ({kind})")
    comm_stats.add(kind, shard.world * flat.numel() * flat.element_size())
    part = pick(gathered)
    return part.sum(0) if part.shape[0] else torch.zeros_like(flat)


# --------------------------------------------------------------------------------------------
# metadata: every rank's shard length, and the same shapes everywhere


def _meta_device(group) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def dtype_code(dtype: torch.dtype) -> int:
    """A small int naming a floating dtype (-1 for others), for the metadata exchange."""
    return FLOAT_DTYPES.index(dtype) if dtype in FLOAT_DTYPES else -1


def agree(shard: ShardGroup, error: Exception | None, row: list[int], names: tuple[str, ...], *,
          min_tokens: int = 1) -> list[int]:
    """One all-gather of [ok, *row] (at least 7 int64) so that every rank sees every rank's shard
    length and shape; a rank whose local checks failed (error) makes all ranks raise, instead of
    leaving the others waiting in the next collective. row = [n_local, *shape]; the shape entries
    named in `names` must be equal on all ranks (names[i] names entry i + 1 in the message). Returns
    the shard lengths."""
    return [r[0] for r in agree_rows(shard, error, row, names, min_tokens=min_tokens)]


def agree_rows(shard: ShardGroup, error: Exception | None, row: list[int], names: tuple[str, ...], *,
               min_tokens: int = 1) -> list[list[int]]:
    """`agree`, returning every rank's row (rows[s] = rank s's [n_local, *shape]); entries after the
    named ones are only exchanged (e.g. a flag the caller combines over the ranks). Every rank must
    pass a row of the same length."""
    width = max(_META_LEN, len(row) + 1)
    row = [0 if error is None else 1, *row]
    row += [-1] * (width - len(row))
    t = torch.tensor(row, dtype=torch.int64, device=_meta_device(shard.group))
    rows = all_gather(t, shard.group, shard.world, "metadata all-gather (shard lengths, shapes)").tolist()
    comm_stats.add("meta", shard.world * width * 8)
    if error is not None:
        raise error
    bad = [s for s, r in enumerate(rows) if r[0]]
    if bad:
        raise ValueError(f"rank(s) {bad} of the sequence-parallel group rejected their arguments (see the error "
                         "on those ranks); every rank must call with valid shards")
    rows = [r[1:] for r in rows]
    for i, name in enumerate(names, start=1):
        vals = [r[i] for r in rows]
        if name and len(set(vals)) > 1:
            raise ValueError(f"{name} must be equal on all ranks of the group, got {vals} (by rank)")
    lengths = [r[0] for r in rows]
    if min(lengths) < min_tokens:
        raise ValueError(f"q: every rank needs at least one token of the sequence, got shard lengths {lengths}")
    return rows
