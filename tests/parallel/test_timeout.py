"""Sequence-parallel groups keep the collective timeout: a rank that freezes (SIGSTOP) makes its
peer fail with a clear error after about the timeout set, not after torch's 30-minute default."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import sys
import tempfile
import time

import pytest
import torch

from linattn import parallel as D

TIMEOUT_S = 3.0  # also bounds the rendezvous and the first exchange: margin for a loaded machine
WAIT_S = 45.0  # the peer must be done long before this; without the fix it would wait 30 minutes


def _rank(rank: int, init: str, out: str, explicit: bool) -> None:
    torch.set_num_threads(1)
    D.init_distributed("gloo", init_method=init, rank=rank, world_size=2, timeout_s=TIMEOUT_S)
    groups = D.make_parallel_groups(2, timeout_s=TIMEOUT_S) if explicit else D.make_parallel_groups(2)
    q = torch.randn(1, 1, 4, 8)
    D.sequence_parallel_linear_attention(q, q, q, group=groups.sequence)  # both ranks alive: works
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # frozen, not dead: its sockets stay open
        return
    start = time.monotonic()
    try:
        D.sequence_parallel_linear_attention(q, q, q, group=groups.sequence)
        result = {"error": None}
    except RuntimeError as exc:
        result = {"error": str(exc)}
    result["elapsed_s"] = time.monotonic() - start
    with open(out, "w") as f:
        json.dump(result, f)
    os._exit(0)  # no teardown collective with the frozen peer


@pytest.mark.skipif(sys.platform == "win32", reason="SIGSTOP is POSIX")
@pytest.mark.parametrize("explicit", [False, True], ids=["default-group-timeout", "explicit-timeout"])
def test_frozen_rank_fails_its_peer_within_the_timeout(explicit):
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "linattn.parallel", __name__])
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.json")
        procs = [ctx.Process(target=_rank, args=(r, f"file://{tmp}/rendezvous", out, explicit)) for r in range(2)]
        for p in procs:
            p.start()
        try:
            procs[0].join(WAIT_S)
            alive = procs[0].is_alive()
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join()
        assert not alive, f"rank 0 still blocked {WAIT_S:.0f} s after its peer froze (timeout_s={TIMEOUT_S})"
        with open(out) as f:
            result = json.load(f)
    assert result["error"] is not None, "the collective with a frozen peer returned"
    assert "sequence parallelism" in result["error"] and "timed out" in result["error"]
    assert result["elapsed_s"] < 5 * TIMEOUT_S, result


def _read_timeout(rank: int, init: str, out: str) -> None:
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=0, world_size=1, timeout=datetime.timedelta(seconds=7))
    with open(out, "w") as f:
        json.dump({"timeout_s": D.groups.default_group_timeout().total_seconds()}, f)


def test_default_group_timeout_of_a_group_made_by_torch_directly():
    """A default group made with torch.distributed (not init_distributed): its own timeout is used."""
    ctx = multiprocessing.get_context("forkserver")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "timeout.json")
        p = ctx.Process(target=_read_timeout, args=(0, f"file://{tmp}/rendezvous", out))
        p.start()
        p.join(60)
        assert p.exitcode == 0
        with open(out) as f:
            assert json.load(f)["timeout_s"] == 7.0
