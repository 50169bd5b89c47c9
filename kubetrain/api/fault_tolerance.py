"""spec.faultTolerance: per-step fault tolerance with torchft, in replica groups.

The workers split into replicaGroups groups of whole pods, each its own torchrun group;
within a group the model is sharded (fsdp) or replicated (ddp) as parallelism.strategy
says, and across the groups torchft's Manager replicates: every step averages the
gradients over the groups present, so when a group fails the others keep training, and a
group that comes back heals its weights from a live peer. The operator runs torchft's
lighthouse, which keeps the quorum of groups, for the job (docs/fault-tolerance.md).

The rules that tie the section to workers and parallelism are here too, as the CEL the
server runs (`fault_tolerance_rules`) and as what the models raise
(`fault_tolerance_refusals`), with the same messages. Torch-free; imports nothing from the
other API sections.
"""

from __future__ import annotations

from pydantic import ConfigDict, Field, model_validator
from pydantic.json_schema import JsonDict

from kubetrain.api.base import ApiModel, cel, problem

MIN_GROUPS_AT_MOST_GROUPS = ("must be less than or equal to replicaGroups: it is the fewest "
                             "groups training continues with; lower minReplicaGroups or "
                             "raise replicaGroups")
GROUPS_ARE_FIXED = ("cannot change after creation: the workers were split into groups, "
                    "each its own torchrun group, for the first value; create a new job that "
                    "resumes from this one's checkpoint (checkpoint.resumeFrom)")

ADDED_OR_REMOVED = ("cannot be added or removed after creation: the workers run as one "
                    "torchrun group or as replica groups from the start; create a new job "
                    "that resumes from this one's checkpoint (checkpoint.resumeFrom)")

# What the rest of the spec must be with faultTolerance: each message follows its field's
# name (and, from the models, its value).
REPLICAS_IN_WHOLE_GROUPS = ("must be a multiple of faultTolerance.replicaGroups: each "
                            "replica group is whole worker pods; set replicas to replicaGroups "
                            "x the pods of one group")
STRATEGY_WITHIN_A_GROUP = ("must be fsdp or ddp with faultTolerance: the replica groups are "
                           "the replicate dimension already (hsdp's, and auto may choose "
                           "hsdp); use fsdp to shard within a group, or ddp to replicate")
_NOT_ELASTIC = ("must equal workers.replicas with faultTolerance: the replica groups absorb a "
                "lost pod, not torchrun's elastic range (faultTolerance.minReplicaGroups says "
                "how few groups training continues with); remove {field} or set it to replicas")
MIN_REPLICAS_NOT_ELASTIC = _NOT_ELASTIC.format(field="minReplicas")
MAX_REPLICAS_NOT_ELASTIC = _NOT_ELASTIC.format(field="maxReplicas")

_REPLICAS = "(has(self.workers) && has(self.workers.replicas) ? self.workers.replicas : 1)"


