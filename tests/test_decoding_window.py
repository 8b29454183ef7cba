"""The fused decoding step of the window kinds — swa, lolcats, liger: the "window" mixer,
csrc/model_window.h — and of hgrn2 (the gated mixer with the key decay), against the eager step.

From one left-padded prefill the fused step's logits and every cache tensor (the ring buffers' keys,
values, validity and LoLCATs' key features, the linear and gated states) equal the eager step's to
float32 rounding, with prompts that leave the ring buffer part-empty, fill it during decoding, leave
padded keys in it that later leave the window, or have wrapped it already (tokens gone into the
linear or gated state); on 1 and 2 threads, in bf16, in hybrids with softmax layers and in linearized
students; and either step continues a cache the other advanced."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from linattn.models.decoding import FusedDecoder, fused_decoding_obstacle
from linattn.models.linearized import student_from_teacher
from linattn.nn.caches import LoLCATsCache, SlidingWindowCache
from linattn.nn.swa import ring_of

from .test_decoding import assert_bf16_steps_close, check_fused_equals_eager, make_model, perturb_biases, prompts, run_both

WINDOW_KINDS = ["swa", "lolcats", "liger"]


def window_model(kinds, window: int = 4, dtype=torch.float32, **kw):
    """A model of `kinds` (one layer each) whose window kinds see `window` tokens; LoLCATs' feature maps
    and window factors moved off their initialization (the identity map, γ = 0.1)."""
    options = {k: {"window": window} for k in kinds if k in WINDOW_KINDS}
    kw = {"positions": "rope", **kw}
    model = make_model(attention=list(kinds), n_layers=len(kinds), kind_options=options, **kw)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for block in model.blocks:
            attn = block.attn
            if hasattr(attn, "window_factor_logit"):
                attn.window_factor_logit.add_(torch.randn(attn.window_factor_logit.shape, generator=g))
                for fm in (attn.feature_map_q, attn.feature_map_k):
                    if isinstance(getattr(fm, "weight", None), torch.nn.Parameter):  # Hedgehog's W
                        fm.weight.add_(0.3 * torch.randn(fm.weight.shape, generator=g))
    return model.to(dtype)


def rings_in_step(eager, fused) -> None:
    """The window layers' ring buffers count the tokens their caches do, on both paths."""
    rings = [(e, f) for e, f in zip(eager.layers, fused.layers) if isinstance(e, (SlidingWindowCache, LoLCATsCache))]
    assert rings
    for e, f in rings:
        assert ring_of(f).length == ring_of(e).length == f.length == e.length


# window W, prompt n (rows 1, 2 of the batch left-padded by 2 and 4 tokens), 6 decoded tokens:
CASES = {
    "never-full": (16, 3),      # the ring never fills: the filled slots only
    "fills": (4, 2),            # the ring fills and wraps during the fused steps
    "padded-keys": (8, 6),      # padded prompt keys in the ring, leaving the window during decoding
    "wrapped": (4, 11),         # wrapped in the prefill: tokens already in the linear / gated state
}


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("kind", WINDOW_KINDS)
def test_window_kinds_fused_equals_eager(kind, case, threads):
    window, n = CASES[case]
    model = window_model([kind], window)
    assert fused_decoding_obstacle(model) is None
    eager, fused = check_fused_equals_eager(model, threads=threads, batch=3, n=n, steps=6)
    rings_in_step(eager, fused)


@pytest.mark.parametrize("feature_map", ["elu", "relu", "favor", "trig", "cosformer", "taylor"])
def test_lolcats_with_other_feature_maps(feature_map):
    """φ_q and φ_k of any map the linear mixer has (model_features.h), each read under its own prefix."""
    model = make_model(attention=["lolcats"], positions="rope", qk_dim=4 if feature_map == "taylor" else None,
                       kind_options={"lolcats": {"window": 3, "feature_map": feature_map}})
    assert fused_decoding_obstacle(model) is None
    check_fused_equals_eager(model, batch=3, n=6, steps=6)


@pytest.mark.parametrize("positions", ["rope", "none"])
@pytest.mark.parametrize("short_conv", [0, 3])
def test_hgrn2_fused_equals_eager(positions, short_conv):
    """HGRN2 on the gated mixer: g = logsigmoid of the k block (the key decay), k = 1 − e^g, SiLU(q),
    RoPE after them when the model has it."""
    model = make_model(attention=["hgrn2", "hgrn2"], positions=positions, short_conv=short_conv)
    assert fused_decoding_obstacle(model) is None
    check_fused_equals_eager(model, threads=2, batch=3, n=7, steps=6)


