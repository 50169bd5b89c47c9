"""What the in-memory checkpoint tier (`spec.checkpoint.memory`) costs in host memory.

Torch-free, so the operator (which adds the tier to each worker pod's memory request and
limit and sizes its volume), the spec's validation (which refuses a tier over
`maxWorkerMemory`), `kubetrain estimate` and the trainer (memory_checkpoint.py) share one
figure:

    tier per process = state shard x versions kept (2) x (1 + replicas)

The state shard is what one training process snapshots: its part of the fp32 parameters
and of the optimizer's state (AdamW/Adam: two fp32 moments; SGD: one momentum buffer),
divided by the world size under FSDP and whole under DDP, plus a small fixed allowance
for the pickled rest (data position, schedule, RNG, goodput). Two versions are kept: a
snapshot is written beside the newest complete one, never over it, so a rank killed in
the middle of a snapshot still leaves a version every rank agrees on. `replicas` is the
number of partner copies each rank's shard has on other ranks (at most world size - 1).

Checkpoint staging (the trainer's staging.py) has its figures here too. The S3 tier's
asynchronous saves (`checkpoint.async`) stage into one host buffer per process that holds a
state shard, allocated at the first save and kept (`staging_budget`): the operator adds it
to the pod's memory request and limit beside the tier's, and `kubetrain estimate` shows it.
The in-memory tier stages into its own slots' pages and needs nothing more. On a GPU, a
tier's snapshots take a device-side first phase (a copy of the shard within the GPU) where
the free device memory leaves `device_headroom` free after it (`device_phase_fits`): the
trainer decides it from the GPU's free memory at the first snapshot, `kubetrain estimate`
from its estimate.

Nothing here touches the model or the tier's files; Kubernetes quantities are parsed
and written here for the operator's arithmetic on memory requests. A spec is read through
`SizedSpec`, the sections the figure depends on, so that the API's own validation
(`TrainingJobSpec`) imports this module without a circle.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Protocol

from kubetrain.api.checkpoint import CheckpointSpec
from kubetrain.api.model import ModelSpec
from kubetrain.api.optimization import OptimizationSpec
from kubetrain.api.parallelism import ParallelismSpec
from kubetrain.api.workers import Workers
from kubetrain.sizing import parameter_count, ssm_parameter_count

VERSIONS = 2  # the newest complete snapshot and the one being written beside it
# Where the trainer keeps the tier: the operator mounts the pod's memory volume there.
FOLDER_ENV = "KUBETRAIN_MEMORY_CHECKPOINTS"
EXTRA_BYTES = 1 << 20  # the pickled rest of a snapshot: data position, schedule, RNG, goodput
MIB = 1 << 20

_SUFFIXES = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15,
             "E": 10**18, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50,
             "Ei": 2**60, "m": 10**-3}
_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE]([-+]?[0-9]+))?([a-zA-Z]*)$")


class SizedSpec(Protocol):
    """The sections of a TrainingJobSpec the tier's size depends on (any TrainingJobSpec)."""

    @property
    def model(self) -> ModelSpec: ...
    @property
    def optimization(self) -> OptimizationSpec: ...
    @property
    def parallelism(self) -> ParallelismSpec: ...
    @property
    def workers(self) -> Workers: ...
    @property
    def checkpoint(self) -> CheckpointSpec: ...


def parse_quantity(value: int | str) -> int:
    """Bytes of a Kubernetes memory quantity (`64Gi`, `500M`, `1e9`, 1024), rounded up."""
    if isinstance(value, int):
        return value
    match = _QUANTITY.match(value.strip())
    if match is None or match.group(3) not in _SUFFIXES:
        raise ValueError(f"{value!r} is not a Kubernetes quantity (e.g. 64Gi, 500M)")
    number, exponent, suffix = match.groups()
    return math.ceil(float(number) * 10 ** int(exponent or 0) * _SUFFIXES[suffix])


