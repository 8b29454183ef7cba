"""Shared pieces of tests/test_compat_fla*.py: the peers' own reference code (FLA's
`fla.ops.<family>.naive`, transformers' undecorated torch fallbacks), skipped cleanly when a peer is
not installed, random inputs in FLA's [B, T, H, D] layout, and the comparison rule.

FLA's naive references and transformers' fallbacks cast their inputs to float32 (`.float()`,
`.to(torch.float32)`), so they are compared in float32: the compat function runs in float64 on the
same (float32-representable) inputs and the difference must stay at float32 rounding (FP32, relative
to the largest reference entry). The few that keep float64 (`naive_chunk_linear_attn`,
`delta_rule_chunkwise`, transformers' convolution fallbacks) are compared at F64.
"""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
import torch.nn.functional as F

FP32 = 2e-5  # float32 rounding over a few dozen tokens, relative to max |reference|
F64 = 1e-12


def peer(module: str):
    """The peer module, or a clean skip when its package is missing (FLA warns on a CPU)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pytest.importorskip(module)


def qwen35(name: str):
    """transformers' torch fallback `name` of Qwen3.5, undecorated (the hub-kernel decorator would
    hand it to FLA's Triton kernels when `fla` is installed)."""
    mod = peer("transformers.models.qwen3_5.modeling_qwen3_5")
    return inspect.unwrap(getattr(mod, name))


def close(actual, expected, tol: float, what: str = "") -> None:
    """max |actual − expected| ≤ tol · max(1, max |expected|), compared in float64."""
    a, e = actual.detach().double(), expected.detach().double()
    assert a.shape == e.shape, f"{what}: shape {tuple(a.shape)} vs {tuple(e.shape)}"
    err = (a - e).abs().max().item()
    bound = tol * max(1.0, e.abs().max().item())
    assert err <= bound, f"{what}: max error {err:.3g} > {bound:.3g}"


def make(b=2, t=37, h=2, hv=4, kd=8, vd=6, *, seed=0, dtype=torch.float32, gate="scalar", state=True):
    """q, k [B, T, H, K], v [B, T, HV, V], g (log-sigmoid decays: [B, T, HV] for "scalar", [B, T, HV, K]
    for "vector"), beta (0.1 … 0.9) [B, T, HV], h0 [B, HV, K, V] (or None): float32 values in `dtype`."""
    gen = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=gen)

    gshape = (b, t, hv) if gate == "scalar" else (b, t, hv, kd)
    out = dict(q=r(b, t, h, kd), k=r(b, t, h, kd), v=r(b, t, hv, vd), g=F.logsigmoid(r(*gshape) + 2.0),
               beta=0.1 + 0.8 * torch.rand(b, t, hv, generator=gen), h0=r(b, hv, kd, vd) if state else None)
    return {n: None if x is None else x.to(dtype) for n, x in out.items()}


def grouped(x, hv: int):
    """q or k [B, T, H, K] repeated to HV heads the way GVA reads them (h serves h·G … h·G+G−1)."""
    return x.repeat_interleave(hv // x.shape[2], dim=2)


def leaves(d: dict, dtype=torch.float64) -> dict:
    """Copies of the tensors in d as leaves that want a gradient, in dtype."""
    return {n: None if x is None else x.detach().to(dtype).requires_grad_(True) for n, x in d.items()}


def loss(o, S, seed=1):
    """A scalar through every output entry and the final state, with fixed random weights."""
    gen = torch.Generator().manual_seed(seed)
    wo = torch.randn(o.shape, generator=gen, dtype=torch.float64)
    total = (o.double() * wo).sum()
    if S is not None:
        total = total + (S.double() * torch.randn(S.shape, generator=gen, dtype=torch.float64)).sum()
    return total


def grads(inputs: dict, names) -> list:
    return [inputs[n].grad for n in names]
