"""linattn.ops.cross_entropy.linear_cross_entropy against F.cross_entropy on materialized logits (float64),
and the model's return_logits=False path against its logits path."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from linattn.models import ModelConfig
from linattn.models.lm import IGNORE_INDEX, LinearTransformerLM, correct_predictions
from linattn.ops.cross_entropy import block_rows, linear_cross_entropy


def _plain(h, w, b, t):
    z = F.linear(h, w, b)
    loss = F.cross_entropy(z.reshape(-1, z.shape[-1]), t.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")
    return loss, correct_predictions(z, t)


def _case(shape, d, v, bias, ignored, seed):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(*shape, d, generator=g, dtype=torch.float64) * 2
    w = torch.randn(v, d, generator=g, dtype=torch.float64)
    b = torch.randn(v, generator=g, dtype=torch.float64) if bias else None
    t = torch.randint(0, v, shape, generator=g)
    t[torch.rand(shape, generator=g) < ignored] = IGNORE_INDEX
    return h, w, b, t


@settings(max_examples=25, deadline=None)
@given(m=st.integers(1, 40), d=st.integers(1, 9), v=st.integers(1, 50), rows=st.one_of(st.none(), st.integers(1, 13)),
       bias=st.booleans(), ignored=st.sampled_from([0.0, 0.3, 1.0]), seed=st.integers(0, 2**16))
def test_loss_count_and_gradients_equal_the_logits_path(m, d, v, rows, bias, ignored, seed):
    h, w, b, t = _case((m,), d, v, bias, ignored, seed)
    leaves = [x.requires_grad_() for x in (h, w, b) if x is not None]
    loss, correct = linear_cross_entropy(h, w, b, t, rows=rows)
    want_loss, want_correct = _plain(h, w, b, t)
    torch.testing.assert_close(loss, want_loss, rtol=1e-12, atol=1e-12)
    assert int(correct) == int(want_correct)
    upstream = 0.7  # the backward scales by the upstream gradient
    got = torch.autograd.grad(loss * upstream, leaves, allow_unused=True)
    want = torch.autograd.grad(want_loss * upstream, leaves, allow_unused=True)
    for g1, g2 in zip(got, want):
        g2 = torch.zeros_like(g1) if g2 is None else g2
        torch.testing.assert_close(g1, g2, rtol=1e-10, atol=1e-12)


def test_batch_dims_and_block_edges():
    h, w, b, t = _case((3, 7), 5, 11, True, 0.2, 0)
    for rows in (1, 4, 21, 100):
        loss, correct = linear_cross_entropy(h, w, b, t, rows=rows)
        want_loss, want_correct = _plain(h, w, b, t)
        torch.testing.assert_close(loss, want_loss, rtol=1e-12, atol=1e-12)
        assert int(correct) == int(want_correct)


@pytest.mark.parametrize("rows", [None, 1, 3])
def test_tied_and_nan_logits_count_as_argmax_decides(rows):
    """Classes with equal logits: argmax takes the first, so a target on a later copy is not counted; a
    row whose logits hold a NaN counts when its target is the first NaN (torch.argmax's NaN order)."""
    g = torch.Generator().manual_seed(3)
    h = torch.randn(12, 4, generator=g, dtype=torch.float64)
    w = torch.randn(7, 4, generator=g, dtype=torch.float64)
    w[5] = w[2] = w[4] * 0 + 10.0  # classes 2 and 5 tie and win on rows where h sums positive
    h[:6] = h[:6].abs()
    t = torch.tensor([2, 5, 2, 5, 0, 5, 1, 2, 5, 3, 6, 2])
    with torch.no_grad():
        loss, correct = linear_cross_entropy(h, w, None, t, rows=rows)
        _, want = _plain(h, w, None, t)
    assert int(correct) == int(want) and int(want) >= 2
    hn = h.clone()
    hn[0, 0] = float("nan")  # row 0: every logit NaN; its target 2 is not the first NaN (class 0)
    t2 = t.clone()
    t2[1] = 0
    hn[1, 0] = float("nan")  # row 1: its target 0 is the first NaN
    with torch.no_grad():
        _, correct = linear_cross_entropy(hn, w, None, t2, rows=rows)
        _, want = _plain(hn, w, None, t2)
    assert int(correct) == int(want)


def test_gradcheck():
    h, w, b, t = _case((6,), 3, 5, True, 0.3, 1)
    t[0] = 2  # at least one scored row
    torch.autograd.gradcheck(lambda h, w, b: linear_cross_entropy(h, w, b, t, rows=4)[0],
                             (h.requires_grad_(), w.requires_grad_(), b.requires_grad_()))


def test_ignored_rows_with_non_finite_states_reach_nothing():
    h, w, b, t = _case((5,), 4, 6, False, 0.0, 2)
    h[1] = float("nan")
    h[3] = float("inf")
    t[1] = t[3] = IGNORE_INDEX
    h.requires_grad_()
    w.requires_grad_()
    loss, _ = linear_cross_entropy(h, w, b, t, rows=2)
    loss.backward()
    keep = t != IGNORE_INDEX
    want, _ = _plain(h.detach()[keep], w.detach(), None, t[keep])
    torch.testing.assert_close(loss.detach(), want)
    assert torch.isfinite(w.grad).all() and torch.isfinite(h.grad[keep]).all()
    assert (h.grad[~keep] == 0).all()


def test_float32_and_bf16_dtypes():
    h, w, _, t = _case((64,), 16, 300, False, 0.1, 3)
    loss, _ = linear_cross_entropy(h.float(), w.float(), None, t)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), _plain(h, w, None, t)[0], rtol=1e-5, atol=1e-3)
    hb, wb = h.bfloat16().requires_grad_(), w.bfloat16().requires_grad_()
    loss, _ = linear_cross_entropy(hb, wb, None, t)
    want = F.cross_entropy(F.linear(hb, wb).float(), t, ignore_index=IGNORE_INDEX, reduction="sum")
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-3)
    loss.backward()
    assert hb.grad.dtype == torch.bfloat16 and wb.grad.dtype == torch.bfloat16


