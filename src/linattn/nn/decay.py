"""The log-decays g ≤ 0 of the gated attention kinds (design §8, §12), computed from a layer's input
x (B, N, d) for every head and token. The state of a gated layer evolves as S_t = diag(e^{g_t}) S_{t−1}
+ …, so e^{g_t} ∈ (0, 1] is how much of the memory survives token t.

    FixedDecay    RetNet (Sun et al. 2023, §2.2): one constant per head, γ_h = 1 − 2^{−5−h}, g = log γ_h.
    ScalarDecay   Mamba2 (Dao & Gu 2024): g = −exp(A_log_h) · softplus(W_α x + dt_bias_h), one scalar
                  per head and token; Gated DeltaNet (Yang et al. 2024b) uses the same form.
    FeatureDecay  GLA (Yang et al. 2023, §4.4): g = logsigmoid(W₂ W₁ x + b) / τ, one value per head,
                  token and key feature, from a rank-16 projection, τ = 16.

Each returns g in the state dtype (float32, float64 for float64 inputs): (B, H, N), or (B, H, N, F)
for FeatureDecay.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .._checks import check_number, check_positive_int
from ..ops.delta.gate import mamba2_gate
from ..ops.linear.chunked import state_dtype
from .linear import Linear

#: Mamba2's initial ranges (mamba_ssm defaults, also Gated DeltaNet's): A ∈ [1, 16], Δ ∈ [0.001, 0.1].
A_INIT_RANGE = (1.0, 16.0)
DT_INIT_RANGE = (0.001, 0.1)
DT_INIT_FLOOR = 1e-4
#: GLA's gate: rank of W₂W₁ and the temperature τ (Yang et al. 2023, §4.4).
GLA_GATE_RANK = 16
GLA_GATE_TEMPERATURE = 16.0


def check_dt_init_range(dt_init_range) -> tuple[float, float]:
    """(lo, hi) with 0 < lo ≤ hi, finite: the range Δ = softplus(dt_bias) is drawn from at init."""
    try:
        lo, hi = (float(x) for x in dt_init_range)
    except (TypeError, ValueError):
        raise ValueError(f"dt_init_range must be two numbers (lo, hi), got {dt_init_range!r}") from None
    if not (math.isfinite(lo) and math.isfinite(hi) and 0 < lo <= hi):
        raise ValueError(f"dt_init_range must satisfy 0 < lo <= hi (finite), got {dt_init_range!r}")
    return lo, hi


def mamba2_gate_init(n_heads: int, dt_shape, dt_init_range=DT_INIT_RANGE,
                     generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(A_log (n_heads,), dt_bias dt_shape), float64, Mamba2's initialization: A ~ U[A_INIT_RANGE],
    Δ = softplus(dt_bias) log-uniform in dt_init_range (at least DT_INIT_FLOOR). ScalarDecay draws one Δ
    per head, KDA's forget gate one per head and key channel."""
    lo, hi = A_INIT_RANGE
    dt_lo, dt_hi = check_dt_init_range(dt_init_range)
    a = torch.rand(n_heads, generator=generator, dtype=torch.float64) * (hi - lo) + lo
    u = torch.rand(dt_shape, generator=generator, dtype=torch.float64)
    dt = torch.exp(u * (math.log(dt_hi) - math.log(dt_lo)) + math.log(dt_lo)).clamp_min(DT_INIT_FLOOR)
    return a.log(), dt + torch.log(-torch.expm1(-dt))  # softplus⁻¹(Δ)


def retnet_log_decays(n_heads: int) -> torch.Tensor:
    """log γ_h, γ_h = 1 − 2^{−5−h} for h = 0 … H−1 (RetNet's multi-scale decay), float64 (H,)."""
    h = torch.arange(n_heads, dtype=torch.float64)
    return torch.log1p(-torch.pow(2.0, -5.0 - h))


#: the fused decoder's code of the key decay (csrc/model_decay.h): g = logsigmoid(k) / τ per key channel from
#: the layer's own k before RoPE (Liger, τ = 16; HGRN2, τ = 1), a decay with no module of its own
KEY_DECAY_CODE = 5


def plan_key_decay(ints: dict, floats: dict, temperature: float) -> None:
    """The key decay g = logsigmoid(k) / temperature in a fused decoder's mixer call (KEY_DECAY_CODE)."""
    ints["decay"] = KEY_DECAY_CODE
    floats["temperature"] = float(temperature)


def plan_decay(decay: nn.Module | None, plan, tensors: dict, ints: dict, floats: dict) -> None:
    """A recurrent layer's decay in the fused decoder's mixer call (csrc/model_mixers.h): its code
    (`native_code`: 1 fixed, 2 scalar, 3 per feature; none given: no decay) and its tensors, the
    products of its projections added to `plan` (linattn.models.decoding.FusedDecoder)."""
    if decay is not None:
        ints["decay"] = decay.native_code
        decay.plan_step(plan, tensors, floats)


