"""linattn.models: config, LM (parallel == recurrent), encoder, training integrations
(activation checkpointing, autocast, torch.compile, DDP, sequence parallelism)."""

import json
import os

import pytest
import torch
import torch.nn.functional as F

from linattn.nn.feature_maps import FEATURE_MAPS
from linattn.nn.caches import KVCache, LinearAttentionCache
from linattn.models import LinearTransformerEncoder, LinearTransformerLM, ModelConfig

from .conftest import spread, tiny_config


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


tiny = tiny_config


# ---------------------------------------------------------------------------------------------
# config


def test_config_json_round_trip():
    cfg = tiny(n_layers=8, attention=["linear", "linear", "linear", "softmax"], feature_map="favor",
               feature_map_options={"num_features": 16, "redraw_interval": 100}, positions="learned", dropout=0.1,
               tie_embeddings=False, norm="layernorm", activation="gelu", num_classes=10, pooling="first")
    back = ModelConfig.from_json(cfg.to_json())
    assert back == cfg and back.to_dict() == cfg.to_dict()
    assert json.loads(cfg.to_json())["attention"] == ["linear", "linear", "linear", "softmax"]
    assert back.layer_kinds == ["linear", "linear", "linear", "softmax"] * 2


def test_config_attention_forms():
    assert tiny(n_layers=4, attention="linear").layer_kinds == ["linear"] * 4
    assert tiny(n_layers=4, attention="linear, softmax").layer_kinds == ["linear", "softmax"] * 2
    assert tiny(n_layers=2, attention=("softmax", "linear")).attention == ["softmax", "linear"]


@pytest.mark.parametrize("kw, field", [
    (dict(vocab_size=0), "vocab_size"),
    (dict(d_model=30), "d_model"),
    (dict(n_layers=3, attention=["linear", "softmax"]), "attention"),
    (dict(attention=["linear", "mamba"]), "attention"),
    (dict(attention=[]), "attention"),
    (dict(feature_map="gaussian"), "feature_map"),
    (dict(feature_map="favor", feature_map_options={"bogus": 1}), "feature_map_options"),
    (dict(feature_map_options={"x": object()}), "feature_map_options"),
    (dict(positions="alibi"), "positions"),
    (dict(norm="batchnorm"), "norm"),
    (dict(activation="relu"), "activation"),
    (dict(dropout=1.0), "dropout"),
    (dict(d_ff=-4), "d_ff"),
    (dict(qk_dim=0), "qk_dim"),
    (dict(pooling="max"), "pooling"),
    (dict(tie_embeddings="yes"), "tie_embeddings"),
    (dict(max_len=0), "max_len"),
    (dict(chunk_size=0), "chunk_size"),
    (dict(chunk_size=True), "chunk_size"),
])
def test_config_rejects_bad_values(kw, field):
    with pytest.raises(ValueError, match=field):
        tiny(**kw)


def test_chunk_size_reaches_the_linear_layers_and_keeps_the_numbers(monkeypatch):
    """ModelConfig.chunk_size (default 64) is the chunk of every linear layer's chunked operator;
    other chunk sizes give the same logits up to rounding (float64 here)."""
    from linattn.nn.families import linear as layers

    assert tiny().chunk_size == 64
    cfg = tiny(attention=["linear", "softmax"], chunk_size=5)
    model = spread(LinearTransformerLM(cfg)).double()
    assert [b.attn.chunk_size for b in model.blocks if b.attn.kind == "linear"] == [5]
    seen = []
    op = layers.linear_attention
    monkeypatch.setattr(layers, "linear_attention", lambda *a, **kw: seen.append(kw["chunk_size"]) or op(*a, **kw))
    ids = torch.randint(0, 40, (2, 23), generator=torch.Generator().manual_seed(0))
    logits, _ = model(ids)
    assert seen == [5]
    ref = LinearTransformerLM(ModelConfig.from_dict({**cfg.to_dict(), "chunk_size": 64})).double()
    ref.load_state_dict(model.state_dict())
    torch.testing.assert_close(logits, ref(ids)[0], rtol=1e-10, atol=1e-10)
    # a checkpoint written before the field existed loads with the default
    d = tiny().to_dict()
    del d["chunk_size"]
    assert ModelConfig.from_dict(d).chunk_size == 64


