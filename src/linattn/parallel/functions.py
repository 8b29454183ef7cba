"""The autograd Functions of sequence parallelism and the shard-level passes they run.

A shard pass walks this rank's tokens in blocks of `block` tokens (features recomputed block by
block, so nothing of size n·F is kept): `key_state` sums the shard's keys into a state,
`query_state_gradient` computes what the shard's outputs send back into their initial state.
`PrefixStates` is the exchange of the gated and delta-rule operators: every shard's affine
transition (A_r, ΔS_r) in, the state entering this shard out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ops.affine import apply_transition, transition_grad
from ..ops.linear.chunked import state_dtype
from .comm import all_gather, comm_stats, sum_after_rank, sum_over_ranks, sum_scatter
from .groups import ShardGroup


@dataclass(frozen=True)
class ShardPass:
    """What a causal shard's backward needs besides tensors: the featurizer (φ, RoPE, mask; see
    linattn.ops.linear.make_featurizer), the feature dim F, the shard's group, the op's options and
    the block and chunk sizes of the shard-level passes."""

    featurize: object
    feat: int
    shard: ShardGroup
    normalize: bool
    eps: float
    block: int
    chunk: int


@torch.no_grad()
def key_state(featurize, feat: int, k, v, block: int):
    """ΔS = Σ_j R_j φ(k_j) v_jᵀ (B, H, F, E), Δz = Σ_j φ(k_j) (B, H, F) over the shard's tokens j, in
    the state dtype, walked in blocks of `block` tokens (no autograd: KeyStateSum and
    InjectStateGradient supply the gradients)."""
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


class KeyStateSum(torch.autograd.Function):
    """apply(featurize, feat, block, k, v, *params) -> (ΔS (B, H, F, E), Δz (B, H, F)) = key_state,
    with autograd (the non-causal path; the causal one uses key_state + InjectStateGradient).

    Backward, for incoming ∂ΔS (F×E) and ∂Δz (F), block by block with recomputed features:
        ∂V = K̃ ∂ΔS,   ∂K̃ = V ∂ΔSᵀ,   ∂K̃_den = 1 ∂Δzᵀ     (K̃ = rows R_j φ(k_j), K̃_den = rows φ(k_j)),
    chained to k (and φ's parameters) by autograd on the recomputed block features.
    """

    @staticmethod
    def forward(ctx, featurize, feat: int, block: int, k, v, *params):
        S, z = key_state(featurize, feat, k, v, block)
        ctx.featurize, ctx.block = featurize, block
        ctx.save_for_backward(k, v, *params)
        return S, z

    @staticmethod
    def backward(ctx, dS, dz):
        k, v, *params = ctx.saved_tensors
        featurize, L = ctx.featurize, ctx.block
        b, h, n, _ = k.shape
        sdt = state_dtype(k.dtype)
        need_k = ctx.needs_input_grad[3]
        dk = torch.zeros_like(k) if need_k else None
        dv = torch.empty_like(v)
        dparams = [torch.zeros_like(p) for p in params]
        if dS is None and dz is None:
            return (None, None, None, dk, torch.zeros_like(v), *dparams)
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
        return (None, None, None, dk, dv, *dparams)


def _denominators(qd, kd, z, chunk: int):
    """d_i = qd_iᵀ(z + Σ_{j≤i} kd_j) for a block: qd, kd (B, H, n, F), z (B, H, F) -> (d (B, H, n), z after).

    Chunked like the causal op (design §3: intra-chunk tril(Qd Kdᵀ)·1 plus Qd times the state before
    the chunk): batched matmuls instead of an (n, F) cumulative sum, about 3× faster on CPU."""
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
def query_state_gradient(p: ShardPass, q, k, o, do, z0):
    """Γ_S = Σ_i R_i φ(q_i) G_iᵀ (B, H, F, E), Γ_z = Σ_i φ(q_i) g_i (B, H, F): the gradient the shard's
    outputs send into its initial state (∂L/∂S_init, ∂L/∂z_init when nothing flows into the final
    state), with G_i = ∂L/∂U_i = do_i/(d_i + ε) and g_i = ∂L/∂d_i = −(do_i·o_i)/(d_i + ε), the
    denominators d_i = φ(q_i)ᵀ(z_init + Σ_{j≤i} φ(k_j)) recomputed block by block (normalize=False:
    G = do, g = 0)."""
    b, h, n, _ = q.shape
    sdt = state_dtype(q.dtype)
    GS = torch.zeros(b, h, p.feat, do.shape[-1], dtype=sdt, device=q.device)
    Gz = torch.zeros(b, h, p.feat, dtype=sdt, device=q.device)
    z = z0.to(sdt)
    for s in range(0, n, p.block):
        t = min(s + p.block, n)
        qr, qd = p.featurize(q[:, :, s:t], s, t, True)
        dob = do[:, :, s:t].to(sdt)
        if not p.normalize:
            GS += qr.to(sdt).transpose(-1, -2) @ dob
            continue
        kr, kd = p.featurize(k[:, :, s:t], s, t, False)
        qd = (qr if qd is None else qd).to(sdt)
        den, z = _denominators(qd, (kr if kd is None else kd).to(sdt), z, p.chunk)
        inv = den.add_(p.eps).reciprocal_()  # (B, H, n_b)
        GS += qr.to(sdt).transpose(-1, -2) @ (dob * inv[..., None])
        g = (dob * o[:, :, s:t].to(sdt)).sum(-1).mul_(inv).neg_()
        Gz += (qd * g[..., None]).sum(2)
    return GS, Gz


def flatten(S, z):
    """A state (S, z) as one flat buffer for a collective."""
    return torch.cat((S.reshape(-1), z.reshape(-1)))


def unflatten(flat, shapes):
    """flatten's inverse: (S, z) of `shapes`, copies."""
    shS, shz = shapes
    m = shS.numel()
    return flat[:m].view(shS).clone(), flat[m:].view(shz).clone()


class InjectStateGradient(torch.autograd.Function):
    """apply(pass_: ShardPass, q, k, z0, o, kv_final, z_final) -> o.

    Identity on o in the forward. In the backward (∂o arrives first, before the chunked op's own
    backward) it computes Γ_r = ∂L/∂(S_init,r, z_init,r) with one cheap pass over the shard
    (`query_state_gradient`), all-gathers the Γ of all ranks and returns, as the gradient of the
    chunked op's *final* state, ∂ΔS_r = Σ_{s>r} Γ_s. Since final_r = init_r + ΔS_r(k, v), the chunked
    backward then adds ∂ΔS_r's share to ∂k, ∂v (and φ's parameters) in the same pass that computes
    their direct gradient: no separate local-sum backward, no second set of N-sized gradient tensors,
    so per-rank memory is the single-process op's on n_r tokens. (The initial state itself is a
    constant of the graph: its gradient is exactly what Γ computes.)
    """

    @staticmethod
    def forward(ctx, pass_: ShardPass, q, k, z0, o, kv_final, z_final):
        ctx.pass_ = pass_
        ctx.save_for_backward(q, k, z0, o)
        return o.view_as(o)

    @staticmethod
    def backward(ctx, do):
        p = ctx.pass_
        q, k, z0, o = ctx.saved_tensors
        dkv = dz = None
        if ctx.needs_input_grad[5] or ctx.needs_input_grad[6]:  # same on every rank: all or none exchange
            if p.shard.rank == 0:  # nobody needs Γ_0 (no rank before 0): send zeros, skip the pass
                sdt = state_dtype(q.dtype)
                b, h = q.shape[:2]
                GS = torch.zeros(b, h, p.feat, o.shape[-1], dtype=sdt, device=q.device)
                Gz = torch.zeros(b, h, p.feat, dtype=sdt, device=q.device)
            else:
                GS, Gz = query_state_gradient(p, q, k, o, do, z0)
            dkv, dz = unflatten(sum_after_rank(flatten(GS, Gz), p.shard, "state_backward"), (GS.shape, Gz.shape))
        return None, None, None, None, do, dkv, dz


class AllReduceStates(torch.autograd.Function):
    """apply(shard, ΔS, Δz) -> (Σ_s ΔS_s, Σ_s Δz_s), the non-causal global state.

    Forward all-reduce; backward all-reduce, ∂Δ_r = Σ_s ∂out_s (every rank's loss sees every key).
    ΔS and Δz travel as one flat buffer in their (float32/float64) dtype.
    """

    @staticmethod
    def forward(ctx, shard: ShardGroup, dS, dz):
        ctx.shard = shard
        ctx.shapes, ctx.dtype, ctx.device = (dS.shape, dz.shape), dS.dtype, dS.device
        return unflatten(sum_over_ranks(flatten(dS, dz), shard, "state_forward"), ctx.shapes)

    @staticmethod
    def backward(ctx, gS, gz):
        shS, shz = ctx.shapes
        # always take part in the collective, even without incoming gradient (the others wait for it)
        gS = torch.zeros(shS, dtype=ctx.dtype, device=ctx.device) if gS is None else gS
        gz = torch.zeros(shz, dtype=ctx.dtype, device=ctx.device) if gz is None else gz
        flat = flatten(gS.to(ctx.dtype), gz.to(ctx.dtype))
        return (None, *unflatten(sum_over_ranks(flat, ctx.shard, "state_backward"), ctx.shapes))


class PrefixStates(torch.autograd.Function):
    """apply(shard, A, dS, anchor) -> S_in,r (B, H, F, E'), the state entering this rank's shard when
    shard s maps its entering state S to A_s S + ΔS_s (linattn.ops.affine):

        S_in,0 = 0,     S_in,s+1 = A_s S_in,s + ΔS_s        (rank r combines the ranks s < r)

    A: (B, H), (B, H, F) or (B, H, F, F) (see ops.affine.apply_transition); dS: (B, H, F, E'); both
    in the state dtype. Forward: one all-gather of every rank's (A_s, ΔS_s). Backward, from
    Λ_r = ∂L/∂S_in,r: one all-gather of the Λ's, then every rank runs the recurrence backwards over
    the ranks after it with the A's it kept,

        Λ̄_P = 0,   Λ̄_s = Λ_s + A_sᵀ Λ̄_{s+1},
        ∂ΔS_r = Λ̄_{r+1},   ∂A_r = ∂⟨Λ̄_{r+1}, A_r S_in,r⟩/∂A_r

    (Λ̄_{r+1} is what every later shard's outputs send back into this shard's final state).
    `anchor`, an empty tensor, only makes the output require a gradient on a rank whose own inputs
    do not, so that every rank takes part in the backward's collective when any rank needs it.
    """

    @staticmethod
    def forward(ctx, shard: ShardGroup, A, dS, anchor):
        r, world = shard.rank, shard.world
        flat = torch.cat((A.reshape(-1), dS.reshape(-1)))
        rows = all_gather(flat, shard.group, world, "state all-gather (state_forward)")
        comm_stats.add("state_forward", rows.numel() * rows.element_size())
        As = rows[:, :A.numel()].view(world, *A.shape)
        dSs = rows[:, A.numel():].view(world, *dS.shape)
        S = torch.zeros_like(dS)
        for s in range(r):
            S = apply_transition(As[s], S) + dSs[s]
        ctx.shard = shard
        ctx.save_for_backward(As[r:].clone(), S)  # this rank's transition and the later ranks'
        return S

    @staticmethod
    def backward(ctx, lam):
        As, S_in = ctx.saved_tensors  # As[0] is this rank's A, As[i] rank r + i's
        r, world = ctx.shard.rank, ctx.shard.world
        # every rank takes part, with zeros when no gradient reached its entering state
        lam = torch.zeros_like(S_in) if lam is None else lam.to(S_in.dtype)
        lams = all_gather(lam, ctx.shard.group, world, "state-gradient all-gather (state_backward)")
        comm_stats.add("state_backward", lams.numel() * lams.element_size())
        after = torch.zeros_like(S_in)  # Λ̄_{s+1} while s walks down from the last rank to r + 1
        for s in range(world - 1, r, -1):
            after = lams[s] + apply_transition(As[s - r], after, transpose=True)
        dA = transition_grad(As[0], S_in, after) if ctx.needs_input_grad[1] else None
        return None, dA, after if ctx.needs_input_grad[2] else None, None


class GatherSequence(torch.autograd.Function):
    """apply(shard, lengths, kind, x) -> the full sequence (B, H, N, C) from the local shards
    (B, H, n_r, C), padded to max n_r for the all-gather. Backward: each rank's gradient of the full
    sequence is summed over ranks and its own slice kept (a reduce-scatter)."""

    @staticmethod
    def forward(ctx, shard: ShardGroup, lengths: list[int], kind: str, x):
        world, m = len(lengths), max(lengths)
        ctx.shard, ctx.lengths, ctx.kind = shard, lengths, kind
        pad = torch.zeros(*x.shape[:2], m, x.shape[3], dtype=x.dtype, device=x.device)
        pad[:, :, : x.shape[2]] = x
        g = all_gather(pad, shard.group, world, f"all-gather of the sequence ({kind})")
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
        mine = sum_scatter(stacked, ctx.shard.group, ctx.shard.rank, f"gradient reduce of the sequence ({ctx.kind})")
        return None, None, None, mine[:, :, : lengths[ctx.shard.rank]]
