"""The in-memory checkpoint tier: each rank's state in its pod's memory every few steps, with
a copy on a partner rank of another node (`spec.checkpoint.memory`).

Beside the S3 tier (checkpoint.py) and behind the same calls (`save`, `load_latest`,
`wait`, `close`); S3 stays the durable tier at its own interval, and SIGTERM still saves
there. The loop snapshots every `memory.everySteps`:

    memory = MemoryCheckpoints(spec, rank=rank, world_size=world)   # collective
    restored = memory.load_latest(app_state)   # before S3; None: use the S3 tier
    ...
    if memory.due(step):
        memory.save(step, app_state)           # blocking part: one copy of the state

Where it lives. A folder per local rank in memory that outlives the trainer process:
`$KUBETRAIN_MEMORY_CHECKPOINTS` (the operator mounts an emptyDir of medium Memory there,
sized by memory_budget.py), else /dev/shm. torchrun's in-place restarts keep the pod and
its volume, so a restarted rank finds its own snapshot there; a replaced pod or a lost node
takes it, and the partner's copy is used.

A snapshot of one rank (a *part*) is two files per slot: `<owner>-<slot>.data`, the raw
bytes of every tensor of the rank's state (its FSDP shards of the parameters and of the
optimizer's state, as they are: no gathering), and `<owner>-<slot>.meta`, the pickled rest
(data position, schedule, RNG, goodput, early stopping; where each tensor lies in the data
file; step, world size, lineage). The blocking part of `save` copies each tensor into the
data file, mapped in memory (`torch.from_file`), and pickles the rest; the model's part of
that skeleton is built and pickled once and kept while the model and optimizer hold the
same tensors (`_ModelPlan`). The copy is staged (staging.py, shared with the S3 tier): on
the CPU it is done when `save` returns, as it always was; on a GPU it runs on a side stream
into the slot's own pages, registered with CUDA, beside the next step's forward and
backward, and the next optimizer step waits for it (the loop's `before_update`). A
background thread waits until the copy has landed, then writes the meta file, by rename:
the meta file is the commit, and a part without one is torn and never read. Two slots per
owner: a snapshot is written into the slot not holding the newest committed part, so a
rank killed in the middle of a snapshot, or before its commit, leaves the one before it
intact.

Partners. Each rank's part is sent to `replicas` partner ranks, chosen on other nodes
(`partners`: ranks ordered by node, each sending to the rank one largest node further on,
so every rank holds the same number of copies) over a gloo group of the job's own
processes: the copy moves through torch.distributed's connections between the job's
ranks, which are formed through the job's rendezvous, and nothing new listens on a
port. The copy runs in the background thread after the commit; the next snapshot waits
for both. Where every rank is on one node the copies survive a trainer restart but
not a node loss, and the log says so (docs/memory-checkpoints.md).

Restore order (`load_latest`, collective). Every rank lists the committed parts it holds
(its own and its partners'), the lists are gathered, and the newest step for which a
part of every rank exists, all of the same lineage (one attempt's run of snapshots) and
the same world size, is chosen; it is used only when no newer S3 checkpoint exists. A rank
holding its own part reads it from its folder (the tier's "memory"); a rank whose part
is elsewhere receives it from the rank that holds it ("partner"). A world size unlike the
snapshot's, no complete step, or any rank failing to apply its part: every rank falls back
to S3 together. Reading a snapshot reads nothing from S3 but the listing of its
checkpoints' manifests.

This module owns the tier's files and transfers; it does not decide when to snapshot
(loop.py) and does not touch S3 (checkpoint.py).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import pickle
import shutil
import socket
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from kubetrain.api.trainingjob import TrainingJobSpec
from kubetrain.memory_budget import FOLDER_ENV
from kubetrain.pod_conventions import NODE_NAME_ENV
from kubetrain.trainer.checkpoint import ModelState, RandomState, latest_checkpoint
from kubetrain.trainer.distributed import all_ranks_agree, broadcast_from_rank0
from kubetrain.trainer.goodput import MEMORY_TIER, PARTNER_TIER, S3_TIER
from kubetrain.trainer.staging import Layout, Staged, Staging

log = logging.getLogger(__name__)

FORMAT = "kubetrain-memory-checkpoint-v1"
NODE_ENV = NODE_NAME_ENV  # the node's name, from the downward API in a pod
DEFAULT_ROOT = Path("/dev/shm/kubetrain-memory-checkpoints")
SLOTS = 2  # memory_budget.VERSIONS


# --- where partners are ---------------------------------------------------------------


def partners(nodes: Sequence[str], replicas: int) -> list[list[int]]:
    """For each rank, the ranks that keep copies of its snapshot: `replicas` of them (at most
    world size - 1), on other nodes wherever the job has other nodes.

    Ranks are ordered by node; the first partner of each is the rank one largest node
    further on in that order, which is a permutation (every rank holds one copy) and lies
    on another node whenever no node holds more than half the ranks. Further replicas
    continue the same way, then fall back to any other rank, other nodes first.
    """
    world = len(nodes)
    replicas = min(replicas, world - 1)
    order = sorted(range(world), key=lambda rank: (nodes[rank], rank))
    position = {rank: index for index, rank in enumerate(order)}
    largest = max(collections.Counter(nodes).values())
    shift = largest if largest < world else 1
    chosen: list[list[int]] = []
    for rank in range(world):
        start = position[rank]
        candidates = [order[(start + shift * k) % world] for k in range(1, world)]
        candidates += [order[(start + k) % world] for k in range(1, world)]
        others = list(dict.fromkeys(other for other in candidates if other != rank))
        # The first keeps the permutation; the rest, stably sorted, other nodes first.
        others[1:] = sorted(others[1:], key=lambda other: nodes[other] == nodes[rank])
        chosen.append(others[:replicas])
    return chosen


def copies_on_own_node(nodes: Sequence[str], chosen: Sequence[Sequence[int]]) -> str | None:
    """What the trainer's log says when some ranks' partner copies sit on their own node
    (`chosen` from `partners`): every rank on one node, or more than half on one; None
    when every copy is on another node, or there are no copies."""
    lonely = [rank for rank, ranks in enumerate(chosen)
              if any(nodes[other] == nodes[rank] for other in ranks)]
    if not lonely:
        return None
    where = sorted(set(nodes))
    why = (f"every rank runs on node {where[0]} and no other node exists" if len(where) == 1
           else f"a node holds more than half of the ranks (nodes {', '.join(where)})")
    return (f"in-memory checkpoints: {len(lonely)} of {len(nodes)} ranks keep their partner "
            f"copy on their own node, as {why}: those copies survive a trainer or pod restart "
            "but not the loss of that node; S3 covers that")


def memory_folder(job_name: str, local_rank: int) -> Path:
    """This process's folder of the tier: the pod's memory volume (or /dev/shm), one folder
    per job run (torchrun's run id: the job's uid under the operator) and local rank."""
    root = Path(os.environ.get(FOLDER_ENV) or DEFAULT_ROOT)
    run = os.environ.get("TORCHELASTIC_RUN_ID") or job_name
    return root / run / f"local-{local_rank}"


def open_memory_tier(spec: TrainingJobSpec, *, rank: int, world_size: int, local_rank: int,
                     job_name: str, staging: Staging | None = None) -> MemoryCheckpoints | None:
    """The job's tier on this rank (collective), or None without `spec.checkpoint.memory`.
    A snapshot is weighed against the newest S3 checkpoint of `spec.checkpoint.uri`;
    `staging` is the attempt's, shared with the S3 tier."""
    if spec.checkpoint.memory is None:
        return None

    def s3_latest_step() -> int | None:
        info = latest_checkpoint(spec.checkpoint.uri, spec.storage)
        return info.step if info is not None else None

    return MemoryCheckpoints(spec, rank=rank, world_size=world_size,
                             folder=memory_folder(job_name, local_rank),
                             s3_latest_step=s3_latest_step, staging=staging)