def test_config_from_dict_rejects_unknown_fields():
    d = tiny().to_dict()
    d["n_layer"] = 3
    with pytest.raises(ValueError, match="n_layer"):
        ModelConfig.from_dict(d)
    with pytest.raises(ValueError, match="JSON"):
        ModelConfig.from_json("{not json")


# ---------------------------------------------------------------------------------------------
# LM: recurrent decoding == parallel forward


def _decode_all(model, ids, prefill):
    cache = model.new_cache()
    logits, cache = model(ids[:, :prefill], cache=cache)
    out = [logits]
    for t in range(prefill, ids.shape[1]):
        logits, cache = model(ids[:, t:t + 1], cache=cache)
        out.append(logits)
    return torch.cat(out, 1), cache


@pytest.mark.parametrize("fm", sorted(FEATURE_MAPS))
def test_lm_step_decoding_equals_parallel_fp32(fm):
    """For every feature map, with RoPE, in a hybrid (linear + softmax) LM: the logits of prefill +
    token-by-token decoding equal the full parallel forward at every position (fp32)."""
    torch.manual_seed(0)
    cfg = tiny(attention=["linear", "softmax"], feature_map=fm, positions="rope", qk_dim=4 if fm == "taylor" else None)
    model = spread(LinearTransformerLM(cfg)).eval()
    ids = torch.randint(0, 40, (2, 20))
    with torch.no_grad():
        full, _ = model(ids)
        rec, cache = _decode_all(model, ids, prefill=7)
    scale = full.abs().max()
    assert scale > 1.0  # logits far from trivial
    torch.testing.assert_close(rec, full, rtol=0, atol=2e-5 * scale)
    assert isinstance(cache.layers[0], LinearAttentionCache) and isinstance(cache.layers[1], KVCache)


@pytest.mark.parametrize("attention", [["linear"], ["linear", "softmax"], ["softmax", "linear"]])
@pytest.mark.parametrize("positions", ["rope", "learned", "none"])
def test_lm_step_decoding_equals_parallel_fp64(attention, positions):
    torch.manual_seed(1)
    model = spread(LinearTransformerLM(tiny(attention=attention, positions=positions))).double().eval()
    ids = torch.randint(0, 40, (2, 15))
    with torch.no_grad():
        full, _ = model(ids)
        rec, _ = _decode_all(model, ids, prefill=1)
    torch.testing.assert_close(rec, full, rtol=1e-10, atol=1e-10)


def test_lm_chunked_prefill_continuation():
    """Feeding a cached model blocks of several tokens equals the parallel forward."""
    torch.manual_seed(2)
    model = spread(LinearTransformerLM(tiny(attention=["linear", "softmax"]))).double().eval()
    ids = torch.randint(0, 40, (1, 30))
    with torch.no_grad():
        full, _ = model(ids)
        cache = model.new_cache()
        parts = [model(ids[:, a:b], cache=cache)[0] for a, b in ((0, 9), (9, 10), (10, 25), (25, 30))]
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-10, atol=1e-10)


def test_lm_is_causal():
    torch.manual_seed(3)
    model = spread(LinearTransformerLM(tiny(attention=["linear", "softmax"]))).double().eval()
    ids = torch.randint(0, 40, (1, 12))
    other = ids.clone()
    other[:, 8:] = (other[:, 8:] + 1) % 40
    a, _ = model(ids)
    b, _ = model(other)
    torch.testing.assert_close(a[:, :8], b[:, :8], rtol=1e-12, atol=1e-12)
    assert (a[:, 8:] - b[:, 8:]).abs().max() > 1e-3


