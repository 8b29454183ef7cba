"""Sequence parallelism for linear attention (DESIGN §9), on ``torch.distributed``.

A sequence of N tokens is split into P contiguous shards, one per rank of a process group, in rank
order (rank r holds tokens [o_r, o_r + n_r), o_r = Σ_{s<r} n_s; shards may differ in length). Every
rank calls the same function on its *local* shard q, k, v: (B, H, n_r, D) and gets its local output
(B, H, n_r, E). The only thing that crosses a shard boundary is the state (DESIGN §3):

    ΔS_r = Σ_{j ∈ shard r} R_j φ(k_j) v_jᵀ   (F×E)        Δz_r = Σ_{j ∈ shard r} φ(k_j)   (F)

(R_j the RoPE rotation, identity without RoPE). Rank r runs the chunked causal op on its shard
from the initial state

    S_init,r = Σ_{s<r} ΔS_s,      z_init,r = Σ_{s<r} Δz_s,

which is exactly the state the single-process op would carry into token o_r, so the outputs equal
the single-process ones (up to fp32 summation order). Positions (cosFormer, RoPE) are *global*:
o_r + arange(n_r).

Scheme: all-gather (LASP-2), not a ring (LASP). Every rank computes its ΔS_r, Δz_r at once (one
O(n_r·F·E) pass over its keys), one all-gather of the P states, then each rank sums the states of
the ranks before it locally and runs its shard. All ranks work in parallel; a ring would serialize
P shard computations (or P latency-bound hops). The backward mirrors the forward: each rank first
computes Γ_r = ∂L/∂S_init,r = Σ_i R_i φ(q_i) ∂U_iᵀ (and its z part) in one cheap pass over its
queries, one all-gather of the Γ's, and rank s obtains ∂ΔS_s = Σ_{r>s} Γ_r. That gradient enters the
chunked op's backward as the gradient of its *final* state (final = init + ΔS(k, v)), so ∂k, ∂v
(and φ's parameter gradients) come out of the single chunked backward pass: per-rank memory is that
of the single-process op on n_r tokens. Non-causal attention uses the total Σ_s ΔS_s for every
query: one all-reduce forward, one all-reduce backward.

Communication per attention layer and per direction (forward; the backward is the same), with
the states on the wire in float32 (float64 for float64 inputs) whatever the input dtype:

    all-gather (causal):      P·B·H·(F·E + F)·4 bytes land on each rank
    all-reduce (non-causal):  B·H·(F·E + F)·4 bytes (the reduced buffer)
    metadata:                 one all-gather of 7 int64 per rank (shard lengths and a shape check)

independent of N (`state_exchange_bytes`; `comm_stats` counts what was actually exchanged).
Example: B=1, H=8, F=E=64, P=2: 2·8·(4096+64)·4 = 266 kB per layer, whether N is 2^10 or 2^20.

Softmax layers of a hybrid model cannot be split this way (their "state" is all of K and V):
`sequence_parallel_softmax_attention` all-gathers K and V (O(N) bytes) and masks causally with
the shard's global offset.

Every rank of the group must make the same calls in the same order (forward and backward), with
the same B, H, D, E, dtype, options and requires_grad pattern. The metadata exchange turns
mismatched shapes and a rank whose local arguments were rejected into a ValueError on every rank;
anything else that leaves a rank out (a crash, a dead process) surfaces as an error after the
process group's timeout (`init_distributed(timeout_s=...)`) instead of a hang.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ._checks import (
    FLOAT_DTYPES,
    check_bool,
    check_int,
    check_number,
    check_positions,
    check_positive_int,
    check_qkv,
    check_tensor,
)
from .ops._features import Featurizer
from .ops.chunked import block_tokens, compute_dtype, state_dtype
from .ops.linear import _linear_attention, _prepare, advance_schedule
from .ops.softmax import softmax_attention

__all__ = [
    "CommStats",
    "ParallelGroups",
    "comm_stats",
    "gather_sequence",
    "init_distributed",
    "make_parallel_groups",
    "sequence_parallel_linear_attention",
    "sequence_parallel_softmax_attention",
    "shard_bounds",
    "shard_sequence",
    "state_exchange_bytes",
]

#: Default collective timeout (seconds) for `init_distributed`.
DEFAULT_TIMEOUT_S = 300.0

_META_LEN = 7  # [ok, n_local, B, H, F (or D), E, dtype code]


# --------------------------------------------------------------------------------------------
# process groups


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
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=float(timeout_s)))
    return rank, world_size


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


def make_parallel_groups(sequence_parallel: int) -> ParallelGroups:
    """Splits the default group into sequence-parallel blocks of `sequence_parallel` ranks and the
    matching data-parallel groups (see ParallelGroups). Every rank must call it (collective)."""
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("make_parallel_groups needs an initialized default process group (init_distributed())")
    check_positive_int("sequence_parallel", sequence_parallel)
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % sequence_parallel:
        raise ValueError(f"sequence_parallel={sequence_parallel} must divide the world size {world}")
    p, r = sequence_parallel, world // sequence_parallel
    sp_group = dp_group = None
    for i in range(r):  # every rank creates every group, in the same order
        g = dist.new_group(list(range(i * p, (i + 1) * p)))
        if rank // p == i:
            sp_group = g
    for j in range(p):
        g = dist.new_group(list(range(j, world, p)))
        if rank % p == j:
            dp_group = g
    return ParallelGroups(sp_group, dp_group, rank % p, p, rank // p, r)


def _resolve_group(group):
    """-> (group, rank in group, group size); ValueError when there is no usable group."""
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            "group: torch.distributed is not initialized; call linattn.distributed.init_distributed() "
            "(or torch.distributed.init_process_group) first, or use the single-process op"
        )
    if group is None:
        group = dist.group.WORLD
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("group: this process is not a member of the given process group")
    return group, rank, dist.get_world_size(group)


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
    """Bytes that landed on this rank from the collectives of this module, by kind.

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
# collectives (thin wrappers: one place for version differences and accounting)

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


