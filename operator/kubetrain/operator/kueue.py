"""Kueue's two paths for a TrainingJob, as pure builders and readers.

The Workload path (spec.scheduling.queue): the operator is the job's Kueue integration, as
Kueue's own jobframework is for a Job. It makes one Kueue `Workload` (kueue.x-k8s.io/v1beta1)
owned by the job, with one pod set `workers` of `replicas` pods (`minCount` minReplicas for
partial admission, a `topologyRequest` for the level asked), and keeps the job suspended
until Kueue admits it. On admission the pods get the node labels and tolerations of the
flavors Kueue assigned, and, with a topology assignment, each worker the node selector of
its domain, in domain order, so that worker index (and rank) follows the topology. When the
job finishes, the Workload is marked Finished; when Kueue evicts it, the pods stop (the
group checkpoints on SIGTERM) and the quota reservation is given back once they are gone,
as jobframework does for the jobs it knows. Kueue must list the kind among its
`integrations.externalFrameworks` (docs/scheduling.md).

The PodGroup path (the queue only as the TrainingJob's kueue.x-k8s.io/queue-name label):
each pod carries Kueue's plain-pod group labels, and Kueue's pod integration gates, admits
and places them itself (`pod_group_marks`).

Which path a job takes is `kubetrain.api.scheduling.kueue_path`; when to create, finish or
release the Workload is `kubetrain.operator.scheduling`'s.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

from kubetrain.api.scheduling import KUEUE_QUEUE_LABEL
from kubetrain.api.trainingjob import TrainingJob
from kubetrain.operator.children import MANAGED_BY, owner_reference
from kubetrain.operator.gang import Api
from kubetrain.pod_conventions import JOB_LABEL

KUEUE_WORKLOAD: Final = Api("kueue.x-k8s.io/v1beta1", "workloads", "Workload")
RESOURCE_FLAVOR: Final = Api("kueue.x-k8s.io/v1beta1", "resourceflavors", "ResourceFlavor")
POD_SET: Final = "workers"

# Kueue's plain-pod integration: the group's name and size on each pod.
GROUP_LABEL: Final = "kueue.x-k8s.io/pod-group-name"
GROUP_COUNT_ANNOTATION: Final = "kueue.x-k8s.io/pod-group-total-count"
# Topology-aware scheduling, on the pods of a group (the PodGroup path).
REQUIRED_TOPOLOGY: Final = "kueue.x-k8s.io/podset-required-topology"
PREFERRED_TOPOLOGY: Final = "kueue.x-k8s.io/podset-preferred-topology"


def workload_name(job_name: str, previous: str | None) -> str:
    """The name of the job's next Kueue Workload: `trainingjob-<job>-<n>`, n one more than
    the last one's, so that a new Workload never waits for the old one's finalizer."""
    prefix = f"trainingjob-{job_name}-"
    last = previous.removeprefix(prefix) if previous and previous.startswith(prefix) else ""
    return f"{prefix}{int(last) + 1 if last.isdigit() else 0}"


def workload(job: TrainingJob, name: str, count: int, min_count: int,
             template: Mapping[str, Any]) -> dict[str, Any]:
    """The job's Kueue Workload: one pod set of `count` workers like `template` (a worker pod
    manifest), admissible from `min_count` (partial admission), in spec.scheduling.queue."""
    pod_set: dict[str, Any] = {"name": POD_SET, "count": count,
                               "template": pod_template(template)}
    if min_count < count:
        pod_set["minCount"] = min_count
    topology = job.spec.scheduling.topology
    if topology is not None:
        pod_set["topologyRequest"] = {topology.mode.lower(): topology.level}
    meta: dict[str, Any] = {"name": name,
                            "labels": {**MANAGED_BY, JOB_LABEL: job.metadata.name},
                            "ownerReferences": [owner_reference(job)]}
    if job.metadata.namespace:
        meta["namespace"] = job.metadata.namespace
    return {"apiVersion": KUEUE_WORKLOAD.api_version, "kind": KUEUE_WORKLOAD.kind,
            "metadata": meta,
            "spec": {"queueName": job.spec.scheduling.queue, "podSets": [pod_set]}}


def pod_template(pod: Mapping[str, Any]) -> dict[str, Any]:
    """A worker pod as a pod set's template: its labels and annotations, and the spec
    without what names one pod (hostname)."""
    meta = pod.get("metadata", {})
    spec = {key: value for key, value in pod.get("spec", {}).items() if key != "hostname"}
    template_meta = {key: dict(meta[key]) for key in ("labels", "annotations") if meta.get(key)}
    return {"metadata": template_meta, "spec": spec}


def pod_set_shape(manifest: Mapping[str, Any]) -> tuple[Any, ...]:
    """What must match between the Workload the job wants and the one it has: the pod set's
    count, minCount, topology request and queue. Kueue's pod sets are immutable once quota
    is reserved, so any difference is a new Workload (the job goes back to its queue)."""
    spec = manifest.get("spec", {})
    pod_sets = spec.get("podSets") or [{}]
    first = pod_sets[0]
    request = first.get("topologyRequest") or {}
    return (spec.get("queueName"), first.get("count"), first.get("minCount"),
            tuple(sorted(request.items())))


def pod_group_marks(job: TrainingJob, replicas: int) -> tuple[dict[str, str], dict[str, str]]:
    """Labels and annotations of a pod on the PodGroup path: Kueue's pod integration admits
    the job's pods as one group of `replicas`, placed within the topology level asked."""
    queue = job.metadata.labels[KUEUE_QUEUE_LABEL]
    labels = {KUEUE_QUEUE_LABEL: queue, GROUP_LABEL: job.metadata.name}
    annotations = {GROUP_COUNT_ANNOTATION: str(replicas)}
    topology = job.spec.scheduling.topology
    if topology is not None:
        key = REQUIRED_TOPOLOGY if topology.mode == "Required" else PREFERRED_TOPOLOGY
        annotations[key] = topology.level
    return labels, annotations


