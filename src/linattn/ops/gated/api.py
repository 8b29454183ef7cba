"""The public gated linear-attention operators: the causal chunked form and the recurrent step.

Tensors are (B, H, N, D) as everywhere in linattn.ops; g is the log of the decay (≤ 0), one per head
and token (B, H, N) — RetNet with a constant, Mamba2/SSD-style when data-dependent — or one per
feature of φ(k) (B, H, N, F) — GLA (design §12). The state is the tensor kv (B, H, F, E), or the tuple
(kv, z (B, H, F)) with normalize=True, in float32 (float64 for float64 inputs).
"""

from __future__ import annotations

import torch

from ..precision import without_autocast
from ..._checks import check_bool, check_eps, check_positive_int, narrowed_gates
from .. import native, packed, stepcheck
from ..affine import AffineForm
from ..linear.chunked import DEFAULT_CHUNK_SIZE, state_dtype
from ..linear.api import advance_schedule, check_arguments, make_featurizer
from ..autodiff import has_tangent, refuse_forward_ad
from ..nonfinite import all_finite
from . import fused
from .checks import check_gate, check_gate_values, check_gated_state
from .chunked import ChunkedGatedLinearAttention


@without_autocast
def gated_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    *,
    feature_map=None,
    normalize: bool = False,
    eps: float = 1e-6,
    scale: float | None = None,
    initial_state=None,
    return_state: bool = False,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    key_padding_mask: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
):
    """Causal gated linear attention, per (batch, head), with q̃ = φ(scale·q), k̃ = φ(k):

        S_t = diag(e^{g_t}) S_{t−1} + k̃_t v_tᵀ,      o_t = S_tᵀ q̃_t
        normalize:  z_t = e^{g_t} ⊙ z_{t−1} + k̃_t,   o_t = S_tᵀ q̃_t / (q̃_t · z_t + ε)

    q, k: (B, H, N, D); v: (B, H, N, E); g: (B, H, N) or (B, H, N, F), g ≤ 0 and finite -> o (B, H, N, E)
    in q's dtype.

    feature_map: φ (a linattn.nn.feature_maps module) or None when q, k are already features.
    scale: multiplies q before φ (None: no scaling).
    initial_state: kv (B, H, F, E), or (kv, z) with normalize, from an earlier call; gradients flow
        into it. return_state: also return the final state; the result is then (o, state).
    chunk_size: rows per chunk of the chunked algorithm (any positive int).
    key_padding_mask: (B, N) bool, True where the key is real; a masked token leaves the state as it
        was (no key added, no decay), so padding anywhere gives the state of the sequence without it.
    cu_seqlens: packed sequences (design §17, linattn.ops.packed): a 1-D integer tensor [N+1] of
        cumulative lengths (0 … T) of N sequences laid end to end in a batch of 1; each runs as its own
        call (the state resets at every boundary), initial_state and the returned state are per
        sequence: kv (N, H, F, E), or (kv, z (N, H, F)) with normalize.

    Gradients flow to q, k, v, g, the initial state and φ's parameters. On the CPU, φ elu+1 or None
    without scale or mask and fp32/fp64/bf16 inputs run as fused operators, forward and backward
    (`linattn.ops.gated.fused`); elsewhere torch ops (`ChunkedGatedLinearAttention`), same numbers
    up to rounding.

    NaN and Inf respect causality: one at token j changes no output before j and no gradient of a loss
    over those outputs (such a call runs an exact, slower pass: linattn.ops.gated.chunked), and a
    masked key slot changes nothing whatever it holds.
    """
    advance_schedule(feature_map)
    check_positive_int("chunk_size", chunk_size)
    for name, flag in (("normalize", normalize), ("return_state", return_state)):
        check_bool(name, flag, error=TypeError)
    check_eps("eps", eps)
    if cu_seqlens is not None:
        return _packed(q, k, v, g, cu_seqlens, feature_map=feature_map, normalize=normalize, eps=eps, scale=scale,
                       initial_state=initial_state, return_state=return_state, chunk_size=chunk_size,
                       key_padding_mask=key_padding_mask)
    return _gated_linear_attention(q, k, v, g, feature_map=feature_map, normalize=normalize, eps=eps, scale=scale,
                                   initial_state=initial_state, return_state=return_state, chunk_size=chunk_size,
                                   key_padding_mask=key_padding_mask)


