"""The attention layer every kind is (design §8, §10.1, §14): projections, the output gate and one
forward for every mode.

Every kind has one interface, so the same module serves training and decoding:

    forward(x, mask=None, cache=None, positions=None, *, cu_seqlens=None) -> (y, cache)

x: (B, N, d_model); mask: (B, N) bool key-padding mask, True = real token; y: (B, N, d_model).
`Attention.forward` decides the mode once and calls one entry point of the layer's operator family
(linattn.nn.families):

    cu_seqlens given        packed         sequences packed in x (1, T, d), kept apart (design §17)
    a cache                 step           the new tokens continue the cached context; the cache is
                                           updated in place and returned (one from `new_cache()`
                                           for the prefill)
    sequence_parallel_group sequence_parallel   this rank's shard of one sequence (design §9)
    otherwise               full           the whole sequence at once; the returned cache is None

Before it, once for all kinds: the mask's checks and the refusals (packing takes no cache and no
sequence parallelism; a cache needs a causal layer; sequence parallelism takes no padding mask and
needs a family that has it), the fused q|k|v projection with its short causal convolution (its
tail from the cache, the earlier ranks or zeros before each packed sequence), and the token
positions where the layer reads them (RoPE, cosFormer): given, else counted by the cache, from each
packed sequence's start, or from each row's first real token. A kind supplies only what is its own:
`mix(x, q, k, v, positions)` — its activations, gates, feature maps and rotation — returning its
family's operands, its `family`, and its parameters.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .._checks import check_int, check_number, check_positive_int
from ..ops import packed
from ..parallel import sequence_halo
from .caches import LayerCache, token_positions
from .convolution import ShortConvolution
from .families import Family
from .norms import RMSNorm
from .positional import RotaryEmbedding
from .linear import Linear


def shard_halo(x: torch.Tensor, kernel_size: int, group) -> torch.Tensor | None:
    """The tail a causal convolution of `kernel_size` needs before this rank's shard x (B, n, C) under
    sequence parallelism (its K−1 inputs from the earlier ranks, linattn.parallel.sequence_halo);
    None without a group or for K = 1 (the convolution then starts from zeros, as a whole sequence
    does)."""
    if group is None or kernel_size == 1:
        return None
    return sequence_halo(x, kernel_size - 1, group=group)


def column_major(linear: nn.Linear) -> nn.Linear:
    """Stores linear.weight (out, in) as the transpose of a contiguous (in, out) tensor. x·Wᵀ for one
    token is then a plain (1, in)·(in, out) product, which CPU BLAS runs about 1.7× faster than the
    row-major layout's (decoding is bound by these matrix-vector products); batched products cost
    the same. Values, shapes, state_dict names and checkpoints are unchanged."""
    linear.weight = nn.Parameter(linear.weight.detach().t().contiguous().t(), requires_grad=linear.weight.requires_grad)
    return linear


def check_dropout(p) -> float:
    check_number("dropout", p, minimum=0, maximum=1, high_open=True)
    return float(p)


def _check_heads(d_model: int, n_heads: int, qk_dim: int | None, v_dim: int | None = None) -> tuple[int, int]:
    """(value head dim, q/k head dim): v_dim (default d_model / n_heads, which must then divide) and
    qk_dim (default the value head dim)."""
    check_positive_int("d_model", d_model)
    check_positive_int("n_heads", n_heads)
    check_positive_int("v_dim", v_dim, allow_none=True)
    if v_dim is None and d_model % n_heads:
        raise ValueError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads}) (or pass v_dim)")
    head_dim = d_model // n_heads if v_dim is None else v_dim
    if qk_dim is None:
        return head_dim, head_dim
    check_positive_int("qk_dim", qk_dim, allow_none=True)
    return head_dim, qk_dim


#: the values of Attention's `output_gate`: off, RMSNorm and swish, or the sigmoid gate of gated attention
OUTPUT_GATES = (False, True, "sigmoid")


def check_output_gate(output_gate) -> bool | str:
    """output_gate: one of OUTPUT_GATES (False, True or "sigmoid")."""
    if not any(output_gate is g or (isinstance(g, str) and output_gate == g) for g in OUTPUT_GATES):
        raise ValueError(f"output_gate must be one of {OUTPUT_GATES}, got {output_gate!r}")
    return output_gate


def check_mask(mask, x: torch.Tensor) -> None:
    """mask: None or a bool tensor of x's (B, N)."""
    if mask is None:
        return
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or tuple(mask.shape) != tuple(x.shape[:2]):
        got = f"{tuple(mask.shape)} {mask.dtype}" if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"mask must be a bool tensor of shape (B, N) = {tuple(x.shape[:2])} (True = real token), "
                         f"got {got}")


