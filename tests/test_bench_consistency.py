"""linattn.bench.consistency and the bench commands' own checks (issue 13, item 13): numbers that
cannot be right are flagged, clean numbers are not, and the default thread count follows the idle
cores."""

from __future__ import annotations

import json

import pytest
import torch

from linattn.bench import consistency
from linattn.bench.decode import check_decode
from linattn.bench.generate import check_generate
from linattn.bench.ops import check_ops
from linattn.cli import main

MS = 1e-3


def _decode(kv, step=(0.02, 0.001)):
    """A decode result dict: kv = {ctx: (median ms, iqr ms)} for softmax + KV cache."""
    rows = []
    for ctx, (m, i) in kv.items():
        rows.append({"ctx": ctx, "linear_step": {"median_s": step[0] * MS, "iqr_s": step[1] * MS},
                     "kv_cache": {"median_s": m * MS, "iqr_s": i * MS}, "no_cache": None})
    return {"results": rows}


def test_the_flat_softmax_kv_reading_of_an_oversubscribed_machine_is_flagged():
    """The issue's reading: softmax + KV cache at a flat 7.99 ms for every context."""
    warnings = check_decode(_decode({256: (7.99, 0.05), 1024: (7.99, 0.06), 4096: (7.98, 0.3), 16384: (7.99, 0.1)}))
    assert warnings == ["softmax + KV cache: flat from context=256 to 16384 (7.99 ms to 7.99 ms, spreads 0.05 ms and "
                        "0.1 ms) although the cost grows with it over a 64-fold range"]


def test_clean_numbers_give_no_warning():
    """The one-thread reading of the same machine (medians ± IQR in ms, measured): no warning."""
    clean = {256: (0.040, 0.002), 1024: (0.12, 0.007), 4096: (0.80, 0.31), 16384: (4.8, 0.46)}
    assert check_decode(_decode(clean)) == []


def test_a_longer_context_faster_beyond_the_spread_and_an_unstable_point_are_flagged():
    warnings = check_decode(_decode({256: (0.04, 0.002), 1024: (0.9, 0.05), 4096: (0.5, 0.1), 16384: (4.8, 0.4)},
                                    step=(0.02, 0.03)))
    assert any(w.startswith("softmax + KV cache: context=4096 took 0.5 ms, less than context=1024 (0.9 ms)")
               for w in warnings)
    assert any(w.startswith("linear RNN step at context 256: 0.02 ms with an IQR of 0.03 ms (150% of the median)")
               for w in warnings)
    # within the spreads, a dip is not called an inversion
    assert check_decode(_decode({256: (0.04, 0.002), 1024: (0.9, 0.4), 4096: (0.8, 0.3), 16384: (4.8, 0.4)})) == []


def test_ops_sweep_checks_every_method_and_mode():
    def t(m, i=0.0):
        return {"median_s": m * MS, "iqr_s": i * MS}

    res = {"methods": [{"key": "chunked", "label": "chunked"}],
           "results": [{"method": "chunked", "n": 256, "fwd": t(1.0), "fwd_bwd": t(3.0)},
                       {"method": "chunked", "n": 512, "fwd": t(2.0), "fwd_bwd": t(1.0)},
                       {"method": "chunked", "n": 1024, "fwd": None, "fwd_bwd": None}]}
    assert check_ops(res) == ["chunked forward+backward: N=512 took 1 ms, less than N=256 (3 ms), although the cost "
                              "grows with it"]


def test_single_runs_are_compared_only_at_twice_the_size():
    """Without a spread, nearby sizes may differ by noise alone; a size at least twice another may not
    be more than 10% faster. The worst inversion is reported once, with a count of the others."""
    pts = [(1, 2.0e-3, None), (4, 1.5e-3, None), (163, 6.7e-3, None), (130, 8.6e-3, None), (767, 9.0e-3, None)]
    assert consistency.growing_series("s", "prefix", pts) == [
        "s: prefix=4 took 1.5 ms, less than prefix=1 (2 ms), although the cost grows with it"]
    pts += [(1600, 1.0e-3, None)]
    assert consistency.growing_series("s", "prefix", pts) == [
        "s: prefix=1600 took 1 ms, less than prefix=767 (9 ms), although the cost grows with it (and 5 more such "
        "pairs)"]


def test_generate_flags_a_larger_model_faster_per_token():
    def row(dataset, label, tokens, layers, batch, ms):
        return {"dataset": dataset, "label": label, "tokens": tokens, "layers": layers, "batch": batch,
                "methods": {"linear": {"ms_per_token": ms, "seconds": ms * tokens / 1e3, "latency_ms": []}}}

    rows = [row("mnist", "MNIST", 784, 2, 1, 2.0), row("cifar10", "CIFAR-10", 3072, 4, 1, 1.0)]
    warnings = check_generate({"results": rows})
    assert len(warnings) == 1 and "linear (RNN), batch 1, per token: layers×tokens=12288 took 1 ms, less than" in warnings[0]
    rows[1]["methods"]["linear"]["ms_per_token"] = 3.9  # about twice the layers: about twice the time
    rows[1]["methods"]["linear"]["seconds"] = 3.9 * 3072 / 1e3
    assert check_generate({"results": rows}) == []


@pytest.mark.parametrize("load, cpus, affinity, expected", [
    (3.1, 2, 2, 1),  # the development machine while other jobs run
    (0.2, 2, 2, 2),
    (1.4, 2, 2, 1),
    (0.1, 64, 4, 4),  # a container allowed 4 CPUs of an idle 64-core machine
    (60.0, 64, 4, 4),  # 4 idle cores left on a busy one
    (63.9, 64, 4, 1),
])
def test_stable_threads_is_one_per_idle_core(monkeypatch, load, cpus, affinity, expected):
    monkeypatch.setattr(consistency.os, "getloadavg", lambda: (load, load, load))
    monkeypatch.setattr(consistency.os, "cpu_count", lambda: cpus)
    monkeypatch.setattr(consistency.os, "sched_getaffinity", lambda pid: set(range(affinity)), raising=False)
    threads, why = consistency.stable_threads()
    assert threads == expected and f"load average {load:.1f}" in why


@pytest.fixture
def _keep_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_bench_decode_reports_its_threads_and_warnings(tmp_path, capsys, monkeypatch, _keep_threads):
    """End to end: without --threads the command picks stable_threads() and says so; numbers made
    flat (as an oversubscribed machine gives them) are reported as warnings on screen and in the JSON."""
    from linattn.bench import decode
    from linattn.bench.timing import Timing

    monkeypatch.setattr(consistency, "stable_threads", lambda: (1, "test: one idle core"))
    monkeypatch.setattr(decode, "measure", lambda fn, **kw: Timing(median=7.99e-3, iqr=1e-5, blocks=5))
    out = tmp_path / "decode"
    assert main(["bench", "decode", "--contexts", "32,512", "--heads", "1", "--models", "none", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "threads: 1 (test: one idle core)" in printed
    assert "warning: softmax + KV cache: flat from context=32 to 512" in printed
    assert "rerun with a longer --min-run-time" in printed  # one thread already: not "fewer --threads"
    data = json.loads((out / "bench-decode.json").read_text())
    assert data["threads"] == {"count": 1, "how": "test: one idle core"} and torch.get_num_threads() == 1
    assert len(data["warnings"]) == 2  # KV cache and no cache, both flat
    assert "warning: softmax + KV cache: flat" in (out / "bench-decode.txt").read_text()
