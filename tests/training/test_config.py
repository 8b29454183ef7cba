"""linattn.training.config: files, validation errors, what validation builds, example configs."""

from __future__ import annotations

from pathlib import Path

import pytest

from linattn.nn import attention as layers
from linattn import models
from linattn.training import TrainConfig, build_model, make_task
from linattn.training import tasks as training_tasks

from .helpers import mqar_config

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
    ({"stop_accuracy": 0.0}, r"stop_accuracy must be None or a number in \(0, 1\], got 0.0"),
    ({"stop_accuracy": 1.5}, "stop_accuracy must be None or a number in"),
    ({"stop_accuracy": 0.99, "eval_interval": 0}, "stop_accuracy=0.99 needs validations during the run"),
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


def test_example_configs_load():
    root = Path(__file__).resolve().parents[2] / "configs"
    files = sorted(root.glob("*.toml")) + sorted(root.glob("*.json"))
    assert files
    for f in files:
        TrainConfig.from_file(f).model_config()


def test_validation_builds_the_task_and_feature_map_once(monkeypatch):
    """A config checks its task options (one draw of one example) and its model (one feature-map build)
    when it is made; model_config(), make_task() and build_model() build no more of either."""
    draws, fmaps = [], []
    mqar = training_tasks.MqarTask.generate
    counted = staticmethod(lambda n, **kw: draws.append(n) or mqar(n, **kw))
    monkeypatch.setattr(training_tasks.MqarTask, "generate", counted)
    make_fmap = models.make_feature_map
    for module in (models, layers):  # the config's check, and the model's layers
        monkeypatch.setattr(module, "make_feature_map", lambda *a, **kw: fmaps.append(a) or make_fmap(*a, **kw))
    cfg = mqar_config()
    assert (draws, len(fmaps)) == ([1], 1)
    for _ in range(3):
        cfg.model_config(), make_task(cfg)
    assert (draws, len(fmaps)) == ([1], 1)
    assert make_task(cfg) is make_task(cfg) and cfg.model_config() == cfg.model_config()
    model = build_model(cfg)
    assert draws == [1] and len(fmaps) == 1 + model.config.n_layers  # the model's own layers only


def test_config_pickles_as_its_fields():
    import pickle

    cfg = mqar_config(steps=5)
    back = pickle.loads(pickle.dumps(cfg))
    assert back == cfg and back.model_config() == cfg.model_config()
    assert make_task(back) is not make_task(cfg)


def test_resumable_changes():
    cfg = mqar_config(steps=4)
    cfg.check_resumable(mqar_config(steps=8, grad_accum=2, eval_interval=3).to_dict(), "ckpt")  # allowed
    with pytest.raises(ValueError, match=r"different training setup \(model: .*; seed: checkpoint 1, now 0\)"):
        cfg.check_resumable(mqar_config(seed=1).to_dict(), "ckpt")
    with pytest.raises(ValueError, match=r"model: checkpoint .*'d_model': 32"):
        cfg.check_resumable(mqar_config(model={"d_model": 32, "n_layers": 2, "n_heads": 2}).to_dict(), "ckpt")


def test_model_chunk_size_is_a_config_value():
    cfg = mqar_config(model={"d_model": 16, "n_layers": 2, "n_heads": 2, "chunk_size": 8})
    assert cfg.model_config().chunk_size == 8
    assert [b.attn.chunk_size for b in build_model(cfg).blocks] == [8, 8]
    with pytest.raises(ValueError, match="model: chunk_size must be a positive int"):
        mqar_config(model={"d_model": 16, "n_layers": 2, "n_heads": 2, "chunk_size": 0})
