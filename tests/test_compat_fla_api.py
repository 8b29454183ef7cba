"""linattn.compat.fla's surface: FLA's signatures (names, order, defaults), refusals that name the
argument, checks in FLA's layout, no import of `fla` on the way in, and the CUDA handover rule."""

import inspect
import subprocess
import sys
import types

import pytest
import torch

from linattn.compat import fla as C
from linattn.compat.fla import _edge

from .compat_fla_peers import make, peer

FAMILIES = {
    "linear_attn": ["chunk_linear_attn", "fused_recurrent_linear_attn"],
    "retention": ["chunk_retention", "fused_recurrent_retention"],
    "simple_gla": ["chunk_simple_gla", "fused_recurrent_simple_gla"],
    "gla": ["chunk_gla", "fused_recurrent_gla"],
    "delta_rule": ["chunk_delta_rule", "fused_recurrent_delta_rule"],
    "gated_delta_rule": ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"],
    "kda": ["chunk_kda", "fused_recurrent_kda"],
}


def _params(fn):
    return [(p.name, p.default, p.kind) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_signatures_are_flas(family):
    mod = peer(f"fla.ops.{family}")
    for name in FAMILIES[family]:
        assert _params(getattr(C, name)) == _params(getattr(mod, name)), name


def test_conv_signatures_are_daos():
    """Dao's causal_conv1d_interface (the CUDA package does not install here): the parameters as
    transformers' Qwen3.5 and Mamba layers pass them."""
    assert [p[0] for p in _params(C.causal_conv1d_fn)] == [
        "x", "weight", "bias", "seq_idx", "initial_states", "return_final_states", "final_states_out", "activation"]
    assert [p[0] for p in _params(C.causal_conv1d_update)] == [
        "x", "conv_state", "weight", "bias", "activation", "cache_seqlens", "conv_state_indices"]


def test_import_does_not_import_fla():
    code = "import sys, linattn.compat.fla; print('fla' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_cpu_tensors_never_hand_over(monkeypatch):
    """The handover needs CUDA tensors: on the CPU the body runs even when the peer is importable."""
    calls = []
    monkeypatch.setattr(_edge, "_importable", lambda package: True)
    monkeypatch.setattr(_edge, "importlib", types.SimpleNamespace(import_module=calls.append))
    x = make(t=5, hv=2)
    o, _ = C.chunk_simple_gla(x["q"], x["k"], x["v"], x["g"])
    assert o.shape == (2, 5, 2, 6) and calls == []
    assert C.chunk_gated_delta_rule.peer == "fla.ops.gated_delta_rule.chunk_gated_delta_rule"


def test_refused_options_name_the_argument():
    x = make(t=4, hv=2)
    q, k, v, g, beta = x["q"], x["k"], x["v"], x["g"], x["beta"]
    cases = [
        (lambda: C.fused_recurrent_linear_attn(q, k, v, reverse=True), "reverse"),
        (lambda: C.fused_recurrent_gla(q, k, v, gv=torch.zeros_like(v)), "gv"),
        (lambda: C.fused_recurrent_gated_delta_rule(q, k, v, g, gk=torch.zeros(2, 4, 2, 8), beta=beta), "gk"),
        (lambda: C.chunk_gated_delta_rule(q, k, v, g, beta, allow_neg_eigval=True), "allow_neg_eigval"),
        (lambda: C.chunk_gated_delta_rule(q, k, v, g, beta, cp_context=object()), "cp_context"),
        (lambda: C.chunk_simple_gla(q, k, v, head_first=True), "head_first"),
        (lambda: C.chunk_simple_gla(q, k, v, g, g_gamma=torch.zeros(2)), "g_gamma"),
        (lambda: C.chunk_gated_delta_rule(q, k, v, g, beta, use_gate_in_kernel=True), "A_log"),
        (lambda: C.causal_conv1d_fn(q[..., 0], torch.randn(4, 3), seq_idx=torch.zeros(2, 2, dtype=torch.int32),
                                    return_final_states=True), "return_final_states"),
        (lambda: C.causal_conv1d_fn(q[..., 0], torch.randn(4, 3), seq_idx=torch.tensor([[0, 1], [1, 0]])),
         "seq_idx must not decrease"),
        (lambda: C.causal_conv1d_update(q[:, 0, 0], torch.zeros(2, 2, 3), torch.randn(2, 4),
                                        cache_seqlens=torch.zeros(2)), "cache_seqlens"),
        (lambda: C.causal_conv1d_fn(q[..., 0], torch.randn(4, 3), activation="gelu"), "activation"),
    ]
    for call, name in cases:
        with pytest.raises(ValueError, match=name):
            call()
    with pytest.raises(TypeError, match="foo"):
        C.chunk_retention(q, k, v, foo=1)
    with pytest.raises(TypeError, match="foo"):
        C.fused_recurrent_gated_delta_rule(q, k, v, g, beta=beta, foo=1)


def test_shape_errors_speak_flas_layout():
    x = make(t=4, hv=4)
    q, k, v, g, beta = x["q"], x["k"], x["v"], x["g"], x["beta"]
    with pytest.raises(ValueError, match=r"v's heads HV = 3 must be a multiple"):
        C.chunk_delta_rule(q, k, v[:, :, :3], beta[:, :, :3])
    with pytest.raises(ValueError, match=r"beta must have shape \[B, T, HV\]"):
        C.chunk_gated_delta_rule(q, k, v, g, beta[:, :, :2])
    with pytest.raises(ValueError, match=r"g must have shape \[B, T, HV, K\]"):
        C.chunk_gla(q, k, v, g)
    with pytest.raises(ValueError, match=r"initial_state must have shape \[N, HV, K, V\]"):
        C.chunk_simple_gla(q, k, v, g, initial_state=torch.zeros(2, 2, 8, 6))
    with pytest.raises(ValueError, match=r"4 dimensions \[B, T, H, D\]"):
        C.chunk_linear_attn(q[0], k, v)
    with pytest.raises(TypeError, match="k must be a floating tensor"):  # mixed floating dtypes run (item 14)
        C.chunk_delta_rule(q, k.long(), v, beta)
    with pytest.raises(TypeError, match="normalize=False"):
        C.chunk_linear_attn(q, k, v, normalize=False, initial_state=(x["h0"], torch.zeros(2, 1, 4, 8)))
    with pytest.raises(ValueError, match=r"z\) must be a tensor \[N, 1, HV, K\]"):
        C.chunk_linear_attn(q, k, v, initial_state=(x["h0"], torch.zeros(2, 4, 8)))
    with pytest.raises(ValueError, match="beta must lie in"):
        C.chunk_delta_rule(q, k, v, beta + 2.0)
    with pytest.raises(ValueError, match=r"conv_state must have shape"):
        C.causal_conv1d_update(q[:, 0, 0], torch.zeros(2, 8, 2), torch.randn(8, 4))


def test_outputs_are_views_in_flas_layout():
    """o comes back [B, T, HV, V] as a transposed view of the operator's (B, HV, T, V) result."""
    x = make(t=6, hv=4)
    o, S = C.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], output_final_state=True)
    assert o.shape == (2, 6, 4, 6) and S.shape == (2, 4, 8, 6)
    assert o.transpose(1, 2).is_contiguous()


