"""Configs and callbacks shared by the linattn.training tests."""

from __future__ import annotations

from linattn.training import TrainConfig

TINY_MODEL = {"d_model": 16, "n_layers": 2, "n_heads": 2, "d_ff": 32}


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
