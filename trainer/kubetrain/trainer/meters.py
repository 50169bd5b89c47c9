"""What the training loop measures: a step's shape and clocks, the logged interval, and the
values reduced over ranks at a logged step.

`StepMeter` holds a step's clocks (busy time, the part of it inside collectives, the data
wait) and the interval since the last logged step (`Interval`), whose wall time is read
once per interval after synchronising the device: throughput, MFU and step time are
measured over it (loop.py's docstring says why). The loop calls it; it decides nothing.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from kubetrain.api.trainingjob import ModelDims, TrainingJobSpec
from kubetrain.sizing import flops_per_token, ssm_flops_per_token
from kubetrain.trainer.data import TokenDataset
from kubetrain.trainer.distributed import World
from kubetrain.trainer.goodput import PRODUCTIVE, GoodputLedger, StragglerBooking
from kubetrain.trainer.metrics import DynamicsReport, peak_flops
from kubetrain.trainer.model import Dynamics
from kubetrain.trainer.parallelize import ParallelModel
from kubetrain.trainer.rank_timing import WaitClock, time_fsdp_collectives


def mean_over_ranks(value: torch.Tensor) -> float:
    total = value.detach().clone()
    dist.all_reduce(total)  # SUM: gloo has no AVG
    return float(total) / dist.get_world_size()


def dynamics_over_ranks(model: torch.nn.Module, device: torch.device) -> DynamicsReport:
    """Mean mu over every block's channels; mean beta and velocity RMS over every block and
    rank, from each rank's last forward pass (`Dynamics.stats`). Collective: one all-reduce."""
    blocks = [module for module in model.modules() if isinstance(module, Dynamics)]
    world_size = dist.get_world_size()
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # mu sum, beta, mean square
    for dynamics in blocks:
        mu = dynamics.equilibrium.detach()
        # Each rank adds 1/world_size of the whole mu (HSDP's shards repeat on every replica).
        totals[0] += (mu.full_tensor() if isinstance(mu, DTensor) else mu).sum() / world_size
        totals[1:] += dynamics.stats
    dist.all_reduce(totals)
    channels = len(blocks) * blocks[0].equilibrium.shape[0]  # a DTensor's shape is global
    samples = len(blocks) * world_size
    return DynamicsReport(equilibrium_mean=float(totals[0]) / channels,
                          beta_mean=float(totals[1]) / samples,
                          velocity_rms=math.sqrt(float(totals[2]) / samples))


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step leaves for its logged interval (tensors, read when logged)."""

    loss: torch.Tensor  # this rank's loss, summed over its micro-batches
    terms: torch.Tensor  # distillation: its cross-entropy and KD terms, summed the same way
    grad_norm: torch.Tensor
    learning_rate: float  # the rate the step used


class StepMeter:
    """What the loop measures: the shape of a step, its clocks, and the logged interval.

    A step's busy time runs from `begin_step` (before the stop agreement) to `end_step`
    (after the optimizer's step); the part of it inside collectives (`clock`) is its wait,
    the rest its compute (rank_timing). Its data wait is `fetch`, and the host time the
    reporter gets per step runs from the fetch on (on a GPU, enqueue time: throughput is
    the interval's wall time).
    """

    def __init__(self, world: World, parallel: ParallelModel, dims: ModelDims,
                 goodput: GoodputLedger, spec: TrainingJobSpec, micro_batch_size: int) -> None:
        device = world.device
        # The spec's global batch in micro-batches of the size in use (see `fit`), over the
        # data-parallel ranks (a tensor-parallel group reads one micro-batch together).
        data_parallel = parallel.dp_size
        self.accumulation = spec.gradient_accumulation(data_parallel, micro_batch_size)
        self.local_tokens = self.accumulation * micro_batch_size * spec.data.seq_len
        self.global_tokens = self.local_tokens * data_parallel
        self.flops_per_second_peak = peak_flops(device) * world.world_size
        self.model_flops = (ssm_flops_per_token(dims) if spec.model.architecture == "ssm"
                            else flops_per_token(dims, spec.data.seq_len,
                                                 dynamics=spec.model.dynamics.enabled))
        self.interval = Interval(device)
        # Each rank's time inside collectives, to tell its compute from its wait (rank_timing).
        self.clock = WaitClock(device)
        time_fsdp_collectives(parallel.module, self.clock)
        self.computed = 0.0  # this process's seconds of compute so far (a counter for the operator)
        policy = spec.run_policy.stragglers
        # goodput's, judging a tensor-parallel group as one as the operator does
        self.stragglers = StragglerBooking(policy.threshold, policy.window,
                                           tensor_parallel=spec.parallelism.tensor_parallel)
        self.productive_mark = goodput.seconds[PRODUCTIVE]  # at the last logged interval
        self._step_started = self._waited_before = self._fetch_started = self._data_wait = 0.0

    def begin_step(self) -> None:
        """Start the step's clock (and, at the first step, the interval's)."""
        self.interval.begin_step()
        self._step_started, self._waited_before = time.perf_counter(), self.clock.seconds

    def fetch(self, data: TokenDataset) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every micro-batch of the step; the wait is what the data pipeline costs."""
        self._fetch_started = time.perf_counter()
        batches = [next(data) for _ in range(self.accumulation)]
        self._data_wait = time.perf_counter() - self._fetch_started
        return batches

    def end_step(self) -> float:
        """Add the step to the interval; its host seconds from the fetch on."""
        self.interval.add(self._data_wait, self.global_tokens,
                          busy=time.perf_counter() - self._step_started,
                          waited=self.clock.seconds - self._waited_before)
        return time.perf_counter() - self._fetch_started


class Interval:
    """Steps, data wait and tokens since the last logged step, and the wall time they took.

    `busy` is the wall time of the steps themselves (from the stop agreement to the
    optimizer's step), `waited` the part of it this rank spent inside collectives: the
    rest is its compute (rank_timing).

    The first interval's clock starts at the first step (`begin_step`); each later
    one starts where the one before ended (`next`). `end` synchronises the device
    before reading the clock, so an interval covers the device's work, not just
    the host's enqueueing of it: one synchronisation per logged interval, none per step.
    """

    def __init__(self, device: torch.device, started: float | None = None) -> None:
        self.device = device
        self.steps = 0
        self.data_wait = 0.0
        self.tokens = 0
        self.busy = 0.0
        self.waited = 0.0
        self._started = started
        self._ended: float | None = None

    def begin_step(self) -> None:
        if self._started is None:
            synchronize(self.device)
            self._started = time.perf_counter()

    def add(self, data_wait: float, tokens: int, *, busy: float, waited: float) -> None:
        self.steps += 1
        self.data_wait += data_wait
        self.tokens += tokens
        self.busy += busy
        self.waited += waited

    def end(self) -> float:
        """Wall seconds from the first step's start to now, once the device has caught up."""
        assert self._started is not None, "end() before any begin_step()"
        synchronize(self.device)
        self._ended = time.perf_counter()
        return self._ended - self._started

    def next(self) -> Interval:
        """The interval that starts where this one ended."""
        assert self._ended is not None, "next() before end()"
        return Interval(self.device, started=self._ended)


def synchronize(device: torch.device) -> None:
    """Wait for the training's kernels queued on `device` (a no-op where work runs
    synchronously): its own stream's, not a snapshot's copy on the staging stream, which
    goes on beside the next steps (staging.py)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
