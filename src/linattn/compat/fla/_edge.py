"""The edge between flash-linear-attention's conventions and linattn's operators (design §18), shared
by every family module of `linattn.compat.fla`.

FLA passes [B, T, H, D] (sequence before heads); linattn's operators take (B, H, N, D). Each tensor
crosses as `x.transpose(1, 2)`, a view (the fused kernels make their own contiguous copies where
they need them). Grouped value heads (GVA): v and the per-head gates may have HV = G·H heads; q/k
head h serves value heads h·G … h·G + G − 1, so q and k are repeated G times along the head axis
(`repeat_interleave(G, dim=2)`, as FLA's and transformers' references do). Recurrent states are
[N, HV, K, V] as in linattn ((B, H, F, E)); N is the batch, or the number of packed sequences with
cu_seqlens.

The edge checks only what is FLA's: the [B, T, H, D] layout (ranks, shapes of the tensors, states
and per-token gates as the caller passed them), grouped value heads, FLA's own arguments (scale's
default, the gates' A_log / dt_bias / g_gamma, β's logits, state_v_first, options linattn lacks)
and what it must know before it converts anything (a state it casts must be floating; K ≥ 1 for
the default scale; tensors with values). Dtypes, devices and values (β's range, a gate's sign,
cu_seqlens' contents, chunk sizes) are the operators' to check: their errors come through
unchanged, with a hint of the layout where they speak of a shape (`layout_hint`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import importlib.util
import math
import os
import warnings

import torch

from ...ops.linear.chunked import state_dtype

#: environment switch: "0" keeps every call on linattn's kernels, even on CUDA with `fla` installed
HANDOVER_ENV = "LINATTN_COMPAT_FLA"


@functools.lru_cache(maxsize=None)
def _importable(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def hands_over(module: str, name: str):
    """Decorator: a call whose first tensor is on CUDA, with `module`'s package importable and
    LINATTN_COMPAT_FLA not "0", goes to the peer's own `module.name` with the same arguments (FLA's
    Triton kernels, Dao's CUDA convolution); every other call runs the decorated body (linattn).
    The peer is imported only then, never by `import linattn.compat.fla`."""

    def decorate(fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            first = args[0] if args else next(iter(kwargs.values()), None)
            if (isinstance(first, torch.Tensor) and first.is_cuda and os.environ.get(HANDOVER_ENV, "1") != "0"
                    and _importable(module.split(".")[0])):
                return getattr(importlib.import_module(module), name)(*args, **kwargs)
            return fn(*args, **kwargs)

        call.peer = f"{module}.{name}"
        return call

    return decorate


def refuse(fn: str, **given) -> None:
    """ValueError naming every argument of `given` that holds something other than None / False:
    FLA options that linattn's operators do not implement."""
    bad = [f"{k}={v!r}" if not isinstance(v, torch.Tensor) else f"{k} (a tensor)"
           for k, v in given.items() if v is not None and v is not False]
    if bad:
        raise ValueError(f"linattn.compat.fla.{fn} does not support {', '.join(bad)} "
                         "(linattn's operators have no such option; leave it at its default)")


def take_kwargs(fn: str, kwargs: dict, allowed: tuple[str, ...]) -> dict:
    """The **kwargs FLA's `fn` accepts that linattn honours (`allowed`); TypeError naming the others
    (FLA ignores some silently; here nothing is ignored)."""
    if "head_first" in kwargs:
        raise ValueError(f"linattn.compat.fla.{fn}: head_first was removed from FLA; pass [B, T, H, ...] tensors")
    extra = sorted(set(kwargs) - set(allowed))
    if extra:
        raise TypeError(f"linattn.compat.fla.{fn} got unexpected keyword argument(s) that linattn does not "
                        f"support: {', '.join(extra)}")
    return {k: kwargs[k] for k in allowed if k in kwargs}


def state_layout_alias(state_v_first: bool, extra: dict) -> bool:
    """FLA's deprecated `transpose_state_layout` (= state_v_first), popped from the keyword arguments
    `extra`: a DeprecationWarning, as FLA gives, and a ValueError when both are set."""
    if "transpose_state_layout" not in extra:
        return state_v_first
    alias = extra.pop("transpose_state_layout")
    if state_v_first:
        raise ValueError("pass state_v_first or the deprecated transpose_state_layout, not both")
    warnings.warn("transpose_state_layout is deprecated (FLA renamed it state_v_first)", DeprecationWarning,
                  stacklevel=4)
    return bool(alias)