def _gated_linear_attention(q, k, v, g, *, feature_map, normalize, eps, scale, initial_state, return_state,
                            chunk_size, key_padding_mask):
    """gated_linear_attention on one batch of checked options, φ's schedule already advanced."""
    fz, kv0, z0 = _prepare(q, k, v, g, feature_map=feature_map, scale=scale, key_padding_mask=key_padding_mask,
                           state=initial_state, normalize=normalize, name="initial_state")
    refuse_forward_ad("gated_linear_attention", q, k, v, g, kv0, z0, fz.parameters)
    chunk_size = min(chunk_size, q.shape[2])  # one chunk at most: no C² work buffer beyond N²
    sdt = state_dtype(q.dtype)
    kv0, z0 = kv0.to(sdt), None if z0 is None else z0.to(sdt)
    phi = native.fused_phi(feature_map, scale, key_padding_mask, (kv0, kv0 if z0 is None else z0), q, k, v, bf16=True,
                           train=True)
    in_kernel = phi is not None and fused.ready(q.dtype)
    if not in_kernel or key_padding_mask is not None:  # the kernel checks the gates it reads; padding zeroes some
        check_gate_values(g)
    if key_padding_mask is not None:
        keep = key_padding_mask[:, None, :] if g.dim() == 3 else key_padding_mask[:, None, :, None]
        g = g.masked_fill(~keep, 0.0)
    if in_kernel:
        g = narrowed_gates(g, kv0.dtype, check_gate_values)
        o, kv, z = fused.chunked(q, k, v, g, kv0, z0, phi=phi, eps=float(eps), chunk=chunk_size)
    else:
        o, kv, *rest = ChunkedGatedLinearAttention.apply(fz, chunk_size, normalize, float(eps), False, q, k, v, g, kv0,
                                                         z0, *fz.parameters)
        z = rest[0] if normalize else None
    if not all_finite(kv, *(() if z is None else (z,))):  # a NaN or Inf reached the state: the exact pass
        o, kv, *rest = ChunkedGatedLinearAttention.apply(fz, chunk_size, normalize, float(eps), True, q, k, v, g, kv0,
                                                         z0, *fz.parameters)
        z = rest[0] if normalize else None
    if not return_state:
        return o
    return o, ((kv, z) if normalize else kv)


def _packed(q, k, v, g, cu_seqlens, *, initial_state, return_state, key_padding_mask, **options):
    """gated_linear_attention on N packed sequences (cu_seqlens), each one by itself (linattn.ops.packed)."""
    check_gated_arguments(q, k, v, g, feature_map=options["feature_map"], scale=options["scale"],
                          key_padding_mask=key_padding_mask)
    bounds = packed.boundaries(cu_seqlens, batch=q.shape[0], length=q.shape[2])
    normalize = options["normalize"]
    if initial_state is not None:
        if normalize and (not isinstance(initial_state, (tuple, list)) or len(initial_state) != 2):
            raise TypeError("initial_state must be a tuple (kv (N, H, F, E), z (N, H, F)) with normalize and cu_seqlens")
        packed.check_state_count(initial_state, len(bounds))
    out = _packed_fused(q, k, v, g, cu_seqlens, len(bounds), initial_state, key_padding_mask, **options)
    if out is not None:
        return out if return_state else out[0]
    b, h = q.shape[:2]
    feat = q.shape[3] if options["feature_map"] is None else options["feature_map"].feature_dim
    e, sdt = v.shape[-1], state_dtype(q.dtype)

    def one(spans, state):
        return _gated_linear_attention(*(packed.gather(x, spans, 2) for x in (q, k, v, g)), initial_state=state,
                                       return_state=True, key_padding_mask=packed.gather(key_padding_mask, spans, 1),
                                       **options)

    def empty(state):
        if state is not None:
            return state
        kv = q.new_zeros(1, h, feat, e, dtype=sdt)
        return (kv, q.new_zeros(1, h, feat, dtype=sdt)) if normalize else kv

    o, state = packed.run(one, bounds, initial_state, empty, lambda: q.new_zeros(b, h, 0, e))
    return (o, state) if return_state else o


