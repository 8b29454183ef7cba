"""The sequence-parallel operators (design §9): linear attention, softmax attention and a gather,
each called by every rank of a group on its contiguous shard of the sequence.

A sequence of N tokens is split into P contiguous shards, one per rank, in rank order (rank r holds
tokens [o_r, o_r + n_r), o_r = Σ_{s<r} n_s; shards may differ in length). Every rank calls the same
function on its *local* shard q, k, v: (B, H, n_r, D) and gets its local output (B, H, n_r, E). The
only thing that crosses a shard boundary is the state (design §3):

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

import torch

from .._checks import check_bool, check_positions, check_positive_int, check_qkv, check_tensor
from ..ops.linear.chunked import DEFAULT_CHUNK_SIZE, block_tokens
from ..ops.linear.api import advance_schedule, check_arguments, make_featurizer, run_linear_attention, state_readout
from ..ops.softmax import softmax_attention
from .comm import agree, dtype_code, sum_before_rank
from .functions import (
    AllReduceStates,
    GatherSequence,
    InjectStateGradient,
    KeyStateSum,
    ShardPass,
    flatten,
    key_state,
    unflatten,
)
from .groups import resolve_group


def _check_linear(q, k, v, *, causal, feature_map, scale, rope, chunk_size, positions, key_padding_mask) -> int:
    """This rank's local checks (those of the single-process op, and the shard's): returns F."""
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
    return check_arguments(q, k, v, feature_map=feature_map, scale=scale, key_padding_mask=key_padding_mask,
                           initial_state=None, positions=positions, rope=rope)


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
    chunk_size: int = DEFAULT_CHUNK_SIZE,
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
    chunk_size: rows per chunk of the chunked op and of the shard-level passes (blocks of tokens are
        multiples of it).
    Other arguments as in linear_attention. States cross ranks in float32 (float64 for float64
    inputs): P·B·H·(F·E + F)·4 bytes per all-gather, once forward and once backward (see
    `state_exchange_bytes`), plus a 7·8·P-byte metadata all-gather.
    """
    shard = resolve_group(group)
    advance_schedule(feature_map)  # once per call, before any feature (same on every rank)
    error, row = None, [-1] * 6
    try:
        feat = _check_linear(q, k, v, causal=causal, feature_map=feature_map, scale=scale, rope=rope,
                             chunk_size=chunk_size, positions=positions, key_padding_mask=key_padding_mask)
        row = [q.shape[2], q.shape[0], q.shape[1], feat, v.shape[-1], dtype_code(q.dtype)]
    except (ValueError, TypeError) as exc:
        error = exc
    lengths = agree(shard, error, row, ("q/k batch size B", "q/k heads H", "feature dim F", "v head dim E",
                                        "q/k/v dtype"))
    n, e = q.shape[2], v.shape[-1]
    offset, total = sum(lengths[:shard.rank]), sum(lengths)
    needs_pos = rope is not None or getattr(feature_map, "needs_positions", False)
    if needs_pos and positions is None:
        max_len = getattr(feature_map, "max_len", None)
        if max_len is not None and total > max_len:
            raise ValueError(f"feature_map: the global sequence ({total} tokens over {shard.world} ranks) exceeds "
                             f"the feature map's max_len={max_len}")
        positions = torch.arange(offset, offset + n, device=q.device)
    fz = make_featurizer(k, feature_map=feature_map, scale=scale, key_padding_mask=key_padding_mask,
                         positions=positions, rope=rope)
    block = block_tokens(q.shape[0] * q.shape[1], max(feat, e), chunk_size)
    if not causal:  # O = φ(Q) S / (φ(Q) z + ε) with the global S, z (the local keys are already in it)
        dS, dz = KeyStateSum.apply(fz, feat, block, k, v, *fz.parameters)
        S, z = AllReduceStates.apply(shard, dS, dz)
        return state_readout(fz, q, S, z, normalize=normalize, eps=eps)
    dS, dz = key_state(fz, feat, k, v, block)
    S0, z0 = unflatten(sum_before_rank(flatten(dS, dz), shard, "state_forward"), (dS.shape, dz.shape))
    o, (kv_final, z_final) = run_linear_attention(fz, (S0, z0), q, k, v, causal=True, normalize=normalize, eps=eps,
                                                  chunk_size=chunk_size)
    if not o.requires_grad:
        return o
    pass_ = ShardPass(fz, feat, shard, normalize, float(eps), block, chunk_size)
    return InjectStateGradient.apply(pass_, q, k, z0, o, kv_final, z_final)


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
    shard = resolve_group(group)
    error, row = None, [-1] * 6
    try:
        check_bool("causal", causal, error=TypeError)
        check_qkv(q, k, v)
        if q.shape[2] != k.shape[2]:
            raise ValueError(f"k must have q's shard length {q.shape[2]}, got {k.shape[2]}")
        if scale is not None and not isinstance(scale, (int, float)):
            raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
        row = [q.shape[2], q.shape[0], q.shape[1], q.shape[3], v.shape[3], dtype_code(q.dtype)]
    except (ValueError, TypeError) as exc:
        error = exc
    lengths = agree(shard, error, row, ("q/k batch size B", "q/k heads H", "q/k head dim D", "v head dim E",
                                        "q/k/v dtype"))
    offset, n, d = sum(lengths[:shard.rank]), q.shape[2], q.shape[3]
    full = GatherSequence.apply(shard, lengths, "kv", torch.cat((k, v), dim=-1))
    kf, vf = full[..., :d], full[..., d:]
    if causal:  # keys after this shard are never seen; bottom-right alignment gives j <= offset + i
        kf, vf = kf[:, :, : offset + n], vf[:, :, : offset + n]
    return softmax_attention(q, kf, vf, causal=causal, scale=scale)


