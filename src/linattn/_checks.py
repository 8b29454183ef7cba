"""Argument checks shared by every part of linattn: each error names the argument, what was expected
and what came, so a user never sees a bare broadcasting error from deep inside.

Generic values (ints, numbers, bools, choices, device names) raise ValueError by default: config
validation and the command line report ValueErrors as one clear line. Tensor checks raise TypeError
for a wrong type or dtype and ValueError for a wrong shape or device."""

from __future__ import annotations

import dataclasses
import math

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_tensor(name: str, x, ndim: int | None = None) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if ndim is not None and x.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions (B, H, N, D), got shape {tuple(x.shape)}")


def check_floating(name: str, x, shape: tuple, form: str, device: torch.device, owner: str = "q") -> None:
    """x is a floating torch.Tensor of `shape` (written `form` in the messages, e.g. "[B, T, HV]") on
    `device`, `owner`'s."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {form}, got {type(x).__name__}")
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {form} = {tuple(shape)}, got {tuple(x.shape)}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating tensor, got dtype {x.dtype}")
    if x.device != device:
        raise ValueError(f"{name} must be on {owner}'s device ({device}), got {x.device}")


def _qkv_ok(q, k, v) -> bool:
    """The common case in one expression (a decoding step calls the checks for every token)."""
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)):
        return False
    qs, ks, vs = q.shape, k.shape, v.shape
    return (len(qs) == 4 and len(ks) == 4 and len(vs) == 4 and q.dtype in FLOAT_DTYPES
            and q.dtype == k.dtype == v.dtype and qs[0] == ks[0] == vs[0] and qs[1] == ks[1] == vs[1]
            and ks[2] == vs[2] and ks[3] == qs[3] and q.device == k.device == v.device and not q.is_meta)


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """q: (B, H, Nq, Dq), k: (B, H, Nk, Dq), v: (B, H, Nk, E); same dtype and device."""
    if _qkv_ok(q, k, v):
        return
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, x, 4)
        if x.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} must be a floating tensor, got dtype {x.dtype}")
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name}.dtype must equal q.dtype ({q.dtype}), got {x.dtype}")
        if x.device != q.device:
            raise ValueError(f"{name} must be on q's device ({q.device}), got {x.device}")
        if x.shape[:2] != q.shape[:2]:
            raise ValueError(
                f"{name} batch and heads (B, H) must match q's {tuple(q.shape[:2])}, got {tuple(x.shape[:2])}"
            )
    if k.shape[2] != v.shape[2]:
        raise ValueError(f"v must have the same sequence length as k ({k.shape[2]}), got {v.shape[2]}")
    if k.shape[3] != q.shape[3]:
        raise ValueError(f"k head dim must equal q's ({q.shape[3]}), got {k.shape[3]}")
    if q.is_meta:
        raise ValueError("q, k, v are on the meta device: the operators compute values; pass tensors on the CPU or a "
                         "GPU (for shapes only, run the model under torch.device('meta') without calling it)")


def is_int(value) -> bool:
    """An int that is not a bool (True is an int to Python, never to a config)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    """An int or float that is not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_int(name: str, value, *, minimum: int | None = None, below: int | None = None, allow_none: bool = False,
              error: type[Exception] = ValueError) -> None:
    """value is an int (not a bool) in [minimum, below) (either bound optional), or None with allow_none.

    Message: "<name> must be [None or ]an int[ >= minimum | in [minimum, below)], got <value>"."""
    if value is None and allow_none:
        return
    if is_int(value) and (minimum is None or value >= minimum) and (below is None or value < below):
        return
    if minimum is not None and below is not None:
        bounds = f" in [{minimum}, {below})"
    elif minimum is not None:
        bounds = f" >= {minimum}"
    else:
        bounds = "" if below is None else f" < {below}"
    raise error(f"{name} must be {'None or ' if allow_none else ''}an int{bounds}, got {value!r}")


#: Seeds are 64-bit signed integers: torch.Generator.manual_seed takes [−2^63, 2^64), and linattn adds
#: offsets to a seed (per layer, per redraw), so a seed must leave room for them.
SEED_BOUND = 2**63


def check_seed(name: str, value) -> None:
    """value is an int in [−2^63, 2^63) (SEED_BOUND); 2^64 failed deep inside torch ("Overflow when
    unpacking long long")."""
    check_int(name, value, minimum=-SEED_BOUND, below=SEED_BOUND)


def check_positive_int(name: str, value, *, allow_none: bool = False) -> None:
    """value is an int > 0 (not a bool), or None with allow_none."""
    if value is None and allow_none:
        return
    if not is_int(value) or value <= 0:
        raise ValueError(f"{name} must be a positive int{' or None' if allow_none else ''}, got {value!r}")


def check_number(name: str, value, *, minimum: float | None = None, maximum: float | None = None,
                 low_open: bool = False, high_open: bool = False, allow_none: bool = False) -> None:
    """value is a finite int or float (not a bool) between minimum and maximum (each bound optional,
    closed unless low_open / high_open; NaN and ±inf never pass), or None with allow_none.

    Message: "<name> must be [None or ]a positive number | a number >= m | a number in [m, M), got <value>"."""
    if value is None and allow_none:
        return
    ok = is_number(value) and math.isfinite(value)
    if ok and minimum is not None:
        ok = value > minimum if low_open else value >= minimum
    if ok and maximum is not None:
        ok = value < maximum if high_open else value <= maximum
    if ok:
        return
    if minimum is not None and maximum is not None:
        what = f"a number in {'(' if low_open else '['}{minimum:g}, {maximum:g}{')' if high_open else ']'}"
    elif minimum == 0 and low_open:
        what = "a positive number"
    elif minimum is not None:
        what = f"a number {'>' if low_open else '>='} {minimum:g}"
    elif maximum is not None:
        what = f"a number {'<' if high_open else '<='} {maximum:g}"
    else:
        what = "a number"
    raise ValueError(f"{name} must be {'None or ' if allow_none else ''}{what}, got {value!r}")


def check_bool(name: str, value, *, error: type[Exception] = ValueError) -> None:
    """A real bool: a string such as "False" would otherwise count as true."""
    if value is not True and value is not False:
        raise error(f"{name} must be a bool, got {type(value).__name__} {value!r}")


def check_choice(name: str, value, choices) -> None:
    """value is one of `choices` (a tuple, shown in the message)."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {value!r}")


def check_device(name: str, value) -> None:
    """value names a torch device ('cpu', 'cuda', 'cuda:1', ...) or is 'auto'."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a string such as 'cpu', 'cuda', 'cuda:1' or 'auto', got {value!r}")
    if value != "auto":
        try:
            torch.device(value)
        except RuntimeError:
            raise ValueError(f"{name} must be 'cpu', 'cuda', 'cuda:N' or 'auto', got {value!r}") from None


