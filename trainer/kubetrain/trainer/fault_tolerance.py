"""Replica groups that keep training when one fails (spec.faultTolerance), on torchft.

A job with `faultTolerance.replicaGroups: N` runs as N torchrun groups, each its own
process group and rendezvous (`KUBETRAIN_REPLICA_GROUP` says which one this is). Within a
group the model is sharded (fsdp) or replicated (ddp) as in any job; across the groups
torchft's `Manager` replicates it. Each step:

    fetch the batch → start the quorum (the lighthouse: which groups are alive; in the
    background) → forward/backward in the group → average the gradients over the groups
    present (waits for the quorum) → should_commit (every group agrees the step went
    through; a group behind applies a peer's state here) → optimizer step

The quorum runs asynchronously (torchft's `use_async_quorum=True`): its round trip to the
lighthouse, and the wait for the slowest group to ask, overlap the forward and backward
passes instead of coming before them. A step's quorum therefore cannot change the batch
the step trains on, which is why the groups' data never depends on it (below), and why a
group behind its peers heals at the step's commit rather than before its forward pass.

A group that fails drops out of the next quorum, and the others step on, averaging over
those present. A group that comes back (its torchrun restarted, its pod replaced) asks for a
quorum before loading anything (`first_quorum`), finds peers ahead and receives their state
there: no checkpoint is read from storage. It trains its first step as a bystander (torchft
replaces its gradients with the others' average) and, at that step's commit, takes the
peer's state (weights, optimizer, learning-rate schedule, data position, early-stopping
record, the torch RNG of the same rank in the peer, and the goodput ledger's totals); the
optimizer step that follows makes it the peer's equal. A live group that fell behind (its
step failed where its peers' committed) heals the same way at its next step.

torchft asks a peer for its state from its quorum thread, while the peer's loop computes:
FSDP2 swaps a module's parameters between their shards and the gathered tensors during
the forward and backward passes, so the state is not read there. The loop answers the
request itself once its backward pass is done, before the all-reduce (`HealState.serve`):
the parameters are sharded again, the data position is past the step's batch, the
schedule and optimizer have not stepped. Those shards do not change before the peer's
optimizer step, which waits for the healing group's share of the all-reduce, itself after
the healing group received them.

The data: every group reads its own slots of the global position (data.py), as if the
groups' processes were one data-parallel world, so the groups never read the same sample.
Every group advances the position by the whole world's batch each step, so the slots of a
group that is absent (or healing) are passed over, never trained later: what a degraded
step skipped is counted (`skipped_samples`), not made up. A step that does not commit (a
group failed inside it) passes its batch over the same way.

Checkpoints are written by one group, the first in the quorum (`writes_checkpoints`): the
other groups hold the same state. A whole-job restart resumes from them as any job does;
a group that starts while its peers are at step 0 too (a fresh job, or every group
restarting) reads the checkpoint as usual.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map

from kubetrain.pod_conventions import LIGHTHOUSE_ENV, REPLICA_GROUP_ENV
from kubetrain.trainer.goodput import GoodputLedger
from kubetrain.trainer.silent_peers import SilentPeers, SilentReplicaGroups

if TYPE_CHECKING:
    from torch.distributed.checkpoint.stateful import Stateful
    from torchft import Manager

    from kubetrain.api.trainingjob import FaultToleranceSpec
    from kubetrain.trainer.distributed import World

# DDP's default bucket size: large enough that the round trips do not count, small enough
# that a bucket's flat copy is a small part of the gradients' memory.
BUCKET_BYTES = 25 * 1024 * 1024
# Quorum requests tried again before QuorumLost: a lighthouse restarted in place (its
# pod's restartPolicy) is asked again, and the groups step on where they were. Measured
# with a 10 s quorum timeout: the lighthouse killed and back in 2 s, a group stepped again
# 7.9 s after the kill; without retries both groups ended at the timeout.
QUORUM_RETRIES = 2
# The least time given a quorum's store to answer a connection (a live one answers in
# milliseconds; `forming_watched`): the heartbeat timeout when that is longer.
STORE_REACHED_SECONDS = 1.0
INSTALL_FAULT_TOLERANCE = "pip install 'kubetrain[fault-tolerance]' (or pip install torchft)"


class QuorumLost(RuntimeError):
    """No quorum of minReplicaGroups groups formed within the quorum timeout (retried
    QUORUM_RETRIES times), or the lighthouse could not be reached: the failure class
    QuorumLost. torchrun restarts the group's processes in place; they rejoin the quorum
    and heal from a live group, or, where every group lost it and restarted, find no group
    ahead and resume from the latest checkpoint together: a whole-job restart."""


class NotInAReplicaGroup(RuntimeError):
    """spec.faultTolerance is set, but this process was not started as one of its groups."""


def replica_group() -> int | None:
    """This process's replica group, from the runner's environment (None outside one)."""
    group = os.environ.get(REPLICA_GROUP_ENV)
    return int(group) if group is not None else None


def data_slot(spec: FaultToleranceSpec | None, dp_rank: int, dp_size: int) -> tuple[int, int]:
    """This rank's (rank, world size) in the data: the groups' ranks side by side."""
    if spec is None:
        return dp_rank, dp_size
    return (replica_group() or 0) * dp_size + dp_rank, spec.replica_groups * dp_size


@dataclass
class ReplicaGroups:
    """This group's place among the job's replica groups, and torchft's Manager across them."""

    manager: Manager
    process_group: Any  # torchft's ProcessGroupGloo or ProcessGroupNCCL across the groups
    heal: HealState
    silent_peers: SilentPeers  # ends an all-reduce with a group the lighthouse lost
    groups: int
    min_groups: int
    timeout_seconds: int
    rank: int  # in the group's torchrun world
    samples_per_group_step: int  # one group's samples in one step, set by the loop
    skipped_samples: int = 0  # absent groups' and uncommitted steps' samples, passed over
    participants: int = 0  # groups in the last quorum, this one included unless healing
    healed_at: int | None = None  # the peer's step this group took at the last commit
    _unused_quorum: bool = False  # the start's quorum, not yet trained in
    # Waits for each step's quorum, so that the loop can answer a peer meanwhile.
    _waiter: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(
        1, thread_name_prefix="kubetrain-quorum"))

    @classmethod
    def join(cls, spec: FaultToleranceSpec, world: World, job_name: str,
             state: dict[str, Stateful]) -> ReplicaGroups:
        """Start this group's Manager (rank 0 of the group reports to the lighthouse).

        `state` is what a group that comes back takes from a live one (`HealState`).
        """
        group = replica_group()
        if group is None or LIGHTHOUSE_ENV not in os.environ:
            raise NotInAReplicaGroup(
                f"spec.faultTolerance: this process was not started as one of the job's "
                f"replica groups ({REPLICA_GROUP_ENV} and {LIGHTHOUSE_ENV} unset). The "
                "operator and `kubetrain run` start them: run the job with either, or each "
                "group as a torchrun of its own beside torchft's lighthouse "
                "(docs/fault-tolerance.md), or remove faultTolerance")
        # torchft logs every step's quorum and commit at INFO (its Rust part by RUST_LOG):
        # the trainer prints what changes (`Reporter.quorum`, `Reporter.healed`) instead.
        os.environ.setdefault("RUST_LOG", "warn")
        logging.getLogger("torchft").setLevel(logging.WARNING)
        # (A filter applies to its own logger's records only, not its children's.)
        logging.getLogger("torchft.manager").addFilter(_no_flight_recorder_on_cpu)
        try:
            from torchft import Manager
            from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL
        except ImportError as error:
            raise ImportError(f"faultTolerance needs torchft: {INSTALL_FAULT_TOLERANCE}") \
                from error
        timeout = timedelta(seconds=spec.quorum_timeout_seconds)
        # The cross-group process group's collectives and its forming end at this timeout
        # at the latest (the lighthouse's word ends them sooner: silent_peers.py, and
        # `forming_watched`); the manager's own, for the quorum and healing, stays the
        # longer one.
        collective = timedelta(milliseconds=spec.collective_timeout_milliseconds)
        silent_peers = SilentPeers(os.environ[LIGHTHOUSE_ENV],
                                   spec.heartbeat_timeout_milliseconds / 1000)
        process_group = forming_watched(
            ProcessGroupNCCL if world.device.type == "cuda" else ProcessGroupGloo,
            max(spec.heartbeat_timeout_milliseconds / 1000, STORE_REACHED_SECONDS),
            silent_peers,
        )(timeout=collective)
        heal = HealState(state, timeout.total_seconds())
        manager = Manager(
            pg=process_group, min_replica_size=spec.min_replica_groups,
            # The addresses peers reach this group's manager and checkpoint server at.
            hostname=reachable_host(), checkpoint_transport=_http_transport(timeout),
            state_dict=heal.state_dict, load_state_dict=heal.load_state_dict,
            # The quorum overlaps the forward and backward passes (the module docstring).
            use_async_quorum=True,
            # Every group draws the same initial weights from the job's seed: nothing to sync.
            init_sync=False,
            timeout=timeout, quorum_timeout=timeout, quorum_retries=QUORUM_RETRIES,
            # torchft numbers a replica by the digits its id ends with.
            replica_id=f"{job_name}-group-{group}",
            rank=world.rank, world_size=world.world_size)
        return cls(manager=manager, process_group=process_group, heal=heal,
                   silent_peers=silent_peers, groups=spec.replica_groups,
                   min_groups=spec.min_replica_groups,
                   timeout_seconds=spec.quorum_timeout_seconds, rank=world.rank,
                   samples_per_group_step=0)

    def first_quorum(self) -> int:
        """Join the quorum before loading anything. The step of the peers this group is
        behind, whose state it received and takes at its first step's commit; 0 when no
        peer is ahead (then it loads a checkpoint, as any job does). The first step trains
        in this quorum, for the peers train in it too."""
        with self._quorum_errors():
            self.manager.start_quorum()
            self._wait_for_quorum()
        self.participants = self.manager.num_participants()
        self._unused_quorum = True
        if self.manager.is_participating():
            return 0
        self.heal.prepare()
        return self.manager.current_step()

    def quorum(self) -> None:
        """Start this step's quorum: it runs while the group computes, and the gradients'
        average waits for it."""
        if self._unused_quorum:
            self._unused_quorum = False
            return
        with self._quorum_errors():
            self.manager.start_quorum()  # (waits for the last step's quorum, long done)

    def average(self, gradients: Iterable[torch.Tensor]) -> None:
        """Average this group's (local shards of the) gradients over the groups present: in
        buckets of BUCKET_BYTES, as DDP does, for one all-reduce per parameter costs a
        round trip each (a step of the CPU bench's model took 1.86 times as long). A group
        that is healing gets the others' average (torchft sends zeros for it)."""
        buckets = _buckets([_local(gradient) for gradient in gradients])
        flat = [_flatten_dense_tensors(bucket) for bucket in buckets]
        with self._quorum_errors():
            self._wait_for_quorum()
            works = [self.manager.allreduce(tensor) for tensor in flat]
        # A group lost without a word (silent_peers.py) ends the wait, and the step.
        silent = self.silent_peers.wait(works, holding=getattr(self.process_group, "_pg", None))
        if silent:
            error = SilentReplicaGroups(silent, self.silent_peers.heartbeat_timeout_seconds,
                                        "this step's all-reduce (the step is passed over)")
            if self.rank == 0:
                print(error, flush=True)
            self.manager.report_error(error)
            return
        for tensor, bucket in zip(flat, buckets, strict=True):
            for gradient, averaged in zip(bucket, _unflatten_dense_tensors(tensor, bucket),
                                          strict=True):
                gradient.copy_(averaged)

    def commit(self) -> bool:
        """Whether every group got through the step (then, and only then, step the optimizer).
        A group behind its peers takes their state here (`healed_at`). Passed-over samples
        are counted here: those of absent and healing groups, or the whole step's."""
        self.heal.loaded = False
        was_at = self.manager.current_step()
        committed = self.manager.should_commit()
        if not committed and self.manager.errored() is not None:
            self._let_go_of_the_failed_collective()
        self.healed_at = was_at if self.heal.loaded else None
        self.participants = self.manager.num_participants()
        present = self.participants if committed else 0
        self.skipped_samples += (self.groups - present) * self.samples_per_group_step
        return committed

    def _let_go_of_the_failed_collective(self) -> None:
        """Close this group's side of the cross-group process group as soon as a step's
        collective failed here, not at the next quorum's reconfiguration.

        A live peer may still sit in that collective, waiting for this group's share (it
        got no reset from the group that died). The lighthouse withholds the next quorum
        while the peer heartbeats without asking for one (a quorum needs more than half the
        heartbeating groups: torchft's guard against split brain), so this group's
        reconfiguration, which would close the connection and free the peer, waited for
        the peer: both waited until the dead group's replacement joined, or the collective
        timeout. Closed now, the peer's side fails at once and both ask for the quorum.
        (Should the abort fail, the next quorum's reconfiguration closes it, as before.)"""
        with contextlib.suppress(Exception):
            self.process_group.abort()

    @property
    def step(self) -> int:
        """The steps the groups have committed: the step this group trained last."""
        return self.manager.current_step()

    @property
    def absent_share(self) -> float:
        """The share of the groups absent from the last quorum (0 with all of them)."""
        return 1 - self.participants / self.groups if self.participants else 0.0

    def starts_at(self, step: int) -> None:
        """After a checkpoint was loaded (or none): the quorum's step count starts there."""
        self.manager.load_state_dict({"step": step, "batches_committed": step * self.groups})

    @property
    def writes_checkpoints(self) -> bool:
        """Whether this group writes the job's checkpoints: the first in the quorum."""
        return self.manager.participating_rank() == 0

    def close(self) -> None:
        self.manager.shutdown(wait=False)
        self._waiter.shutdown(wait=False)

    def _wait_for_quorum(self) -> None:
        """Wait for the step's quorum, giving a peer that asks for this group's state meanwhile
        what it asks for (`HealState.serve`); raises what failed the quorum."""
        done = self._waiter.submit(self.manager.wait_quorum)
        self.heal.serve(until=done)
        done.result()

    @contextlib.contextmanager
    def _quorum_errors(self) -> Iterator[None]:
        """torchft's client failing a quorum (a timeout, no lighthouse) as QuorumLost."""
        try:
            yield
        except Exception as error:
            raise QuorumLost(
                f"no quorum of faultTolerance.minReplicaGroups ({self.min_groups}) "
                f"replica groups within quorumTimeoutSeconds ({self.timeout_seconds}s): "
                f"{error}".strip()) from error


