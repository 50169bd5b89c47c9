"""A plain PyTorch training script run as a job's own code (spec.trainer): FSDP2 and DCP.

A test asset, never part of a product image (the whole-loop tests mount it from a
ConfigMap; `kubetrain run` tests run it from here). What a user's torchrun script looks like
with kubetrain.sdk: a tiny regression model sharded with FSDP2 on gloo (CPU), a sharded
torch.distributed.checkpoint (DCP) folder every `--save-every` steps that every rank marks
complete, resume from `sdk.latest_checkpoint()`, progress through `sdk.report`, and on
SIGTERM a save at the step every rank agrees on, then exit 143. Each rank marks its part as
soon as its own dcp.save returned: no barrier is needed (docs/own-code.md).

Rank 0 prints one `own-code step N loss L` line per step it trains and
`own-code resumed from step N` when it loads a checkpoint, which the tests read to count the
steps a restart redid. The batch of step N is a function of N and the rank only, so a run
that resumes trains the same steps an uninterrupted one does.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

from kubetrain import sdk

EXIT_STOPPED = 143  # 128 + SIGTERM: saved and stopped, not finished (docs/own-code.md)


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--step-seconds", type=float, default=0.0,
                        help="sleep after each step, so a test can act mid-run")
    parser.add_argument("--batch", type=int, default=16)
    return parser.parse_args()


def batch(step: int, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step * 1000 + rank)
    inputs = torch.randn(size, 32, generator=generator)
    return inputs, inputs[:, :8].sum(dim=1, keepdim=True)


def save(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    folder = sdk.checkpoint_dir() / f"step-{step:06d}"
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optimizer_state, "step": torch.tensor(step)},
             checkpoint_id=str(folder))
    sdk.mark_complete(folder, step, sharded=True)


def load(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    latest = sdk.latest_checkpoint()
    if latest is None:
        return 0
    model_state, optimizer_state = get_state_dict(model, optimizer)
    step = torch.tensor(0)
    dcp.load({"model": model_state, "optim": optimizer_state, "step": step},
             checkpoint_id=str(latest))  # in place
    set_state_dict(model, optimizer, model_state_dict=model_state,
                   optim_state_dict=optimizer_state)
    return int(step)


def main() -> int:
    args = arguments()
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sdk.stop_requested()  # from here SIGTERM only sets a flag
    start = load(model, optimizer)
    if rank == 0 and start:
        print(f"own-code resumed from step {start}", flush=True)
    for step in range(start + 1, args.steps + 1):
        inputs, targets = batch(step, rank, args.batch)
        loss = nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0:
            print(f"own-code step {step} loss {loss.item():.5f}", flush=True)
        sdk.report(step, total_steps=args.steps, loss=loss.item(),
                   tokens=step * args.batch * world_size)
        stop = sdk.stop_agreed()
        if stop or step % args.save_every == 0 or step == args.steps:
            save(model, optimizer, step)
        if stop:
            if rank == 0:
                print(f"own-code stopped at step {step} on SIGTERM", flush=True)
            end_process_group()
            return EXIT_STOPPED
        time.sleep(args.step_seconds)
    sdk.mark_finished()
    end_process_group()
    return 0


def end_process_group() -> None:
    """A barrier, then the end of the process group: the last collective's work (a tensor
    of Python's) is freed on a gloo thread that needs the GIL, and the group's destructor,
    as DDP's reducer is freed, joins that thread holding the GIL (docs/own-code.md)."""
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
