"""Optional third-party causal linear attention implementations, as extra benchmark columns.

Each peer gets the same elu+1 features and is normalized the same way as linattn's op. A peer that
is not importable (or cannot run on the device) is skipped with a note saying why and how to get it.

    fast_transformers   fast_transformers.causal_product.causal_dot_product (C++/CUDA kernel)
    performer_pytorch   performer_pytorch.performer_pytorch.causal_linear_attention_noncuda
    fla                 fla.ops.linear_attn.chunk_linear_attn (Triton; CUDA only)
"""

from __future__ import annotations

import importlib.util
import inspect

import torch

from ..nn.feature_maps import EluPlusOne
from .methods import Method

EPS = 1e-6


def _fast_transformers(fm):
    from fast_transformers.causal_product import causal_dot_product

    def run(q, k, v):
        qf, kf = fm(q, is_query=True), fm(k, is_query=False)
        num = causal_dot_product(qf.contiguous(), kf.contiguous(), v.contiguous())  # (B, H, N, E)
        den = (qf * kf.cumsum(2)).sum(-1, keepdim=True)
        return num / (den + EPS)

    return run


def _performer(fm):
    from performer_pytorch.performer_pytorch import causal_linear_attention_noncuda

    def run(q, k, v):
        return causal_linear_attention_noncuda(fm(q, is_query=True), fm(k, is_query=False), v, eps=EPS)

    return run


def _fla(fm):
    from fla.ops.linear_attn import chunk_linear_attn

    params = inspect.signature(chunk_linear_attn).parameters
    extra = {"head_first": False} if "head_first" in params else {}

    def run(q, k, v):
        # fla takes (B, T, H, ·); scale 1 (normalization cancels it anyway)
        qf, kf = fm(q, is_query=True).transpose(1, 2), fm(k, is_query=False).transpose(1, 2)
        o, _ = chunk_linear_attn(qf, kf, v.transpose(1, 2), scale=1.0, normalize=True, **extra)
        return o.transpose(1, 2)

    return run


PEERS = {
    "fast_transformers": (_fast_transformers, "pip install pytorch-fast-transformers", False),
    "performer_pytorch": (_performer, "pip install performer-pytorch", False),
    "fla": (_fla, "pip install flash-linear-attention (needs CUDA and Triton)", True),
}


def peer_methods(device: torch.device, head_dim: int = 64, names=None) -> tuple[list[Method], list[str]]:
    """The importable peers as Methods, and one note per skipped peer."""
    fm = EluPlusOne(head_dim)
    methods, notes = [], []
    for name in names or PEERS:
        build, how, cuda_only = PEERS[name]
        if importlib.util.find_spec(name) is None:
            notes.append(f"peer {name}: not installed, skipped ({how})")
            continue
        if cuda_only and torch.device(device).type != "cuda":
            notes.append(f"peer {name}: needs CUDA, skipped on {device}")
            continue
        try:
            methods.append(Method(f"peer_{name}", name, build(fm)))
        except Exception as exc:  # a broken install must not stop the benchmark
            notes.append(f"peer {name}: import failed ({type(exc).__name__}: {exc}), skipped")
    return methods, notes