def _all_gather(x: torch.Tensor, group, world: int, what: str) -> torch.Tensor:
    """x (any shape) -> (P, *x.shape), row s from rank s."""
    x = x.contiguous()
    out = torch.empty((world, *x.shape), dtype=x.dtype, device=x.device)
    _run(what, _all_gather_flat, out.view(world * x.shape[0], *x.shape[1:]) if x.dim() else out, x, group=group)
    return out


def _all_reduce(x: torch.Tensor, group, what: str) -> torch.Tensor:
    x = x.contiguous().clone()
    _run(what, dist.all_reduce, x, group=group)
    return x


def _sum_scatter(stacked: torch.Tensor, group, rank: int, what: str) -> torch.Tensor:
    """stacked (P, *s) on every rank -> Σ over ranks of row `rank` (a reduce-scatter)."""
    if dist.get_backend(group) == "nccl":
        out = torch.empty(stacked.shape[1:], dtype=stacked.dtype, device=stacked.device)
        _run(what, _reduce_scatter_flat, out, stacked.contiguous(), group=group)
        return out
    return _all_reduce(stacked, group, what)[rank]  # portable: gloo builds may lack reduce_scatter


def _meta_device(group) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _agree(group, world: int, error: Exception | None, row: list[int], names: tuple[str, ...], *,
           min_tokens: int = 1) -> list[list[int]]:
    """One all-gather of [ok, *row] (7 int64) so that every rank sees every rank's shard length and
    shape; a rank whose local checks failed (error) makes all ranks raise, instead of leaving the
    others waiting in the next collective. Returns the rows [n_local, *shape] of all ranks."""
    row = [0 if error is None else 1, *row]
    row += [-1] * (_META_LEN - len(row))
    t = torch.tensor(row, dtype=torch.int64, device=_meta_device(group))
    rows = _all_gather(t, group, world, "metadata all-gather (shard lengths, shapes)").tolist()
    comm_stats.add("meta", world * _META_LEN * 8)
    if error is not None:
        raise error
    bad = [s for s, r in enumerate(rows) if r[0]]
    if bad:
        raise ValueError(f"rank(s) {bad} of the sequence-parallel group rejected their arguments (see the error "
                         "on those ranks); every rank must call with valid shards")
    rows = [r[1:] for r in rows]
    for i, name in enumerate(names, start=1):
        vals = [r[i] for r in rows]
        if len(set(vals)) > 1:
            raise ValueError(f"{name} must be equal on all ranks of the group, got {vals} (by rank)")
    lengths = [r[0] for r in rows]
    if min(lengths) < min_tokens:
        raise ValueError(f"q: every rank needs at least one token of the sequence, got shard lengths {lengths}")
    return rows


