"""Multi-head latent attention's projections (MLA: DeepSeek-V2; Kimi Linear's full-attention layers,
transformers' KimiLinearAttention), the q|k|v projection of a softmax layer with kv_lora_rank set
(design §22). With x (B, N, d), H heads, q/k head dim D = D_n + D_s (D_s = shared_k_dim), value
head dim E:

    q       = W_q x                          (q_lora_rank None)
            = W_qb RMSNorm(W_qa x)           (q_lora_rank r_q: d -> r_q -> H·D)
    [c | s] = W_kva x                        (d -> r_kv + D_s)
    [k_n,h | v_h] = (W_kvb RMSNorm(c))_h     (r_kv -> H·(D_n + E))
    k_h     = [k_n,h | s]                    (s: D_s key features shared by every head)

The RMSNorms (gain r_q, r_kv) take latent_eps (transformers' 1e-6 whatever rms_norm_eps is). The
output is laid out as a fused q|k|v projection's, [q (H·D) | k (H·D) | v (H·E)], so the softmax layer
runs as it does with one (short convolution, q/k norms, RoPE on the first rope_dim features, the KV
cache of the expanded k and v). Kimi Linear's layers rotate nothing ("NoPE": its D_s shared
features are named RoPE's but no rotation is applied), so its models have positions "none".
"""

from __future__ import annotations

import torch
from torch import nn

from .._checks import check_int, check_number, check_positive_int
from .base import column_major
from .norms import RMSNorm
from .linear import Linear


class LatentQKV(nn.Module):
    """The MLA projections (module docstring): forward(x (B, N, d)) -> (B, N, out_features) with
    out_features = H·(2D + E), [q | k | v] as the fused projection's. bias: on W_qa and W_kva (and
    W_q), as transformers' attention_bias."""

    def __init__(self, d_model: int, n_heads: int, qk_dim: int, v_dim: int, kv_lora_rank: int,
                 q_lora_rank: int | None = None, shared_k_dim: int = 0, eps: float = 1e-6, bias: bool = False):
        super().__init__()
        check_positive_int("kv_lora_rank", kv_lora_rank)
        check_positive_int("q_lora_rank", q_lora_rank, allow_none=True)
        check_int("shared_k_dim", shared_k_dim, minimum=0)
        check_number("latent_eps", eps, minimum=0, low_open=True)
        if shared_k_dim >= qk_dim:
            raise ValueError(f"shared_k_dim={shared_k_dim} must be below qk_dim={qk_dim} (each head keeps "
                             "qk_dim − shared_k_dim key features of its own)")
        self.n_heads, self.qk_dim, self.v_dim = n_heads, qk_dim, v_dim
        self.kv_lora_rank, self.shared_k_dim = kv_lora_rank, shared_k_dim
        self.out_features = n_heads * (2 * qk_dim + v_dim)
        if q_lora_rank is None:
            self.q = column_major(Linear(d_model, n_heads * qk_dim, bias=bias))
            self.q_a = self.q_a_norm = self.q_b = None
        else:
            self.q = None
            self.q_a = column_major(Linear(d_model, q_lora_rank, bias=bias))
            self.q_a_norm = RMSNorm(q_lora_rank, eps)
            self.q_b = column_major(Linear(q_lora_rank, n_heads * qk_dim, bias=False))
        self.kv_a = column_major(Linear(d_model, kv_lora_rank + shared_k_dim, bias=bias))
        self.kv_a_norm = RMSNorm(kv_lora_rank, eps)
        self.kv_b = column_major(Linear(kv_lora_rank, n_heads * (qk_dim - shared_k_dim + v_dim), bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q = self.q(x) if self.q is not None else self.q_b(self.q_a_norm(self.q_a(x)))
        latent, shared = self.kv_a(x).split((self.kv_lora_rank, self.shared_k_dim), dim=-1)
        kv = self.kv_b(self.kv_a_norm(latent)).view(b, n, self.n_heads, -1)
        k_own, v = kv.split((self.qk_dim - self.shared_k_dim, self.v_dim), dim=-1)
        k = torch.cat((k_own, shared[:, :, None, :].expand(b, n, self.n_heads, self.shared_k_dim)), dim=-1)
        return torch.cat((q, k.flatten(2), v.flatten(2)), dim=-1)

    def plan_step(self, plan, out: torch.Tensor, norm: nn.Module | None) -> None:
        """The fused step's q|k|v into `out` (B, out_features) (linattn.models.decoding; the plan in
        the group of the layer's input x normalized by `norm`): q (or W_qa x) and [c | s] = W_kva x
        as products of x; c gathered into its own buffer; W_qb RMSNorm(W_qa x) and W_kvb RMSNorm(c)
        as products of their norm groups; then one gather lays q, [k_n,h | s] and v_h out as the
        fused projection's [q | k | v]. Ends by opening x's group again (its norm recomputed) for the
        layer's other products of x."""
        h, d, e, r, ds = self.n_heads, self.qk_dim, self.v_dim, self.kv_lora_rank, self.shared_k_dim
        q = plan.project(self.q if self.q is not None else self.q_a)
        kva = plan.project(self.kv_a)
        latent = plan.buffer(r)
        plan.gather(latent, [kva], torch.arange(r))
        if self.q is None:
            plan.group(q, self.q_a_norm)
            q = plan.project(self.q_b)
        plan.group(latent, self.kv_a_norm)
        kvb = plan.project(self.kv_b)
        # the columns of [q (H·D) | W_kvb's output (H·(D_n + E)) | [c | s] (r + D_s)]
        dn, kv0, s0 = d - ds, h * d, h * d + h * (d - ds + e) + r
        head = torch.arange(h)[:, None] * (dn + e) + kv0
        k = torch.cat((head + torch.arange(dn), (s0 + torch.arange(ds)).expand(h, ds)), dim=1)
        index = torch.cat((torch.arange(h * d), k.flatten(), (head + dn + torch.arange(e)).flatten()))
        plan.gather(out, [q, kvb, kva], index)
        plan.group(plan.x, norm)

    def extra_repr(self) -> str:
        rank = None if self.q_b is None else self.q_b.in_features
        return (f"q_lora_rank={rank}, kv_lora_rank={self.kv_lora_rank}, shared_k_dim={self.shared_k_dim}, "
                f"out_features={self.out_features}")


__all__ = ["LatentQKV"]
