"""linattn.training.progress: what the rich display shows of a run's events (the loop feeds it)."""

from __future__ import annotations

from rich.console import Console

from linattn.training import StepInfo, train
from linattn.training.progress import ProgressDisplay, Reporter, RunInfo

from .helpers import mqar_config


def test_display_shows_the_run_validations_and_the_end():
    con = Console(record=True, width=200, force_terminal=False)
    shown = ProgressDisplay(con)
    shown.start(RunInfo("LinearTransformerLM", 1234, "mqar task {}", 2, "1 data × 2 sequence parallel", "cpu", 8,
                        "runs/x/checkpoints/step-00000003", 3, 10))
    shown.step(StepInfo(4, 1.2345, 1e-3, 0.5, None, tokens_per_s=1000.0))
    shown.validation(4, {"loss": 1.5, "accuracy": 0.25})
    shown.validation(5, {"loss": 1.5, "accuracy": 0.25, "bpb": 2.16})
    shown.validation(6, {"loss": 0.0125, "mse": 0.0125, "count": 99})  # attention transfer: a loss only
    shown.note("could not draw loss.png: no disk")
    shown.close()
    shown.finish("interrupted", "interrupted at step 5")
    text = con.export_text()
    assert "LinearTransformerLM 1,234 parameters, mqar task {}, 2 process(es) (1 data × 2 sequence parallel)" in text
    assert "resuming from runs/x/checkpoints/step-00000003 (step 3)" in text
    assert "step 4: validation loss 1.5000, accuracy 0.2500" in text
    assert "step 5: validation loss 1.5000, bpb 2.1600" in text
    assert "step 6: validation loss 0.0125\n" in text
    assert "could not draw loss.png" in text and "interrupted at step 5" in text


def test_train_reports_every_step_to_the_display(monkeypatch):
    events = []

    class Recorder(Reporter):
        def start(self, run):
            events.append(("start", run.start_step, run.steps))

        def step(self, info):
            events.append(("step", info.step, info.tokens_per_s > 0))

        def validation(self, step, metrics):
            events.append(("validation", step))

        def finish(self, status, message):
            events.append(("finish", status))

    from linattn.training import loop

    monkeypatch.setattr(loop, "ProgressDisplay", lambda console: Recorder())
    train(mqar_config(steps=3, eval_interval=2), progress=True)
    assert events == [("start", 0, 3), ("step", 1, True), ("step", 2, True), ("validation", 2), ("step", 3, True),
                      ("validation", 3), ("finish", "completed")]
