"""Blocks (design §8, §14): the pre-norm Transformer block with its feed-forward network, and the
conv_mixer block of Zoology's and Based's recall models with its gated short convolution.

    Block           x ← x + Attn(Norm₁(x)),   x ← x + FFN(Norm₂(x))
    ConvMixerBlock  x ← x + GatedConv(Norm₁(x)),   x ← x + Attn(Norm₂(x))

forward(x (B, N, d), mask, cache, positions, *, cu_seqlens) -> (x, cache), the attention layer's
interface (linattn.nn.base.Attention).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .._checks import check_positive_int
from .base import Attention, check_dropout, column_major, shard_halo
from .caches import PositionCounter, nbytes
from .convolution import ShortConvolution
from .moe import MOE_DEFAULTS, MoEFeedForward
from .norms import make_norm, native_norm_code
from .linear import Linear

ACTIVATIONS = ("gelu", "swiglu", "gelu_tanh")
#: the activations the fused decoding step knows (csrc/model_ops.h)
FUSED_ACTIVATIONS = ("swiglu", "gelu")


def _norms_obstacle(*norms) -> str | None:
    bad = [n for n in norms if native_norm_code(n) is None]
    return f"norm {type(bad[0]).__name__} takes the eager path" if bad else None


class FeedForward(nn.Module):
    """Position-wise FFN, x (…, d) -> (…, d):

        gelu:      W_down · gelu(W_up x)
        gelu_tanh: W_down · gelu_tanh(W_up x)             (GPT-2's tanh approximation of GELU)
        swiglu:    W_down · (silu(W_gate x) ⊙ W_up x)     (Shazeer 2020; W_gate, W_up fused in `up`)
    """

    def __init__(self, d_model: int, d_ff: int, activation: str = "swiglu", dropout: float = 0.0, bias: bool = False):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        check_positive_int("d_ff", d_ff)
        self.activation = activation
        self.up = column_major(Linear(d_model, d_ff * (2 if activation == "swiglu" else 1), bias=bias))
        self.down = column_major(Linear(d_ff, d_model, bias=bias))
        self.dropout = nn.Dropout(check_dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        if self.activation == "swiglu":
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h, approximate="tanh" if self.activation == "gelu_tanh" else "none")
        y = self.down(h)
        return self.dropout(y) if self.dropout.p and self.training else y


class Block(nn.Module):
    """Pre-norm Transformer block (design §8):

        x ← x + Attn(Norm₁(x)),   x ← x + FFN(Norm₂(x));

    with post_norm, OLMo2's (and OLMo-Hybrid's attention layers') order, the norms on the outputs:

        x ← x + Norm₁(Attn(x)),   x ← x + Norm₂(FFN(x)).

    forward(x (B, N, d), mask, cache, positions) -> (x, cache), the attention's cache passed through.
    """

    def __init__(self, attn: Attention, d_ff: int, *, activation: str = "swiglu", norm: str = "rmsnorm",
                 norm_eps: float = 1e-5, dropout: float = 0.0, bias: bool = False, moe: dict | None = None,
                 post_norm: bool = False):
        """moe: the options of a mixture-of-experts FFN (ModelConfig.moe, less `layers`) in place of
        the dense one (linattn.nn.moe; SwiGLU experts)."""
        super().__init__()
        d = attn.d_model
        self.norm1 = make_norm(norm, d, norm_eps)
        self.attn = attn
        self.norm2 = make_norm(norm, d, norm_eps)
        self.post_norm = bool(post_norm)
        if moe:
            shared = FeedForward(d, moe["shared_d_ff"], "swiglu", dropout, bias) if moe["shared_d_ff"] else None
            router = {k: moe[k] for k in MOE_DEFAULTS if k in moe}
            self.ffn = MoEFeedForward(d, moe["num_experts"], moe["top_k"], moe["d_expert"], shared,
                                      moe["norm_topk_prob"], **router)
        else:
            self.ffn = FeedForward(d, d_ff, activation, dropout, bias)

    def new_cache(self):
        """The attention layer's empty cache."""
        return self.attn.new_cache()

    def step_obstacle(self) -> str | None:
        """Why the fused decoder cannot plan this block's one-token step (None: it can)."""
        ffn = self.ffn.shared if isinstance(self.ffn, MoEFeedForward) else self.ffn  # MoE: SwiGLU experts
        bad = ffn is not None and ffn.activation not in FUSED_ACTIVATIONS
        return _norms_obstacle(self.norm1, self.norm2) or (f"activation {ffn.activation} takes the eager path"
                                                           if bad else None)

    def plan_step(self, plan, cache) -> None:
        """x ← x + Attn(Norm₁(x)), x ← x + FFN(Norm₂(x)) for one token, added to `plan` (a fused
        decoder being built: linattn.nn.base.Attention.plan_step); post_norm: x ← x + Norm₁(Attn(x)),
        x ← x + Norm₂(FFN(x)), each output product into a buffer, then plan.norm_add."""
        post = self.post_norm
        self.attn.plan_step(plan, None if post else self.norm1, cache, self.norm1 if post else None)
        ffn = self.ffn
        if isinstance(ffn, MoEFeedForward):
            out = plan.buffer(self.attn.d_model) if post else plan.x
            ffn.plan_step(plan, None if post else self.norm2, out, residual=not post)
            if post:
                plan.norm_add(out, self.norm2)
            return
        plan.group(plan.x, None if post else self.norm2)
        h = plan.buffer(ffn.down.in_features)
        plan.product(ffn.up, h, ffn.activation)
        plan.group(h, None)
        if post:
            plan.norm_add(plan.project(ffn.down), self.norm2)
        else:
            plan.product(ffn.down, plan.x, "residual")

    def forward(self, x, mask=None, cache=None, positions=None, *, cu_seqlens=None):
        kw = {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens}
        if self.post_norm:
            a, cache = self.attn(x, mask, cache, positions, **kw)
            x = x + self.norm1(a)
            return x + self.norm2(self.ffn(x)), cache
        a, cache = self.attn(self.norm1(x), mask, cache, positions, **kw)
        x = x + a
        x = x + self.ffn(self.norm2(x))
        return x, cache


class GatedConvolution(nn.Module):
    """Zoology's BaseConv (Arora et al. 2023): a causal depthwise convolution of kernel K (3 by default)
    gated by a linear map of the same input, plus the input,

        y = conv(u) ⊙ (W u + b) + u,         u (B, N, d),

    with biases on both, as in Zoology. forward(u, mask=None, tail=None, return_tail=False) -> y, or
    (y, tail') with return_tail (the convolution's cache, see linattn.nn.convolution.ShortConvolution).
    """

    def __init__(self, d_model: int, kernel_size: int = 3):
        super().__init__()
        self.conv = ShortConvolution(d_model, kernel_size, bias=True)
        self.proj = column_major(Linear(d_model, d_model, bias=True))

    def forward(self, u: torch.Tensor, mask: torch.Tensor | None = None, tail: torch.Tensor | None = None,
                return_tail: bool = False, *, cu_seqlens: torch.Tensor | None = None):
        c = self.conv(u, mask, tail, return_tail, cu_seqlens=cu_seqlens)
        if return_tail:
            c, tail = c
        y = torch.addcmul(u, c, self.proj(u))
        return (y, tail) if return_tail else y


@dataclass
class ConvMixerCache:
    """The decoding cache of a ConvMixerBlock: its attention layer's cache and the gated convolution's
    tail (B, K−1, d) (None before the first call)."""

    attn: PositionCounter
    conv: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return self.attn.nbytes + nbytes(self.conv)


class ConvMixerBlock(nn.Module):
    """A block without feed-forward network that alternates a gated short convolution with the
    attention layer (the layout of Zoology's and Based's MQAR models; design §14, §16):

        x ← x + GatedConv(Norm₁(x)),   x ← x + Attn(Norm₂(x)).

    forward(x (B, N, d), mask, cache, positions) -> (x, cache); cache a ConvMixerCache or None.
    """

    def __init__(self, attn: Attention, kernel_size: int = 3, *, norm: str = "rmsnorm", norm_eps: float = 1e-5):
        super().__init__()
        d = attn.d_model
        self.norm1 = make_norm(norm, d, norm_eps)
        self.conv = GatedConvolution(d, kernel_size)
        self.norm2 = make_norm(norm, d, norm_eps)
        self.attn = attn
        #: set by LinearTransformerLM.set_sequence_parallel_group: the convolution's halo comes from there
        self.sequence_parallel_group = None

    def new_cache(self) -> ConvMixerCache:
        return ConvMixerCache(attn=self.attn.new_cache())

    def step_obstacle(self) -> str | None:
        """Why the fused decoder cannot plan this block's one-token step (None: it can)."""
        return _norms_obstacle(self.norm1, self.norm2)

    def plan_step(self, plan, cache: ConvMixerCache) -> None:
        """x ← x + GatedConv(Norm₁(x)), x ← x + Attn(Norm₂(x)) for one token, added to `plan`."""
        if cache.conv is None:
            raise ValueError("fused decoding: a gated convolution's cache is missing; run the prefill first")
        plan.group(plan.x, self.norm1)
        conv = self.conv.conv
        plan.product(self.conv.proj, plan.x, "gated_conv", conv_weight=conv.weight.detach(),
                     conv_bias=conv.bias.detach(), tail=cache.conv)
        self.attn.plan_step(plan, self.norm2, cache.attn)

    def forward(self, x, mask=None, cache=None, positions=None, *, cu_seqlens=None):
        if cu_seqlens is not None:
            if cache is not None or self.sequence_parallel_group is not None:
                raise ValueError("cu_seqlens (packed sequences) takes neither a cache nor sequence parallelism")
            x = x + self.conv(self.norm1(x), mask, cu_seqlens=cu_seqlens)
            a, _ = self.attn(self.norm2(x), mask, None, positions, cu_seqlens=cu_seqlens)
            return x + a, None
        if cache is None:
            u = self.norm1(x)
            x = x + self.conv(u, mask, shard_halo(u, self.conv.conv.kernel_size, self.sequence_parallel_group))
            a, _ = self.attn(self.norm2(x), mask, None, positions)
            return x + a, None
        c, cache.conv = self.conv(self.norm1(x), mask, cache.conv, return_tail=True)
        x = x + c
        a, _ = self.attn(self.norm2(x), mask, cache.attn, positions)
        return x + a, cache


__all__ = ["ACTIVATIONS", "Block", "ConvMixerBlock", "ConvMixerCache", "FeedForward", "GatedConvolution"]