def _dtype_code(dtype: torch.dtype) -> int:
    return FLOAT_DTYPES.index(dtype) if dtype in FLOAT_DTYPES else -1


# --------------------------------------------------------------------------------------------
# autograd pieces


class _LocalStateSum(torch.autograd.Function):
    """apply(featurize, feat, k, v, *params) -> (ΔS (B, H, F, E), Δz (B, H, F)) in the state dtype,
    with autograd (the non-causal path; the causal one uses `_local_state` + `_InjectStateGradient`).

        ΔS = Σ_j R_j φ(k_j) v_jᵀ,   Δz = Σ_j φ(k_j)        over the local tokens j

    Walked in blocks of tokens, features recomputed block by block in the backward, so nothing of
    size n·F is kept. Backward, for incoming ∂ΔS (F×E) and ∂Δz (F):
        ∂V = K̃ ∂ΔS,   ∂K̃ = V ∂ΔSᵀ,   ∂K̃_den = 1 ∂Δzᵀ     (K̃ = rows R_j φ(k_j), K̃_den = rows φ(k_j)),
    chained to k (and φ's parameters) by autograd on the recomputed block features.
    """

    @staticmethod
    def forward(ctx, featurize: Featurizer, feat: int, k, v, *params):
        b, h, n, _ = k.shape
        e = v.shape[-1]
        sdt = state_dtype(k.dtype)
        S = torch.zeros(b, h, feat, e, dtype=sdt, device=k.device)
        z = torch.zeros(b, h, feat, dtype=sdt, device=k.device)
        L = block_tokens(b * h, max(feat, e), 64)
        with torch.no_grad():
            for s in range(0, n, L):
                t = min(s + L, n)
                kr, kd = featurize(k[:, :, s:t], s, t, False)
                S += kr.to(sdt).transpose(-1, -2) @ v[:, :, s:t].to(sdt)
                z += (kr if kd is None else kd).to(sdt).sum(-2)
        ctx.featurize, ctx.L, ctx.n_params = featurize, L, len(params)
        ctx.save_for_backward(k, v, *params)
        return S, z

    @staticmethod
    def backward(ctx, dS, dz):
        k, v, *params = ctx.saved_tensors
        featurize, L = ctx.featurize, ctx.L
        b, h, n, _ = k.shape
        sdt = state_dtype(k.dtype)
        need_k = ctx.needs_input_grad[2]
        dk = torch.zeros_like(k) if need_k else None
        dv = torch.empty_like(v)
        dparams = [torch.zeros_like(p) for p in params]
        if dS is None and dz is None:
            return (None, None, dk, torch.zeros_like(v), *dparams)
        for s in range(0, n, L):
            t = min(s + L, n)
            with torch.enable_grad():
                kb = k[:, :, s:t].detach().requires_grad_(need_k)
                kr, kd = featurize(kb, s, t, False)
            dkr = None
            if dS is not None:
                dv[:, :, s:t] = (kr.detach().to(sdt) @ dS.to(sdt)).to(v.dtype)
                dkr = v[:, :, s:t].to(sdt) @ dS.to(sdt).transpose(-1, -2)
            else:
                dv[:, :, s:t] = 0
            dkd = None if dz is None else dz.to(sdt)[:, :, None, :].expand(b, h, t - s, dz.shape[-1])
            want = ([kb] if need_k else []) + list(params)
            if not want:
                continue
            if kd is None:
                g = dkr if dkd is None else (dkd if dkr is None else dkr + dkd)
                outs, grads = [kr], [g.to(kr.dtype)]
            else:
                outs, grads = [], []
                for o_, g_ in ((kr, dkr), (kd, dkd)):
                    if g_ is not None:
                        outs.append(o_)
                        grads.append(g_.to(o_.dtype))
            pairs = [(o_, g_) for o_, g_ in zip(outs, grads) if o_.requires_grad]
            if not pairs:
                continue
            res = torch.autograd.grad([p[0] for p in pairs], want, [p[1] for p in pairs], allow_unused=True)
            it = iter(res)
            if need_k:
                gk = next(it)
                if gk is not None:
                    dk[:, :, s:t] = gk
            for j in range(len(params)):
                gp = next(it)
                if gp is not None:
                    dparams[j] += gp
        return (None, None, dk, dv, *dparams)


