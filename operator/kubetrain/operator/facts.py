"""What the operator sees of a TrainingJob's world, reduced to the facts reconcile decides on.

Pure translations only: a pod manifest becomes a `WorkerPod`, rank 0's Prometheus
exposition becomes a `MetricsSample`, and so does an own-code job's latest report to
the status endpoint (`reported_sample`): reconcile reads progress from one place,
whichever kind of trainer the job runs. Fetching them (watches, HTTP, the endpoint's
memory) is the handlers' job; deciding what to do about them is
`kubetrain.operator.reconcile`'s.
"""

from __future__ import annotations

import math
from collections.abc import Container, Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from kubetrain import protocol
from kubetrain.operator.children import (
    ATTEMPT_LABEL,
    AVOIDED_NODES_ANNOTATION,
    INDEX_LABEL,
    TRAINER_CONTAINER,
)
from kubetrain.operator.kueue import Flavor
from kubetrain.operator.scheduling_facts import GroupObject
from kubetrain.protocol import (
    METRIC_PREFIX,
    FailureClass,
    Report,
    TrainerFailure,
    counter_sample,
    trainer_failure,
    unmarked_checkpoints,
)

# Pod or container reasons that mean the infrastructure, not the training code, ended a pod.
DISRUPTION_REASONS = frozenset({
    "OOMKilled", "Evicted", "NodeLost", "Preempting", "Shutdown", "Terminated",
    "NodeShutdown", "UnexpectedAdmissionError", "DeadlineExceeded",
})


@dataclass(frozen=True)
class WorkerPod:
    """One observed worker pod."""

    name: str
    index: int
    restart_attempt: int
    phase: str = "Pending"
    ready: bool = False
    deleting: bool = False
    created_at: datetime | None = None
    exit_code: int | None = None
    reason: str | None = None
    node_lost: bool = False
    ip: str | None = None
    # What the trainer left in its termination log, once the container ended.
    termination_message: str | None = None
    node: str | None = None
    # The DisruptionTarget condition's reason (preemption, eviction, taint manager), if any.
    disruption: str | None = None
    # The pod's own status reason and message (the kubelet's words about an eviction or an
    # OOM kill), which the container's reason may hide.
    pod_reason: str | None = None
    pod_message: str | None = None
    trainer_failure: TrainerFailure | None = None
    # Since when the scheduler finds no node for it (PodScheduled False, Unschedulable).
    unschedulable_since: datetime | None = None
    # The scheduler's words about why (e.g. "0/3 nodes are available: ...").
    unschedulable_message: str | None = None
    # The nodes its required anti-affinity keeps it off (status.avoidedNodes when created).
    avoiding: tuple[str, ...] = ()
    # Checkpoint folders its own code wrote but never marked complete (not uploaded).
    unmarked_checkpoints: tuple[str, ...] = ()
    # Held back by a scheduling gate (Kueue's pod integration until it admits the group):
    # waiting on purpose, not stuck.
    gated: bool = False

    @property
    def active(self) -> bool:
        """Still scheduled or running (not finished, not on its way out)."""
        return not self.deleting and self.phase in ("Pending", "Running", "Unknown")


@dataclass(frozen=True)
class RankSample:
    """One rank's mean seconds per step computing over a logged interval, and where it ran."""

    rank: int
    pod: str
    node: str
    compute_seconds: float
    # Its seconds of compute since its process started (None from trainers without it).
    compute_seconds_total: float | None = None


