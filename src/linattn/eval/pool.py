"""Runs of an evaluation in worker processes: `run_in_processes`, used by `linattn eval`'s presets
and the recall presets (`--jobs`)."""

from __future__ import annotations

__all__ = ["run_in_processes"]


def _init_worker(threads: int) -> None:
    import signal

    import torch

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and cancels the pool
    torch.set_num_threads(threads)


def run_in_processes(fn, items, jobs: int, threads: int, on_done=None) -> dict:
    """{i: fn(*items[i])} for every item, computed in `jobs` spawned processes with `threads` torch
    threads each (fn must be importable: a module-level function). on_done(i, result) runs in this
    process as each finishes. Ctrl-C cancels what has not started, waits for the runs in flight and
    raises KeyboardInterrupt({i: result} of the finished ones)."""
    import multiprocessing
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

    done: dict = {}
    pool = ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_init_worker, initargs=(threads,))
    try:
        pending = {pool.submit(fn, *item): i for i, item in enumerate(items)}
        while pending:
            finished, _ = wait(pending, return_when=FIRST_COMPLETED)
            for fut in finished:
                i = pending.pop(fut)
                done[i] = fut.result()
                if on_done is not None:
                    on_done(i, done[i])
    except KeyboardInterrupt:
        pool.shutdown(wait=True, cancel_futures=True)
        raise KeyboardInterrupt(done) from None
    pool.shutdown(wait=True)
    return done