def node_name() -> str:
    """The node this process runs on: the operator's downward-API variable, else the host."""
    return os.environ.get(NODE_ENV) or socket.gethostname()


# --- turning state into bytes and back --------------------------------------------------


@dataclass(frozen=True)
class _Ref:
    """Where a tensor of the state lies in the data file, and what it was."""

    index: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    device: str
    sharded: bool  # a DTensor: its local shard is stored


def _flatten(value: Any, tensors: list[torch.Tensor]) -> Any:
    """`value` with every tensor replaced by a `_Ref` to its place in `tensors`."""
    if isinstance(value, torch.Tensor):
        sharded = isinstance(value, DTensor)
        local = value.to_local() if isinstance(value, DTensor) else value
        tensors.append(local.detach())
        return _Ref(len(tensors) - 1, local.dtype, tuple(local.shape), str(local.device),
                    sharded)
    if isinstance(value, dict):
        return {key: _flatten(item, tensors) for key, item in value.items()}
    if isinstance(value, list | tuple):
        items = [_flatten(item, tensors) for item in value]
        return items if isinstance(value, list) else tuple(items)
    return value


def _model_entry(state: ModelState,
                 modules: Sequence[torch.nn.Module] | None = None) -> dict[str, Any]:
    """A rank's model and optimizer state as they are: local shards, no gathering.
    `modules`: the model's `modules()`, where the caller kept them (a snapshot does not walk
    the module tree each time); its parameters and buffers are read from them as they are
    now, in the order of `parameters()` and `buffers()`."""
    optimizer = state.optimizer
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if modules is None:
        modules = list(state.model.modules())
    return {
        "parameters": _members(modules, "_parameters"),
        "buffers": _members(modules, "_buffers"),
        "optimizer": [dict(optimizer.state.get(p, {})) for p in params],
        "groups": [{key: value for key, value in group.items() if key != "params"}
                   for group in optimizer.param_groups],
    }


