"""The recall preset (issue 16): query-only MQAR logits, fresh data per step, the lr sweep, early stop,
state sizes, the criteria, the output files and `linattn eval --preset recall` end to end, all at
tiny sizes (the preset itself is too long for CI)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from linattn.training import data as D
from linattn.eval import recall, recall_stats
from linattn.cli import main as cli_main
from linattn.eval.kinds import kind_model
from linattn.models import LinearTransformerLM, ModelConfig
from linattn.eval.recall_report import RECORD_KEYS, recall_json, render_recall_markdown, write_recall_report
from linattn.training.tasks import LMTask, MqarTask


@pytest.fixture(autouse=True)
def _single_thread(one_thread):
    yield


def tiny_preset(**kw) -> recall.RecallPreset:
    """RECALL_PRESET at a size that trains in well under a second per run."""
    base = dict(model={**recall.RECALL_PRESET.model, "d_model": 16}, settings=((16, 2, 8),), steps=4,
                warmup_steps=1, eval_interval=2, eval_samples=16, vocab_size=32, seeds=(0,))
    return dataclasses.replace(recall.RECALL_PRESET, **{**base, **kw})


def _mqar_task(**kw) -> MqarTask:
    return MqarTask({"seq_len": 32, "n_pairs": 4, "vocab_size": 64, **kw}, batch_size=6, seed=3, eval_samples=8)


@pytest.mark.parametrize("kind", ["softmax", "elu", "taylor", "gla", "gated_deltanet", "hybrid"])
def test_query_only_logits_equal_full_logits_at_the_query_positions(kind):
    p = tiny_preset()
    cfg = ModelConfig.from_dict({**kind_model(kind, p.model, p.kind_options), "vocab_size": 64, "max_len": 32})
    torch.manual_seed(0)
    model = LinearTransformerLM(cfg).double()
    task = _mqar_task()
    batch = task.train_batch(0)
    keep = batch.targets != D.IGNORE_INDEX
    full, _ = model(batch.inputs)
    index = keep.nonzero()[:, 1].view(6, 4)
    some, _ = model(batch.inputs, logits_at=index)
    assert some.shape == (6, 4, 64)
    torch.testing.assert_close(some, full[keep].view(6, 4, 64), rtol=1e-12, atol=1e-12)
    # the task's loss through the query-only path equals LMTask's full-logits loss (both in float32)
    loss, correct = task.loss_stats(model, batch)
    ref_loss, ref_correct = LMTask.loss_stats(task, model, batch)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    assert int(correct) == int(ref_correct)
    # and its gradients
    g = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
    g_ref = torch.autograd.grad(LMTask.loss_stats(task, model, batch)[0], list(model.parameters()), allow_unused=True)
    for a, b in zip(g, g_ref):
        if a is None or b is None:
            assert a is None and b is None
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_query_only_logits_project_only_the_queries(monkeypatch):
    model = LinearTransformerLM(ModelConfig.from_dict({**recall.RECALL_PRESET.model, "d_model": 16, "vocab_size": 64,
                                                       "max_len": 32, "attention": ["softmax"]}))
    rows = []
    from linattn.models import lm

    original = lm.linear_cross_entropy
    monkeypatch.setattr(lm, "linear_cross_entropy", lambda h, *a, **kw: rows.append(h.shape) or original(h, *a, **kw))
    _mqar_task().loss_stats(model, _mqar_task().train_batch(0))
    assert rows == [torch.Size([6, 4, 16])]  # n_pairs rows per sequence, not seq_len


def test_rows_with_different_query_counts_fall_back_to_full_logits():
    """A shard of a sequence may hold different numbers of queries per row: same loss as LMTask's."""
    model = LinearTransformerLM(ModelConfig.from_dict({"d_model": 16, "n_layers": 1, "n_heads": 2, "vocab_size": 64,
                                                       "max_len": 32}))
    task = _mqar_task()
    b = task.train_batch(0)
    targets = b.targets.clone()
    first = (targets[0] != D.IGNORE_INDEX).nonzero()[0, 0]
    targets[0, first] = D.IGNORE_INDEX  # row 0 now has 3 queries, the others 4
    b = D.TaskBatch(b.inputs, targets, b.vocab_size)
    loss, correct = task.loss_stats(model, b)
    ref, ref_correct = LMTask.loss_stats(task, model, b)
    torch.testing.assert_close(loss, ref)
    assert int(correct) == int(ref_correct)


def test_training_data_is_fresh_every_step_and_reproducible():
    task = _mqar_task()
    batches = [task.train_batch(s) for s in range(4)]
    keys = [b.inputs[:, 0:8:2] for b in batches]
    for i in range(4):
        for j in range(i + 1, 4):
            assert not torch.equal(keys[i], keys[j])
    again = _mqar_task().train_batch(2)  # a function of (seed, step): a resumed run sees the same batch
    assert torch.equal(again.inputs, batches[2].inputs) and torch.equal(again.targets, batches[2].targets)
    val = next(task.validation_batches(8))
    assert all(not torch.equal(val.inputs[:6], b.inputs) for b in batches)
    # the preset's configs draw their own MQAR task with the 8192 vocabulary, 16 keys at (64, 16)
    cfg = recall.recall_config(recall.RECALL_PRESET, "softmax", 64, 16, 64, 1e-2)
    assert cfg.task == "mqar" and cfg.task_options == {"seq_len": 64, "n_pairs": 16, "vocab_size": 8192}


