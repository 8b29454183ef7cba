"""The public linear-attention operators: parallel (causal chunked or non-causal) and recurrent step.

Tensors are (B, H, N, D) as in F.scaled_dot_product_attention. With feature_map=None, q and k are
already non-negative features of dim F; otherwise φ = feature_map is applied first (and F is its
output dim). A state is (kv: (B, H, F, E), z: (B, H, F)) in float32 (float64 for float64 inputs).

The pieces the public operators are made of are named for the other parts of linattn that build on
them (linattn.parallel): `check_arguments` (every argument check, once per call), `make_featurizer`
(φ, scale, mask and RoPE for checked arguments, and the zero state), `run_linear_attention` (the
causal or non-causal op on checked arguments) and `state_readout` (every query reads one state).
"""

from __future__ import annotations

import math

import torch

from ..precision import without_autocast
from ..._checks import (
    check_bool,
    check_eps,
    check_key_padding_mask,
    check_positions,
    check_positive_int,
    check_qkv,
    check_sizes,
    check_state,
    check_state_dtype,
)
from .. import native, packed, stepcheck
from ..features import Featurizer
from ..autodiff import has_tangent, refuse_forward_ad
from .chunked import DEFAULT_CHUNK_SIZE, ChunkedCausalLinearAttention, compute_dtype, state_dtype
from ..nonfinite import all_finite

State = tuple[torch.Tensor, torch.Tensor]


def _feature_dim(feature_map, head_dim: int) -> int:
    return head_dim if feature_map is None else feature_map.feature_dim