def format_quantity(size: int) -> str:
    """`size` bytes as a quantity in whole Mi, rounded up (what the operator writes)."""
    return f"{-(-size // MIB)}Mi"


@dataclass(frozen=True)
class TierBudget:
    """The tier's host memory at one world size."""

    world_size: int
    shard_bytes: int  # one process's snapshot
    copies: int  # 1 + the replicas the world size allows
    procs_per_worker: int

    @property
    def per_process(self) -> int:
        """One process's own versions and the partner copies it holds."""
        return self.shard_bytes * VERSIONS * self.copies

    @property
    def per_worker(self) -> int:
        """One worker pod's: what the operator adds to its memory request and limit."""
        return self.per_process * self.procs_per_worker

    def describe(self) -> str:
        """The arithmetic, for refusals, logs and `kubetrain estimate`."""
        return (f"{_gib(self.shard_bytes)} state shard per process x {VERSIONS} versions x "
                f"{self.copies} copies (1 + replicas) x {self.procs_per_worker} processes per "
                f"worker = {_gib(self.per_worker)} per worker pod at {self.world_size} "
                "processes")


def _gib(size: int) -> str:
    return f"{size / 2**30:.2f} GiB"


def state_bytes(spec: SizedSpec, parameters: int, world_size: int) -> int:
    """Bytes of one process's snapshot of `parameters` fp32 parameters and their optimizer
    state at `world_size` processes."""
    opt = spec.optimization
    optimizer = 0 if opt.optimizer == "sgd" and not opt.momentum else (
        4 if opt.optimizer == "sgd" else 8)
    total = parameters * (4 + optimizer)
    if spec.parallelism.strategy == "fsdp" and world_size > 1:
        total = -(-total // world_size)
    return total + EXTRA_BYTES


def model_parameters(spec: SizedSpec) -> int | None:
    """The model's parameter count from the spec; None when only its config.json knows it
    (model.init, model.fromTeacher)."""
    if spec.model.init is not None or spec.model.from_teacher:
        return None
    dims = spec.model.resolve()
    if spec.model.architecture == "ssm":
        return ssm_parameter_count(dims)
    return parameter_count(dims, dynamics=spec.model.dynamics.enabled)


def tier_budget(spec: SizedSpec, world_size: int | None = None,
                parameters: int | None = None) -> TierBudget | None:
    """The tier's memory at `world_size` processes (default: the fewest the job may run
    with, where each shard is largest); None without a tier or a known model size."""
    memory = spec.checkpoint.memory
    sized = _sized(spec, world_size, parameters) if memory is not None else None
    if memory is None or sized is None:
        return None
    world_size, shard_bytes = sized
    return TierBudget(world_size=world_size, shard_bytes=shard_bytes,
                      copies=1 + min(memory.replicas, world_size - 1),
                      procs_per_worker=spec.workers.procs_per_worker)


def _sized(spec: SizedSpec, world_size: int | None,
           parameters: int | None) -> tuple[int, int] | None:
    """The world size (default: the fewest processes the job may run with, where each
    shard is largest) and one process's state shard there; None without a known model
    size."""
    workers = spec.workers
    if world_size is None:
        world_size = workers.min_workers * workers.procs_per_worker
    if parameters is None:
        parameters = model_parameters(spec)
    if parameters is None:
        return None
    return world_size, state_bytes(spec, parameters, world_size)


@dataclass(frozen=True)
class StagingBudget:
    """The S3 tier's staging buffer in host memory at one world size (checkpoint.async)."""

    world_size: int
    shard_bytes: int  # one process's buffer: its state shard
    procs_per_worker: int

    @property
    def per_worker(self) -> int:
        """One worker pod's: what the operator adds to its memory request and limit."""
        return self.shard_bytes * self.procs_per_worker

    def describe(self) -> str:
        """The arithmetic, for logs and `kubetrain estimate`."""
        return (f"{_gib(self.shard_bytes)} state shard per process x {self.procs_per_worker} "
                f"processes per worker = {_gib(self.per_worker)} per worker pod at "
                f"{self.world_size} processes")


def staging_budget(spec: SizedSpec, world_size: int | None = None,
                   parameters: int | None = None) -> StagingBudget | None:
    """The host memory the S3 tier's asynchronous saves stage into, at `world_size`
    processes (default: the fewest the job may run with, where shards are largest); None
    without `checkpoint.async` or a known model size."""
    sized = _sized(spec, world_size, parameters) if spec.checkpoint.async_ else None
    if sized is None:
        return None
    world_size, shard_bytes = sized
    return StagingBudget(world_size=world_size, shard_bytes=shard_bytes,
                         procs_per_worker=spec.workers.procs_per_worker)


# A device-side first phase leaves at least this much device memory free, whichever is more:
# the caching allocator may still grow after the first snapshot (an evaluation's batches,
# fragmentation), and a snapshot's buffer must never be what runs the step out of memory.
DEVICE_HEADROOM_BYTES = 4 << 30
DEVICE_HEADROOM_SHARE = 0.05


def device_headroom(total: int) -> int:
    """The device memory a device-side first phase leaves free, of a device of `total`."""
    return max(DEVICE_HEADROOM_BYTES, int(total * DEVICE_HEADROOM_SHARE))


def device_phase_fits(free: int, needed: int, total: int) -> bool:
    """Whether a snapshot of `needed` bytes takes a device-side first phase on a device of
    `total` bytes with `free` bytes free: whether `device_headroom` is left after it."""
    return free - needed >= device_headroom(total)


# Of the container's memory limit, the tier's share from which an out-of-memory kill names
# it: below that, the trainer's own use is most of the limit and the failure is its as before.
LARGE_SHARE = 0.25


def out_of_memory_note(spec: SizedSpec) -> str:
    """What a worker killed by its memory cgroup (OOMKilled) should also say about the tier:
    its tmpfs pages count against the container's memory limit, and the operator's healing,
    half the micro-batch, shrinks only the trainer's own use, never the tier. "" without a
    tier or a memory limit, or where the tier is less than LARGE_SHARE of the limit."""
    limit = spec.workers.resources.limits.get("memory")
    if spec.checkpoint.memory is None or limit is None:
        return ""
    own = parse_quantity(limit)
    budget = tier_budget(spec)
    if budget is None:
        return (f"the in-memory checkpoints (spec.checkpoint.memory) of a model sized by its "
                f"config.json were given no memory of their own: their tmpfs pages count "
                f"against the container's memory limit ({_gib(own)}) and a smaller "
                "micro-batch does not shrink them; add the tier's size (kubetrain estimate) "
                "to spec.workers.resources.limits.memory")
    whole = own + budget.per_worker
    share = budget.per_worker / whole
    if share < LARGE_SHARE:
        return ""
    return (f"{_gib(budget.per_worker)} of the container's {_gib(whole)} memory limit "
            f"({share:.0%}) is the in-memory checkpoint tier's (spec.checkpoint.memory: "
            f"{budget.describe()}), added for it: its tmpfs pages count against the "
            f"container's memory, and a smaller micro-batch shrinks only the trainer's own "
            f"{_gib(own)}, never the tier; if halving does not help, lower "
            "spec.checkpoint.memory.replicas or raise spec.workers.resources.limits.memory")


__all__ = ["DEVICE_HEADROOM_BYTES", "DEVICE_HEADROOM_SHARE", "FOLDER_ENV", "LARGE_SHARE",
           "VERSIONS", "SizedSpec", "StagingBudget", "TierBudget", "device_headroom",
           "device_phase_fits", "format_quantity", "model_parameters", "out_of_memory_note",
           "parse_quantity", "staging_budget", "state_bytes", "tier_budget"]