class FaultToleranceSpec(ApiModel):
    """Replica groups that train on when one of them fails: docs/fault-tolerance.md."""

    model_config = ConfigDict(json_schema_extra={"x-kubetrain-cel": [
        cel("self.replicaGroups == oldSelf.replicaGroups",
            f"replicaGroups {GROUPS_ARE_FIXED}", ".replicaGroups"),
        cel("!has(self.minReplicaGroups) || self.minReplicaGroups <= self.replicaGroups",
            f"minReplicaGroups {MIN_GROUPS_AT_MOST_GROUPS}", ".minReplicaGroups"),
    ]})

    replica_groups: int = Field(
        ge=2, le=64,
        description="Groups the workers split into (2 to 64), each workers.replicas / "
        "replicaGroups whole pods running its own torchrun group: within a group the model "
        "is sharded as parallelism.strategy says (fsdp, or ddp to replicate; hsdp and auto "
        "are refused, the groups being the replicate dimension; tensorParallel stays within "
        "a pod, so within a group), and across the groups torchft's Manager averages the "
        "gradients of the groups present each step. workers.replicas must be a multiple of "
        "it. Cannot change after creation.",
    )
    min_replica_groups: int = Field(
        default=1, ge=1,
        description="Fewest live groups training continues with (at most replicaGroups). "
        "With fewer, the whole job restarts from its latest checkpoint.",
    )
    quorum_timeout_seconds: int = Field(
        default=60, ge=1, le=3600,
        description="How long a step waits for a quorum of groups (torchft's "
        "quorum_timeout), 1 to 3600.",
    )
    heartbeat_timeout_milliseconds: int = Field(
        default=1000, ge=100, le=60000,
        description="The lighthouse drops a group silent this long from the quorum "
        "(torchft_lighthouse --heartbeat_timeout_ms), 100 to 60000: the longest the "
        "healthy groups pause when one fails.",
    )
    collective_timeout_milliseconds: int = Field(
        default=10000, ge=1000, le=600000,
        description="How long a cross-group all-reduce may take before the step is dropped "
        "and the quorum formed again (the timeout of torchft's process group, torchtitan's "
        "process_group_timeout_ms), 1000 to 600000: it also bounds the process group's "
        "forming. A group lost without a word (a lost node) holds the others only until the "
        "lighthouse has not heard from it for heartbeatTimeoutMilliseconds, this long at "
        "most should the lighthouse not say; set it above the all-reduce's time on a healthy "
        "but loaded network.",
    )

    @model_validator(mode="after")
    def _min_groups_fit(self) -> FaultToleranceSpec:
        if self.min_replica_groups > self.replica_groups:
            raise problem("minReplicaGroups",
                          f"({self.min_replica_groups}) {MIN_GROUPS_AT_MOST_GROUPS}")
        return self

    def pods_per_group(self, replicas: int) -> int:
        """Worker pods in each group of a job of `replicas` pods (a multiple of the groups)."""
        return replicas // self.replica_groups


def fault_tolerance_refusals(groups: FaultToleranceSpec, replicas: int,
                             min_replicas: int | None, max_replicas: int | None,
                             strategy: str) -> list[tuple[str, str]]:
    """What the rest of the spec gets wrong for these replica groups, as (field under spec,
    message starting with the field's value) for `problem`; [] when nothing."""
    found = []
    if replicas % groups.replica_groups:
        found.append(("workers.replicas", f"({replicas}) {REPLICAS_IN_WHOLE_GROUPS}"))
    if min_replicas is not None and min_replicas != replicas:
        found.append(("workers.minReplicas", f"({min_replicas}) {MIN_REPLICAS_NOT_ELASTIC}"))
    if max_replicas is not None and max_replicas != replicas:
        found.append(("workers.maxReplicas", f"({max_replicas}) {MAX_REPLICAS_NOT_ELASTIC}"))
    if strategy not in ("fsdp", "ddp"):
        found.append(("parallelism.strategy", f"({strategy}) {STRATEGY_WITHIN_A_GROUP}"))
    return found


def fault_tolerance_rules() -> list[JsonDict]:
    """The spec-level CEL rules that tie faultTolerance to workers and parallelism."""
    return [
        cel(f"!has(self.faultTolerance) || {_REPLICAS} % self.faultTolerance.replicaGroups "
            "== 0", f"workers.replicas {REPLICAS_IN_WHOLE_GROUPS}", ".workers.replicas"),
        cel(f"!has(self.faultTolerance) || !has(self.workers) "
            f"|| !has(self.workers.minReplicas) || self.workers.minReplicas == {_REPLICAS}",
            f"workers.minReplicas {MIN_REPLICAS_NOT_ELASTIC}", ".workers.minReplicas"),
        cel(f"!has(self.faultTolerance) || !has(self.workers) "
            f"|| !has(self.workers.maxReplicas) || self.workers.maxReplicas == {_REPLICAS}",
            f"workers.maxReplicas {MAX_REPLICAS_NOT_ELASTIC}", ".workers.maxReplicas"),
        cel("has(self.faultTolerance) == has(oldSelf.faultTolerance)",
            f"faultTolerance {ADDED_OR_REMOVED}", ".faultTolerance"),
        cel("!has(self.faultTolerance) || !has(self.parallelism) "
            "|| !has(self.parallelism.strategy) "
            "|| self.parallelism.strategy == 'fsdp' || self.parallelism.strategy == 'ddp'",
            f"parallelism.strategy {STRATEGY_WITHIN_A_GROUP}", ".parallelism.strategy"),
    ]
