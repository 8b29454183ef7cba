"""What a training run tells its user: a silent `Reporter` and the rich `ProgressDisplay` (a
progress bar with loss, tokens/s and ETA, and one line per validation and at the end).

The loop emits events and nothing else: start(RunInfo), step(StepInfo) after every optimizer step,
validation(step, metrics), note(text), close() when the steps are over (also when they end in an
error), finish(status, message). A display is chosen by the caller of `train` (progress=True gives
ProgressDisplay on the main process).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RunInfo:
    """What a run is, for its opening line."""

    model: str
    parameters: int
    task: str
    processes: int
    parallelism: str | None  # e.g. "2 data × 2 sequence parallel", None without sequence parallelism
    device: str
    batch_size: int
    resumed_from: str | None
    start_step: int
    steps: int


class Reporter:
    """Receives a run's events and shows nothing."""

    def start(self, run: RunInfo) -> None:
        pass

    def step(self, info) -> None:
        """info: a linattn.training.StepInfo."""

    def validation(self, step: int, metrics: dict) -> None:
        pass

    def note(self, text: str) -> None:
        pass

    def close(self) -> None:
        pass

    def finish(self, status: str, message: str) -> None:
        pass


class ProgressDisplay(Reporter):
    """A rich progress bar and messages on `console` (None: linattn.report.make_console())."""

    _COLOURS = {"completed": "green", "interrupted": "yellow", "diverged": "red"}

    def __init__(self, console=None):
        self.console = console
        self.bar = None

    def start(self, run: RunInfo) -> None:
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                   TimeRemainingColumn)

        if self.console is None:
            from ..report import make_console

            self.console = make_console()
        self.console.print(
            f"[bold]linattn train[/]: {run.model} {run.parameters:,} parameters, {run.task}, {run.processes} "
            "process(es)" + (f" ({run.parallelism})" if run.parallelism else "") + f", device {run.device}, global "
            f"batch {run.batch_size}"
            + (f", resuming from {run.resumed_from} (step {run.start_step})" if run.resumed_from else ""))
        self.bar = Progress(TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[tps]} tok/s"),
                            TextColumn("ETA"), TimeRemainingColumn(), TimeElapsedColumn(), console=self.console,
                            transient=False)
        self._task = self.bar.add_task("train", total=run.steps, completed=run.start_step, loss="—", tps="—")
        self.bar.start()

    def step(self, info) -> None:
        self.bar.update(self._task, completed=info.step, loss=f"{info.loss:.4f}", tps=f"{info.tokens_per_s:,.0f}")

    def validation(self, step: int, metrics: dict) -> None:
        extra = "".join(f", {name} {metrics[name]:.4f}" for name in ("bpb", "accuracy") if name in metrics)
        self.console.print(f"step {step}: validation loss {metrics['loss']:.4f}{extra}")

    def note(self, text: str) -> None:
        self.console.print(f"[yellow]{text}[/]")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None

    def finish(self, status: str, message: str) -> None:
        self.console.print(f"[{self._COLOURS[status]}]{message}[/]")
