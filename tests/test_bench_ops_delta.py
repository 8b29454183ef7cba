"""benchmarks/ops_delta.py runs end to end on a tiny problem and reports what it measured."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ops_delta_script_smoke(capsys, tmp_path):
    spec = importlib.util.spec_from_file_location("ops_delta", ROOT / "benchmarks" / "ops_delta.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "delta.json"
    assert mod.main(["--lengths", "64,128", "--min-run-time", "0.01", "--threads", "1", "--rounds", "2",
                     "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "delta rule" in printed and "2 interleaved rounds" in printed
    assert printed.count("PASS") + printed.count("FAIL") == 8 + 1  # the rows and the caption
    data = json.loads(out.read_text())
    assert len(data["rounds"]) == 2 and len(data["rows"]) == 8
    row = data["rows"][0]  # DeltaNet / linear at N=64: one ratio per round
    rnd = data["rounds"][1]
    expected = rnd["fwd_bwd"]["deltanet"][0]["median_s"] / rnd["fwd_bwd"]["linear"][0]["median_s"]
    assert row["per_round"][1] == pytest.approx(expected) and row["min"] <= row["median"] <= row["max"]
    mem = data["rows"][-1]
    assert mem["setting"] == "N=128" and 0 < mem["median"] < 100
