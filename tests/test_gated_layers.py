"""linattn.nn.recurrent: every gated and delta-rule kind against its definition (float64, token by
token, forward and gradients), parallel == recurrent, padding, the output gate, argument checks."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from linattn.nn.decay import FeatureDecay, FixedDecay
from linattn.nn.hgrn2 import HGRN2Attention
from linattn.nn.recurrent import (
    DeltaNetAttention,
    GatedDeltaNetAttention,
    GLAAttention,
    RecurrentCache,
    RetNetAttention,
    SimpleGLAAttention,
)
from linattn.nn.attention import LinearAttention, SoftmaxAttention
from linattn.nn.base import OutputGate

from .conftest import spread


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


LAYERS = {"retnet": RetNetAttention, "simple_gla": SimpleGLAAttention, "gla": GLAAttention,
          "deltanet": DeltaNetAttention, "gated_deltanet": GatedDeltaNetAttention, "hgrn2": HGRN2Attention}
DELTA = ("deltanet", "gated_deltanet")
KINDS = sorted(LAYERS)
D_MODEL, HEADS = 16, 2


def make_layer(kind, *, short_conv=3, qk_dim=None, rope=False, output_gate=True, seed=0, chunk_size=4):
    layer = LAYERS[kind](D_MODEL, HEADS, short_conv=short_conv, qk_dim=qk_dim, rope=rope, output_gate=output_gate,
                         chunk_size=chunk_size)
    return spread(layer, seed).double().eval()


# ---------------------------------------------------------------------------------------------
# the definition, written out token by token in float64


def _conv(y, w):
    """Causal depthwise convolution: out_t = Σ_j w[:, j] y_{t−K+1+j}, zeros before the sequence."""
    k = w.shape[1]
    yp = F.pad(y, (0, 0, k - 1, 0))
    return sum(w[:, j] * yp[:, j:j + y.shape[1]] for j in range(k))


def _heads(t, h):
    b, n, _ = t.shape
    return t.view(b, n, h, -1).transpose(1, 2)  # (B, H, N, ·)


def _log_decay(kind, layer, x):
    """g (B, H, N) or (B, H, N, D) as the papers define it, or None (DeltaNet)."""
    b, n, _ = x.shape
    if kind in ("gated_deltanet", "simple_gla"):  # Mamba2's form
        a = x @ layer.decay.proj.weight.T + layer.decay.dt_bias
        return (-torch.exp(layer.decay.A_log) * F.softplus(a)).transpose(1, 2)
    if kind == "retnet":  # γ_h = 1 − 2^(−5−h)
        gamma = 1 - 2.0 ** (-5 - torch.arange(layer.n_heads, dtype=torch.float64))
        return torch.log(gamma)[None, :, None].expand(b, -1, n)
    if kind == "gla":  # logsigmoid(W₂W₁x + b) / 16
        a = x @ layer.decay.down.weight.T @ layer.decay.up.weight.T + layer.decay.up.bias
        return (F.logsigmoid(a) / 16).view(b, n, layer.n_heads, layer.qk_dim).transpose(1, 2)
    return None


def reference(kind, layer, x, mask=None, positions=None):
    """The layer's output from its definition: projections, convolution, activations, the recurrence
    token by token (a masked token leaves the state alone), output norm and gate, output projection."""
    b, n, _ = x.shape
    h, dk, dv = layer.n_heads, layer.qk_dim, layer.head_dim
    y = x @ layer.qkv.weight.T
    if mask is not None:
        y = y * mask[..., None]
    if layer.conv is not None:
        y = _conv(y, layer.conv.weight)
    q, k, v = (_heads(t, h) for t in y.split((h * dk, h * dk, h * dv), -1))
    if kind in DELTA:
        q, k, v = F.silu(q), F.silu(k), F.silu(v)
    g = _log_decay(kind, layer, x)
    if kind == "hgrn2":  # the k block holds the forget logits f: g = logsigmoid(f), k = 1 − e^g; SiLU on q
        g, q, k = F.logsigmoid(k), F.silu(q), 1 - torch.sigmoid(k)
    if layer.rope is not None:
        q, k = layer.rope.rotate(q, positions), layer.rope.rotate(k, positions)
    if kind in DELTA:
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        beta = torch.sigmoid(x @ layer.beta_proj.weight.T).transpose(1, 2)
    else:  # gated linear attention: S_t = diag(e^g) S + k vᵀ, i.e. the delta rule's form with β k̂k̂ᵀ = 0, β k̂ = k
        beta = None
    q = q / math.sqrt(dk)
    S = torch.zeros(b, h, dk, dv, dtype=x.dtype)
    outs = []
    for t in range(n):
        kt, vt = k[:, :, t], v[:, :, t]
        if g is None:
            alpha = 1.0
        elif g.dim() == 3:
            alpha = torch.exp(g[:, :, t])[..., None, None]
        else:  # one decay per key feature: per row of S
            alpha = torch.exp(g[:, :, t])[..., None]
        if beta is None:
            new = alpha * S + kt[..., :, None] * vt[..., None, :]
        else:
            bt = beta[:, :, t, None, None]
            new = alpha * (S - bt * kt[..., :, None] * (kt[..., None, :] @ S)) + bt * kt[..., :, None] * vt[..., None, :]
        if mask is not None:
            new = torch.where(mask[:, t, None, None, None], new, S)
        S = new
        outs.append((q[:, :, t, None, :] @ S)[:, :, 0])
    o = torch.stack(outs, 2).transpose(1, 2)  # (B, N, H, E)
    if layer.output_gate is not None:
        gate = layer.output_gate
        o = o / torch.sqrt((o * o).mean(-1, keepdim=True) + gate.norm.eps) * gate.norm.weight
        o = o * F.silu(x @ gate.proj.weight.T).view(b, n, h, dv)
    return o.reshape(b, n, h * dv) @ layer.out.weight.T


# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("short_conv, qk_dim, output_gate", [(3, None, True), (0, 6, True), (4, None, False)])
def test_layer_matches_its_definition_forward_and_gradients(kind, short_conv, qk_dim, output_gate):
    layer = make_layer(kind, short_conv=short_conv, qk_dim=qk_dim, output_gate=output_gate)
    x = torch.randn(2, 11, D_MODEL, dtype=torch.float64)
    y, cache = layer(x)
    assert cache is None
    want = reference(kind, layer, x)
    torch.testing.assert_close(y, want, rtol=1e-10, atol=1e-12)
    dy = torch.randn_like(y)
    params = [p for _, p in layer.named_parameters()]
    got = torch.autograd.grad((y * dy).sum(), params)
    ref = torch.autograd.grad((want * dy).sum(), params)
    for (name, _), a, b in zip(layer.named_parameters(), got, ref):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11, msg=name)
        assert a.abs().sum() > 0, name


@pytest.mark.parametrize("kind", KINDS)
def test_rope_rotates_q_and_k_after_the_activation(kind):
    layer = make_layer(kind, rope=True)
    x = torch.randn(2, 9, D_MODEL, dtype=torch.float64)
    y, _ = layer(x)
    torch.testing.assert_close(y, reference(kind, layer, x, positions=torch.arange(9)), rtol=1e-10, atol=1e-12)


def _decode(layer, x, splits, mask=None):
    cache, parts = layer.new_cache(), []
    for lo, hi in splits:
        y, cache = layer(x[:, lo:hi], mask=None if mask is None else mask[:, lo:hi], cache=cache)
        parts.append(y)
    return torch.cat(parts, 1), cache


SPLITS = [(0, 4), (4, 5), (5, 6), (6, 7), (7, 10), (10, 11)]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rope", [False, True])
def test_prefill_and_steps_equal_the_parallel_forward_fp64(kind, rope):
    layer = make_layer(kind, rope=rope)
    x = torch.randn(2, 11, D_MODEL, dtype=torch.float64)
    full, _ = layer(x)
    rec, cache = _decode(layer, x, SPLITS)
    torch.testing.assert_close(rec, full, rtol=1e-10, atol=1e-12)
    assert isinstance(cache, RecurrentCache) and cache.length == 11
    assert cache.state.shape == (2, HEADS, layer.qk_dim, layer.head_dim) and cache.conv.shape == (2, 2, 3 * D_MODEL)
    assert cache.nbytes == (cache.state.numel() + cache.conv.numel()) * 8


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_and_steps_equal_the_parallel_forward_fp32(kind):
    """fp32 runs the fused kernels (chunked and step) where the extension is built."""
    layer = make_layer(kind, chunk_size=64).float()
    x = torch.randn(3, 70, D_MODEL)
    with torch.no_grad():
        full, _ = layer(x)
        rec, _ = _decode(layer, x, [(0, 65)] + [(t, t + 1) for t in range(65, 70)])
    torch.testing.assert_close(rec, full, rtol=1e-5, atol=1e-5 * float(full.abs().max()))


@pytest.mark.parametrize("kind", KINDS)
def test_left_padded_rows_equal_the_rows_alone(kind):
    layer = make_layer(kind)
    x = torch.randn(1, 7, D_MODEL, dtype=torch.float64)
    alone, _ = layer(x)
    padded = torch.cat((torch.randn(1, 3, D_MODEL, dtype=torch.float64) * 5, x), 1)
    mask = torch.tensor([[False] * 3 + [True] * 7])
    y, _ = layer(padded, mask=mask)
    torch.testing.assert_close(y[:, 3:], alone, rtol=1e-10, atol=1e-12)
    rec, _ = _decode(layer, padded, [(0, 5), (5, 6), (6, 7), (7, 10)], mask=mask)
    torch.testing.assert_close(rec[:, 3:], alone, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind", KINDS)
def test_a_padded_token_anywhere_leaves_the_state_alone(kind):
    """With the convolution off (it sees pads as zeros), a pad in the middle changes nothing for the
    other tokens: the reference skips it."""
    layer = make_layer(kind, short_conv=0)
    x = torch.randn(2, 8, D_MODEL, dtype=torch.float64)
    mask = torch.ones(2, 8, dtype=torch.bool)
    mask[0, 3] = mask[1, 0] = mask[1, 6] = False
    y, _ = layer(x, mask=mask)
    want = reference(kind, layer, x, mask=mask)
    torch.testing.assert_close(y[mask], want[mask], rtol=1e-10, atol=1e-12)
    _, cache = _decode(layer, x, [(0, 8)], mask=mask)
    _, alone = _decode(layer, x[:1, mask[0]], [(0, 7)])
    torch.testing.assert_close(cache.state[:1], alone.state, rtol=1e-10, atol=1e-12)


def test_gated_deltanet_decay_is_mamba2_style_and_seeded():
    layer = GatedDeltaNetAttention(D_MODEL, 4)
    a = torch.exp(layer.decay.A_log.detach())
    dt = F.softplus(layer.decay.dt_bias.detach())
    assert ((a >= 1) & (a <= 16)).all() and ((dt >= 1e-3 - 1e-9) & (dt <= 0.1 + 1e-9)).all()
    g = layer.decay(torch.randn(2, 5, D_MODEL) * 100)
    assert g.shape == (2, 4, 5) and (g <= 0).all() and torch.isfinite(g).all()
    other = GatedDeltaNetAttention(D_MODEL, 4)
    layer.decay.init_parameters(torch.Generator().manual_seed(1))
    other.decay.init_parameters(torch.Generator().manual_seed(1))
    assert torch.equal(layer.decay.A_log, other.decay.A_log) and torch.equal(layer.decay.dt_bias, other.decay.dt_bias)


def test_retnet_decays_are_the_papers():
    g = FixedDecay(4)(torch.zeros(2, 3, 8, dtype=torch.float64))
    assert g.shape == (2, 4, 3) and g.dtype == torch.float64
    torch.testing.assert_close(g.exp()[0, :, 0], torch.tensor([31 / 32, 63 / 64, 127 / 128, 255 / 256],
                                                               dtype=torch.float64), rtol=1e-15, atol=0)
    assert FixedDecay(4)(torch.zeros(1, 2, 8)).dtype == torch.float32  # the state dtype
    assert not list(FixedDecay(4).parameters()) and not FixedDecay(4).state_dict()


def test_gla_decay_is_low_rank_with_temperature_16():
    decay = FeatureDecay(8, 2, 3)
    assert decay.down.weight.shape == (16, 8) and decay.up.weight.shape == (6, 16) and decay.temperature == 16
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 100
    g = copy.deepcopy(decay).double()(x)
    assert g.shape == (2, 2, 5, 3) and (g <= 0).all()
    # log σ(W_up W_down x + b) / 16 per (head, feature), head h owning features h·3 … h·3 + 2
    a = x @ decay.down.weight.T.double() @ decay.up.weight.T.double() + decay.up.bias.double()
    want = -torch.logaddexp(torch.zeros_like(a), -a) / 16  # log σ(a) = −log(1 + e^{−a})
    torch.testing.assert_close(g, want.view(2, 5, 2, 3).transpose(1, 2), rtol=1e-12, atol=1e-12)
    with torch.no_grad():
        decay.up.weight.zero_()
        decay.up.bias.zero_()
    torch.testing.assert_close(decay(torch.randn(1, 2, 8)), torch.full((1, 2, 2, 3), math.log(0.5) / 16))


def test_beta_never_underflows_to_zero():
    """A hugely negative β logit would make sigmoid 0 in float32; the layer keeps β > 0 so the operator
    takes it (it writes nothing either way)."""
    layer = make_layer("deltanet").float()
    with torch.no_grad():
        layer.beta_proj.weight.fill_(-1e4)
    y, _ = layer(torch.rand(1, 5, D_MODEL) + 1)
    assert torch.isfinite(y).all()


def test_output_gate_normalizes_each_head():
    gate = OutputGate(8, 2, 4).double()
    with torch.no_grad():
        gate.proj.weight.normal_()
    o = torch.randn(3, 5, 2, 4, dtype=torch.float64) * torch.tensor([1.0, 100.0], dtype=torch.float64)[:, None]
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    want = o / o.pow(2).mean(-1, keepdim=True).add(gate.norm.eps).sqrt()
    want = want * F.silu(x @ gate.proj.weight.T).view(3, 5, 2, 4)
    torch.testing.assert_close(gate(o, x), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("cls", [LinearAttention, SoftmaxAttention])
def test_short_conv_and_output_gate_on_linear_and_softmax(cls):
    """The convolution and the gate sit in front of / behind any kind: decoding still equals the
    parallel forward, and a left-padded row equals the row alone."""
    layer = spread(cls(D_MODEL, HEADS, short_conv=4, output_gate=True, rope=True)).double().eval()
    assert layer.conv.kernel_size == 4 and layer.output_gate is not None
    x = torch.randn(2, 11, D_MODEL, dtype=torch.float64)
    full, _ = layer(x)
    rec, cache = _decode(layer, x, SPLITS)
    torch.testing.assert_close(rec, full, rtol=1e-10, atol=1e-12)
    assert cache.conv.shape == (2, 3, 3 * D_MODEL)
    padded = torch.cat((torch.randn(2, 2, D_MODEL, dtype=torch.float64), x), 1)
    mask = torch.ones(2, 13, dtype=torch.bool)
    mask[:, :2] = False
    y, _ = layer(padded, mask=mask)
    torch.testing.assert_close(y[:, 2:], full, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind", KINDS)
def test_sequence_parallel_hook(kind, monkeypatch):
    """With a group set and no cache, a layer calls linattn.parallel's operator of its kind with the
    single-process op's arguments and the short convolution asks for its halo; a padding mask is
    refused; decoding with a cache stays local. (The sharded results: tests/parallel/.)"""
    import linattn.nn.families.delta as delta_family
    import linattn.nn.families.gated as gated_family
    import linattn.nn.base as ly

    calls = {}

    def sp_op(name):
        def op(q, k, v, gate, **kw):
            calls[name] = (gate, kw)
            return torch.zeros_like(v)
        return op

    def halo(x, width, *, group):
        calls["halo"] = (width, group)
        return torch.zeros(x.shape[0], width, x.shape[2], dtype=x.dtype)

    monkeypatch.setattr(gated_family, "sequence_parallel_gated_linear_attention", sp_op("gated"))
    monkeypatch.setattr(delta_family, "sequence_parallel_delta_rule", sp_op("delta"))
    monkeypatch.setattr(ly, "sequence_halo", halo)
    layer = make_layer(kind)
    layer.sequence_parallel_group = "GROUP"
    x = torch.randn(1, 4, D_MODEL, dtype=torch.float64)
    y, _ = layer(x)
    assert torch.equal(y, layer._merge(torch.zeros(1, HEADS, 4, D_MODEL // HEADS, dtype=torch.float64), x))
    gate, kw = calls["delta" if kind in DELTA else "gated"]
    assert kw["group"] == "GROUP" and kw["chunk_size"] == layer.chunk_size
    if kind in DELTA:
        assert kw["qk_l2norm"] is True and kw["scale"] == layer.scale and (kw["g"] is None) == (kind == "deltanet")
        assert gate.shape == (1, HEADS, 4)
    else:
        assert gate.shape[:3] == (1, HEADS, 4)
    assert calls["halo"] == (2, "GROUP")
    with pytest.raises(ValueError, match="sequence parallelism does not take a padding mask"):
        layer(x, mask=torch.ones(1, 4, dtype=torch.bool))
    calls.clear()
    y, cache = layer(x, cache=layer.new_cache())
    assert not calls and cache.length == 4 and y.abs().sum() > 0


@pytest.mark.parametrize("kw, match", [
    (dict(short_conv=-1), "short_conv"),
    (dict(short_conv=2.0), "short_conv"),
    (dict(output_gate="yes"), "output_gate"),
    (dict(chunk_size=0), "chunk_size"),
    (dict(qk_dim=0), "qk_dim"),
])
def test_bad_arguments(kw, match):
    with pytest.raises(ValueError, match=match):
        DeltaNetAttention(D_MODEL, HEADS, **kw)
    with pytest.raises(ValueError, match="d_model"):
        DeltaNetAttention(15, 2)
    layer = make_layer("gated_deltanet")
    with pytest.raises(ValueError, match="mask"):
        layer(torch.randn(1, 4, D_MODEL, dtype=torch.float64), mask=torch.ones(1, 3, dtype=torch.bool))
