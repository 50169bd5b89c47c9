"""Gang placement's objects: one builder per mechanism, behind one choice (pure).

A gang keeps a scheduler from placing some of a job's workers and not the others: it
binds a group's pods together once `minCount` of them fit, or none. Each mechanism is a
group object that exists before the pods, and a mark on each pod naming its group:

- WorkloadAPI: a `Workload` (the template, `podGroupTemplates[].schedulingPolicy.gang.
  minCount`) and a runtime `PodGroup` that refers to it, scheduling.k8s.io/v1alpha2
  (Kubernetes 1.36, feature gates GenericWorkload and GangScheduling); each pod names its
  group in `spec.schedulingGroup.podGroupName`.
- Volcano: a `PodGroup` of scheduling.volcano.sh/v1beta1 (`minMember`, `minResources`,
  `queue`); each pod has the annotation `scheduling.k8s.io/group-name` and runs on the
  volcano scheduler.
- Coscheduling: a `PodGroup` of scheduling.x-k8s.io/v1alpha1, scheduler-plugins'
  (`minMember`, `minResources`, `scheduleTimeoutSeconds`); each pod has the label
  `scheduling.x-k8s.io/pod-group` and runs on scheduler-plugins' scheduler.

`choose` resolves spec.scheduling.gang (Auto from the APIs the cluster serves, never
changing the pods' scheduler); `group_objects` builds what a mechanism needs; `membership`
is what each pod carries. When to create, patch, renew or delete them is
`kubetrain.operator.scheduling`'s; the API shapes and where they come from are
docs/scheduling.md's and tests/cluster/scheduling_apis.py's.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from kubetrain.api.scheduling import VOLCANO_SCHEDULER, ChosenGang
from kubetrain.api.trainingjob import GROUP, KIND, TrainingJob
from kubetrain.memory_budget import format_quantity, parse_quantity
from kubetrain.operator.children import MANAGED_BY, owner_reference
from kubetrain.pod_conventions import JOB_LABEL


@dataclass(frozen=True)
class Api:
    """One kind of object in the API: group/version, plural and kind."""

    api_version: str
    plural: str
    kind: str

    @property
    def group(self) -> str:
        return self.api_version.split("/", 1)[0]

    @property
    def version(self) -> str:
        return self.api_version.split("/", 1)[1]


WORKLOAD_API: Final = Api("scheduling.k8s.io/v1alpha2", "workloads", "Workload")
WORKLOAD_POD_GROUP: Final = Api("scheduling.k8s.io/v1alpha2", "podgroups", "PodGroup")
VOLCANO_POD_GROUP: Final = Api("scheduling.volcano.sh/v1beta1", "podgroups", "PodGroup")
COSCHEDULING_POD_GROUP: Final = Api("scheduling.x-k8s.io/v1alpha1", "podgroups", "PodGroup")
# The kinds each mechanism makes: the cluster serves a mechanism when it serves them all.
MECHANISM_APIS: Final[dict[str, tuple[Api, ...]]] = {
    "WorkloadAPI": (WORKLOAD_API, WORKLOAD_POD_GROUP),
    "Volcano": (VOLCANO_POD_GROUP,),
    "Coscheduling": (COSCHEDULING_POD_GROUP,),
}
GANG_APIS: Final = (WORKLOAD_API, WORKLOAD_POD_GROUP, VOLCANO_POD_GROUP,
                    COSCHEDULING_POD_GROUP)

# The pod marks that name the group.
VOLCANO_GROUP_ANNOTATION: Final = "scheduling.k8s.io/group-name"
COSCHEDULING_GROUP_LABEL: Final = "scheduling.x-k8s.io/pod-group"
# scheduler-plugins' scheduler as its chart installs it beside kube-scheduler.
COSCHEDULING_SCHEDULER: Final = "scheduler-plugins-scheduler"
DEFAULT_SCHEDULER: Final = "default-scheduler"
# The Workload's one pod group template: the workers.
TEMPLATE_NAME: Final = "workers"


def served_mechanisms(group_versions: Collection[str]) -> frozenset[str]:
    """The gang mechanisms whose API group/versions (`group/version` strings, what the
    API server's discovery lists) the cluster serves."""
    return frozenset(name for name, apis in MECHANISM_APIS.items()
                     if all(api.api_version in group_versions for api in apis))


def choose(gang: str, scheduler_name: str | None,
           served: Collection[str]) -> tuple[ChosenGang, str]:
    """The mechanism for spec.scheduling.gang `gang` and why. Auto picks only what the pods'
    scheduler (`scheduler_name`) reads, from the mechanisms the cluster serves."""
    if gang != "Auto":
        chosen: ChosenGang = gang  # type: ignore[assignment]  # the API's literals
        return chosen, f"spec.scheduling.gang is {gang}"
    scheduler = scheduler_name or DEFAULT_SCHEDULER
    wanted: dict[str, ChosenGang] = {DEFAULT_SCHEDULER: "WorkloadAPI",
                                     VOLCANO_SCHEDULER: "Volcano",
                                     COSCHEDULING_SCHEDULER: "Coscheduling"}
    candidate = wanted.get(scheduler)
    if candidate is not None and candidate in served:
        apis = ", ".join(sorted({api.api_version for api in MECHANISM_APIS[candidate]}))
        return candidate, f"Auto: the cluster serves {apis} and the pods run on {scheduler}"
    offered = ", ".join(sorted(served)) or "none"
    return "None", (f"Auto: no gang API that {scheduler} reads is served (gang APIs served: "
                    f"{offered}); the pods are placed one by one")


def pod_requests(pod: Mapping[str, Any]) -> dict[str, int]:
    """What a pod manifest requests, by resource, summed over its containers, in the smallest
    unit (millicores for cpu, bytes for memory): requests, else limits, as Kubernetes
    defaults a request from a limit."""
    total: dict[str, int] = {}
    for container in pod.get("spec", {}).get("containers", []):
        resources = container.get("resources") or {}
        merged = {**(resources.get("limits") or {}), **(resources.get("requests") or {})}
        for name, value in merged.items():
            total[name] = total.get(name, 0) + quantity(name, value)
    return total


def quantity(resource: str, value: int | str) -> int:
    """A Kubernetes quantity of `resource` in its smallest unit: cpu in millicores, the rest
    as whole numbers (bytes for memory)."""
    text = str(value).strip()
    if resource == "cpu":
        return int(float(text[:-1])) if text.endswith("m") else int(float(text) * 1000)
    return parse_quantity(text)


def format_amount(resource: str, amount: int) -> str:
    """`quantity`'s inverse, as the operator writes it: millicores, Mi of memory, counts."""
    if resource == "cpu":
        return f"{amount}m"
    if resource in ("memory", "ephemeral-storage"):
        return format_quantity(amount)
    return str(amount)


def min_resources(per_pod: Mapping[str, int], min_count: int) -> dict[str, str]:
    """minResources of a PodGroup: what `min_count` workers of `per_pod` request together."""
    return {name: format_amount(name, amount * min_count)
            for name, amount in sorted(per_pod.items())}


def _metadata(job: TrainingJob, name: str) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name,
                            "labels": {**MANAGED_BY, JOB_LABEL: job.metadata.name},
                            "ownerReferences": [owner_reference(job)]}
    if job.metadata.namespace:
        meta["namespace"] = job.metadata.namespace
    return meta