class HealState:
    """The state a group that comes back takes from a live one, rank by rank.

    torchft sends it between processes of the same rank in two groups, whose shards have
    the same shape: DTensors travel as their local shards and are put back into this
    rank's own DTensors on arrival. Nothing here is collective. torchft asks for it from
    its quorum thread, on one rank at a time, while the loop computes (the module
    docstring): the request waits for the loop to answer it (`serve`) once its parameters
    are sharded again.
    """

    def __init__(self, state: dict[str, Stateful], timeout_seconds: float) -> None:
        self.state = state
        self.timeout_seconds = timeout_seconds
        self.loaded = False  # a peer's state was put here (since the loop last cleared it)
        self._loop_thread = threading.get_ident()
        self._turn = threading.Condition()
        self._asked = False
        self._answer: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        """This rank's state, as the loop reads it at its next `serve`."""
        if threading.get_ident() == self._loop_thread:
            return self._read()
        with self._turn:
            self._asked, self._answer = True, None
            self._turn.notify_all()
            if not self._turn.wait_for(lambda: self._answer is not None,
                                       timeout=self.timeout_seconds):
                self._asked = False
                raise TimeoutError(f"the training loop did not hand over its state in "
                                   f"{self.timeout_seconds:g}s")
            answer, self._answer = self._answer, None
            assert answer is not None
            return answer

    def serve(self, until: Future[Any]) -> None:
        """Answer torchft's requests for the state until `until` is done (the step's quorum,
        in which torchft sends it): from the loop's thread, at a point where the parameters
        are sharded and nothing is computing."""
        until.add_done_callback(lambda _: self._wake())
        with self._turn:
            while True:
                if self._asked:
                    self._asked, self._answer = False, self._read()
                    self._turn.notify_all()
                if until.done():
                    return
                self._turn.wait()

    def prepare(self) -> None:
        """Make what a load puts the peer's state into before the first step: torch creates
        an optimizer's state at its first step, and DCP's state_dict (ModelState's) creates
        it beforehand only while no gradient is held, which at the commit is too late."""
        self.state["model"].state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for name, value in self.state.items():
            if name == "rng":
                torch.set_rng_state(state_dict[name]["cpu"])
            elif isinstance(value, GoodputLedger):
                value.adopt(state_dict[name])
            else:
                into = value.state_dict()  # this rank's own tensors: the shape to put them in
                value.load_state_dict(tree_map(_into, into, state_dict[name]))
        self.loaded = True

    def _read(self) -> dict[str, Any]:
        return {name: _sent(name, value) for name, value in self.state.items()}

    def _wake(self) -> None:
        with self._turn:
            self._turn.notify_all()


