"""linattn.eval.suite and `linattn eval`: kinds build, a tiny grid runs and reports, literature checks."""

from __future__ import annotations

import json
import math

import pytest

from linattn.models import KINDS

from linattn.cli import main as cli_main
from linattn.eval.kinds import EVAL_KINDS, MIXER_KINDS, kind_model
from linattn.eval.suite import PRESETS, _train_config, applies, run_eval
from linattn.eval.suite_report import literature_notes, render_markdown, summarize, write_report
from linattn.models import ModelConfig


@pytest.fixture(autouse=True)
def _single_thread(one_thread):
    yield


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_kind_and_task_of_the_presets_makes_a_valid_config(preset):
    p = PRESETS[preset]
    for task in p.tasks:
        for kind in EVAL_KINDS:
            cfg = _train_config(p, task, kind, 0, None, "cpu")
            mc = cfg.model_config()
            if kind == "softmax":
                assert mc.layer_kinds == ["softmax"] * mc.n_layers
            elif kind == "hybrid":
                assert mc.layer_kinds[-1] == "softmax" and mc.layer_kinds.count("softmax") == max(1, mc.n_layers // 4)
            elif kind in MIXER_KINDS:
                assert mc.layer_kinds == [kind] * mc.n_layers
                assert mc.positions == KINDS[kind].positions  # as in the papers (the kinds table)
                assert (applies(kind, task) is None) == (task.task != "listops")
            else:
                assert set(mc.layer_kinds) == {"linear"} and mc.feature_map == kind
    assert kind_model("taylor", p.model, p.kind_options)["qk_dim"] == {"quick": 16, "paper": 8}[preset]


def test_paper_preset_keeps_copy_listops_bytes_and_points_to_the_recall_preset(capsys):
    """Issue 16: its MQAR columns did not separate the kinds; recall is --preset recall."""
    paper = PRESETS["paper"]
    assert [t.name for t in paper.tasks] == ["copy", "listops", "bytes"]
    assert "--preset recall" in paper.description
    assert cli_main(["eval", "--preset", "paper", "--tasks", "mqar"]) == 2
    assert "unknown task 'mqar'" in capsys.readouterr().err


def test_kind_model_hybrid_pattern_and_errors():
    assert kind_model("hybrid", {"n_layers": 8})["attention"] == ["linear", "linear", "linear", "softmax"]
    assert kind_model("hybrid", {"n_layers": 2})["attention"] == ["linear", "softmax"]
    ModelConfig.from_dict({**kind_model("hybrid", {"n_layers": 8, "d_model": 16, "n_heads": 2})})
    with pytest.raises(ValueError, match="unknown attention kind"):
        kind_model("mamba", {})


def test_mixer_kinds_train_on_lm_tasks_and_skip_the_encoder_task():
    report = run_eval("quick", kinds=["gated_deltanet"], tasks=["mqar", "listops"], steps=2, progress=False)
    runs = {r["task"]: r for r in report["runs"]}
    assert runs["mqar"]["status"] == "completed" and runs["mqar"]["metrics"]["accuracy"] is not None
    assert runs["listops"]["status"] == "skipped" and "causal only" in runs["listops"]["message"]
    assert report["summary"]["listops"]["gated_deltanet"]["accuracy"]["mean"] is None
    md = render_markdown(report)
    assert "Gated DeltaNet" in md and "skipped — Gated DeltaNet is causal only" in md


def test_quick_subset_runs_and_writes_report(tmp_path):
    report = run_eval("quick", kinds=["softmax", "elu"], tasks=["mqar", "copy"], steps=4, progress=False)
    assert len(report["runs"]) == 4 and all(r["status"] == "completed" for r in report["runs"])
    s = report["summary"]
    assert set(s) == {"mqar", "copy"} and set(s["copy"]["elu"]) == {"loss", "accuracy"}
    assert 0 <= s["mqar"]["softmax"]["accuracy"]["mean"] <= 1 and s["mqar"]["softmax"]["accuracy"]["spread"] is None
    checks = {n["check"]: n["verdict"] for n in report["notes"]}
    assert set(checks) == {"MQAR (32, 2)", "copy"}
    paths = write_report(report, tmp_path)
    md = paths["markdown"].read_text()
    assert "| softmax |" in md and "| elu+1 |" in md and "Notes: comparison with the literature" in md
    assert json.loads(paths["json"].read_text())["summary"]["copy"]["softmax"]["loss"]["n"] == 1
    assert paths["png"].stat().st_size > 1000


def test_cli_eval_two_seeds_listops_bytes(tmp_path, capsys):
    rc = cli_main(["eval", "--kinds", "softmax,taylor", "--tasks", "listops,bytes", "--seeds", "0,1", "--steps", "2",
                   "--quiet", "--out", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "Taylor (Based)" in out and "byte-LM bpb" in out
    report = json.loads((tmp_path / "eval.json").read_text())
    bpb = report["summary"]["bytes"]["taylor"]["bpb"]
    assert bpb["n"] == 2 and bpb["spread"] is not None and 0 < bpb["mean"] < 9
    assert (tmp_path / "eval.md").is_file() and (tmp_path / "eval.png").is_file() and (tmp_path / "eval.txt").is_file()


def test_eval_jobs_gives_the_runs_of_one_process():
    """--jobs 2 trains the runs in two spawned processes: same runs, in plan order, same losses."""
    kw = dict(kinds=["softmax", "elu"], tasks=["mqar"], seeds=[0, 1], steps=2, progress=False)
    one = run_eval("quick", **kw)
    two = run_eval("quick", jobs=2, threads_per_job=1, **kw)
    assert [(r["kind"], r["seed"]) for r in two["runs"]] == [(r["kind"], r["seed"]) for r in one["runs"]]
    for a, b in zip(one["runs"], two["runs"]):
        assert b["status"] == "completed"
        assert abs(a["last_loss"] - b["last_loss"]) <= 1e-5 * abs(a["last_loss"])
    with pytest.raises(ValueError, match="jobs must be a positive int"):
        run_eval("quick", jobs=0, **kw)


def test_cli_eval_rejects_unknown_names(capsys):
    assert cli_main(["eval", "--kinds", "softmax,lstm", "--quiet", "--out", "/tmp/unused-linattn-eval"]) == 2
    assert "unknown attention kind 'lstm'" in capsys.readouterr().err


def _fake_report(acc: dict, copy_loss: dict) -> dict:
    kinds = list(acc)
    runs = []
    for k in kinds:
        runs.append({"task": "mqar", "kind": k, "seed": 0, "status": "completed", "metrics": {"accuracy": acc[k]}})
        runs.append({"task": "copy", "kind": k, "seed": 0, "status": "completed",
                     "metrics": {"loss": copy_loss[k], "accuracy": 0.9}})
    report = {"preset": "test", "preset_description": "fake", "kinds": kinds, "tasks": ["mqar", "copy"], "seeds": [0],
              "elapsed_s": 1.0, "model": {}, "kind_options": {}, "machine": {}, "runs": runs, "steps_override": None,
              "task_specs": {"mqar": {"task": "mqar", "label": "MQAR", "options": {}, "train": {},
                                      "metrics": ["accuracy"]},
                             "copy": {"task": "copy", "label": "copy", "options": {}, "train": {},
                                      "metrics": ["loss", "accuracy"]}}}
    report["summary"] = summarize(report)
    report["notes"] = literature_notes(report)
    return report


def test_literature_notes_verdicts():
    agree = _fake_report({"softmax": 1.0, "taylor": 0.97, "elu": 0.2, "favor": 0.15, "cosformer": 0.3},
                         {"softmax": 0.01, "taylor": 0.02, "elu": 0.03, "favor": 0.04, "cosformer": 0.02})
    verdicts = {n["check"]: n["verdict"] for n in agree["notes"]}
    assert verdicts == {"MQAR": "agrees", "copy": "agrees"}
    disagree = _fake_report({"softmax": 0.3, "taylor": 0.9, "elu": 0.5, "favor": 0.1, "cosformer": 0.1},
                            {"softmax": 0.01, "taylor": 0.02, "elu": 1.5, "favor": 2.0, "cosformer": 0.03})
    notes = {n["check"]: n for n in disagree["notes"]}
    assert notes["MQAR"]["verdict"] == "disagrees" and "elu+1 ≥ softmax" in notes["MQAR"]["detail"]
    close = _fake_report({"softmax": 1.0, "taylor": 0.29, "elu": 0.28, "favor": 0.1, "cosformer": 0.1},
                         {k: 0.1 for k in ("softmax", "taylor", "elu", "favor", "cosformer")})
    n = {x["check"]: x for x in close["notes"]}["MQAR"]
    assert n["verdict"] == "disagrees" and "elu+1 within 0.1 of Taylor (Based)" in n["detail"]
    assert notes["copy"]["verdict"] == "partly agrees"
    assert "do not: elu+1 1.500, FAVOR+ 2.000" in notes["copy"]["detail"]
    partly = _fake_report({"softmax": 0.6, "taylor": 0.5, "elu": 0.2, "favor": 0.1, "cosformer": 0.1},
                          {k: 0.1 for k in ("softmax", "taylor", "elu", "favor", "cosformer")})
    n = {x["check"]: x for x in partly["notes"]}["MQAR"]
    assert n["verdict"] == "partly agrees" and "undertrained" in n["detail"]
    md = render_markdown(disagree)
    assert "DISAGREES" in md and "| softmax | 0.300 |" in md


def test_summary_mean_and_spread():
    report = _fake_report({"softmax": 1.0, "elu": 0.2}, {"softmax": 0.1, "elu": 0.2})
    report["runs"].append({"task": "mqar", "kind": "elu", "seed": 1, "status": "completed",
                           "metrics": {"accuracy": 0.4}})
    report["runs"].append({"task": "mqar", "kind": "elu", "seed": 2, "status": "diverged", "metrics": None})
    st = summarize(report)["mqar"]["elu"]["accuracy"]
    assert st["n"] == 2 and st["mean"] == pytest.approx(0.3) and st["spread"] == pytest.approx(math.sqrt(0.02))


def test_help_lists_per_preset_the_task_names_that_preset_accepts(capsys, monkeypatch):
    """Every task name `linattn eval --help` lists for a preset is accepted by `--preset P --tasks NAME`
    (issue 13, item 11: the help listed mqar-32, which --preset quick rejects)."""
    import re

    from linattn import cli
    from linattn.eval import suite as evaluation

    with pytest.raises(SystemExit):
        cli.main(["eval", "--help"])
    text = "".join(capsys.readouterr().out.split())  # argparse wraps lines, also at hyphens
    listed = {p: m.group(1).split(",") for p in evaluation.PRESETS
              if (m := re.search(rf"(?:preset:|;){p}:([\w,-]+?)(?:;|$)", text))}
    assert listed.keys() == evaluation.PRESETS.keys(), text

    class Accepted(Exception):
        pass

    def stop(*args, **kwargs):  # the task selection passed: stop before any training
        raise Accepted

    monkeypatch.setattr(evaluation, "_train_config", stop)
    for preset, names in listed.items():
        assert names and set(names) <= {t.name for t in evaluation.PRESETS[preset].tasks}
        for name in names + [n.split("-")[0] for n in names if "-" in n]:  # and what the help says of prefixes
            with pytest.raises(Accepted):
                cli.main(["eval", "--preset", preset, "--tasks", name, "--quiet"])
