"""linattn.parallel's operators: spawned gloo processes on CPU against the single-process
ops. Each launch runs many cases in one set of processes (process start-up dominates the cost);
every rank recomputes the single-process reference itself and compares its shard."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from linattn import parallel as D
from linattn.parallel import ops as sp_ops
from linattn.nn.feature_maps import make_feature_map
from linattn.ops import linear_attention, softmax_attention
from linattn.nn.positional import RotaryEmbedding

from .harness import launch, setup

B, H, DH, E = 2, 2, 8, 6  # F = DH for elu/relu; E != F on purpose
TOL = dict(atol=2e-5, rtol=1e-4)
TOL_BF16 = dict(atol=3e-2, rtol=3e-2)


# ------------------------------------------------------------------------------------------------
# helpers run inside the spawned ranks


def _launch(fn, world: int, *args, timeout_s: float = 60.0):
    launch(fn, world, *args, timeout_s=timeout_s, preload=(__name__,))


_setup = setup


def _inputs(n, seed, dtype=torch.float32, positive=False):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, H, n, DH, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(B, H, n, E, generator=g, dtype=torch.float64)
    w = torch.randn(B, H, n, E, generator=g)
    if positive:
        q, k = torch.nn.functional.softplus(q), torch.nn.functional.softplus(k)
    return q.to(dtype), k.to(dtype), v.to(dtype), w


def _params(module):
    return [] if module is None else [p for p in module.parameters() if p.requires_grad]


def _check_linear(rank, world, name, *, n, group=None, seed=0, dtype=torch.float32, fmap=None, rope=None,
                  normalize=True, causal=True, explicit_positions=False, mask=False, chunk=8, positive=False):
    """Sharded forward+backward equals the single-process op on the full sequence (rank's slice)."""
    prank = dist.get_rank(group)
    q, k, v, w = _inputs(n, seed, dtype, positive)
    kpm = None
    if mask:
        kpm = torch.rand(B, n, generator=torch.Generator().manual_seed(seed + 1)) > 0.3
    kw = dict(causal=causal, feature_map=fmap, normalize=normalize, rope=rope, chunk_size=chunk)
    ref_in = [x.clone().requires_grad_() for x in (q, k, v)]
    o_ref = linear_attention(*ref_in, key_padding_mask=kpm, **kw)
    (o_ref.double() * w.double()).sum().backward()
    ref_pgrads = [p.grad.clone() for p in _params(fmap)]
    for p in _params(fmap):
        p.grad = None

    s, t = D.shard_bounds(n, prank, dist.get_world_size(group))
    loc = [x[:, :, s:t].clone().requires_grad_() for x in (q, k, v)]
    pos = torch.arange(s, t).expand(B, t - s).contiguous() if explicit_positions else None
    o = D.sequence_parallel_linear_attention(*loc, group=group, positions=pos,
                                             key_padding_mask=None if kpm is None else kpm[:, s:t], **kw)
    (o.double() * w[:, :, s:t].double()).sum().backward()
    tol = TOL_BF16 if dtype == torch.bfloat16 else TOL
    def msg(what):
        return lambda m: f"[{name}, rank {rank}/{world}, n={n}] {what}: {m}"

    assert o.dtype == dtype, f"[{name}] output dtype {o.dtype}"
    torch.testing.assert_close(o, o_ref[:, :, s:t].detach(), **tol, msg=msg("output"))
    for nm, x, xr in zip("qkv", loc, ref_in):
        torch.testing.assert_close(x.grad, xr.grad[:, :, s:t], **tol, msg=msg(f"d{nm}"))
    for p, gref in zip(_params(fmap), ref_pgrads):  # parameter grads: this rank's share, summed over the group
        gsum = p.grad.clone()
        dist.all_reduce(gsum, group=group)
        torch.testing.assert_close(gsum, gref, **tol, msg=msg("feature-map parameter grad"))
        p.grad = None


def _check_softmax(rank, world, name, *, n, causal, seed=0):
    q, k, v, w = _inputs(n, seed)
    ref_in = [x.clone().requires_grad_() for x in (q, k, v)]
    o_ref = softmax_attention(*ref_in, causal=causal)
    (o_ref * w).sum().backward()
    s, t = D.shard_bounds(n, rank, world)
    loc = [x[:, :, s:t].clone().requires_grad_() for x in (q, k, v)]
    o = D.sequence_parallel_softmax_attention(*loc, causal=causal)
    (o * w[:, :, s:t]).sum().backward()
    torch.testing.assert_close(o, o_ref[:, :, s:t].detach(), **TOL, msg=lambda m: f"[{name}, rank {rank}] output: {m}")
    for nm, x, xr in zip("qkv", loc, ref_in):
        torch.testing.assert_close(x.grad, xr.grad[:, :, s:t], **TOL,
                                   msg=lambda m, nm=nm: f"[{name}, rank {rank}] d{nm}: {m}")


def _bytes_per_layer(rank, world, n, causal):
    """comm_stats of one forward+backward of one layer."""
    q, k, v, _ = _inputs(n, 7)
    s, t = D.shard_bounds(n, rank, world)
    loc = [x[:, :, s:t].clone().requires_grad_() for x in (q, k, v)]
    fmap = make_feature_map("elu", DH)
    D.comm_stats.reset()
    D.sequence_parallel_linear_attention(*loc, feature_map=fmap, causal=causal).sum().backward()
    return dict(D.comm_stats.bytes)


def _check_bytes(rank, world):
    for causal in (True, False):
        small = _bytes_per_layer(rank, world, 2 * world + 1, causal)
        large = _bytes_per_layer(rank, world, 40 * world + 3, causal)
        assert small == large, f"bytes depend on N: {small} vs {large}"
        expected = D.state_exchange_bytes(B, H, DH, E, world, causal=causal)
        assert small["state_forward"] == expected, (small, expected)
        assert small["state_backward"] == expected, (small, expected)
        assert small["meta"] == world * 7 * 8


def _check_errors(rank, world):
    q, k, v, _ = _inputs(4, 3)
    # shapes that differ between ranks: every rank gets a ValueError naming the argument
    h = 1 if rank == 1 else H
    with pytest.raises(ValueError, match="heads H must be equal on all ranks"):
        D.sequence_parallel_linear_attention(q[:, :h], k[:, :h], v[:, :h])
    # a rank with bad local arguments raises its own error; the others learn it instead of hanging
    kk = k[..., :4] if rank == 0 else k
    expected = "head dim" if rank == 0 else "rejected their arguments"
    with pytest.raises(ValueError, match=expected):
        D.sequence_parallel_linear_attention(q, kk, v)
    with pytest.raises(ValueError, match="max_len"):
        D.sequence_parallel_linear_attention(q, k, v, feature_map=make_feature_map("cosformer", DH, max_len=7))


def _check_gather(rank, world):
    n = 3 * world + 1
    x = torch.randn(n, 3, 5, generator=torch.Generator().manual_seed(11))
    s, t = D.shard_bounds(n, rank, world)
    loc = x[s:t].clone().requires_grad_()
    full = D.gather_sequence(loc, dim=0)
    torch.testing.assert_close(full, x)
    (full * (rank + 1)).sum().backward()  # every rank's loss uses the full sequence
    torch.testing.assert_close(loc.grad, torch.full_like(loc, world * (world + 1) / 2))


def _worker_2(rank, world, init, tmp, timeout_s):
    _setup(rank, world, init, timeout_s)
    n = 37  # 19 + 18: not divisible by the world size
    elu = make_feature_map("elu", DH)
    cos = make_feature_map("cosformer", DH, max_len=64)
    _check_linear(rank, world, "elu", n=n, fmap=elu)
    _check_linear(rank, world, "elu, one chunk per shard", n=9, fmap=elu, chunk=64)
    _check_linear(rank, world, "elu non-causal", n=n, fmap=elu, causal=False)
    _check_linear(rank, world, "elu normalize=False", n=n, fmap=elu, normalize=False)
    _check_linear(rank, world, "elu key padding mask", n=n, fmap=elu, mask=True)
    _check_linear(rank, world, "no feature map", n=n, positive=True)
    # relu-based maps: a key/query row with no positive entry gives a ~0 denominator, where fp32 itself
    # is ill-conditioned (single-process fp32 vs fp64 differ by 0.1); positive inputs avoid such rows
    _check_linear(rank, world, "relu", n=n, fmap=make_feature_map("relu", DH), positive=True)
    _check_linear(rank, world, "relu fp64 (fp64 states)", n=n, fmap=make_feature_map("relu", DH),
                  dtype=torch.float64)
    _check_linear(rank, world, "favor", n=n, fmap=make_feature_map("favor", DH, num_features=16, seed=1))
    _check_linear(rank, world, "trig (signed features, ill-conditioned: fp64)", n=n,
                  fmap=make_feature_map("trig", DH, num_features=8, seed=2), dtype=torch.float64)
    _check_linear(rank, world, "taylor", n=n, fmap=make_feature_map("taylor", DH))
    _check_linear(rank, world, "hedgehog (learned)", n=n, fmap=make_feature_map("hedgehog", DH, num_features=8))
    _check_linear(rank, world, "cosformer", n=n, fmap=cos, positive=True)
    _check_linear(rank, world, "cosformer explicit positions", n=n, fmap=cos, explicit_positions=True,
                  positive=True)
    _check_linear(rank, world, "cosformer non-causal", n=n, fmap=cos, causal=False, positive=True)
    _check_linear(rank, world, "cosformer fp64", n=n, fmap=cos, dtype=torch.float64)
    _check_linear(rank, world, "elu + rope", n=n, fmap=elu, rope=RotaryEmbedding(DH))
    _check_linear(rank, world, "elu + rope non-causal", n=n, fmap=elu, rope=RotaryEmbedding(DH), causal=False)
    _check_linear(rank, world, "bf16 elu", n=n, fmap=elu, dtype=torch.bfloat16)
    _check_linear(rank, world, "bf16 cosformer + rope", n=n, fmap=cos, rope=RotaryEmbedding(2 * DH),
                  dtype=torch.bfloat16, positive=True)
    # the shard-level passes (local state sum, state-gradient pass) walk several token blocks
    block_tokens = sp_ops.block_tokens
    sp_ops.block_tokens = lambda bh, width, chunk: 8
    try:
        _check_linear(rank, world, "elu + rope, blocks of 8 tokens", n=n, fmap=elu, rope=RotaryEmbedding(DH))
        _check_linear(rank, world, "cosformer non-causal, blocks of 8", n=n, fmap=cos, causal=False, positive=True)
    finally:
        sp_ops.block_tokens = block_tokens
    _check_softmax(rank, world, "softmax causal", n=n, causal=True)
    _check_softmax(rank, world, "softmax non-causal", n=n, causal=False)
    _check_bytes(rank, world)
    _check_gather(rank, world)
    _check_errors(rank, world)
    dist.destroy_process_group()


def _worker_4(rank, world, init, tmp, timeout_s):
    _setup(rank, world, init, timeout_s)
    n = 23  # 6 + 6 + 6 + 5
    elu = make_feature_map("elu", DH)
    _check_linear(rank, world, "elu", n=n, fmap=elu, chunk=4)
    _check_linear(rank, world, "elu non-causal", n=n, fmap=elu, causal=False)
    _check_linear(rank, world, "cosformer", n=n, fmap=make_feature_map("cosformer", DH, max_len=32), positive=True)
    _check_linear(rank, world, "elu + rope, normalize=False", n=n, fmap=elu, rope=RotaryEmbedding(DH),
                  normalize=False)
    _check_linear(rank, world, "bf16 elu", n=n, fmap=elu, dtype=torch.bfloat16)
    _check_softmax(rank, world, "softmax causal", n=n, causal=True)
    _check_bytes(rank, world)
    # sequence × data parallelism: 2 sequence-parallel blocks of 2 ranks, each with its own batch
    groups = D.make_parallel_groups(2)
    assert (groups.sp_size, groups.dp_size) == (2, 2)
    assert (groups.sp_rank, groups.dp_rank) == (rank % 2, rank // 2)
    _check_linear(rank, world, "elu on a sequence-parallel subgroup", n=13, fmap=elu, group=groups.sequence,
                  seed=100 + groups.dp_rank)
    dist.destroy_process_group()


def _worker_timeout(rank, world, init, tmp, timeout_s):
    _setup(rank, world, init, timeout_s)
    flag = os.path.join(tmp, "done")
    if rank == 1:  # alive but never joins the collective
        deadline = time.time() + 30
        while not os.path.exists(flag) and time.time() < deadline:
            time.sleep(0.1)
        return
    q, k, v, _ = _inputs(6, 0)
    t0 = time.time()
    try:
        with pytest.raises(RuntimeError, match="sequence parallelism: the .* failed"):
            D.sequence_parallel_linear_attention(q, k, v)
        assert time.time() - t0 < timeout_s + 10
    finally:
        open(flag, "w").close()


# ------------------------------------------------------------------------------------------------
# tests


def test_two_ranks_match_single_process():
    _launch(_worker_2, 2)


def test_four_ranks_match_single_process_and_data_parallel_groups():
    _launch(_worker_4, 4)


def test_silent_rank_gives_timeout_error_not_hang():
    _launch(_worker_timeout, 2, timeout_s=2.0)