def _members(modules: Sequence[torch.nn.Module], kind: str) -> list[torch.Tensor]:
    """The parameters or buffers (`kind`) of `modules`, each once, as `Module.parameters()`
    and `buffers()` list them."""
    seen: set[torch.Tensor] = set()
    members = []
    for module in modules:
        for tensor in getattr(module, kind).values():
            if tensor is not None and tensor not in seen:
                seen.add(tensor)
                members.append(tensor)
    return members


def _rng_entry() -> dict[str, Any]:
    return {"cpu": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}


_PLAN_PARTS = ("parameters", "buffers", "optimizer")  # a model entry's parts a plan covers
PLANNED = "planned"  # in a model's skeleton: those parts, pickled by its `_ModelPlan`


def _model_tensors(entry: dict[str, Any]) -> tuple[list[torch.Tensor],
                                                   list[tuple[str, ...]]] | None:
    """The tensors of a model entry's parameters, buffers and optimizer state, in
    `_flatten`'s order, and the keys of each parameter's optimizer state; None where that
    state holds anything but tensors (no plan then: every snapshot flattens it)."""
    tensors = [*entry["parameters"], *entry["buffers"]]
    keys = []
    for state in entry["optimizer"]:
        for value in state.values():
            if not isinstance(value, torch.Tensor):
                return None
            tensors.append(value)
        keys.append(tuple(state))
    return tensors, keys


@dataclass
class _ModelPlan:
    """A model's part of the skeleton (its parameters, buffers and optimizer state as
    `_Ref`s), kept from one snapshot to the next while the model and its optimizer hold the
    same tensor objects, as they do between steps (both update them in place). A snapshot
    then neither walks that nested state nor builds and pickles a `_Ref` for each tensor,
    which was most of its blocking time (bench/memory_checkpoints.py): the meta file holds
    the plan's skeleton as it was pickled once (`PLANNED`). Weak references: a restore that
    replaces the optimizer's state frees the old tensors and the plan no longer matches."""

    sources: list[weakref.ref[torch.Tensor]]
    keys: list[tuple[str, ...]]
    start: int  # the index of its first tensor in the snapshot's list
    pickled: bytes  # the skeleton of the model's parameters, buffers and optimizer state

    def matches(self, tensors: list[torch.Tensor], keys: list[tuple[str, ...]],
                start: int) -> bool:
        return (start == self.start and keys == self.keys
                and len(tensors) == len(self.sources)
                and all(ref() is tensor for ref, tensor in zip(self.sources, tensors,
                                                                 strict=True)))


class _Capture:
    """A rank's state as a skeleton (tensors as `_Ref`s), its tensors in order and their
    layout in the data file. Each model's part comes from its `_ModelPlan` while that
    matches, and the layout is the last one while no plan changed and the rest of the
    state's tensors (RNG states and the like) have the same dtypes and shapes."""

    def __init__(self, device: torch.device) -> None:
        self._device = device  # the staging's: its tensors are laid out first
        self._plans: dict[str, _ModelPlan] = {}
        # Each model's modules: the tree is taken as fixed while the model is the same.
        self._modules: dict[str, tuple[weakref.ref[torch.nn.Module],
                                       list[torch.nn.Module]]] = {}
        self._layout: Layout | None = None

    def forget(self) -> None:
        """Drop the plans and the layout: the next snapshot builds them afresh."""
        self._plans.clear()
        self._modules.clear()
        self._layout = None

    @torch.no_grad()  # a DTensor's local shard without an autograd node (to_local)
    def __call__(self, app_state: dict[str, Any]) -> tuple[dict[str, Any],
                                                          list[torch.Tensor], Layout]:
        tensors: list[torch.Tensor] = []
        skeleton: dict[str, Any] = {}
        planned = True
        # Models first: their tensors keep their places from one snapshot to the next.
        for key, value in app_state.items():
            if isinstance(value, ModelState):
                saved, reused = self._model(key, value, tensors)
                skeleton[key] = ("model", saved)
                planned = planned and reused
        modelled = len(tensors)
        for key, value in app_state.items():
            if isinstance(value, ModelState):
                continue
            if isinstance(value, RandomState):  # this rank's own generators: same world size
                skeleton[key] = ("rng", _flatten(_rng_entry(), tensors))
            else:
                skeleton[key] = ("state", _flatten(value.state_dict(), tensors))
        layout = self._layout
        if (not planned or layout is None or len(layout.signature) != len(tensors)
                or any(have != (tensor.dtype, tensor.shape) for have, tensor in
                       zip(layout.signature[modelled:], tensors[modelled:], strict=True))):
            layout = self._layout = Layout.of(tensors, self._device)
        return skeleton, tensors, layout

    def _model(self, key: str, state: ModelState,
               tensors: list[torch.Tensor]) -> tuple[dict[str, Any], bool]:
        """The model entry's skeleton, its tensors appended to `tensors`; True when its
        plan was used."""
        modules = self._modules.get(key)
        if modules is None or modules[0]() is not state.model:
            modules = self._modules[key] = (weakref.ref(state.model),
                                            list(state.model.modules()))
        entry = _model_entry(state, modules[1])
        found = _model_tensors(entry)
        plan = self._plans.get(key)
        start = len(tensors)
        if found is not None and plan is not None and plan.matches(*found, start):
            tensors.extend(tensor.to_local() if isinstance(tensor, DTensor) else tensor
                           for tensor in found[0])
            saved, reused = {PLANNED: plan.pickled}, True
        else:
            saved, reused = _flatten({part: entry[part] for part in _PLAN_PARTS}, tensors), False
            if found is None:
                self._plans.pop(key, None)
            else:
                pickled = pickle.dumps(saved)
                self._plans[key] = _ModelPlan([weakref.ref(tensor) for tensor in found[0]],
                                              found[1], start, pickled)
                saved = {PLANNED: pickled}
        saved["groups"] = _flatten(entry["groups"], tensors)
        return saved, reused


