"""Sequence-parallel gated linear attention and delta rule (linattn.parallel.recurrent) and the halo
exchange: spawned gloo processes on CPU against the single-process operators on the whole sequence —
outputs and the gradients of q, k, v, g / beta, the initial state and φ's parameters — with shards
of unequal lengths (one token included), on 2 and 4 ranks. Every rank computes the single-process
result itself and compares its shard."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from linattn import parallel as D
from linattn.nn.feature_maps import make_feature_map
from linattn.ops import delta_rule, gated_linear_attention

from .harness import launch, setup

B, H, DH, E = 2, 2, 6, 5  # D ≠ E
TOL = {torch.float64: dict(atol=1e-10, rtol=1e-10), torch.float32: dict(atol=2e-5, rtol=1e-4),
       torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


def _msg(name, rank, what):
    return lambda m: f"[{name}, rank {rank}] {what}: {m}"


def _weights(n, e, seed):
    return torch.randn(B, H, n, e, generator=torch.Generator().manual_seed(seed + 99), dtype=torch.float64)


def _compare(name, rank, bounds, got, want, grads, ref_grads, dtype, params=(), ref_pgrads=(), exact=None):
    """got/want: outputs of this rank's shard / the whole sequence; grads: {name: (local grad,
    sliced?)}, ref_grads: the whole sequence's; φ's parameter grads summed over the ranks. bf16:
    `exact` = (output, grads) of the single-process op in float64 on the same (rounded) inputs, and
    the shard's error from it must be within twice the single-process bf16 op's error (+ one bf16
    ulp of the values): the shard adds one rounding of its partial outputs."""
    s, t = bounds[rank]
    assert got.dtype == dtype, f"[{name}] output dtype {got.dtype}"
    pairs = [("output", got, want[:, :, s:t].detach(), None if exact is None else exact[0][:, :, s:t])]
    for what, (g_local, sliced) in grads.items():
        cut = (lambda x: x[:, :, s:t]) if sliced else (lambda x: x)
        pairs.append((f"d{what}", g_local, cut(ref_grads[what]), None if exact is None else cut(exact[1][what])))
    for what, a, b, truth in pairs:
        if truth is None:
            torch.testing.assert_close(a, b, **TOL[dtype], msg=_msg(name, rank, what))
            continue
        err, ref_err = (a.double() - truth).abs().max().item(), (b.double() - truth).abs().max().item()
        bound = 2 * ref_err + 2**-8 * truth.abs().max().item()
        assert err <= bound, f"[{name}, rank {rank}] {what}: error {err:.3g} vs single-process bf16 {ref_err:.3g}"
    for p, gref in zip(params, ref_pgrads):
        total = p.grad.clone()
        dist.all_reduce(total)
        torch.testing.assert_close(total, gref, **TOL[dtype], msg=_msg(name, rank, "φ parameter grad (summed)"))
        p.grad = None


def _single(op, inputs: dict, w, dtype=None):
    """op(**leaves) on the whole sequence (every input cast to dtype if given) and the gradients of Σ o·w."""
    leaves = {nm: (x if dtype is None else x.to(dtype)).detach().clone().requires_grad_() for nm, x in inputs.items()}
    o = op(**leaves)
    (o.double() * w).sum().backward()
    return o, {nm: x.grad for nm, x in leaves.items()}


def _check_gated(rank, world, name, *, bounds, vector=False, normalize=False, fmap=None, mask=False, state=False,
                 dtype=torch.float32, chunk=4, seed=0):
    n = bounds[-1][1]
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, H, n, DH, generator=gen, dtype=torch.float64) for _ in range(2))
    if normalize and fmap is None:
        q, k = q.abs(), k.abs()
    v = torch.randn(B, H, n, E, generator=gen, dtype=torch.float64)
    g = torch.nn.functional.logsigmoid(torch.randn(B, H, n, *((DH,) if vector else ()), generator=gen,
                                                   dtype=torch.float64) + 2)
    kv0 = torch.randn(B, H, DH, E, generator=gen, dtype=torch.float64)
    z0 = torch.rand(B, H, DH, generator=gen, dtype=torch.float64) + 1
    kpm = torch.rand(B, n, generator=gen) > 0.3 if mask else None
    q, k, v = (x.to(dtype) for x in (q, k, v))
    sdt = torch.float64 if dtype == torch.float64 else torch.float32
    g, kv0, z0 = g.to(sdt), kv0.to(sdt), z0.to(sdt)
    w = _weights(n, E, seed)
    opts = dict(feature_map=fmap, normalize=normalize, chunk_size=chunk)
    params = [] if fmap is None else [p for p in fmap.parameters() if p.requires_grad]

    def op(q, k, v, g, kv0, z0):
        init = ((kv0, z0) if normalize else kv0) if state else None
        return gated_linear_attention(q, k, v, g, initial_state=init, key_padding_mask=kpm, **opts)

    inputs = dict(q=q, k=k, v=v, g=g, kv0=kv0, z0=z0)
    o_ref, ref_grads = _single(op, inputs, w)
    ref_pgrads = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    exact = _single(op, inputs, w, torch.float64) if dtype == torch.bfloat16 else None
    for p in params:
        p.grad = None

    s, t = bounds[rank]
    loc = {nm: x[:, :, s:t].clone().requires_grad_() for nm, x in (("q", q), ("k", k), ("v", v), ("g", g))}
    st = {nm: x.clone().requires_grad_() for nm, x in (("kv0", kv0), ("z0", z0))}
    init = ((st["kv0"], st["z0"]) if normalize else st["kv0"]) if state and rank == 0 else None
    o = D.sequence_parallel_gated_linear_attention(loc["q"], loc["k"], loc["v"], loc["g"], initial_state=init,
                                                   key_padding_mask=None if kpm is None else kpm[:, s:t], **opts)
    (o.double() * w[:, :, s:t]).sum().backward()
    grads = {nm: (x.grad, True) for nm, x in loc.items()}
    if state and rank == 0:
        grads["kv0"] = (st["kv0"].grad, False)
        if normalize:
            grads["z0"] = (st["z0"].grad, False)
    _compare(name, rank, bounds, o, o_ref, grads, ref_grads, dtype, params, ref_pgrads, exact)


def _check_delta(rank, world, name, *, bounds, gated=False, l2norm=True, scale=None, state=False,
                 dtype=torch.float32, chunk=4, seed=0, beta_max=1.0):
    n = bounds[-1][1]
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, H, n, DH, generator=gen, dtype=torch.float64) for _ in range(2))
    if not l2norm:
        k = torch.nn.functional.normalize(k, dim=-1)
    v = torch.randn(B, H, n, E, generator=gen, dtype=torch.float64)
    beta = torch.rand(B, H, n, generator=gen, dtype=torch.float64) * (beta_max - 0.02) + 0.01
    if beta_max == 2.0:  # negative eigenvalues (issue 33): some β exactly 2
        beta[..., ::3] = 2.0
    g = torch.nn.functional.logsigmoid(torch.randn(B, H, n, generator=gen, dtype=torch.float64) + 2)
    S0 = torch.randn(B, H, DH, E, generator=gen, dtype=torch.float64)
    sdt = torch.float64 if dtype == torch.float64 else torch.float32
    q, k, v = (x.to(dtype) for x in (q, k, v))
    beta, g, S0 = beta.to(sdt), g.to(sdt), S0.to(sdt)
    w = _weights(n, E, seed)
    opts = dict(scale=scale, qk_l2norm=l2norm, chunk_size=chunk)

    names = ("q", "k", "v", "beta") + (("g",) if gated else ())

    def op(q, k, v, beta, S0, g=None):
        return delta_rule(q, k, v, beta, g=g, initial_state=S0 if state else None, **opts)

    inputs = dict(q=q, k=k, v=v, beta=beta, S0=S0, **(dict(g=g) if gated else {}))
    o_ref, ref_grads = _single(op, inputs, w)
    exact = _single(op, inputs, w, torch.float64) if dtype == torch.bfloat16 else None

    s, t = bounds[rank]
    loc = {nm: x[:, :, s:t].clone().requires_grad_() for nm, x in zip(names, (q, k, v, beta, g))}
    S_loc = S0.clone().requires_grad_() if state and rank == 0 else None
    o = D.sequence_parallel_delta_rule(loc["q"], loc["k"], loc["v"], loc["beta"], g=loc.get("g"),
                                       initial_state=S_loc, **opts)
    (o.double() * w[:, :, s:t]).sum().backward()
    grads = {nm: (x.grad, True) for nm, x in loc.items()}
    if S_loc is not None:
        grads["S0"] = (S_loc.grad, False)
    _compare(name, rank, bounds, o, o_ref, grads, ref_grads, dtype, exact=exact)


def _bytes(rank, world, n, call):
    """comm_stats of one forward+backward of `call` on this rank's shard of n tokens."""
    gen = torch.Generator().manual_seed(3)
    q, k = (torch.randn(B, H, n, DH, generator=gen) for _ in range(2))
    v = torch.randn(B, H, n, E, generator=gen)
    s, t = D.shard_bounds(n, rank, world)
    q, k, v = (x[:, :, s:t].clone().requires_grad_() for x in (q, k, v))
    D.comm_stats.reset()
    call(q, k, v).sum().backward()
    return dict(D.comm_stats.bytes)