@torch.no_grad()
def _local_state(featurize: Featurizer, feat: int, k, v, block: int):
    """ΔS = Σ_j R_j φ(k_j) v_jᵀ (B, H, F, E), Δz = Σ_j φ(k_j) (B, H, F) over the local tokens, in the
    state dtype, walked in blocks of `block` tokens (no autograd: the causal path gets its
    gradient through `_InjectStateGradient`)."""
    b, h, n, _ = k.shape
    sdt = state_dtype(k.dtype)
    S = torch.zeros(b, h, feat, v.shape[-1], dtype=sdt, device=k.device)
    z = torch.zeros(b, h, feat, dtype=sdt, device=k.device)
    for s in range(0, n, block):
        t = min(s + block, n)
        kr, kd = featurize(k[:, :, s:t], s, t, False)
        S += kr.to(sdt).transpose(-1, -2) @ v[:, :, s:t].to(sdt)
        z += (kr if kd is None else kd).to(sdt).sum(-2)
    return S, z


def _denominators(qd, kd, z, chunk: int = 64):
    """d_i = qd_iᵀ(z + Σ_{j≤i} kd_j) for a block: qd, kd (B, H, n, F), z (B, H, F) -> (d (B, H, n), z after).

    Chunked like DESIGN §3 (intra-chunk tril(Qd Kdᵀ)·1 plus Qd times the state before the chunk):
    batched matmuls instead of an (n, F) cumulative sum, about 3× faster on CPU."""
    b, h, n, f = qd.shape
    pad = (-n) % chunk
    if pad:
        qd, kd = torch.nn.functional.pad(qd, (0, 0, 0, pad)), torch.nn.functional.pad(kd, (0, 0, 0, pad))
    nc = (n + pad) // chunk
    Q, K = qd.reshape(b * h * nc, chunk, f), kd.reshape(b * h * nc, chunk, f)
    intra = torch.bmm(Q, K.transpose(1, 2)).tril_().sum(-1)  # (BH·nc, C)
    sums = K.sum(1).view(b * h, nc, f)
    before = sums.cumsum(1).sub_(sums).add_(z.reshape(b * h, 1, f))  # state before each chunk
    den = torch.baddbmm(intra.unsqueeze(-1), Q, before.reshape(-1, f, 1)).view(b, h, nc * chunk)[:, :, :n]
    return den, (before[:, -1] + sums[:, -1]).view(b, h, f)


@torch.no_grad()
def _query_state_gradient(featurize: Featurizer, feat: int, q, k, o, do, z0, normalize: bool, eps: float,
                          block: int):
    """Γ_S = Σ_i R_i φ(q_i) G_iᵀ (B, H, F, E), Γ_z = Σ_i φ(q_i) g_i (B, H, F): the gradient the shard's
    outputs send into its initial state (∂L/∂S_init, ∂L/∂z_init when nothing flows into the final
    state), with G_i = ∂L/∂U_i = do_i/(d_i + ε) and g_i = ∂L/∂d_i = −(do_i·o_i)/(d_i + ε), the
    denominators d_i = φ(q_i)ᵀ(z_init + Σ_{j≤i} φ(k_j)) recomputed block by block (normalize=False:
    G = do, g = 0)."""
    b, h, n, _ = q.shape
    sdt = state_dtype(q.dtype)
    GS = torch.zeros(b, h, feat, do.shape[-1], dtype=sdt, device=q.device)
    Gz = torch.zeros(b, h, feat, dtype=sdt, device=q.device)
    z = z0.to(sdt)
    for s in range(0, n, block):
        t = min(s + block, n)
        qr, qd = featurize(q[:, :, s:t], s, t, True)
        dob = do[:, :, s:t].to(sdt)
        if not normalize:
            GS += qr.to(sdt).transpose(-1, -2) @ dob
            continue
        kr, kd = featurize(k[:, :, s:t], s, t, False)
        qd = (qr if qd is None else qd).to(sdt)
        den, z = _denominators(qd, (kr if kd is None else kd).to(sdt), z)
        inv = den.add_(eps).reciprocal_()  # (B, H, n_b)
        GS += qr.to(sdt).transpose(-1, -2) @ (dob * inv[..., None])
        g = (dob * o[:, :, s:t].to(sdt)).sum(-1).mul_(inv).neg_()
        Gz += (qd * g[..., None]).sum(2)
    return GS, Gz