def _sent(name: str, value: Stateful) -> Any:
    """What is sent of `value`: its state (DTensors as their local shards), but of the RNG
    only this rank's (RandomState's gathers every rank's, a collective), and of the goodput
    ledger its totals with the load tiers (`GoodputLedger.adopt`)."""
    if name == "rng":
        return {"cpu": torch.get_rng_state()}
    if isinstance(value, GoodputLedger):
        return value.snapshot()
    return tree_map(_local, value.state_dict())


def forming_watched(process_group: type, store_seconds: float,
                    silent_peers: SilentPeers) -> type:
    """torchft's `process_group` class, whose forming for a new quorum ends early when the
    quorum names a group already lost.

    A quorum formed just as a node is lost can still name a group of that node: its request
    for the quorum reached the lighthouse before its heartbeats stopped. A lost group sends
    no reset, and the others' forming would wait for the collective timeout:
    - when that group hosts the quorum's store (its first group does): 7.3 s in a whole-loop
      run at 5000 ms. The forming first connects to the store within `store_seconds`; a live
      host answers at once.
    - when it is another member: gloo's forming connects to every member. It runs on a
      thread of its own while `silent_peers` asks the lighthouse (`SilentPeers.form`), and
      fails as soon as the lighthouse counts a member silent.
    The failed forming fails the step (torchft's Manager takes the error), and the next
    quorum, the lost group's heartbeats stale by then, leaves it out."""

    class FormingWatched(process_group):
        def configure(self, store_addr: str, *args: Any, **kwargs: Any) -> None:
            host, _, port = store_addr.partition("/")[0].rpartition(":")
            try:
                with socket.create_connection((host.strip("[]"), int(port)),
                                              timeout=store_seconds):
                    pass
            except OSError as error:
                raise RuntimeError(f"the quorum's store at {host}:{port} did not answer "
                                   f"within {store_seconds:g}s: its group is most likely lost "
                                   f"({error})") from error
            super().configure(store_addr, *args, **kwargs)

        def _create_pg(self, store: Any, rank: int, world_size: int) -> Any:
            create = super()._create_pg
            return silent_peers.form(lambda: create(store, rank, world_size))

    FormingWatched.__name__ = FormingWatched.__qualname__ = \
        f"{process_group.__name__}FormingWatched"
    return FormingWatched


