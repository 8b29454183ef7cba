"""Sequence parallelism for linear attention on ``torch.distributed`` (design §9): one sequence split
into contiguous shards over the ranks of a process group, only the (kv, z) state crossing shards.

    groups     process groups: init_distributed, make_parallel_groups (sequence × data parallel)
    comm       shard arithmetic (shard_bounds, shard_sequence), the collectives, comm_stats
    functions  the autograd Functions and the shard-level passes
    ops        sequence_parallel_linear_attention / _softmax_attention, gather_sequence,
               sequence_halo (the maths)
    recurrent  sequence_parallel_gated_linear_attention, sequence_parallel_delta_rule (and its KDA
               entry point sequence_parallel_kda): the affine state exchange of the decaying and
               delta-family operators
"""

from .comm import CommStats, comm_stats, shard_bounds, shard_sequence, state_exchange_bytes
from .groups import DEFAULT_TIMEOUT_S, ParallelGroups, free_port, init_distributed, make_parallel_groups
from .ops import (
    gather_sequence,
    sequence_halo,
    sequence_parallel_linear_attention,
    sequence_parallel_softmax_attention,
)
from .recurrent import (
    sequence_parallel_delta_rule,
    sequence_parallel_gated_linear_attention,
    sequence_parallel_kda,
    transition_exchange_bytes,
)

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "CommStats",
    "ParallelGroups",
    "comm_stats",
    "free_port",
    "gather_sequence",
    "init_distributed",
    "make_parallel_groups",
    "sequence_halo",
    "sequence_parallel_delta_rule",
    "sequence_parallel_gated_linear_attention",
    "sequence_parallel_kda",
    "sequence_parallel_linear_attention",
    "sequence_parallel_softmax_attention",
    "shard_bounds",
    "shard_sequence",
    "state_exchange_bytes",
    "transition_exchange_bytes",
]
