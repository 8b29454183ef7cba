"""The argument checks of the one-token steps, run once per call signature.

A decoding loop calls a step with tensors of the same shapes, dtypes and devices at every token; the
checks of shapes, dtypes, devices and options (which name the argument on a mistake) depend on
nothing else, so a signature that passed them once need not pass them again. Values are not part of
a signature: the checks they need (g ≤ 0 and finite, …) run at every call, in the fused kernels or
in Python. The cache is bounded (SIZE signatures, the oldest dropped).

`check_inplace` and `write_into` serve the steps' `inplace=True` (decoding without a new state tensor
per token): the fused CPU steps update the state themselves; the other paths compute the new state
and copy it into the given one.

    key = signature("gated", state, q, k, v, g, feature_map, scale, normalize, eps)
    if not seen(key):
        ...the full checks...
        remember(key)
"""

from __future__ import annotations

from collections import OrderedDict

import torch

__all__ = ["SIZE", "check_inplace", "clear", "note", "noted", "remember", "seen", "signature", "write_into"]

SIZE = 256
_SEEN: OrderedDict = OrderedDict()


_TENSOR = torch.Tensor
_PLAIN = frozenset((type(None), bool, int, float, str))


def _module_part(x) -> tuple:
    """A feature map or RoPE: its kind and sizes, not its (trainable) values."""
    dim = getattr(x, "dim", None)
    return (type(x), getattr(x, "head_dim", None), getattr(x, "feature_dim", None), dim if isinstance(dim, int) else None)


def _add(out: list, x) -> None:
    if isinstance(x, _TENSOR):
        out += (x.shape, x.dtype, x.device, x.requires_grad)
    elif type(x) in _PLAIN:
        out += (type(x), x)
    elif isinstance(x, (tuple, list)):
        out += (type(x), len(x))
        for y in x:
            _add(out, y)
    elif isinstance(x, torch.nn.Module):
        out.append(_module_part(x))
    else:
        out += (type(x), id(x))


def signature(*parts) -> tuple | None:
    """What the checks depend on, as one flat tuple (cheap to build and hash: a step pays it at
    every token): each tensor's shape, dtype, device and requires_grad, the type and sizes of a
    feature map, options by value (with their types: 1 and True differ); None (never cached) while
    torch.compile traces."""
    if torch.compiler.is_compiling():
        return None
    out: list = []
    add = out.append
    for x in parts:  # the common cases inline (a function call per part costs what they do)
        t = type(x)
        if t is _TENSOR:
            add((x.shape, x.dtype, x.device, x.requires_grad))
        elif t in _PLAIN:
            add((t, x))
        else:
            _add(out, x)
    return tuple(out)  # hashable: every entry above is


def seen(key) -> bool:
    return key is not None and key in _SEEN


def note(key, name: str, value) -> None:
    """Keeps a decision that depends on nothing but the signature (a fused kernel's code, say) beside
    a remembered key; `noted` reads it back (None when there is none)."""
    if key is not None and key in _SEEN:
        _SEEN[key] = {**(_SEEN[key] if isinstance(_SEEN[key], dict) else {}), name: value}


def noted(key, name: str):
    got = _SEEN.get(key) if key is not None else None
    return got.get(name) if isinstance(got, dict) else None


def remember(key) -> None:
    """Adds key; beyond SIZE signatures the oldest is dropped (it is checked again if it comes back)."""
    if key is None:
        return
    _SEEN[key] = True
    while len(_SEEN) > SIZE:
        _SEEN.popitem(last=False)


def clear() -> None:
    _SEEN.clear()


def _leaves(state):
    return [x for x in (state if isinstance(state, (tuple, list)) else (state,)) if x is not None]


def check_inplace(state, *inputs) -> None:
    """ValueError unless `state` (a tensor or a tuple of them) can be updated in place by a step: given,
    and no gradient wanted of it or of the inputs (an update in place is not differentiable)."""
    if state is None:
        raise ValueError("inplace=True needs a state to update (got None)")
    if not torch.is_grad_enabled():  # decoding under no_grad / inference_mode: nothing can want a gradient
        return
    tensors = _leaves(state) + [x for x in inputs if isinstance(x, torch.Tensor)]
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        raise ValueError("inplace=True updates the state without autograd: no input may require a gradient "
                         "(use inplace=False, or torch.no_grad())")


def write_into(state, new_state):
    """Copies new_state into state (tensor for tensor, in a tuple too; nothing where the step already
    updated it) and returns state."""
    if new_state is state:
        return state
    pairs = [(dst, src) for dst, src in zip(_leaves(state), _leaves(new_state)) if dst is not src]
    if pairs:
        with torch.no_grad():
            for dst, src in pairs:
                dst.copy_(src)
    return state
