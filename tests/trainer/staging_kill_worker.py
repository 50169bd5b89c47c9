"""A trainer process killed while a snapshot's copy is in flight (test_staging.py).

    staging_kill_worker.py FOLDER EXPECTED

Snapshots steps 1 and 2 into the in-memory tier at FOLDER (both land and commit), writes
the state at step 2 to EXPECTED, trains step 3 and snapshots it: step 3's snapshot goes
into the slot that held step 1, with its copy enqueued on the stand-in stream and not yet
run. Then the next step's forward and backward run beside the copy, and the process kills
itself with SIGKILL before the optimizer step would wait for it, as a trainer dies
while a GPU copies.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from deferred_stream import DeferredStream

from kubetrain.api.trainingjob import TrainingJobSpec
from kubetrain.trainer.checkpoint import ModelState, RandomState
from kubetrain.trainer.memory_checkpoint import MemoryCheckpoints
from kubetrain.trainer.staging import Staging


def main(folder: str, expected: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    spec = TrainingJobSpec.model_validate({
        "image": "kubetrain/trainer:test", "data": {"train": "s3://bucket/train"},
        "checkpoint": {"uri": str(Path(folder).parent / "s3"), "memory": {"everySteps": 1}}})
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    app_state = {"model": ModelState(model, optimizer), "rng": RandomState()}
    staging = Staging(torch.device("cpu"), DeferredStream())
    tier = MemoryCheckpoints(spec, rank=0, world_size=1, folder=Path(folder), staging=staging)

    def forward_backward() -> None:
        model(torch.randn(4, 8)).square().mean().backward()

    for step in (1, 2):
        forward_backward()
        staging.before_update()
        optimizer.step()
        optimizer.zero_grad()
        tier.save(step, app_state)
        tier.wait()  # landed and committed
    torch.save({"weights": [p.detach().clone() for p in model.parameters()],
                "moments": [optimizer.state[p]["exp_avg"].clone() for p in model.parameters()]},
               expected)
    forward_backward()
    staging.before_update()
    optimizer.step()
    optimizer.zero_grad()
    tier.save(3, app_state)  # into step 1's slot: its commit removed, its copy in flight
    forward_backward()
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main(*sys.argv[1:])
