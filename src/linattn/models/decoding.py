"""Fused decoding: one token of a whole LM in one C++ call (linattn_cpu.DecodePlan, csrc/model_step.cpp).

The eager decoding step (`model(tok (B, 1), cache=cache)`) runs some ten torch operators per layer,
and at small batches its time goes to their dispatch, not to reading the weights. `FusedDecoder`
builds, once per decoding run, a plan of the model's step from its modules and its cache:

    ids (B,) ─ embedding (+ positions) ─ per block: [norm₁ → q|k|v (+ gate, β, decay) products] →
    attention per (row, head) on the cached state → [W_o + residual] → [norm₂ → FFN up, SwiGLU / GELU]
    → [FFN down + residual] (conv_mixer blocks: [norm₁ → gated convolution + residual], then the
    attention after norm₂; post-norm blocks: x + Norm(W_o o), x + Norm(FFN(x)) by `norm_add`; MoE
    blocks: [norm₂ → router, shared expert] → the `moe` op) ─ final norm ─ LM head ─ logits (B, V)

Each block plans its own part (`plan_step(decoder, cache)`, linattn.nn.blocks; its attention layer's
`Attention.plan_step` and, per kind, `plan_mixer`: the kind's state, gates and tensors), with the
decoder's small vocabulary — `x`, `buffer`, `group`, `product`, `project`, `gather`, `rope`, `state`,
`reserve_kv`, `mixer`, `after_step`, `norm_add`, `moe` —, so the decoder reads no layer's parameters by
name and a kind's fused arguments live beside its eager code. `step(ids)` runs the plan: no tensor is
allocated per token, the caches (linear (kv, z), gated and delta-rule S, short-convolution and
gated-convolution tails, KV caches, window ring buffers) are updated in place, so the model's
ModelCache stays the one the eager path would hold and either path can continue it (what a cache holds
outside tensors — a window kind's ring buffer counts its tokens in an immutable WindowState — is moved
on by the `after_step` updates its layer registered). The eager path is the
reference: the fused step computes the same values, in float32 (the state dtype), and differs only by
the order of the float sums (tests/test_decoding.py).

Positions are counted on one side, the cache's: its PositionCounters (`length`, and `seen` once a
row was padded) are what the eager step advances and what hf's get_seq_length and row selection
read, so `step` hands the plan each token's positions and the tokens fed so far from them and then
advances them; the plan keeps no counter of its own. A decoding run (plan built once, rebuilt
after an eager call or a row selection, KV room reserved, logits read) is a
linattn.models.session.DecodingSession.

What the fused step takes (`fused_decoding_obstacle` says why a model is refused; generation then
runs the eager step): CPU LinearTransformerLM models in float32 or bfloat16 with transformer blocks
(pre- or post-norm; dense or mixture-of-experts FFN, linattn.nn.moe) or conv_mixer blocks, their
nn.Linear weights float or 8-bit quantized by torchao (Int8WeightOnlyConfig, per-row or per-tensor
scales: read in place, linattn.models.weights; or Int8DynamicActivationInt8WeightConfig in float32
models: the activations rounded to int8 as torchao rounds them, integer products); every attention kind of
linattn.models.KINDS with a fused mixer (Kind.fused: linear with every φ that has a native code,
softmax with its KV cache and MLA's latent projections, the gated and delta-rule kinds, KDA's
per-key-channel decay and HGRN2's key decay included, the window kinds swa, lolcats and liger on
their ring buffers); RoPE (whole or partial, rope_dim), learned
or no positions; short convolutions on q, k, v; q/k RMSNorms (qk_norm: per head, or across the heads
where no short convolution comes first); the output gate (RMSNorm and swish, KDA's RMSNorm and
sigmoid, or gated attention's sigmoid); value heads of any width (v_dim); β ∈ (0, 2)
(allow_neg_eigval); RMSNorm or LayerNorm;
SwiGLU or GELU; biases; left-padded batches.

`weight_streaming()` runs every matrix-vector product of a step and nothing else (same kernels,
threads and column shares; int8 weights: the int8 kernels): the time to read every weight once, the
bound a step at small batch cannot beat (linattn bench decode reports the step's time beside it).
"""

from __future__ import annotations

import torch
from torch import nn

from ..nn.caches import KVCache, first_tensor
from ..nn.norms import native_norm_code
from ..ops import native
from .kinds import kind_of
from .weights import activation_quantization, float_weight, plan_weight, quantization_obstacle

#: the epilogues of a product (csrc/model_ops.h): store, add to x, SwiGLU, GELU, Zoology's gated convolution,
#: store unrounded (float32 results of a bf16 model)
_EPILOGUES = {"store": 0, "residual": 1, "swiglu": 2, "gelu": 3, "gated_conv": 4, "float": 5}
_DTYPES = (torch.float32, torch.bfloat16)