def check_arguments(q, k, v, *, feature_map, scale, key_padding_mask, initial_state, positions, rope) -> int:
    """Checks the arguments shared by every form of the op (ValueError / TypeError naming the
    argument) and returns F, the feature dim."""
    check_qkv(q, k, v)
    b, h, n_k, d = k.shape
    if q.shape[2] < 1 or n_k < 1:
        raise ValueError(f"q and k must hold at least one token, got lengths {q.shape[2]} and {n_k}")
    if 0 in (b, h, d, v.shape[3]):
        check_sizes(q, v)
    if feature_map is not None:
        if not hasattr(feature_map, "feature_dim"):
            raise TypeError(f"feature_map must be a linattn feature map (with .feature_dim), got {type(feature_map).__name__}")
        if getattr(feature_map, "head_dim", d) != d:
            raise ValueError(f"feature_map expects head dim {feature_map.head_dim}, q/k have {d}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    if scale is not None and not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    check_key_padding_mask(key_padding_mask, b, n_k, k.device)
    check_positions(positions, b, n_k, k.device)
    feat = _feature_dim(feature_map, d)
    if rope is not None and rope.dim != feat:
        raise ValueError(f"rope dim must equal the feature dim F={feat}, got {rope.dim}")
    if initial_state is not None:
        check_state(initial_state, b, h, feat, v.shape[-1], q.device)
        check_state_dtype(initial_state, q.dtype, state_dtype(q.dtype))
        if positions is None and (rope is not None or getattr(feature_map, "needs_positions", False)):
            raise ValueError(
                "positions are required when resuming from initial_state with RoPE or a position-dependent "
                "feature map (pass the global token indices)"
            )
    return feat


def make_featurizer(k, *, feature_map, scale, key_padding_mask, positions, rope) -> Featurizer:
    """The Featurizer (φ, scale, key mask, RoPE) of arguments that passed `check_arguments`;
    positions default to arange(N) where φ or RoPE needs them."""
    if positions is None and (rope is not None or getattr(feature_map, "needs_positions", False)):
        positions = torch.arange(k.shape[2], device=k.device)
    return Featurizer(feature_map, rope, None if scale is None else float(scale), positions, key_padding_mask)


def _prepare(q, k, v, *, feature_map, scale, key_padding_mask, initial_state, positions, rope):
    """Checks the arguments once and returns (Featurizer, initial state or zeros in the state dtype)."""
    feat = check_arguments(q, k, v, feature_map=feature_map, scale=scale, key_padding_mask=key_padding_mask,
                           initial_state=initial_state, positions=positions, rope=rope)
    fz = make_featurizer(k, feature_map=feature_map, scale=scale, key_padding_mask=key_padding_mask,
                         positions=positions, rope=rope)
    if initial_state is None:
        sdt = state_dtype(q.dtype)
        b, h = q.shape[:2]
        initial_state = (
            torch.zeros(b, h, feat, v.shape[-1], dtype=sdt, device=q.device),
            torch.zeros(b, h, feat, dtype=sdt, device=q.device),
        )
    return fz, initial_state


def advance_schedule(feature_map) -> None:
    """One operator call for φ's redraw schedule (FAVOR+ / trig with redraw_interval, training
    mode). Every public operator calls it exactly once, before any feature is computed."""
    if feature_map is not None and hasattr(feature_map, "advance_schedule"):
        feature_map.advance_schedule()


@without_autocast
def linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    feature_map=None,
    normalize: bool = True,
    eps: float = 1e-6,
    scale: float | None = None,
    key_padding_mask: torch.Tensor | None = None,
    initial_state: State | None = None,
    return_state: bool = False,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    positions: torch.Tensor | None = None,
    rope=None,
    cu_seqlens: torch.Tensor | None = None,
):
    """Linear attention O_i = Σ_j φ(q_i)ᵀφ(k_j) v_j / (Σ_j φ(q_i)ᵀφ(k_j) + ε), j ≤ i when causal.

    q, k: (B, H, N, D); v: (B, H, N, E) -> o: (B, H, N, E) in q's dtype.

    feature_map: φ (a linattn.nn.feature_maps module) or None when q, k are already features.
    normalize: divide by the denominator (False: O_i = numerator only).
    scale: multiplies q before φ (None: no scaling).
    key_padding_mask: (B, N) bool, True where the key is real; a masked key leaves numerator and
        denominator alike.
    initial_state: (kv (B, H, F, E), z (B, H, F)) carried from an earlier call (causal: the tokens
        before; non-causal: extra keys every query sees). Gradients flow into it.
    return_state: also return the final state (kv, z); then the result is (o, (kv, z)).
    chunk_size: rows per chunk of the causal chunked algorithm (any positive int; N need not be a
        multiple).
    positions: (N,) or (B, N) absolute token indices for RoPE / cosFormer (default arange(N); must
        be given when resuming from a state with either).
    rope: a linattn.nn.positional.RotaryEmbedding of dim F, applied to the numerator features only.
    cu_seqlens: packed sequences (causal only; design §17, linattn.ops.packed): a 1-D integer tensor
        [N+1] of cumulative lengths (0 … T) of N sequences laid end to end in a batch of 1. Each
        sequence runs as its own call: states reset at every boundary, positions (default) restart
        at 0, positions / key_padding_mask given are read on the packed time axis, initial_state
        and the returned state are per sequence, kv (N, H, F, E) and z (N, H, F).

    On the CPU, a causal call with φ elu+1 or None, no RoPE, mask or scale and fp32/fp64/bf16 inputs
    runs as fused operators, forward and backward (linattn.ops.native; the same numbers up to rounding).

    NaN and Inf respect causality: one at token j changes no output before j and no gradient of a
    loss over those outputs (such a call runs an exact, slower pass: linattn.ops.linear.chunked), and a masked
    key slot changes nothing whatever it holds.
    """
    advance_schedule(feature_map)
    if cu_seqlens is not None:
        return _packed_linear_attention(q, k, v, cu_seqlens, causal=causal, feature_map=feature_map,
                                        normalize=normalize, eps=eps, scale=scale, key_padding_mask=key_padding_mask,
                                        initial_state=initial_state, return_state=return_state,
                                        chunk_size=chunk_size, positions=positions, rope=rope)
    return _linear_attention(q, k, v, causal=causal, feature_map=feature_map, normalize=normalize, eps=eps,
                             scale=scale, key_padding_mask=key_padding_mask, initial_state=initial_state,
                             return_state=return_state, chunk_size=chunk_size, positions=positions, rope=rope)