def test_no_grad_keeps_no_gradients_and_block_rows():
    h, w, _, t = _case((4,), 3, 7, False, 0.0, 4)
    with torch.no_grad():
        loss, correct = linear_cross_entropy(h, w, None, t)
    assert not loss.requires_grad and not correct.requires_grad
    assert block_rows(8192) == 32 and block_rows(4096) == 64 and block_rows(248_320) == 32 and block_rows(10**9) == 32


@pytest.mark.parametrize("call, match", [
    (lambda h, w, t: linear_cross_entropy(h, w[:, :2], None, t), "share d"),
    (lambda h, w, t: linear_cross_entropy(h, w, torch.zeros(3), t), "bias"),
    (lambda h, w, t: linear_cross_entropy(h, w, None, t[:2]), "targets"),
    (lambda h, w, t: linear_cross_entropy(h, w, None, t.double()), "targets"),
    (lambda h, w, t: linear_cross_entropy(h, w, None, t + 100), r"targets must lie in \[0, 7\)"),
    (lambda h, w, t: linear_cross_entropy(h, w, None, t, rows=0), "rows"),
])
def test_bad_input_names_the_argument(call, match):
    h, w, _, t = _case((4,), 3, 7, False, 0.0, 5)
    with pytest.raises(ValueError, match=match):
        call(h, w, t)


def test_forward_ad_is_refused():
    h, w, _, t = _case((4,), 3, 7, False, 0.0, 6)
    with torch.autograd.forward_ad.dual_level():
        dual = torch.autograd.forward_ad.make_dual(h, torch.ones_like(h))
        with pytest.raises(NotImplementedError, match="linear_cross_entropy"):
            linear_cross_entropy(dual, w, None, t)


@pytest.mark.parametrize("tie", [False, True])
def test_model_return_logits_false_equals_the_logits_path(tie):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=37, d_model=16, n_layers=2, n_heads=2, attention="gated_deltanet",
                      tie_embeddings=tie)
    model = LinearTransformerLM(cfg).double()
    ids = torch.randint(0, 37, (3, 9))
    targets = torch.randint(0, 37, (3, 4))
    targets[1, 2] = IGNORE_INDEX
    at = torch.tensor([[0, 3, 5, 8]] * 3)
    logits, _ = model(ids, logits_at=at)  # float64 logits; the plain targets path rounds them to float32
    loss = F.cross_entropy(logits.reshape(-1, 37), targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")
    grads = torch.autograd.grad(loss, list(model.parameters()))
    correct, loss2 = model(ids, logits_at=at, targets=targets, return_logits=False)
    grads2 = torch.autograd.grad(loss2, list(model.parameters()))
    torch.testing.assert_close(loss2, loss, rtol=1e-12, atol=1e-12)
    assert int(correct) == int(correct_predictions(logits, targets))
    for g1, g2 in zip(grads2, grads):
        torch.testing.assert_close(g1, g2, rtol=1e-10, atol=1e-12)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # under autocast: the logits path, counted the same way
        model.float()
        logits, loss = model(ids, logits_at=at, targets=targets)
        correct, loss2 = model(ids, logits_at=at, targets=targets, return_logits=False)
    assert torch.equal(loss2, loss) and int(correct) == int(correct_predictions(logits, targets))
    with pytest.raises(ValueError, match="return_logits=False: pass targets"):
        model(ids, return_logits=False)


@pytest.mark.parametrize("rows", [16, 17, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_tiled_blocks_equal_the_logits_path(rows, bias, monkeypatch):
    """Blocks of at least TILE_ROWS rows on the tiled gemm (transposed logits): loss, count and the
    three gradients as the logits path's, a partial last block and ignored rows included."""
    from linattn.ops import cross_entropy as ce
    from linattn.ops import native

    calls = []
    if native.tile_gemm():
        real = native.gemm
        monkeypatch.setattr(native, "gemm", lambda *a, **k: calls.append(1) or real(*a, **k))
    h, w, b, t = _case((70,), 40, 33, bias, 0.2, 5)
    leaves = [x.requires_grad_() for x in (h, w, b) if x is not None]
    loss, correct = linear_cross_entropy(h, w, b, t, rows=rows)
    want_loss, want_correct = _plain(h, w, b, t)
    torch.testing.assert_close(loss, want_loss, rtol=1e-12, atol=1e-12)
    assert int(correct) == int(want_correct)
    for g1, g2 in zip(torch.autograd.grad(loss, leaves), torch.autograd.grad(want_loss, leaves)):
        torch.testing.assert_close(g1, g2, rtol=1e-10, atol=1e-12)
    if native.tile_gemm():
        assert len(calls) == 3 * -(-70 // rows) and rows >= ce.TILE_ROWS