class _InjectStateGradient(torch.autograd.Function):
    """apply(featurize, feat, group, rank, world, normalize, eps, block, q, k, z0, o, kv_final, z_final) -> o.

    Identity on o in the forward. In the backward (∂o arrives first, before the chunked op's own
    backward) it computes Γ_r = ∂L/∂(S_init,r, z_init,r) with one cheap pass over the shard
    (`_query_state_gradient`), all-gathers the Γ of all ranks and returns, as the gradient of the
    chunked op's *final* state, ∂ΔS_r = Σ_{s>r} Γ_s. Since final_r = init_r + ΔS_r(k, v), the chunked
    backward then adds ∂ΔS_r's share to ∂k, ∂v (and φ's parameters) in the same pass that computes
    their direct gradient: no separate local-sum backward, no second set of N-sized gradient tensors,
    so per-rank memory is the single-process op's on n_r tokens. (The initial state itself is a
    constant of the graph: its gradient is exactly what Γ computes.)
    """

    @staticmethod
    def forward(ctx, featurize, feat, group, rank, world, normalize, eps, block, q, k, z0, o, kv_final, z_final):
        ctx.args = (featurize, feat, group, rank, world, normalize, eps, block)
        ctx.save_for_backward(q, k, z0, o)
        return o.view_as(o)

    @staticmethod
    def backward(ctx, do):
        featurize, feat, group, rank, world, normalize, eps, block = ctx.args
        q, k, z0, o = ctx.saved_tensors
        dkv = dz = None
        if ctx.needs_input_grad[12] or ctx.needs_input_grad[13]:  # same on every rank: all or none exchange
            if rank == 0:  # nobody needs Γ_0 (no rank before 0): send zeros, skip the pass
                sdt = state_dtype(q.dtype)
                b, h = q.shape[:2]
                GS = torch.zeros(b, h, feat, o.shape[-1], dtype=sdt, device=q.device)
                Gz = torch.zeros(b, h, feat, dtype=sdt, device=q.device)
            else:
                GS, Gz = _query_state_gradient(featurize, feat, q, k, o, do, z0, normalize, eps, block)
            flat = torch.cat((GS.reshape(-1), Gz.reshape(-1)))
            out = _exchange(flat, group, rank, world, True, "state_backward", reverse=True)
            dkv, dz = _split(out, (GS.shape, Gz.shape))
        return (None,) * 8 + (None, None, None, do, dkv, dz)


class _AllReduceStates(torch.autograd.Function):
    """apply(group, rank, world, ΔS, Δz) -> (Σ_s ΔS_s, Σ_s Δz_s), the non-causal global state.

    Forward all-reduce; backward all-reduce, ∂Δ_r = Σ_s ∂out_s (every rank's loss sees every key).
    ΔS and Δz travel as one flat buffer in their (float32/float64) dtype.
    """

    @staticmethod
    def forward(ctx, group, rank: int, world: int, dS, dz):
        ctx.group, ctx.rank, ctx.world = group, rank, world
        ctx.shapes, ctx.dtype, ctx.device = (dS.shape, dz.shape), dS.dtype, dS.device
        flat = torch.cat((dS.reshape(-1), dz.reshape(-1)))
        return _split(_exchange(flat, group, rank, world, False, "state_forward", reverse=False), ctx.shapes)

    @staticmethod
    def backward(ctx, gS, gz):
        shS, shz = ctx.shapes
        # always take part in the collective, even without incoming gradient (the others wait for it)
        gS = torch.zeros(shS, dtype=ctx.dtype, device=ctx.device) if gS is None else gS
        gz = torch.zeros(shz, dtype=ctx.dtype, device=ctx.device) if gz is None else gz
        flat = torch.cat((gS.to(ctx.dtype).reshape(-1), gz.to(ctx.dtype).reshape(-1)))
        out = _exchange(flat, ctx.group, ctx.rank, ctx.world, False, "state_backward", reverse=True)
        return (None, None, None, *_split(out, ctx.shapes))


