"""Per-rank timing: how long each rank computes, and how long it waits for the others.

A synchronous job runs at the pace of its slowest rank: the others wait for it inside
the collectives. So the rank the others wait for (a straggler: a slow GPU, a throttled
CPU, a paused process) shows the largest compute time and the smallest wait, and the
operator's slowness rule (`kubetrain.operator.stragglers`) compares compute times.

What is measured, per step, on each rank's host clock:
- wait: the time spent inside collectives. The loop's own (the stop agreement at each
  step boundary, and the gradient norm: on DTensor shards `get_total_norm` reduces
  their partial norms across ranks inside it, so the whole call is timed) and FSDP2's
  parameter all-gathers and gradient reduce-scatters, which FSDP lets a caller replace
  (`set_custom_all_gather`, `set_custom_reduce_scatter`): the replacements here are
  FSDP's defaults with a clock around them.
  Under HSDP, FSDP2 also all-reduces each gradient shard across the replicate dimension
  with a plain `dist.all_reduce` it offers no hook for: `time_fsdp_collectives` puts the
  clock around that call too (`_TimedAllReduce`), or a rank waiting there for a slow
  replica in the other pod would count the wait as its compute, and the rule would name
  the healthy pod's ranks instead of the slow one.
- compute: the rest of the step (data fetch, forward, backward, optimizer).
  Tensor parallelism's collectives (DTensor's, inside every layer) are not timed: the
  ranks of one tensor-parallel group wait on each other there, so a slow rank's group
  peers count that wait as compute and the whole group looks slow; the straggler rule
  judges a tensor-parallel group as one (`kubetrain.operator.stragglers`).
On CPU (gloo) these collectives block the host, so the clock sees the wait. On a GPU,
NCCL work runs on its own streams and the host does not wait in it: there the clock
records a pair of CUDA events on the current stream around each collective, and reads
their elapsed times at the logged step (`settle`), once the device has caught up. A
collective issued with async_op waits on NCCL's stream, not the current one, so only
the ones the current stream waits for (async_op=False, as the loop's and FSDP2's by
default) are seen; with DDP the bucket all-reduces are waited for inside backward (in
C++) and count as compute. The CUDA path is not exercised by the CPU test suite.

Only rank 0 serves /metrics, so at each logged step every rank's figures are gathered
to rank 0 (`gather_rank_timings`, a collective), which exports them labelled by rank,
pod and node. A group of one waits for nobody: its wait is 0. From the same figures,
every rank books goodput's `straggler` cause (`goodput.StragglerBooking`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard import _fsdp_collectives
from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
    DefaultAllGather,
    DefaultReduceScatter,
)

from kubetrain.trainer.lifeline import where_am_i


class WaitClock:
    """Seconds this process spent inside collectives since it started (a running total).

    On CUDA the total counts only the collectives `settle` has read.
    """

    def __init__(self, device: torch.device | None = None) -> None:
        self.seconds = 0.0
        self.cuda = device is not None and device.type == "cuda"
        self._pending: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        # Since when (time.monotonic) the host has been inside a collective, on CPU; None
        # outside one. A rank blocked on a peer that is gone stays inside (StopRequest).
        self.inside_since: float | None = None

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Count the block's time as waiting in a collective: the host's wall time on
        CPU, the current stream's time between two events on CUDA."""
        if self.cuda:
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            try:
                yield
            finally:
                end.record()
                self._pending.append((start, end))
            return
        started = time.perf_counter()
        try:
            with self.inside():
                yield
        finally:
            self.seconds += time.perf_counter() - started

    @contextlib.contextmanager
    def inside(self) -> Iterator[None]:
        """Mark the block as inside collectives (`inside_since`, on CPU) without counting
        its time as a step's wait: for those between two steps, which block on a lost peer
        as any other does."""
        outermost = not self.cuda and self.inside_since is None
        if outermost:
            self.inside_since = time.monotonic()
        try:
            yield
        finally:
            if outermost:
                self.inside_since = None

    def settle(self) -> float:
        """Add the recorded CUDA events' times to the total; returns the seconds added
        (always 0 on CPU, where `waiting` adds as it goes)."""
        added = 0.0
        for start, end in self._pending:
            end.synchronize()
            added += start.elapsed_time(end) / 1000  # milliseconds
        self._pending.clear()
        self.seconds += added
        return added


