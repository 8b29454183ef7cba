"""transformers' linear-attention models on linattn's kernels: use_linattn_kernels() / undo.

transformers runs the Gated DeltaNet layers of Qwen3.5, Qwen3-Next and OLMo-Hybrid and the KDA
layers of Kimi Linear through module-level functions of each modeling file — the chunked and the
recurrent rule, Dao's `causal_conv1d_fn` / `causal_conv1d_update` for the short convolution — that
fall back to plain torch (or, where the `fla` package imports, to FLA's Triton kernels, which need a
GPU). `use_linattn_kernels()` rebinds those module globals to linattn.compat.fla (FLA's API on
linattn's CPU operators, design §18), so the layers' own code runs unchanged on linattn:

    import linattn.hf
    patch = linattn.hf.use_linattn_kernels()      # every listed model type that transformers has
    model(input_ids)                             # prefill, decoding steps, training, packed rows
    patch.undo()                                 # (or `with linattn.hf.use_linattn_kernels(): ...`)

What the adapters add to a plain rebinding (the same things transformers' hub wrapper does for a
package implementation, plus packing):
- keyword arguments the compat function does not name are dropped (the layers pass their whole
  **kwargs: use_cache, the flash-attention keys, …), as transformers' wrapper does;
- packed rows: `cu_seq_lens_q` (transformers' name, from DataCollatorWithFlattening with
  return_flash_attn_kwargs) becomes `cu_seqlens` for the rule, and the short convolution runs
  each packed sequence by itself (zeros before its first token, design §17);
- padding-free rows described only by `position_ids` restarting at 0 (batch 1): each decoder layer
  class gets a `__call__` that derives `cu_seq_lens_q` from them under the condition transformers'
  mask builder reads them as documents (no cache, no 2-D padding mask; `masking_utils`), so the
  linear layers keep documents apart exactly when transformers' full-attention layers do (their
  block-diagonal mask). That is training and `use_cache=False`. With a cache (`generate`, a prefill
  with `use_cache=True`) a row is one sequence in every layer: transformers' full-attention layers
  then mix the documents of a packed row (their business, not linattn's; the decode that follows
  works and equals transformers' own path), and a left-padded prompt's position_ids
  [0, 0, 0, 0, 1, …] are pads, not documents. The layers' `forward` is left alone: transformers
  wraps it so that it checkpoints only while it is the class's outermost forward, and replacing it
  turned gradient checkpointing off (issue 37 item 22).

OLMo-Hybrid's linear_allow_neg_eigval (the default there: β doubled into (0, 2), negative eigenvalues)
runs on linattn's kernels like every other call, packed rows included (the delta family takes
β ∈ [0, 2]).

Where a transformers release renames or moves one of the functions (or the decoder layer) this
module rebinds, use_linattn_kernels raises KernelPatchError naming it and the transformers version,
rather than leave the slow path in place without a word.

Numbers do not change beyond fp32 rounding: tests/test_hf_kernels.py compares logits, greedy
tokens and gradients with transformers' torch fallbacks on tiny random configs.
"""

from __future__ import annotations

import functools
import importlib
import inspect

import torch

from ..ops.packed import cu_seqlens_from_position_ids

#: model type -> transformers module, and {module global: linattn.compat.fla function}
_GDN = {
    "torch_chunk_gated_delta_rule": "chunk_gated_delta_rule",
    "torch_recurrent_gated_delta_rule": "fused_recurrent_gated_delta_rule",
    "causal_conv1d_fn": "causal_conv1d_fn",
    "causal_conv1d_update": "causal_conv1d_update",
}
_KDA = {
    "chunk_kimi_delta_attention": "chunk_kda",
    "recurrent_kimi_delta_attention": "fused_recurrent_kda",
    "causal_conv1d_fn": "causal_conv1d_fn",
    "causal_conv1d_update": "causal_conv1d_update",
}
MODEL_TYPES = {
    "qwen3_5": ("transformers.models.qwen3_5.modeling_qwen3_5", _GDN),
    "qwen3_next": ("transformers.models.qwen3_next.modeling_qwen3_next", _GDN),
    "olmo_hybrid": ("transformers.models.olmo_hybrid.modeling_olmo_hybrid", _GDN),
    "kimi_linear": ("transformers.models.kimi_linear.modeling_kimi_linear", _KDA),
}


def _compat(name: str):
    """linattn.compat.fla's function `name` (None where it has none)."""
    return getattr(importlib.import_module("linattn.compat.fla"), name, None)


def _named_params(fn) -> frozenset:
    return frozenset(p.name for p in inspect.signature(fn).parameters.values()
                     if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL))