def _packed_fused(q, k, v, g, cu_seqlens, count: int, initial_state, key_padding_mask, *, feature_map, normalize, eps,
                  scale, chunk_size):
    """The packed call as one fused kernel call given cu_seqlens (linattn.ops.packed.IN_KERNELS) when the
    fused kernels take it: (o, state) with the states of the N sequences; None otherwise, and when a NaN
    or Inf reached a final state (the per-sequence path then runs the exact passes)."""
    if not packed.IN_KERNELS or q.shape[2] == 0:
        return None
    h, e, sdt = q.shape[1], v.shape[-1], state_dtype(q.dtype)
    feat = q.shape[3] if feature_map is None else feature_map.feature_dim
    if initial_state is None:
        kv0 = q.new_zeros(count, h, feat, e, dtype=sdt)
        z0 = q.new_zeros(count, h, feat, dtype=sdt) if normalize else None
    else:
        check_gated_state(initial_state, normalize, count, h, feat, e, q.device, "initial_state")
        kv0, z0 = (initial_state[0].to(sdt), initial_state[1].to(sdt)) if normalize else (initial_state.to(sdt), None)
    phi = native.fused_phi(feature_map, scale, key_padding_mask, (kv0, kv0 if z0 is None else z0), q, k, v, bf16=True,
                           train=True)
    if phi is None or not fused.ready(q.dtype):
        return None
    refuse_forward_ad("gated_linear_attention", q, k, v, g, kv0, z0)
    # the kernel checks g's values as it reads them
    g = narrowed_gates(g, kv0.dtype, check_gate_values)
    o, kv, z = fused.chunked(q, k, v, g, kv0, z0, phi=phi, eps=float(eps), chunk=min(chunk_size, q.shape[2]),
                             cu_seqlens=cu_seqlens)
    if not all_finite(kv, *(() if z is None else (z,))):
        return None
    return o, ((kv, z) if normalize else kv)


