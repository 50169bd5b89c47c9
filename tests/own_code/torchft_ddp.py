"""A user's own torchft training script, run as one replica group of a job (spec.trainer
with spec.faultTolerance): torchft's Manager and OptimizerWrapper, the gradients averaged
by `Manager.allreduce`. (torchft 0.2.0's DistributedDataParallel wrapper crashed a live
group now and then when its peer was killed mid-all-reduce: its comm hook asserts on the
failed work's future instead of reporting the error to the Manager.)

A test asset, never part of a product image. It knows nothing of kubetrain beyond what
torchft itself reads: TORCHFT_LIGHTHOUSE, torchrun's RANK/WORLD_SIZE/MASTER_ADDR/PORT, and
a replica id, here from KUBETRAIN_REPLICA_GROUP (a torchtitan script takes it as
--fault_tolerance.replica_id). That is what the operator gives each pod of a group.

Rank 0 prints `own-code step N loss L` for each committed step, and `own-code healed at
step N` when the step count jumped in one (the state came from a live group). With
`--report` it also reports each step through kubetrain.sdk, as a script that wants
kubetrain's progress bar and status does (`kubetrain run` kills a node at a step by them).
"""

from __future__ import annotations

import argparse
import os
import time
from datetime import timedelta

import torch
from torch import nn
from torchft import Manager, Optimizer, ProcessGroupGloo


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--step-seconds", type=float, default=0.0,
                        help="sleep after each step, so a test can act mid-run")
    parser.add_argument("--report", action="store_true",
                        help="report each step's progress through kubetrain.sdk")
    args = parser.parse_args()
    if args.report:
        from kubetrain import sdk
    torch.manual_seed(0)  # every group draws the same initial weights
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=30)), min_replica_size=1,
        load_state_dict=lambda state: (model.load_state_dict(state["model"]),
                                       optimizer.load_state_dict(state["optim"])),
        state_dict=lambda: {"model": model.state_dict(), "optim": optimizer.state_dict()},
        replica_id=f"own-code-{os.environ['KUBETRAIN_REPLICA_GROUP']}",
        timeout=timedelta(seconds=30))
    optimizer = Optimizer(manager, optimizer)
    rank = int(os.environ["RANK"])
    while manager.current_step() < args.steps:
        before = manager.current_step()
        generator = torch.Generator().manual_seed(before * 1000 + rank)
        inputs = torch.randn(16, 32, generator=generator)
        optimizer.zero_grad()  # starts the step's quorum
        loss = nn.functional.mse_loss(model(inputs), inputs[:, :8].sum(dim=1, keepdim=True))
        loss.backward()
        # The groups' average: a failed all-reduce is reported to the Manager, and the step
        # then does not commit.
        for work in [manager.allreduce(p.grad) for p in model.parameters()]:
            work.wait()
        optimizer.step()  # only when every group present commits; a group behind heals here
        after = manager.current_step()
        if after > before and rank == 0:
            if after > before + 1:
                print(f"own-code healed at step {after - 1}", flush=True)
            print(f"own-code step {after} loss {loss.item():.4f}", flush=True)
            if args.report:
                sdk.report(after, total_steps=args.steps, loss=loss.item())
        time.sleep(args.step_seconds)
    manager.shutdown(wait=False)


if __name__ == "__main__":
    main()
