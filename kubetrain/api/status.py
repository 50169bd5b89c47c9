"""The TrainingJob's status: observed state, written only by the operator."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Final, Literal

from pydantic import ConfigDict, Field, field_validator

from kubetrain.api.base import ApiModel
from kubetrain.api.scheduling import SchedulingStatus
from kubetrain.protocol import FailureClass

Phase = Literal["Pending", "Running", "Restarting", "Suspended", "Succeeded", "Failed"]
# The phases a job never leaves (a pod's last phases have the same names).
FINISHED: Final = ("Succeeded", "Failed")


class Condition(ApiModel):
    model_config = ConfigDict(extra="ignore")

    type: str = Field(description="Created, Running, Restarting, Suspended, Succeeded, Failed, "
                      "Straggler, NodesAvoided, MemoryCopiesShareNode, PlacementBlocked, and "
                      "kstatus's Ready, Reconciling and Stalled.")
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    reason: str | None = Field(default=None, description="One-word CamelCase reason.")
    message: str | None = Field(default=None, description="Human-readable detail.")
    last_transition_time: datetime | None = Field(
        default=None, description="When the status last changed."
    )


class WorkersStatus(ApiModel):
    model_config = ConfigDict(extra="ignore")

    desired: int = Field(default=0, description="Workers the job wants now.")
    ready: int = Field(default=0, description="Workers running and ready.")
    selector: str | None = Field(
        default=None, description="Label selector of the worker pods (for the scale subresource)."
    )


class Progress(ApiModel):
    model_config = ConfigDict(extra="ignore")

    step: int = Field(default=0, description="Last completed optimizer step.")
    max_steps: int | None = Field(default=None, description="Steps to train for.")
    epoch: float | None = Field(
        default=None, description="Passes over the training data so far, with the fraction "
        "of the current one (1.5: halfway through the second epoch).")
    loss: float | None = Field(default=None, description="Training loss at that step.")
    ce_loss: float | None = Field(
        default=None, description="Knowledge distillation (spec.distillation): the "
        "cross-entropy on the labels at that step; loss is (1 - alpha) x ceLoss + alpha x "
        "kdLoss.")
    kd_loss: float | None = Field(
        default=None, description="Knowledge distillation: T^2 x KL(teacher || student) at "
        "that step.")
    tokens_per_second: float | None = Field(default=None, description="Throughput of the group.")
    updated_at: datetime | None = Field(default=None, description="When the step last advanced.")
    eta_seconds: int | None = Field(
        default=None, description="Seconds until maxSteps at the recent step time "
        "(restarts and other badput not included).")


class CheckpointLoadSeconds(ApiModel):
    """checkpointLoad split by the tier the resumed checkpoint came from."""

    model_config = ConfigDict(extra="ignore")

    memory: float = Field(default=0.0, description="Restored from the ranks' own in-memory "
                          "snapshots (spec.checkpoint.memory), after an in-place or container "
                          "restart.")
    partner: float = Field(default=0.0, description="Restored from memory with some ranks' "
                           "parts from a partner's copy on another node (a lost pod or node).")
    s3: float = Field(default=0.0, description="Loaded from the durable checkpoints "
                      "(spec.checkpoint.uri).")


class BadputSeconds(ApiModel):
    model_config = ConfigDict(extra="ignore")

    data_wait: float = Field(default=0.0, description="Waiting for training batches.")
    checkpoint_save: float = Field(default=0.0, description="Blocking part of checkpoint saves "
                                   "and the final export.")
    checkpoint_load: float = Field(default=0.0, description="Loading checkpoints on resume.")
    checkpoint_load_by_tier: CheckpointLoadSeconds | None = Field(
        default=None, description="checkpointLoad by the tier each resume loaded from; a "
        "load that found nothing to resume from (a fresh start) is in none, so the tiers sum "
        "to at most checkpointLoad. Absent from trainers that do not report the split.")
    startup: float = Field(default=0.0, description="Process start to the first step: "
                           "rendezvous, model build, compilation.")
    evaluation: float = Field(default=0.0, description="Validation passes.")
    lost_progress: float = Field(default=0.0, description="Step time once spent on steps that "
                                 "a restart made the job redo.")
    downtime: float = Field(default=0.0, description="Between the last step of one attempt and "
                            "the start of the next: replacement, scheduling, backoff.")
    oom: float = Field(default=0.0, description="Lost progress and downtime of attempts that "
                       "ran out of memory (runPolicy.outOfMemory's restarts).")
    straggler: float = Field(default=0.0, description="Time lost while a rank was a "
                             "straggler (runPolicy.stragglers), from the first slow interval "
                             "of its episode: the group's steps and saves over their healthy "
                             "pace, since every rank waits for the slowest.")
    preflight: float = Field(default=0.0, description="The health check before each attempt's "
                             "first step (runPolicy.preflight).")
    degraded: float = Field(default=0.0, description="spec.faultTolerance: of each step "
                            "trained by fewer than all replica groups, the absent groups' "
                            "share of its time (k of N groups: (N - k) / N).")


class ReplicaGroupsStatus(ApiModel):
    """spec.faultTolerance's groups as the operator last saw them."""

    groups: int = Field(description="faultTolerance.replicaGroups.")
    ready: int = Field(default=0, description="Groups whose every pod is running and ready.")
    in_quorum: int | None = Field(
        default=None, description="Groups in the last step's quorum, as worker 0's trainer "
        "reports it; fewer than groups while a group is away or healing.")
    skipped_samples: int | None = Field(
        default=None, description="Samples worker 0's group passed over since it started: "
        "the absent groups' shares of the steps it trained without them, and steps that "
        "did not commit. None is trained twice.")
    restarts: list[int] = Field(
        default_factory=list, description="Restarts of each group alone, by group index: "
        "its pods replaced, or its trainers restarted in place by torchrun. A whole-job "
        "restart counts in none; status.restarts counts every restart.")


