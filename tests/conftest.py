import os

import pytest
import torch
from hypothesis import settings

# CI runs every property test on the same examples (CI=true there); a local run keeps exploring
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(params=["bf16", "fp32"])
def bf16_path(request, monkeypatch):
    """Runs a test on each way of multiplying bf16 inputs (LINATTN_BF16_PATH, linattn.ops.precision):
    bf16 gemms, and fp32 gemms on blocks widened in cache. Returns the mode."""
    monkeypatch.setenv("LINATTN_BF16_PATH", request.param)
    return request.param


def oracle(q, k, v, *, causal, feature_map=None, normalize=True, eps=1e-6, scale=None, key_padding_mask=None,
           initial_state=None, positions=None, rope=None):
    """Quadratic float64-friendly oracle for linattn.ops.linear_attention built from the definitions."""
    from linattn.ops.linear import reference

    n = k.shape[2]
    if positions is None:
        positions = torch.arange(n)
    qs = q if scale is None else q * scale
    qf = qs if feature_map is None else feature_map(qs, is_query=True, positions=positions)
    kf = k if feature_map is None else feature_map(k, is_query=False, positions=positions)
    if rope is None:
        return reference.kernel_attention(qf, kf, v, causal=causal, normalize=normalize, eps=eps,
                                          key_padding_mask=key_padding_mask, initial_state=initial_state)
    return reference.kernel_attention(rope.rotate(qf, positions), rope.rotate(kf, positions), v, causal=causal,
                                      normalize=normalize, eps=eps, key_padding_mask=key_padding_mask,
                                      initial_state=initial_state, qf_den=qf, kf_den=kf)


def explicit_rotation(x, positions, base=10_000.0):
    """RoPE written pair by pair in float64: (x_m, x_{m+P}), P = ⌊F/2⌋, rotated by position·base^(−m/P)
    (positions (N,)); an odd last feature kept. Independent of linattn.nn.positional."""
    f = x.shape[-1]
    p = f // 2
    out = x.clone()
    for m in range(p):
        theta = positions.double() * base ** (-m / p)
        c, s = torch.cos(theta).to(x.dtype), torch.sin(theta).to(x.dtype)
        a, b = x[..., :, m], x[..., :, m + p]
        out[..., :, m] = a * c - b * s
        out[..., :, m + p] = a * s + b * c
    return out


def numbers(obj):
    """Every int/float inside nested dicts and lists (for checking that reports hold finite numbers)."""
    if isinstance(obj, dict):
        for v in obj.values():
            yield from numbers(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from numbers(v)
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        yield obj


def check_png(path):
    """The file is a real PNG image of a plausible size."""
    import matplotlib.image

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", path
    img = matplotlib.image.imread(path)
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100, path


def spread(module, seed=0, scale=0.3):
    """Re-draws every parameter (norm gains around 1) so that attention patterns are far from uniform."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * scale + (1.0 if "norm" in name else 0.0))
    return module


def tiny_config(**kw):
    """A small ModelConfig for model tests (vocab 40, d 32, 2 layers, 4 heads); `kw` overrides fields."""
    from linattn.models import ModelConfig

    return ModelConfig(**{**dict(vocab_size=40, d_model=32, n_layers=2, n_heads=4, d_ff=48, max_len=64), **kw})


def select_op_path(path: str, monkeypatch) -> None:
    """Makes the operators take one CPU path for a test: "fused" (the C++ kernels; skipped where they
    could not be built) or "torch ops" (LINATTN_NATIVE=0, the torch-op autograd Functions)."""
    from linattn.ops import native

    if path == "fused" and not native.available():
        pytest.skip("the fused CPU kernels could not be built here")
    monkeypatch.setenv("LINATTN_NATIVE", "1" if path == "fused" else "0")


@pytest.fixture(params=["fused", "torch ops"])
def op_path(request, monkeypatch):
    """Runs a test on both CPU paths of the operators (select_op_path); returns the path."""
    select_op_path(request.param, monkeypatch)
    return request.param


@pytest.fixture
def one_thread():
    """Tiny tensors: one thread avoids OpenMP hand-off costs on a shared 2-core machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1234)


def raises_on_threads(error, match: str, calls, threads=(1, 2)) -> None:
    """Each of `calls` (no-argument functions) raises `error` matching `match`, on every torch thread
    count of `threads` (the count is restored after)."""
    before = torch.get_num_threads()
    try:
        for n in threads:
            torch.set_num_threads(n)
            for call in calls:
                with pytest.raises(error, match=match):
                    call()
    finally:
        torch.set_num_threads(before)