def _linear_attention(q, k, v, *, causal, feature_map, normalize, eps, scale, key_padding_mask, initial_state,
                      return_state, chunk_size, positions, rope):
    """linear_attention without advancing φ's redraw schedule (for callers that already did)."""
    check_positive_int("chunk_size", chunk_size)
    for name, flag in (("causal", causal), ("normalize", normalize), ("return_state", return_state)):
        check_bool(name, flag, error=TypeError)
    check_eps("eps", eps)
    if causal and q.dim() == 4 and k.dim() == 4 and q.shape[2] != k.shape[2]:
        raise ValueError(f"causal linear attention needs q and k of equal length, got {q.shape[2]} and {k.shape[2]}")
    fz, state = _prepare(q, k, v, feature_map=feature_map, scale=scale, key_padding_mask=key_padding_mask,
                         initial_state=initial_state, positions=positions, rope=rope)
    o, (kv, z) = run_linear_attention(fz, state, q, k, v, causal=causal, normalize=normalize, eps=eps,
                                      chunk_size=chunk_size)
    return (o, (kv, z)) if return_state else o


def _packed_linear_attention(q, k, v, cu_seqlens, *, causal, initial_state, return_state, key_padding_mask,
                             positions, **options):
    """linear_attention on N packed sequences (cu_seqlens), each one by itself (linattn.ops.packed)."""
    check_bool("causal", causal, error=TypeError)
    if not causal:
        raise ValueError("cu_seqlens needs causal=True (packed sequences are defined for the causal op)")
    check_qkv(q, k, v)
    bounds = packed.boundaries(cu_seqlens, batch=q.shape[0], length=k.shape[2])
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"causal linear attention needs q and k of equal length, got {q.shape[2]} and {k.shape[2]}")
    if initial_state is not None:
        if not isinstance(initial_state, (tuple, list)) or len(initial_state) != 2:
            raise TypeError("initial_state must be a tuple (kv (N, H, F, E), z (N, H, F)) with cu_seqlens")
        packed.check_state_count(initial_state, len(bounds))
    b, h, _, d = q.shape
    feat, e, sdt = _feature_dim(options["feature_map"], d), v.shape[-1], state_dtype(q.dtype)
    fused = _packed_fused(q, k, v, cu_seqlens, len(bounds), initial_state, key_padding_mask, positions, **options)
    if fused is not None:
        return fused if return_state else fused[0]

    def one(spans, state):
        return _linear_attention(
            packed.gather(q, spans, 2), packed.gather(k, spans, 2), packed.gather(v, spans, 2), causal=True,
            initial_state=state, return_state=True, key_padding_mask=packed.gather(key_padding_mask, spans, 1),
            positions=packed.gather(positions, spans, -1), **options)

    def empty(state):
        return state if state is not None else (q.new_zeros(1, h, feat, e, dtype=sdt), q.new_zeros(1, h, feat, dtype=sdt))

    o, state = packed.run(one, bounds, initial_state, empty, lambda: q.new_zeros(b, h, 0, e))
    return (o, state) if return_state else o