class _LooksLikeCuda(torch.Tensor):
    """A CPU tensor that says it is on CUDA (to exercise the handover without a GPU)."""

    @property
    def is_cuda(self):
        return True


def test_cuda_tensors_hand_over_with_the_same_arguments(monkeypatch):
    seen = {}

    def peer_fn(*args, **kwargs):
        seen.update(args=args, kwargs=kwargs)
        return "from the peer"

    modules = {"fla.ops.gated_delta_rule": types.SimpleNamespace(chunk_gated_delta_rule=peer_fn)}
    monkeypatch.setattr(_edge, "_importable", lambda package: package == "fla")
    monkeypatch.setattr(_edge, "importlib", types.SimpleNamespace(import_module=modules.__getitem__))
    x = make(t=3, hv=2)
    q = torch.Tensor._make_subclass(_LooksLikeCuda, x["q"])
    out = C.chunk_gated_delta_rule(q, x["k"], x["v"], x["g"], x["beta"], use_qk_l2norm_in_kernel=True)
    assert out == "from the peer" and seen["args"][0] is q and seen["kwargs"] == {"use_qk_l2norm_in_kernel": True}
    monkeypatch.setenv(_edge.HANDOVER_ENV, "0")
    o, _ = C.chunk_gated_delta_rule(q, x["k"], x["v"], x["g"], x["beta"])  # LINATTN_COMPAT_FLA=0: linattn runs
    assert isinstance(o, torch.Tensor) and o.shape == (2, 3, 2, 6)


@pytest.mark.parametrize("name", ["chunk_kda", "fused_recurrent_kda"])
def test_kda_hands_over_on_cuda_as_every_function(monkeypatch, name):
    """compat.fla's KDA functions go through _edge like the others: on CUDA tensors with `fla` importable
    the call is FLA's own `fla.ops.kda.<name>` with the same arguments (issue 32; before: never)."""
    seen = {}

    def peer_fn(*args, **kwargs):
        seen.update(args=args, kwargs=kwargs)
        return "from the peer"

    monkeypatch.setattr(_edge, "_importable", lambda package: package == "fla")
    monkeypatch.setattr(_edge, "importlib", types.SimpleNamespace(
        import_module={"fla.ops.kda": types.SimpleNamespace(**{name: peer_fn})}.__getitem__))
    x = make(t=3, hv=2, gate="vector")
    q = torch.Tensor._make_subclass(_LooksLikeCuda, x["q"])
    out = getattr(C, name)(q, x["k"], x["v"], x["g"], x["beta"], use_qk_l2norm_in_kernel=True)
    assert out == "from the peer" and seen["args"][0] is q and seen["kwargs"] == {"use_qk_l2norm_in_kernel": True}
    assert getattr(C, name).peer == f"fla.ops.kda.{name}"