def test_preset_configs_follow_the_recipe():
    p = recall.RECALL_PRESET
    runs, skipped = recall.recall_plan(p)
    assert skipped == []
    assert {r[0] for r in runs} == set(recall.RECALL_KINDS)
    assert len(p.seeds) >= 3
    per_kind = sum(len(p.setting_lrs(n, pairs)) for n, pairs, _b in p.settings)
    assert len(runs) == len(recall.RECALL_KINDS) * per_kind * len(p.seeds)
    # every kind at (64, 16) over the lr sweep and at two harder settings (more pairs at longer length)
    assert p.settings[0][:2] == (64, 16) and p.setting_lrs(64, 16) == p.lrs and len(p.lrs) >= 2
    harder = [(n, pairs) for n, pairs, _b in p.settings[1:]]
    assert len(harder) >= 2 and all(n > 64 and pairs > 16 for n, pairs in harder)
    assert all(set(p.setting_kinds(n, pairs, recall.RECALL_KINDS)) == set(recall.RECALL_KINDS) for n, pairs in harder)
    assert len({r[5]["config_digest"] for r in runs}) == len(runs)  # every run its own config
    for kind, n, pairs, lr, cfg, meta in runs:
        assert cfg.seed == meta["seed"] and meta["variant"] == ""
        mc = cfg.model_config()
        assert mc.block == "conv_mixer" and mc.vocab_size == 8192 and pairs >= 8
        assert cfg.weight_decay == 0.1 and cfg.min_lr_ratio == 0.0 and cfg.stop_accuracy == 0.99
        assert cfg.eval_interval > 0 and cfg.lr in p.lrs
        if kind == "hybrid":
            assert mc.layer_kinds.count("softmax") == 1 and mc.layer_kinds[0] in ("retnet", "simple_gla", "gla")
    with pytest.raises(ValueError, match="unknown recall kind"):
        recall.recall_plan(p, ["relu"])


def test_state_size_is_the_kv_cache_for_softmax_and_constant_for_recurrent_kinds():
    p = tiny_preset()

    def size(kind, n):
        cfg = ModelConfig.from_dict({**kind_model(kind, p.model, p.kind_options), "vocab_size": 32, "max_len": 64})
        return recall.state_size(LinearTransformerLM(cfg), n)

    d = p.model["d_model"]
    assert size("softmax", 32) - size("softmax", 16) == 16 * 2 * d  # keys and values of 16 more tokens
    for kind in ("elu", "taylor", "gla", "deltanet"):
        assert size(kind, 32) == size(kind, 16)
    # Taylor's state is (1 + d' + d'^2) x head dim; elu+1's d' x head dim (d' = 8 here)
    assert size("taylor", 16) - size("elu", 16) == (73 - 8) * (d + 1)


def _rec(kind, lr, acc, steps=100, n=64, p=16, seed=0):
    return {"kind": kind, "seq_len": n, "n_pairs": p, "lr": lr, "state_size": 10, "accuracy": acc, "steps": steps,
            "steps_to_stop": None, "curve": [(steps, acc)], "status": "completed", "elapsed_s": 1.0,
            "parameters": 1, "message": "", "seed": seed, "variant": ""}


def test_the_lr_sweep_keeps_the_best_run():
    records = [_rec("elu", 1e-3, 0.2), _rec("elu", 3e-3, 0.7), _rec("elu", 1e-2, 0.5),
               _rec("softmax", 1e-3, 0.99, steps=300), _rec("softmax", 1e-2, 0.99, steps=200),
               _rec("taylor", 1e-3, None), _rec("taylor", 1e-2, 0.1),
               _rec("elu", 1e-2, 0.9, n=128, p=32)]
    best = {(r["seq_len"], r["kind"]): r["lr"] for r in recall.best_runs(records)}
    assert best == {(64, "elu"): 3e-3, (64, "softmax"): 1e-2, (64, "taylor"): 1e-2, (128, "elu"): 1e-2}


def test_criteria():
    good = {"softmax": 0.99, "taylor": 0.95, "elu": 0.7, "favor": 0.2, "cosformer": 0.05,
            **{k: 0.91 for k in recall_stats.DELTA_KINDS}}
    out = recall.check_criteria([_rec(k, 1e-2, a) for k, a in good.items()])
    assert len(out) == len(recall.CRITERIA) and all(c["holds"] and c["holds_every_seed"] for c in out)
    bad = recall.check_criteria([_rec(k, 1e-2, a) for k, a in {**good, "elu": 0.8, "softmax": 0.9}.items()])
    failed = {c["check"] for c in bad if not c["holds"]}
    assert failed == {"softmax ≥ 0.95", "elu+1 ≤ Taylor − 0.20"}
    assert recall.check_criteria([_rec(k, 1e-2, a, p=4) for k, a in good.items()]) == []  # < 8 pairs: no claim
    partial = recall.check_criteria([_rec("softmax", 1e-2, 0.99)])
    assert [c["holds"] for c in partial] == [True] + [None] * (len(recall.CRITERIA) - 1)