def gated_linear_attention_step(
    state,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    *,
    feature_map=None,
    normalize: bool = False,
    eps: float = 1e-6,
    scale: float | None = None,
    inplace: bool = False,
):
    """Recurrent form: returns (o, new_state); `state` is not modified unless inplace.

        kv ← diag(e^{g}) kv + k̃ vᵀ,   (z ← e^{g} ⊙ z + k̃),   o = kvᵀ q̃  (/ (q̃ · z + ε))

    state: kv (B, H, F, E), or (kv, z) with normalize, or None to start from zeros. q, k: (B, H, T, D),
    v: (B, H, T, E), g: (B, H, T) or (B, H, T, F). T = 1 is the decoding fast path (on the CPU, with φ
    elu+1 or None, no scale and no gradient wanted: one fused operator); T > 1 (a short block) runs
    the chunked op from the state. inplace: the new state is written into `state` (given, no gradient
    wanted) and returned: no new state tensor per token (the fused step updates a contiguous state
    itself, linattn_cpu::gated_step_; other paths copy their result into it).
    """
    if inplace:
        stepcheck.check_inplace(state, q, k, v, g)
    if isinstance(q, torch.Tensor) and q.dim() == 4 and q.shape[2] != 1:
        o, new = gated_linear_attention(q, k, v, g, feature_map=feature_map, normalize=normalize, eps=eps,
                                        scale=scale, initial_state=state, return_state=True)
        return (o, stepcheck.write_into(state, new)) if inplace else (o, new)
    advance_schedule(feature_map)
    key = stepcheck.signature("gated_step", state, q, k, v, g, feature_map, scale, normalize, eps)
    if stepcheck.seen(key) and state is not None:  # checked once for this signature (linattn.ops.stepcheck)
        fz = make_featurizer(k, feature_map=feature_map, scale=scale, key_padding_mask=None, positions=None, rope=None)
        kv, z = state if normalize else (state, None)
    else:
        check_bool("normalize", normalize, error=TypeError)
        check_eps("eps", eps)
        fz, kv, z = _prepare(q, k, v, g, feature_map=feature_map, scale=scale, key_padding_mask=None, state=state,
                             normalize=normalize, name="state")
        stepcheck.remember(key)
    phi = native.fused_phi(feature_map, scale, None, (kv, kv if z is None else z), q, k, v)
    if g.dtype in (torch.bfloat16, torch.float16) and kv.dtype is torch.float32:
        g = g.to(kv.dtype)  # exact: a bf16 model's gates reach the fused step too
    if (phi is not None and g.dtype is kv.dtype and not (g.requires_grad and torch.is_grad_enabled())
            and not has_tangent(kv, z, q, k, v, g)):
        own = inplace and kv.is_contiguous() and (z is None or z.is_contiguous())
        o, kv, z = fused.step(kv, z, q, k, v, g, phi=phi, eps=float(eps), inplace=own)  # checks g's values itself
    else:
        check_gate_values(g)
        o, kv, z = step_from_features(kv, z, fz(q, 0, 1, True)[0], fz(k, 0, 1, False)[0], v, g, eps=float(eps),
                                      out_dtype=q.dtype)
    new = (kv, z) if normalize else kv
    return (o, stepcheck.write_into(state, new)) if inplace else (o, new)


def gated_affine_form(q, k, v, g, *, feature_map=None, normalize: bool = False, eps: float = 1e-6,
                      scale: float | None = None, chunk_size: int = DEFAULT_CHUNK_SIZE,
                      key_padding_mask: torch.Tensor | None = None) -> AffineForm:
    """`gated_linear_attention` on a span as an affine function of its initial state
    (`linattn.ops.affine`), per (batch, head), with b_t = Σ_{s≤t} g_s (masked keys' g taken as 0):

        q̄_t = e^{b_t} ⊙ φ(scale·q_t)        A = e^{b_n}: (B, H) for g (B, H, N), (B, H, F) for g (B, H, N, F)

    and o⁰, ΔS the outputs and final state of the op run from zeros, with normalize=False on the
    values [v | 1] when normalize (the normalizer z is the state's last column, the denominators
    o⁰'s). The b_t are summed in float64 (a float32 prefix sum over a long span would drift), so
    e^{b_t} has the rounding of one exponential. Arguments and checks as for gated_linear_attention;
    a position-dependent feature map (cosFormer) is refused: the op would give it the span's local
    positions. Gradients flow to q, k, v, g and φ's parameters through every term.
    """
    if getattr(feature_map, "needs_positions", False):
        raise ValueError(f"feature_map: a position-dependent map ({type(feature_map).__name__}) cannot run on a "
                         "span of a longer sequence (the gated operators take no positions)")
    check_bool("normalize", normalize, error=TypeError)
    check_eps("eps", eps)
    check_gated_arguments(q, k, v, g, feature_map=feature_map, scale=scale, key_padding_mask=key_padding_mask)
    values = torch.cat((v, v.new_ones(*v.shape[:-1], 1)), -1) if normalize else v
    out0, dS = gated_linear_attention(q, k, values, g, feature_map=feature_map, scale=scale, return_state=True,
                                      chunk_size=chunk_size, key_padding_mask=key_padding_mask)
    sdt = dS.dtype
    if key_padding_mask is not None:
        keep = key_padding_mask[:, None, :] if g.dim() == 3 else key_padding_mask[:, None, :, None]
        g = g.masked_fill(~keep, 0.0)
    b = g.to(torch.float64).cumsum(2).to(sdt)  # (B, H, n) or (B, H, n, F)
    decay = b.exp()
    fz = make_featurizer(k, feature_map=feature_map, scale=scale, key_padding_mask=None, positions=None, rope=None)
    qf = fz(q, 0, q.shape[2], True)[0].to(sdt)  # after the op: a random φ's ω as the op drew it
    query = qf * (decay[..., None] if g.dim() == 3 else decay)
    return AffineForm(out0, query, decay[:, :, -1], dS, normalize, float(eps))


