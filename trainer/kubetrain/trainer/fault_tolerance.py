"""Replica groups that keep training when one fails (spec.faultTolerance), on torchft.

A job with `faultTolerance.replicaGroups: N` runs as N torchrun groups, each its own
process group and rendezvous (`KUBETRAIN_REPLICA_GROUP` says which one this is). Within a
group the model is sharded (fsdp) or replicated (ddp) as in any job; across the groups
torchft's `Manager` replicates it. Each step:

    quorum (the lighthouse: which groups are alive; a group behind heals from a peer)
    → forward/backward in the group → average the gradients over the groups present
    → should_commit (every group agrees the step went through) → optimizer step

A group that fails drops out of the next quorum, and the others step on, averaging over
those present. A group that comes back (its torchrun restarted, its pod replaced) asks for a
quorum at step 0, finds peers ahead and takes their state before its first step: weights,
optimizer, learning-rate schedule, data position, early-stopping record, the torch RNG
of the same rank in the peer, and the goodput ledger's totals. No checkpoint is read from
storage for that. The quorum runs synchronously (torchft's `use_async_quorum=False`), so
a group heals before its forward pass and every step starts from the same weights on every
group.

The data: every group reads its own slots of the global position (data.py), as if the
groups' processes were one data-parallel world, so the groups never read the same sample.
Every participating group advances the position by the whole world's batch each step, so
the slots of a group that is absent are passed over, never trained later: what a
degraded step skipped is counted (`skipped_samples`), not made up. A step that does not
commit (a group failed inside it) passes its batch over the same way.

Checkpoints are written by one group, the first in the quorum (`writes_checkpoints`): the
other groups hold the same state. A whole-job restart resumes from them as any job does;
a group that starts while its peers are at step 0 too (a fresh job, or every group
restarting) reads the checkpoint as usual.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map

from kubetrain.pod_conventions import LIGHTHOUSE_ENV, REPLICA_GROUP_ENV
from kubetrain.trainer.goodput import GoodputLedger

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
    groups: int
    min_groups: int
    timeout_seconds: int
    samples_per_group_step: int  # one group's samples in one step, set by the loop
    skipped_samples: int = 0  # absent groups' and uncommitted steps' samples, passed over
    participants: int = 0  # groups in the last quorum
    _unused_quorum: bool = False  # the start's quorum, not yet trained in

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
                "operator starts them; `kubetrain run` does not yet: run each group as a "
                "torchrun of its own beside torchft's lighthouse (docs/fault-tolerance.md), "
                "or remove faultTolerance")
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
        process_group = (ProcessGroupNCCL(timeout=timeout) if world.device.type == "cuda"
                         else ProcessGroupGloo(timeout=timeout))
        heal = HealState(state)
        manager = Manager(
            pg=process_group, min_replica_size=spec.min_replica_groups,
            # The addresses peers reach this group's manager and checkpoint server at.
            hostname=reachable_host(), checkpoint_transport=_http_transport(timeout),
            state_dict=heal.state_dict, load_state_dict=heal.load_state_dict,
            # Healing before the forward pass: the loop's step and data position are the
            # peer's before this group fetches a batch (see the module docstring).
            use_async_quorum=False,
            # Every group draws the same initial weights from the job's seed: nothing to sync.
            init_sync=False,
            timeout=timeout, quorum_timeout=timeout, quorum_retries=QUORUM_RETRIES,
            # torchft numbers a replica by the digits its id ends with.
            replica_id=f"{job_name}-group-{group}",
            rank=world.rank, world_size=world.world_size)
        return cls(manager=manager, groups=spec.replica_groups,
                   min_groups=spec.min_replica_groups,
                   timeout_seconds=spec.quorum_timeout_seconds, samples_per_group_step=0)

    def first_quorum(self) -> int:
        """Join the quorum before loading anything: a group behind its peers takes their
        state here. The step the group is at (0 when no peer is ahead); the first step
        trains in this quorum, for the peers train in it too."""
        step = self.quorum()
        self._unused_quorum = True
        return step

    def quorum(self) -> int:
        """Join this step's quorum (healing from a peer when behind); the step to train."""
        if self._unused_quorum:
            self._unused_quorum = False
        else:
            try:
                self.manager.start_quorum()
            except Exception as error:  # torchft's client: a timeout, or no lighthouse
                raise QuorumLost(
                    f"no quorum of faultTolerance.minReplicaGroups ({self.min_groups}) "
                    f"replica groups within quorumTimeoutSeconds ({self.timeout_seconds}s): "
                    f"{error}".strip()) from error
        self.participants = self.manager.num_participants()
        return self.manager.current_step()

    def average(self, gradients: Iterable[torch.Tensor]) -> None:
        """Average this group's (local shards of the) gradients over the groups present: in
        buckets of BUCKET_BYTES, as DDP does, for one all-reduce per parameter costs a
        round trip each (a step of the CPU bench's model took 1.86 times as long)."""
        buckets = _buckets([_local(gradient) for gradient in gradients])
        flat = [_flatten_dense_tensors(bucket) for bucket in buckets]
        works = [self.manager.allreduce(tensor) for tensor in flat]
        for work, tensor, bucket in zip(works, flat, buckets, strict=True):
            work.wait()
            for gradient, averaged in zip(bucket, _unflatten_dense_tensors(tensor, bucket),
                                          strict=True):
                gradient.copy_(averaged)

    def commit(self) -> bool:
        """Whether every group got through the step (then, and only then, step the optimizer).
        Passed-over samples are counted here: those of absent groups, or the whole step's."""
        committed = self.manager.should_commit()
        present = self.participants if committed else 0
        self.skipped_samples += (self.groups - present) * self.samples_per_group_step
        return committed

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


class HealState:
    """The state a group that comes back takes from a live one, rank by rank.

    torchft sends it between processes of the same rank in two groups, whose shards have
    the same shape: DTensors travel as their local shards and are put back into this
    rank's own DTensors on arrival. Nothing here is collective: torchft asks for it from
    its own thread, on one rank at a time.
    """

    def __init__(self, state: dict[str, Stateful]) -> None:
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        return {name: tree_map(_local, _sent(name, value)) for name, value in self.state.items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for name, value in self.state.items():
            if name == "rng":
                torch.set_rng_state(state_dict[name]["cpu"])
            elif isinstance(value, GoodputLedger):
                value.adopt(state_dict[name])
            else:
                into = value.state_dict()  # this rank's own tensors: the shape to put them in
                value.load_state_dict(tree_map(_into, into, state_dict[name]))


def _sent(name: str, value: Stateful) -> Any:
    """What is sent of `value`: its state, but of the RNG only this rank's (RandomState's
    gathers every rank's, a collective), and of the goodput ledger its totals with the
    load tiers (`GoodputLedger.adopt`)."""
    if name == "rng":
        return {"cpu": torch.get_rng_state()}
    if isinstance(value, GoodputLedger):
        return value.snapshot()
    return value.state_dict()


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
