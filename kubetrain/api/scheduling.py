"""spec.scheduling and spec.managedBy: how the worker group is placed and queued, and who
runs the job; status.scheduling: what the operator chose and why.

Three independent choices, each with the rules that keep them from contradicting one
another (here as pydantic validators for `kubetrain validate`, and as CEL for the server):

- the gang mechanism that places the group all or nothing: Kubernetes' own Workload API
  (scheduling.k8s.io/v1alpha2), Volcano's PodGroup, scheduler-plugins' coscheduling
  PodGroup, none, or Auto (the operator picks from the APIs the cluster serves);
- a Kueue LocalQueue that admits the job as a whole;
- a topology level (a node label, e.g. a rack or block) the group is placed within,
  required or preferred.

The operator acts on them in `kubetrain.operator.scheduling`; docs/scheduling.md says what
each needs from the cluster. Torch-free; imports nothing from the other API sections.
"""

from __future__ import annotations

import re
from typing import Final, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator
from pydantic.json_schema import JsonDict

from kubetrain.api.base import ApiModel, cel, problem

GangMechanism = Literal["Auto", "WorkloadAPI", "Volcano", "Coscheduling", "None"]
# What Auto resolves to, and what status.scheduling.gang holds.
ChosenGang = Literal["WorkloadAPI", "Volcano", "Coscheduling", "None"]

# The label Kueue reads a queue from, on any object it manages (Job, JobSet, plain pods).
KUEUE_QUEUE_LABEL: Final = "kueue.x-k8s.io/queue-name"
# spec.managedBy of a job this operator runs (absent means the same); MultiKueue's value
# marks a job whose copy runs in a worker cluster, which its controller mirrors back.
MANAGED_BY_KUBETRAIN: Final = "kubetrain.io/operator"
MANAGED_BY_MULTIKUEUE: Final = "kueue.x-k8s.io/multikueue"
# Volcano's scheduler, the one its PodGroups speak to.
VOLCANO_SCHEDULER: Final = "volcano"

# A label key: an optional DNS-subdomain prefix and a name (what a node label may be).
_LABEL_KEY = r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?" \
             r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
# Job's rule for managedBy: a domain-prefixed path, at most 63 characters.
_MANAGED_BY = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[-A-Za-z0-9_./]+$"

VOLCANO_QUEUE_NEEDS_VOLCANO = ("volcanoQueue is the queue of Volcano's PodGroup: set gang: "
                               "Volcano, or remove volcanoQueue")
TIMEOUT_NEEDS_COSCHEDULING = ("scheduleTimeoutSeconds is scheduler-plugins' PodGroup field "
                              "(coscheduling): set gang: Coscheduling, or remove it")
KUEUE_AND_VOLCANO = ("queue (a Kueue LocalQueue) and gang: Volcano both queue the job, and "
                     "neither sees the other's admissions: use Kueue with gang WorkloadAPI, "
                     "Coscheduling or Auto, or Volcano's own queue (volcanoQueue) without "
                     "queue")
VOLCANO_NEEDS_ITS_SCHEDULER = ("gang Volcano needs the volcano scheduler, the only one that "
                               "reads its PodGroups: remove workers.template.schedulerName or "
                               "set it to volcano")


class TopologyRequest(ApiModel):
    """Place the worker group within one domain of a node label (a rack, a block)."""

    level: str = Field(
        min_length=1, max_length=317, pattern=_LABEL_KEY,
        description="The node label whose value names a domain, e.g. "
        "cloud.provider.com/topology-rack or kubernetes.io/hostname. With Kueue "
        "(spec.scheduling.queue) it must be a level of the ClusterQueue's Topology.",
    )
    mode: Literal["Required", "Preferred"] = Field(
        default="Required",
        description="Required: the group runs within one domain or waits. Preferred: within "
        "as few domains as fit it. Where the operator knows the domains before the pods "
        "(Kueue's topology assignment), worker index and so rank follow them: ranks on one "
        "domain are adjacent.",
    )

    @field_validator("level", mode="before")
    @classmethod
    def _a_label_key(cls, level: object) -> object:
        # Before the pattern check, whose message is only the regular expression.
        if isinstance(level, str) and level and not re.fullmatch(_LABEL_KEY, level):
            raise ValueError(
                f"({level}) is not a node label key: write one such as "
                "cloud.provider.com/topology-rack or kubernetes.io/hostname (an optional "
                "lowercase DNS prefix and '/', then letters, digits, '-', '_' or '.')")
        return level