def beta_in(fn: str, beta, sigmoid: bool, allow_neg_eigval: bool):
    """β as the delta-family operators take it. use_beta_sigmoid_in_kernel: beta holds logits and β =
    sigmoid(beta), with allow_neg_eigval β = 2·sigmoid(beta) ∈ [0, 2] (negative eigenvalues of the
    transition, design §13.2); computed in float32 or wider, as FLA's fused_beta_sigmoid does.
    allow_neg_eigval without the sigmoid is refused as FLA refuses it."""
    check_bools(use_beta_sigmoid_in_kernel=sigmoid, allow_neg_eigval=allow_neg_eigval)
    if allow_neg_eigval and not sigmoid:
        raise ValueError(f"linattn.compat.fla.{fn}: allow_neg_eigval=True requires use_beta_sigmoid_in_kernel=True "
                         "(as in FLA; a β already in [0, 2] may be passed as it is)")
    if not sigmoid or not isinstance(beta, torch.Tensor):
        return beta
    beta = torch.sigmoid(beta.to(torch.promote_types(beta.dtype, torch.float32)))
    return 2 * beta if allow_neg_eigval else beta


def check_bools(**flags) -> None:
    """TypeError naming the first of FLA's switches (keyword: value) that is not a bool."""
    for name, flag in flags.items():
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")


def check_qkv(q, k, v) -> tuple[int, int]:
    """FLA's layout: q, k [B, T, H, K] of one shape, v [B, T, HV, V] with HV a multiple of H (grouped value
    heads), K and V ≥ 1 (the default scale divides by K), tensors with values (not on "meta": the
    operators read them). Dtypes and devices are the operators' to check. Returns (H, HV)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor [B, T, H, D], got {type(x).__name__}")
        if x.dim() != 4:
            raise ValueError(f"{name} must have 4 dimensions [B, T, H, D] (FLA's layout), got shape {tuple(x.shape)}")
        if x.device.type == "meta":
            raise ValueError(f"{name} is on the meta device: linattn's operators compute values; pass tensors on "
                             "the CPU or a GPU")
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape [B, T, H, K] = {tuple(q.shape)}, got {tuple(k.shape)}")
    if v.shape[:2] != q.shape[:2]:
        raise ValueError(f"v must have q's batch and length [B, T] = {tuple(q.shape[:2])}, got {tuple(v.shape[:2])}")
    if q.shape[3] < 1 or v.shape[3] < 1:
        raise ValueError(f"the head dim K must be ≥ 1 (q, k) and V ≥ 1 (v), got K = {q.shape[3]}, V = {v.shape[3]}")
    h, hv = q.shape[2], v.shape[2]
    if hv % h:
        raise ValueError(f"v's heads HV = {hv} must be a multiple of q/k's heads H = {h} (grouped value heads)")
    return h, hv


def common_dtype(*items) -> torch.dtype:
    """The dtype mixed inputs run in: torch's promotion of theirs (tensors or dtypes; q/k float32 with
    v float16: float32)."""
    return functools.reduce(torch.promote_types, (x if isinstance(x, torch.dtype) else x.dtype for x in items))


def in_common_dtype(q, k, v) -> tuple:
    """q, k, v of mixed floating dtypes in their promotion (`common_dtype`), as FLA runs them (and as the
    edge scales q: a TypeError names a non-floating one, which the cast would hide from the operator)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not x.is_floating_point():
            raise TypeError(f"{name} must be a floating tensor, got dtype {x.dtype}")
    cdt = common_dtype(q, k, v)
    return q.to(cdt), k.to(cdt), v.to(cdt)


def fla_output_dtype(q, v, recurrent: bool) -> torch.dtype:
    """The dtype of o where q and v differ, as FLA's kernels write it: its chunk kernels allocate o
    like v (`torch.empty_like(v)`), its fused_recurrent kernels return o in q's dtype."""
    return q.dtype if recurrent else v.dtype


def check_per_head(name: str, x, q, hv: int, last: int | None = None) -> None:
    """A per-token tensor of v's heads in FLA's layout: [B, T, HV] (last None) or [B, T, HV, last] (its
    dtype and device are the operator's to check)."""
    shape = (*q.shape[:2], hv) + (() if last is None else (last,))
    form = "[B, T, HV]" if last is None else "[B, T, HV, K]"
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {form}, got {type(x).__name__}")
    if tuple(x.shape) != shape:
        raise ValueError(f"{name} must have shape {form} = {shape}, got {tuple(x.shape)}")