#: dtype names accepted where a user names a dtype (command line, demo), and the torch dtype of each.
DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype a name of DTYPE_NAMES means."""
    check_choice("dtype", name, tuple(DTYPE_NAMES))
    return DTYPE_NAMES[name]


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """The torch.device a device name means here: 'auto' is cuda when CUDA is available, else cpu;
    'cuda' without an index is this process's GPU (local_rank modulo the GPU count). ValueError when
    CUDA is asked for and not available."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(name)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={name!r} but CUDA is not available; use device='cpu'")
        if dev.index is None:
            dev = torch.device("cuda", local_rank % torch.cuda.device_count())
    return dev


def check_key_padding_mask(mask, batch: int, length: int, device: torch.device) -> None:
    """mask: (B, N) bool, True where the key is a real token that takes part in attention."""
    if mask is None:
        return
    check_tensor("key_padding_mask", mask)
    if mask.dtype != torch.bool:
        raise TypeError(f"key_padding_mask must be a bool tensor (True = keep), got dtype {mask.dtype}")
    if tuple(mask.shape) != (batch, length):
        raise ValueError(f"key_padding_mask must have shape (B, N) = {(batch, length)}, got {tuple(mask.shape)}")
    if mask.device != device:
        raise ValueError(f"key_padding_mask must be on {device}, got {mask.device}")


def check_positions(positions, batch: int, length: int, device: torch.device) -> None:
    """positions: (N,) or (B, N) integer tensor of absolute token indices."""
    if positions is None:
        return
    check_tensor("positions", positions)
    if positions.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"positions must be an integer tensor, got dtype {positions.dtype}")
    if tuple(positions.shape) not in ((length,), (batch, length)):
        raise ValueError(
            f"positions must have shape (N,) = ({length},) or (B, N) = {(batch, length)}, "
            f"got {tuple(positions.shape)}"
        )
    if positions.device != device:
        raise ValueError(f"positions must be on {device}, got {positions.device}")