def fused_decoding_obstacle(model) -> str | None:
    """Why `model` cannot decode through FusedDecoder (None: it can)."""
    if not all(hasattr(model, name) for name in ("tok_emb", "pos_emb", "blocks", "norm", "lm_head", "new_cache")):
        return f"fused decoding takes a LinearTransformerLM, got {type(model).__name__}"
    params = list(model.parameters())
    if any(p.device.type != "cpu" for p in params):
        return "fused decoding runs on the CPU only"
    dtypes = {p.dtype for p in params}
    if len(dtypes) != 1 or next(iter(dtypes)) not in _DTYPES:
        return f"fused decoding takes float32 or bfloat16 models, got {sorted(str(d) for d in dtypes)}"
    quantized = quantization_obstacle(model)
    if quantized is not None:
        return quantized
    if not (native.enabled() and native.load() and hasattr(torch.classes.linattn_cpu, "DecodePlan")):
        return "the fused CPU kernels are not available (linattn.ops.native)"
    for i, block in enumerate(model.blocks):
        if not hasattr(block, "plan_step"):
            return f"block {i}: {type(block).__name__} blocks take the eager path"
        attn = block.attn
        kind = kind_of(attn)
        if kind is None:
            return f"block {i}: attention {type(attn).__name__} is no kind of linattn.models.KINDS"
        if kind.fused is None:
            return f"block {i}: kind {kind.name} has no fused mixer"
        if kind.fused != attn.family.name:
            return f"block {i}: kind {kind.name} names the {kind.fused} mixer, its layer runs the {attn.family.name} family"
        obstacle = block.step_obstacle() or attn.step_obstacle()
        if obstacle is not None:
            return f"block {i}: {obstacle}"
    if native_norm_code(model.norm) is None:
        return f"final norm {type(model.norm).__name__} takes the eager path"
    return None


def _norm(prefix: str, norm: nn.Module | None):
    """(tensors, ints, floats) of a norm spec named `prefix` in the plan (None: no norm)."""
    if norm is None:
        return {}, {f"{prefix}_kind": 0}, {}
    t = {f"{prefix}_weight": norm.weight.detach()}
    if getattr(norm, "bias", None) is not None:
        t[f"{prefix}_bias"] = norm.bias.detach()
    return t, {f"{prefix}_kind": native_norm_code(norm)}, {f"{prefix}_eps": float(norm.eps)}


