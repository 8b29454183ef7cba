"""Process groups for sequence parallelism: setting up the default group, splitting a world into
sequence-parallel blocks and data-parallel replicas, and the group a collective runs on."""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .._checks import check_number, check_positive_int

#: Default collective timeout (seconds) for `init_distributed`.
DEFAULT_TIMEOUT_S = 300.0

# the timeout init_distributed gave the default group it created (keyed by the group object)
_default_group_timeouts: dict[int, datetime.timedelta] = {}


def init_distributed(
    backend: str | None = None,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    init_method: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
) -> tuple[int, int]:
    """Initializes the default process group (once) and returns (rank, world_size).

    backend: "gloo" (CPU) or "nccl" (CUDA); None picks nccl when CUDA is available, else gloo.
    timeout_s: seconds a collective may wait for the other ranks before it raises, so a dead or
        diverged rank gives an error, not a hang (NCCL needs async error handling, the default
        of recent torch, for this).
    init_method, rank, world_size: as for torch.distributed.init_process_group; by default they come
        from the environment `torchrun` sets (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). Without
        that environment and world_size in (None, 1), a one-process group on a free local port.
    With nccl, the CUDA device is set to LOCAL_RANK (or rank mod the device count).
    If a default group already exists it is kept and its (rank, world_size) returned.
    """
    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this build of torch")
    check_number("timeout_s", timeout_s, minimum=0, low_open=True)
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo', 'nccl' or None, got {backend!r}")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("backend='nccl' needs CUDA, which is not available; use backend='gloo' on CPU")
    env = os.environ
    if rank is None and "RANK" in env:
        rank = int(env["RANK"])
    if world_size is None and "WORLD_SIZE" in env:
        world_size = int(env["WORLD_SIZE"])
    if init_method is None:
        if "MASTER_ADDR" in env and "MASTER_PORT" in env:
            init_method = "env://"
        elif world_size in (None, 1) and rank in (None, 0):
            init_method, rank, world_size = f"tcp://127.0.0.1:{free_port()}", 0, 1
        else:
            raise ValueError(
                "init_method is None and MASTER_ADDR/MASTER_PORT are not set: launch with torchrun or pass "
                "init_method (e.g. 'tcp://host:port' or 'file:///path')"
            )
    if rank is None or world_size is None:
        raise ValueError(f"rank and world_size are needed (got rank={rank}, world_size={world_size}); "
                         "set RANK/WORLD_SIZE (torchrun does) or pass them")
    if backend == "nccl":
        local = int(env.get("LOCAL_RANK", rank % max(1, torch.cuda.device_count())))
        torch.cuda.set_device(local)
    timeout = datetime.timedelta(seconds=float(timeout_s))
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timeout)
    _default_group_timeouts.clear()
    _default_group_timeouts[id(dist.group.WORLD)] = timeout
    return rank, world_size


def default_group_timeout() -> datetime.timedelta:
    """The collective timeout of the default process group: the one init_distributed set, else the
    one its backend reports (a group made with torch.distributed directly), else DEFAULT_TIMEOUT_S.
    Groups made later do not inherit it by themselves: torch.distributed.new_group without a timeout
    takes torch's default (30 minutes for gloo), which is why make_parallel_groups passes this one."""
    world = dist.group.WORLD
    try:
        device = torch.device("cuda" if dist.get_backend() == "nccl" else "cpu")
        timeout = world._get_backend(device).options._timeout
        if isinstance(timeout, datetime.timedelta) and timeout.total_seconds() > 0:
            return timeout
    except (AttributeError, RuntimeError, TypeError):  # private API, varies with the torch version
        pass
    return _default_group_timeouts.get(id(world), datetime.timedelta(seconds=DEFAULT_TIMEOUT_S))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bind to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class ParallelGroups:
    """Process groups for sequence × data parallelism over a world of W = P·R ranks.

    Sequence-parallel groups are blocks of P consecutive ranks (one sequence split over them, fast
    links within a node); data-parallel groups gather the ranks with the same position in their
    block (gradients are averaged over them). World rank w: sp_rank = w mod P, dp_rank = w div P.
    """

    sequence: object  # ProcessGroup of this rank's sequence-parallel block
    data: object  # ProcessGroup of this rank's data-parallel replicas
    sp_rank: int
    sp_size: int
    dp_rank: int
    dp_size: int


def make_parallel_groups(sequence_parallel: int, *, timeout_s: float | None = None) -> ParallelGroups:
    """Splits the default group into sequence-parallel blocks of `sequence_parallel` ranks and the
    matching data-parallel groups (see ParallelGroups). Every rank must call it (collective).
    timeout_s: seconds a collective on the new groups waits for a missing rank before it raises
    (None: the default group's, see default_group_timeout)."""
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("make_parallel_groups needs an initialized default process group (init_distributed())")
    check_positive_int("sequence_parallel", sequence_parallel)
    check_number("timeout_s", timeout_s, minimum=0, low_open=True, allow_none=True)
    timeout = default_group_timeout() if timeout_s is None else datetime.timedelta(seconds=float(timeout_s))
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % sequence_parallel:
        raise ValueError(f"sequence_parallel={sequence_parallel} must divide the world size {world}")
    p, r = sequence_parallel, world // sequence_parallel
    sp_group = dp_group = None
    for i in range(r):  # every rank creates every group, in the same order
        g = dist.new_group(list(range(i * p, (i + 1) * p)), timeout=timeout)
        if rank // p == i:
            sp_group = g
    for j in range(p):
        g = dist.new_group(list(range(j, world, p)), timeout=timeout)
        if rank % p == j:
            dp_group = g
    return ParallelGroups(sp_group, dp_group, rank % p, p, rank // p, r)


@dataclass(frozen=True)
class ShardGroup:
    """The processes one sequence is sharded over: the process group, this process's rank in it
    and its size (shard r holds the r-th contiguous piece of the sequence)."""

    group: object
    rank: int
    world: int


def resolve_group(group) -> ShardGroup:
    """The ShardGroup of `group` (None: the default group); ValueError when there is no usable group."""
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            "group: torch.distributed is not initialized; call linattn.parallel.init_distributed() "
            "(or torch.distributed.init_process_group) first, or use the single-process op"
        )
    if group is None:
        group = dist.group.WORLD
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("group: this process is not a member of the given process group")
    return ShardGroup(group, rank, dist.get_world_size(group))
