"""A torchrun worker for the resharding test: FSDP2 training state saved on N ranks, loaded on M.

    fsdp_checkpoint_worker.py ENDPOINTS WIDTH save|save-async|load URI OUT [MODE URI OUT ...]

Each MODE URI OUT is done in turn, in one launch (a launch's start-up costs more than a
small model's save or load), with a fresh model and checkpointer each:

`save`: train two steps of a small FSDP2 model and checkpoint at step 2.
`save-async`: the same, asynchronously: the DTensor shards staged on a stand-in for a
side stream (tests/trainer/deferred_stream.py) whose copy runs only before step 3's
optimizer step, and step 3 trained before the save is waited for; OUT holds step 2's state.
`load`: build the same model on this world size and load the newest checkpoint.
Either way rank 0 then writes the full (unsharded) model and optimizer state to OUT.
ENDPOINTS is one S3 endpoint, or a comma-separated one per rank; WIDTH sizes the model's
three square layers.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

from kubetrain.api.manifest import parse_job
from kubetrain.trainer.checkpoint import Checkpointer, ModelState
from kubetrain.trainer.staging import Staging

sys.path.insert(0, str(Path(__file__).parents[1] / "trainer"))
from deferred_stream import DeferredStream


def main(endpoints: str, width: str, *tasks: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    per_rank = endpoints.split(",")
    endpoint = per_rank[rank % len(per_rank)]
    mesh = init_device_mesh("cpu", (world,))
    for at in range(0, len(tasks), 3):
        mode, uri, out = tasks[at:at + 3]
        one_task(mode, uri, out, endpoint, mesh, int(width))
    dist.barrier()  # no rank tears the group down while another still uses it
    dist.destroy_process_group()


def one_task(mode: str, uri: str, out: str, endpoint: str, mesh: DeviceMesh,
             size: int) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(size, size) for _ in range(3)))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    spec = parse_job({
        "apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob",
        "metadata": {"name": "reshard"},
        "spec": {"image": "trainer", "model": {"preset": "tiny"},
                 "data": {"train": "s3://unused/train"},
                 "optimization": {"maxSteps": 10},
                 "checkpoint": {"uri": uri, "async": mode == "save-async"},
                 "storage": {"endpoint": endpoint, "region": "us-east-1"}},
    }).spec
    staging = Staging(torch.device("cpu"), DeferredStream() if mode == "save-async" else None)
    checkpointer = Checkpointer(spec, rank=rank, world_size=world, staging=staging)
    app = {"model": ModelState(model, optimizer)}

    def train(step: int) -> None:
        seed = torch.Generator().manual_seed(step * world + rank)
        inputs = torch.randn(8, size, generator=seed)
        model(inputs).square().mean().backward()
        staging.before_update()
        optimizer.step()
        optimizer.zero_grad()

    if mode.startswith("save"):
        for step in range(2):
            train(step)
        checkpointer.save(2, app, blocking=mode == "save")
    else:
        assert checkpointer.load_latest(app) == 2
    full_model, full_optimizer = get_state_dict(
        model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if mode == "save-async":
        # Step 2's state as it is now: a CPU tensor (AdamW's step count) is not copied by
        # get_state_dict, and step 3 would change it in place.
        full_model, full_optimizer = copy.deepcopy((full_model, full_optimizer))
        train(2)  # step 3 changes the weights the save's copy reads, after waiting for it
        checkpointer.wait()
    if rank == 0:
        torch.save({"model": full_model, "optimizer": full_optimizer}, out)
    checkpointer.close()


if __name__ == "__main__":
    # Launched by tests/forked_torchrun.py: this rank is a fork, which ends without the
    # interpreter's teardown once main returns (torch's C++ teardown, which under load now
    # and then aborted with "terminate called without an active exception" after the work
    # was done).
    main(*sys.argv[1:])