@pytest.mark.parametrize("attention", [["linear"], ["linear", "softmax"]])
def test_lm_left_padded_batch_equals_single(attention):
    torch.manual_seed(4)
    model = spread(LinearTransformerLM(tiny(attention=attention, feature_map="cosformer"))).double().eval()
    ids = torch.randint(0, 40, (1, 9))
    alone, _ = model(ids)
    batch = torch.cat((torch.cat((torch.zeros(1, 4, dtype=torch.long), ids), 1), torch.randint(0, 40, (1, 13))))
    mask = torch.ones(2, 13, dtype=torch.bool)
    mask[0, :4] = False
    logits, _ = model(batch, mask)
    assert torch.isfinite(logits).all()
    torch.testing.assert_close(logits[0, 4:], alone[0], rtol=1e-10, atol=1e-10)


def test_tied_and_untied_embeddings():
    tied = LinearTransformerLM(tiny())
    assert tied.lm_head.weight is tied.tok_emb.weight
    untied = LinearTransformerLM(tiny(tie_embeddings=False))
    assert untied.lm_head.weight is not untied.tok_emb.weight
    assert sum(p.numel() for p in untied.parameters()) == sum(p.numel() for p in tied.parameters()) + 40 * 32


def test_init_is_seeded_and_favor_layers_differ():
    a = LinearTransformerLM(tiny(feature_map="favor", seed=5))
    b = LinearTransformerLM(tiny(feature_map="favor", seed=5))
    c = LinearTransformerLM(tiny(feature_map="favor", seed=6))
    for (k, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), k
    assert not torch.equal(a.tok_emb.weight, c.tok_emb.weight)
    om = [blk.attn.feature_map.omega for blk in a.blocks]
    assert not torch.equal(om[0], om[1])


def test_lm_loss_is_next_token_cross_entropy():
    torch.manual_seed(5)
    model = spread(LinearTransformerLM(tiny())).double()
    ids = torch.randint(0, 40, (2, 10))
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[1, 7:] = False
    logits, _ = model(ids[:, :-1], mask[:, :-1])
    keep = mask[:, 1:]
    ref = F.cross_entropy(logits[keep], ids[:, 1:][keep])
    torch.testing.assert_close(model.loss(ids, mask), ref, rtol=1e-12, atol=1e-12)


def test_dropout_only_in_training():
    model = LinearTransformerLM(tiny(attention=["linear", "softmax"], dropout=0.3))
    ids = torch.randint(0, 40, (2, 12))
    model.train()
    a, b = model(ids)[0], model(ids)[0]
    assert (a - b).abs().max() > 1e-4
    model.eval()
    torch.testing.assert_close(model(ids)[0], model(ids)[0], rtol=0, atol=0)


def test_forward_rejects_bad_input():
    model = LinearTransformerLM(tiny(positions="learned", max_len=8))
    with pytest.raises(ValueError, match="ids"):
        model(torch.randn(1, 4))
    with pytest.raises(ValueError, match="mask"):
        model(torch.zeros(1, 4, dtype=torch.long), torch.ones(1, 4))
    with pytest.raises(ValueError, match="max_len"):
        model(torch.zeros(1, 9, dtype=torch.long))


# ---------------------------------------------------------------------------------------------
# encoder


@pytest.mark.parametrize("attention", [["linear"], ["softmax", "linear"]])
@pytest.mark.parametrize("pooling", ["mean", "first"])
def test_encoder_padding_invariance(attention, pooling):
    torch.manual_seed(6)
    model = spread(LinearTransformerEncoder(tiny(attention=attention, num_classes=5, pooling=pooling,
                                                  positions="learned"))).double().eval()
    ids = torch.randint(1, 40, (1, 7))
    alone = model(ids)
    assert alone.shape == (1, 5)
    right = torch.cat((ids, torch.zeros(1, 3, dtype=torch.long)), 1)
    left = torch.cat((torch.zeros(1, 3, dtype=torch.long), ids), 1)
    rmask = torch.tensor([[True] * 7 + [False] * 3])
    for x, m in ((right, rmask), (left, rmask.flip(1))):
        torch.testing.assert_close(model(x, m), alone, rtol=1e-10, atol=1e-10)


