"""The processes of a run: one, or the data-parallel (DDP) and sequence-parallel groups of a
`torchrun` launch (WORLD_SIZE, RANK, LOCAL_RANK in the environment); gloo on CPU, NCCL on CUDA."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from .._checks import resolve_device
from ..parallel import ParallelGroups, init_distributed, make_parallel_groups


@dataclass(frozen=True)
class Processes:
    """Where this process stands in a run: its rank among `world` processes and, with sequence
    parallelism, its groups. Data parallelism is over dp_size replicas (each sequence_parallel
    processes wide); only the main process (rank 0) writes files and shows progress."""

    ddp: bool = False
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    groups: ParallelGroups | None = None

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def dp_rank(self) -> int:
        return self.rank if self.groups is None else self.groups.dp_rank

    @property
    def dp_size(self) -> int:
        return self.world if self.groups is None else self.groups.dp_size

    def device(self, name: str) -> torch.device:
        """The run's device ('cuda' without an index: this process's GPU)."""
        return resolve_device(name, self.local_rank)

    def wrap(self, model: nn.Module, device: torch.device) -> nn.Module:
        """The module the training step calls: DistributedDataParallel(model) with DDP, else model."""
        if not self.ddp:
            return model
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)

    def sum(self, values: list[float], device: torch.device) -> list[float]:
        """Element-wise sum of `values` over all processes (float64; one all-reduce with DDP)."""
        on = device if (self.ddp and dist.get_backend() == "nccl") else torch.device("cpu")
        t = torch.tensor(values, dtype=torch.float64, device=on)
        if self.ddp:
            dist.all_reduce(t)
        return t.tolist()


@contextlib.contextmanager
def processes_for(cfg) -> Iterator[Processes]:
    """The processes of a run of TrainConfig `cfg`: DDP when `distributed` is "on", or "auto" and
    launched with WORLD_SIZE > 1 (or a process group exists); the default group is created here
    when needed and destroyed (after a barrier) when the run ends."""
    env_world = int(os.environ.get("WORLD_SIZE", "1"))
    want = cfg.distributed == "on" or (cfg.distributed == "auto" and (env_world > 1 or
                                                                     (dist.is_available() and dist.is_initialized())))
    if not want:
        if cfg.sequence_parallel > 1:
            raise ValueError(f"sequence_parallel={cfg.sequence_parallel} needs that many processes: launch with "
                             f"torchrun --nproc-per-node {cfg.sequence_parallel} (or a multiple of it)")
        yield Processes()
        return
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    created = not dist.is_initialized()
    if created:
        dev = resolve_device(cfg.device, local_rank)
        init_distributed(cfg.backend or ("nccl" if dev.type == "cuda" else "gloo"), timeout_s=cfg.dist_timeout_s)
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        groups = None
        if cfg.sequence_parallel > 1:
            if world % cfg.sequence_parallel:
                raise ValueError(f"sequence_parallel={cfg.sequence_parallel} must divide the number of processes "
                                 f"({world})")
            groups = make_parallel_groups(cfg.sequence_parallel, timeout_s=cfg.dist_timeout_s)
        yield Processes(True, rank, world, local_rank, groups)
    finally:
        if created:
            with contextlib.suppress(Exception):
                dist.barrier()
            dist.destroy_process_group()