def _exchange(flat, group, rank, world, causal, kind, *, reverse):
    nbytes = flat.numel() * flat.element_size()
    if not causal:
        comm_stats.add(kind, nbytes)
        return _all_reduce(flat, group, f"state all-reduce ({kind})")
    gathered = _all_gather(flat, group, world, f"state all-gather ({kind})")
    comm_stats.add(kind, world * nbytes)
    part = gathered[rank + 1:] if reverse else gathered[:rank]
    return part.sum(0) if part.shape[0] else torch.zeros_like(flat)


def _split(flat, shapes):
    shS, shz = shapes
    m = shS.numel()
    return flat[:m].view(shS).clone(), flat[m:].view(shz).clone()


class _GatherSequence(torch.autograd.Function):
    """apply(group, rank, lengths, kind, x) -> the full sequence (B, H, N, C) from the local shards
    (B, H, n_r, C), padded to max n_r for the all-gather. Backward: each rank's gradient of the full
    sequence is summed over ranks and its own slice kept (a reduce-scatter)."""

    @staticmethod
    def forward(ctx, group, rank: int, lengths: list[int], kind: str, x):
        world, m = len(lengths), max(lengths)
        ctx.group, ctx.rank, ctx.lengths, ctx.kind = group, rank, lengths, kind
        pad = torch.zeros(*x.shape[:2], m, x.shape[3], dtype=x.dtype, device=x.device)
        pad[:, :, : x.shape[2]] = x
        g = _all_gather(pad, group, world, f"all-gather of the sequence ({kind})")
        comm_stats.add(f"{kind}_forward", g.numel() * g.element_size())
        return torch.cat([g[s, :, :, : lengths[s]] for s in range(world)], dim=2)

    @staticmethod
    def backward(ctx, grad):
        lengths, m = ctx.lengths, max(ctx.lengths)
        world = len(lengths)
        stacked = grad.new_zeros(world, *grad.shape[:2], m, grad.shape[3])
        for s, part in enumerate(grad.split(lengths, dim=2)):
            stacked[s, :, :, : lengths[s]] = part
        comm_stats.add(f"{ctx.kind}_backward", stacked.numel() * stacked.element_size())
        mine = _sum_scatter(stacked, ctx.group, ctx.rank, f"gradient reduce of the sequence ({ctx.kind})")
        return None, None, None, None, mine[:, :, : lengths[ctx.rank]]


# --------------------------------------------------------------------------------------------
# public ops