def _view(data: torch.Tensor, offset: int, ref: _Ref) -> torch.Tensor:
    """The stored bytes of `ref` in `data` (uint8), as a tensor of its dtype and shape."""
    count = 1
    for length in ref.shape:
        count *= length
    size = count * torch.empty((), dtype=ref.dtype).element_size()
    return data[offset:offset + size].view(ref.dtype).view(ref.shape)


class _Restorer:
    """Puts a decoded snapshot back into the live objects of `app_state`."""

    def __init__(self, data: torch.Tensor, offsets: list[int]) -> None:
        self.data, self.offsets = data, offsets

    def tensor(self, ref: _Ref) -> torch.Tensor:
        return _view(self.data, self.offsets[ref.index], ref)

    def value(self, item: Any) -> Any:
        """A saved value with its tensors copied out of the data file (to their device)."""
        if isinstance(item, _Ref):
            return self.tensor(item).to(item.device, copy=True)
        if isinstance(item, dict):
            return {key: self.value(entry) for key, entry in item.items()}
        if isinstance(item, list | tuple):
            items = [self.value(entry) for entry in item]
            return items if isinstance(item, list) else tuple(items)
        return item

    @torch.no_grad()
    def into(self, target: torch.Tensor, ref: _Ref) -> None:
        local = target.to_local() if isinstance(target, DTensor) else target
        if tuple(local.shape) != ref.shape or local.dtype != ref.dtype:
            raise ValueError(f"a stored tensor is {ref.dtype} {ref.shape}, its target "
                             f"{local.dtype} {tuple(local.shape)}: another model or sharding")
        local.copy_(self.tensor(ref))

    def model(self, state: ModelState, saved: dict[str, Any]) -> None:
        if PLANNED in saved:
            saved = {**pickle.loads(saved[PLANNED]), "groups": saved["groups"]}
        live = _model_entry(state)
        for kind in ("parameters", "buffers"):
            if len(live[kind]) != len(saved[kind]):
                raise ValueError(f"the snapshot has {len(saved[kind])} {kind}, the model "
                                 f"{len(live[kind])}")
            for target, ref in zip(live[kind], saved[kind], strict=True):
                self.into(target, ref)
        optimizer = state.optimizer
        params = [p for group in optimizer.param_groups for p in group["params"]]
        for param, entries in zip(params, saved["optimizer"], strict=True):
            optimizer.state[param] = {key: self._optimizer_value(param, entry)
                                      for key, entry in entries.items()}
        for group, hyper in zip(optimizer.param_groups, saved["groups"], strict=True):
            group.update(self.value(hyper))

    def _optimizer_value(self, param: torch.Tensor, entry: Any) -> Any:
        if isinstance(entry, _Ref) and entry.sharded and isinstance(param, DTensor):
            local = self.tensor(entry).to(entry.device, copy=True)
            return DTensor.from_local(local, param.device_mesh, param.placements,
                                      run_check=False, shape=param.shape,
                                      stride=param.stride())
        return self.value(entry)

    def apply(self, app_state: dict[str, Any], skeleton: dict[str, Any]) -> None:
        missing = sorted(set(app_state) - set(skeleton))
        if missing:
            raise ValueError(f"the snapshot holds no {', '.join(missing)}")
        for key, value in app_state.items():
            kind, saved = skeleton[key]
            if kind == "model":
                self.model(value, saved)
            elif kind == "rng":
                rng = self.value(saved)
                torch.set_rng_state(rng["cpu"])
                if rng["cuda"] is not None and torch.cuda.is_available():
                    torch.cuda.set_rng_state(rng["cuda"])
            else:
                value.load_state_dict(self.value(saved))