@dataclass(frozen=True)
class MetricsSample:
    """Rank 0's training metrics at one scrape; None where the trainer has not reported yet."""

    step: int | None = None
    max_steps: int | None = None
    epoch: float | None = None
    loss: float | None = None
    # The two terms of a distillation job's loss (other jobs have no such gauges).
    ce_loss: float | None = None
    kd_loss: float | None = None
    tokens_per_second: float | None = None
    last_step_time: datetime | None = None
    checkpoint_step: int | None = None
    checkpoint_time: datetime | None = None
    # The checkpoint with the lowest validation loss (keepBest); step 0: none yet.
    best_checkpoint_step: int | None = None
    best_checkpoint_val_loss: float | None = None
    step_time: float | None = None
    # Seconds of the job's wall time by cause (kubetrain_wall_time_seconds_total{cause}).
    wall_seconds: Mapping[str, float] | None = None
    # checkpoint_load's seconds by tier (kubetrain_checkpoint_load_seconds_total{tier}).
    checkpoint_load_seconds: Mapping[str, float] | None = None
    # Every rank's compute time over the interval ending at logged step `ranks_step`.
    ranks: tuple[RankSample, ...] = ()
    ranks_step: int | None = None
    # Seconds to maxSteps as the job's own code estimated them (its status reports).
    eta_seconds: int | None = None
    # From an own-code job's status reports, which say nothing of wall time by cause:
    # its goodput is judged from when its step advanced (observation.step_goodput).
    reported: bool = False
    # Own code: the furthest step an earlier attempt reported (the trainer status endpoint
    # keeps it), so the steps up to it that this attempt trains again are lost progress;
    # None: no restart.
    redone_until: int | None = None
    resumed_step: int | None = None  # own code: the checkpoint this attempt resumed from
    first_step: int | None = None  # own code: this attempt's first reported step
    # A report of progress 100 % with no step: the code's end-of-training post
    # (transformers' KubeflowCallback sends one), so the step is the last one, maxSteps.
    finished: bool = False
    # spec.faultTolerance: the replica groups in the last quorum, the samples passed over.
    replica_groups: int | None = None
    skipped_samples: int | None = None


# How a TrainerEnd's message ends: what status.lastFailure says of a restart in place.
IN_PLACE = "torchrun restarts the group in place"


@dataclass(frozen=True)
class TrainerEnd:
    """A trainer process of a running pod that ended, as its lifeline said (or did not say):
    torchrun restarts its group in place, and only the lifeline shows it
    (`kubetrain.operator.lifeline_watch`)."""

    pod: str
    time: datetime  # when the operator saw it end, to the second
    failure_class: FailureClass  # the trainer's class in its `end` line; Unknown without one
    message: str
    exit_code: int | None = None  # the trainer process's, when it said it


@dataclass(frozen=True)
class Observed:
    """Everything reconcile looks at besides the job itself."""

    pods: tuple[WorkerPod, ...] = ()
    # Trainer processes that ended in pods that run on (in-place restarts), oldest first.
    trainer_ends: tuple[TrainerEnd, ...] = ()
    # Pods whose trainer's lifeline stopped beating: their node or its network is lost.
    silent_pods: frozenset[str] = frozenset()
    service: bool = False
    # A job with spec.faultTolerance: its lighthouse's pod (None: absent) and whether its
    # Service is there. Never among `pods`, which are the workers.
    lighthouse: WorkerPod | None = None
    lighthouse_service: bool = False
    # The job generation the ConfigMap's snapshot was taken from (0: unknown); None: absent.
    config_generation: int | None = None
    # The micro-batch its snapshot tells the trainer to use; None: not annotated (the spec's).
    config_micro_batch: int | None = None
    metrics: MetricsSample | None = None
    # The job's gang objects and Kueue Workloads (kubetrain.operator.scheduling_facts).
    groups: tuple[GroupObject, ...] = ()
    # What the cluster serves of the placement APIs, by discovery: the gang mechanisms
    # (kubetrain.operator.gang.MECHANISM_APIS) and "Kueue".
    served: frozenset[str] = frozenset()
    # Kueue's ResourceFlavors, by name.
    flavors: Mapping[str, Flavor] = field(default_factory=dict)


def _time(value: str | None) -> datetime | None:
    return datetime.fromisoformat(value.replace("Z", "+00:00")) if value else None


