"""Feature maps φ for linear attention (design §5), one interface for all.

A feature map is an nn.Module built for a head dim D with a known output dim `feature_dim` (F):

    forward(x, *, is_query: bool, positions: Tensor | None = None) -> (…, N, F)

x: (…, N, D). `positions` ((N,) or (B, N) absolute token indices) is used by maps with
`needs_positions = True` (cosFormer). Randomness (FAVOR+, trigonometric features) lives in buffers,
saved with the model, drawn from a seed, redrawn only on request (`redraw()`) or every
`redraw_interval` training-mode operator calls (`advance_schedule()`, which the operators call once
per call), never in eval and never between a forward and its backward. `make_feature_map(name, head_dim, **options)` builds one by name
from the plain dict FEATURE_MAPS.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.features import elu_plus_one, elu_plus_one_derivative_, native_code

from .._checks import check_eps, check_positive_int
from .positional import broadcast_positions


class FeatureMap(nn.Module):
    """Base class: stores head_dim; subclasses set feature_dim and implement forward."""

    #: its name in tables and plots
    label = ""
    needs_positions = False
    #: φ treats queries and keys alike (is_query unused), so both can be featurized in one call.
    symmetric = False
    #: the code the fused C++ kernels know this φ by (csrc: 1 elu+1 … 7 Hedgehog; None: none). Read
    #: from the map's own class by `linattn.ops.features.native_code`, never inherited, so a subclass
    #: that changes φ is not taken for its parent.
    native_code: int | None = None
    #: the fused decoder computes these features in float32 whatever the model's dtype
    float32_features = False

    def native_tensors(self) -> dict:
        """The tensors the fused decoder reads besides the inputs ({"projection": W} for the maps
        with a projection)."""
        return {}

    def __init__(self, head_dim: int):
        super().__init__()
        check_positive_int("head_dim", head_dim)
        self.head_dim = head_dim
        self.feature_dim = head_dim

    def advance_schedule(self) -> None:
        """Counts one operator call; maps with a redraw schedule redraw here (training mode only).
        The operators call it once per call, never while recomputing features in a backward."""

    def _check(self, x: torch.Tensor) -> None:
        if x.shape[-1] != self.head_dim:
            raise ValueError(f"{type(self).__name__}(head_dim={self.head_dim}) got inputs of last dim {x.shape[-1]}")

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, feature_dim={self.feature_dim}"


class EluPlusOne(FeatureMap):
    """φ(x) = elu(x) + 1 (Katharopoulos et al. 2020). F = D; strictly positive."""

    label = "elu+1"
    native_code = 1
    symmetric = True
    #: φ'(x) from φ(x), in place (0 where φ(x) = 0, as for masked keys): lets the chunked backward
    #: chain gradients without autograd.
    derivative_from_output_ = staticmethod(elu_plus_one_derivative_)

    def forward(self, x, *, is_query: bool = True, positions=None):
        self._check(x)
        return elu_plus_one(x)


class ReLUFeatureMap(FeatureMap):
    """φ(x) = relu(x) + eps. F = D. With eps = 0 an all-negative key gives a zero row and a query
    orthogonal to all keys a zero denominator; the operator's ε then keeps the output finite (0)."""

    label = "relu"
    native_code = 2
    symmetric = True

    def __init__(self, head_dim: int, eps: float = 1e-6):
        super().__init__(head_dim)
        check_eps("eps", eps)
        self.eps = float(eps)

    def forward(self, x, *, is_query: bool = True, positions=None):
        self._check(x)
        f = F.relu(x)
        return f + self.eps if self.eps else f