class SchedulingSpec(ApiModel):
    """How the worker group is placed and queued: docs/scheduling.md."""

    model_config = ConfigDict(json_schema_extra={"x-kubetrain-cel": [
        cel("self.gang == oldSelf.gang",
            "gang cannot change after creation: its objects and the pods' membership were "
            "made for the first one; create the job again", ".gang"),
        cel("!has(self.volcanoQueue) || (has(self.gang) && self.gang == 'Volcano')",
            VOLCANO_QUEUE_NEEDS_VOLCANO, ".volcanoQueue"),
        cel("!has(self.scheduleTimeoutSeconds) || (has(self.gang) "
            "&& self.gang == 'Coscheduling')", TIMEOUT_NEEDS_COSCHEDULING,
            ".scheduleTimeoutSeconds"),
        cel("!has(self.queue) || !has(self.gang) || self.gang != 'Volcano'",
            KUEUE_AND_VOLCANO, ".queue"),
    ]})

    gang: GangMechanism = Field(
        default="Auto",
        description="What places the workers all or nothing, so that two jobs never hold "
        "half their pods each and wait for ever. WorkloadAPI: Kubernetes' Workload and "
        "PodGroup (scheduling.k8s.io/v1alpha2, feature gates GenericWorkload and "
        "GangScheduling). Volcano: a Volcano PodGroup, pods on the volcano scheduler. "
        "Coscheduling: a scheduler-plugins PodGroup. None: pods placed one by one. Auto "
        "(default): from the APIs the cluster serves, never changing the pods' scheduler: "
        "the Workload API for the default scheduler, Volcano for schedulerName volcano, "
        "coscheduling for scheduler-plugins' scheduler, else None; status.scheduling says "
        "which and why.",
    )
    schedule_timeout_seconds: int | None = Field(
        default=None, ge=1, le=86400,
        description="Coscheduling only: how long scheduler-plugins waits for the whole "
        "group before it releases the members it placed and tries again (its PodGroup's "
        "scheduleTimeoutSeconds; the plug-in's default when unset).",
    )
    volcano_queue: str | None = Field(
        default=None, min_length=1, max_length=253,
        description="Volcano only: the Volcano queue of the job's PodGroup (Volcano's "
        "default queue when unset).",
    )
    queue: str | None = Field(
        default=None, min_length=1, max_length=63,
        description="A Kueue LocalQueue in the job's namespace. The job waits, suspended, "
        "until Kueue admits its Workload, then runs with the node selectors and tolerations "
        "of the flavor Kueue assigned (docs/scheduling.md, 'Kueue').",
    )
    topology: TopologyRequest | None = Field(
        default=None,
        description="Place the group within one domain of a node label: level and mode "
        "(Required or Preferred).",
    )

    @model_validator(mode="after")
    def _no_conflicts(self) -> SchedulingSpec:
        if self.volcano_queue is not None and self.gang != "Volcano":
            raise problem("volcanoQueue", f"({self.volcano_queue}) "
                          + VOLCANO_QUEUE_NEEDS_VOLCANO.removeprefix("volcanoQueue "))
        if self.schedule_timeout_seconds is not None and self.gang != "Coscheduling":
            raise problem("scheduleTimeoutSeconds", f"({self.schedule_timeout_seconds}) "
                          + TIMEOUT_NEEDS_COSCHEDULING.removeprefix("scheduleTimeoutSeconds "))
        if self.queue is not None and self.gang == "Volcano":
            raise problem("queue", KUEUE_AND_VOLCANO.removeprefix("queue "))
        return self


def scheduling_rules() -> list[JsonDict]:
    """The spec-level CEL rules that span scheduling and the other sections."""
    return [
        cel("!has(self.scheduling) || !has(self.scheduling.gang) "
            "|| self.scheduling.gang != 'Volcano' || !has(self.workers) "
            "|| !has(self.workers.template) || !has(self.workers.template.schedulerName) "
            f"|| self.workers.template.schedulerName == '{VOLCANO_SCHEDULER}'",
            VOLCANO_NEEDS_ITS_SCHEDULER, ".scheduling.gang"),
        # As Job's spec.managedBy: set at creation, never changed.
        cel("has(self.managedBy) == has(oldSelf.managedBy) "
            "&& (!has(self.managedBy) || self.managedBy == oldSelf.managedBy)",
            "managedBy is immutable: the controller that runs a job is chosen when it is "
            "created; create the job again", ".managedBy"),
    ]


