"""linattn.training.tasks: tasks built from plain values, batches as functions of (seed, step), the
model config a task fills in, and evaluation."""

from __future__ import annotations

import math

import pytest
import torch

from linattn.training import data as D
from linattn.models.checkpoint import CheckpointError
from linattn.models import LinearTransformerEncoder, LinearTransformerLM
from linattn.training.tasks import TASK_CLASSES, BytesTask, CopyTask, ListOpsTask, MqarTask, evaluate

TINY = {"d_model": 16, "n_layers": 1, "n_heads": 2, "d_ff": 32}


def _equal(a, b) -> bool:
    return all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("inputs",) + (("targets",) if hasattr(a, "targets")
                                                                                  else ("labels", "mask")))


@pytest.mark.parametrize("cls, options", [(CopyTask, {"max_len": 5, "n_symbols": 4}),
                                          (MqarTask, {"seq_len": 16, "n_pairs": 2, "vocab_size": 32}),
                                          (ListOpsTask, {"max_depth": 3, "max_args": 3, "min_len": 4, "max_len": 20})])
def test_generated_batches_are_functions_of_seed_and_step(cls, options):
    a = cls(options, batch_size=4, seed=3, eval_samples=6)
    b = cls(options, batch_size=4, seed=3, eval_samples=6)
    assert _equal(a.train_batch(7), b.train_batch(7))  # another object, same (seed, step)
    assert not _equal(a.train_batch(7), a.train_batch(8))
    assert not _equal(a.train_batch(7), cls(options, batch_size=4, seed=4, eval_samples=6).train_batch(7))
    assert a.train_batch(0).inputs.shape == (4, a.seq_len)
    rows = [r.inputs.shape[0] for r in a.validation_batches(4)]
    assert rows == [4, 2]
    assert TASK_CLASSES[cls.name] is cls


def test_task_sizes_and_models():
    copy = CopyTask({"max_len": 5, "n_symbols": 4}, batch_size=2, seed=0, eval_samples=2)
    assert (copy.vocab_size, copy.seq_len) == (6, 11)
    mc = copy.model_config(TINY, seed=9)
    assert (mc.vocab_size, mc.max_len, mc.seed) == (6, 11, 9)
    assert isinstance(copy.build_model(mc), LinearTransformerLM)
    listops = ListOpsTask({"max_len": 20}, batch_size=2, seed=0, eval_samples=2)
    mc = listops.model_config(TINY, seed=0)
    assert (mc.num_classes, mc.vocab_size, mc.max_len) == (10, len(D.LISTOPS_TOKENS), 21)
    assert isinstance(listops.build_model(mc), LinearTransformerEncoder)
    with pytest.raises(ValueError, match="smaller than the copy task's vocabulary"):
        copy.model_config({**TINY, "vocab_size": 5}, seed=0)
    with pytest.raises(ValueError, match="raise model.max_len"):
        copy.model_config({**TINY, "positions": "learned", "max_len": 8}, seed=0)


def test_bad_options_name_the_task():
    with pytest.raises(ValueError, match="task_options for 'mqar'"):
        MqarTask({"n_pairs": 100}, batch_size=2, seed=0, eval_samples=2)
    with pytest.raises(ValueError, match="task_options for 'copy'.*unexpected keyword"):
        CopyTask({"colour": 1}, batch_size=2, seed=0, eval_samples=2)


def test_bytes_task_reads_its_corpus_on_first_use(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("linear attention " * 400, encoding="utf-8")
    missing = BytesTask(seq_len=16, batch_size=2, seed=0, eval_batches=1, corpus=[str(tmp_path / "none")])
    with pytest.raises(ValueError, match="none"):  # built without reading; reading names the path
        missing.load_data()
    task = BytesTask(seq_len=16, batch_size=2, seed=0, eval_batches=1, corpus=[str(text)])
    x = task.train_batch(5)
    assert x.inputs.shape == (2, 16) and torch.equal(x.targets[:, :-1], x.inputs[:, 1:])
    state = task.data_state(5)
    task.check_data_state(state, 5)
    with pytest.raises(CheckpointError, match="for task 'copy'"):
        task.check_data_state({**state, "task": "copy"}, 5)
    with pytest.raises(CheckpointError, match="does not fit this corpus"):
        task.check_data_state({**state, "seq_len": 32}, 5)


def test_evaluate_counts_scored_targets_and_reports_bits(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("abc " * 500, encoding="utf-8")
    task = BytesTask(seq_len=8, batch_size=2, seed=0, eval_batches=2, corpus=[str(text)])
    model = task.build_model(task.model_config(TINY, seed=0))
    m = evaluate(model, task, batch_size=3)
    assert m["count"] == 2 * 3 * 8 and m["bpb"] == pytest.approx(m["loss"] / math.log(2))
    copy = CopyTask({"max_len": 4}, batch_size=2, seed=0, eval_samples=5)
    model = copy.build_model(copy.model_config(TINY, seed=0))
    m = evaluate(model, copy)
    want = sum(copy.scored(b) for b in copy.validation_batches(100))
    assert m["count"] == want and "bpb" not in m and 0 <= m["accuracy"] <= 1
