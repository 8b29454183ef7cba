"""linattn.training and `linattn train`: loss goes down, exact resume, checkpoint errors, Ctrl-C,
non-finite loss, config files and flags, and 2-process DDP against one process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from linattn.checkpoint import CheckpointError
from linattn.cli import main as cli_main
from linattn.models import LinearTransformerLM
from linattn.training import (
    EXIT_DIVERGED,
    EXIT_INTERRUPTED,
    TrainConfig,
    find_checkpoint,
    lr_factor,
    read_metrics,
    train,
)

TINY_MODEL = {"d_model": 16, "n_layers": 2, "n_heads": 2, "d_ff": 32}


@pytest.fixture(autouse=True)
def _single_thread(one_thread):
    yield


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("corpus")
    words = ["alpha", "beta", "gamma", "delta", "linear", "attention", "kernel", "state", "the", "a"]
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(len(words), (6000,), generator=g).tolist()
    (d / "text.txt").write_text(" ".join(words[i] for i in idx), encoding="utf-8")
    return str(d)


def bytes_config(corpus, **kw) -> TrainConfig:
    base = dict(task="bytes", corpus=[corpus], model=dict(TINY_MODEL), seq_len=32, batch_size=8, steps=8,
                warmup_steps=2, lr=3e-3, eval_interval=0, eval_batches=2, log_interval=1)
    base.update(kw)
    return TrainConfig(**base)


def mqar_config(**kw) -> TrainConfig:
    base = dict(task="mqar", task_options={"seq_len": 16, "n_pairs": 2, "vocab_size": 32},
                model={**TINY_MODEL, "dropout": 0.1}, batch_size=8, steps=8, warmup_steps=2, lr=3e-3,
                eval_interval=0, eval_samples=16, log_interval=1)
    base.update(kw)
    return TrainConfig(**base)


def stop_at(k):
    def cb(info):
        if info.step == k:
            raise KeyboardInterrupt

    return cb


# ------------------------------------------------------------------------------------------------
# config


def test_config_from_toml_and_json(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text('task = "mqar"\nsteps = 7\nbetas = [0.9, 0.99]\ngrad_clip = 0\n'
                    '[model]\nd_model = 16\nn_layers = 1\nn_heads = 2\nfeature_map = "taylor"\nqk_dim = 4\n'
                    '[task_options]\nseq_len = 16\nn_pairs = 2\nvocab_size = 32\n')
    cfg = TrainConfig.from_file(toml)
    assert cfg.task == "mqar" and cfg.steps == 7 and cfg.grad_clip is None and cfg.betas == [0.9, 0.99]
    mc = cfg.model_config()
    assert mc.vocab_size == 32 and mc.max_len == 16 and mc.feature_map == "taylor" and mc.qk_dim == 4
    js = tmp_path / "c.json"
    js.write_text(cfg.to_json())
    assert TrainConfig.from_file(js) == cfg


@pytest.mark.parametrize("change, match", [
    ({"stepz": 3}, "unknown training config fields"),
    ({"steps": 0}, "steps must be an int >= 1"),
    ({"task": "mnist"}, "task must be one of"),
    ({"dtype": "float16"}, "bfloat16"),
    ({"model": {"d_model": 15, "n_heads": 2}}, "model: d_model"),
    ({"task_options": {"n_pairs": 100}}, "task_options for 'mqar'"),
    ({"sequence_parallel": 2, "task": "listops", "task_options": {}}, "needs an LM task"),
    ({"model": {"d_model": 16, "n_heads": 2, "positions": "learned", "max_len": 8}}, "raise model.max_len"),
])
def test_config_errors(change, match):
    d = mqar_config().to_dict()
    d.update(change)
    with pytest.raises(ValueError, match=match):
        TrainConfig.from_dict(d)


def test_bad_config_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("steps = = 3\n")
    with pytest.raises(ValueError, match="not valid TOML"):
        TrainConfig.from_file(bad)
    with pytest.raises(FileNotFoundError):
        TrainConfig.from_file(tmp_path / "missing.json")


def test_lr_schedule():
    cfg = TrainConfig(steps=100, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_factor(0, cfg) == pytest.approx(0.1)
    assert lr_factor(9, cfg) == pytest.approx(1.0)
    assert lr_factor(55, cfg) == pytest.approx(0.55)
    assert lr_factor(100, cfg) == pytest.approx(0.1)
    assert all(lr_factor(s, cfg) >= lr_factor(s + 1, cfg) for s in range(10, 100))


# ------------------------------------------------------------------------------------------------
# training


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


# ------------------------------------------------------------------------------------------------
# checkpoint errors


@pytest.fixture
def finished_run(tmp_path):
    out = tmp_path / "run"
    train(mqar_config(steps=2, out_dir=str(out)), progress=False)
    return out


def test_missing_checkpoint_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing to resume"):
        train(mqar_config(out_dir=str(tmp_path / "empty"), resume="latest"), progress=False)
    with pytest.raises(FileNotFoundError, match="no training checkpoint"):
        train(mqar_config(resume=str(tmp_path / "nowhere")), progress=False)


def test_fresh_run_refuses_a_used_out_dir(finished_run):
    with pytest.raises(ValueError, match="already holds checkpoints"):
        train(mqar_config(out_dir=str(finished_run)), progress=False)


def test_auto_resume_starts_fresh_then_resumes(tmp_path):
    out = str(tmp_path / "run")
    a = train(mqar_config(steps=2, out_dir=out, resume="auto"), progress=False)
    b = train(mqar_config(steps=4, out_dir=out, resume="auto"), progress=False)
    assert (a.start_step, a.step, b.start_step, b.step) == (0, 2, 2, 4)


@pytest.mark.parametrize("damage, error, match", [
    ("flip-weights", CheckpointError, r"corrupted: model\.safetensors does not match the checksum"),
    ("truncate-trainer", CheckpointError, r"corrupted: trainer\.safetensors"),
    ("bad-json", CheckpointError, r"trainer\.json is not valid JSON"),
    ("delete-optimizer", FileNotFoundError, r"incomplete: trainer\.safetensors is missing"),
    ("delete-doc", FileNotFoundError, r"incomplete: trainer\.json is missing"),
])
def test_corrupted_checkpoint_gives_clear_error(finished_run, damage, error, match):
    ckpt = find_checkpoint(finished_run)
    if damage == "flip-weights":
        p = ckpt / "model.safetensors"
        raw = bytearray(p.read_bytes())
        raw[-10] ^= 0xFF
        p.write_bytes(bytes(raw))
    elif damage == "truncate-trainer":
        p = ckpt / "trainer.safetensors"
        p.write_bytes(p.read_bytes()[:100])
    elif damage == "bad-json":
        (ckpt / "trainer.json").write_text('{"format": "linattn-trainer", ')
    elif damage == "delete-optimizer":
        (ckpt / "trainer.safetensors").unlink()
    else:
        (ckpt / "trainer.json").unlink()
    with pytest.raises(error, match=match):
        train(mqar_config(steps=4, out_dir=str(finished_run), resume="latest"), progress=False)


def test_resume_with_a_different_setup_is_refused(finished_run):
    with pytest.raises(ValueError, match=r"different training setup \(lr: checkpoint 0.003, now 0.001\)"):
        train(mqar_config(steps=4, lr=1e-3, out_dir=str(finished_run), resume="latest"), progress=False)


# ------------------------------------------------------------------------------------------------
# CLI


def test_cli_train_config_flags_and_resume(tmp_path, corpus, capsys):
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'task = "bytes"\ncorpus = ["{corpus}"]\nseq_len = 16\nbatch_size = 4\nsteps = 3\n'
                   'warmup_steps = 1\neval_batches = 1\n[model]\nd_model = 16\nn_layers = 1\nn_heads = 2\n')
    out = tmp_path / "run"
    rc = cli_main(["train", "--config", str(cfg), "--out", str(out), "--steps", "4", "--set", "model.dropout=0.1",
                   "--quiet"])
    assert rc == 0
    saved = json.loads((out / "train_config.json").read_text())
    assert saved["steps"] == 4 and saved["model"]["dropout"] == 0.1 and saved["seq_len"] == 16
    # resume without --config: the checkpoint's config, extended by --steps
    assert cli_main(["train", "--out", str(out), "--resume", "--steps", "6", "--quiet"]) == 0
    assert find_checkpoint(out).name == "step-00000006"
    # errors are one clear line and exit status 2
    assert cli_main(["train", "--out", str(tmp_path / "none"), "--resume", "--quiet"]) == 2
    assert "nothing to resume" in capsys.readouterr().err
    assert cli_main(["train", "--config", str(cfg), "--dtype", "float16", "--quiet", "--out", str(tmp_path / "x")]) == 2
    assert "bfloat16" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_ctrl_c_saves_and_exits_130(tmp_path, corpus):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "linattn.cli", "train", "--corpus", corpus, "--seq-len", "16", "--batch-size", "4",
           "--steps", "100000", "--d-model", "16", "--n-layers", "1", "--n-heads", "2", "--log-interval", "1",
           "--eval-interval", "0", "--out", str(out), "--quiet"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            if len(read_metrics(out / "metrics.jsonl")) >= 3:
                break
            time.sleep(0.2)
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == EXIT_INTERRUPTED, err
    assert "interrupted at step" in err and "checkpoint saved" in err
    doc = json.loads((find_checkpoint(out) / "trainer.json").read_text())
    assert doc["step"] >= 3


# ------------------------------------------------------------------------------------------------
# data parallel: 2 processes (gloo) against one process with the same global batch


def _ddp_config(**kw) -> TrainConfig:
    # copy task: rows score different numbers of targets, so the global normalization matters
    # eps=1e-6: Adam divides by sqrt(v) + eps, which would blow float rounding differences in near-zero
    # gradient components (the two runs sum the batch in different orders) up to lr-sized differences
    base = dict(task="copy", task_options={"max_len": 6, "n_symbols": 5}, model=dict(TINY_MODEL), batch_size=8,
                steps=3, warmup_steps=1, lr=3e-3, eps=1e-6, eval_samples=8, log_interval=1)
    base.update(kw)
    return TrainConfig(**base)


def _ddp_worker(rank: int, world: int, port: int, out: str, sequence_parallel: int = 1) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank)})
    torch.set_num_threads(1)
    res = train(_ddp_config(dist_timeout_s=60.0, sequence_parallel=sequence_parallel), progress=False)
    assert res.world_size == world and res.rank == rank
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in res.model.state_dict().items() if k != "lm_head.weight"},
              os.path.join(out, f"rank{rank}.safetensors"))
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"losses": res.losses, "status": res.status}, f)


@pytest.mark.parametrize("sequence_parallel", [1, 2], ids=["data-parallel", "sequence-parallel"])
def test_ddp_two_processes_equal_one_process(tmp_path, sequence_parallel):
    """2 processes, as 2 data-parallel replicas or as one sequence split over 2 processes, train
    exactly like one process with the same global batch."""
    from safetensors.torch import load_file

    from linattn.parallel import free_port

    mp.start_processes(_ddp_worker, args=(2, free_port(), str(tmp_path), sequence_parallel), nprocs=2, join=True,
                       start_method="spawn")
    single = train(_ddp_config(distributed="off"), progress=False)
    ref = {k: v for k, v in single.model.state_dict().items() if k != "lm_head.weight"}
    for rank in range(2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["status"] == "completed"
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(single.losses), rtol=1e-5, atol=1e-5)
        params = load_file(str(tmp_path / f"rank{rank}.safetensors"))
        assert params.keys() == ref.keys()
        for k in ref:
            torch.testing.assert_close(params[k], ref[k], rtol=1e-5, atol=1e-5, msg=lambda m: f"{k}: {m}")


def test_sequence_parallel_needs_processes_and_an_lm_task():
    with pytest.raises(ValueError, match="sequence_parallel=2 needs that many processes"):
        train(_ddp_config(sequence_parallel=2, distributed="off"), progress=False)
    with pytest.raises(ValueError, match="sequence_parallel > 1 needs an LM task"):
        _ddp_config(task="listops", task_options={}, sequence_parallel=2)


def test_example_configs_load():
    root = Path(__file__).resolve().parents[1] / "configs"
    files = sorted(root.glob("*.toml")) + sorted(root.glob("*.json"))
    assert files
    for f in files:
        TrainConfig.from_file(f).model_config()