def test_encoder_is_bidirectional_and_needs_num_classes():
    torch.manual_seed(7)
    model = spread(LinearTransformerEncoder(tiny(num_classes=3))).double().eval()
    ids = torch.randint(0, 40, (1, 6))
    other = ids.clone()
    other[0, -1] = (other[0, -1] + 1) % 40
    assert (model.encode(ids)[0, 0] - model.encode(other)[0, 0]).abs().max() > 1e-4
    with pytest.raises(ValueError, match="num_classes"):
        LinearTransformerEncoder(tiny())


# ---------------------------------------------------------------------------------------------
# training integrations


def _grads(model, ids):
    model.zero_grad()
    model.loss(ids).backward()
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def test_activation_checkpointing_gives_same_gradients():
    torch.manual_seed(8)
    model = spread(LinearTransformerLM(tiny(attention=["linear", "softmax"], feature_map="hedgehog"))).double()
    ids = torch.randint(0, 40, (2, 12))
    ref = _grads(model, ids)
    model.set_activation_checkpointing(True)
    got = _grads(model, ids)
    assert got.keys() == ref.keys() and "blocks.0.attn.feature_map.weight" in got
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-10, atol=1e-12)


def test_activation_checkpointing_keeps_favor_projection():
    """The recomputation must not advance FAVOR+'s redraw schedule (a redraw every call here)."""
    import copy

    torch.manual_seed(12)
    base = LinearTransformerEncoder(tiny(num_classes=3, feature_map="favor",
                                         feature_map_options={"redraw_interval": 1})).double().train()
    ids = torch.randint(0, 40, (2, 8))
    base(ids)  # first call counts; the next one redraws
    plain, ckpt = copy.deepcopy(base), copy.deepcopy(base)
    ckpt.set_activation_checkpointing(True)
    grads = []
    for m in (plain, ckpt):
        m(ids).square().sum().backward()
        grads.append({k: p.grad for k, p in m.named_parameters()})
    fm_plain, fm_ckpt = plain.blocks[0].attn.feature_map, ckpt.blocks[0].attn.feature_map
    assert int(fm_ckpt.draws) == int(fm_plain.draws) and torch.equal(fm_ckpt.omega, fm_plain.omega)
    for k in grads[0]:
        torch.testing.assert_close(grads[1][k], grads[0][k], rtol=1e-10, atol=1e-12)


def test_autocast_bf16_cpu():
    torch.manual_seed(9)
    model = spread(LinearTransformerLM(tiny(attention=["linear", "softmax"], feature_map="favor")), scale=0.1)
    ids = torch.randint(0, 40, (2, 16))
    ref, _ = model(ids)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = model(ids)
        loss = model.loss(ids)
    loss.backward()
    assert out.dtype == torch.bfloat16
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    err = (out.float() - ref).abs().max() / ref.abs().max()
    assert err < 0.05, err


def _compile_check():
    torch.manual_seed(10)
    model = spread(LinearTransformerLM(tiny(attention=["linear", "softmax"])), scale=0.1)
    ids = torch.randint(0, 40, (2, 16))
    ref_logits, _ = model(ids)
    ref = _grads(model, ids)
    compiled = torch.compile(model)
    out, _ = compiled(ids)
    torch.testing.assert_close(out, ref_logits, rtol=1e-4, atol=1e-5)
    model.zero_grad()
    logits, _ = compiled(ids[:, :-1])
    F.cross_entropy(logits.reshape(-1, 40), ids[:, 1:].reshape(-1)).backward()
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref[k], rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_torch_compile():
    _compile_check()