def test_early_stop_ends_a_run_at_the_first_validation_that_reaches_it():
    p = tiny_preset(steps=40, stop_accuracy=0.05)
    kind, n, pairs, lr, cfg, _meta = recall.recall_plan(p, ["softmax"])[0][0]
    rec = recall._run(kind, n, pairs, lr, cfg)
    assert rec["status"] == "completed" and rec["steps"] < 40
    assert rec["steps_to_stop"] == rec["steps"] and rec["accuracy"] >= 0.05
    assert all(a < 0.05 for s, a in rec["curve"][:-1])
    full = recall._run(kind, n, pairs, lr, dataclasses.replace(cfg, stop_accuracy=None))
    assert full["steps"] == 40 and full["steps_to_stop"] is None


def test_ctrl_c_in_one_run_stops_the_sweep_with_the_partial_report(monkeypatch):
    calls, seen = [], []

    def fake_run(kind, n, pairs, lr, cfg, meta=None):  # train() turns a Ctrl-C into an "interrupted" run
        calls.append(kind)
        return {**_rec(kind, lr, 0.1, n=n, p=pairs), "status": "interrupted" if len(calls) == 2 else "completed"}

    monkeypatch.setattr(recall, "_run", fake_run)
    with pytest.raises(KeyboardInterrupt) as info:
        recall.run_recall(tiny_preset(), kinds=["softmax", "elu"], progress=False, on_record=seen.append)
    report = info.value.args[0]
    assert len(calls) == 2 and [r["status"] for r in report["records"]] == ["completed", "interrupted"]
    assert seen == report["records"] and report["wall_s"] >= 0 and len(report["summary"]) == 1


def test_run_recall_writes_the_issue_schema(tmp_path):
    report = recall.run_recall(tiny_preset(), kinds=["softmax", "deltanet"], progress=False)
    assert len(report["records"]) == 2 * 2 and report["wall_s"] > 0
    for r in report["records"]:
        assert r["steps"] <= 4 and r["curve"] and 0 <= r["accuracy"] <= 1 and r["cpu_s"] > 0
    paths = write_recall_report(report, tmp_path)
    data = json.loads(paths["json"].read_text())
    assert set(data) == {"records", "summary", "wall_s", "machine"}
    assert len(data["records"]) == 4
    for r in data["records"]:
        assert tuple(r) == RECORD_KEYS
        assert r["kind"] in recall.RECALL_KINDS and isinstance(r["seq_len"], int) and isinstance(r["n_pairs"], int)
        assert isinstance(r["lr"], float) and isinstance(r["state_size"], int) and isinstance(r["accuracy"], float)
        assert r["seed"] == 0 and r["variant"] == ""
    assert data["machine"]["cpu"] and data == json.loads(json.dumps(recall_json(report)))
    assert paths["png"].stat().st_size > 10_000
    md = paths["markdown"].read_text()
    assert "| DeltaNet |" in md and "state (floats/layer)" in md and "Wall time" in md and "CPU s in total" in md
    assert render_recall_markdown(report) == md


def test_cli_preset_recall_end_to_end(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(recall, "RECALL_PRESET", tiny_preset(settings=((32, 8, 8),)))
    out = tmp_path / "out"
    assert cli_main(["eval", "--preset", "recall", "--jobs", "2", "--kinds", "softmax,taylor,deltanet,elu,favor,"
                     "cosformer", "--quiet", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "MQAR (32, 8) acc" in text and "Taylor ≥ 0.90" in text
    data = json.loads((out / "recall.json").read_text())
    assert sorted({r["kind"] for r in data["records"]}) == sorted(["softmax", "taylor", "deltanet", "elu", "favor",
                                                                   "cosformer"])
    assert data["machine"]["jobs"] == 2 and data["machine"]["threads_per_job"] == 1
    assert {p.name for p in out.iterdir()} >= {"recall.json", "recall-runs.json", "recall.md", "recall.png",
                                              "recall.txt", "recall-runs.jsonl"}
    lines = [json.loads(x) for x in (out / "recall-runs.jsonl").read_text().splitlines()]  # written as runs end
    assert len(lines) == len(data["records"]) and {x["kind"] for x in lines} == {r["kind"] for r in data["records"]}


def test_cli_preset_recall_rejects_what_it_does_not_take(capsys):
    assert cli_main(["eval", "--preset", "recall", "--tasks", "copy"]) == 2
    assert "--preset recall takes no --tasks" in capsys.readouterr().err
    assert cli_main(["eval", "--preset", "recall", "--seeds", "0,0", "--kinds", "softmax"]) == 2
    assert "seeds must not repeat" in capsys.readouterr().err
    assert cli_main(["eval", "--preset", "recall", "--kinds", "relu"]) == 2
    assert "unknown recall kind" in capsys.readouterr().err