class GoodputStatus(ApiModel):
    """Where the job's wall time went, reported by its trainer (cumulative across restarts)."""

    model_config = ConfigDict(extra="ignore")

    ratio: float = Field(description="Productive step time over wall time since the job first "
                         "started (0..1).")
    productive_seconds: float = Field(description="Time spent on steps the job keeps.")
    wall_seconds: float = Field(description="Wall time since the job first started, as of the "
                                "trainer's last report.")
    badput_seconds: BadputSeconds = Field(default_factory=BadputSeconds,
                                          description="The rest of the wall time, by cause.")


class CheckpointStatus(ApiModel):
    model_config = ConfigDict(extra="ignore")

    step: int = Field(description="Step of the newest committed checkpoint.")
    uri: str = Field(description="Where it is.")
    time: datetime | None = Field(default=None, description="When it was committed.")


class BestCheckpointStatus(ApiModel):
    model_config = ConfigDict(extra="ignore")

    step: int = Field(description="Step of the checkpoint with the lowest validation loss.")
    validation_loss: float = Field(description="Its validation loss.")
    uri: str = Field(description="Its folder: give it to checkpoint.resumeFrom or "
                     "`kubetrain generate --checkpoint`.")


class WorkerFailure(ApiModel):
    """One worker pod's end, classified (status.lastFailure)."""

    model_config = ConfigDict(extra="ignore")

    class_: FailureClass = Field(
        alias="class",
        description="OOMKilled, CUDAOutOfMemory, Evicted, Preempted, NodeLost, "
        "CollectiveTimeout, GPUError, PreflightFailed, UserError "
        "(runPolicy.permanentExitCodes) or Unknown.",
    )
    pod: str = Field(default="", description="The worker pod.")
    node: str | None = Field(default=None, description="The node it ran on.")
    exit_code: int | None = Field(default=None, description="Its trainer container's exit code.")
    message: str = Field(default="", description="What happened, from the pod's status and the "
                         "trainer's termination message (never environment or credentials).")
    time: datetime | None = Field(default=None, description="When the operator saw it.")


class EffectiveBatch(ApiModel):
    """The batch split the workers use, when the operator changed it from the spec's."""

    model_config = ConfigDict(extra="ignore")

    micro_batch_size: int = Field(description="Sequences per process per forward/backward "
                                  "pass: the spec's, or less after out-of-memory restarts.")
    gradient_accumulation_steps: int = Field(
        description="Micro-batches per optimizer step at the job's replicas: grows as the "
        "micro-batch shrinks, so the global batch is the spec's.")
    out_of_memory_restarts: int = Field(
        default=0, description="Restarts for running out of memory so far (each halved the "
        "micro-batch; not counted in restarts).")
    spec_micro_batch_size: int | None = Field(
        default=None, description="The spec's optimization.microBatchSize these values come "
        "from: when the spec's changes, the workers start again from the new one.")
    reason: str | None = Field(default=None, description="Why the values last changed.")
    time: datetime | None = Field(default=None, description="When they last changed.")