def sequence_parallel_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group=None,
    causal: bool = True,
    feature_map=None,
    normalize: bool = True,
    eps: float = 1e-6,
    scale: float | None = None,
    rope=None,
    chunk_size: int = 64,
    positions: torch.Tensor | None = None,
    key_padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Linear attention over a sequence sharded across the ranks of `group` (see the module doc).

    q, k: (B, H, n_r, D), v: (B, H, n_r, E) — this rank's contiguous shard, shards in rank order,
    lengths free (N need not divide by P; every rank needs ≥ 1 token) -> o: (B, H, n_r, E), q's dtype.

    Equals shard r of `linattn.ops.linear_attention` on the full sequence with the same arguments:
    causal:  O_i = φ(q_i)ᵀ(S_init,r + Σ_{o_r≤j≤i} φ(k_j)v_jᵀ) / (φ(q_i)ᵀ(z_init,r + Σ φ(k_j)) + ε),
             S_init,r = Σ_{s<r} ΔS_s (all-gather);
    non-causal: every query sees all N keys, S = Σ_s ΔS_s (all-reduce).
    Gradients of q, k, v (and φ's parameters) are the single-process ones restricted to the shard;
    φ's parameter gradients are this rank's share (sum them over the group, as data parallelism
    does, to get the full gradient). Random-feature maps (FAVOR+, trig) must hold the same ω on
    every rank (same seed, same redraw schedule).

    Cost per rank (causal): the chunked op on n_r tokens plus two O(n_r·F·E) passes (the local
    state sum, and the state-gradient pass of the backward; rank 0 skips the latter); memory that of
    the chunked op on n_r tokens, so it falls as 1/P.

    group: a torch.distributed process group (None: the default group, which must be initialized).
    positions: (n_r,) or (B, n_r) *global* token indices of the shard (default o_r + arange(n_r),
        o_r from the all-gathered shard lengths), used by cosFormer and RoPE.
    key_padding_mask: (B, n_r) bool, True where the key is real (local shard).
    Other arguments as in linear_attention. States cross ranks in float32 (float64 for float64
    inputs): P·B·H·(F·E + F)·4 bytes per all-gather, once forward and once backward (see
    `state_exchange_bytes`), plus a 7·8·P-byte metadata all-gather.
    """
    group, rank, world = _resolve_group(group)
    advance_schedule(feature_map)  # once per call, before any feature (same on every rank)
    error, feat, e = None, -1, -1
    try:
        check_positive_int("chunk_size", chunk_size)
        check_bool("causal", causal, error=TypeError)
        check_qkv(q, k, v)
        if q.shape[2] != k.shape[2]:
            raise ValueError(f"k must have q's shard length {q.shape[2]}, got {k.shape[2]}")
        if positions is not None:
            check_positions(positions, q.shape[0], q.shape[2], q.device)
            max_len = getattr(feature_map, "max_len", None)
            if max_len is not None and positions.numel():
                lo, hi = int(positions.min()), int(positions.max())
                if lo < 0 or hi >= max_len:
                    raise ValueError(f"positions must lie in [0, feature_map.max_len={max_len}), got [{lo}, {hi}]")
        # every local check of the single-process op (feature map, rope, mask, positions)
        _prepare(q, k, v, feature_map=feature_map, scale=scale, key_padding_mask=key_padding_mask,
                 initial_state=None, positions=positions, rope=rope)
        feat = q.shape[-1] if feature_map is None else feature_map.feature_dim
        e = v.shape[-1]
    except (ValueError, TypeError) as exc:
        error = exc
    b, h = (q.shape[0], q.shape[1]) if error is None else (-1, -1)
    n = q.shape[2] if error is None else -1
    dcode = _dtype_code(q.dtype) if error is None else -1
    rows = _agree(group, world, error, [n, b, h, feat, e, dcode],
                  ("q/k batch size B", "q/k heads H", "feature dim F", "v head dim E", "q/k/v dtype"))
    lengths = [r[0] for r in rows]
    offset, total = sum(lengths[:rank]), sum(lengths)
    needs_pos = rope is not None or getattr(feature_map, "needs_positions", False)
    if needs_pos and positions is None:
        max_len = getattr(feature_map, "max_len", None)
        if max_len is not None and total > max_len:
            raise ValueError(f"feature_map: the global sequence ({total} tokens over {world} ranks) exceeds the "
                             f"feature map's max_len={max_len}")
        positions = torch.arange(offset, offset + n, device=q.device)
    fz, _ = _prepare(q, k, v, feature_map=feature_map, scale=scale, key_padding_mask=key_padding_mask,
                     initial_state=None, positions=positions, rope=rope)
    block = block_tokens(q.shape[0] * q.shape[1], max(feat, e), 64)
    if causal:
        dS, dz = _local_state(fz, feat, k, v, block)
        flat = _exchange(torch.cat((dS.reshape(-1), dz.reshape(-1))), group, rank, world, True, "state_forward",
                         reverse=False)
        S0, z0 = _split(flat, (dS.shape, dz.shape))
        o, (kv_final, z_final) = _linear_attention(
            q, k, v, causal=True, feature_map=feature_map, normalize=normalize, eps=eps, scale=scale,
            key_padding_mask=key_padding_mask, initial_state=(S0, z0), return_state=True, chunk_size=chunk_size,
            positions=positions, rope=rope)
        if not o.requires_grad:
            return o
        return _InjectStateGradient.apply(fz, feat, group, rank, world, normalize, float(eps), block, q, k, z0, o,
                                          kv_final, z_final)
    dS, dz = _LocalStateSum.apply(fz, feat, k, v, *fz.parameters)
    S0, z0 = _AllReduceStates.apply(group, rank, world, dS, dz)
    # non-causal: O = φ(Q) S / (φ(Q) z + ε) with the global S, z (the local keys are already in it)
    cdt, sdt = compute_dtype(q.dtype), state_dtype(q.dtype)
    qr, qd = fz(q, 0, n, True)
    u = qr.to(cdt) @ S0.to(cdt)
    if not normalize:
        return u.to(q.dtype)
    den = ((qr if qd is None else qd).to(sdt) * z0[:, :, None, :]).sum(-1, keepdim=True)
    return (u / (den + eps)).to(q.dtype)


def sequence_parallel_softmax_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group=None,
    causal: bool = True,
    scale: float | None = None,
) -> torch.Tensor:
    """Softmax attention softmax(q kᵀ·scale) v over a sequence sharded like
    `sequence_parallel_linear_attention`: q, k: (B, H, n_r, D), v: (B, H, n_r, E) -> (B, H, n_r, E).

    K and V of all ranks are all-gathered (one collective of P·B·H·max(n_r)·(D+E) elements — O(N),
    unlike the linear layers' O(1) state) and rank r's queries, at global positions o_r + i, see keys
    j ≤ o_r + i when causal (all N keys otherwise). The backward sums each rank's ∂K, ∂V over the
    ranks (a reduce-scatter; an all-reduce on gloo). Memory per rank O(n_r·N) for the scores.
    """
    group, rank, world = _resolve_group(group)
    error = None
    try:
        check_bool("causal", causal, error=TypeError)
        check_qkv(q, k, v)
        if q.shape[2] != k.shape[2]:
            raise ValueError(f"k must have q's shard length {q.shape[2]}, got {k.shape[2]}")
        if scale is not None and not isinstance(scale, (int, float)):
            raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    except (ValueError, TypeError) as exc:
        error = exc
    ok = error is None
    rows = _agree(group, world, error,
                  [q.shape[2] if ok else -1, q.shape[0] if ok else -1, q.shape[1] if ok else -1,
                   q.shape[3] if ok else -1, v.shape[3] if ok else -1, _dtype_code(q.dtype) if ok else -1],
                  ("q/k batch size B", "q/k heads H", "q/k head dim D", "v head dim E", "q/k/v dtype"))
    lengths = [r[0] for r in rows]
    offset, n, d = sum(lengths[:rank]), q.shape[2], q.shape[3]
    full = _GatherSequence.apply(group, rank, lengths, "kv", torch.cat((k, v), dim=-1))
    kf, vf = full[..., :d], full[..., d:]
    if causal:  # keys after this shard are never seen; bottom-right alignment gives j <= offset + i
        kf, vf = kf[:, :, : offset + n], vf[:, :, : offset + n]
    return softmax_attention(q, kf, vf, causal=causal, scale=scale)


def gather_sequence(x: torch.Tensor, *, group=None, dim: int = 2) -> torch.Tensor:
    """All-gathers the contiguous shards of x along `dim` (lengths may differ) into the full
    sequence on every rank, with autograd (the backward sums the gradients over the ranks and keeps
    each rank's slice). O(N) bytes: for losses, logging and tests, not for attention."""
    group, rank, world = _resolve_group(group)
    error, row = None, [-1] * 6
    try:
        check_tensor("x", x)
        if not -x.dim() <= dim < x.dim():
            raise ValueError(f"dim must index one of x's {x.dim()} dimensions, got {dim}")
        dim = dim % x.dim()
        xm = x.movedim(dim, 0)  # (n, *rest)
        rest = xm.shape[1:]
        x4 = xm.reshape(1, 1, xm.shape[0], -1)
        row = [x4.shape[2], 1, 1, x4.shape[3], 0, _dtype_code(x.dtype)]
    except (ValueError, TypeError) as exc:
        error = exc
    rows = _agree(group, world, error, row, ("", "", "x's size in the other dims", "", "x dtype"), min_tokens=0)
    lengths = [r[0] for r in rows]
    full = _GatherSequence.apply(group, rank, lengths, "seq", x4)
    return full.reshape(full.shape[2], *rest).movedim(0, dim)
