"""linattn.parallel.groups: the errors before any process group exists (the multi-process group
set-up is exercised by tests/parallel/test_ops.py)."""

import pytest
import torch
import torch.distributed as dist

from linattn import parallel as D


def test_bad_arguments_without_process_group():
    q = torch.randn(1, 1, 4, 8)
    if not dist.is_initialized():
        with pytest.raises(ValueError, match="group"):
            D.sequence_parallel_linear_attention(q, q, q)
        with pytest.raises(ValueError, match="group"):
            D.sequence_parallel_softmax_attention(q, q, q)
        with pytest.raises(ValueError, match="initialized default process group"):
            D.make_parallel_groups(2)
    with pytest.raises(ValueError, match="timeout_s"):
        D.init_distributed(timeout_s=0)
    with pytest.raises(ValueError, match="backend"):
        D.init_distributed("mpi-ish")
