"""linattn.nn.kda.KimiDeltaAttention (the `kda` kind) against its definition written token by token in
float64 (forward and every parameter's gradient), prefill + decoding steps == the parallel forward,
padding, Kimi Linear's initialization, and a tiny LM that trains, saves and loads."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from linattn.nn.recurrent import RecurrentCache
from linattn.models import LinearTransformerLM
from linattn.nn.kda import KimiDeltaAttention

from .conftest import spread, tiny_config
from .test_gated_layers import _conv, _decode, _heads

D_MODEL, HEADS = 16, 2


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def make_layer(*, short_conv=3, qk_dim=None, output_gate=True, chunk_size=4, seed=0):
    layer = KimiDeltaAttention(D_MODEL, HEADS, short_conv=short_conv, qk_dim=qk_dim, output_gate=output_gate,
                               chunk_size=chunk_size)
    return spread(layer, seed).double().eval()


def reference(layer, x, mask=None):
    """Projections, convolution, SiLU, the forget gate −e^{A_log} softplus(F_b F_a x + dt_bias), β =
    sigmoid(W_β x), S_t = (I − β k̂k̂ᵀ) Diag(e^{g_t}) S + β k̂ vᵀ token by token (a masked token leaves S
    alone), o = Sᵀ q̂ / √D, RMSNorm ⊙ sigmoid(G_b G_a x), output projection."""
    b, n, _ = x.shape
    h, dk, dv = layer.n_heads, layer.qk_dim, layer.head_dim
    y = x @ layer.qkv.weight.T
    if mask is not None:
        y = y * mask[..., None]
    if layer.conv is not None:
        y = _conv(y, layer.conv.weight)
    q, k, v = (F.silu(_heads(t, h)) for t in y.split((h * dk, h * dk, h * dv), -1))
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) / math.sqrt(dk)
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    beta = torch.sigmoid(x @ layer.beta_proj.weight.T).transpose(1, 2)
    fg = layer.forget_gate
    raw = (x @ fg.f_a.weight.T @ fg.f_b.weight.T + fg.dt_bias).view(b, n, h, dk).transpose(1, 2)
    g = -torch.exp(fg.A_log)[:, None, None] * F.softplus(raw)  # (B, H, N, D)
    S = torch.zeros(b, h, dk, dv, dtype=x.dtype)
    eye = torch.eye(dk, dtype=x.dtype)
    outs = []
    for t in range(n):
        kt, vt, bt = k[:, :, t], v[:, :, t], beta[:, :, t, None, None]
        new = (eye - bt * kt[..., :, None] * kt[..., None, :]) @ (torch.exp(g[:, :, t])[..., None] * S)
        new = new + bt * kt[..., :, None] * vt[..., None, :]
        if mask is not None:
            new = torch.where(mask[:, t, None, None, None], new, S)
        S = new
        outs.append((q[:, :, t, None, :] @ S)[:, :, 0])
    o = torch.stack(outs, 2).transpose(1, 2)  # (B, N, H, E)
    if layer.kda_gate is not None:
        gate = layer.kda_gate
        o = o / torch.sqrt((o * o).mean(-1, keepdim=True) + gate.norm.eps) * gate.norm.weight
        o = o * torch.sigmoid(x @ gate.g_a.weight.T @ gate.g_b.weight.T).view(b, n, h, dv)
    return o.reshape(b, n, h * dv) @ layer.out.weight.T


@pytest.mark.parametrize("short_conv, qk_dim, output_gate", [(3, None, True), (0, 6, True), (4, None, False)])
def test_layer_matches_its_definition_forward_and_gradients(short_conv, qk_dim, output_gate):
    layer = make_layer(short_conv=short_conv, qk_dim=qk_dim, output_gate=output_gate)
    x = torch.randn(2, 11, D_MODEL, dtype=torch.float64)
    y, cache = layer(x)
    assert cache is None
    want = reference(layer, x)
    torch.testing.assert_close(y, want, rtol=1e-10, atol=1e-12)
    dy = torch.randn_like(y)
    params = [p for _, p in layer.named_parameters()]
    got = torch.autograd.grad((y * dy).sum(), params)
    ref = torch.autograd.grad((want * dy).sum(), params)
    for (name, _), a, b in zip(layer.named_parameters(), got, ref):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11, msg=name)
        assert a.abs().sum() > 0, name


SPLITS = [(0, 4), (4, 5), (5, 6), (6, 7), (7, 10), (10, 11)]


def test_prefill_and_steps_equal_the_parallel_forward_fp64():
    layer = make_layer()
    x = torch.randn(2, 11, D_MODEL, dtype=torch.float64)
    full, _ = layer(x)
    rec, cache = _decode(layer, x, SPLITS)
    torch.testing.assert_close(rec, full, rtol=1e-10, atol=1e-12)
    assert isinstance(cache, RecurrentCache) and cache.length == 11
    assert cache.state.shape == (2, HEADS, layer.qk_dim, layer.head_dim) and cache.state.dtype == torch.float64


def test_prefill_and_steps_equal_the_parallel_forward_fp32():
    """fp32 decoding runs the fused step where the extension is built."""
    layer = make_layer(chunk_size=64).float()
    x = torch.randn(3, 70, D_MODEL)
    with torch.no_grad():
        full, _ = layer(x)
        rec, cache = _decode(layer, x, [(0, 65)] + [(t, t + 1) for t in range(65, 70)])
    torch.testing.assert_close(rec, full, rtol=1e-5, atol=1e-5 * float(full.abs().max()))
    assert cache.state.dtype == torch.float32


def test_left_padded_rows_equal_the_rows_alone_and_pads_leave_the_state():
    layer = make_layer()
    x = torch.randn(1, 7, D_MODEL, dtype=torch.float64)
    alone, _ = layer(x)
    padded = torch.cat((torch.randn(1, 3, D_MODEL, dtype=torch.float64) * 5, x), 1)
    mask = torch.tensor([[False] * 3 + [True] * 7])
    y, _ = layer(padded, mask=mask)
    torch.testing.assert_close(y[:, 3:], alone, rtol=1e-10, atol=1e-12)
    layer = make_layer(short_conv=0)
    x = torch.randn(2, 8, D_MODEL, dtype=torch.float64)
    mask = torch.ones(2, 8, dtype=torch.bool)
    mask[0, 3] = mask[1, 0] = mask[1, 6] = False
    y, _ = layer(x, mask=mask)
    torch.testing.assert_close(y[mask], reference(layer, x, mask=mask)[mask], rtol=1e-10, atol=1e-12)


def test_initialization_is_kimi_linears_with_their_range():
    """Kimi Linear's init with its Δ range passed; linattn's default Δ range is slower
    (KDA_DT_INIT_RANGE, chosen by the recall-init study) and drawn the same way."""
    from linattn.nn.kda import KDA_DT_INIT_RANGE

    lo, hi = KDA_DT_INIT_RANGE
    dt = F.softplus(KimiDeltaAttention(64, 4).forget_gate.dt_bias.detach().double())
    assert (dt >= lo * (1 - 1e-6)).all() and (dt <= hi * (1 + 1e-6)).all()
    layer = KimiDeltaAttention(64, 4, short_conv=4, dt_init_range=(0.001, 0.1))
    fg = layer.forget_gate
    assert fg.A_log.shape == (4,) and fg.dt_bias.shape == (4 * layer.qk_dim,)
    a = fg.A_log.exp()
    assert (a >= 1).all() and (a <= 16).all()
    dt = F.softplus(fg.dt_bias.detach().double())
    assert (dt >= 1e-3 * (1 - 1e-6)).all() and (dt <= 0.1 * (1 + 1e-6)).all()
    assert float(dt.log().std()) > 0.5  # log-uniform over two decades, not a constant
    g = torch.Generator().manual_seed(1)
    fg.init_parameters(g)
    first = fg.dt_bias.clone()
    fg.init_parameters(torch.Generator().manual_seed(1))
    assert torch.equal(first, fg.dt_bias)
    assert layer.forget_gate.f_a.out_features == layer.qk_dim and layer.kda_gate.g_a.out_features == layer.head_dim


def test_tiny_lm_trains_saves_and_loads(tmp_path):
    torch.manual_seed(0)
    model = LinearTransformerLM(tiny_config(attention="kda,softmax"))
    assert isinstance(model.blocks[0].attn, KimiDeltaAttention)
    ids = torch.randint(0, 40, (8, 24), generator=torch.Generator().manual_seed(2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(8):
        loss = model.loss(ids)
        opt.zero_grad()
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.3, losses
    model.eval()
    model.save_pretrained(tmp_path / "m")
    back = LinearTransformerLM.from_pretrained(tmp_path / "m").eval()
    assert back.config == model.config
    with torch.no_grad():
        torch.testing.assert_close(back(ids)[0], model(ids)[0], rtol=0, atol=0)