# --- parts on this rank ----------------------------------------------------------------


@dataclass(frozen=True)
class Part:
    """A committed snapshot part that this rank holds: `owner`'s state at `step`."""

    owner: int
    step: int
    world_size: int
    lineage: str
    data_bytes: int
    slot: int

    def key(self) -> tuple[int, str]:
        return self.step, self.lineage


def _read_meta(path: Path) -> dict[str, Any] | None:
    try:
        meta: dict[str, Any] = pickle.loads(path.read_bytes())
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError):
        return None
    return meta if meta.get("format") == FORMAT else None


@dataclass(frozen=True)
class Restored:
    """What `load_latest` restored: the step, and whether every rank found its own part in
    its folder ("memory") or some came from a partner ("partner")."""

    step: int
    tier: str  # MEMORY_TIER or PARTNER_TIER: goodput books checkpoint_load by it
    fetched: int  # ranks whose part came from another rank
    seconds: float

    @property
    def uri(self) -> str:
        """How the log and the resumed event name the source."""
        return f"memory://{self.tier}/step-{self.step:08d}"


def load_tier(restored: Restored | None, s3_step: int | None) -> str | None:
    """The tier goodput books a resume's checkpoint_load to: the memory tier's when it
    restored, else S3's when a checkpoint was loaded from there (`s3_step`), else none."""
    if restored is not None:
        return restored.tier
    return S3_TIER if s3_step is not None else None