MANAGED_BY_PATTERN: Final = _MANAGED_BY


def check_managed_by(managed_by: object) -> object:
    """spec.managedBy as written, refused with its fix when it is not a controller's name
    (before the pattern check, whose message is only the regular expression)."""
    if isinstance(managed_by, str) and not re.fullmatch(_MANAGED_BY, managed_by):
        raise ValueError(
            f"({managed_by}) is not a controller's name: write a domain-prefixed path such as "
            f"{MANAGED_BY_MULTIKUEUE}, or remove managedBy for kubetrain's operator")
    return managed_by


def managed_elsewhere(managed_by: str | None) -> bool:
    """Whether another controller runs a job whose spec.managedBy is `managed_by`."""
    return managed_by is not None and managed_by != MANAGED_BY_KUBETRAIN


KueuePath = Literal["Workload", "PodGroup"]

WORKLOAD_PATH_WHY = ("spec.scheduling.queue: the operator makes the job's Kueue Workload "
                     "(one pod set, minCount minReplicas for partial admission) and keeps the "
                     "job suspended until Kueue admits it; needs TrainingJob.v1alpha1.kubetrain.io "
                     "in Kueue's integrations.externalFrameworks")
POD_GROUP_PATH_WHY = ("the label kueue.x-k8s.io/queue-name without spec.scheduling.queue: the "
                      "pods carry Kueue's plain-pod group labels and Kueue's pod integration "
                      "gates and admits them as one group of replicas pods (needs the pod "
                      "integration; no partial admission, and a rescale is a new group); set "
                      "spec.scheduling.queue for the job-level path")


def kueue_path(queue: str | None, labels: dict[str, str]) -> tuple[KueuePath, str, str] | None:
    """Which of Kueue's two paths a job takes, its queue, and why; None without Kueue.

    spec.scheduling.queue is the job-level path (the operator's Kueue Workload); the
    TrainingJob's own queue-name label alone is the plain-pod group path, kept for the
    clusters that run Kueue's pod integration and manifests written before spec.scheduling.
    """
    if queue:
        return "Workload", queue, WORKLOAD_PATH_WHY
    labelled = labels.get(KUEUE_QUEUE_LABEL)
    if labelled:
        return "PodGroup", labelled, POD_GROUP_PATH_WHY
    return None


# --- status.scheduling --------------------------------------------------------------------


class KueueStatus(ApiModel):
    """How Kueue admits the job: its path, its queue and where admission stands."""

    model_config = ConfigDict(extra="ignore")

    path: Literal["Workload", "PodGroup"] = Field(
        description="Workload: the operator makes the job's Kueue Workload and runs the pods "
        "once Kueue admits it (spec.scheduling.queue). PodGroup: the pods carry Kueue's "
        "plain-pod group labels and Kueue's pod integration admits them (the TrainingJob's "
        "kueue.x-k8s.io/queue-name label without spec.scheduling.queue).")
    queue: str = Field(description="The LocalQueue.")
    workload: str | None = Field(default=None, description="The Kueue Workload (path "
                                 "Workload).")
    admitted: bool = Field(default=False, description="Whether Kueue admits the job now.")
    message: str = Field(default="", description="Why this path, and what the job waits for.")


class SchedulingStatus(ApiModel):
    """What places the group: the gang mechanism chosen, its group, and Kueue's admission."""

    model_config = ConfigDict(extra="ignore")

    gang: ChosenGang = Field(description="The gang mechanism in use: WorkloadAPI, Volcano, "
                             "Coscheduling or None.")
    reason: str = Field(default="", description="Why: spec.scheduling.gang, or what Auto "
                        "found the cluster serving.")
    pod_group: str | None = Field(default=None, description="The group object the pods join "
                                  "(a PodGroup's name).")
    min_count: int | None = Field(default=None, description="Workers the group needs placed "
                                  "at once (minCount / minMember).")
    wanted_min_count: int | None = Field(
        default=None, description="Workers the job needs placed at once now (minReplicas, "
        "at most the workers it runs): differs from minCount while a group that cannot "
        "change (a v1alpha2 PodGroup) keeps its size until the next whole-group restart.")
    kueue: KueueStatus | None = Field(default=None, description="Kueue's admission, for a "
                                      "job with a queue.")
