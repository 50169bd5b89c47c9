"""The trainer on a device that cannot hold a micro-batch above LIMIT sequences.

    oom_worker.py JOB.yaml METRICS_LOG LIMIT [triton]

There is no GPU here, so no CUDA allocation can fail for real. A forward pre-hook on
the trainer's model raises torch.OutOfMemoryError (the error a failed CUDA allocation
raises, with its words) when a micro-batch has more than LIMIT sequences: inside the
training step, where a real out-of-memory error arises. Everything else is the real
trainer, `Trainer(job).fit()` as `python -m kubetrain.trainer` runs it: its handler,
the termination message and the exit code are what the test looks at. With `triton`
the error is the plain RuntimeError a Triton kernel (Liger's fused loss) raises when
its allocation fails.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from kubetrain.api.manifest import load_job
from kubetrain.trainer.distributed import World
from kubetrain.trainer.goodput import GoodputLedger
from kubetrain.trainer.loop import Trainer, _Run


class SmallDevice(Trainer):
    """The trainer with a model that runs out of memory above `limit` sequences."""

    limit = 0
    triton = False

    def _build(self, world: World, goodput: GoodputLedger) -> _Run:
        run = super()._build(world, goodput)

        def allocate(_module: torch.nn.Module, args: tuple[Any, ...]) -> None:
            if args[0].shape[0] > self.limit and self.triton:
                raise RuntimeError("Triton Error [CUDA]: out of memory")
            if args[0].shape[0] > self.limit:
                raise torch.OutOfMemoryError(
                    f"CUDA out of memory. Tried to allocate {args[0].shape[0] * 256} MiB "
                    f"(a micro-batch of {args[0].shape[0]} sequences)")

        run.parallel.module.register_forward_pre_hook(allocate)
        return run


if __name__ == "__main__":
    job, metrics_log, limit = sys.argv[1], sys.argv[2], int(sys.argv[3])
    SmallDevice.limit = limit
    SmallDevice.triton = sys.argv[4:] == ["triton"]
    sys.exit(SmallDevice(load_job(job), metrics_log=metrics_log).fit().exit_code)