def _terminated(pod_status: Mapping[str, Any]) -> Mapping[str, Any]:
    for container in pod_status.get("containerStatuses") or []:
        if container.get("name") == TRAINER_CONTAINER:
            state = container.get("state") or {}
            return state.get("terminated") or {}
    return {}


def _condition(pod_status: Mapping[str, Any], kind: str) -> Mapping[str, Any]:
    for condition in pod_status.get("conditions") or []:
        if condition.get("type") == kind:
            return condition
    return {}


def node_reachable(status: Mapping[str, Any], **_: Any) -> bool:
    """Whether a Node's kubelet still reports: False once the node lifecycle controller
    set its Ready condition to Unknown (no heartbeat within the grace period). Its pods
    can then neither run nor confirm their deletion: they have lost their node."""
    return _condition(status, "Ready").get("status") != "Unknown"


def worker_pod(pod: Mapping[str, Any], nodes: Container[str] | None = None) -> WorkerPod:
    """The facts about one worker pod manifest.

    `nodes` is the set of names of the existing, reachable nodes (`node_reachable`),
    when known: a pod bound to a node outside it has lost its node, whatever its last
    reported phase says.
    """
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    status = pod.get("status") or {}
    terminated = _terminated(status)
    phase = status.get("phase") or "Pending"
    reason = terminated.get("reason") or status.get("reason")
    disruption = None
    if _condition(status, "DisruptionTarget").get("status") == "True":
        reason = disruption = (_condition(status, "DisruptionTarget").get("reason")
                               or "DisruptionTarget")
    node = (pod.get("spec") or {}).get("nodeName")
    scheduled = _condition(status, "PodScheduled")
    unschedulable = scheduled.get("status") == "False" and scheduled.get(
        "reason") == "Unschedulable"
    avoiding = (meta.get("annotations") or {}).get(AVOIDED_NODES_ANNOTATION, "")
    return WorkerPod(
        name=meta.get("name", ""),
        index=int(labels.get(INDEX_LABEL, -1)),
        restart_attempt=int(labels.get(ATTEMPT_LABEL, 0)),
        phase=phase,
        ready=phase == "Running" and _condition(status, "Ready").get("status", "True") == "True",
        deleting=bool(meta.get("deletionTimestamp")),
        created_at=_time(meta.get("creationTimestamp")),
        exit_code=terminated.get("exitCode"),
        reason=reason,
        node_lost=bool(node) and nodes is not None and node not in nodes,
        ip=status.get("podIP"),
        termination_message=terminated.get("message"),
        node=node or None,
        disruption=disruption,
        pod_reason=status.get("reason"),
        pod_message=status.get("message"),
        trainer_failure=trainer_failure(terminated.get("message")),
        # A pod never scheduled has no other clock: its creation stands in for a missing time.
        unschedulable_since=(_time(scheduled.get("lastTransitionTime"))
                             or _time(meta.get("creationTimestamp"))) if unschedulable else None,
        unschedulable_message=scheduled.get("message") if unschedulable else None,
        avoiding=tuple(node for node in avoiding.split(",") if node),
        unmarked_checkpoints=unmarked_checkpoints(terminated.get("message")),
        gated=bool((pod.get("spec") or {}).get("schedulingGates")),
    )


def reported_sample(report: Report) -> MetricsSample:
    """An own-code job's latest status report as the progress reconcile reads.

    The step counts as advanced when the operator sees it change (the report's own time
    is the pod's clock, and a reporter may repeat an unchanged step): no last_step_time.
    A loss that is not finite (a diverged run) is left unreported, as from rank 0. An
    end-of-training post (100 %, no step) finishes the step count at maxSteps, since
    transformers posts steps at most every 5 s and its last post names none.
    """
    loss = report.loss if report.loss is not None and math.isfinite(report.loss) else None
    epoch = report.epoch if report.epoch is not None and math.isfinite(report.epoch) else None
    return MetricsSample(step=report.step, max_steps=report.total_steps, epoch=epoch,
                         loss=loss, eta_seconds=report.remaining_seconds, reported=True,
                         finished=report.step is None and report.progress_percent == 100,
                         redone_until=report.redone_until, resumed_step=report.resumed_step,
                         first_step=report.first_step)


