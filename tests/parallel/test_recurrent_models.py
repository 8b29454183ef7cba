"""LMs of the gated and delta-rule kinds, with short convolutions and conv_mixer blocks, run
sequence-parallel (spawned gloo processes, float64): every rank's logits equal the single-process
model's on its shard, and every parameter gradient, summed over the ranks, equals the single-process
one; shards of unequal lengths, on 4 ranks some shorter than the convolution's K − 1 (the halo then
spans several ranks)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from linattn.models import LinearTransformerLM

from ..conftest import spread, tiny_config
from .harness import launch, setup

TOL = dict(rtol=1e-9, atol=1e-9)


def _check_model(rank, world, name, lengths, **cfg):
    model = spread(LinearTransformerLM(tiny_config(**cfg))).double()
    n = sum(lengths)
    gen = torch.Generator().manual_seed(len(name))
    ids = torch.randint(0, 40, (2, n), generator=gen)
    w = torch.randn(2, n, 40, generator=gen, dtype=torch.float64)
    full, _ = model(ids)
    (full * w).sum().backward()
    ref = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()

    s = sum(lengths[:rank])
    t = s + lengths[rank]
    model.set_sequence_parallel_group(dist.group.WORLD)
    out, _ = model(ids[:, s:t], positions=torch.arange(s, t))
    (out * w[:, s:t]).sum().backward()
    model.set_sequence_parallel_group(None)
    torch.testing.assert_close(out, full[:, s:t].detach(), **TOL, msg=lambda m: f"[{name}, rank {rank}] logits: {m}")
    for k, p in model.named_parameters():
        total = p.grad.clone()
        dist.all_reduce(total)
        torch.testing.assert_close(total, ref[k], **TOL, msg=lambda m, k=k: f"[{name}, rank {rank}] d{k}: {m}")


def _worker(rank, world, init, tmp, timeout_s, lengths):
    setup(rank, world, init, timeout_s)
    _check_model(rank, world, "retnet (RoPE)", lengths, attention="retnet")
    _check_model(rank, world, "simple_gla, short conv 3", lengths, attention="simple_gla", short_conv=3)
    _check_model(rank, world, "gla, short conv 2, no output gate", lengths, attention="gla", short_conv=2,
                 output_gate=False)
    _check_model(rank, world, "deltanet (short conv 4)", lengths, attention="deltanet")
    _check_model(rank, world, "gated_deltanet + softmax, chunks of 2", lengths, attention="gated_deltanet,softmax",
                 chunk_size=2)
    _check_model(rank, world, "gla + linear in conv_mixer blocks", lengths, attention="gla,linear",
                 block="conv_mixer")
    dist.destroy_process_group()


def test_two_ranks_match_single_process():
    launch(_worker, 2, [4, 9], preload=(__name__,))


def test_four_ranks_match_single_process():
    launch(_worker, 4, [1, 2, 6, 4], preload=(__name__,))