@pytest.mark.parametrize("threads", [1, 2])
def test_hybrid_of_window_kinds_and_softmax(threads):
    model = window_model(["lolcats", "softmax", "liger", "swa", "hgrn2"], window=3, output_gate=True)
    eager, fused = check_fused_equals_eager(model, threads=threads, batch=3, n=6, steps=6)
    rings_in_step(eager, fused)


@pytest.mark.parametrize("kind", WINDOW_KINDS + ["hgrn2"])
def test_bfloat16_within_two_roundings_of_eager(kind):
    model = window_model([kind, "softmax"], window=4, dtype=torch.bfloat16)
    ids, mask = prompts(3, 6, padded=True)
    out, _, _ = run_both(model, ids, mask, 6)
    assert_bf16_steps_close(out)


@pytest.mark.parametrize("recipe", ["lolcats", "liger"])
def test_linearized_student_decodes_fused(recipe):
    """A student of `linattn linearize` (its first layer linearized, the second softmax) decodes fused,
    equal to its eager step, its window shortened so that the ring wraps."""
    teacher = make_model(attention=["softmax"], positions="rope")
    student, _ = student_from_teacher(teacher, recipe, layers=[0])
    assert student.config.layer_kinds == [recipe, "softmax"]
    student.blocks[0].attn.window = 3
    assert fused_decoding_obstacle(student.eval()) is None
    check_fused_equals_eager(student, batch=2, n=5, steps=6)


def test_eager_and_fused_steps_continue_each_other():
    """Two fused steps, two eager ones, two fused ones again on one cache: the same logits as the eager
    path all along (the ring's token count moved on by the fused step, the plan rebuilt after the
    eager steps)."""
    model = window_model(["lolcats", "swa", "liger"], window=3)
    ids, mask = prompts(2, 4, padded=True)
    toks = torch.tensor([[3, 4], [5, 6], [7, 8], [9, 10], [11, 12], [13, 14]])
    with torch.no_grad():
        _, eager = model(ids, mask, cache=model.new_cache())
        _, mixed = model(ids, mask, cache=model.new_cache())
        decoder = FusedDecoder(model, mixed)
        for i, t in enumerate(toks):
            le, _ = model(t[:, None], cache=eager)
            if i in (2, 3):
                lm = model(t[:, None], cache=mixed)[0][:, -1]
            else:
                lm = decoder.step(t)
            torch.testing.assert_close(lm, le[:, -1], atol=2e-6, rtol=1e-5)
    rings_in_step(eager, mixed)


@pytest.mark.parametrize("kind", WINDOW_KINDS)
def test_position_counters_moved_on_alone(kind):
    """`linattn bench decode` times long contexts on a short prefill whose position counters it moves on
    (the ring keeps its own count, which the eager step writes by): the fused step does the same."""
    model = window_model([kind], window=4)
    ids, _ = prompts(2, 6)
    toks = torch.tensor([[3, 4], [5, 6], [7, 8], [9, 10]])
    with torch.no_grad():
        caches = [model(ids, cache=model.new_cache())[1] for _ in range(2)]
        for cache in caches:
            for counter in (cache, *cache.layers):
                counter.length = 100
        eager, fused = caches
        decoder = FusedDecoder(model, fused, reserve=len(toks))
        for t in toks:
            le, _ = model(t[:, None], cache=eager)
            torch.testing.assert_close(decoder.step(t), le[:, -1], atol=2e-6, rtol=1e-5)
    assert ring_of(fused.layers[0]).length == ring_of(eager.layers[0]).length == 6 + len(toks)


def test_greedy_generation_same_tokens_fused_and_eager():
    model = window_model(["lolcats", "softmax"], window=3)
    ps = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15]]
    eager = model.generate(ps, 12, temperature=0, fused=False)
    assert model.generate(ps, 12, temperature=0, fused=True) == eager
    assert model.generate(ps, 12, temperature=0) == eager  # the default takes the fused step


@settings(max_examples=10, deadline=None)
@given(kinds=st.lists(st.sampled_from(WINDOW_KINDS + ["hgrn2", "softmax"]), min_size=1, max_size=2),
       window=st.integers(1, 6), prompt=st.integers(1, 9), batch=st.integers(1, 3),
       positions=st.sampled_from(["rope", "none"]), short_conv=st.sampled_from([0, 3]),
       gate=st.sampled_from([True, False]), qk_dim=st.sampled_from([None, 8]), bias=st.booleans(),
       threads=st.sampled_from([1, 2]))
def test_window_kinds_over_configs(kinds, window, prompt, batch, positions, short_conv, gate, qk_dim, bias, threads):
    model = window_model(kinds, window, short_conv=short_conv, output_gate=gate, qk_dim=qk_dim, bias=bias,
                         positions=positions)
    if bias:
        perturb_biases(model)
    check_fused_equals_eager(model, threads=threads, batch=batch, n=prompt, steps=5)