def _check_bytes(rank, world):
    def gated(vector, normalize):
        return lambda q, k, v: D.sequence_parallel_gated_linear_attention(
            q.abs(), k.abs(), v, torch.full((*q.shape[:3], *((DH,) if vector else ())), -0.1), normalize=normalize)

    def delta(q, k, v):
        return D.sequence_parallel_delta_rule(q, k, v, torch.full(q.shape[:3], 0.5), g=torch.full(q.shape[:3], -0.1),
                                              qk_l2norm=True)

    cases = [("scalar", False, gated(False, False)), ("vector", True, gated(True, True)), ("matrix", False, delta)]
    for transition, normalize, call in cases:
        small, large = _bytes(rank, world, world + 1, call), _bytes(rank, world, 20 * world + 3, call)
        assert small == large, f"[{transition}] bytes depend on N: {small} vs {large}"
        fwd, bwd = D.transition_exchange_bytes(B, H, DH, E, world, transition=transition, normalize=normalize)
        assert (small["state_forward"], small["state_backward"]) == (fwd, bwd), (transition, small, fwd, bwd)
        assert small["meta"] == world * 11 * 8
    assert D.transition_exchange_bytes(1, 8, 64, 64, 2, transition="matrix") == (2 * 8 * (64 * 64 * 2) * 4,
                                                                                  2 * 8 * 64 * 64 * 4)