def final_metrics(pods: Iterable[WorkerPod]) -> MetricsSample | None:
    """Rank 0's last gauges from its termination message, once its container has ended.

    The trainer writes them there on exit (kubetrain.trainer.metrics), so a run that
    ends between two scrapes still reports its last step and checkpoint.
    """
    for pod in pods:
        if pod.index == 0 and pod.termination_message:
            try:
                return metrics_sample(pod.termination_message)
            except ValueError:
                return None
    return None


def _seconds(value: float | None) -> datetime | None:
    return datetime.fromtimestamp(value, UTC).replace(microsecond=0) if value else None


def metrics_sample(exposition: str) -> MetricsSample:
    """Parse rank 0's /metrics text (the trainer's kubetrain_* gauges)."""
    values: dict[str, float] = {}
    wall_seconds: dict[str, float] = {}
    load_seconds: dict[str, float] = {}
    ranks: list[RankSample] = []
    totals: dict[int, float] = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            # NaN (a diverged loss) has no JSON form; such a value is left unreported.
            if not sample.name.startswith(METRIC_PREFIX) or not math.isfinite(sample.value):
                continue
            if not sample.labels:
                values[sample.name] = sample.value
            elif (sample.name == counter_sample(protocol.METRIC_WALL_TIME)
                  and "cause" in sample.labels):
                wall_seconds[sample.labels["cause"]] = sample.value
            elif sample.name == counter_sample(protocol.METRIC_CHECKPOINT_LOAD_TIME) \
                    and "tier" in sample.labels:
                load_seconds[sample.labels["tier"]] = sample.value
            elif sample.name == protocol.METRIC_RANK_COMPUTE and sample.labels.get(
                    "rank", "").isdigit():
                ranks.append(RankSample(int(sample.labels["rank"]),
                                        sample.labels.get("pod_name", ""),
                                        sample.labels.get("node", ""), sample.value))
            elif sample.name == protocol.METRIC_RANK_COMPUTE_TOTAL and sample.labels.get(
                    "rank", "").isdigit():
                totals[int(sample.labels["rank"])] = sample.value

    def whole(name: str) -> int | None:
        return int(values[name]) if name in values else None

    return MetricsSample(
        step=whole(protocol.METRIC_STEP),
        max_steps=whole(protocol.METRIC_MAX_STEPS),
        epoch=values.get(protocol.METRIC_EPOCH),
        loss=values.get(protocol.METRIC_LOSS),
        ce_loss=values.get(protocol.METRIC_CE_LOSS),
        kd_loss=values.get(protocol.METRIC_KD_LOSS),
        tokens_per_second=values.get(protocol.METRIC_TOKENS_PER_SECOND),
        last_step_time=_seconds(values.get(protocol.METRIC_LAST_STEP_TIME)),
        checkpoint_step=whole(protocol.METRIC_CHECKPOINT_STEP),
        checkpoint_time=_seconds(values.get(protocol.METRIC_CHECKPOINT_TIME)),
        best_checkpoint_step=whole(protocol.METRIC_BEST_CHECKPOINT_STEP),
        best_checkpoint_val_loss=values.get(protocol.METRIC_BEST_CHECKPOINT_VALIDATION_LOSS),
        step_time=values.get(protocol.METRIC_STEP_TIME),
        wall_seconds=wall_seconds or None,
        checkpoint_load_seconds=load_seconds or None,
        ranks=tuple(sorted((replace(rank, compute_seconds_total=totals.get(rank.rank))
                            for rank in ranks), key=lambda rank: rank.rank)),
        ranks_step=whole(protocol.METRIC_RANK_TIMING_STEP),
        replica_groups=whole(protocol.METRIC_REPLICA_GROUPS),
        skipped_samples=whole(protocol.METRIC_SKIPPED_SAMPLES),
    )