def check_head_vector(name: str, x, q, hv: int) -> None:
    """A per-head parameter [HV] (g_gamma, A_log, dt_bias: FLA's, the operators never see them): floating,
    on q's device."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor [HV], got {type(x).__name__}")
    if x.numel() != hv or x.dim() != 1:
        raise ValueError(f"{name} must have shape [HV] = ({hv},), got {tuple(x.shape)}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating tensor, got dtype {x.dtype}")
    if x.device != q.device:
        raise ValueError(f"{name} must be on q's device ({q.device}), got {x.device}")


@contextlib.contextmanager
def layout_hint():
    """Around a call of linattn's operators: an error of theirs that speaks of a shape gets a hint of the
    layout it speaks in (same type, same message first, the original chained)."""
    try:
        yield
    except (ValueError, TypeError) as exc:
        if "shape" not in str(exc) and "(B, H" not in str(exc):
            raise
        raise type(exc)(f"{exc} (linattn.compat.fla hands linattn's operator your [B, T, H, D] tensors as "
                        "(B, H, T, D), its (B, H, N, D))") from exc


def resolve_scale(scale, k) -> float:
    """FLA's default scale K^−1/2 (K = k's head dim), else the given finite real number."""
    if scale is None:
        return k.shape[-1] ** -0.5
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite (FLA multiplies q by it), got {scale}")
    return float(scale)


def expand_heads(q, k, hv: int):
    """q, k [B, T, H, K] -> [B, T, HV, K]: head h serves value heads h·G … h·G + G − 1 (a copy when
    G > 1; q and k themselves when G = 1)."""
    g = hv // q.shape[2]
    if g == 1:
        return q, k
    return q.repeat_interleave(g, dim=2), k.repeat_interleave(g, dim=2)


def heads_first(x):
    """[B, T, H, ...] -> (B, H, T, ...) as a view (None stays None)."""
    return None if x is None else x.transpose(1, 2)


def state_count(q, cu_seqlens) -> int:
    """N, the leading dim of the states: the batch, or the number of packed sequences (cu_seqlens a
    tensor [N+1], as FLA takes it; its values are the operators' to check)."""
    if cu_seqlens is None:
        return q.shape[0]
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor [N+1] (a LongTensor, as FLA takes it), got "
                        f"{type(cu_seqlens).__name__}")
    return int(cu_seqlens.numel()) - 1


def state_in(name: str, state, q, n: int, hv: int, k_dim: int, v_dim: int, v_first: bool = False):
    """A recurrent state [N, HV, K, V] ([N, HV, V, K] with v_first) as the operator takes it: (N, HV,
    K, V) in the state dtype (float32; float64 for float64 inputs), a view where the dtype already
    fits (its device is the operator's to check). None stays None."""
    if state is None:
        return None
    if not isinstance(state, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor [N, HV, K, V], got {type(state).__name__}")
    want = (n, hv, v_dim, k_dim) if v_first else (n, hv, k_dim, v_dim)
    if tuple(state.shape) != want:
        form = "[N, HV, V, K] (state_v_first)" if v_first else "[N, HV, K, V]"
        raise ValueError(f"{name} must have shape {form} = {want} (N: the batch, or the number of sequences "
                         f"in cu_seqlens), got {tuple(state.shape)}")
    if not state.is_floating_point():  # cast below: an integer state would pass silently
        raise TypeError(f"{name} must be a floating tensor, got dtype {state.dtype}")
    state = state.transpose(-1, -2) if v_first else state
    return state.to(state_dtype(q.dtype))


def state_out(state, wanted: bool, v_first: bool = False):
    """The operator's final state (N, HV, K, V) as FLA returns it: None unless output_final_state,
    transposed (a view) with state_v_first."""
    if not wanted:
        return None
    return state.transpose(-1, -2) if v_first else state


def packed(cu_seqlens) -> dict:
    """The operators' keyword for packed sequences, only when there are some (linattn.ops.packed)."""
    return {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens}


@dataclasses.dataclass
class Inputs:
    """One call's q, k [B, T, H, K] and v [B, T, HV, V], checked in FLA's layout and cast to their common
    dtype (`fla_inputs`), with what every family derives from them: HV, the states' N, o's dtype."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    hv: int
    out_dtype: torch.dtype
    cu_seqlens: torch.Tensor | None

    @property
    def n(self) -> int:
        """N, the leading dim of the states (`state_count`)."""
        return state_count(self.q, self.cu_seqlens)

    def state(self, initial_state, v_first: bool = False):
        """initial_state [N, HV, K, V] ([N, HV, V, K] with v_first) as the operator takes it (`state_in`)."""
        return state_in("initial_state", initial_state, self.q, self.n, self.hv, self.q.shape[-1], self.v.shape[-1],
                        v_first)

    def heads_first(self) -> tuple:
        """(q, k, v) as the operators take them, (B, HV, T, D): q and k repeated for grouped value heads
        (`expand_heads`), views otherwise."""
        q, k = expand_heads(self.q, self.k, self.hv)
        return heads_first(q), heads_first(k), heads_first(self.v)

    def scale(self, scale) -> float:
        """FLA's scale, K^−1/2 by default (`resolve_scale`)."""
        return resolve_scale(scale, self.k)

    def output(self, o):
        """The operator's o (B, HV, T, V) as FLA returns it: [B, T, HV, V] in `out_dtype`."""
        return heads_first(o).to(self.out_dtype)


def fla_inputs(q, k, v, cu_seqlens, *, o_like_q: bool, **flags) -> Inputs:
    """What every family checks first, in this order: FLA's layout (`check_qkv`), o's dtype (q's where
    o_like_q, else v's: `fla_output_dtype`), q, k, v in their common dtype (`in_common_dtype`), then the
    bool switches `flags` (name: value, `check_bools`)."""
    _, hv = check_qkv(q, k, v)
    out_dtype = fla_output_dtype(q, v, o_like_q)
    q, k, v = in_common_dtype(q, k, v)
    check_bools(**flags)
    return Inputs(q, k, v, hv, out_dtype, cu_seqlens)