def workload_api_workload(job: TrainingJob, min_count: int) -> dict[str, Any]:
    """The Workload (scheduling.k8s.io/v1alpha2): the gang's template, named after the job."""
    return {
        "apiVersion": WORKLOAD_API.api_version, "kind": WORKLOAD_API.kind,
        "metadata": _metadata(job, job.metadata.name),
        "spec": {
            "controllerRef": {"apiGroup": GROUP, "kind": KIND, "name": job.metadata.name},
            "podGroupTemplates": [{"name": TEMPLATE_NAME, "schedulingPolicy": {
                "gang": {"minCount": min_count}}}],
        },
    }


def workload_api_pod_group(job: TrainingJob, name: str, min_count: int) -> dict[str, Any]:
    """The runtime PodGroup (scheduling.k8s.io/v1alpha2) of the job's Workload."""
    return {
        "apiVersion": WORKLOAD_POD_GROUP.api_version, "kind": WORKLOAD_POD_GROUP.kind,
        "metadata": _metadata(job, name),
        "spec": {
            "podGroupTemplateRef": {"workloadName": job.metadata.name,
                                    "podGroupTemplateName": TEMPLATE_NAME},
            "schedulingPolicy": {"gang": {"minCount": min_count}},
        },
    }


def volcano_pod_group(job: TrainingJob, name: str, min_count: int,
                      per_pod: Mapping[str, int]) -> dict[str, Any]:
    """Volcano's PodGroup: minMember workers, their minResources, in spec.scheduling's queue."""
    spec: dict[str, Any] = {"minMember": min_count}
    resources = min_resources(per_pod, min_count)
    if resources:
        spec["minResources"] = resources
    if job.spec.scheduling.volcano_queue:
        spec["queue"] = job.spec.scheduling.volcano_queue
    if job.spec.workers.template.priority_class_name:
        spec["priorityClassName"] = job.spec.workers.template.priority_class_name
    return {"apiVersion": VOLCANO_POD_GROUP.api_version, "kind": VOLCANO_POD_GROUP.kind,
            "metadata": _metadata(job, name), "spec": spec}


