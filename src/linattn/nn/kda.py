"""The `kda` attention kind: Kimi Delta Attention (Kimi Linear, Moonshot AI 2025; design §13.8), the
layer of transformers' `KimiLinearDeltaAttention` on linattn's recurrent-layer base.

Per head, with x (B, N, d) the layer's input, D the q/k head dim, E the value head dim:

    q, k, v   = SiLU(conv(W_qkv x))                 (short causal convolution, kernel 4 by default)
    g_t       = −e^{A_log_h} · softplus(F_b F_a x_t + dt_bias)   ∈ (−∞, 0]^D per head (rank-D F_a → F_b)
    β_t       = sigmoid(W_β x_t)
    S_t       = (I − β_t k̂_t k̂_tᵀ) Diag(e^{g_t}) S_{t−1} + β_t k̂_t v_tᵀ,   o_t = S_tᵀ q̂_t · D^{−1/2}
    y_t       = W_o [RMSNorm(o_t) ⊙ w ⊙ sigmoid(G_b G_a x_t)]   (rank-E output gate, per head)

q̂, k̂ L2-normalized inside the operator (linattn.ops.kda: the delta family with a per-channel g).
Initialization as Kimi Linear's (after Mamba2's): A = e^{A_log} ~ U[1, 16] per head, softplus(dt_bias)
log-uniform in [1e-3, 1e-1] per channel (at least 1e-4), through the inverse softplus. Decoding: the cache
holds S (B, H, D, E) in the state dtype and the convolution's tail; the delta family
(linattn.nn.families.DELTA) runs it with the per-channel g.
Padding: a masked token has k = 0 and g = 0 (the state stays as it was) and enters the convolution as zeros.
With output_gate=False the output skips the norm and gate (y = W_o o).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.kda import kda_gate
from ..ops.linear.chunked import state_dtype
from .base import column_major
from .decay import check_dt_init_range, mamba2_gate_init
from .families import DELTA, DeltaMix
from .norms import RMSNorm
from .recurrent import RecurrentAttention
from .linear import Linear

#: KDA's initial range of Δ = softplus(dt_bias), one draw per head and key channel: slower than
#: Mamba2's [0.001, 0.1] (Kimi Linear's and FLA's init), which `linattn eval --preset recall-init` measured
#: reaching 99% at MQAR (64, 16) on 5 of 5 seeds at 200 steps each, against 200–500 (mean 300) with
#: Mamba2's range (docs/results/recall-init; design §16.4). Pass dt_init_range=(0.001, 0.1) for theirs.
KDA_DT_INIT_RANGE = (0.0005, 0.002)


class KDAForgetGate(nn.Module):
    """g = −e^{A_log} · softplus(F_b F_a x + dt_bias) (linattn.ops.kda.kda_gate): F_a d -> rank,
    F_b rank -> H·D (no biases), A_log (H,), dt_bias (H·D,). forward(x (B, N, d)) -> g (B, H, N, D)
    in the state dtype."""

    def __init__(self, d_model: int, n_heads: int, key_dim: int, rank: int | None = None,
                 dt_init_range=KDA_DT_INIT_RANGE):
        super().__init__()
        self.n_heads, self.key_dim = n_heads, key_dim
        self.dt_init_range = check_dt_init_range(dt_init_range)
        rank = key_dim if rank is None else rank
        self.f_a = column_major(Linear(d_model, rank, bias=False))
        self.f_b = column_major(Linear(rank, n_heads * key_dim, bias=False))
        self.A_log = nn.Parameter(torch.empty(n_heads))
        self.dt_bias = nn.Parameter(torch.empty(n_heads * key_dim))
        self.init_parameters()

    @torch.no_grad()
    def init_parameters(self, generator: torch.Generator | None = None) -> None:
        """A_log and dt_bias drawn from `generator` (the projections are initialized by the model):
        Mamba2's ranges, one Δ per head and key channel (linattn.nn.decay.mamba2_gate_init)."""
        a_log, dt_bias = mamba2_gate_init(self.n_heads, self.dt_bias.shape, self.dt_init_range, generator)
        self.A_log.copy_(a_log)
        self.dt_bias.copy_(dt_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raw = self.f_b(self.f_a(x)).unflatten(-1, (self.n_heads, self.key_dim))  # (B, N, H, D)
        return kda_gate(raw, self.A_log, self.dt_bias).transpose(1, 2)

    #: the per-channel decay's code in the fused decoder's mixers (csrc/model_decay.h)
    native_code = 4

    def plan_step(self, plan, tensors: dict, floats: dict) -> None:
        """The fused step's gate (linattn.models.decoding): F_a x into a (B, rank) buffer in the
        current group (the layer's normalized input), then F_b of it (a group of its own) into
        decay_proj (B, H·D); the mixer computes g from it in float32 (csrc/model_decay.h).
        Leaves the plan in that group: the layer's products of x come first."""
        low = plan.project(self.f_a)
        plan.group(low, None)
        tensors.update(decay_proj=plan.project(self.f_b), A_log=self.A_log.detach(), dt_bias=self.dt_bias.detach())


class KDAOutputGate(nn.Module):
    """o_h ← RMSNorm(o_h) ⊙ sigmoid(G_b G_a x)_h with G_a d -> rank, G_b rank -> H·E (Kimi Linear's
    low-rank gate and sigmoid-gated RMSNorm; the norm's gain (E) is shared by the heads).
    forward(o (B, N, H, E), x (B, N, d)) -> (B, N, H, E)."""

    def __init__(self, d_model: int, n_heads: int, head_dim: int, eps: float = 1e-5, rank: int | None = None,
                 bias: bool = False):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, head_dim
        rank = head_dim if rank is None else rank
        self.norm = RMSNorm(head_dim, eps)
        self.g_a = column_major(Linear(d_model, rank, bias=False))
        self.g_b = column_major(Linear(rank, n_heads * head_dim, bias=bias))

    def forward(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        gate = torch.sigmoid(self.g_b(self.g_a(x))).unflatten(-1, (self.n_heads, self.head_dim))
        return self.norm(o) * gate


class KimiDeltaAttention(RecurrentAttention):
    """Kimi Delta Attention (module doc): the delta rule with a per-channel forget gate. Arguments as
    the other recurrent kinds' (linattn.nn.recurrent): short_conv 4 and output_gate on in the models'
    defaults; output_gate selects Kimi Linear's low-rank sigmoid gate with its RMSNorm."""

    kind = "kda"
    family = DELTA

    def __init__(self, d_model: int, n_heads: int, *, output_gate: bool = True, norm_eps: float = 1e-5,
                 bias: bool = False, dt_init_range=KDA_DT_INIT_RANGE, **kw):
        super().__init__(d_model, n_heads, output_gate=False, norm_eps=norm_eps, bias=bias, **kw)
        self.beta_proj = column_major(Linear(d_model, n_heads, bias=False))
        self.forget_gate = KDAForgetGate(d_model, n_heads, self.qk_dim, dt_init_range=dt_init_range)
        self.kda_gate = KDAOutputGate(d_model, n_heads, self.head_dim, norm_eps, bias=bias) if output_gate else None

    def mix(self, x, q, k, v, positions) -> DeltaMix:
        q, k = self.rotate(F.silu(q), F.silu(k), positions)
        beta = torch.sigmoid(self.beta_proj(x).to(state_dtype(x.dtype))).transpose(1, 2)  # β = 0 writes nothing
        return DeltaMix(q, k, F.silu(v), beta, self.forget_gate(x), scale=self.scale, chunk_size=self.chunk_size)

    def gate_output(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return o if self.kda_gate is None else self.kda_gate(o, x)

    def plan_mixer(self, plan, cache, tensors: dict, ints: dict, floats: dict) -> None:
        """The delta mixer's arguments: the state, β's product, the output gate's G_a product and
        norm (the products of the layer's normalized input first), then the low-rank second
        products (G_b, F_b: each a group of its own) and the per-channel decay (decay code 4)."""
        self.plan_state(plan, cache, tensors, ints, floats)
        tensors["beta"] = plan.project(self.beta_proj)
        gate_low = None if self.kda_gate is None else plan.project(self.kda_gate.g_a)
        ints["decay"] = self.forget_gate.native_code
        self.forget_gate.plan_step(plan, tensors, floats)  # F_a in x's group, then F_b in its own
        if gate_low is not None:
            plan.group(gate_low, None)
            tensors.update(gate=plan.project(self.kda_gate.g_b), gate_norm_weight=self.kda_gate.norm.weight.detach())
            floats["gate_norm_eps"] = float(self.kda_gate.norm.eps)
            ints["gate_norm_sigmoid"] = 1

    def step_obstacle(self) -> str | None:
        if self.kda_gate is not None and type(self.kda_gate.norm) is not RMSNorm:
            return "KDA's output gate norm takes the eager path"
        return super().step_obstacle()


__all__ = ["KDAForgetGate", "KDAOutputGate", "KimiDeltaAttention"]
