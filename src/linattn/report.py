"""Shared helpers for the tools that write reports: machine info, output folders, JSON, rich tables
and progress bars, log-log plots.

Every report is a folder holding `<kind>.json` (machine, arguments, results; strict JSON, so a value
that could not be measured is `null`, never NaN) and, where it makes sense, a PNG plot.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from rich.console import Console, ConsoleOptions
from rich.measure import Measurement
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table


def make_console() -> Console:
    """A rich Console; wide enough for the benchmark tables when stdout is not a terminal."""
    con = Console(soft_wrap=False)
    if not con.is_terminal:
        con = Console(soft_wrap=False, width=max(con.width, 160))
    return con


def cpu_model() -> str:
    """The CPU model name from /proc/cpuinfo (Linux), else platform.processor()."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def machine_info(device: str | torch.device = "cpu") -> dict:
    """What the numbers were measured on: CPU model, cores, threads, torch version, GPU if used."""
    dev = torch.device(device)
    info = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "affinity_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": str(dev),
        "gpu": None,
        "cuda": torch.version.cuda,
    }
    if dev.type == "cuda" and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(dev)
    return info


def timestamp() -> str:
    return _dt.datetime.now().strftime("%Y%m%d-%H%M%S")


def output_dir(kind: str, out: str | os.PathLike | None) -> Path:
    """The folder a report goes to: `out` if given, else ./reports/<kind>-<timestamp> (a numeric suffix
    is added when that already exists). Created, parents included."""
    if out is not None:
        path = Path(out)
    else:
        base = Path("reports") / f"{kind}-{timestamp()}"
        path, i = base, 1
        while path.exists():
            path, i = base.with_name(f"{base.name}-{i}"), i + 1
    path.mkdir(parents=True, exist_ok=True)
    return path


def _finite(obj):
    """Replaces non-finite floats by None and converts tuples, Paths and dtypes for JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    if isinstance(obj, (Path, torch.dtype, torch.device)):
        return str(obj)
    return obj


def write_json(path: str | os.PathLike, data: dict) -> Path:
    """Writes strict JSON (NaN/inf become null), indented."""
    path = Path(path)
    path.write_text(json.dumps(_finite(data), indent=2, allow_nan=False) + "\n", encoding="utf-8")
    return path


def args_dict(args) -> dict:
    """argparse Namespace -> JSON-friendly dict (drops the command callable)."""
    return {k: v for k, v in vars(args).items() if not callable(v)}


def make_table(title: str, columns: Sequence[str], rows: Iterable[Sequence[str]],
               caption: str | None = None) -> "FittedTable":
    """A rich table that fits its console: the first column is left-aligned (row labels), the others
    right-aligned (numbers). See FittedTable."""
    return FittedTable(title, columns, rows, caption)


class FittedTable:
    """A table printed whole at any terminal width, never cropped ("linear RN…", "0.0214 ±9…": issue 37
    item 21). When the whole table is wider than the console, its columns are split into groups that
    fit, printed one under the other, each repeating the first column (the row labels) and titled
    "(columns i–j of n)"; a group that cannot fit even with one column folds its cells onto
    several lines instead of cutting them."""

    def __init__(self, title: str, columns: Sequence[str], rows: Iterable[Sequence[str]], caption: str | None = None):
        self.title, self.columns, self.caption = title, list(columns), caption
        self.rows = [list(row) for row in rows]

    def table(self, keep: Sequence[int] | None = None, *, part: str = "", caption: str | None = None,
              fold: bool = False) -> Table:
        """The rich Table of columns `keep` (default all; 0 is always first), cells on one line unless fold."""
        keep = list(range(len(self.columns))) if keep is None else [0, *keep]
        table = Table(title=self.title + part, caption=caption, show_lines=False, header_style="bold")
        for i in keep:
            col = self.columns[i]
            table.add_column(col, justify="left" if i == 0 else "right", no_wrap=not fold, overflow="fold",
                             min_width=len(col) if i == 0 and not fold else None)
        for row in self.rows:
            table.add_row(*(row[i] for i in keep))
        return table

    def __rich_console__(self, console: Console, options: ConsoleOptions):
        width = options.max_width
        unbounded = options.update_width(1 << 20)

        def fits(table: Table) -> bool:  # its natural width (a bounded measurement is clamped to the console)
            return Measurement.get(console, unbounded, table).maximum <= width

        whole = self.table(caption=self.caption)
        if fits(whole):
            yield whole
            return
        groups, group = [], []
        for i in range(1, len(self.columns)):
            if group and not fits(self.table([*group, i])):
                groups.append(group)
                group = []
            group.append(i)
        groups.append(group)
        n = len(self.columns) - 1
        for k, group in enumerate(groups):
            part = f" (columns {group[0]}–{group[-1]} of {n})" if len(group) > 1 else f" (column {group[0]} of {n})"
            caption = self.caption if k == len(groups) - 1 else None
            yield self.table(group, part=part, caption=caption, fold=not fits(self.table(group)))


def progress(console: Console) -> Progress:
    """A rich progress bar for sweeps: description, bar, done/total, elapsed."""
    return Progress(TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=console, transient=False)


def fmt_time(seconds: float | None, iqr: float | None = None) -> str:
    """Milliseconds with 3 significant digits, '±IQR' when given; '—' for missing."""
    if seconds is None:
        return "—"
    ms = seconds * 1e3
    s = f"{ms:.3g}" if ms < 1000 else f"{ms:.0f}"
    if iqr is not None:
        s += f" ±{iqr * 1e3:.2g}"
    return s


def fmt_bytes(n: float | None) -> str:
    """MiB with 3 significant digits; '—' for missing."""
    return "—" if n is None else f"{n / 2**20:.3g}"


def plot_loglog(path: str | os.PathLike, panels: Sequence[dict], *, title: str, xlabel: str, ylabel: str) -> Path:
    """Log-log line plot, one panel per dict {"title", "series": {label: (xs, ys)}, "vlines": {label: x}}.

    Missing points (None) are dropped. Uses the Agg canvas directly (no pyplot global state).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import NullLocator

    fig = Figure(figsize=(6.0 * len(panels), 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, panel in zip(axes, panels):
        for label, (xs, ys) in panel["series"].items():
            pts = [(x, y) for x, y in zip(xs, ys) if y is not None and y > 0]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3, label=label)
        for label, x in panel.get("vlines", {}).items():
            ax.axvline(x, color="gray", linestyle="--", linewidth=1, label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        xs_all = sorted({x for xs, _ in panel["series"].values() for x in xs})
        if xs_all:
            ax.set_xticks(xs_all, [str(x) for x in xs_all], rotation=45 if len(xs_all) > 6 else 0)
            ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(panel.get("title", ""))
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(title)
    path = Path(path)
    fig.savefig(path, dpi=120)
    return path