def step_from_features(kv, z, qf, kf, v, g, *, eps: float, out_dtype):
    """One step in torch ops from the features qf, kf (B, H, 1, F): kv (B, H, F, E) and z (B, H, F) or
    None in the state dtype. Returns (o (B, H, 1, E) in out_dtype, kv', z' or None)."""
    b, h, feat, e = kv.shape
    sdt = kv.dtype
    qf, kf, v = qf.to(sdt), kf.to(sdt), v.to(sdt)
    decay = g.to(sdt).exp().reshape(b, h, -1)  # (B, H, 1 or F)
    kv_new = torch.addcmul(kv * decay[..., None], kf.mT, v)
    num = torch.bmm(qf.reshape(b * h, 1, feat), kv_new.reshape(b * h, feat, e))
    z_new = None
    if z is not None:
        z_new = torch.addcmul(kf.reshape(b, h, feat), z, decay)
        den = torch.bmm(qf.reshape(b * h, 1, feat), z_new.reshape(b * h, feat, 1))
        num = num / (den + eps)
    return num.view(b, h, 1, e).to(out_dtype), kv_new, z_new


def check_gated_arguments(q, k, v, g, *, feature_map, scale, key_padding_mask) -> int:
    """The checks of gated_linear_attention on q, k, v, g and the feature options (shapes, dtypes,
    devices; g's values are `check_gate_values`'s); returns the feature dim F."""
    feat = check_arguments(q, k, v, feature_map=feature_map, scale=scale, key_padding_mask=key_padding_mask,
                           initial_state=None, positions=None, rope=None)
    b, h, n, _ = q.shape
    if k.shape[2] != n:
        raise ValueError(f"causal gated linear attention needs q and k of equal length, got {n} and {k.shape[2]}")
    check_gate(g, b, h, n, feat, q.device)
    return feat


def _prepare(q, k, v, g, *, feature_map, scale, key_padding_mask, state, normalize: bool, name: str):
    """Checks every argument; returns (featurizer, kv0, z0): the given state, or zeros (z0 None
    without normalize)."""
    if state is not None and getattr(feature_map, "needs_positions", False):
        raise ValueError(f"the gated operators take no positions, so a position-dependent feature map "
                         f"({type(feature_map).__name__}) cannot continue from {name}")
    feat = check_gated_arguments(q, k, v, g, feature_map=feature_map, scale=scale, key_padding_mask=key_padding_mask)
    b, h, n, _ = q.shape
    e = v.shape[-1]
    fz = make_featurizer(k, feature_map=feature_map, scale=scale, key_padding_mask=key_padding_mask, positions=None,
                         rope=None)
    if state is None:
        sdt = state_dtype(q.dtype)
        kv0 = torch.zeros(b, h, feat, e, dtype=sdt, device=q.device)
        return fz, kv0, (torch.zeros(b, h, feat, dtype=sdt, device=q.device) if normalize else None)
    check_gated_state(state, normalize, b, h, feat, e, q.device, name)
    return (fz, *state) if normalize else (fz, state, None)