# ---------------------------------------------------------------------------------------------
# multi-process: DDP and sequence parallelism (gloo, 2 processes)


def _batches():
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, 40, (2, 10), generator=g) for _ in range(2)]


def _check_ddp(rank):
    """DDP on 2 ranks, each with its own batch: gradients = the average of the single-process ones."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    cfg = tiny(attention=["linear", "softmax"], feature_map="favor")
    batches = _batches()
    ref_model = LinearTransformerLM(cfg)
    ref = [_grads(ref_model, b) for b in batches]
    model = LinearTransformerLM(cfg)
    ddp = DDP(model)
    ids = batches[rank]
    logits, _ = ddp(ids[:, :-1])
    F.cross_entropy(logits.reshape(-1, 40), ids[:, 1:].reshape(-1)).backward()
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad, (ref[0][k] + ref[1][k]) / 2, rtol=1e-5, atol=1e-7)


def _check_sequence_parallel(rank):
    """A hybrid RoPE LM with its sequence split unevenly over 2 ranks gives the single-process logits."""
    import torch.distributed as dist

    cfg = tiny(attention=["linear", "softmax"], positions="rope")
    model = spread(LinearTransformerLM(cfg)).double()
    ids = _batches()[0]
    full, _ = model(ids)
    model.set_sequence_parallel_group(dist.group.WORLD)
    a, b = [(0, 4), (4, 10)][rank]
    out, _ = model(ids[:, a:b], positions=torch.arange(a, b))
    torch.testing.assert_close(out, full[:, a:b], rtol=1e-9, atol=1e-9)


def _worker(rank, world, outdir):
    import traceback

    import torch.distributed as dist

    torch.set_num_threads(1)
    # a file rendezvous: no TCP port to race for with other test processes
    dist.init_process_group("gloo", init_method=f"file://{outdir}/rendezvous", rank=rank, world_size=world)
    results = {}
    try:
        for name, check in (("ddp", _check_ddp), ("sequence_parallel", _check_sequence_parallel)):
            try:
                check(rank)
                results[name] = "ok"
            except Exception:  # reported by the test that owns the check
                results[name] = traceback.format_exc()
    finally:
        dist.barrier()  # both ranks done with their collectives before the group's threads are torn down
        dist.destroy_process_group()
        with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
    # The results are written: leave without the interpreter's teardown, where a library thread still
    # joinable at exit aborted a worker once in CI ("terminate called without an active exception")
    os._exit(0)


@pytest.fixture(scope="module")
def two_process_results(tmp_path_factory):
    """Spawns 2 gloo processes once (start-up dominates the cost) and runs every multi-process check."""
    outdir = str(tmp_path_factory.mktemp("mp"))
    torch.multiprocessing.spawn(_worker, args=(2, outdir), nprocs=2, join=True)
    out = []
    for r in range(2):
        with open(os.path.join(outdir, f"rank{r}.json")) as f:
            out.append(json.load(f))
    return out


def test_ddp_gradients_are_the_average(two_process_results):
    for r, res in enumerate(two_process_results):
        assert res["ddp"] == "ok", f"rank {r}:\n{res['ddp']}"


def test_sequence_parallel_model_equals_single_process(two_process_results):
    for r, res in enumerate(two_process_results):
        assert res["sequence_parallel"] == "ok", f"rank {r}:\n{res['sequence_parallel']}"


def test_set_sequence_parallel_group_reaches_every_layer():
    model = LinearTransformerLM(tiny(attention=["linear", "softmax"]))
    model.set_sequence_parallel_group("G")
    assert [b.attn.sequence_parallel_group for b in model.blocks] == ["G", "G"]
    model.set_sequence_parallel_group(None)
    assert all(b.attn.sequence_parallel_group is None for b in model.blocks)

