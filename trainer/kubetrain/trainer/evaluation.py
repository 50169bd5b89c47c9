"""Validation during training: the mean token loss over the validation data (collective).

The loop (loop.py) calls `evaluate` every evaluation.everySteps steps, records it for early
stopping and keepBest, and books its time as goodput's `evaluation`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from kubetrain.trainer.data import TokenDataset
from kubetrain.trainer.parallelize import ParallelModel
from kubetrain.trainer.rank_timing import WaitClock


def evaluate(parallel: ParallelModel, data: TokenDataset, batches: int,
             device: torch.device, clock: WaitClock) -> float:
    """Mean token loss over the same `batches` micro-batches per rank each time (collective).

    Its closing sum is marked inside a collective on `clock`, as FSDP's gathers in the
    forward already are (`time_fsdp_collectives`): a rank blocked there on a lost peer gives
    up when signalled (StopRequest), not after torchrun's 30 s. The forward itself is not
    marked, so a long but healthy evaluation still ends in a checkpoint when signalled."""
    model = parallel.module
    model.eval()
    data.rewind()
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, token count
    with torch.no_grad(), parallel.autocast():
        for _ in range(batches):
            inputs, targets = next(data)
            totals[0] += model(inputs.to(device), targets.to(device))
            totals[1] += targets.numel()
    model.train()
    with clock.inside():
        dist.all_reduce(totals)
    return float(totals[0] / totals[1])
