"""linattn.training.train: loss goes down, exact resume, accumulation, bf16, ListOps, non-finite loss, Ctrl-C."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch

from linattn.models import LinearTransformerLM
from linattn.training import EXIT_DIVERGED, EXIT_INTERRUPTED, TrainConfig, find_checkpoint, read_metrics, train

from .helpers import TINY_MODEL, bytes_config, mqar_config, stop_at

def test_tiny_run_lowers_loss_and_writes_outputs(corpus, tmp_path):
    cfg = bytes_config(corpus, steps=40, eval_interval=20, checkpoint_interval=20, out_dir=str(tmp_path / "run"))
    res = train(cfg, progress=False)
    assert res.status == "completed" and res.exit_code == 0 and res.step == 40
    first, last = sum(res.losses[:4]) / 4, sum(res.losses[-4:]) / 4
    assert last < first - 0.5, (first, last)
    assert res.final is not None and 0 < res.final["bpb"] < 8.0
    assert [v["step"] for v in res.validation] == [20, 40]
    out = tmp_path / "run"
    recs = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in recs if r["split"] == "train"] == list(range(1, 41))
    assert all({"loss", "lr", "grad_norm", "tokens_per_s"} <= set(r) for r in recs if r["split"] == "train")
    assert (out / "loss.png").stat().st_size > 1000
    assert json.loads((out / "train_config.json").read_text())["steps"] == 40
    ckpts = out / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("step-*")) == ["step-00000020", "step-00000040"]
    assert find_checkpoint(out).name == "step-00000040"
    # the checkpoint is a plain model folder too
    model = LinearTransformerLM.from_pretrained(ckpts / "last")
    for a, b in zip(model.state_dict().values(), res.model.state_dict().values()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("task", ["bytes", "mqar"])
def test_resume_equals_uninterrupted_run(task, corpus, tmp_path):
    make = (lambda **kw: bytes_config(corpus, **kw)) if task == "bytes" else mqar_config
    full = train(make(out_dir=str(tmp_path / "a")), progress=False)
    part = train(make(out_dir=str(tmp_path / "b")), progress=False, callback=stop_at(3))
    assert part.status == "interrupted" and part.exit_code == EXIT_INTERRUPTED and part.step == 3
    assert part.checkpoint is not None and part.checkpoint.name == "step-00000003"
    assert part.losses == full.losses[:3]
    rest = train(make(out_dir=str(tmp_path / "b"), resume="latest"), progress=False)
    assert rest.status == "completed" and rest.start_step == 3 and rest.step == 8
    assert rest.losses == full.losses[3:]  # exactly: same data, dropout masks, optimizer and schedule
    for (name, a), b in zip(full.model.state_dict().items(), rest.model.state_dict().values()):
        assert torch.equal(a, b), name
    steps = [r["step"] for r in read_metrics(tmp_path / "b" / "metrics.jsonl") if r["split"] == "train"]
    assert steps == list(range(1, 9))


def test_grad_accum_matches_one_big_batch():
    a = train(mqar_config(steps=3, model=dict(TINY_MODEL), eps=1e-6), progress=False)
    b = train(mqar_config(steps=3, model=dict(TINY_MODEL), eps=1e-6, grad_accum=4), progress=False)
    torch.testing.assert_close(torch.tensor(a.losses), torch.tensor(b.losses), rtol=1e-5, atol=1e-6)
    for x, y in zip(a.model.parameters(), b.model.parameters()):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)


def test_bf16_autocast_and_activation_checkpointing(corpus):
    res = train(bytes_config(corpus, steps=3, dtype="bfloat16", activation_checkpointing=True), progress=False)
    assert res.status == "completed" and all(torch.isfinite(torch.tensor(res.losses)))


def test_listops_encoder_trains():
    cfg = TrainConfig(task="listops", task_options={"max_depth": 3, "max_args": 3, "min_len": 4, "max_len": 24},
                      model=dict(TINY_MODEL), batch_size=8, steps=3, warmup_steps=1, eval_samples=16)
    res = train(cfg, progress=False)
    assert type(res.model).__name__ == "LinearTransformerEncoder"
    assert res.status == "completed" and 0 <= res.final["accuracy"] <= 1


def test_non_finite_loss_stops_and_keeps_last_good_checkpoint(tmp_path):
    def poison(info):
        if info.step == 3:
            with torch.no_grad():
                next(info.model.parameters()).fill_(float("nan"))

    out = tmp_path / "run"
    res = train(mqar_config(steps=10, checkpoint_interval=2, out_dir=str(out)), progress=False, callback=poison)
    assert res.status == "diverged" and res.exit_code == EXIT_DIVERGED
    assert res.step == 3 and "non-finite" in res.message and "step 4" in res.message
    assert "step-00000002" in res.message
    assert find_checkpoint(out).name == "step-00000002"
    assert not (out / "checkpoints" / "step-00000004").exists()
    ok = LinearTransformerLM.from_pretrained(out / "checkpoints" / "last")
    assert all(torch.isfinite(p).all() for p in ok.parameters())


def test_sigint_stops_after_the_step_and_saves(tmp_path):
    """A real SIGINT (the first Ctrl-C) only sets a flag: the step finishes, a checkpoint is saved."""
    def ctrl_c(info):
        if info.step == 2:
            os.kill(os.getpid(), signal.SIGINT)

    handler = signal.getsignal(signal.SIGINT)
    res = train(mqar_config(out_dir=str(tmp_path / "run")), progress=False, callback=ctrl_c)
    assert signal.getsignal(signal.SIGINT) is handler  # restored
    assert res.status == "interrupted" and res.step == 3 and "checkpoint saved" in res.message
    assert find_checkpoint(tmp_path / "run").name == "step-00000003"


def test_interrupt_without_out_dir_returns_interrupted():
    res = train(mqar_config(), progress=False, callback=stop_at(2))
    assert res.status == "interrupted" and res.step == 2 and res.checkpoint is None


def _copy_config(**kw) -> TrainConfig:
    base = dict(task="copy", task_options={"max_len": 6, "n_symbols": 5}, model=dict(TINY_MODEL), batch_size=8,
                steps=12, warmup_steps=2, lr=3e-3, eval_interval=2, eval_samples=32, log_interval=1)
    base.update(kw)
    return TrainConfig(**base)


def test_stop_accuracy_ends_the_run_at_the_first_validation_that_reaches_it():
    full = train(_copy_config(), progress=False)
    accs = [v["accuracy"] for v in full.validation]
    assert len(accs) == 6 and not full.stopped_early and full.step == 12
    # a threshold the 2nd..5th validation reaches first (strictly above the earlier ones)
    k = next(i for i in range(1, 5) if accs[i] > max(accs[:i]))
    target = accs[k]
    res = train(_copy_config(stop_accuracy=target), progress=False)
    assert res.status == "completed" and res.stopped_early and res.step == 2 * (k + 1)
    assert "stopped early after" in res.message and f"stop_accuracy {target:g}" in res.message
    assert [v["step"] for v in res.validation] == [2 * (i + 1) for i in range(k + 1)]
    assert res.final == res.validation[-1] and res.final["accuracy"] >= target
    assert res.losses == full.losses[:res.step]  # the same trajectory up to the stop: the schedule is not changed


def test_stop_accuracy_never_reached_runs_every_step():
    res = train(_copy_config(steps=4, stop_accuracy=1.0, eval_samples=64, task_options={"max_len": 12,
                                                                                          "n_symbols": 9}),
                progress=False)
    assert res.status == "completed" and not res.stopped_early and res.step == 4