# --- what Kueue decided ---------------------------------------------------------------------


@dataclass(frozen=True)
class Flavor:
    """A ResourceFlavor: what a pod placed on it needs (its nodes' labels and taints)."""

    name: str
    node_labels: tuple[tuple[str, str], ...] = ()
    tolerations: tuple[Mapping[str, Any], ...] = ()


@dataclass(frozen=True)
class Admission:
    """Kueue's admission of the pod set: how many workers, on which flavors, where."""

    cluster_queue: str
    count: int
    flavors: tuple[str, ...] = ()
    # The topology assignment: the levels (node labels, highest first) and each domain's
    # values at those levels with its count of pods.
    levels: tuple[str, ...] = ()
    domains: tuple[tuple[tuple[str, ...], int], ...] = ()


def flavor(body: Mapping[str, Any]) -> Flavor:
    """A ResourceFlavor manifest, read: nodeLabels, and the tolerations its pods need (its
    own tolerations and its nodeTaints)."""
    spec = body.get("spec") or {}
    taints = [{"key": taint.get("key"), "operator": "Equal", "value": taint.get("value", ""),
               "effect": taint.get("effect")} for taint in spec.get("nodeTaints") or []]
    return Flavor(name=body.get("metadata", {}).get("name", ""),
                  node_labels=tuple(sorted((spec.get("nodeLabels") or {}).items())),
                  tolerations=tuple([*(spec.get("tolerations") or []), *taints]))


def admission(status: Mapping[str, Any]) -> Admission | None:
    """The admission a Workload's status records (None: no quota reserved)."""
    admitted = status.get("admission")
    if not admitted:
        return None
    assignments = admitted.get("podSetAssignments") or [{}]
    first = assignments[0]
    topology = first.get("topologyAssignment") or {}
    domains = tuple((tuple(domain.get("values") or ()), int(domain.get("count", 0)))
                    for domain in topology.get("domains") or [])
    return Admission(cluster_queue=admitted.get("clusterQueue", ""),
                     count=int(first.get("count", 0)),
                     flavors=tuple(sorted(set((first.get("flavors") or {}).values()))),
                     levels=tuple(topology.get("levels") or ()), domains=domains)


@dataclass(frozen=True)
class Placement:
    """Where the admitted workers go: every worker's node labels and tolerations, and each
    worker index's own node selector (its topology domain), in index order."""

    node_selector: dict[str, str]
    tolerations: list[dict[str, Any]]
    per_worker: list[dict[str, str]]


def placement(admitted: Admission, flavors: Mapping[str, Flavor]) -> Placement:
    """How the pods follow `admitted`: the flavors' node labels and tolerations, and the
    topology domains expanded to one per worker, sorted by their values so that workers of
    one domain (a rack within a block, a host within a rack) have adjacent indices."""
    selector: dict[str, str] = {}
    tolerations: list[dict[str, Any]] = []
    for name in admitted.flavors:
        known = flavors.get(name)
        if known is None:
            continue
        selector.update(dict(known.node_labels))
        tolerations += [dict(toleration) for toleration in known.tolerations
                        if dict(toleration) not in tolerations]
    per_worker = [dict(zip(admitted.levels, values, strict=True))
                  for values, count in sorted(admitted.domains) for _ in range(count)]
    return Placement(selector, tolerations, per_worker)


def missing_flavors(admitted: Admission, flavors: Mapping[str, Flavor]) -> list[str]:
    """The flavors of `admitted` the operator has not seen (its ResourceFlavor index lags)."""
    return [name for name in admitted.flavors if name not in flavors]


# --- the Workload's status: what the integration writes -----------------------------------


def _condition(kind: str, status: str, reason: str, message: str,
               now: datetime) -> dict[str, Any]:
    return {"type": kind, "status": status, "reason": reason, "message": message,
            "lastTransitionTime": now.strftime("%Y-%m-%dT%H:%M:%SZ")}


def _with(conditions: Sequence[Mapping[str, Any]],
          *changes: dict[str, Any]) -> list[dict[str, Any]]:
    """`conditions` with `changes` put in (replacing those of their types); a condition's
    transition time is kept when its status did not change."""
    result = [dict(condition) for condition in conditions]
    for change in changes:
        old = next((c for c in result if c.get("type") == change["type"]), None)
        if old is None:
            result.append(change)
            continue
        if old.get("status") == change["status"]:
            change = {**change, "lastTransitionTime": old.get("lastTransitionTime")}
        result[result.index(old)] = change
    return result


def finished_status(conditions: Sequence[Mapping[str, Any]], succeeded: bool,
                    message: str, now: datetime) -> dict[str, Any]:
    """The status patch that marks the Workload Finished, giving Kueue back its quota."""
    reason = "Succeeded" if succeeded else "Failed"
    return {"conditions": _with(conditions, _condition("Finished", "True", reason, message,
                                                       now))}


def released_status(conditions: Sequence[Mapping[str, Any]], message: str,
                    now: datetime) -> dict[str, Any]:
    """The status patch of an evicted Workload whose pods are gone: no quota reserved, not
    admitted, so Kueue may admit it again (jobframework's UnsetQuotaReservation)."""
    return {"admission": None, "conditions": _with(
        conditions, _condition("QuotaReserved", "False", "Pending", message, now),
        _condition("Admitted", "False", "NoReservation", "The workload has no reservation",
                   now))}