def _packed_fused(q, k, v, cu_seqlens, count: int, initial_state, key_padding_mask, positions, *, feature_map,
                  normalize, eps, scale, chunk_size, rope):
    """The packed call as one fused kernel call given cu_seqlens (linattn.ops.packed.IN_KERNELS) when the
    fused kernels take it: (o, (kv, z)) with the states of the N sequences; None otherwise, and when a
    NaN or Inf reached a final state (the per-sequence path then runs the exact passes)."""
    if not packed.IN_KERNELS or rope is not None or q.shape[2] == 0:
        return None
    check_positive_int("chunk_size", chunk_size)
    check_bool("normalize", normalize, error=TypeError)
    check_eps("eps", eps)
    feat = check_arguments(q, k, v, feature_map=feature_map, scale=scale, key_padding_mask=key_padding_mask,
                           initial_state=None, positions=positions, rope=None)
    h, e, sdt = q.shape[1], v.shape[-1], state_dtype(q.dtype)
    if initial_state is None:
        state = (q.new_zeros(count, h, feat, e, dtype=sdt), q.new_zeros(count, h, feat, dtype=sdt))
    else:
        check_state(initial_state, count, h, feat, e, q.device)
        check_state_dtype(initial_state, q.dtype, sdt)
        state = tuple(initial_state)
    phi = native.fused_phi(feature_map, scale, key_padding_mask, state, q, k, v, bf16=True, train=True)
    if phi is None or not native.chunked_ready(q.dtype):
        return None
    refuse_forward_ad("linear_attention (causal)", q, k, v, *state)
    o, (kv, z) = native.chunked(q, k, v, state, phi=phi, normalize=normalize, eps=float(eps),
                                chunk=min(chunk_size, q.shape[2]), cu_seqlens=cu_seqlens)
    return (o, (kv, z)) if all_finite(kv, z) else None


def run_linear_attention(fz: Featurizer, state: State, q, k, v, *, causal: bool, normalize: bool, eps: float,
                         chunk_size: int):
    """The op on checked arguments with its featurizer and initial state (see make_featurizer):
    returns (o (B, H, N, E), (kv, z) final). Causal: the fused CPU kernels where they apply, else the
    chunked autograd Function; non-causal: O(N·F·E) with plain autograd. A non-finite value in k, v
    or the state shows in the final state; the causal pass then runs again exactly (ops.nonfinite),
    so that it reaches no earlier token."""
    if not causal:
        return _noncausal(fz, q, k, v, state, normalize, eps)
    refuse_forward_ad("linear_attention (causal)", q, k, v, state, fz.parameters)
    chunk_size = min(chunk_size, q.shape[2])  # one chunk at most: no C² work buffer beyond N²
    phi = None if fz.rope is not None else native.fused_phi(fz.feature_map, fz.scale, fz.key_padding_mask, state,
                                                            q, k, v, bf16=True, train=True)
    if phi is not None and native.chunked_ready(q.dtype):  # CPU: fused forward (and backward)
        o, (kv, z) = native.chunked(q, k, v, state, phi=phi, normalize=normalize, eps=float(eps), chunk=chunk_size)
    else:
        o, kv, z = ChunkedCausalLinearAttention.apply(fz, chunk_size, normalize, float(eps), False, q, k, v, *state,
                                                      *fz.parameters)
    if not all_finite(kv, z):
        o, kv, z = ChunkedCausalLinearAttention.apply(fz, chunk_size, normalize, float(eps), True, q, k, v, *state,
                                                      *fz.parameters)
    return o, (kv, z)


def _noncausal(fz: Featurizer, q, k, v, state, normalize, eps):
    """O = φ(Q)(kv0 + φ(K)ᵀV) / (φ(Q)(z0 + φ(K)ᵀ1) + ε), O(N·F·E), plain autograd."""
    cdt, sdt = compute_dtype(q.dtype, q.device), state_dtype(q.dtype)
    n_q, n_k = q.shape[2], k.shape[2]
    if fz.positions is not None and fz.positions.shape[-1] != n_q:
        # positions describe the keys; queries of another length get their own arange only if unused
        raise ValueError(f"positions cover {fz.positions.shape[-1]} keys but q has {n_q} tokens; use equal lengths")
    kr, kd = fz(k, 0, n_k, False)
    v = fz.values(v)
    kv = state[0].to(sdt) + (kr.to(cdt).transpose(-1, -2) @ v.to(cdt)).to(sdt)
    z = state[1].to(sdt) + (kr if kd is None else kd).to(sdt).sum(-2)
    return state_readout(fz, q, kv, z, normalize=normalize, eps=eps), (kv, z)


