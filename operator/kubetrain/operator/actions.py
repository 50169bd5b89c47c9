"""What a reconcile pass can decide: the actions the kopf handlers apply, as plain data.

`kubetrain.operator.reconcile` and its policy modules (lifecycle, nodes, observation)
build them, and the controller the one that needs the operator's own keys
(`CreateStatusSecret`); `kubetrain.operator.applier` performs them. Nothing here decides
or does I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal


@dataclass(frozen=True)
class CreateObject:
    """Create a child (Service, ConfigMap, Pod, or a placement object: a gang's Workload or
    PodGroup, a Kueue Workload); an existing one of that name is kept."""

    manifest: dict[str, Any]


@dataclass(frozen=True)
class CreateStatusSecret:
    """Create an own-code job's Secret `<job>-status` for the status endpoint, before its
    pods; an existing one is kept. The controller asks for it (it holds the endpoint's keys),
    not reconcile."""

    manifest: dict[str, Any]


@dataclass(frozen=True)
class UpdateConfigMap:
    """Replace the ConfigMap's snapshot (and its generation annotation) with `manifest`'s."""

    manifest: dict[str, Any]


@dataclass(frozen=True)
class DeletePod:
    """Delete a worker pod; grace 0 for pods whose node is gone (no kubelet to ask)."""

    name: str
    reason: str
    grace_period_seconds: int | None = None


@dataclass(frozen=True)
class PatchObject:
    """Merge-patch a placement object's spec (a PodGroup's minMember when the group's size
    changes), or with `status` its status (a Kueue Workload's Finished or released quota)."""

    api_version: str
    kind: str
    name: str
    patch: dict[str, Any]
    status: bool = False


@dataclass(frozen=True)
class DeleteObject:
    """Delete a placement object (a gang's group or a Kueue Workload): suspend and the end
    of the job release them, a renewed group replaces them; an absent one is no error."""

    api_version: str
    kind: str
    name: str
    reason: str


@dataclass(frozen=True)
class DeleteJob:
    """Delete the TrainingJob itself; owner references take its children with it."""

    reason: str


@dataclass(frozen=True)
class WriteStatus:
    """Patch status: `patch` (a JSON merge patch) turns the job's status into `status`.

    Emitted only when the status changed.
    """

    status: dict[str, Any]
    patch: dict[str, Any]


@dataclass(frozen=True)
class RecordEvent:
    """A Kubernetes event on the job, one per transition."""

    type: Literal["Normal", "Warning"]
    reason: str
    message: str


@dataclass(frozen=True)
class CountRestart:
    """Bookkeeping for the operator's metrics: the workers restart for `reason`."""

    reason: str
    hang: bool = False


@dataclass(frozen=True)
class CountFailure:
    """Bookkeeping for the metric kubetrain_worker_failures_total: a worker failed thus."""

    failure_class: str


@dataclass(frozen=True)
class CountQuorumChange:
    """Bookkeeping for the metric kubetrain_quorum_changes_total: the quorum of replica
    groups shrank or grew (spec.faultTolerance)."""

    shrank: bool


@dataclass(frozen=True)
class ReconcileAt:
    """Reconcile the job again at `time`, when a restart's backoff ends: no event of the
    API's comes then (controller-runtime's RequeueAfter). The kopf handlers schedule it."""

    time: datetime


Action = (CreateObject | CreateStatusSecret | UpdateConfigMap | DeletePod | DeleteJob
          | WriteStatus | RecordEvent | CountRestart | CountFailure | CountQuorumChange
          | ReconcileAt | PatchObject | DeleteObject)
