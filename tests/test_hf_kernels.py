"""linattn.hf.use_linattn_kernels: transformers' Qwen3.5 / Qwen3-Next / OLMo-Hybrid / Kimi Linear on
linattn.compat.fla, against transformers' own torch fallbacks (tiny random configs, no downloads)."""

import contextlib
import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("linattn.compat.fla")

import linattn.hf as H  # noqa: E402
from linattn.hf import kernels as K  # noqa: E402

VOCAB = 64
#: linattn's delta rule takes cu_seqlens once the packed-sequences work (design §16) is in
PACKED = "cu_seqlens" in inspect.signature(__import__("linattn.ops", fromlist=["_"]).delta_rule).parameters


def _config(model_type: str, **over):
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, layer_types=["linear_attention", "full_attention"], pad_token_id=0,
                  bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    gdn = dict(linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
               linear_num_value_heads=4)
    if model_type == "qwen3_5":
        return transformers.Qwen3_5TextConfig(head_dim=16, **gdn, **common)
    if model_type == "qwen3_next":
        return transformers.Qwen3NextConfig(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                            shared_expert_intermediate_size=16, **gdn, **common)
    if model_type == "olmo_hybrid":
        return transformers.OlmoHybridConfig(linear_allow_neg_eigval=over.get("neg", False), **gdn, **common)
    if model_type == "kimi_linear":
        common.update(num_key_value_heads=2)
        return transformers.KimiLinearConfig(linear_head_dim=8, linear_num_heads=2, linear_conv_kernel_dim=4,
                                             kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8,
                                             num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                             mlp_layer_types=["dense", "dense"], **common)
    raise AssertionError(model_type)


def _has(model_type: str) -> bool:
    """The installed transformers has this model type (a transformers too old for it raises
    KernelPatchError, tested below: these tests then skip, CI's locked transformers has all four)."""
    try:
        patch = H.use_linattn_kernels(model_type)
    except K.KernelPatchError:
        return False
    patch.undo()
    return model_type in patch.patched


TYPES = [pytest.param(m, marks=pytest.mark.skipif(not _has(m), reason=f"{m}: not in this transformers or no "
                                                  "linattn.compat.fla kernel for it")) for m in K.MODEL_TYPES]


def build(model_type: str, seed: int = 0):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(_config(model_type)).float().eval()
    return model


@contextlib.contextmanager
def fallback(model_type: str):
    """transformers' own torch functions (the undecorated fallbacks), whatever package it found."""
    path, names = K.MODEL_TYPES[model_type]
    module = __import__(path, fromlist=["_"])
    saved = {n: getattr(module, n) for n in names}
    try:
        for n, f in saved.items():
            setattr(module, n, getattr(f, "__wrapped__", f))
        yield
    finally:
        for n, f in saved.items():
            setattr(module, n, f)


def test_olmo_hybrid_negative_eigenvalues_run_linattns_kernels_and_equal_transformers_rule(monkeypatch):
    """linear_allow_neg_eigval (β = 2·sigmoid ∈ (0, 2), negative eigenvalues): the calls run linattn's
    delta rule (no fallback, no warning), prefill and a decoding step equal transformers' own torch
    rule, gradients too, and packed rows equal their documents one by one. Before, linattn took
    β ∈ (0, 1] only: such calls ran transformers' rule with a RuntimeWarning and packed rows failed."""
    if not _has("olmo_hybrid"):
        pytest.skip("olmo_hybrid: not in this transformers")
    import warnings

    from linattn.compat.fla import delta as compat_delta

    calls = []
    run = compat_delta.run_delta
    monkeypatch.setattr(compat_delta, "run_delta", lambda *a, **kw: calls.append(1) or run(*a, **kw))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config("olmo_hybrid", neg=True)).float().eval()
    flags = [layer.linear_attn.allow_neg_eigval for layer in model.model.layers if hasattr(layer, "linear_attn")]
    assert flags and all(flags)
    x = tokens(2, 11)
    with torch.no_grad():
        with fallback("olmo_hybrid"):
            ref = model(x, use_cache=True)
            ref_step = model(x[:, :1], cache=ref.cache).logits
        with H.use_linattn_kernels("olmo_hybrid"), warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            got = model(x, use_cache=True)
            got_step = model(x[:, :1], cache=got.cache).logits
    assert len(calls) == 2, "the chunked rule and the decoding step run linattn's kernels"
    assert torch.allclose(got.logits, ref.logits, atol=2e-5, rtol=1e-4)
    assert torch.allclose(got_step, ref_step, atol=2e-5, rtol=1e-4)

    def grads():
        model.zero_grad()
        model(x, labels=x, use_cache=False).loss.backward()
        return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}

    model.train()
    with fallback("olmo_hybrid"):
        want = grads()
    with H.use_linattn_kernels("olmo_hybrid"):
        have = grads()
    for k in want:
        scale = float(want[k].abs().max()) + 1e-12
        assert torch.allclose(have[k], want[k], atol=1e-5 * max(scale, 1.0), rtol=1e-3), k
    model.eval()
    a, b = tokens(1, 7, seed=4), tokens(1, 12, seed=5)
    pos = torch.cat([torch.arange(7), torch.arange(12)])[None]
    with torch.no_grad(), H.use_linattn_kernels("olmo_hybrid"):
        packed = model(torch.cat([a, b], 1), position_ids=pos, use_cache=False).logits
        alone = torch.cat([model(a, use_cache=False).logits, model(b, use_cache=False).logits], 1)
    assert torch.allclose(packed, alone, atol=2e-5, rtol=1e-4)


