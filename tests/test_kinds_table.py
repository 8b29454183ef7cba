"""The kinds table (linattn.models.KINDS): every kind builds, trains a step, saves and loads, and decodes
token by token (fused where its record names a mixer, eager otherwise) to its parallel forward (each
family's public entry points and every row's family record: tests/test_families.py)."""

from __future__ import annotations

import warnings

import pytest
import torch

import linattn
from linattn.models import KINDS, Kind, LinearTransformerLM, ModelConfig, kind_of
from linattn.models import generation
from linattn.models.decoding import FusedDecoder, fused_decoding_obstacle
from linattn.nn.feature_maps import FEATURE_MAPS, EluPlusOne
from linattn.ops import native
from linattn.ops.features import native_code

ALL = list(KINDS)


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def tiny(kind: str, **kw) -> ModelConfig:
    cfg = dict(vocab_size=40, d_model=32, n_layers=2, n_heads=2, max_len=64, seed=1, attention=[kind],
               positions=KINDS[kind].positions or "rope")
    cfg.update(kw)
    return ModelConfig(**cfg)


def ids(batch=2, n=11, seed=0):
    return torch.randint(0, 40, (batch, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", ALL)
def test_every_kind_builds_its_layer_class(kind):
    model = LinearTransformerLM(tiny(kind))
    row = KINDS[kind]
    assert all(type(b.attn) is row.layer and kind_of(b.attn) is row for b in model.blocks)
    assert model.config.short_conv_for(kind) == row.short_conv
    assert model.config.output_gate_for(kind) == row.output_gate


@pytest.mark.parametrize("kind", ALL)
def test_every_kind_trains_a_step_and_saves_and_loads(kind, tmp_path):
    model = LinearTransformerLM(tiny(kind)).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = [p.detach().clone() for p in model.parameters()]
    x = ids()
    loss = model.loss(x)
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())
    opt.step()
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    model.eval()
    model.save_pretrained(tmp_path / "m")
    loaded = LinearTransformerLM.from_pretrained(tmp_path / "m").eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(x)[0], model(x)[0], rtol=0, atol=0)


@pytest.mark.parametrize("kind", ALL)
def test_every_kind_decodes_token_by_token_to_its_parallel_forward_fp64(kind):
    model = LinearTransformerLM(tiny(kind, attention=[kind, "softmax"])).double().eval()
    x = ids()
    with torch.no_grad():
        full, _ = model(x)
        cache, steps = model.new_cache(), []
        for t in range(x.shape[1]):
            logits, cache = model(x[:, t:t + 1], cache=cache)
            steps.append(logits)
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-10, atol=1e-10)


@pytest.mark.skipif(not native.available(), reason="the fused CPU kernels are not built (or LINATTN_NATIVE=0)")
@pytest.mark.parametrize("kind", ALL)
def test_fused_decoding_where_the_record_names_a_mixer(kind):
    model = LinearTransformerLM(tiny(kind)).eval()
    obstacle = fused_decoding_obstacle(model)
    if KINDS[kind].fused is None:
        assert obstacle is not None and f"kind {kind} has no fused mixer" in obstacle
        return
    assert obstacle is None
    x = ids(n=7)
    with torch.no_grad():
        logits, eager = model(x, cache=model.new_cache(), last_only=True)
        _, fused_cache = model(x, cache=model.new_cache(), last_only=True)
        decoder = FusedDecoder(model, fused_cache, reserve=4)
        tok = logits[:, -1].argmax(-1)
        for _ in range(4):
            le, eager = model(tok[:, None], cache=eager, last_only=True)
            torch.testing.assert_close(decoder.step(tok), le[:, -1], atol=2e-6, rtol=1e-5)
            tok = le[:, -1].argmax(-1)


def test_a_kind_without_a_fused_mixer_generates_eagerly_and_says_so_once(monkeypatch):
    row = KINDS["linear"]
    eager_row = Kind(row.name, row.layer, row.label, row.family, rnn=True, fused=None, build=row.build)
    monkeypatch.setitem(KINDS, "linear", eager_row)
    monkeypatch.setattr("linattn.models.kinds._BY_LAYER", {**linattn.models.kinds._BY_LAYER, row.layer: eager_row})
    monkeypatch.setattr(generation, "_EAGER_KINDS_SAID", set())
    model = LinearTransformerLM(tiny("linear")).eval()
    assert "kind linear has no fused mixer" in fused_decoding_obstacle(model)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        first = model.generate(ids(batch=1, n=3), max_new_tokens=3, temperature=0)
        second = model.generate(ids(batch=1, n=3), max_new_tokens=3, temperature=0)
    said = [w for w in seen if "eager step" in str(w.message)]
    assert len(said) == 1 and "linear" in str(said[0].message)
    assert torch.equal(torch.as_tensor(first), torch.as_tensor(second))


def test_a_record_refuses_an_unknown_family_or_mixer():
    row = KINDS["linear"]
    with pytest.raises(ValueError, match="family"):
        Kind("x", row.layer, "x", "conv", rnn=True)
    with pytest.raises(ValueError, match="fused"):
        Kind("x", row.layer, "x", "linear", rnn=True, fused="kda")


def test_kind_options_are_checked_against_the_record():
    with pytest.raises(ValueError, match="kind_options key"):
        tiny("linear", kind_options={"nope": {}})
    with pytest.raises(ValueError, match=r"kind_options\['linear'\]: unknown option 'window'"):
        tiny("linear", kind_options={"linear": {"window": 4}})
    with pytest.raises(ValueError, match="must be a dict"):
        tiny("linear", kind_options={"linear": 3})


def test_every_feature_map_has_a_label_and_its_native_code_is_not_inherited():
    assert all(cls.label for cls in FEATURE_MAPS.values())
    assert len({cls.label for cls in FEATURE_MAPS.values()}) == len(FEATURE_MAPS)

    class Shifted(EluPlusOne):  # a different φ: the kernels must not take it for elu+1
        def forward(self, x, *, is_query=True, positions=None):
            return super().forward(x) + 1

    assert native_code(EluPlusOne(4)) == 1 and native_code(Shifted(4)) is None and native_code(None) == 0
