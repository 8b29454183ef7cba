"""linattn.training.processes: 2-process DDP (gloo) and sequence parallelism against one process."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.multiprocessing as mp

from linattn.training import TrainConfig, train

from .helpers import TINY_MODEL

def _ddp_config(**kw) -> TrainConfig:
    # copy task: rows score different numbers of targets, so the global normalization matters
    # eps=1e-6: Adam divides by sqrt(v) + eps, which would blow float rounding differences in near-zero
    # gradient components (the two runs sum the batch in different orders) up to lr-sized differences
    base = dict(task="copy", task_options={"max_len": 6, "n_symbols": 5}, model=dict(TINY_MODEL), batch_size=8,
                steps=3, warmup_steps=1, lr=3e-3, eps=1e-6, eval_samples=8, log_interval=1)
    base.update(kw)
    return TrainConfig(**base)


def _ddp_worker(rank: int, world: int, port: int, out: str, sequence_parallel: int = 1,
                model: dict | None = None, extra: dict | None = None) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank)})
    torch.set_num_threads(1)
    res = train(_ddp_config(dist_timeout_s=60.0, sequence_parallel=sequence_parallel, model=model or dict(TINY_MODEL),
                            **(extra or {})),
                progress=False)
    assert res.world_size == world and res.rank == rank
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in res.model.state_dict().items() if k != "lm_head.weight"},
              os.path.join(out, f"rank{rank}.safetensors"))
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"losses": res.losses, "status": res.status, "step": res.step, "stopped_early": res.stopped_early},
                  f)


@pytest.mark.parametrize("sequence_parallel, attention", [(1, "linear"), (2, "linear"), (2, "gated_deltanet,gla")],
                         ids=["data-parallel", "sequence-parallel", "sequence-parallel-gated-delta-conv"])
def test_ddp_two_processes_equal_one_process(tmp_path, sequence_parallel, attention):
    """2 processes, as 2 data-parallel replicas or as one sequence split over 2 processes, train
    exactly like one process with the same global batch; also a Gated DeltaNet + GLA model with
    short convolutions (kernel 4 by default for gated_deltanet, 3 set for all here)."""
    from safetensors.torch import load_file

    from linattn.parallel import free_port

    model = dict(TINY_MODEL, attention=attention, **({} if attention == "linear" else {"short_conv": 3}))
    mp.start_processes(_ddp_worker, args=(2, free_port(), str(tmp_path), sequence_parallel, model), nprocs=2,
                       join=True, start_method="spawn")
    single = train(_ddp_config(distributed="off", model=model), progress=False)
    ref = {k: v for k, v in single.model.state_dict().items() if k != "lm_head.weight"}
    for rank in range(2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["status"] == "completed"
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(single.losses), rtol=1e-5, atol=1e-5)
        params = load_file(str(tmp_path / f"rank{rank}.safetensors"))
        assert params.keys() == ref.keys()
        for k in ref:
            torch.testing.assert_close(params[k], ref[k], rtol=1e-5, atol=1e-5, msg=lambda m: f"{k}: {m}")


def test_sequence_parallel_needs_processes_and_an_lm_task():
    with pytest.raises(ValueError, match="sequence_parallel=2 needs that many processes"):
        train(_ddp_config(sequence_parallel=2, distributed="off"), progress=False)
    with pytest.raises(ValueError, match="sequence_parallel > 1 needs an LM task"):
        _ddp_config(task="listops", task_options={}, sequence_parallel=2)


def test_stop_accuracy_stops_every_process_at_rank_0s_validation(tmp_path):
    """Only rank 0 validates; the other process must stop at the same step (else it would wait in the
    next step's all-reduce for a partner that has left)."""
    from linattn.parallel import free_port

    extra = {"steps": 6, "eval_interval": 2, "stop_accuracy": 1e-6, "eval_samples": 32}
    mp.start_processes(_ddp_worker, args=(2, free_port(), str(tmp_path), 1, None, extra), nprocs=2, join=True,
                       start_method="spawn")
    single = train(_ddp_config(distributed="off", **extra), progress=False)
    assert single.stopped_early and single.step == 2
    for rank in range(2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["status"] == "completed" and got["stopped_early"] and got["step"] == 2