def _check_errors(rank, world):
    q = torch.randn(B, H, 3, DH)
    v = torch.randn(B, H, 3, E)
    g = torch.full((B, H, 3), -0.5)
    beta = torch.full((B, H, 3), 0.5)
    # the state before the sequence belongs to rank 0: another rank holding one is refused on that rank
    S = torch.zeros(B, H, DH, E)
    expected = "only rank 0 holds" if rank == 1 else "rejected their arguments"
    with pytest.raises(ValueError, match=expected):
        D.sequence_parallel_delta_rule(q, q, v, beta, initial_state=S if rank == 1 else None)
    # a scalar gate on one rank and a vector gate on another would exchange different sizes
    gv = torch.full((B, H, 3, DH), -0.5)
    with pytest.raises(ValueError, match="g's form .* must be equal on all ranks"):
        D.sequence_parallel_gated_linear_attention(q, q, v, gv if rank == 0 else g)
    bad = beta.clone()
    bad[0, 0, 0] = 2.5 if rank == 0 else 0.5
    with pytest.raises(ValueError, match="beta must lie in" if rank == 0 else "rejected their arguments"):
        D.sequence_parallel_delta_rule(q, q, v, bad)
    with pytest.raises(ValueError, match="position-dependent"):
        D.sequence_parallel_gated_linear_attention(q, q, v, g, feature_map=make_feature_map("cosformer", DH))