class MemoryCheckpoints:
    """The job's in-memory snapshots on this rank; see the module docstring."""

    def __init__(self, spec: TrainingJobSpec, *, rank: int, world_size: int, folder: Path,
                 node: str | None = None,
                 s3_latest_step: Callable[[], int | None] = lambda: None,
                 staging: Staging | None = None) -> None:
        """Collective. `folder` is this rank's own (`memory_folder`); `node` the node it runs
        on (`node_name`); `s3_latest_step` the newest committed S3 checkpoint's step, asked
        on rank 0 only when a complete memory snapshot exists; `staging` where the copies
        run (default: in place, on the caller's thread)."""
        memory = spec.checkpoint.memory
        assert memory is not None, "MemoryCheckpoints needs spec.checkpoint.memory"
        self.every_steps = memory.every_steps
        self.rank, self.world_size = rank, world_size
        self.folder = folder
        self.folder.mkdir(parents=True, exist_ok=True)
        self.s3_latest_step = s3_latest_step
        self._group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        here = node or node_name()
        nodes = self._gather(here)
        self.partners = partners(nodes, memory.replicas)
        self.sources = [other for other in range(world_size) if rank in self.partners[other]]
        self.same_node = [other for other in self.partners[rank] if nodes[other] == here]
        warning = copies_on_own_node(nodes, self.partners)
        if rank == 0 and warning is not None:
            log.warning("%s", warning)
        self.lineage = broadcast_from_rank0(uuid.uuid4().hex if rank == 0 else None,
                                            self._group)
        self._slots: dict[tuple[int, int], tuple[torch.Tensor, int]] = {}  # mapped data files
        self._header_sizes: dict[tuple[int, int, int], int] = {}  # (holder, owner, slot)
        self._staging = staging or Staging(torch.device("cpu"))
        self._area = self._staging.area("in-memory checkpoints")
        self._staged: Staged | None = None  # the last snapshot's copy
        self._capture = _Capture(self._staging.device)
        self._newest: dict[int, tuple[int, int]] = {}  # owner -> (step, slot) newest committed
        self._in_flight: Future[None] | None = None  # the last snapshot's background part
        # Marks where `save` waits on partners (the loop sets its `WaitClock.inside`), as
        # the S3 checkpointer's `waiting_on_peers` does.
        self.waiting_on_peers: Callable[[], contextlib.AbstractContextManager[None]] = (
            contextlib.nullcontext)
        self.last_blocking = 0.0  # seconds the last save held the loop

    @property
    def staging_path(self) -> str | None:
        """How the first snapshot was staged on a GPU ("device-side first phase" or
        "overlapped host copy"); None in place (the CPU) or before the first."""
        return self._area.path

    # --- saving ---------------------------------------------------------------------

    def due(self, step: int) -> bool:
        """Whether the loop snapshots at `step`."""
        return step % self.every_steps == 0

    def save(self, step: int, app_state: dict[str, Any]) -> float:
        """Snapshot this rank's state at `step` into its folder (collective only in the
        background); the seconds it blocked.

        The blocking part is what must see the state of `step`: its tensors staged into the
        mapped data file (copied, on the CPU; on a GPU the copy is in flight on return, and
        the next optimizer step waits for it) and the rest pickled. Committing the part
        (its meta file), once the copy has landed, and the copies to and from partners
        follow in the background; the next snapshot, `wait` and `close` wait for them. A
        rank killed before the commit leaves the slot torn, and the snapshot before it is
        used.
        """
        started = time.perf_counter()
        with self.waiting_on_peers():  # the last snapshot's copies to and from partners
            self.wait()
        skeleton, tensors, layout = self._capture(app_state)
        slot = self._free_slot(self.rank)
        data = self._mapped(self.rank, slot, layout.size)
        self._uncommit(self.rank, slot)
        self._staged = staged = self._area.stage(tensors, data, layout)
        meta = self._meta(step, skeleton, layout)
        self._in_flight = in_background(self._publish, step, slot, data, meta, staged)
        self.last_blocking = time.perf_counter() - started
        return self.last_blocking

    def _publish(self, step: int, slot: int, data: torch.Tensor, meta: bytes,
                 staged: Staged) -> None:
        """Commit this rank's part once its copy has landed, then copy it to its partners
        (the background part)."""
        staged.land()
        self._commit(self.rank, slot, meta, step)
        if self._group is not None and (self.partners[self.rank] or self.sources):
            self._replicate(step, data, meta)

    def _meta(self, step: int, skeleton: dict[str, Any], layout: Layout) -> bytes:
        return pickle.dumps({"format": FORMAT, "owner": self.rank, "step": step,
                             "world_size": self.world_size, "lineage": self.lineage,
                             "data_bytes": layout.size, "offsets": layout.offsets,
                             "skeleton": skeleton})

    def _replicate(self, step: int, data: torch.Tensor, meta: bytes) -> None:
        """Send this rank's part to its partners and receive its sources' parts (gloo)."""
        header = torch.frombuffer(bytearray(meta), dtype=torch.uint8)
        sizes = torch.tensor([data.numel(), header.numel(), step], dtype=torch.int64)
        pending = [dist.isend(sizes, partner, group=self._group)
                   for partner in self.partners[self.rank]]
        received = {source: torch.zeros(3, dtype=torch.int64) for source in self.sources}
        pending += [dist.irecv(buffer, source, group=self._group)
                    for source, buffer in received.items()]
        _wait_all(pending)
        pending.clear()
        for partner in self.partners[self.rank]:
            pending += [dist.isend(header, partner, group=self._group),
                        dist.isend(data, partner, group=self._group)]
        incoming = []
        for source, buffer in received.items():
            data_bytes, header_bytes, their_step = (int(value) for value in buffer)
            slot = self._free_slot(source)
            target = self._mapped(source, slot, data_bytes)
            self._uncommit(source, slot)
            their_header = torch.empty(header_bytes, dtype=torch.uint8)
            pending += [dist.irecv(their_header, source, group=self._group),
                        dist.irecv(target, source, group=self._group)]
            incoming.append((source, slot, their_header, their_step))
        _wait_all(pending)
        for source, slot, their_header, their_step in incoming:
            self._commit(source, slot, their_header.numpy().tobytes(), their_step)

    def _free_slot(self, owner: int) -> int:
        """The slot not holding `owner`'s newest committed part."""
        newest = self._newest.get(owner)
        return 0 if newest is None else (newest[1] + 1) % SLOTS

    def _mapped(self, owner: int, slot: int, size: int) -> torch.Tensor:
        """The data file of `owner`'s `slot`, mapped, at least `size` bytes."""
        held = self._slots.get((owner, slot))
        if held is not None and held[1] == size:
            return held[0]
        if held is not None:
            self._unmap(held[0])
        path = self.folder / f"{owner}-{slot}.data"
        path.unlink(missing_ok=True)  # a stale file of another size: mapped afresh
        data = torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)
        if owner == self.rank:  # staged into from the device: its own pages, registered
            self._staging.register(data)
        self._slots[(owner, slot)] = (data, size)
        return data

    def _unmap(self, data: torch.Tensor) -> None:
        """Let go of a mapped data file: its views and its registration with CUDA."""
        self._area.forget(data)
        self._staging.release(data)

    def _land(self, *, quietly: bool = False) -> None:
        """Wait until the last snapshot's copy is in host memory. `quietly`: a device that
        failed (a GPU error ended the attempt) raises here; the attempt is over anyway."""
        staged, self._staged = self._staged, None
        if staged is None:
            return
        try:
            staged.land()
        except RuntimeError:
            if not quietly:
                raise
            log.debug("rank %d: the last snapshot's copy did not land", self.rank,
                      exc_info=True)

    def _uncommit(self, owner: int, slot: int) -> None:
        (self.folder / f"{owner}-{slot}.meta").unlink(missing_ok=True)

    def _commit(self, owner: int, slot: int, meta: bytes, step: int) -> None:
        """Write the meta file last, by rename: from here on the part is committed."""
        final = self.folder / f"{owner}-{slot}.meta"
        temporary = final.with_suffix(".meta.tmp")
        temporary.write_bytes(meta)
        os.replace(temporary, final)
        self._newest[owner] = (step, slot)

    def wait(self) -> None:
        """Block until the last snapshot has landed, is committed and its partner copies are
        done; re-raise their error."""
        self._land()
        if self._in_flight is not None:
            in_flight, self._in_flight = self._in_flight, None
            in_flight.result()

    def close(self, *, discard: bool = False, abandon: bool = False) -> None:
        """Wait for a copy in flight; `discard` (the job finished) deletes this rank's folder.

        `abandon` (the attempt failed: a peer may be gone) does not wait: a copy to or from
        a lost rank would block until the group's timeout, or until torchrun's SIGKILL 30 s
        after its SIGTERM, and hold up the restart (bench/chaos.py --memory-tier's node
        loss took 36.7 s so). The part it was copying stays uncommitted at its partner,
        which a restore never uses."""
        try:
            if abandon:
                self._land(quietly=True)  # the copy from the device needs no peer
            else:
                self.wait()
        finally:
            self._in_flight = None
            for data, _ in self._slots.values():
                self._unmap(data)
            self._slots.clear()
            self._area.close()
            self._capture.forget()
            if discard:
                shutil.rmtree(self.folder, ignore_errors=True)

    # --- restoring ------------------------------------------------------------------

    def held(self) -> list[Part]:
        """The committed parts in this rank's folder (torn ones, without a meta, are not)."""
        found = []
        for path in sorted(self.folder.glob("*.meta")):
            meta = _read_meta(path)
            data = path.with_suffix(".data")
            if meta is None or not data.exists() or data.stat().st_size < meta["data_bytes"]:
                continue
            slot = int(path.stem.rpartition("-")[2])
            found.append(Part(int(meta["owner"]), int(meta["step"]), int(meta["world_size"]),
                              str(meta["lineage"]), int(meta["data_bytes"]), slot))
        return found

    def load_latest(self, app_state: dict[str, Any]) -> Restored | None:
        """Restore the newest snapshot every rank has a part of (collective); None when
        there is none, when S3 holds a newer checkpoint, or when any rank could not apply
        its part: then the caller loads from S3."""
        started = time.perf_counter()
        self._staging.before_update()  # a restore writes what a snapshot in flight reads
        inventory = self._inventory()
        choice = _complete_step(inventory, self.world_size)
        if choice is None:
            self._forget(inventory, None)
            return None
        step, lineage = choice
        s3_step = broadcast_from_rank0(self.s3_latest_step() if self.rank == 0 else None,
                                       self._group)
        if s3_step is not None and s3_step > step:
            if self.rank == 0:
                log.info("in-memory snapshot of step %d is older than the S3 checkpoint of "
                         "step %d: loading from S3", step, s3_step)
            self._forget(inventory, None)
            return None
        holders = _holders(inventory, step, lineage)
        try:
            data, meta = self._fetch(inventory, holders, step, lineage)
            _Restorer(data, meta["offsets"]).apply(app_state, meta["skeleton"])
            error = ""
        except (ValueError, KeyError, RuntimeError, OSError) as problem:
            error = f"{type(problem).__name__}: {problem}"
        if not all_ranks_agree(not error, self._group):
            log.warning("rank %d: the in-memory snapshot of step %d could not be restored "
                        "(%s): loading from S3", self.rank, step,
                        error or "another rank failed")
            return None
        fetched = sum(1 for owner, holder in holders.items() if holder != owner)
        self._forget(inventory, choice)
        seconds = time.perf_counter() - started
        tier = PARTNER_TIER if fetched else MEMORY_TIER
        log.info("rank %d restored step %d from %s in %.3f s", self.rank, step,
                 "its own memory" if holders[self.rank] == self.rank
                 else f"rank {holders[self.rank]}'s copy", seconds)
        return Restored(step, tier, fetched, seconds)

    def _fetch(self, inventory: list[list[Part]], holders: dict[int, int], step: int,
               lineage: str) -> tuple[torch.Tensor, dict[str, Any]]:
        """This rank's part: read from its folder, or received from its holder; and sends
        the parts it holds for others."""
        def part_of(rank: int, owner: int) -> Part:
            return next(part for part in inventory[rank] if part.owner == owner
                        and part.step == step and part.lineage == lineage)

        pending = []
        for owner, holder in holders.items():
            if holder == self.rank and owner != self.rank:
                data, header = self._read(part_of(self.rank, owner))
                pending += [dist.isend(header, owner, group=self._group),
                            dist.isend(data, owner, group=self._group)]
        holder = holders[self.rank]
        if holder == self.rank:
            data, header = self._read(part_of(self.rank, self.rank))
        else:
            part = part_of(holder, self.rank)
            header_size = self._gather_header_size(part, holder)
            header = torch.empty(header_size, dtype=torch.uint8)
            data = torch.empty(part.data_bytes, dtype=torch.uint8)
            _wait_all([dist.irecv(header, holder, group=self._group),
                       dist.irecv(data, holder, group=self._group)])
        _wait_all(pending)
        meta: dict[str, Any] = pickle.loads(header.numpy().tobytes())
        return data, meta

    def _gather_header_size(self, part: Part, holder: int) -> int:
        """The meta file's size of a part another rank holds (recorded in its inventory)."""
        return self._header_sizes[(holder, part.owner, part.slot)]

    def _read(self, part: Part) -> tuple[torch.Tensor, torch.Tensor]:
        base = self.folder / f"{part.owner}-{part.slot}"
        header = torch.frombuffer(bytearray(base.with_suffix(".meta").read_bytes()),
                                  dtype=torch.uint8)
        data = torch.from_file(str(base.with_suffix(".data")), shared=False,
                               size=part.data_bytes, dtype=torch.uint8)
        return data, header

    def _forget(self, inventory: list[list[Part]], keep: tuple[int, str] | None) -> None:
        """Delete this rank's parts except those of `keep` (the step restored): older or
        torn snapshots, another attempt's, or a world size that no longer applies."""
        kept = {(part.owner, part.slot) for part in inventory[self.rank] if part.key() == keep}
        for path in self.folder.iterdir():
            owner, _, slot = path.name.partition(".")[0].partition("-")
            try:
                if (int(owner), int(slot)) in kept:
                    continue
            except ValueError:
                pass
            path.unlink(missing_ok=True)
        self._newest = {part.owner: (part.step, part.slot) for part in inventory[self.rank]
                        if part.key() == keep}

    # Coordination on the tier's own gloo group.

    def _gather(self, value: Any) -> list[Any]:
        if self._group is None:
            return [value]
        every: list[Any] = [None] * self.world_size
        dist.all_gather_object(every, value, group=self._group)
        return every

    def _inventory(self) -> list[list[Part]]:
        """Every rank's committed parts (collective), with the sizes of their meta files:
        a rank receiving a part must size its buffer."""
        parts = self.held()
        sizes = {(part.owner, part.slot): (self.folder / f"{part.owner}-{part.slot}.meta")
                 .stat().st_size for part in parts}
        every = self._gather((parts, sizes))
        self._header_sizes = {(rank, owner, slot): size
                              for rank, (_, held) in enumerate(every)
                              for (owner, slot), size in held.items()}
        return [held for held, _ in every]



