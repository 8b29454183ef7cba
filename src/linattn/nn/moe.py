"""The mixture-of-experts feed-forward of Qwen3-Next, Qwen3.5-MoE and Kimi Linear (design §22), in
the block's FFN place (ModelConfig.moe):

    p = softmax(W_r x)                        (float32, over the E experts)
    T = the top_k experts of p;  w_e = p_e (/ Σ_{e∈T} p_e with norm_topk_prob), in x's dtype
    y = Σ_{e∈T} w_e · W_down,e (silu(W_gate,e x) ⊙ W_up,e x)  +  sigmoid(w_s · x) · SwiGLU_shared(x)

router "sigmoid" (Kimi Linear's and DeepSeek-V3's grouped router with a score-correction bias b (E),
a buffer; transformers' KimiLinearTopkRouter, step for step):

    p = sigmoid(W_r x) (float32);  s = p + b             (s chooses, p weighs)
    the E experts in n_group groups of E / n_group; a group's score: the sum of its two largest s
    the topk_group best groups kept, s = −∞ elsewhere;  T = the top_k experts of s
    w_e = p_e (/ (Σ_{e∈T} p_e + 1e-20) with norm_topk_prob) · routed_scaling_factor

shared_gate False: the shared expert is added ungated (Kimi Linear's shared_experts, width
moe_intermediate_size · n_shared_experts).

W_r (E, d) the router; the experts' weights stacked as gate_up (E, 2F, d) ([gate; up] rows, F =
d_expert) and down (E, d, F) — transformers' own layout, so converted weights are shared; the
shared expert a SwiGLU FeedForward of width shared_d_ff with its scalar sigmoid gate w_s (d),
absent when shared_d_ff is 0. Ties in top-k are broken as torch.topk breaks them (the lower index
first, on the CPU), as transformers does. Each expert runs on the tokens routed to it only.
forward(x (…, d)) -> (…, d); route(x) -> (indices (T, top_k), weights (T, top_k)) of the flattened tokens.
No load-balancing loss: this module computes the forward a trained model needs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .._checks import check_bool, check_int, check_number, check_positive_int
from .base import column_major
from .linear import Linear, linear

#: the keys of ModelConfig.moe
MOE_KEYS = ("num_experts", "top_k", "d_expert", "shared_d_ff", "norm_topk_prob", "layers")
#: the routers of MoEFeedForward: Qwen's softmax, Kimi Linear's grouped sigmoid with a score bias
ROUTERS = ("softmax", "sigmoid")
#: the optional keys of ModelConfig.moe and their defaults (Qwen's router)
MOE_DEFAULTS = {"router": "softmax", "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0, "shared_gate": True}


def check_moe(moe: dict, n_layers: int) -> None:
    """ModelConfig.moe: {} (no MoE) or every key of MOE_KEYS: num_experts E ≥ 1, 1 ≤ top_k ≤ E,
    d_expert ≥ 1, shared_d_ff ≥ 0 (0: no shared expert), norm_topk_prob a bool, layers None (every
    layer) or the indices of the MoE layers (the others keep the dense FFN); optionally (MOE_DEFAULTS)
    router in ROUTERS, n_group dividing E (groups of at least 2 experts when > 1), 1 ≤ topk_group ≤
    n_group, routed_scaling_factor > 0 and shared_gate a bool; the grouping and scaling are the
    sigmoid router's only."""
    if not isinstance(moe, dict):
        raise ValueError(f"moe must be a dict (empty: no mixture of experts), got {type(moe).__name__}")
    if not moe:
        return
    unknown, missing = sorted(set(moe) - set(MOE_KEYS) - set(MOE_DEFAULTS)), sorted(set(MOE_KEYS) - set(moe))
    if unknown or missing:
        raise ValueError(f"moe: unknown keys {unknown}, missing keys {missing} (it takes {', '.join(MOE_KEYS)}; "
                         f"optionally {', '.join(MOE_DEFAULTS)})")
    check_positive_int("moe['num_experts']", moe["num_experts"])
    check_int("moe['top_k']", moe["top_k"], minimum=1)
    if moe["top_k"] > moe["num_experts"]:
        raise ValueError(f"moe['top_k']={moe['top_k']} exceeds moe['num_experts']={moe['num_experts']}")
    check_positive_int("moe['d_expert']", moe["d_expert"])
    check_int("moe['shared_d_ff']", moe["shared_d_ff"], minimum=0)
    check_bool("moe['norm_topk_prob']", moe["norm_topk_prob"])
    layers = moe["layers"]
    if layers is not None:
        if not isinstance(layers, list) or any(not isinstance(i, int) or not 0 <= i < n_layers for i in layers):
            raise ValueError(f"moe['layers'] must be None or a list of layer indices in [0, {n_layers}), "
                             f"got {layers!r}")
    _check_router({**MOE_DEFAULTS, **moe})