def tokens(b, n, seed=0):
    return torch.randint(3, VOCAB, (b, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("model_type", TYPES)
def test_prefill_and_decode_logits_match_the_fallback(model_type):
    model = build(model_type)
    x = tokens(2, 19)
    with torch.no_grad():
        with fallback(model_type):
            ref = model(x, use_cache=True)
            ref_step = model(x[:, :1], cache=ref.cache).logits
        with H.use_linattn_kernels(model_type):
            got = model(x, use_cache=True)
            got_step = model(x[:, :1], cache=got.cache).logits
    assert torch.allclose(got.logits, ref.logits, atol=2e-5, rtol=1e-4)
    assert torch.allclose(got_step, ref_step, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("model_type", TYPES)
def test_greedy_generate_gives_identical_tokens(model_type):
    model = build(model_type, seed=1)
    x = tokens(2, 9, seed=1)
    kw = dict(max_new_tokens=6, do_sample=False, eos_token_id=None)
    with fallback(model_type):
        ref = model.generate(x, **kw)
    with H.use_linattn_kernels(model_type):
        got = model.generate(x, **kw)
    assert torch.equal(got, ref)


@pytest.mark.parametrize("model_type", TYPES)
def test_training_step_gives_the_same_gradients(model_type):
    model = build(model_type, seed=2).train()
    x = tokens(2, 21, seed=2)

    def grads():
        model.zero_grad()
        model(x, labels=x).loss.backward()
        return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}

    with fallback(model_type):
        ref = grads()
    with H.use_linattn_kernels(model_type):
        got = grads()
    assert ref.keys() == got.keys() and len(ref) > 10
    for k in ref:
        scale = float(ref[k].abs().max()) + 1e-12
        assert torch.allclose(got[k], ref[k], atol=1e-5 * max(scale, 1.0), rtol=1e-3), k


@pytest.mark.skipif(not PACKED, reason="linattn's delta_rule has no cu_seqlens yet (packed sequences, design §16)")
@pytest.mark.parametrize("how", ["position_ids", "cu_seq_lens_q"])
@pytest.mark.parametrize("model_type", TYPES)
def test_packed_rows_equal_separate_documents(model_type, how):
    """Padding-free rows: two documents in one row give each document's logits (and gradients
    flow). What transformers' own torch rule does with such rows is its business (5.24 mixed the
    documents, 5.25 refuses them): this holds whichever it does, and only linattn's kernels pass it."""
    model = build(model_type, seed=3)
    a, b = tokens(1, 7, seed=4), tokens(1, 12, seed=5)
    row = torch.cat([a, b], 1)
    pos = torch.cat([torch.arange(7), torch.arange(12)])[None]
    cu = torch.tensor([0, 7, 19], dtype=torch.int32)
    extra = dict(position_ids=pos) if how == "position_ids" else dict(position_ids=pos, cu_seq_lens_q=cu,
                                                                      cu_seq_lens_k=cu, max_length_q=12,
                                                                      max_length_k=12)
    with torch.no_grad(), H.use_linattn_kernels(model_type):
        packed = model(row, use_cache=False, **extra).logits
        alone = torch.cat([model(a, use_cache=False).logits, model(b, use_cache=False).logits], 1)
    assert torch.allclose(packed, alone, atol=2e-5, rtol=1e-4)
    with H.use_linattn_kernels(model_type):
        model.train()
        loss = model(row, labels=row, use_cache=False, **extra).loss
        loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


@pytest.mark.parametrize("model_type", TYPES)
def test_generate_from_one_left_padded_prompt_equals_the_fallback(model_type):
    """Issue 37 item 10: a batch of one left-padded prompt has position_ids [0, 0, 0, 0, 0, 1, …]; read as
    packed documents they gave 5 states and an error at the first decode step. With a cache, the
    positions are read as transformers' own mask builder reads them: one sequence per row."""
    model = build(model_type, seed=1)
    x = tokens(1, 9, seed=1)
    x[:, :4] = 0
    mask = torch.ones_like(x)
    mask[:, :4] = 0
    kw = dict(max_new_tokens=5, do_sample=False, eos_token_id=None, attention_mask=mask, pad_token_id=0)
    with fallback(model_type):
        ref = model.generate(x, **kw)
    with H.use_linattn_kernels(model_type):
        got = model.generate(x, **kw)
    assert torch.equal(got, ref)


@pytest.mark.skipif(not PACKED, reason="linattn's delta_rule has no cu_seqlens yet (packed sequences, design §16)")
@pytest.mark.parametrize("model_type", TYPES)
def test_packed_rows_with_a_cache_are_one_sequence_as_in_transformers(model_type):
    """Issue 37 item 10 and the docstring's claim: with use_cache=True transformers' mask builder does not
    read restarting position_ids as documents (its full-attention layers mix them), so linattn's
    linear layers take the row as one sequence too: prefill and the decode step after it equal
    transformers' own fallback (before: one state per document, and the decode step failed)."""
    model = build(model_type, seed=3)
    row = torch.cat([tokens(1, 7, seed=4), tokens(1, 12, seed=5)], 1)
    pos = torch.cat([torch.arange(7), torch.arange(12)])[None]
    nxt = tokens(1, 1, seed=6)
    with torch.no_grad():
        with fallback(model_type):
            ref = model(row, position_ids=pos, use_cache=True)
            ref_step = model(nxt, cache=ref.cache, position_ids=torch.tensor([[12]])).logits
        with H.use_linattn_kernels(model_type):
            got = model(row, position_ids=pos, use_cache=True)
            got_step = model(nxt, cache=got.cache, position_ids=torch.tensor([[12]])).logits
    assert torch.allclose(got.logits, ref.logits, atol=2e-5, rtol=1e-4)
    assert torch.allclose(got_step, ref_step, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("model_type", TYPES)
def test_gradient_checkpointing_still_checkpoints_every_layer(model_type):
    """Issue 37 item 22: the patch replaced each decoder layer's forward, which transformers wraps so that
    it checkpoints only while it is the class's outermost forward: checkpointing silently stopped
    (gradients right, no memory saved). Counted here: every layer's forward runs through the
    checkpoint function, with the patch as without it, and the gradients equal the fallback's."""
    model = build(model_type, seed=2).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    calls = []
    for layer in model.model.layers:
        func = layer._gradient_checkpointing_func
        layer._gradient_checkpointing_func = lambda *a, _f=func, **k: calls.append(1) or _f(*a, **k)
    x = tokens(2, 13, seed=2)

    def grads():
        model.zero_grad()
        model(x, labels=x, use_cache=False).loss.backward()
        return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}

    with fallback(model_type):
        ref = grads()
    assert len(calls) == len(model.model.layers)
    calls.clear()
    with H.use_linattn_kernels(model_type):
        got = grads()
    assert len(calls) == len(model.model.layers)
    for k in ref:
        scale = float(ref[k].abs().max()) + 1e-12
        assert torch.allclose(got[k], ref[k], atol=1e-5 * max(scale, 1.0), rtol=1e-3), k


def test_cu_seqlens_from_position_ids():
    assert K.cu_seqlens_from_position_ids(torch.tensor([[0, 1, 2, 0, 1, 0]])).tolist() == [0, 3, 5, 6]
    assert K.cu_seqlens_from_position_ids(torch.tensor([[4, 5, 6]])) is None  # one sequence, a cache's offset
    assert K.cu_seqlens_from_position_ids(torch.tensor([[0, 1], [0, 1]])) is None


def _originals():
    """(owner, name, object) of everything use_linattn_kernels may rebind."""
    out = []
    for path, names in K.MODEL_TYPES.values():
        try:
            module = __import__(path, fromlist=["_"])
        except ImportError:
            continue
        out += [(module, n, getattr(module, n)) for n in names if hasattr(module, n)]
        for c in vars(module).values():
            if isinstance(c, type) and c.__name__.endswith("DecoderLayer") and "forward" in c.__dict__:
                out += [(c, "forward", c.__dict__["forward"]), (c, "__call__", c.__dict__.get("__call__", _ABSENT))]
    return out


_ABSENT = object()


def _restored(originals) -> bool:
    return all((owner.__dict__.get(n, _ABSENT) if isinstance(owner, type) else getattr(owner, n)) is f
               for owner, n, f in originals)


def test_undo_restores_the_original_functions():
    import transformers.models.qwen3_5.modeling_qwen3_5 as q

    originals = _originals()
    patch = H.use_linattn_kernels()
    assert "qwen3_5" in patch.patched and not _restored(originals)
    assert q.causal_conv1d_fn.linattn_kernel is __import__("linattn.compat.fla", fromlist=["_"]).causal_conv1d_fn
    inner = H.use_linattn_kernels("qwen3_5")  # nested patches, undone out of order
    patch.undo()
    inner.undo()
    patch.undo()  # idempotent
    assert _restored(originals)
    with H.use_linattn_kernels("qwen3_5"):
        assert not _restored(originals)
    assert _restored(originals)
    H.use_linattn_kernels("qwen3_5")
    H.undo_linattn_kernels()
    assert _restored(originals)


def test_unknown_model_type_is_refused():
    with pytest.raises(ValueError, match="model_types"):
        H.use_linattn_kernels("llama")


def _stand_in(monkeypatch, model_type: str, drop: str):
    """A copy of transformers' modeling module for `model_type` without the global `drop` (as a
    release that renamed it would be), installed in its place in sys.modules."""
    import sys
    import types

    path, _ = K.MODEL_TYPES[model_type]
    real = __import__(path, fromlist=["_"])
    fake = types.ModuleType(path)
    fake.__dict__.update({k: v for k, v in vars(real).items() if k != drop})
    if drop.endswith("DecoderLayer"):  # the class kept under another name, as a rename would leave it
        renamed = type("Renamed" + drop.removesuffix("DecoderLayer") + "Block", (), {"forward": lambda self: None})
        renamed.__module__ = path
        fake.__dict__[renamed.__name__] = renamed
    monkeypatch.setitem(sys.modules, path, fake)
    return fake


@pytest.mark.parametrize("drop", ["torch_chunk_gated_delta_rule", "causal_conv1d_update"])
def test_a_renamed_function_fails_loudly_naming_it_and_the_version(monkeypatch, drop):
    """A transformers release that renames a function use_linattn_kernels rebinds: an error naming the
    function and the transformers version, and nothing patched (not a silent slow path)."""
    originals = _originals()
    _stand_in(monkeypatch, "qwen3_5", drop)
    with pytest.raises(K.KernelPatchError, match=rf"{drop}.*transformers {transformers.__version__}"):
        H.use_linattn_kernels(["qwen3_next", "qwen3_5"])
    assert _restored(originals)  # qwen3_next, planned before qwen3_5 failed, was not patched either


def test_a_renamed_decoder_layer_fails_loudly(monkeypatch):
    fake = _stand_in(monkeypatch, "qwen3_5", "Qwen3_5DecoderLayer")
    assert not any(n.endswith("DecoderLayer") for n in vars(fake))
    with pytest.raises(K.KernelPatchError, match=rf"DecoderLayer.*transformers {transformers.__version__}"):
        H.use_linattn_kernels("qwen3_5")


def test_a_moved_modeling_module_fails_loudly(monkeypatch):
    import sys

    path, _ = K.MODEL_TYPES["olmo_hybrid"]
    monkeypatch.setitem(sys.modules, path, None)  # import of it raises ImportError, as a moved module does
    with pytest.raises(K.KernelPatchError, match=rf"{path}.*transformers {transformers.__version__}"):
        H.use_linattn_kernels("olmo_hybrid")