def orthogonal_gaussian(m: int, d: int, *, orthogonal: bool, generator: torch.Generator) -> torch.Tensor:
    """ω: (m, d). Orthogonal: rows orthogonal within blocks of d (QR of a Gaussian d×d matrix), each
    row's norm drawn from chi(d) (the norm of a d-dim Gaussian), so every row is marginally N(0, I)
    (Performer, Choromanski et al. 2021, §4). Otherwise i.i.d. Gaussian rows."""
    if not orthogonal:
        return torch.randn(m, d, generator=generator, dtype=torch.float64)
    g = torch.randn(math.ceil(m / d), d, d, generator=generator, dtype=torch.float64)
    qmat, rmat = torch.linalg.qr(g)
    qmat = qmat * torch.sign(torch.diagonal(rmat, dim1=-2, dim2=-1)).unsqueeze(-2)  # Haar-uniform
    w = qmat.transpose(-1, -2).reshape(-1, d)[:m]
    norms = torch.randn(m, d, generator=generator, dtype=torch.float64).norm(dim=1)
    return w * norms[:, None]


class _RandomFeatures(FeatureMap):
    """Shared machinery for random-feature maps: ω buffer, seeded redraws, redraw schedule."""

    float32_features = True

    def native_tensors(self) -> dict:
        return {"projection": self.omega.detach()}

    def __init__(self, head_dim: int, num_features: int | None, orthogonal: bool, seed: int, redraw_interval: int | None):
        super().__init__(head_dim)
        m = head_dim if num_features is None else num_features
        check_positive_int("num_features", m)
        check_positive_int("redraw_interval", redraw_interval, allow_none=True)
        self.num_features = m
        self.orthogonal = orthogonal
        self.seed = int(seed)
        self.redraw_interval = redraw_interval
        self.register_buffer("omega", torch.empty(m, head_dim))
        self.register_buffer("draws", torch.zeros((), dtype=torch.long))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.redraw()

    @torch.no_grad()
    def redraw(self, generator: torch.Generator | None = None) -> None:
        """Draw a new ω. Without a generator the k-th draw (k = 0 at construction) uses seed + k, so
        runs are reproducible; `draws` counts them and is saved with the buffers."""
        if generator is None:
            generator = torch.Generator().manual_seed(self.seed + int(self.draws))
        w = orthogonal_gaussian(self.num_features, self.head_dim, orthogonal=self.orthogonal, generator=generator)
        self.omega.copy_(w.to(self.omega.dtype))
        self.draws += 1

    def advance_schedule(self) -> None:
        """In training mode, counts one call and redraws ω before every redraw_interval-th call."""
        if self.training and self.redraw_interval is not None:
            if int(self.calls) > 0 and int(self.calls) % self.redraw_interval == 0:
                self.redraw()
            self.calls += 1

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x scaled by D^(−1/4), in float32 at least: returns (x', ω x')."""
        self._check(x)
        dt = torch.float64 if x.dtype == torch.float64 else torch.float32
        xs = x.to(dt) * self.head_dim ** -0.25
        return xs, xs @ self.omega.to(dt).T

    def extra_repr(self) -> str:
        return (f"head_dim={self.head_dim}, num_features={self.num_features}, orthogonal={self.orthogonal}, "
                f"seed={self.seed}, redraw_interval={self.redraw_interval}")


class FavorPlus(_RandomFeatures):
    """FAVOR+ positive random features (Performer, Choromanski et al. 2021):

        φ(x) = exp(ω x − ‖x‖²/2) / √m,   x ← x·D^(−1/4),   E[φ(q)ᵀφ(k)] = exp(qᵀk/√D).

    F = m. Stabilization (stabilize=True), exact in normalized attention, with or without RoPE, and
    causal-safe: with h_i = ‖ω_i‖²/2 and P = ⌊m/2⌋, each feature i is multiplied by e^{+h'_i} on queries
    and e^{−h'_i} on keys, where h'_i is shared by the pair that RoPE rotates together (rotate-half:
    h'_i = h'_{i+P} = max(h_i, h_{i+P}) for i < P; an odd m's last feature keeps its own h). Per pair
    the two scalings are one scalar each, so they commute with RoPE's 2×2 rotations: the query and key
    scalings cancel in every product φ(q)ᵀ R φ(k) (a constant per feature would cancel only when
    feature i meets feature i, and RoPE mixes i with i+P). Taking the larger of the pair keeps a key's
    exponent −‖x−ω_i‖²/2 − (h'_i − h_i) ≤ 0, so keys cannot overflow, with no dependence on other tokens.
    Keys are then multiplied by the fixed constant e^{c}, c = min(30, mean_i h'_i), which brings typical
    keys back to O(1) so the denominators stay far above the operator's ε (a constant shared by all
    keys cancels in the ratio; keys stay ≤ e^30). Each query's exponents are shifted by their
    logsumexp, a per-query constant that also cancels and makes its features sum to 1; the 1/√m
    factors are dropped for the same reason. Only ε sees these constants. With normalize=False use
    stabilize=False. Computed in float32 (float64 for float64 inputs), returned in that dtype.
    """

    label = "FAVOR+"
    native_code = 3

    def __init__(self, head_dim: int, num_features: int | None = None, *, orthogonal: bool = True, seed: int = 0,
                 redraw_interval: int | None = None, stabilize: bool = True):
        super().__init__(head_dim, num_features, orthogonal, seed, redraw_interval)
        self.feature_dim = self.num_features
        self.stabilize = stabilize

    def _pair_shift(self, dtype: torch.dtype) -> torch.Tensor:
        """h'_i: ‖ω_i‖²/2, raised to the larger of the two in each RoPE pair (i, i+⌊m/2⌋). (m,)"""
        half = 0.5 * (self.omega.to(dtype) ** 2).sum(-1)
        p = self.num_features // 2
        top = torch.maximum(half[:p], half[p:2 * p])
        return torch.cat((top, top, half[2 * p:]))

    def forward(self, x, *, is_query: bool = True, positions=None):
        xs, wx = self._project(x)
        expo = wx - 0.5 * (xs * xs).sum(-1, keepdim=True)
        if self.stabilize:
            shift = self._pair_shift(wx.dtype)
            if is_query:
                expo = expo + shift
                return torch.exp(expo - torch.logsumexp(expo, dim=-1, keepdim=True).detach())
            return torch.exp(expo - shift + shift.mean().clamp(max=30.0))
        return torch.exp(expo) / math.sqrt(self.num_features)


class TrigRandomFeatures(_RandomFeatures):
    """Trigonometric random features (Performer's baseline, Rahimi & Recht 2007):

        φ(x) = exp(‖x‖²/2)/√m · [sin ωx, cos ωx],  x ← x·D^(−1/4),  E[φ(q)ᵀφ(k)] = exp(qᵀk/√D).

    F = 2m. Features can be negative, so denominators can be near zero or negative: that is the
    known weakness FAVOR+ fixes. With stabilize=True the query factor exp(‖q‖²/2), a per-query
    constant, is dropped (exact in normalized attention).
    """

    label = "trig RF"
    native_code = 4

    def __init__(self, head_dim: int, num_features: int | None = None, *, orthogonal: bool = True, seed: int = 0,
                 redraw_interval: int | None = None, stabilize: bool = True):
        super().__init__(head_dim, num_features, orthogonal, seed, redraw_interval)
        self.feature_dim = 2 * self.num_features
        self.stabilize = stabilize

    def forward(self, x, *, is_query: bool = True, positions=None):
        xs, wx = self._project(x)
        f = torch.cat((torch.sin(wx), torch.cos(wx)), dim=-1) / math.sqrt(self.num_features)
        if is_query and self.stabilize:
            return f
        return f * torch.exp(0.5 * (xs * xs).sum(-1, keepdim=True))


class CosFormer(FeatureMap):
    """cosFormer (Qin et al. 2022): relu features re-weighted by cos(π(i−j)/(2M)), split with
    cos(a−b) = cos a cos b + sin a sin b into

        φ(x_i) = [relu(x_i)·cos(πi/2M), relu(x_i)·sin(πi/2M)],   F = 2D,

    so φ(q_i)ᵀφ(k_j) = relu(q_i)ᵀrelu(k_j)·cos(π(i−j)/2M). M (max_len) is fixed in advance so causal,
    recurrent and sharded use agree; positions must lie in [0, M).
    """

    label = "cosFormer"
    native_code = 5

    needs_positions = True

    def __init__(self, head_dim: int, max_len: int = 2048):
        super().__init__(head_dim)
        check_positive_int("max_len", max_len)
        self.max_len = max_len
        self.feature_dim = 2 * head_dim

    def forward(self, x, *, is_query: bool = True, positions=None):
        self._check(x)
        if positions is None:
            positions = torch.arange(x.shape[-2], device=x.device)
        if positions.numel() and (int(positions.max()) >= self.max_len or int(positions.min()) < 0):
            raise ValueError(
                f"cosFormer positions must lie in [0, max_len={self.max_len}), got range "
                f"[{int(positions.min())}, {int(positions.max())}]"
            )
        dt = torch.float64 if x.dtype == torch.float64 else torch.float32
        ang = broadcast_positions(positions, x.dim()).to(dt) * (math.pi / (2 * self.max_len))
        r = F.relu(x)
        return torch.cat((r * torch.cos(ang).to(x.dtype), r * torch.sin(ang).to(x.dtype)), dim=-1)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, max_len={self.max_len}"


class Taylor(FeatureMap):
    """Second-order Taylor features (Based, Arora et al. 2024):

        φ(x) = [1, x/D^(1/4), vec(x xᵀ)/(√2·√D)],   φ(q)ᵀφ(k) = 1 + s + s²/2,  s = qᵀk/√D,

    the 2nd-order expansion of exp(s) (always positive: 1 + s + s²/2 > 0). F = 1 + D + D², so use a
    small q/k dim (16 gives F = 273).
    """

    label = "Taylor (Based)"
    native_code = 6

    symmetric = True

    def __init__(self, head_dim: int):
        super().__init__(head_dim)
        self.feature_dim = 1 + head_dim + head_dim * head_dim

    def forward(self, x, *, is_query: bool = True, positions=None):
        self._check(x)
        return _TaylorFunction.apply(x)


class _TaylorFunction(torch.autograd.Function):
    """φ(x) = [1, a·x, b·vec(x xᵀ)] with a = D^(-1/4), b = 1/√(2D), written into one (…, F) buffer.

    Backward, with g = [g0, g1, G2] split like φ and G2 viewed as (…, D, D):
        dx = a·g1 + b·(G2 + G2ᵀ) x,
    one batched matvec instead of autograd's full-size zero tensors for each slice of a cat."""

    @staticmethod
    def forward(ctx, x):
        d = x.shape[-1]
        out = x.new_empty(*x.shape[:-1], 1 + d + d * d)
        out[..., 0] = 1
        torch.mul(x, d ** -0.25, out=out[..., 1:1 + d])
        torch.mul(x.unsqueeze(-1), x.unsqueeze(-2), out=out[..., 1 + d:].unflatten(-1, (d, d)))
        out[..., 1 + d:] *= (2 * d) ** -0.5
        ctx.save_for_backward(x)
        return out

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        d = x.shape[-1]
        g2 = grad[..., 1 + d:].unflatten(-1, (d, d))
        sym = g2 + g2.transpose(-1, -2)
        dx = torch.matmul(sym, x.unsqueeze(-1)).squeeze(-1).mul_((2 * d) ** -0.5)
        return dx.add_(grad[..., 1:1 + d], alpha=d ** -0.25)


class Hedgehog(FeatureMap):
    """Hedgehog (Zhang et al. 2024): φ(x) = [softmax(Wx), softmax(−Wx)] with W (m×D) learned, F = 2m.

    W starts at the identity (m = D) or a scaled Gaussian; softmax over the feature axis makes the
    weights spiky like softmax attention's. Trained end to end (or by distillation) with the model.
    """

    label = "Hedgehog"
    native_code = 7

    def native_tensors(self) -> dict:
        return {"projection": self.weight.detach()}

    symmetric = True

    def __init__(self, head_dim: int, num_features: int | None = None, *, seed: int = 0):
        super().__init__(head_dim)
        m = head_dim if num_features is None else num_features
        check_positive_int("num_features", m)
        self.num_features = m
        self.feature_dim = 2 * m
        if m == head_dim:
            w = torch.eye(m)
        else:
            w = torch.randn(m, head_dim, generator=torch.Generator().manual_seed(seed)) / math.sqrt(head_dim)
        self.weight = nn.Parameter(w)

    def forward(self, x, *, is_query: bool = True, positions=None):
        self._check(x)
        y = x @ self.weight.to(x.dtype).T
        return torch.cat((torch.softmax(y, dim=-1), torch.softmax(-y, dim=-1)), dim=-1)


class T2R(FeatureMap):
    """T2R (Kasai et al. 2021, "Finetuning pretrained transformers into RNNs"): φ(x) = relu(W x + b)
    with W (m×D) and b (m) learned, m = 32 by default (the paper's k), F = m; one map for queries
    and keys. W starts as a seeded Gaussian scaled by D^−1/2, b at 0; the map is meant to be trained
    (by attention transfer and fine-tuning, linattn.linearize). A row whose features are all zero is
    kept finite by the operators' ε."""

    label = "T2R"
    symmetric = True

    def __init__(self, head_dim: int, num_features: int = 32, *, seed: int = 0):
        super().__init__(head_dim)
        check_positive_int("num_features", num_features)
        self.num_features = self.feature_dim = num_features
        w = torch.randn(num_features, head_dim, generator=torch.Generator().manual_seed(seed)) / math.sqrt(head_dim)
        self.weight = nn.Parameter(w)
        self.bias = nn.Parameter(torch.zeros(num_features))

    def forward(self, x, *, is_query: bool = True, positions=None):
        self._check(x)
        return F.relu(F.linear(x, self.weight.to(x.dtype), self.bias.to(x.dtype)))


def plan_feature_map(fm: nn.Module, plan, tensors: dict, ints: dict, floats: dict, prefix: str = "") -> bool:
    """φ's arguments of a fused decoder's mixer (csrc/model_features.h reads them), each name led by
    `prefix`: its code (`native_code`), feature dim, options, tensors (`native_tensors`) and whether its
    features are rounded to bf16 (a bf16 model's maps but those with float32 features), which it returns.
    The linear kind's φ (no prefix), LoLCATs' φ_q and φ_k ("q_", "k_")."""
    features_bf16 = plan.bf16 and not fm.float32_features
    ints.update({prefix + "feature_map": native_code(fm), prefix + "feature_dim": fm.feature_dim,
                 prefix + "features_bf16": int(features_bf16),
                 prefix + "stabilize": int(getattr(fm, "stabilize", False)),
                 prefix + "max_len": int(getattr(fm, "max_len", 0))})
    floats[prefix + "map_eps"] = float(getattr(fm, "eps", 0.0))
    tensors.update({prefix + name: t for name, t in fm.native_tensors().items()})
    return features_bf16


FEATURE_MAPS: dict[str, type[FeatureMap]] = {
    "elu": EluPlusOne,
    "relu": ReLUFeatureMap,
    "favor": FavorPlus,
    "trig": TrigRandomFeatures,
    "cosformer": CosFormer,
    "taylor": Taylor,
    "hedgehog": Hedgehog,
    "t2r": T2R,
}


def make_feature_map(name: str, head_dim: int, **options) -> FeatureMap:
    """Builds a feature map by name (a key of FEATURE_MAPS) with its options, e.g.
    make_feature_map("favor", 64, num_features=128, seed=0)."""
    if name not in FEATURE_MAPS:
        raise ValueError(f"unknown feature map {name!r}; choose one of {sorted(FEATURE_MAPS)}")
    try:
        return FEATURE_MAPS[name](head_dim, **options)
    except TypeError as exc:
        raise TypeError(f"bad options for feature map {name!r}: {exc}") from None