def coscheduling_pod_group(job: TrainingJob, name: str, min_count: int,
                           per_pod: Mapping[str, int]) -> dict[str, Any]:
    """scheduler-plugins' PodGroup: minMember workers, their minResources, its timeout."""
    spec: dict[str, Any] = {"minMember": min_count}
    resources = min_resources(per_pod, min_count)
    if resources:
        spec["minResources"] = resources
    if job.spec.scheduling.schedule_timeout_seconds is not None:
        spec["scheduleTimeoutSeconds"] = job.spec.scheduling.schedule_timeout_seconds
    return {"apiVersion": COSCHEDULING_POD_GROUP.api_version,
            "kind": COSCHEDULING_POD_GROUP.kind, "metadata": _metadata(job, name),
            "spec": spec}


def group_objects(job: TrainingJob, mechanism: str, group: str, min_count: int,
                  per_pod: Mapping[str, int]) -> list[dict[str, Any]]:
    """Every object `mechanism` needs for a group named `group` of `min_count` workers that
    each request `per_pod` (`pod_requests`), in the order they must be created (a Workload
    before its PodGroup)."""
    if mechanism == "WorkloadAPI":
        return [workload_api_workload(job, min_count),
                workload_api_pod_group(job, group, min_count)]
    if mechanism == "Volcano":
        return [volcano_pod_group(job, group, min_count, per_pod)]
    if mechanism == "Coscheduling":
        return [coscheduling_pod_group(job, group, min_count, per_pod)]
    return []


def mutable_spec(manifest: Mapping[str, Any]) -> dict[str, Any] | None:
    """What of a group object's spec may change in place (a merge patch's `spec`), None
    where nothing may: a v1alpha2 Workload's or PodGroup's spec is immutable (1.37's beta
    makes minCount mutable), Volcano's and scheduler-plugins' PodGroups take new values."""
    if manifest["apiVersion"] == WORKLOAD_API.api_version:
        return None
    return dict(manifest["spec"])


@dataclass(frozen=True)
class Membership:
    """What a pod carries to join its group."""

    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)
    spec: dict[str, Any] = field(default_factory=dict)


def membership(job: TrainingJob, mechanism: str, group: str) -> Membership:
    """How a worker pod names group `group` of `mechanism`, and the scheduler that reads it
    (the pod template's schedulerName wins where it names one)."""
    chosen = job.spec.workers.template.scheduler_name
    if mechanism == "WorkloadAPI":
        return Membership(spec={"schedulingGroup": {"podGroupName": group}})
    if mechanism == "Volcano":
        return Membership(annotations={VOLCANO_GROUP_ANNOTATION: group},
                          spec={"schedulerName": chosen or VOLCANO_SCHEDULER})
    if mechanism == "Coscheduling":
        return Membership(labels={COSCHEDULING_GROUP_LABEL: group},
                          spec={"schedulerName": chosen or COSCHEDULING_SCHEDULER})
    return Membership()
