"""linattn.report.make_table in a terminal narrower than the table (issue 37 item 21): rich cropped
columns to "linear RN…" and numbers to "0.0214 ±9…". Rendered at 100 columns, every cell of the
table must appear whole in the output (the table is split into column groups that fit, each
repeating the row labels), and no line may be wider than the terminal."""

from __future__ import annotations

import pytest
from rich.console import Console

from linattn.bench.decode import DECODE_METHODS, render_decode
from linattn.demo import render_agreement
from linattn.report import make_table


def _render(draw, width: int = 100) -> str:
    console = Console(width=width, record=True, color_system=None, force_terminal=False)
    draw(console)
    return console.export_text()


def _cells_whole(text: str, cells) -> None:
    lines = text.splitlines()
    assert all(len(line) <= 100 for line in lines), max(map(len, lines))
    assert "…" not in text
    for cell in cells:
        assert any(cell in line for line in lines), cell


def test_bench_decode_table_at_100_columns():
    res = {"results": [{"ctx": ctx, **{k: {"median_s": 0.0000214 * (i + 1), "iqr_s": 0.0000093} for i, k in
                                         enumerate(DECODE_METHODS)},
                        "kv_cache_over_step": 12.34, "no_cache_over_step": 456.78, "state_bytes": 65536.0 * 3,
                        "kv_cache_bytes": 2.0**20 * ctx} for ctx in (8, 512, 32768)]}
    text = _render(lambda c: render_decode(res, c))
    _cells_whole(text, [*DECODE_METHODS.values(), "KV cache / step", "no cache / step", "0.0214 ±0.0093",
                        "0.15 ±0.0093", "456.78×", "3.28e+04", "32768"])


def test_demo_agreement_table_at_100_columns():
    rows = [{"method": name, "feature_dim": f, "parallel_vs_oracle": 1.2e-15, "recurrent_vs_oracle": 3.4e-16,
             "parallel_vs_recurrent": 5.6e-15, "ok": True}
            for name, f in (("linear (elu+1)", 64), ("Performer FAVOR+ (m = 256)", 256), ("softmax", None))]
    text = _render(lambda c: render_agreement(rows, c))
    _cells_whole(text, ["Performer FAVOR+ (m = 256)", "chunked vs recurrent", "1.2e-15", "3.4e-16", "5.6e-15"])


@pytest.mark.parametrize("width", [40, 100, 200])
def test_a_table_keeps_every_cell_at_any_width(width):
    cols = ["attention"] + [f"column number {i}" for i in range(12)]
    rows = [[f"kind {r} with a long label"] + [f"{r}.{i}e-0{i % 9}" for i in range(12)] for r in range(3)]
    text = _render(lambda c: c.print(make_table("title", cols, rows, caption="a caption")), width)
    lines = text.splitlines()
    assert all(len(line) <= width for line in lines)
    assert "…" not in text
    for cell in [c for row in rows for c in row[1:]]:
        assert any(cell in line for line in lines), cell
