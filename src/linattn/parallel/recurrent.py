"""Sequence-parallel gated linear attention and the delta family (design §9): each called by every
rank of a group on its contiguous shard of the sequence, like `sequence_parallel_linear_attention`.

With decay or the delta rule the state entering a shard is no longer a sum of the earlier shards'
states: each shard maps the state it receives affinely (linattn.ops.affine),

    S_out,r = A_r S_in,r + ΔS_r        o_r = o⁰_r + S_in,rᵀ q̄_r   (normalize: numerator and denominator alike)

with A_r = e^{Σ_r g} (a scalar per head for g (B, H, N), a vector over the F state rows for
g (B, H, N, F)) for gated linear attention, and A_r = the ordered product of (I − β_t k̂_t k̂_tᵀ) Diag(α_t)
over the shard (D×D) for the delta family (DeltaNet, Gated DeltaNet, KDA). Every rank computes its
(A_r, ΔS_r), q̄_r and o⁰_r at once with the single-process operator (`gated_affine_form`,
`delta_rule_affine_form`), one all-gather exchanges the (A_s, ΔS_s), and rank r combines the ranks
before it,

    S_in,0 = S_init (rank 0's initial_state, or 0),    S_in,s+1 = A_s S_in,s + ΔS_s,

then reads its outputs from S_in,r. The backward mirrors it (parallel.functions.PrefixStates): the
outputs' gradient gives Λ_r = ∂L/∂S_in,r = Σ_t q̄_t ∂o_tᵀ; one all-gather of the Λ's; rank r forms
Λ̄_{r+1} = Λ_{r+1} + A_{r+1}ᵀ Λ̄_{r+2} (the gradient every later shard sends into its final state)
and hands ∂ΔS_r = Λ̄_{r+1}, ∂A_r = ∂⟨Λ̄_{r+1}, A_r S_in,r⟩/∂A_r to the operator's own backward,
which turns them into the gradients of k, v, g, β through A_r and ΔS_r in the same pass as the
direct ones. All ranks work at once; the gate's gradient includes its terms through A_r and q̄_r.

Communication per layer and rank, independent of N (state dtype: float32, float64 for float64
inputs), E' = E + 1 with normalize, else E:

    forward   all-gather of P·B·H·(F·E' + a) numbers, a = 1 (scalar gate), F (vector gate), D² (delta)
    backward  all-gather of P·B·H·F·E' numbers
    metadata  one all-gather of 11 int64 per rank

(`transition_exchange_bytes`). Cost per rank: the single-process operator on n_r tokens with E'
value columns (gated) or D + E (the delta rule: the identity block that yields A_r and q̄_r), and
its backward; memory that of the operator on n_r tokens.
"""

from __future__ import annotations

import torch

from .._checks import check_bool, check_eps, check_positive_int
from ..ops.affine import AffineForm
from ..ops.linear.chunked import DEFAULT_CHUNK_SIZE, state_dtype
from ..ops.delta import delta_rule_affine_form
from ..ops.delta.checks import check_arguments as check_delta_arguments
from ..ops.delta.checks import check_values as check_delta_values
from ..ops.gated import gated_affine_form
from ..ops.gated.api import check_gated_arguments
from ..ops.gated.checks import check_gate_values, check_gated_state
from .comm import agree_rows, dtype_code
from .functions import PrefixStates
from .groups import ShardGroup, resolve_group

_NAMES = ("q/k batch size B", "q/k heads H", "feature dim F (or D)", "v head dim E", "q/k/v dtype", "", "",
          "the autograd mode (torch.is_grad_enabled())")


def _needs_grad(*tensors) -> int:
    return int(torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors))


def _agree(shard: ShardGroup, error, q, v, feat: int, form_names: tuple[str, str], flags: tuple[int, int],
           grads) -> bool:
    """The metadata exchange: shapes, dtype, the operator's form (`flags`, named by `form_names`) and
    autograd mode equal on all ranks; returns whether any rank needs the backward."""
    row = [-1] * 10
    if error is None:
        row = [q.shape[2], q.shape[0], q.shape[1], feat, v.shape[-1], dtype_code(q.dtype), *flags,
               int(torch.is_grad_enabled()), _needs_grad(*grads)]
    names = _NAMES[:5] + form_names + _NAMES[7:]
    rows = agree_rows(shard, error, row, names)
    return any(r[-1] for r in rows)