def reachable_host() -> str:
    """The name other pods reach this one by. torchft advertises `socket.gethostname()`,
    in a pod its bare hostname `<job>-worker-<i>`, which only the pod itself resolves (a
    healing group failed to connect to it for 60 s on the whole loop); the fully qualified
    name, `<job>-worker-<i>.<job>.<namespace>.svc...` from the /etc/hosts the kubelet
    writes, is the workers' headless Service's DNS name."""
    return socket.getfqdn()


def _http_transport(timeout: timedelta) -> Any:
    """torchft's HTTP checkpoint server, advertised at `reachable_host()`."""
    from torchft.checkpointing.http_transport import HTTPTransport

    class ReachableHTTPTransport(HTTPTransport):
        def address(self) -> str:
            return str(super().address()).replace(
                f"//{socket.gethostname()}:", f"//{reachable_host()}:", 1)

    return ReachableHTTPTransport(timeout=timeout, num_chunks=0)


def _no_flight_recorder_on_cpu(record: logging.LogRecord) -> bool:
    """torchft warns at each quorum change that it cannot reset NCCL's flight recorder,
    which a build without NCCL (CPU, gloo) does not have: nothing to warn about there."""
    return "flight recorder" not in record.getMessage() or torch.cuda.is_available()


def _buckets(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """`tensors` in order, in runs of one dtype and device of about BUCKET_BYTES each."""
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for tensor in tensors:
        last = buckets[-1][-1] if buckets else None
        if (last is None or size >= BUCKET_BYTES or last.dtype != tensor.dtype
                or last.device != tensor.device):
            buckets.append([])
            size = 0
        buckets[-1].append(tensor)
        size += tensor.numel() * tensor.element_size()
    return buckets


def _local(value: Any) -> Any:
    return value.to_local() if isinstance(value, DTensor) else value


def _into(own: Any, received: Any) -> Any:
    if isinstance(own, DTensor):
        return DTensor.from_local(received.to(own.device), own.device_mesh, own.placements,
                                  shape=own.shape, stride=own.stride())
    return received