def gather_sequence(x: torch.Tensor, *, group=None, dim: int = 2) -> torch.Tensor:
    """All-gathers the contiguous shards of x along `dim` (lengths may differ) into the full
    sequence on every rank, with autograd (the backward sums the gradients over the ranks and keeps
    each rank's slice). O(N) bytes: for losses, logging and tests, not for attention."""
    shard = resolve_group(group)
    error, row = None, [-1] * 6
    try:
        check_tensor("x", x)
        if not -x.dim() <= dim < x.dim():
            raise ValueError(f"dim must index one of x's {x.dim()} dimensions, got {dim}")
        dim = dim % x.dim()
        xm = x.movedim(dim, 0)  # (n, *rest)
        rest = xm.shape[1:]
        x4 = xm.reshape(1, 1, xm.shape[0], -1)
        row = [x4.shape[2], 1, 1, x4.shape[3], 0, dtype_code(x.dtype)]
    except (ValueError, TypeError) as exc:
        error = exc
    lengths = agree(shard, error, row, ("", "", "x's size in the other dims", "", "x dtype"), min_tokens=0)
    full = GatherSequence.apply(shard, lengths, "seq", x4)
    return full.reshape(full.shape[2], *rest).movedim(0, dim)


def sequence_halo(x: torch.Tensor, width: int, *, group=None) -> torch.Tensor:
    """The `width` tokens of the sequence just before this rank's shard: x (B, n_r, C) -> (B, width, C),
    zeros before the sequence's start (all zeros on rank 0). What a causal convolution of kernel
    width + 1 needs from the earlier shards (the `tail` of linattn.nn.convolution.ShortConvolution).
    A shard shorter than `width` is bridged: the tokens come from as many earlier ranks as needed.

    With autograd: a halo token's gradient returns to the rank that holds the token. Each rank sends
    its last min(n_r, width) tokens: one all-gather of P·B·width·C elements (x's dtype) at most, one
    all-reduce (gloo) or reduce-scatter (NCCL) of as many backward, plus the metadata all-gather;
    independent of N.
    """
    shard = resolve_group(group)
    error, row = None, [-1] * 6
    try:
        check_tensor("x", x)
        if x.dim() != 3:
            raise ValueError(f"x must have shape (B, n, C) (this rank's shard), got {tuple(x.shape)}")
        check_positive_int("width", width)
        row = [min(x.shape[1], width), x.shape[0], 1, x.shape[2], 0, dtype_code(x.dtype)]
    except (ValueError, TypeError) as exc:
        error = exc
    lengths = agree(shard, error, row, ("x's batch size B", "", "x's channels C", "", "x dtype"), min_tokens=0)
    tail = x[:, x.shape[1] - lengths[shard.rank]:]
    tails = GatherSequence.apply(shard, lengths, "halo", tail.unsqueeze(1))[:, 0]  # (B, Σ_s m_s, C)
    before = tails[:, : sum(lengths[:shard.rank])]  # the earlier ranks' tails, in order
    if before.shape[1] < width:
        before = torch.nn.functional.pad(before, (0, 0, width - before.shape[1], 0))
    return before[:, before.shape[1] - width:]