def _initial_on_rank0(shard: ShardGroup, initial_state) -> None:
    if initial_state is not None and shard.rank != 0:
        raise ValueError(f"initial_state: only rank 0 holds the state before the sequence (its shard comes first); "
                         f"rank {shard.rank} must pass None")


def _run_shard(shard: ShardGroup, form: AffineForm, initial, any_grad: bool) -> torch.Tensor:
    """This rank's outputs from its affine form: exchange, prefix-combine, read out (module doc)."""
    dS = form.state if initial is None else form.final(initial)  # rank 0 folds S_init into what it sends
    anchor = torch.zeros(0, dtype=dS.dtype, device=dS.device, requires_grad=any_grad and torch.is_grad_enabled())
    S_in = PrefixStates.apply(shard, form.transition, dS, anchor)
    if initial is not None:
        S_in = S_in + initial
    return form.output(S_in)


def sequence_parallel_gated_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    *,
    group=None,
    feature_map=None,
    normalize: bool = False,
    eps: float = 1e-6,
    scale: float | None = None,
    initial_state=None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    key_padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal gated linear attention (linattn.ops.gated_linear_attention) over a sequence sharded across
    the ranks of `group` (see the module doc).

    q, k: (B, H, n_r, D), v: (B, H, n_r, E), g: (B, H, n_r) or (B, H, n_r, F) — this rank's
    contiguous shard, shards in rank order, lengths free (every rank needs ≥ 1 token) -> o
    (B, H, n_r, E) in q's dtype, equal to shard r of gated_linear_attention on the whole sequence.

    initial_state: the state before the sequence (kv, or (kv, z) with normalize), on rank 0 only
        (the other ranks pass None); its gradient, on rank 0, is the whole one.
    key_padding_mask: (B, n_r) bool, True where the key is real (this rank's shard).
    feature_map: as for the single-process op, except position-dependent maps (cosFormer), which the
        gated operators cannot give global positions. φ's parameter gradients are this rank's share
        (sum them over the group, as data parallelism does); random maps need the same ω everywhere.
    Other arguments as gated_linear_attention's. Gradients reach q, k, v, g, φ's parameters and the
    initial state. bf16 inputs: the shard's partial outputs o⁰ are rounded to bf16 once before the
    initial state's share is added (one more bf16 rounding than the single-process op).
    """
    shard = resolve_group(group)
    error, feat, vector = None, 0, 0
    try:
        check_positive_int("chunk_size", chunk_size)
        check_bool("normalize", normalize, error=TypeError)
        check_eps("eps", eps)
        if getattr(feature_map, "needs_positions", False):
            raise ValueError(f"feature_map: a position-dependent map ({type(feature_map).__name__}) does not run "
                             "sequence-parallel in the gated operators (they take no positions)")
        feat = check_gated_arguments(q, k, v, g, feature_map=feature_map, scale=scale,
                                     key_padding_mask=key_padding_mask)
        vector = int(g.dim() == 4)
        check_gate_values(g)
        _initial_on_rank0(shard, initial_state)
        if initial_state is not None:
            check_gated_state(initial_state, normalize, q.shape[0], q.shape[1], feat, v.shape[-1], q.device)
        state = tuple(initial_state) if normalize and initial_state is not None else (initial_state,)
        grads = (q, k, v, g, *state, *([] if feature_map is None else feature_map.parameters()))
    except (ValueError, TypeError) as exc:
        error, grads = exc, ()
    any_grad = _agree(shard, error, q, v, feat, ("g's form (0: per head, 1: per feature)", "normalize"),
                      (vector, int(normalize is True)), grads)
    form = gated_affine_form(q, k, v, g, feature_map=feature_map, normalize=normalize, eps=eps, scale=scale,
                             chunk_size=chunk_size, key_padding_mask=key_padding_mask)
    initial = None
    if initial_state is not None:
        sdt = form.state.dtype
        initial = (torch.cat((initial_state[0], initial_state[1][..., None]), -1) if normalize
                   else initial_state).to(sdt)
    return _run_shard(shard, form, initial, any_grad)


def sequence_parallel_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    *,
    g: torch.Tensor | None = None,
    group=None,
    scale: float | None = None,
    qk_l2norm: bool = False,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> torch.Tensor:
    """The delta rule (linattn.ops.delta_rule; DeltaNet, Gated DeltaNet with g) over a sequence
    sharded across the ranks of `group` (see the module doc).

    q, k: (B, H, n_r, D), v: (B, H, n_r, E), beta (B, H, n_r), g (B, H, n_r), (B, H, n_r, D) (KDA) or
    None — this rank's contiguous shard, shards in rank order, lengths free (every rank needs ≥ 1 token)
    -> o (B, H, n_r, E) in q's dtype, equal to shard r of delta_rule on the whole sequence.

    initial_state: S (B, H, D, E) in the state dtype before the sequence, on rank 0 only (the other
        ranks pass None); its gradient, on rank 0, is the whole one.
    Other arguments as delta_rule's. Gradients reach q, k, v, beta, g and the initial state. The
    shard's transition A_r (D×D per head) crosses the ranks with ΔS_r: P·B·H·(D² + D·E) numbers
    forward, P·B·H·D·E backward. bf16 inputs: o⁰ and q̄ are rounded to bf16 once before the initial
    state's share is added.
    """
    def check():
        check_delta_arguments(q, k, v, beta, g, scale, qk_l2norm, initial_state)
        check_delta_values(beta, g)

    form = 0 if g is None else 2 if isinstance(g, torch.Tensor) and g.dim() == 4 else 1
    return run_delta_family(group, check, chunk_size, ("g (0: None, 1: per head, 2: per key channel)", "qk_l2norm"),
                            (form, int(qk_l2norm is True)), (q, k, v, beta, g, initial_state),
                            lambda: delta_rule_affine_form(q, k, v, beta, g=g, scale=scale, qk_l2norm=qk_l2norm,
                                                           chunk_size=chunk_size))


def sequence_parallel_kda(q, k, v, beta, g, *, group=None, scale: float | None = None, qk_l2norm: bool = False,
                          initial_state=None, chunk_size: int = DEFAULT_CHUNK_SIZE) -> torch.Tensor:
    """KDA (linattn.ops.kda.kda) over a sequence sharded across the ranks of `group`:
    `sequence_parallel_delta_rule` with g (B, H, n_r, D), one log-decay per key channel."""
    return sequence_parallel_delta_rule(q, k, v, beta, g=g, group=group, scale=scale, qk_l2norm=qk_l2norm,
                                        initial_state=initial_state, chunk_size=chunk_size)


def run_delta_family(group, check, chunk_size: int, flag_names: tuple, flags: tuple, tensors: tuple, make_form):
    """A delta-family operator sequence-parallel over `group`: `check()` (and the chunk size and the
    initial state's rank) on every rank, one agreement on errors, shapes and `flags` (named
    `flag_names`), then this rank's shard as `make_form()` (an AffineForm) run through the state
    exchange. tensors: (q, k, v, …, initial_state), the inputs whose gradients are wanted anywhere."""
    shard = resolve_group(group)
    q, v, initial_state = tensors[0], tensors[2], tensors[-1]
    error = None
    try:
        check_positive_int("chunk_size", chunk_size)
        check()
        _initial_on_rank0(shard, initial_state)
    except (ValueError, TypeError) as exc:
        error = exc
    feat = q.shape[-1] if error is None else 0
    any_grad = _agree(shard, error, q, v, feat, flag_names, flags, tensors)
    return _run_shard(shard, make_form(), initial_state, any_grad)


def transition_exchange_bytes(batch: int, heads: int, feature_dim: int, value_dim: int, world_size: int, *,
                              transition: str, normalize: bool = False,
                              dtype: torch.dtype = torch.float32) -> tuple[int, int]:
    """(forward, backward) bytes that land on each rank in one layer's state exchange of the gated
    and delta-rule operators, independent of N: P·B·H·(F·E' + a)·s forward, P·B·H·F·E'·s backward,
    with E' = E + normalize, a = 1 ("scalar": g (B, H, N)), F ("vector": g (B, H, N, F)) or F²
    ("matrix": the delta rule, F = D), s the state element size (4; 8 for float64)."""
    for name, val in (("batch", batch), ("heads", heads), ("feature_dim", feature_dim), ("value_dim", value_dim),
                      ("world_size", world_size)):
        check_positive_int(name, val)
    sizes = {"scalar": 1, "vector": feature_dim, "matrix": feature_dim * feature_dim}
    if transition not in sizes:
        raise ValueError(f"transition must be one of {tuple(sizes)}, got {transition!r}")
    check_bool("normalize", normalize)
    s = torch.tensor([], dtype=state_dtype(dtype)).element_size()
    per_rank = batch * heads * feature_dim * (value_dim + int(normalize))
    return (world_size * (per_rank + batch * heads * sizes[transition]) * s, world_size * per_rank * s)
