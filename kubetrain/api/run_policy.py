"""spec.runPolicy: restarts, deadlines, out-of-memory, stragglers, preflight, cleanup."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field

from kubetrain.api.base import ApiModel
from kubetrain.protocol import DEFAULT_PERMANENT_EXIT_CODES


class OutOfMemoryPolicy(ApiModel):
    """What follows a worker running out of memory (OOMKilled or a CUDA out-of-memory error)."""

    action: Literal["Halve", "Fail"] = Field(
        default="Halve",
        description="Halve (the default): restart the group from its latest checkpoint with "
        "the micro-batch halved and gradient accumulation doubled, so the global batch, the "
        "data order and the loss curve stay the same; the spec is not changed (the values "
        "used are in status.effective). Such restarts do not count against maxRestarts; "
        "they are limited to log2(optimization.microBatchSize). Fail: the job fails at the "
        "first out-of-memory failure.",
    )
    min_micro_batch: int = Field(
        default=1, ge=1,
        description="Smallest micro-batch Halve may go to: a job that ran out of memory at "
        "it, or would have to go below it, fails with reason OutOfMemory.",
    )


class StragglerPolicy(ApiModel):
    """When a rank counts as a straggler, and what follows (kubetrain.operator.stragglers)."""

    threshold: float = Field(
        default=1.3, gt=1,
        description="A rank whose compute time per step is more than this many times the "
        "median rank's is slow (a rank's slowness is its compute time over the median; "
        "under tensorParallel, its tensor-parallel group's: the group's smallest rank's "
        "compute over the median group's).",
    )
    window: int = Field(
        default=3, ge=1,
        description="Consecutive judged intervals a rank must be slow in before it is "
        "reported as a straggler. An interval is metrics.logEverySteps steps; the operator "
        "judges the latest one at each scrape, so intervals shorter than its resync are "
        "sampled, not all seen.",
    )
    action: Literal["Report", "Replace"] = Field(
        default="Report",
        description="Report: set the job's Straggler condition and post an event naming the "
        "pod, node and slowness. Replace: that too, then avoid the straggler's node "
        "(status.avoidedNodes, runPolicy.avoidNodesFor) and recreate its pod off it; the "
        "group checkpoints on the pod's SIGTERM and resumes from that checkpoint.",
    )


class PreflightPolicy(ApiModel):
    """The health check every rank runs before the first step of each attempt."""

    enabled: bool = Field(
        default=True,
        description="Before the first step, every rank multiplies matrices on its device "
        "(checked against a reference), all-reduces over the group and exchanges a tensor "
        "with each neighbouring rank (its links' bandwidth measured): a rank that fails or "
        "is too slow gets its node avoided and the group restarts without it.",
    )
    timeout_seconds: int = Field(
        default=60, ge=1, le=3600,
        description="Deadline of the whole check: a rank that has not reported by then "
        "failed it.",
    )
    min_bandwidth_fraction: float = Field(
        default=0.5, gt=0, le=1,
        description="A rank whose best link to a neighbouring rank (a tensor exchanged with "
        "each of its two neighbours in the ring of ranks) is under this fraction of the "
        "median rank's is measured again, with every rank, and fails the check when it is "
        "under it in both rounds: a slow node's every link is slow, a busy moment passes.",
    )


class RunPolicy(ApiModel):
    """How the job is restarted, bounded and cleaned up."""

    max_restarts: int = Field(
        default=5, ge=0, description="Group restarts allowed before the job fails."
    )
    backoff_seconds: int = Field(
        default=10, ge=0, description="First delay before a restart; doubles on each one.",
    )
    max_backoff_seconds: int = Field(
        default=600, ge=0, description="Upper bound of the restart delay."
    )
    permanent_exit_codes: list[int] = Field(
        default_factory=lambda: list(DEFAULT_PERMANENT_EXIT_CODES),
        description="Exit codes that mean a configuration or code error: the job fails "
        "without retrying. Signals, OOM kills, evictions and node loss are always retried.",
    )
    repeated_failure_limit: int = Field(
        default=3, ge=1,
        description="The job fails when the same non-signal exit code (e.g. 1, a Python "
        "exception) ends this many attempts in a row with no training progress in between.",
    )
    pending_deadline_seconds: int | None = Field(
        default=900, ge=1,
        description="A worker still Pending after this long is recreated (and counts as a "
        "restart).",
    )
    progress_deadline_seconds: int | None = Field(
        default=1800, ge=1,
        description="Restart the group when the training step has not advanced for this long "
        "(hang detection); null disables. Counts each attempt's start too, unless "
        "startupDeadlineSeconds is set.",
    )
    startup_deadline_seconds: int | None = Field(
        default=None, ge=1,
        description="How long each attempt may take to reach its first training step (the "
        "start, the rendezvous, the checkpoint's load, compilation) before the group is "
        "restarted as hung; progressDeadlineSeconds applies from that step on. Lets a short "
        "progress deadline catch hangs quickly where the start is long. null: "
        "progressDeadlineSeconds covers the start too.",
    )
    active_deadline_seconds: int | None = Field(
        default=None, ge=1, description="Fail the job after running this long."
    )
    ttl_seconds_after_finished: int | None = Field(
        default=None, ge=0, description="Delete the finished job (and its pods) after this long."
    )
    suspend: bool = Field(
        default=False,
        description="true: checkpoint, delete the pods and keep the job; false: resume.",
    )
    clean_pod_policy: Literal["None", "Running", "All"] = Field(
        default="Running",
        description="Pods deleted when the job finishes: None, Running (keep failed pods "
        "for their logs) or All.",
    )
    out_of_memory: OutOfMemoryPolicy = Field(
        default_factory=OutOfMemoryPolicy,
        description="After a worker runs out of memory: Halve the micro-batch (default) or "
        "Fail.",
    )
    stragglers: StragglerPolicy = Field(
        default_factory=StragglerPolicy,
        description="Slow-rank detection from each rank's compute time: threshold, window and "
        "action.",
    )
    preflight: PreflightPolicy = Field(
        default_factory=PreflightPolicy,
        description="The health check before each attempt's first step: enabled, "
        "timeoutSeconds, minBandwidthFraction.",
    )
    node_loss_toleration_seconds: int | None = Field(
        default=10, ge=0,
        description="Worker pods tolerate the node.kubernetes.io/unreachable and not-ready "
        "NoExecute taints this long (Kubernetes' default is 300 s), so that the taint "
        "manager evicts them from a lost node about when the operator replaces them (it "
        "does at once when a trainer's lifeline goes silent). A toleration for these keys "
        "in workers.template wins; null adds none.",
    )
    avoid_nodes_for: str = Field(
        default="1h", pattern=r"^([0-9]+h)?([0-9]+m)?([0-9]+s)?$", min_length=2,
        description="How long a node stays avoided by this job's pods after a straggler, a "
        "failed preflight or repeated failures on it (status.avoidedNodes), as 1h, 30m, "
        "90s or 1h30m; 0s avoids no node. The operator never cordons or taints nodes.",
    )

    @property
    def avoid_nodes_seconds(self) -> int:
        """avoidNodesFor in seconds."""
        units = {"h": 3600, "m": 60, "s": 1}
        return sum(int(number) * units[unit]
                   for number, unit in re.findall(r"([0-9]+)([hms])", self.avoid_nodes_for))