class FixedDecay(nn.Module):
    """RetNet's decay: g_h = log(1 − 2^{−5−h}), the same at every token. No parameters: the values
    follow from H (computed in float64, rounded once to the state dtype and kept per dtype and
    device), so they are neither saved nor rounded twice by a change of the model's dtype.
    forward(x (B, N, d)) -> (B, H, N)."""

    native_code = 1

    def __init__(self, n_heads: int):
        super().__init__()
        check_positive_int("n_heads", n_heads)
        self.n_heads = n_heads
        self._values: dict = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        key = (state_dtype(x.dtype), x.device)
        if key not in self._values:
            self._values[key] = retnet_log_decays(self.n_heads).to(dtype=key[0], device=key[1])
        return self._values[key][None, :, None].expand(b, self.n_heads, n)

    def plan_step(self, plan, tensors: dict, floats: dict) -> None:
        tensors["log_decay"] = self(torch.zeros(1, 1, 1, dtype=plan.dtype))[0, :, 0].float()

    def extra_repr(self) -> str:
        return f"n_heads={self.n_heads}"


class ScalarDecay(nn.Module):
    """A data-dependent scalar decay per head and token, Mamba2's parametrization:

        g_{h,t} = −exp(A_log_h) · softplus(W_α x_t + dt_bias_h)          (≤ 0 for every x)

    W_α: d -> H; A_log, dt_bias: (H,); the gate is linattn.ops.delta.gate.mamba2_gate, computed in the
    state dtype. Initialized as in Mamba2 (mamba2_gate_init): A = exp(A_log) ~
    U[1, 16], Δ = softplus(dt_bias) log-uniform in dt_init_range (default [0.001, 0.1], at least 1e-4).
    forward(x (B, N, d)) -> (B, H, N).
    """

    native_code = 2

    def __init__(self, d_model: int, n_heads: int, dt_init_range=DT_INIT_RANGE):
        super().__init__()
        self.n_heads = n_heads
        self.dt_init_range = check_dt_init_range(dt_init_range)
        self.proj = Linear(d_model, n_heads, bias=False)
        self.A_log = nn.Parameter(torch.empty(n_heads))
        self.dt_bias = nn.Parameter(torch.empty(n_heads))
        self.init_parameters()

    @torch.no_grad()
    def init_parameters(self, generator: torch.Generator | None = None) -> None:
        """A_log and dt_bias drawn from `generator` (the projection is initialized by the model)."""
        a_log, dt_bias = mamba2_gate_init(self.n_heads, self.n_heads, self.dt_init_range, generator)
        self.A_log.copy_(a_log)
        self.dt_bias.copy_(dt_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return mamba2_gate(self.proj(x), self.A_log, self.dt_bias).transpose(1, 2)  # (B, N, H) -> (B, H, N)

    def plan_step(self, plan, tensors: dict, floats: dict) -> None:
        tensors.update(decay_proj=plan.project(self.proj), A_log=self.A_log.detach(), dt_bias=self.dt_bias.detach())


class FeatureDecay(nn.Module):
    """GLA's data-dependent decay, one value per head, token and key feature:

        g_t = logsigmoid(W₂ W₁ x_t + b) / τ          (≤ 0 for every x; α_t = e^{g_t} = sigmoid(·)^{1/τ})

    W₁: d -> rank (no bias), W₂: rank -> H·F with bias b; rank 16 and τ = 16 by default, as in the
    GLA paper. A larger τ keeps the decay closer to 1 (a longer memory). forward(x (B, N, d)) ->
    (B, H, N, F).
    """

    native_code = 3

    def __init__(self, d_model: int, n_heads: int, key_dim: int, rank: int = GLA_GATE_RANK,
                 temperature: float = GLA_GATE_TEMPERATURE):
        super().__init__()
        check_positive_int("rank", rank)
        check_number("temperature", temperature, minimum=0, low_open=True)
        self.n_heads, self.key_dim, self.temperature = n_heads, key_dim, float(temperature)
        self.down = Linear(d_model, rank, bias=False)
        self.up = Linear(rank, n_heads * key_dim, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.up(self.down(x)).to(state_dtype(x.dtype))
        g = F.logsigmoid(a) / self.temperature  # (B, N, H·F)
        return g.unflatten(-1, (self.n_heads, self.key_dim)).transpose(1, 2)

    def plan_step(self, plan, tensors: dict, floats: dict) -> None:
        tensors.update(decay_down=plan.project(self.down), decay_up_weight=self.up.weight.detach(),
                       decay_up_bias=self.up.bias.detach())
        floats["temperature"] = self.temperature

    def extra_repr(self) -> str:
        return f"n_heads={self.n_heads}, key_dim={self.key_dim}, temperature={self.temperature:g}"


__all__ = ["KEY_DECAY_CODE", "FeatureDecay", "FixedDecay", "ScalarDecay", "plan_decay", "plan_key_decay",
           "retnet_log_decays"]