class _TimedWork(dist.Work):
    """An async collective's handle whose `wait` counts as waiting (CPU).

    FSDP2 issues its all-gathers with async_op (the next layer's, to overlap this one's
    compute) and waits on the handle later, before the layer runs: that wait, not the
    call, is where a rank sits while a slower peer catches up.
    """

    def __init__(self, work: dist.Work, clock: WaitClock) -> None:
        super().__init__()
        self.work, self.clock = work, clock

    def wait(self, timeout: timedelta | None = None) -> bool:
        with self.clock.waiting():
            return self.work.wait() if timeout is None else self.work.wait(timeout)

    def is_completed(self) -> bool:
        return self.work.is_completed()

    def is_success(self) -> bool:
        return self.work.is_success()

    def exception(self) -> Any:
        return self.work.exception()

    def get_future(self) -> Any:
        return self.work.get_future()


def _timed(work: dist.Work | None, clock: WaitClock) -> dist.Work | None:
    # On CUDA, waiting on the handle only orders the streams: the host waits in nothing.
    return work if work is None or clock.cuda else _TimedWork(work, clock)


class _TimedAllGather(DefaultAllGather):
    def __init__(self, clock: WaitClock) -> None:
        self.clock = clock

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, async_op: bool = False) -> dist.Work | None:
        with self.clock.waiting():
            work = super().__call__(output_tensor, input_tensor, group, async_op)
        return _timed(work, self.clock)


class _TimedReduceScatter(DefaultReduceScatter):
    def __init__(self, clock: WaitClock) -> None:
        self.clock = clock

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, op: dist.ReduceOp | dist.ReduceOp.RedOpType,
                 async_op: bool = False) -> dist.Work:
        with self.clock.waiting():
            work = super().__call__(output_tensor, input_tensor, group, op, async_op)
        return _timed(work, self.clock)  # type: ignore[return-value]


class _TimedAllReduce:
    """`torch.distributed` as FSDP2's gradient reduction sees it, with `all_reduce` timed.

    FSDP2 calls `dist.all_reduce` there only for HSDP's all-reduce across the replicate
    dimension (`foreach_reduce`), and lets a caller replace its all-gather and
    reduce-scatter but not that: so its module's `dist` is this, which hands every other
    name to torch.distributed unchanged.
    """

    def __init__(self, clock: WaitClock) -> None:
        self.clock = clock

    def __getattr__(self, name: str) -> Any:
        return getattr(dist, name)

    def all_reduce(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> dist.Work | None:
        with self.clock.waiting():
            work = dist.all_reduce(tensor, *args, **kwargs)
        return _timed(work, self.clock)


def time_fsdp_collectives(model: torch.nn.Module, clock: WaitClock) -> None:
    """Put `clock` around every FSDP2 all-gather and reduce-scatter of `model` (if sharded),
    and around HSDP's all-reduce across replicas.

    The all-reduce's clock is the process's (FSDP2's module is shared): the latest model
    timed, which is the one training, since a process trains one model at a time.
    """
    sharded = False
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_custom_all_gather(_TimedAllGather(clock))
            module.set_custom_reduce_scatter(_TimedReduceScatter(clock))
            sharded = True
    if sharded:
        _fsdp_collectives.dist = _TimedAllReduce(clock)  # type: ignore[assignment]


@dataclass(frozen=True)
class RankTiming:
    """One rank's mean seconds per step over a logged interval, and where it runs."""

    rank: int
    pod: str
    node: str
    compute_seconds: float
    wait_seconds: float
    # Seconds computing since this process started: a counter, which a reader that samples
    # now and then (the operator) turns into the compute time between its samples.
    compute_seconds_total: float = 0.0


def gather_rank_timings(compute_seconds: float, wait_seconds: float,
                        compute_seconds_total: float) -> list[RankTiming]:
    """Every rank's timing, ordered by rank, on every rank (a collective: call it on all)."""
    pod, node = where_am_i()
    if not dist.is_initialized() or dist.get_world_size() == 1:
        # Its "collectives" return at once: the time in them is its own work.
        return [RankTiming(0, pod, node, compute_seconds + wait_seconds, 0.0,
                           compute_seconds_total)]
    mine = RankTiming(dist.get_rank(), pod, node, compute_seconds, wait_seconds,
                      compute_seconds_total)
    everyone: list[RankTiming | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return sorted((timing for timing in everyone if timing is not None),
                  key=lambda timing: timing.rank)