class RestartStatus(ApiModel):
    """The group's latest restart (status.restart): what the operator keeps doing until
    the replacements run."""

    model_config = ConfigDict(extra="ignore")

    reason: str = Field(description="Why the group restarts: WorkerFailed, NodeLost, "
                        "PendingTimeout, ProgressDeadlineExceeded, OutOfMemory, PreflightFailed "
                        "or StragglerReplaced.")
    attempt: int = Field(description="The restart attempt it began (status.restartAttempt, the "
                         "pods' label kubetrain.io/restart-attempt).")
    time: datetime = Field(description="When it began.")
    counted: bool = Field(default=True, description="Counted in runPolicy.maxRestarts, and "
                          "its pods wait out the backoff; out-of-memory and straggler restarts "
                          "are not.")
    whole_group: bool = Field(default=False, description="Whether every worker is recreated "
                              "(worker 0, the rendezvous host, was among the broken; a hang; a "
                              "new micro-batch; a failed preflight) or only the broken ones.")


class FailureStreak(ApiModel):
    model_config = ConfigDict(extra="ignore")

    exit_code: int = Field(description="Exit code that ended the latest attempts.")
    count: int = Field(description="Attempts in a row it ended with no training progress between.")
    step: int = Field(description="Training step when the streak began.")


class RankSlowness(ApiModel):
    """One rank's slowness at the last judged interval, and for how long it has been slow."""

    model_config = ConfigDict(extra="ignore")

    rank: int = Field(description="The rank (torch.distributed) in the current group.")
    pod: str = Field(description="The worker pod the rank runs in.")
    node: str = Field(description="The node that pod runs on.")
    slowness: float = Field(description="The rank's compute time per step over the median "
                            "rank's (1: as fast as the median); under tensorParallel, its "
                            "group's smallest rank's over the median group's, the same for "
                            "every rank of the group.")
    slow_intervals: int = Field(description="Consecutive judged intervals the rank has been "
                                "above runPolicy.stragglers.threshold (a straggler from "
                                "runPolicy.stragglers.window on).")
    straggler: bool = Field(default=False, description="Reported as a straggler: from "
                            "runPolicy.stragglers.window consecutive slow intervals until as "
                            "many consecutive intervals at or under the threshold.")
    normal_intervals: int = Field(default=0, description="Consecutive judged intervals at or "
                                  "under the threshold (a straggler's recovery).")
    compute_seconds_total: float | None = Field(
        default=None, description="The rank's seconds of compute since its process started, "
        "at this judgement: the next one judges the compute time in between.")


class RanksStatus(ApiModel):
    """Every rank's slowness, judged once per logged interval (kubetrain.operator.stragglers)."""

    model_config = ConfigDict(extra="ignore")

    step: int = Field(description="The logged step whose interval was judged last.")
    ranks: list[RankSlowness] = Field(default_factory=list, description="By rank.")


class AvoidedNode(ApiModel):
    """A node this job's pods keep off for a while (runPolicy.avoidNodesFor)."""

    model_config = ConfigDict(extra="ignore")

    node: str = Field(description="The node's name.")
    reason: Literal["Straggler", "PreflightFailed", "RepeatedFailures", "Unreachable"] = Field(
        description="Straggler (runPolicy.stragglers.action Replace), PreflightFailed, "
        "RepeatedFailures (two Unknown, CollectiveTimeout or GPUError failures on it within "
        "an hour), or Unreachable (a trainer's lifeline there went silent: the node or its "
        "network was lost).")
    message: str = Field(default="", description="What was seen on it.")
    time: datetime = Field(description="When the job began to avoid it.")
    expires: datetime = Field(description="When its pods may run there again.")


