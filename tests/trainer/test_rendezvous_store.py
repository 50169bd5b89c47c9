"""The trainers' store after a restart of a multi-pod group: every rank must find the others.

With several torchrun agents (one per pod) the agents count a restart differently: the
one whose worker failed counts it, one that restarts for the new membership does not.
So the store the trainers meet in must not depend on the restart count; the operator
gives each round a fresh one (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) and the trainer
takes it as it is.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

from kubetrain.api.trainingjob import TrainingJob
from kubetrain.operator.children import torchrun_env

# One rank of a 2-rank group: join through the trainer's own init_world, then all-reduce.
# It leaves the group as the trainer does: a process that exits with its gloo group still
# alive can abort in the group's teardown ("terminate called without an active exception").
_RANK = """
import torch, torch.distributed as dist
from kubetrain.trainer.distributed import init_world, shutdown_world
init_world()
total = torch.tensor([1.0])
dist.all_reduce(total)
print(int(total.item()), flush=True)
dist.barrier()
shutdown_world()
"""


def _operator_env(manifest: dict) -> dict[str, str]:
    """The plain-valued variables the operator sets on a worker pod besides torchrun's options."""
    job = TrainingJob.model_validate(manifest)
    return {entry["name"]: entry["value"] for entry in torchrun_env(job)
            if not entry["name"].startswith("PET_")}


def test_ranks_whose_agents_counted_the_restart_differently_still_form_the_group(
        minimal_manifest: dict, launcher: Any) -> None:
    env = {**os.environ, **_operator_env(minimal_manifest), "OMP_NUM_THREADS": "1",
           "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(launcher.free_port()),
           "LOCAL_RANK": "0", "TORCHELASTIC_RUN_ID": "test"}
    # What torchrun gives its workers when the rendezvous store is not shared.
    env["TORCHELASTIC_USE_AGENT_STORE"] = str(
        env.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") != "1")
    ranks = [subprocess.Popen([sys.executable, "-c", _RANK], text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              env={**env, "RANK": str(rank),
                                   "TORCHELASTIC_RESTART_COUNT": str(rank)})
             for rank in (0, 1)]
    try:
        outputs = [rank.communicate(timeout=60)[0] for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
    assert [output.split()[-1] for output in outputs] == ["2", "2"], outputs
