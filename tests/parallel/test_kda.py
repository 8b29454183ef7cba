"""Sequence-parallel KDA (linattn.parallel.sequence_parallel_kda) on spawned gloo processes against
linattn.ops.kda.kda on the whole sequence: outputs and the gradients of q, k, v, beta, g and the initial
state, shards of unequal lengths (one token included), a strong gate inside a shard, on 2 ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist

from linattn.ops.kda import kda
from linattn.parallel import sequence_parallel_kda

from .harness import launch, setup
from .test_recurrent import _compare, _single, _split, _weights

B, H, DH, E = 2, 2, 6, 5


def _check(rank, world, name, *, bounds, state=False, dtype=torch.float32, chunk=4, seed=0, beta_max=1.0):
    n = bounds[-1][1]
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, H, n, DH, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(B, H, n, E, generator=gen, dtype=torch.float64)
    beta = torch.rand(B, H, n, generator=gen, dtype=torch.float64) * (beta_max - 0.02) + 0.01
    g = torch.nn.functional.logsigmoid(torch.randn(B, H, n, DH, generator=gen, dtype=torch.float64) + 2)
    g[:, :, n // 2, :3] = -1e4
    S0 = torch.randn(B, H, DH, E, generator=gen, dtype=torch.float64)
    sdt = torch.float64 if dtype == torch.float64 else torch.float32
    q, k, v = (x.to(dtype) for x in (q, k, v))
    beta, g, S0 = beta.to(sdt), g.to(sdt), S0.to(sdt)
    w = _weights(n, E, seed)
    opts = dict(scale=0.5, qk_l2norm=True, chunk_size=chunk)

    def op(q, k, v, beta, g, S0):
        return kda(q, k, v, beta, g, initial_state=S0 if state else None, **opts)

    o_ref, ref_grads = _single(op, dict(q=q, k=k, v=v, beta=beta, g=g, S0=S0), w)
    s, t = bounds[rank]
    loc = {nm: x[:, :, s:t].clone().requires_grad_() for nm, x in zip(("q", "k", "v", "beta", "g"), (q, k, v, beta, g))}
    S_loc = S0.clone().requires_grad_() if state and rank == 0 else None
    o = sequence_parallel_kda(loc["q"], loc["k"], loc["v"], loc["beta"], loc["g"], initial_state=S_loc, **opts)
    (o.double() * w[:, :, s:t]).sum().backward()
    grads = {nm: (x.grad, True) for nm, x in loc.items()}
    if S_loc is not None:
        grads["S0"] = (S_loc.grad, False)
    _compare(name, rank, bounds, o, o_ref, grads, ref_grads, dtype)


def _worker_2(rank, world, init, tmp, timeout_s):
    setup(rank, world, init, timeout_s)
    _check(rank, world, "KDA", bounds=_split([10, 9]))
    _check(rank, world, "KDA, initial state, a one-token first shard, fp64", bounds=_split([1, 14]), state=True,
           dtype=torch.float64, chunk=64)
    _check(rank, world, "KDA, β up to 2, fp64", bounds=_split([6, 13]), dtype=torch.float64, beta_max=2.0)
    dist.destroy_process_group()


def test_two_ranks_match_single_process():
    launch(_worker_2, 2, preload=(__name__,))
