"""linattn.parallel.comm: shard arithmetic and the state-exchange byte formula (no processes)."""

import pytest
import torch

from linattn import parallel as D


def test_shard_bounds_cover_sequence():
    for n in (0, 1, 5, 37, 64):
        for p in (1, 2, 3, 4):
            bounds = [D.shard_bounds(n, r, p) for r in range(p)]
            assert bounds[0][0] == 0 and bounds[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
            sizes = [e - s for s, e in bounds]
            assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    x = torch.arange(2 * 3 * 7 * 4).reshape(2, 3, 7, 4)
    parts = [D.shard_sequence(x, r, 3) for r in range(3)]
    assert [p.shape[2] for p in parts] == [3, 2, 2]
    assert torch.equal(torch.cat(parts, dim=2), x)
    assert torch.equal(D.shard_sequence(x, 1, 2, dim=-1), x[..., 2:])


def test_bad_shard_arguments():
    q = torch.randn(1, 1, 4, 8)
    with pytest.raises(ValueError, match="rank"):
        D.shard_sequence(q, 2, 2)
    with pytest.raises(ValueError, match="world_size"):
        D.shard_bounds(4, 0, 0)
    with pytest.raises(ValueError, match="n must be an int >= 0"):
        D.shard_bounds(-1, 0, 2)


def test_state_exchange_bytes_formula():
    # P·B·H·(F·E + F)·4 for the all-gather, independent of N by construction
    assert D.state_exchange_bytes(1, 8, 64, 64, 2) == 2 * 8 * (64 * 64 + 64) * 4
    assert D.state_exchange_bytes(1, 8, 64, 64, 2, dtype=torch.bfloat16) == 2 * 8 * (64 * 64 + 64) * 4
    assert D.state_exchange_bytes(2, 4, 16, 8, 4, causal=False) == 2 * 4 * (16 * 8 + 16) * 4
