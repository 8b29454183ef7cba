"""Launching gloo process groups for the tests of linattn.parallel: spawned ranks that fork from a
forkserver which imported torch and linattn once (a fresh interpreter per rank costs seconds of
imports on a small machine); the forkserver itself never runs torch ops, so forking is safe."""

from __future__ import annotations

import multiprocessing
import tempfile

import torch
import torch.multiprocessing as mp

from linattn import parallel as D


def launch(fn, world: int, *args, timeout_s: float = 60.0, preload: tuple[str, ...] = ()):
    """Runs fn(rank, world, init_method, tmp_dir, timeout_s, *args) on `world` processes; `preload`:
    further modules for the forkserver to import (the test module of fn)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "linattn.parallel", __name__, *preload])
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(fn, args=(world, f"file://{tmp}/rendezvous", tmp, timeout_s, *args), nprocs=world,
                           join=True, start_method="forkserver")


def setup(rank: int, world: int, init: str, timeout_s: float) -> None:
    """One thread per rank and the default gloo group."""
    torch.set_num_threads(1)
    D.init_distributed("gloo", init_method=init, rank=rank, world_size=world, timeout_s=timeout_s)