def state_readout(fz: Featurizer, q, kv, z, *, normalize: bool, eps: float):
    """Every query reads one state: O = φ(Q) kv / (φ(Q) z + ε) (O = φ(Q) kv without normalize),
    q (B, H, N, D), kv (B, H, F, E), z (B, H, F) in the state dtype -> (B, H, N, E) in q's dtype."""
    cdt, sdt = compute_dtype(q.dtype, q.device), state_dtype(q.dtype)
    qr, qd = fz(q, 0, q.shape[2], True)
    u = qr.to(cdt) @ kv.to(cdt)
    if not normalize:
        return u.to(q.dtype)
    den = ((qr if qd is None else qd).to(sdt) * z[:, :, None, :]).sum(-1, keepdim=True)
    return (u / (den + eps)).to(q.dtype)


def linear_attention_step(
    state: State,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    feature_map=None,
    normalize: bool = True,
    eps: float = 1e-6,
    scale: float | None = None,
    key_padding_mask: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    rope=None,
    inplace: bool = False,
):
    """Recurrent form (design §4): returns (o, new_state); `state` is not modified unless inplace.

        kv ← kv + φ(k_t) v_tᵀ,   z ← z + φ(k_t),   o_t = φ(q_t)ᵀ kv / (φ(q_t)ᵀ z + ε)

    q, k: (B, H, T, D), v: (B, H, T, E); T = 1 is the decoding fast path (on the CPU, with φ elu+1 or
    None, no scale or mask and no gradient wanted: one fused operator, linattn.ops.native), T > 1 (a
    short block of tokens) runs the causal chunked op from the state. state: (kv (B, H, F, E), z (B, H, F)), or None
    to start from zeros. positions: (T,) or (B, T) global indices (required with RoPE / cosFormer).
    inplace: the new state is written into `state` (given, no gradient wanted) and returned: no new
    state tensors per token (the fused step updates a contiguous state itself, linattn_cpu::step_;
    other paths copy their result into it).
    """
    if inplace:
        stepcheck.check_inplace(state, q, k, v)
    o, new = _linear_step(state, q, k, v, feature_map=feature_map, normalize=normalize, eps=eps, scale=scale,
                          key_padding_mask=key_padding_mask, positions=positions, rope=rope, own=inplace)
    return (o, stepcheck.write_into(state, new)) if inplace else (o, new)