def check_state(state, batch: int, heads: int, feat: int, value: int, device: torch.device) -> None:
    """state: (kv: (B, H, F, E), z: (B, H, F)), floating, on the inputs' device."""
    if not (isinstance(state, (tuple, list)) and len(state) == 2):
        raise TypeError(f"initial_state must be a tuple (kv, z), got {type(state).__name__}")
    kv, z = state
    if (isinstance(kv, torch.Tensor) and isinstance(z, torch.Tensor) and kv.shape == (batch, heads, feat, value)
            and z.shape == (batch, heads, feat) and kv.is_floating_point() and z.is_floating_point()
            and kv.device == device and z.device == device):
        return
    check_tensor("initial_state[0] (kv)", kv)
    check_tensor("initial_state[1] (z)", z)
    if tuple(kv.shape) != (batch, heads, feat, value):
        raise ValueError(
            f"initial_state kv must have shape (B, H, F, E) = {(batch, heads, feat, value)}, got {tuple(kv.shape)}"
            + (f" (F of the state {kv.shape[2]} != F of the features {feat})" if kv.dim() == 4 and kv.shape[2] != feat else "")
        )
    if tuple(z.shape) != (batch, heads, feat):
        raise ValueError(f"initial_state z must have shape (B, H, F) = {(batch, heads, feat)}, got {tuple(z.shape)}")
    for name, t in (("kv", kv), ("z", z)):
        if not t.is_floating_point():
            raise TypeError(f"initial_state {name} must be floating, got {t.dtype}")
        if t.device != device:
            raise ValueError(f"initial_state {name} must be on {device}, got {t.device}")


def dataclass_from_dict(cls, d, what: str):
    """cls(**d) for a dataclass, refusing a non-dict and unknown keys with a message naming them."""
    if not isinstance(d, dict):
        raise ValueError(f"a {what} must be a dict (a table/object), got {type(d).__name__}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ValueError(f"unknown {what} fields {unknown}; known fields are {sorted(known)}")
    return cls(**d)


def check_output_folder(name: str, path) -> None:
    """`path` can be (or already is) a folder: nothing on the way to it is an existing file. The
    message starts with `name` (e.g. "out_dir") unless it is empty."""
    from pathlib import Path

    p = Path(path)
    for part in (p, *p.parents):
        if part.exists():
            if not part.is_dir():
                what = "is a file" if part == p else f"lies under {str(part)!r}, which is a file"
                prefix = f"{name} " if name else ""
                raise ValueError(f"{prefix}{str(p)!r} {what}, not a folder: pass a folder (created if missing)")
            return


def check_sizes(q: torch.Tensor, v: torch.Tensor) -> None:
    """q (B, H, N, D), v (B, H, N, E) with B, H, D, E >= 1 (linear attention has no empty heads or features:
    a zero dim once gave uninitialized memory or a bare reshape error). Call after `check_qkv`."""
    if q.shape[0] < 1 or q.shape[1] < 1:
        raise ValueError(f"q, k, v must have batch B >= 1 and heads H >= 1, got shape {tuple(q.shape)}")
    if q.shape[3] < 1:
        raise ValueError(f"q and k must have a head dim D >= 1, got shape {tuple(q.shape)}")
    if v.shape[3] < 1:
        raise ValueError(f"v must have a value dim E >= 1, got shape {tuple(v.shape)}")


def check_per_token(name: str, x, q: torch.Tensor, shape: tuple, form: str) -> None:
    """A per-token tensor beside q (a gate, β): `check_floating` against q's device."""
    check_floating(name, x, shape, form, q.device)


def check_eps(name: str, value) -> None:
    """A finite real number >= 0 (an int or float, not a bool or a string)."""
    if type(value) is float and 0.0 <= value < math.inf:  # the common case first (a decoding step checks it)
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a finite float >= 0, got {value!r} ({type(value).__name__})")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite float >= 0, got {value!r}")


def check_state_dtype(state, dtype: torch.dtype, expected: torch.dtype) -> None:
    """The state (kv, z) is in `expected`, the state dtype of `dtype` inputs (see ops.chunked.state_dtype):
    a lower precision would accumulate in it, a higher one is not what the operators return."""
    kv, z = state
    if kv.dtype is not expected or z.dtype is not expected:
        raise TypeError(f"initial_state must be (kv, z) in {expected} for {dtype} inputs, "
                        f"got kv {kv.dtype} and z {z.dtype}")


def narrowed_gates(g: torch.Tensor, dtype: torch.dtype, check) -> torch.Tensor:
    """g in `dtype` for a fused kernel that checks the gates as it reads them. A wider g (float64 for a
    float32 state) is checked here first (`check(g)`: rounding would turn a finite value below the
    narrower range into −∞, which the kernel refuses) and clamped to dtype's lowest finite value (its
    decay e^g is 0 either way)."""
    if g.dtype == dtype:
        return g
    if torch.finfo(g.dtype).bits > torch.finfo(dtype).bits:
        check(g)
        return g.clamp(min=torch.finfo(dtype).min).to(dtype)
    return g.to(dtype)