def _check_grad_on_some_ranks(rank, world):
    """Only rank 0's inputs need a gradient: every rank still takes part in the backward exchange,
    and rank 0's gradients are the single-process ones."""
    n = 2 * world + 1
    gen = torch.Generator().manual_seed(5)
    q, k = (torch.randn(B, H, n, DH, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(B, H, n, E, generator=gen, dtype=torch.float64)
    g = torch.full((B, H, n), -0.2, dtype=torch.float64)
    kf = k.clone().requires_grad_()
    gated_linear_attention(q, kf, v, g).sum().backward()
    s, t = D.shard_bounds(n, rank, world)
    kl = k[:, :, s:t].clone().requires_grad_(rank == 0)
    o = D.sequence_parallel_gated_linear_attention(q[:, :, s:t], kl, v[:, :, s:t], g[:, :, s:t])
    assert o.requires_grad
    o.sum().backward()
    if rank == 0:
        torch.testing.assert_close(kl.grad, kf.grad[:, :, s:t], rtol=1e-10, atol=1e-10)


def _check_halo(rank, world, lengths, width):
    """sequence_halo equals the `width` tokens before the shard (zeros before the start), its
    gradient reaches the ranks that hold them."""
    n = sum(lengths)
    x = torch.randn(2, n, 3, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    s = sum(lengths[:rank])
    loc = x[:, s:s + lengths[rank]].clone().requires_grad_()
    halo = D.sequence_halo(loc, width)
    padded = torch.cat((torch.zeros(2, width, 3, dtype=x.dtype), x), 1)
    torch.testing.assert_close(halo, padded[:, s:s + width], rtol=0, atol=0)
    w = torch.randn(world, 2, width, 3, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    (halo * w[rank]).sum().backward()
    # ∂/∂x_j = Σ over the ranks r whose halo holds token j of w[r] at its slot
    want = torch.zeros_like(x)
    for r in range(world):
        o_r = sum(lengths[:r])
        for slot in range(width):
            j = o_r - width + slot
            if j >= 0:
                want[:, j] += w[r, :, slot]
    torch.testing.assert_close(loc.grad, want[:, s:s + lengths[rank]], rtol=0, atol=1e-15)


def _split(lengths):
    out, s = [], 0
    for m in lengths:
        out.append((s, s + m))
        s += m
    return out


def _worker_2(rank, world, init, tmp, timeout_s):
    setup(rank, world, init, timeout_s)
    even, odd = _split([19, 18]), _split([3, 34])
    elu = make_feature_map("elu", DH)
    _check_gated(rank, world, "scalar gate", bounds=even)
    _check_gated(rank, world, "vector gate, a short first shard", bounds=odd, vector=True)
    _check_gated(rank, world, "scalar gate, elu, normalize, initial state", bounds=even, fmap=elu, normalize=True,
                 state=True)
    _check_gated(rank, world, "vector gate, elu, normalize, initial state, mask", bounds=odd, vector=True, fmap=elu,
                 normalize=True, state=True, mask=True)
    _check_gated(rank, world, "vector gate, initial state, fp64", bounds=even, vector=True, state=True,
                 dtype=torch.float64, chunk=64)
    _check_gated(rank, world, "hedgehog (learned φ), normalize", bounds=even,
                 fmap=make_feature_map("hedgehog", DH, num_features=4), normalize=True)
    _check_gated(rank, world, "scalar gate, elu, bf16", bounds=even, fmap=elu, dtype=torch.bfloat16)
    _check_delta(rank, world, "DeltaNet", bounds=even)
    _check_delta(rank, world, "Gated DeltaNet, initial state, a short first shard", bounds=odd, gated=True, state=True)
    _check_delta(rank, world, "Gated DeltaNet, no l2norm, scale, fp64", bounds=even, gated=True, l2norm=False,
                 scale=0.5, state=True, dtype=torch.float64, chunk=64)
    _check_delta(rank, world, "DeltaNet bf16", bounds=even, dtype=torch.bfloat16)
    _check_delta(rank, world, "Gated DeltaNet, β up to 2, initial state, fp64", bounds=odd, gated=True, state=True,
                 dtype=torch.float64, beta_max=2.0)
    _check_bytes(rank, world)
    _check_errors(rank, world)
    _check_grad_on_some_ranks(rank, world)
    _check_halo(rank, world, [5, 4], 3)
    dist.destroy_process_group()


def _worker_4(rank, world, init, tmp, timeout_s):
    setup(rank, world, init, timeout_s)
    even, odd = _split([6, 6, 6, 5]), _split([1, 11, 1, 10])
    _check_gated(rank, world, "scalar gate", bounds=even)
    _check_gated(rank, world, "vector gate, normalize, initial state, one-token shards", bounds=odd, vector=True,
                 normalize=True, state=True)
    _check_gated(rank, world, "scalar gate, initial state, fp64", bounds=odd, state=True, dtype=torch.float64)
    _check_gated(rank, world, "vector gate, elu, normalize, initial state, mask, fp64, chunks of 3", bounds=odd,
                 vector=True, fmap=make_feature_map("elu", DH), normalize=True, state=True, mask=True,
                 dtype=torch.float64, chunk=3)
    _check_delta(rank, world, "DeltaNet, initial state", bounds=even, state=True)
    _check_delta(rank, world, "Gated DeltaNet, one-token shards, fp64", bounds=odd, gated=True, state=True,
                 dtype=torch.float64)
    _check_bytes(rank, world)
    _check_grad_on_some_ranks(rank, world)
    _check_halo(rank, world, [1, 4, 1, 2], 3)  # the halo of rank 2 spans ranks 0 and 1
    dist.destroy_process_group()


def test_two_ranks_match_single_process():
    launch(_worker_2, 2, preload=(__name__,))


def test_four_ranks_match_single_process():
    launch(_worker_4, 4, preload=(__name__,))