def _check_router(moe: dict) -> None:
    """The router keys of a complete ModelConfig.moe (check_moe)."""
    router, e, groups = moe["router"], moe["num_experts"], moe["n_group"]
    if router not in ROUTERS:
        raise ValueError(f"moe['router'] must be one of {ROUTERS}, got {router!r}")
    check_positive_int("moe['n_group']", groups)
    check_int("moe['topk_group']", moe["topk_group"], minimum=1)
    check_number("moe['routed_scaling_factor']", moe["routed_scaling_factor"], minimum=0, low_open=True)
    check_bool("moe['shared_gate']", moe["shared_gate"])
    if e % groups or (groups > 1 and e // groups < 2):
        raise ValueError(f"moe['n_group']={groups} must divide moe['num_experts']={e} into groups of at least 2 "
                         "experts (a group's score is its two best)")
    if moe["topk_group"] > groups:
        raise ValueError(f"moe['topk_group']={moe['topk_group']} exceeds moe['n_group']={groups}")
    if router == "softmax" and (groups != 1 or moe["topk_group"] != 1 or moe["routed_scaling_factor"] != 1.0):
        raise ValueError("moe: n_group, topk_group and routed_scaling_factor are the sigmoid router's "
                         "(router='sigmoid'); the softmax router takes the defaults")


class MoEFeedForward(nn.Module):
    """The routed experts and the gated shared expert (module docstring)."""

    def __init__(self, d_model: int, num_experts: int, top_k: int, d_expert: int, shared: nn.Module | None = None,
                 norm_topk_prob: bool = True, *, router: str = "softmax", n_group: int = 1, topk_group: int = 1,
                 routed_scaling_factor: float = 1.0, shared_gate: bool = True):
        """shared: the shared expert (a SwiGLU FeedForward of linattn.nn.blocks, which builds this module),
        None: none; router, n_group, topk_group, routed_scaling_factor, shared_gate: module docstring
        (checked by check_moe)."""
        super().__init__()
        _check_router(dict(router=router, num_experts=num_experts, n_group=n_group, topk_group=topk_group,
                           routed_scaling_factor=routed_scaling_factor, shared_gate=shared_gate))
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, bool(norm_topk_prob)
        self.router_kind, self.n_group, self.topk_group = router, n_group, topk_group
        self.routed_scaling_factor = float(routed_scaling_factor)
        self.router = Linear(d_model, num_experts, bias=False)
        #: the sigmoid router's score-correction bias b (E) (transformers' e_score_correction_bias)
        self.score_bias = nn.Buffer(torch.zeros(num_experts)) if router == "sigmoid" else None
        self.gate_up = nn.Parameter(torch.empty(num_experts, 2 * d_expert, d_model))
        self.down = nn.Parameter(torch.empty(num_experts, d_model, d_expert))
        self.shared = shared
        gated = shared is not None and shared_gate
        self.shared_gate = column_major(Linear(d_model, 1, bias=False)) if gated else None
        self.init_parameters()

    @torch.no_grad()
    def init_parameters(self, generator: torch.Generator | None = None) -> None:
        """The experts' weights ~ N(0, 0.02) (the model initializes the router and the shared expert)."""
        for p in (self.gate_up, self.down):
            p.copy_(torch.randn(p.shape, generator=generator) * 0.02)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(indices (T, top_k), weights (T, top_k) in x's dtype) of the tokens x (T, d)."""
        if self.router_kind == "sigmoid":
            return self._route_sigmoid(x)
        probs = torch.softmax(self.router(x), dim=-1, dtype=torch.float32)
        weights, indices = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return indices, weights.to(x.dtype)

    def _route_sigmoid(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The grouped sigmoid router (module docstring), in float32: p = sigmoid(W_r x), s = p + b
        (T, E) choose by groups (T, G, E/G) then experts; the weights are p's."""
        probs = torch.sigmoid(F.linear(x.float(), self.router.weight.float()))
        choice = probs + self.score_bias.float()
        if self.n_group > 1:
            groups = choice.view(-1, self.n_group, self.num_experts // self.n_group)
            best = torch.topk(groups.topk(2, dim=-1)[0].sum(dim=-1), self.topk_group, dim=-1, sorted=False)[1]
            keep = torch.zeros_like(groups[..., 0], dtype=torch.bool).scatter_(1, best, True)
            choice = groups.masked_fill(~keep[..., None], float("-inf")).flatten(1)
        indices = torch.topk(choice, self.top_k, dim=-1, sorted=False)[1]
        weights = probs.gather(1, indices)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return indices, (weights * self.routed_scaling_factor).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        indices, weights = self.route(x)
        y = torch.zeros_like(x)
        for e in indices.unique().tolist():
            token, slot = torch.where(indices == e)
            gate, up = linear(x[token], self.gate_up[e]).chunk(2, dim=-1)
            h = linear(F.silu(gate) * up, self.down[e]) * weights[token, slot, None]
            y = y.index_add(0, token, h)
        if self.shared_gate is not None:
            y = y + torch.sigmoid(self.shared_gate(x)) * self.shared(x)
        elif self.shared is not None:
            y = y + self.shared(x)
        return y.reshape(shape)

    def plan_step(self, plan, norm: nn.Module | None, out: torch.Tensor, residual: bool = True) -> None:
        """out ← out + MoE(norm(x)) (residual) or out ← MoE(norm(x)) for one token, added to `plan`
        (a fused decoder being built, linattn.models.decoding): a group of the router's product (and
        the shared expert's gate and SwiGLU up products, then its down product), then the plan's MoE
        op (csrc/model_moe.h: softmax or the grouped sigmoid router, top-k, the k experts' SwiGLU
        products summed with their weights, the shared expert added, gated or not); out a (B, d)
        float32 buffer of the plan (x itself: residual)."""
        plan.group(plan.x, norm)
        logits = plan.buffer(self.num_experts)
        sigmoid = self.router_kind == "sigmoid"  # its logits in float32 (unrounded in a bf16 model)
        plan.product(self.router, logits, "float" if sigmoid else "store")
        t = {"input": plan.x, "logits": logits, "out": out, "hidden": plan.buffer(self.top_k * self.down.shape[-1]),
             "gate_up": self.gate_up.detach().contiguous(), "down": self.down.detach().contiguous()}
        i = {"top_k": self.top_k, "norm_topk_prob": int(self.norm_topk_prob), "residual": int(residual),
             "router": int(sigmoid)}
        f = {}
        if sigmoid:
            t["score_bias"] = self.score_bias.detach()
            i.update(n_group=self.n_group, topk_group=self.topk_group)
            f["routed_scaling_factor"] = self.routed_scaling_factor
        if self.shared is not None:
            if self.shared_gate is not None:
                t["shared_gate"] = plan.project(self.shared_gate)
            h = plan.buffer(self.shared.down.in_features)
            plan.product(self.shared.up, h, "swiglu")
            plan.group(h, None)
            t["shared_out"] = plan.project(self.shared.down)
        plan.moe(t, norm, i, f)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, top_k={self.top_k}, d_expert={self.down.shape[-1]}, "
                f"norm_topk_prob={self.norm_topk_prob}, router={self.router_kind}")


__all__ = ["MOE_DEFAULTS", "MOE_KEYS", "ROUTERS", "MoEFeedForward", "check_moe"]
