"""linattn.training.optim: the learning-rate schedule and the weight-decay groups."""

from __future__ import annotations

import pytest

from linattn.training import TrainConfig, build_model, lr_factor
from linattn.training.optim import make_optimizer

from .helpers import mqar_config


def test_lr_schedule():
    cfg = TrainConfig(steps=100, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_factor(0, cfg) == pytest.approx(0.1)
    assert lr_factor(9, cfg) == pytest.approx(1.0)
    assert lr_factor(55, cfg) == pytest.approx(0.55)
    assert lr_factor(100, cfg) == pytest.approx(0.1)
    assert all(lr_factor(s, cfg) >= lr_factor(s + 1, cfg) for s in range(10, 100))


def test_weight_decay_on_matrices_and_embeddings_only():
    cfg = mqar_config(weight_decay=0.25)
    model = build_model(cfg)
    opt, sched = make_optimizer(model, cfg)
    decay, none = opt.param_groups
    assert decay["weight_decay"] == 0.25 and none["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in none["params"])
    ids = {id(p) for g in opt.param_groups for p in g["params"]}
    assert ids == {id(p) for p in model.parameters()}  # tied embedding and head counted once
    assert opt.param_groups[0]["lr"] == pytest.approx(cfg.lr * lr_factor(0, cfg))
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(cfg.lr * lr_factor(1, cfg))