def in_background(function: Callable[..., None], *args: Any) -> Future[None]:
    """Run `function(*args)` in a daemon thread; its future holds the outcome.

    Not a ThreadPoolExecutor: the interpreter joins an executor's threads at exit, so a copy
    blocked on a rank that is gone would keep a failed trainer from exiting."""
    done: Future[None] = Future()

    def run() -> None:
        done.set_running_or_notify_cancel()
        try:
            function(*args)
        except BaseException as error:
            done.set_exception(error)
        else:
            done.set_result(None)

    threading.Thread(target=run, name="memory-ckpt", daemon=True).start()
    return done


def _wait_all(pending: list[Any]) -> None:
    """Wait for point-to-point sends and receives (`dist.Work`s)."""
    for work in pending:
        if work is not None:
            work.wait()


def _complete_step(inventory: list[list[Part]], world_size: int) -> tuple[int, str] | None:
    """The newest (step, lineage) with a committed part of every rank at this world size."""
    owners: dict[tuple[int, str], set[int]] = collections.defaultdict(set)
    for parts in inventory:
        for part in parts:
            if part.world_size == world_size:
                owners[part.key()].add(part.owner)
    complete = [key for key, found in owners.items() if found == set(range(world_size))]
    return max(complete) if complete else None


def _holders(inventory: list[list[Part]], step: int, lineage: str) -> dict[int, int]:
    """For each rank, the rank its part comes from: itself when it holds it, else the
    lowest rank holding a copy."""
    holding: dict[int, list[int]] = collections.defaultdict(list)
    for rank, parts in enumerate(inventory):
        for part in parts:
            if part.step == step and part.lineage == lineage:
                holding[part.owner].append(rank)
    return {owner: owner if owner in ranks else min(ranks) for owner, ranks in holding.items()}


__all__ = ["FOLDER_ENV", "NODE_ENV", "MemoryCheckpoints", "Part", "Restored",
           "copies_on_own_node", "load_tier", "memory_folder", "node_name", "open_memory_tier",
           "partners"]