class NodeFailure(ApiModel):
    """A failure on a node that counts towards avoiding it (status.nodeFailures)."""

    model_config = ConfigDict(extra="ignore")

    node: str = Field(description="The node the failed pod ran on.")
    class_: FailureClass = Field(alias="class", description="Unknown, CollectiveTimeout or "
                                 "GPUError.")
    pod: str = Field(default="", description="The worker pod that failed.")
    time: datetime = Field(description="When the operator saw it.")


class TrainingJobStatus(ApiModel):
    """Observed state, written only by the operator."""

    model_config = ConfigDict(extra="ignore")

    phase: Phase | None = Field(default=None, description="Pending, Running, Restarting, "
                                "Suspended, Succeeded or Failed.")
    conditions: list[Condition] = Field(default_factory=list, description="Detailed conditions.")
    observed_generation: int | None = Field(
        default=None, description="The spec generation this status describes."
    )
    workers: WorkersStatus = Field(default_factory=WorkersStatus, description="Worker counts.")
    restarts: int = Field(default=0, description="Group restarts so far.")
    restart_attempt: int = Field(
        default=0,
        description="Generation of the worker group (label kubetrain.io/restart-attempt).",
    )
    last_restart_time: datetime | None = Field(
        default=None, description="When the group last restarted."
    )
    restart: RestartStatus | None = Field(
        default=None, description="The latest restart: why, whether it counts and waits a "
        "backoff, and whether it recreates the whole group.")
    last_failure: WorkerFailure | None = Field(
        default=None, description="The last worker failure, classified: class, pod, node, "
        "exit code, message and time.")
    failures: dict[str, int] = Field(
        default_factory=dict, description="Worker failures so far by class (see "
        "lastFailure.class).")
    effective: EffectiveBatch | None = Field(
        default=None, description="The micro-batch and gradient accumulation the workers "
        "use: the spec's until an out-of-memory restart halves the micro-batch.")
    progress: Progress = Field(default_factory=Progress, description="Training progress.")
    latest_checkpoint: CheckpointStatus | None = Field(
        default=None, description="Newest committed checkpoint."
    )
    best_checkpoint: BestCheckpointStatus | None = Field(
        default=None, description="The checkpoint with the lowest validation loss "
        "(checkpoint.keepBest).",
    )
    goodput: GoodputStatus | None = Field(
        default=None, description="Where the job's wall time went: goodput and badput by cause."
    )
    start_time: datetime | None = Field(default=None, description="When the job first ran.")
    completion_time: datetime | None = Field(default=None, description="When the job finished.")
    failure_streak: FailureStreak | None = Field(
        default=None,
        description="The same non-signal exit code ending consecutive attempts "
        "(repeatedFailureLimit).",
    )
    replica_groups: ReplicaGroupsStatus | None = Field(
        default=None, description="spec.faultTolerance's replica groups: how many are ready "
        "and how many the last step's quorum held (docs/fault-tolerance.md).")
    ranks: RanksStatus | None = Field(
        default=None, description="Each rank's slowness (compute time over the median "
        "rank's; under tensorParallel, its group's over the median group's), as the "
        "straggler rule judged it last (runPolicy.stragglers).",
    )
    avoided_nodes: list[AvoidedNode] = Field(
        default_factory=list, description="Nodes this job's pods keep off until each one's "
        "expiry: a required node anti-affinity on every pod created meanwhile.",
    )
    node_failures: list[NodeFailure] = Field(
        default_factory=list, description="The last hour's first failure of class Unknown, "
        "CollectiveTimeout or GPUError on each node: a second one there within the hour "
        "avoids the node (reason RepeatedFailures).",
    )
    straggler_replacements: int = Field(
        default=0, description="Straggler pods recreated off their node so far "
        "(runPolicy.stragglers.action Replace; at most runPolicy.maxRestarts, not counted in "
        "restarts).",
    )
    scheduling: SchedulingStatus | None = Field(
        default=None, description="What places the workers: the gang mechanism chosen and "
        "why, the group the pods join, and Kueue's admission (spec.scheduling).",
    )
    kopf: dict[str, Any] = Field(
        default_factory=dict,
        description="Handler progress of the kopf framework, kept here instead of annotations.",
    )

    @field_validator("last_failure", mode="before")
    @classmethod
    def _failure_from_text(cls, value: Any) -> Any:
        # Operators before failure classes wrote the failure as a sentence.
        if isinstance(value, str):
            return {"class": "Unknown", "message": value}
        return value