def _linear_step(state, q, k, v, *, feature_map, normalize, eps, scale, key_padding_mask, positions, rope, own):
    """linear_attention_step's work; own: the fused step may update a contiguous state in place."""
    advance_schedule(feature_map)
    key = stepcheck.signature("linear_step", state, q, k, v, feature_map, normalize, eps, scale, key_padding_mask,
                              positions, rope)
    if stepcheck.seen(key) and state is not None:  # checked once for this signature (linattn.ops.stepcheck)
        fz = make_featurizer(k, feature_map=feature_map, scale=scale, key_padding_mask=key_padding_mask,
                             positions=positions, rope=rope)
    else:
        check_bool("normalize", normalize, error=TypeError)
        check_eps("eps", eps)
        if q.dim() == 4 and q.shape[2] != 1:
            o, new_state = _linear_attention(q, k, v, causal=True, feature_map=feature_map, normalize=normalize,
                                             eps=eps, scale=scale, key_padding_mask=key_padding_mask,
                                             initial_state=state, return_state=True, positions=positions, rope=rope,
                                             chunk_size=DEFAULT_CHUNK_SIZE)
            return o, new_state
        if state is not None and positions is None and (rope is not None or
                                                        getattr(feature_map, "needs_positions", False)):
            raise ValueError("positions (the global token index) are required for a step with RoPE or a "
                             "position-dependent feature map")
        fz, state = _prepare(q, k, v, feature_map=feature_map, scale=scale, key_padding_mask=key_padding_mask,
                             initial_state=state, positions=positions, rope=rope)
        if k.shape[2] != 1:
            raise ValueError(f"k must hold the same single token as q, got length {k.shape[2]}")
        stepcheck.remember(key)
    v = fz.values(v)
    # the kernel's φ code depends on the signature alone when no input wants a gradient (requires_grad is in it)
    phi = stepcheck.noted(key, "phi") if native.enabled() else None  # LINATTN_NATIVE=0 is read at each call
    if phi is None:
        phi = native.fused_phi(feature_map, scale, key_padding_mask, state, q, k, v)
        if phi is not None and not any(t.requires_grad for t in (*state, q, k, v)):
            stepcheck.note(key, "phi", phi)
    if phi is not None and not has_tangent(state, q, k, v):  # one fused CPU operator (elu+1 or identity, inference)
        angles = None if rope is None else rope.angles(fz.positions, state[0].dtype)
        return native.step(state, q, k, v, phi=phi, normalize=normalize, eps=float(eps), angles=angles,
                           inplace=own and all(x.is_contiguous() for x in state))
    if getattr(feature_map, "symmetric", False) and scale is None and key_padding_mask is None:
        # φ (and RoPE) treat q and k alike here: one call on both, as 2H heads
        fr, fd = fz(torch.cat((q, k), 1), 0, 1, True)
        qr, kr = fr.chunk(2, 1)
        qd, kd = (None, None) if fd is None else fd.chunk(2, 1)
    else:
        qr, qd = fz(q, 0, 1, True)
        kr, kd = fz(k, 0, 1, False)
    return step_from_features(state, qr, kr, v, qd, kd, normalize=normalize, eps=eps, out_dtype=q.dtype)


def step_from_features(state: State, qr, kr, v, qd=None, kd=None, *, normalize: bool = True,
                       eps: float = 1e-6, out_dtype=None):
    """The arithmetic of one recurrent step, from features (no checks; callers validate):

        kv' = kv + k̃ᵣᵀ v,   z' = z + k̃_d,   o = q̃ᵣ kv' / (q̃_d · z' + ε)   (o = q̃ᵣ kv' without normalize)

    state: (kv (B, H, F, E), z (B, H, F)) in the state dtype; qr, kr (B, H, 1, F)
    numerator features (RoPE-rotated, if any); qd, kd the denominator features (None: qr, kr);
    v (B, H, 1, E). Returns (o (B, H, 1, E) in out_dtype (default v's), (kv', z'))."""
    kv, z = state
    b, h, feat, e = kv.shape
    bh, sdt = b * h, kv.dtype
    out_dtype = v.dtype if out_dtype is None else out_dtype
    if qr.dtype != sdt:
        qr, kr, v = qr.to(sdt), kr.to(sdt), v.to(sdt)
        qd, kd = (None if x is None else x.to(sdt) for x in (qd, kd))
    # a handful of 3-D ops: on CPU one step is bound by operator dispatch, not arithmetic
    kv_new = torch.addcmul(kv, kr.mT, v)  # (B, H, F, 1) * (B, H, 1, E) outer product
    z_new = z + (kr if kd is None else kd).reshape(b, h, feat)
    num = torch.bmm(qr.reshape(bh, 1, feat), kv_new.reshape(bh, feat, e))  # (BH, 1, E)
    if normalize:
        den = torch.bmm((qr if qd is None else qd).reshape(bh, 1, feat), z_new.reshape(bh, feat, 1))
        num = num.div_(den.add_(eps))
    return num.view(b, h, 1, e).to(out_dtype), (kv_new, z_new)