def _packing(kwargs: dict) -> torch.Tensor | None:
    """cu_seqlens (long) from transformers' cu_seq_lens_q or an explicit cu_seqlens, popped."""
    cu = kwargs.pop("cu_seqlens", None)
    alt = kwargs.pop("cu_seq_lens_q", None)
    cu = alt if cu is None else cu
    return None if cu is None else cu.long()


def _rule_adapter(fn):
    """The chunked / recurrent rule: unknown keywords dropped, cu_seq_lens_q → cu_seqlens. Every β
    the layers pass runs on linattn, β ∈ (0, 2) of OLMo-Hybrid's linear_allow_neg_eigval included (the
    delta family takes β ∈ [0, 2], design §13.2)."""
    names = _named_params(fn)

    @functools.wraps(fn)
    def rule(*args, **kwargs):
        cu = _packing(kwargs)
        kwargs = {k: v for k, v in kwargs.items() if k in names}
        if cu is not None:
            kwargs["cu_seqlens"] = cu
        return fn(*args, **kwargs)

    rule.linattn_kernel = fn
    return rule


def _conv_adapter(fn):
    """causal_conv1d_fn(x (B, C, L), weight, bias, activation, …): unknown keywords dropped; with
    cu_seqlens (batch 1) each packed sequence is convolved by itself."""
    names = _named_params(fn)

    @functools.wraps(fn)
    def conv(x, *args, **kwargs):
        cu = _packing(kwargs)
        kwargs = {k: v for k, v in kwargs.items() if k in names}
        if cu is None:
            return fn(x, *args, **kwargs)
        if x.shape[0] != 1 or int(cu[-1]) != x.shape[-1]:
            raise ValueError(f"cu_seqlens: packed rows are batch 1 with cu_seqlens[-1] = L = {x.shape[-1]}, got "
                             f"x of shape {tuple(x.shape)} and cu_seqlens[-1] = {int(cu[-1])}")
        bounds = cu.tolist()
        parts = [fn(x[..., a:b], *args, **kwargs) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
        return torch.cat(parts, -1)

    conv.linattn_kernel = fn
    return conv


def _update_adapter(fn):
    """causal_conv1d_update: unknown keywords dropped (it takes no packed rows)."""
    names = _named_params(fn)

    @functools.wraps(fn)
    def update(*args, **kwargs):
        return fn(*args, **{k: v for k, v in kwargs.items() if k in names})

    update.linattn_kernel = fn
    return update


_ADAPTERS = {"causal_conv1d_fn": _conv_adapter, "causal_conv1d_update": _update_adapter}


def _documents(kwargs: dict) -> torch.Tensor | None:
    """cu_seq_lens_q for a decoder-layer call read as transformers' mask builder reads position_ids
    (masking_utils: packed documents only without a cache and without a 2-D padding mask): the
    documents of one row whose position_ids restart, or None. With a cache (generation, a prefill
    with use_cache=True) a row is one sequence, pads included: transformers' full-attention layers
    see it so, and so do the linear ones (a left-padded prompt's [0, 0, 0, 0, 1, …] are pads)."""
    if kwargs.get("cu_seq_lens_q") is not None or kwargs.get("position_ids") is None:
        return None
    if kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None:
        return None
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:  # a linear layer's padding mask: pads, not documents
        return None
    return cu_seqlens_from_position_ids(kwargs["position_ids"])


def _layer_call_adapter(call):
    """A decoder layer class's __call__ that adds cu_seq_lens_q (`_documents`) and then calls `call`
    (nn.Module's): the layer's forward stays transformers' own, whose wrapper checkpoints only while
    it is the class's outermost forward (GradientCheckpointingLayer), so gradient checkpointing keeps
    working under the patch."""

    @functools.wraps(call)
    def layer_call(self, *args, **kwargs):
        cu = _documents(kwargs)
        if cu is not None:
            kwargs["cu_seq_lens_q"] = cu
        return call(self, *args, **kwargs)

    layer_call.linattn_kernel = call
    return layer_call


#: (id(owner), name) -> [owner, name, original, number of active patches holding it]
_BOUND: dict[tuple[int, str], list] = {}
#: the "original" of a class attribute the class did not define itself
_INHERITED = object()


class KernelPatchError(RuntimeError):
    """transformers no longer has a function (or module, or decoder layer) that use_linattn_kernels
    rebinds: it was renamed or moved in this transformers release. Raised instead of leaving the slow
    path in place silently; nothing stays patched."""


class KernelPatch:
    """What use_linattn_kernels changed: `patched` {model type: [names]}; undo() releases them
    (idempotent): a name gets its original back once no active patch holds it, whatever the order
    patches are undone in. A context manager."""

    def __init__(self):
        self._keys: list[tuple[int, str]] = []
        self.patched: dict[str, list[str]] = {}

    def _set(self, owner, name: str, value) -> None:
        key = (id(owner), name)
        entry = _BOUND.get(key)
        if entry is None:  # a class attribute it only inherits (__call__) is _INHERITED: deleted again on undo
            original = owner.__dict__.get(name, _INHERITED) if isinstance(owner, type) else getattr(owner, name)
            entry = _BOUND[key] = [owner, name, original, 0]
            setattr(owner, name, value)
        entry[3] += 1
        self._keys.append(key)

    def undo(self) -> None:
        while self._keys:
            key = self._keys.pop()
            entry = _BOUND[key]
            entry[3] -= 1
            if entry[3] == 0:
                owner, name, original, _ = _BOUND.pop(key)
                if original is _INHERITED:
                    delattr(owner, name)
                else:
                    setattr(owner, name, original)
        _ACTIVE.discard(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.undo()
        return False

    def __repr__(self) -> str:
        return f"KernelPatch(patched={sorted(self.patched)})"


_ACTIVE: set = set()


def _missing(what: str) -> KernelPatchError:
    from transformers import __version__

    return KernelPatchError(f"use_linattn_kernels: {what} in transformers {__version__}: renamed or moved "
                            "in this release, so linattn cannot rebind it (the layers would silently keep "
                            "transformers' slow path); use the transformers versions linattn is tested with "
                            "(pyproject.toml) or report it")


def _plan_module(model_type: str, module, names: dict) -> list:
    """[(owner, name, replacement)] for one modeling module; KernelPatchError before anything is
    rebound when a function or the decoder layer is not where linattn expects it."""
    plan = []
    for glob, compat_name in names.items():
        fn = _compat(compat_name)
        if fn is None:
            raise KernelPatchError(f"use_linattn_kernels({model_type!r}): linattn.compat.fla has no {compat_name}")
        if not hasattr(module, glob):
            raise _missing(f"{module.__name__} has no function {glob!r} ({model_type})")
        adapter = _ADAPTERS.get(compat_name)
        plan.append((module, glob, (adapter or _rule_adapter)(fn)))
    layers = [cls for cls in vars(module).values() if isinstance(cls, type) and cls.__module__ == module.__name__
              and cls.__name__.endswith("DecoderLayer") and "forward" in cls.__dict__]
    if not layers:
        raise _missing(f"{module.__name__} has no *DecoderLayer class with a forward ({model_type}; linattn derives "
                       "packed documents from position_ids there)")
    plan += [(cls, "__call__", _layer_call_adapter(cls.__call__)) for cls in layers]
    return plan


def use_linattn_kernels(model_types=None) -> KernelPatch:
    """Rebinds the gated-delta-rule / KDA and short-convolution functions of transformers'
    modeling files to linattn.compat.fla (module docstring). model_types: names from
    MODEL_TYPES (None: all). Where the installed transformers lacks a modeling module, a function
    or the decoder layer that linattn rebinds (renamed or moved), KernelPatchError names it and the
    transformers version, and nothing is patched. Returns a KernelPatch; undo() (or leaving its
    `with` block) restores the original functions. Models already built pick the change up at their
    next call (the layers look the functions up at call time)."""
    if model_types is None:
        model_types = list(MODEL_TYPES)
    elif isinstance(model_types, str):
        model_types = [model_types]
    unknown = [m for m in model_types if m not in MODEL_TYPES]
    if unknown:
        raise ValueError(f"model_types: unknown {unknown}; known {sorted(MODEL_TYPES)}")
    plans = {}
    for model_type in model_types:
        path, names = MODEL_TYPES[model_type]
        try:
            module = importlib.import_module(path)
        except ImportError as exc:
            raise _missing(f"the modeling module {path} does not import ({exc.__class__.__name__}: {exc})") from exc
        plans[model_type] = _plan_module(model_type, module, names)
    patch = KernelPatch()
    for model_type, plan in plans.items():
        for owner, name, value in plan:
            patch._set(owner, name, value)
        patch.patched[model_type] = [f"{o.__name__}.{n}" if isinstance(o, type) else n for o, n, _ in plan]
    _ACTIVE.add(patch)
    return patch


def undo_linattn_kernels() -> None:
    """Undoes every patch that use_linattn_kernels made and that is still active."""
    for patch in sorted(_ACTIVE, key=id, reverse=True):
        patch.undo()


__all__ = ["KernelPatch", "KernelPatchError", "MODEL_TYPES", "cu_seqlens_from_position_ids", "undo_linattn_kernels",
           "use_linattn_kernels"]