class OutputGate(nn.Module):
    """Per-head output normalization and swish output gate (RetNet, GLA, DeltaNet; design §14):

        o_h ← RMSNorm(o_h) ⊙ swish(W_g x)_h

    o_h (E) is head h's output at one token, normalized by its own root mean square with a gain (E)
    shared by the heads; W_g (d -> H·E) projects the layer's input x. swish(a) = a·sigmoid(a).
    forward(o (B, N, H, E), x (B, N, d)) -> (B, N, H, E).
    """

    def __init__(self, d_model: int, n_heads: int, head_dim: int, eps: float = 1e-5, bias: bool = False):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, head_dim
        self.norm = RMSNorm(head_dim, eps)
        self.proj = column_major(Linear(d_model, n_heads * head_dim, bias=bias))

    def forward(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        gate = F.silu(self.proj(x)).unflatten(-1, (self.n_heads, self.head_dim))
        return self.norm(o) * gate


class SigmoidGate(nn.Module):
    """The output gate of gated attention (Qiu et al. 2025; Qwen3.5 and Qwen3-Next's softmax layers),
    elementwise, without a norm:

        o_h ← o_h ⊙ sigmoid(W_g x)_h

    W_g (d -> H·E) projects the layer's input x. forward(o (B, N, H, E), x (B, N, d)) -> (B, N, H, E)."""

    def __init__(self, d_model: int, n_heads: int, head_dim: int, bias: bool = False):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, head_dim
        self.proj = column_major(Linear(d_model, n_heads * head_dim, bias=bias))

    def forward(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return o * torch.sigmoid(self.proj(x)).unflatten(-1, (self.n_heads, self.head_dim))


class Attention(nn.Module):
    """What every kind shares (module docstring): x (B, N, d) -> q, k (B, H, N, qk_dim), v (B, H, N, E)
    (E = v_dim, default d/H) from one fused input matmul `qkv`, then (short_conv = K > 0) a causal
    depthwise convolution of kernel K over the projected channels; the family's output o (B, H, N, E)
    -> (B, N, d) through the output gate (output_gate=True: the per-head RMSNorm and swish gate,
    OutputGate; "sigmoid": gated attention's o ⊙ sigmoid(W_g x), SigmoidGate), then `out` (H·E -> d)
    and dropout.

    A kind sets `kind` (its name in linattn.models.KINDS), `family` (its linattn.nn.families record)
    and `rope` (a RotaryEmbedding or None), and implements `mix`."""

    kind = ""
    family: Family

    def __init__(self, d_model: int, n_heads: int, qk_dim: int | None, causal: bool, dropout: float, bias: bool,
                 *, short_conv: int = 0, output_gate: bool | str = False, norm_eps: float = 1e-5,
                 v_dim: int | None = None):
        super().__init__()
        self.head_dim, self.qk_dim = _check_heads(d_model, n_heads, qk_dim, v_dim)
        self.d_model, self.n_heads, self.causal = d_model, n_heads, bool(causal)
        self.dropout_p = check_dropout(dropout)
        check_int("short_conv", short_conv, minimum=0)
        check_output_gate(output_gate)
        width = n_heads * (2 * self.qk_dim + self.head_dim)
        self.qkv = column_major(Linear(d_model, width, bias=bias))
        self.conv = ShortConvolution(width, short_conv) if short_conv else None
        if output_gate == "sigmoid":
            self.output_gate = SigmoidGate(d_model, n_heads, self.head_dim, bias)
        else:
            self.output_gate = OutputGate(d_model, n_heads, self.head_dim, norm_eps, bias) if output_gate else None
        self.out = column_major(Linear(n_heads * self.head_dim, d_model, bias=bias))
        self.dropout = nn.Dropout(self.dropout_p)
        #: set by LinearTransformerLM.set_sequence_parallel_group; used when no cache is given.
        self.sequence_parallel_group = None
        #: RMSNorms of q and k (Qwen3's per head, OLMo2's across heads), set by `set_qk_norm`; None: none
        self.q_norm = self.k_norm = None
        self.qk_norm_across_heads = False
        #: RoPE (a linattn.nn.positional.RotaryEmbedding), set by the kind; None: none
        self.rope = None
        #: RoPE turns only the first rope.dim < qk_dim features of q and k (set_rope_dim)
        self.partial_rope = False

    def set_qk_norm(self, eps: float = 1e-6, *, across_heads: bool = False) -> None:
        """Normalizes q and k right after the projection: per head (RMSNorm over the q/k head dim, one
        gain shared by the heads; Qwen3's q_norm / k_norm), or across_heads (one RMSNorm over all
        H·qk_dim features of the token, a gain per feature; OLMo2's and OLMo-Hybrid's)."""
        width = self.qk_dim * (self.n_heads if across_heads else 1)
        self.q_norm, self.k_norm = RMSNorm(width, eps), RMSNorm(width, eps)
        self.qk_norm_across_heads = bool(across_heads)

    def set_qkv_bias(self, bias: bool) -> None:
        """Gives the fused q/k/v projection a bias (zeros) or takes it away, whatever `bias` the
        layer was built with (Qwen2: biases on q, k, v only)."""
        if (self.qkv.bias is not None) == bool(bias):
            return
        old = self.qkv
        new = column_major(Linear(old.in_features, old.out_features, bias=bool(bias)))
        new.to(device=old.weight.device, dtype=old.weight.dtype)
        with torch.no_grad():
            new.weight.copy_(old.weight)
            if new.bias is not None:
                new.bias.zero_()
        self.qkv = new

    def new_cache(self) -> LayerCache:
        """An empty decoding cache of the layer's family."""
        return self.family.new_state()

    @property
    def needs_positions(self) -> bool:
        """Whether the layer reads token positions: RoPE, or a feature map that does (cosFormer)."""
        return self.rope is not None or any(getattr(m, "needs_positions", False) for m in self._modules.values())

    # ---- the one forward
    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, cache: LayerCache | None = None,
                positions: torch.Tensor | None = None, *, cu_seqlens: torch.Tensor | None = None):
        """x (B, N, d), mask (B, N) bool or None, cache (from new_cache()) or None, positions (N,) or
        (B, N) global token indices or None (derived as the module docstring says); cu_seqlens: packed
        sequences in x (1, T, d) (linattn.ops.packed). Returns (y (B, N, d), cache)."""
        family = self.family
        group = self.sequence_parallel_group if cache is None else None
        self._check_call(x, mask, cache, group, cu_seqlens)
        q, k, v = self._project(x, mask, cache, cu_seqlens)
        n = x.shape[1]
        mix = self.mix(x, q, k, v, self._positions(n, mask, cache, positions, cu_seqlens, x.device))
        if cu_seqlens is not None:
            o = family.packed(mix, mask, cu_seqlens)
        elif cache is not None:
            o = family.step(cache, mix, mask)
            cache.advance(n, mask)
        elif group is not None:
            o = family.sequence_parallel(mix, group)
        else:
            o = family.full(mix, mask)
        return self._merge(o, x), cache

    def mix(self, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions):
        """The family's operands (a dataclass of its linattn.nn.families module) from the layer's input x
        (B, N, d), the projections q, k (B, H, N, qk_dim), v (B, H, N, E) and the token positions
        (None when the layer reads none, or its family's operator counts them): the kind's own part."""
        raise NotImplementedError

    def rotate(self, q: torch.Tensor, k: torch.Tensor, positions) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k rotated by RoPE at `positions` (as they are without RoPE)."""
        if self.rope is None:
            return q, k
        r = self.rope.dim
        if r == q.shape[-1]:
            return self.rope.rotate(q, positions), self.rope.rotate(k, positions)
        # partial RoPE (set_rope_dim): the first r features rotated, the others passed through
        return (torch.cat((self.rope.rotate(q[..., :r], positions), q[..., r:]), -1),
                torch.cat((self.rope.rotate(k[..., :r], positions), k[..., r:]), -1))

    def set_rope_dim(self, rope_dim: int) -> None:
        """Rotates only the first `rope_dim` q/k features (partial RoPE, Qwen3.5's partial_rotary_factor:
        pairs (x_m, x_{m+r/2}), m < r/2, at angles position·base^(−2m/r)); 0: no RoPE in this layer.
        A layer without RoPE takes only 0."""
        check_int("rope_dim", rope_dim, minimum=0)
        if rope_dim == 0:
            self.rope, self.partial_rope = None, False
            return
        if self.rope is not None and self.rope.dim != self.qk_dim:
            raise ValueError(f"rope_dim: this {type(self).__name__} rotates its feature map's features, not q and k")
        if self.rope is None or rope_dim % 2 or rope_dim > self.rope.dim:
            raise ValueError(f"rope_dim={rope_dim}: this {type(self).__name__} rotates "
                             f"{0 if self.rope is None else self.rope.dim} features; rope_dim must be 0 or an even "
                             "number up to that")
        self.rope = RotaryEmbedding(rope_dim, self.rope.base)
        self.partial_rope = rope_dim < self.qk_dim

    def _check_call(self, x, mask, cache, group, cu_seqlens) -> None:
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != self.d_model:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"x must have shape (B, N, d_model={self.d_model}), got {got}")
        check_mask(mask, x)
        if cu_seqlens is not None and (cache is not None or self.sequence_parallel_group is not None):
            raise ValueError("cu_seqlens (packed sequences) takes neither a cache nor sequence parallelism")
        if cache is not None and not self.causal:
            raise ValueError(f"a cache (recurrent decoding) needs a causal {type(self).__name__}")
        if group is not None:
            if self.family.sequence_parallel is None:
                raise ValueError(f"{type(self).__name__} does not run sequence-parallel yet")
            if mask is not None:
                raise ValueError("sequence parallelism does not take a padding mask")

    def _positions(self, n: int, mask, cache, positions, cu_seqlens, device):
        """The positions of the n new tokens where the layer reads them (module docstring)."""
        if positions is not None or not self.needs_positions:
            return positions
        if cache is not None:
            return cache.next_positions(n, mask, device)
        if mask is None and self.family.counts_positions:
            return None
        if cu_seqlens is not None:
            return packed.positions(cu_seqlens, n, mask).to(device)
        return token_positions(n, mask, device=device)

    def _project(self, x: torch.Tensor, mask: torch.Tensor | None = None, cache: LayerCache | None = None,
                 cu_seqlens: torch.Tensor | None = None):
        """q, k, v of x; with a short convolution, padded tokens enter it as zeros and the cache's
        tail (the last K−1 projected inputs) continues the sequence and is updated; under sequence
        parallelism the tail is the K−1 inputs before the shard, from the earlier ranks. With
        cu_seqlens (packed sequences, x (1, T, d)) no tap of the convolution crosses a boundary."""
        b, n, _ = x.shape
        y = self.qkv(x)
        if self.conv is not None:
            if cu_seqlens is not None:
                y = self.conv(y, mask, cu_seqlens=cu_seqlens)
            elif cache is None:
                y = self.conv(y, mask, shard_halo(y, self.conv.kernel_size, self.sequence_parallel_group))
            else:
                y, cache.conv = self.conv(y, mask, cache.conv, return_tail=True)
        if self.qk_dim == self.head_dim:  # [q | k | v] as (3, B, H, N, D) views: three ops, not seven
            q, k, v = y.view(b, n, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        else:
            hq = self.n_heads * self.qk_dim
            q, k, v = y.split((hq, hq, self.n_heads * self.head_dim), dim=-1)
            q = q.view(b, n, self.n_heads, self.qk_dim).transpose(1, 2)
            k = k.view(b, n, self.n_heads, self.qk_dim).transpose(1, 2)
            v = v.view(b, n, self.n_heads, self.head_dim).transpose(1, 2)
        if self.q_norm is not None and self.qk_norm_across_heads:  # (B, H, N, D) -> (B, N, H·D) and back
            q, k = (norm(t.transpose(1, 2).flatten(2)).unflatten(-1, (self.n_heads, self.qk_dim)).transpose(1, 2)
                    for norm, t in ((self.q_norm, q), (self.k_norm, k)))
        elif self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def gate_output(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """o (B, N, H, E) through the output norm and gate (as it is without one); x (B, N, d)."""
        return o if self.output_gate is None else self.output_gate(o, x)

    def _merge(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """o (B, H, N, E) -> (B, N, d); x (B, N, d), the layer's input, feeds the output gate."""
        b, _, n, _ = o.shape
        o = self.gate_output(o.transpose(1, 2), x)
        y = self.out(o.reshape(b, n, self.n_heads * self.head_dim))
        return self.dropout(y) if self.dropout_p and self.training else y

    # ---- the fused decoding step (linattn.models.decoding.FusedDecoder, csrc/model_mixers.h, design §15)
    def step_obstacle(self) -> str | None:
        """Why the fused decoder cannot plan this layer's one-token step (None: it can; whether the
        kind runs fused at all is its kinds-table row's word)."""
        if type(self).plan_mixer is Attention.plan_mixer:
            return f"{type(self).__name__} has no fused step"
        if self.q_norm is not None and not (type(self.q_norm) is type(self.k_norm) is RMSNorm):
            return "q/k norms (qk_norm) other than RMSNorm take the eager path"
        if self.qk_norm_across_heads and self.conv is not None:
            return "qk_norm='all' (one RMSNorm across the heads) after a short convolution takes the eager path"
        if isinstance(self.output_gate, OutputGate) and type(self.output_gate.norm) is not RMSNorm:
            return "output gate norm takes the eager path"
        return None

    def plan_step(self, plan, norm: nn.Module | None, cache: LayerCache, post_norm: nn.Module | None = None) -> None:
        """Adds x ← x + Attn(norm(x)) for one token to `plan`, a fused decoder being built (its
        vocabulary: x, buffer, group, product, project, rope, state, reserve_kv, mixer, norm_add): the
        input group, the q|k|v (and output gate) products, the call of the family's mixer on the cached
        state (`plan_mixer` adds the kind's own arguments), the output product added to x; with
        `post_norm` (and norm None), x ← x + post_norm(Attn(x)) (a post-norm block's order)."""
        t = {"qkv": plan.buffer(self.qkv.out_features), "out": plan.buffer(self.n_heads * self.head_dim)}
        i = {"heads": self.n_heads, "qk_dim": self.qk_dim, "v_dim": self.head_dim}
        f: dict = {}
        plan.group(plan.x, norm)
        if hasattr(self.qkv, "plan_step"):  # MLA's latent projections (linattn.nn.mla.LatentQKV)
            self.qkv.plan_step(plan, t["qkv"], norm)
        else:
            plan.product(self.qkv, t["qkv"])
        if isinstance(self.output_gate, SigmoidGate):
            t["gate"], i["sigmoid_gate"] = plan.project(self.output_gate.proj), 1
        elif self.output_gate is not None:
            t.update(gate=plan.project(self.output_gate.proj), gate_norm_weight=self.output_gate.norm.weight.detach())
            f["gate_norm_eps"] = float(self.output_gate.norm.eps)
        if self.q_norm is not None:  # per head, or across the heads (qk_norm 'all': weights of H·D)
            t.update(q_norm_weight=self.q_norm.weight.detach(), k_norm_weight=self.k_norm.weight.detach())
            f["qk_norm_eps"] = self.q_norm.eps
            i["qk_norm_all"] = int(self.qk_norm_across_heads)
        if self.partial_rope:
            i["rope_dim"] = self.rope.dim
        if self.conv is not None:
            if cache.conv is None or not cache.conv.is_contiguous():
                raise ValueError("fused decoding: the short convolution's cache is missing; run the prefill first")
            t.update(conv_weight=self.conv.weight.detach(), tail=cache.conv)
        self.plan_mixer(plan, cache, t, i, f)
        plan.mixer(self.family.name, t, i, f)
        plan.group(t["out"], None)
        if post_norm is None:
            plan.product(self.out, plan.x, "residual")
        else:
            plan.norm_add(plan.project(self.out), post_norm)

    def plan_mixer(self, plan, cache: LayerCache, tensors: dict, ints: dict, floats: dict) -> None:
        """The kind's own arguments of its family's mixer call (csrc/model_mixers.h) into tensors,
        ints, floats: its state from the cache, its gates' products and tensors (kinds with a fused
        step implement it)."""
        raise NotImplementedError

    def plan_qk_rope(self, plan, tensors: dict) -> None:
        """The RoPE tables of q and k (in the model's dtype), where the layer rotates them."""
        if self.rope is not None:
            tensors["rope_cos"], tensors["rope_sin"] = plan.rope(self.rope.dim, self.rope.base, plan.bf16)

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, n_heads={self.n_heads}, qk_dim={self.qk_dim}, causal={self.causal}, "
                f"short_conv={0 if self.conv is None else self.conv.kernel_size}, "
                f"output_gate={self.output_gate is not None}, rope={self.rope is not None}")


__all__ = ["OUTPUT_GATES", "Attention", "OutputGate", "SigmoidGate", "check_dropout", "check_mask", "check_output_gate",
           "column_major", "shard_halo"]
