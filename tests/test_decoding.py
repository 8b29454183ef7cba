"""The fused decoding step (linattn.models.decoding.FusedDecoder, csrc/model_step.cpp) against the eager step.

The eager path (model(tok (B, 1), cache=cache)) is the reference: from the same prefill, a fused step
must give the eager logits up to the order of float sums, leave the cache as the eager step leaves it
(so either path can continue it), and greedy generation must give the same tokens. The float32 fused
logits are also compared with a float64 eager model (the fp64 reference built from the layers'
definitions), within float32 rounding."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from linattn.models.decoding import FusedDecoder, fused_decoding_obstacle
from linattn.models import KINDS as KIND_TABLE
from linattn.models import LinearTransformerLM, ModelConfig
from linattn.ops import native

pytestmark = pytest.mark.skipif(not native.load(), reason="the fused CPU kernels are not built")

#: every kind of the table with a fused mixer (test_kinds_table checks that the others are refused)
KINDS = [k for k, row in KIND_TABLE.items() if row.fused is not None]
VOCAB = 48


def make_model(dtype=torch.float32, **kw) -> LinearTransformerLM:
    cfg = dict(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=2, max_len=64, seed=3)
    cfg.update(kw)
    return LinearTransformerLM(ModelConfig(**cfg)).to(dtype).eval()


def prompts(batch: int, n: int, seed: int = 0, padded: bool = False):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, n), generator=g)
    if not padded or batch == 1:
        return ids, None
    mask = torch.ones(batch, n, dtype=torch.bool)
    for b in range(1, batch):
        mask[b, : min(b * 2, n - 1)] = False  # left padding, a different length per row
    return ids, mask


def tensors_of(obj) -> list[torch.Tensor]:
    """The tensors of a state: a tensor, or a (nested, named) tuple of them (a WindowState's keys,
    values and validity, a HybridState's ring, key features and linear state)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    return [t for part in obj for t in tensors_of(part)] if isinstance(obj, tuple) else []


def states(cache) -> list[torch.Tensor]:
    """Every tensor of a ModelCache's layers (states, window rings, tails, valid KV entries)."""
    out = []
    for lc in cache.layers:
        lc = getattr(lc, "attn", lc)
        out += tensors_of(getattr(lc, "state", None)) + tensors_of(getattr(lc, "window", None))
        if getattr(lc, "k", None) is not None:
            out += [lc.k[:, :, : lc.length], lc.v[:, :, : lc.length]]
        if lc.conv is not None:
            out.append(lc.conv)
    return out


def run_both(model, ids, mask, steps: int, *, reference=None):
    """Prefill twice, then `steps` tokens fed to the eager step and to the fused step (the eager
    path's greedy tokens to both). Returns the list of (eager logits, fused logits, reference logits)
    and the two caches."""
    reference = reference or model
    with torch.no_grad():
        logits, eager = model(ids, mask, cache=model.new_cache(), last_only=True)
        _, fused_cache = model(ids, mask, cache=model.new_cache(), last_only=True)
        _, ref_cache = reference(ids, mask, cache=reference.new_cache(), last_only=True)
        decoder = FusedDecoder(model, fused_cache, reserve=steps)
        tok = logits[:, -1].argmax(-1)
        out = []
        for _ in range(steps):
            le, eager = model(tok[:, None], cache=eager, last_only=True)
            lr, ref_cache = reference(tok[:, None], cache=ref_cache, last_only=True)
            lf = decoder.step(tok).clone()
            out.append((le[:, -1], lf, lr[:, -1]))
            tok = le[:, -1].argmax(-1)
    return out, eager, fused_cache


def assert_close_steps(out, atol=2e-6, rtol=1e-5):
    for t, (le, lf, _) in enumerate(out):
        torch.testing.assert_close(lf, le, atol=atol, rtol=rtol, msg=lambda m, t=t: f"step {t}: {m}")


def run_both_on_threads(model, ids, mask, steps: int, threads: int):
    """run_both on `threads` torch threads (the number before is restored)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return run_both(model, ids, mask, steps)
    finally:
        torch.set_num_threads(before)


def assert_bf16_steps_close(out):
    """bf16 fused logits against the eager step's: logits of size ~1, one bf16 rounding is 2^-8
    relative; two are allowed."""
    for le, lf, _ in out:
        assert lf.dtype == torch.bfloat16
        torch.testing.assert_close(lf.float(), le.float(), atol=1e-2, rtol=1e-2)


def perturb_biases(model, seed: int = 5) -> None:
    """Nonzero biases (a model starts them at zero), in place."""
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed)
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.add_(torch.randn(p.shape, generator=g) * 0.1)


def check_fused_equals_eager(model, *, threads: int = 1, batch: int = 3, n: int = 7, steps: int = 6):
    """`steps` greedy steps of `model`, eager and fused, from the same left-padded prompts (batch × n) on
    `threads` threads: the logits of every step and every state equal to fp32 rounding. Returns the
    (eager, fused) caches for further checks."""
    ids, mask = prompts(batch, n, padded=True)
    out, eager, fused = run_both_on_threads(model, ids, mask, steps, threads)
    assert_close_steps(out)
    for a, b in zip(states(eager), states(fused)):
        # float32 rounding of sums is relative to their terms: a state's entry near 0 beside entries of
        # ~10² (FAVOR+'s kv, z) differs by ~1e-5 (a hypothesis example found 3e-6 at 0.02, before and
        # after the window mixer)
        scale = max(1.0, a.abs().max().item()) if a.is_floating_point() and a.numel() else 1.0
        torch.testing.assert_close(b, a, atol=2e-6 * scale, rtol=1e-5)
    return eager, fused


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("positions", ["rope", "none", "learned"])
def test_fused_step_equals_eager_step_every_kind(kind, positions):
    model = make_model(attention=[kind], positions=positions)
    assert fused_decoding_obstacle(model) is None
    ids, mask = prompts(3, 7, padded=True)
    out, eager, fused = run_both(model, ids, mask, 6)
    assert_close_steps(out)
    for a, b in zip(states(eager), states(fused)):
        torch.testing.assert_close(b, a, atol=2e-6, rtol=1e-5)
    assert fused.length == eager.length and fused.layers[0].length == eager.layers[0].length


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kind", ["linear", "gated_deltanet", "softmax"])
def test_conv_mixer_blocks(kind, threads):
    """The gated convolution writes the residual its own group normalizes: every thread must have
    read it first (a barrier in that group)."""
    model = make_model(attention=[kind], block="conv_mixer", n_layers=3, conv_mixer_kernel=3)
    with torch.no_grad():  # nonzero convolution biases
        for block in model.blocks:
            block.conv.conv.bias.add_(0.1)
            block.conv.proj.bias.add_(0.05)
    eager, fused = check_fused_equals_eager(model, threads=threads, batch=4, n=6)
    tails = [(e.conv, f.conv) for e, f in zip(eager.layers, fused.layers)]
    for a, b in tails:
        torch.testing.assert_close(b, a, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("kind", ["linear", "gated_deltanet", "softmax"])
def test_fused_float32_equals_float64_eager_reference(kind):
    model = make_model(attention=[kind, "linear"], positions="rope")
    ref = copy.deepcopy(model).double()
    ids, mask = prompts(2, 9, seed=1)
    out, _, _ = run_both(model, ids, mask, 8, reference=ref)
    for t, (_, lf, lr) in enumerate(out):
        torch.testing.assert_close(lf.double(), lr, atol=1e-5, rtol=1e-4, msg=lambda m, t=t: f"step {t}: {m}")


@settings(max_examples=12, deadline=None)
@given(kinds=st.lists(st.sampled_from(KINDS), min_size=1, max_size=2), positions=st.sampled_from(["rope", "none"]),
       batch=st.integers(1, 4), prompt=st.integers(1, 9), norm=st.sampled_from(["rmsnorm", "layernorm"]),
       activation=st.sampled_from(["swiglu", "gelu"]), bias=st.booleans(), tie=st.booleans(),
       short_conv=st.sampled_from([None, 0, 3]), gate=st.sampled_from([None, True, False]),
       feature_map=st.sampled_from(["elu", "relu", "favor", "trig", "cosformer", "taylor", "hedgehog"]),
       qk_dim=st.sampled_from([None, 8]),
       threads=st.sampled_from([1, 2]), block=st.sampled_from(["transformer", "conv_mixer"]))
def test_fused_step_equals_eager_step_over_configs(kinds, positions, batch, prompt, norm, activation, bias, tie,
                                                   short_conv, gate, feature_map, qk_dim, threads, block):
    model = make_model(attention=kinds, positions=positions, n_layers=2 * len(kinds), norm=norm,
                       activation=activation, bias=bias, tie_embeddings=tie, short_conv=short_conv, output_gate=gate,
                       feature_map=feature_map, qk_dim=qk_dim, block=block)
    if bias:
        perturb_biases(model)
    check_fused_equals_eager(model, threads=threads, batch=batch, n=prompt, steps=4)


MAPS = [("elu", {}), ("relu", {}), ("favor", {"num_features": 12}), ("favor", {"stabilize": False}),
        ("trig", {"num_features": 6}), ("trig", {"stabilize": False}), ("cosformer", {}), ("taylor", {}),
        ("hedgehog", {}), ("hedgehog", {"num_features": 5})]


@pytest.mark.parametrize("positions", ["rope", "none"])
@pytest.mark.parametrize("feature_map, options", MAPS)
def test_fused_step_equals_eager_step_every_feature_map(feature_map, options, positions):
    qk_dim = 4 if feature_map == "taylor" else None  # F = 1 + D + D²
    model = make_model(attention=["linear"], positions=positions, feature_map=feature_map,
                       feature_map_options=options, qk_dim=qk_dim)
    assert fused_decoding_obstacle(model) is None
    ids, mask = prompts(3, 7, padded=True)
    out, eager, fused = run_both(model, ids, mask, 6)
    assert_close_steps(out)
    for a, b in zip(states(eager), states(fused)):
        torch.testing.assert_close(b, a, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("kind", ["linear", "simple_gla", "gla", "gated_deltanet", "softmax",
                                  "linear-favor", "linear-taylor", "linear-cosformer"])
def test_bfloat16_fused_step_within_one_rounding_of_eager(kind):
    kind, _, fm = kind.partition("-")
    model = make_model(torch.bfloat16, attention=[kind], positions="rope", feature_map=fm or "elu",
                       qk_dim=4 if fm == "taylor" else None)
    ids, mask = prompts(2, 6, padded=True)
    out, _, _ = run_both(model, ids, mask, 5)
    assert_bf16_steps_close(out)


@pytest.mark.parametrize("kind", ["linear", "gated_deltanet", "softmax"])
def test_greedy_generation_same_tokens_fused_and_eager(kind):
    model = make_model(attention=[kind, "softmax"] if kind != "softmax" else [kind], positions="rope")
    ps = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15]]
    eager = model.generate(ps, 20, temperature=0, fused=False)
    assert model.generate(ps, 20, temperature=0, fused=True) == eager
    assert model.generate(ps, 20, temperature=0) == eager  # the default takes the fused step
    sampled = model.generate(ps, 12, temperature=0.9, top_k=10, seed=4, fused=False)
    assert model.generate(ps, 12, temperature=0.9, top_k=10, seed=4, fused=True) == sampled


def test_generation_takes_the_fused_step_by_default(monkeypatch):
    from linattn.models import decoding

    calls = []
    step = decoding.FusedDecoder.step
    monkeypatch.setattr(decoding.FusedDecoder, "step", lambda self, ids: calls.append(1) or step(self, ids))
    model = make_model(attention=["gated_deltanet", "softmax"], dropout=0.1).train()  # generation sets eval mode
    model.generate([[1, 2, 3], [4]], 5, temperature=0)
    assert len(calls) == 4 and model.training  # every token after the prefill's; the mode restored
    model.generate([[1, 2, 3], [4]], 5, temperature=0, fused=False)
    assert len(calls) == 4
    assert len(list(model.stream([1, 2], 3, temperature=0))) == 3 and len(calls) == 6


def test_eager_continues_a_cache_the_fused_step_advanced():
    model = make_model(attention=["linear", "softmax", "gated_deltanet"], n_layers=3, positions="rope")
    ids, mask = prompts(2, 5, padded=True)
    toks = torch.tensor([[3, 4], [5, 6], [7, 8], [9, 10]])
    with torch.no_grad():
        _, eager = model(ids, mask, cache=model.new_cache())
        _, mixed = model(ids, mask, cache=model.new_cache())
        decoder = FusedDecoder(model, mixed, reserve=2)
        for t in toks[:2]:
            model(t[:, None], cache=eager)
            decoder.step(t)
        for t in toks[2:]:
            le, _ = model(t[:, None], cache=eager)
            lm, _ = model(t[:, None], cache=mixed)
            torch.testing.assert_close(lm, le, atol=2e-6, rtol=1e-5)


def test_weight_streaming_reads_every_weight():
    model = make_model(attention=["gated_deltanet"], tie_embeddings=False)
    with torch.no_grad():
        _, cache = model(torch.tensor([[1, 2]]), cache=model.new_cache())
    decoder = FusedDecoder(model, cache)
    # every matrix the step multiplies: all 2-D parameters but the embeddings (the untied head counts)
    # and the short convolutions' kernels (C, K) and GLA's up-projection (not here)
    expected = sum(p.numel() * 4 for n, p in model.named_parameters()
                   if p.dim() == 2 and not n.startswith(("tok_emb", "pos_emb")) and ".conv." not in n)
    assert decoder.weight_bytes == expected
    state = [t.clone() for t in states(cache)]
    decoder.weight_streaming()  # runs the products only: the cache is left alone
    for a, b in zip(state, states(cache)):
        assert torch.equal(a, b)


def test_refusals_and_bad_input():
    assert "float32 or bfloat16" in fused_decoding_obstacle(make_model(torch.float64))
    wide = make_model(torch.float64)
    with pytest.raises(ValueError, match="fused=True: fused decoding takes float32 or bfloat16"):
        wide.generate([1, 2], 3, fused=True)
    # the default falls back to the eager step
    assert wide.generate([1, 2], 3, temperature=0) == wide.generate([1, 2], 3, temperature=0, fused=False)
    with pytest.raises(ValueError, match="fused .None, True or False. must be a bool"):
        wide.generate([1, 2], 3, fused="yes")
    model = make_model()
    with pytest.raises(ValueError, match="cache is empty"):
        FusedDecoder(model, model.new_cache())
    with torch.no_grad():
        _, cache = model(torch.tensor([[1, 2], [3, 4]]), cache=model.new_cache())
    decoder = FusedDecoder(model, cache)
    with pytest.raises(ValueError, match="training mode"):
        FusedDecoder(model.train(), cache)
    model.eval()
    with pytest.raises(ValueError, match="one token per row"):
        decoder.step(torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="vocab_size"):
        decoder.step(torch.tensor([1, VOCAB]))
