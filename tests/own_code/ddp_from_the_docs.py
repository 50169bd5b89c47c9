"""A DDP training script written from docs/own-code.md alone, as a new user writes one.

A test asset, never part of a product image (the whole-loop tests mount it from a
ConfigMap). DistributedDataParallel on gloo, a torch DCP folder every `--save-every` steps
that every rank marks complete with `sdk.mark_complete(..., sharded=True)` as soon as its
own `dcp.save` returned, and nothing more: no barrier between the save and the mark, which
the docs do not ask for. On SIGTERM every rank agrees on the stop, saves, marks and exits
143. With `--linger-after-stop S` each process then takes S seconds more to end, as a
process whose teardown hangs does (a logger flushing, a thread that does not stop): its
stop checkpoint is saved and marked, so kubetrain need not wait for it.

Rank 0 prints `own-code step N loss L` for each step it trains, `own-code resumed from step
N` when it loads a checkpoint and `own-code stopped at step N on SIGTERM`, which the tests
read. The batch of step N is a function of N and the rank only.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from kubetrain import sdk

EXIT_STOPPED = 143


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--step-seconds", type=float, default=0.0)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--linger-after-stop", type=float, default=0.0,
                        help="seconds each process takes to end after its stop checkpoint")
    return parser.parse_args()


def main() -> int:
    args = arguments()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(32, 64), nn.ReLU(),
                                                  nn.Linear(64, 1)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sdk.stop_requested()
    start = 0
    latest = sdk.latest_checkpoint()
    if latest is not None:
        state = {"model": model.state_dict(), "optim": optimizer.state_dict(),
                 "step": torch.tensor(0)}
        dcp.load(state, checkpoint_id=str(latest))
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
        start = int(state["step"])
        if rank == 0:
            print(f"own-code resumed from step {start}", flush=True)
    for step in range(start + 1, args.steps + 1):
        generator = torch.Generator().manual_seed(step * 1000 + rank)
        inputs = torch.randn(args.batch, 32, generator=generator)
        loss = nn.functional.mse_loss(model(inputs), inputs[:, :8].sum(dim=1, keepdim=True))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0:
            print(f"own-code step {step} loss {loss.item():.5f}", flush=True)
        sdk.report(step, total_steps=args.steps, loss=loss.item())
        stop = sdk.stop_agreed()
        if stop or step % args.save_every == 0 or step == args.steps:
            folder = sdk.checkpoint_dir() / f"step-{step:06d}"
            dcp.save({"model": model.state_dict(), "optim": optimizer.state_dict(),
                      "step": torch.tensor(step)}, checkpoint_id=str(folder))
            sdk.mark_complete(folder, step, sharded=True)
        if stop:
            if rank == 0:
                print(f"own-code stopped at step {step} on SIGTERM", flush=True)
            # A thread that is not a daemon: the interpreter waits for it before it exits.
            threading.Thread(target=time.sleep, args=(args.linger_after_stop,)).start()
            return EXIT_STOPPED
        time.sleep(args.step_seconds)
    sdk.mark_finished()  # docs/own-code.md: ending the process group
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