class FusedDecoder:
    """One decoding step of `model` for a batch whose caches `cache` (a ModelCache, after the prefill)
    holds, run as one fused C++ call.

    step(ids (B,) long) -> logits (B, V) in the model's dtype: a buffer the next step overwrites (clone
    it to keep it). Advances `cache` (states, tails, KV caches, position counters) by one token, as
    model(ids[:, None], cache=cache) would. `reserve`: tokens to make room for in the KV caches of
    softmax layers (they do not grow during fused steps; a step past it raises). Build one per
    decoding run: the plan reads the weight matrices in place but keeps float copies of the small
    parameters of bf16 models (norms, biases, convolution kernels, decays).

    Either path can continue the cache: the plan updates the cache's tensors in place, so the eager
    step can follow a fused one; an eager step (or anything else) that replaced a tensor of the cache
    or changed its length since the last fused step is detected at the next `step`, which then
    rebuilds the plan from the cache as it is (as a new FusedDecoder would) before it runs.

    Threads: every op of a step ends at a barrier of torch's intra-op threads (about five per
    layer). With more threads than idle cores a descheduled thread holds the others at each
    barrier: on a loaded machine run decoding with fewer threads (torch.set_num_threads)."""

    def __init__(self, model, cache, *, reserve: int = 0):
        self._build(model, cache, reserve)

    def _build(self, model, cache, reserve: int):
        obstacle = fused_decoding_obstacle(model)
        if obstacle is not None:
            raise ValueError(f"fused decoding: {obstacle}")
        if model.training:  # dropout and feature redraws would make the eager step differ
            raise ValueError("fused decoding: the model is in training mode; call model.eval() first")
        self.model, self.cache = model, cache
        c = model.config
        self.dtype = next(model.parameters()).dtype
        self.bf16 = self.dtype == torch.bfloat16
        self.batch = b = self._batch(cache)
        #: the positions of the tokens a step decodes, (B,): read from the cache before each step
        self.positions = torch.zeros(b, dtype=torch.long)
        self.plan = torch.classes.linattn_cpu.DecodePlan(b, self.bf16)
        f32 = dict(dtype=torch.float32)
        self.x = torch.zeros(b, c.d_model, **f32)
        self.logits = torch.zeros(b, c.vocab_size, dtype=self.dtype)
        self._ropes: dict = {}
        self._ops: list = []  # (kind, tensors, ints, floats) in order, the RoPE tables' ops before them
        self._after: list = []  # what runs after each step (`after_step`)
        self._reserve = reserve
        emb = {"table": model.tok_emb.weight.detach(), "x": self.x}
        if model.pos_emb is not None:
            emb["positions"] = model.pos_emb.weight.detach()
        self._add("embed", emb, {"bf16": int(self.bf16)})
        for block, layer_cache in zip(model.blocks, cache.layers):
            block.plan_step(self, layer_cache)
        self.group(self.x, model.norm)
        self.product(model.lm_head, self.logits)
        self._keep: list = []  # tensors the plan reads (kept alive with it)
        for (dim, base, bf16), (cos, sin) in self._ropes.items():  # computed once per step, first
            self._emit("rope", {"cos": cos, "sin": sin}, {"dim": dim, "bf16": int(bf16)}, {"base": base})
        for op in self._ops:
            self._emit(*op)
        self._synced = self._cache_parts()

    def _cache_parts(self) -> tuple:
        """The cache's length and every tensor (or state tuple) its layers hold, by identity."""
        parts: list = [self.cache.length]
        for lc in self.cache.layers:
            for part in (lc, getattr(lc, "attn", None)):
                if part is not None:
                    parts += [getattr(part, name, None)
                              for name in ("length", "state", "window", "conv", "k", "v", "mask")]
        return tuple(parts)

    def _in_sync(self) -> bool:
        """True when the cache is as the last fused step (or the build) left it."""
        now = self._cache_parts()
        return len(now) == len(self._synced) and all(a is b or (isinstance(a, int) and a == b)
                                                     for a, b in zip(now, self._synced))

    # ---- building
    @staticmethod
    def _batch(cache) -> int:
        state = first_tensor(cache.layers)  # every cache tensor is batch-first
        if state is None:
            raise ValueError("fused decoding: the cache is empty; run the prefill (model(ids, cache=...)) first")
        return state.shape[0]

    def _add(self, kind: str, tensors: dict, ints: dict | None = None, floats: dict | None = None):
        self._ops.append((kind, tensors, ints, floats))

    def _emit(self, kind: str, tensors: dict, ints: dict | None, floats: dict | None):
        self._keep.append(tensors)
        # "_": TorchScript cannot type an empty dict, and the plan ignores names it does not read
        self.plan.add(kind, tensors, {"_": 0, **(ints or {})}, {"_": 0.0, **(floats or {})})

    # ---- the vocabulary the layers plan their step with (linattn.nn.base.Attention.plan_step, the blocks')
    def buffer(self, width: int) -> torch.Tensor:
        """A (B, width) float32 buffer of the plan."""
        return torch.zeros(self.batch, width, dtype=torch.float32)

    def rope(self, dim: int, base: float, bf16: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The (cos, sin) buffers of RoPE of `dim` and `base` at the step's positions (rounded to bf16
        where `bf16`), computed once per step for every layer that reads them."""
        key = (dim, base, bf16)
        if key not in self._ropes:
            self._ropes[key] = (self.buffer(dim), self.buffer(dim))
        return self._ropes[key]

    def group(self, inp: torch.Tensor, norm: nn.Module | None) -> None:
        """Starts a group of products that read norm(inp) (None: inp as it is)."""
        t, i, f = _norm("norm", norm)
        self._add("group", {"input": inp, **t}, i, f)

    def product(self, linear: nn.Linear, out: torch.Tensor, epilogue: str = "store", **tensors) -> None:
        """out ← (or +=, or an activation of) linear(the group's input); `tensors`: the epilogue's own."""
        t, kn = plan_weight(linear, self.dtype)
        self._add("product", {**t, "out": out, **tensors},
                  {"kn": kn, "epilogue": _EPILOGUES[epilogue], "act_quant": activation_quantization(linear)})

    def project(self, linear: nn.Linear) -> torch.Tensor:
        """A new buffer holding linear(the group's input)."""
        out = self.buffer(linear.out_features)
        self.product(linear, out)
        return out

    def gather(self, out: torch.Tensor, inputs: list, index: torch.Tensor) -> None:
        """out[:, j] ← [inputs side by side][:, index[j]] (csrc/model_gather.h): columns of (B, C_i)
        buffers laid out anew (MLA's q|k|v, linattn.nn.mla.LatentQKV.plan_step). Ends the group."""
        self._add("gather", {"out": out, "index": index.to(torch.long).contiguous(),
                             **{f"input{i}": t for i, t in enumerate(inputs)}}, {"inputs": len(inputs)})

    def norm_add(self, inp: torch.Tensor, norm: nn.Module) -> None:
        """x ← x + norm(inp) (inp a (B, d) buffer): a post-norm block's residual."""
        t, i, f = _norm("norm", norm)
        self._add("norm_add", {"input": inp, "x": self.x, **t}, i, f)

    def moe(self, tensors: dict, norm: nn.Module | None, ints: dict, floats: dict | None = None) -> None:
        """The mixture-of-experts op (csrc/model_moe.h; linattn.nn.moe.MoEFeedForward.plan_step), its
        input normalized by `norm` first."""
        t, i, f = _norm("norm", norm)
        self._add("moe", {**tensors, **t}, {**ints, **i}, {**(floats or {}), **f})

    def after_step(self, update) -> None:
        """`update()` is called after each fused step, once the plan has run: what the cache holds
        outside the tensors the plan updates in place (a window kind's ring buffer counts its tokens in
        an immutable WindowState, linattn.nn.swa)."""
        self._after.append(update)

    def mixer(self, name: str, tensors: dict, ints: dict, floats: dict) -> None:
        """The call of a family's mixer (Kind.fused, csrc/model_mixers.h) on a layer's cached state
        (a quantized matrix it reads itself is handed over dequantized: linattn.models.weights.float_weight)."""
        self._add(name, {k: float_weight(v, self.dtype) for k, v in tensors.items()}, ints, floats)

    def state(self, lc):
        """The layer cache's state (a tensor, or a tuple of them), float32 and contiguous, put back
        into the cache (the plan updates it in place)."""
        state = lc.state
        if state is None:
            raise ValueError("fused decoding: a layer's cache is empty; run the prefill first")
        parts = state if isinstance(state, tuple) else (state,)
        if any(p.dtype != torch.float32 for p in parts):
            raise ValueError(f"fused decoding: states must be float32, got {[p.dtype for p in parts]}")
        parts = tuple(p.contiguous() for p in parts)  # updated in place: the cache must hold these tensors
        lc.state = parts if isinstance(state, tuple) else parts[0]
        return lc.state

    def reserve_kv(self, lc: KVCache) -> None:
        """Grows the KV cache to hold the tokens the decoder reserves (the plan writes into it in place)."""
        if lc.k is None:
            raise ValueError("fused decoding: a KV cache is empty; run the prefill first")
        b, h, cap, _ = lc.k.shape
        need = lc.length + max(self._reserve, 1) + 1
        if cap < need:
            for name in ("k", "v"):
                old = getattr(lc, name)
                new = old.new_empty(b, h, need, old.shape[-1])
                new[:, :, :lc.length] = old[:, :, :lc.length]
                setattr(lc, name, new)
            if lc.mask is not None:
                m = torch.ones(b, need, dtype=torch.bool)
                m[:, :lc.length] = lc.mask[:, :lc.length]
                lc.mask = m

    # ---- running
    def step(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (B,) (or (B, 1)) token ids -> logits (B, V); advances the cache by one token."""
        if not isinstance(ids, torch.Tensor) or ids.dtype.is_floating_point or ids.dtype.is_complex \
                or ids.dtype == torch.bool:
            raise ValueError(f"ids must be an integer tensor of token ids, got "
                            f"{ids.dtype if isinstance(ids, torch.Tensor) else type(ids).__name__}")
        ids = ids.reshape(-1)
        if ids.dtype != torch.long or not ids.is_contiguous():
            ids = ids.long().contiguous()
        if ids.numel() != self.batch:
            raise ValueError(f"ids must hold one token per row (B={self.batch}), got shape {tuple(ids.shape)}")
        if not self._in_sync():  # an eager step (or another writer) moved the cache on: a plan of it as it is
            self._build(self.model, self.cache, self._reserve)
        cache = self.cache
        if cache.seen is None:  # positions count on one side, the cache's (module doc)
            self.positions.fill_(cache.length)
        else:
            self.positions.copy_(cache.seen)
        self.plan.step(ids, self.positions, cache.length)
        for update in self._after:
            update()
        for counter in (cache, *(getattr(lc, "attn", lc) for lc in cache.layers)):
            counter.advance(1, None)
        self._reserve = max(self._reserve - 1, 0)
        self._synced = self._cache_parts()
        return self.logits

    def weight_streaming(self) -> None:
        """Every matrix-vector product of a step once, nothing else (for timing)."""
        self.plan.stream()

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights a step reads."""
        return int(self.plan.weight_bytes())


__all__ = ["FusedDecoder", "fused_decoding_obstacle"]
