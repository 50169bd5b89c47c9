"""The placement APIs the emulator can serve: Kubernetes' Workload API, Volcano's and
scheduler-plugins' PodGroups, and Kueue's Workload and ResourceFlavor.

Each kind is pinned to one published version and carries the part of its OpenAPI schema
that kubetrain writes or reads, so the emulator refuses (422) an object the real API server
would refuse for a wrong type, a missing required field or a field the kind does not have.
What it does as the real servers do: the group/version/kind, scope and subresources, the
types and required fields below. What it does not: defaulting, CEL or webhook validation,
immutability, and the fields kubetrain never touches (the schemas close each object they
describe; a real server would prune an unknown field instead of refusing it, which is the
louder failure a test wants).

Where each comes from. The machine these tests run on reaches no network, so the schemas
were written from the projects' published API types as of the pinned versions, not copied
from their CRD files; each entry names the source a reader can check them against:

- scheduling.k8s.io/v1alpha2 Workload and PodGroup: Kubernetes v1.36,
  k8s.io/api/scheduling/v1alpha2/types.go (KEP-4671 "Gang scheduling", KEP-5832 "Decouple
  PodGroup from Workload"). Alpha: the least certain of these; the field names kubetrain
  uses are the KEPs' (podGroupTemplates[].schedulingPolicy.gang.minCount, the PodGroup's
  podGroupTemplateRef, a pod's spec.schedulingGroup.podGroupName).
- scheduling.volcano.sh/v1beta1 PodGroup: Volcano v1.12, volcano.sh/apis
  pkg/apis/scheduling/v1beta1/types.go.
- scheduling.x-k8s.io/v1alpha1 PodGroup: scheduler-plugins v0.31.8,
  apis/scheduling/v1alpha1/types.go.
- kueue.x-k8s.io/v1beta1 Workload and ResourceFlavor: Kueue v0.13.4,
  apis/kueue/v1beta1/workload_types.go and resourceflavor_types.go.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

Schema = dict[str, Any]


def _object(properties: dict[str, Schema], required: tuple[str, ...] = (),
            closed: bool = True) -> Schema:
    schema: Schema = {"type": "object", "properties": properties}
    if required:
        schema["required"] = list(required)
    if closed:
        schema["additionalProperties"] = False
    return schema


STRING: Schema = {"type": "string"}
INT: Schema = {"type": "integer"}
FREE: Schema = {"type": "object"}  # preserved as given (a pod template, a status condition)
QUANTITIES: Schema = {"type": "object", "additionalProperties": {"type": ["integer", "string"]}}
CONDITIONS: Schema = {"type": "array", "items": FREE}


def _resource(spec: Schema, status: Schema | None = None) -> Schema:
    properties = {"apiVersion": STRING, "kind": STRING, "metadata": FREE, "spec": spec}
    if status is not None:
        properties["status"] = status
    return _object(properties, ("spec",))


_GANG_POLICY = _object({"basic": FREE, "gang": _object({"minCount": {**INT, "minimum": 1}},
                                                       ("minCount",))})

WORKLOAD_API_WORKLOAD = _resource(_object({
    "controllerRef": _object({"apiGroup": STRING, "kind": STRING, "name": STRING},
                             ("kind", "name")),
    "podGroupTemplates": {"type": "array", "minItems": 1, "maxItems": 8, "items": _object(
        {"name": STRING, "schedulingPolicy": _GANG_POLICY}, ("name", "schedulingPolicy"))},
}, ("podGroupTemplates",)))

WORKLOAD_API_POD_GROUP = _resource(_object({
    "podGroupTemplateRef": _object({"workloadName": STRING, "podGroupTemplateName": STRING},
                                   ("workloadName", "podGroupTemplateName")),
    "schedulingPolicy": _GANG_POLICY,
}, ("schedulingPolicy",)), _object({"conditions": CONDITIONS}))

VOLCANO_POD_GROUP = _resource(_object({
    "minMember": {**INT, "minimum": 0},
    "minTaskMember": {"type": "object", "additionalProperties": INT},
    "minResources": QUANTITIES,
    "queue": STRING,
    "priorityClassName": STRING,
    "networkTopology": FREE,
}), _object({"phase": STRING, "conditions": CONDITIONS, "running": INT, "succeeded": INT,
             "failed": INT}))

COSCHEDULING_POD_GROUP = _resource(_object({
    "minMember": {**INT, "minimum": 1},
    "minResources": QUANTITIES,
    "scheduleTimeoutSeconds": {**INT, "minimum": 1},
}), _object({"phase": STRING, "occupiedBy": STRING, "scheduled": INT, "running": INT,
             "succeeded": INT, "failed": INT, "scheduleStartTime": STRING}))

_TOPOLOGY_ASSIGNMENT = _object({
    "levels": {"type": "array", "items": STRING},
    "domains": {"type": "array", "items": _object({
        "values": {"type": "array", "items": STRING}, "count": {**INT, "minimum": 1}},
        ("values", "count"))},
}, ("levels", "domains"))

KUEUE_WORKLOAD = _resource(_object({
    "queueName": STRING,
    "priorityClassName": STRING,
    "priority": INT,
    "active": {"type": "boolean"},
    "podSets": {"type": "array", "minItems": 1, "maxItems": 8, "items": _object({
        "name": STRING,
        "count": {**INT, "minimum": 0},
        "minCount": {**INT, "minimum": 1},
        "template": FREE,
        "topologyRequest": _object({"required": STRING, "preferred": STRING,
                                    "unconstrained": {"type": "boolean"}}),
    }, ("name", "count", "template"))},
}, ("podSets",)), _object({
    "conditions": CONDITIONS,
    "admission": {"type": ["object", "null"], "properties": {
        "clusterQueue": STRING,
        "podSetAssignments": {"type": "array", "items": _object({
            "name": STRING, "flavors": {"type": "object", "additionalProperties": STRING},
            "resourceUsage": QUANTITIES, "count": INT,
            "topologyAssignment": _TOPOLOGY_ASSIGNMENT}, ("name",))}},
        "required": ["clusterQueue", "podSetAssignments"], "additionalProperties": False},
}))

KUEUE_RESOURCE_FLAVOR = _resource(_object({
    "nodeLabels": {"type": "object", "additionalProperties": STRING},
    "nodeTaints": {"type": "array", "items": FREE},
    "tolerations": {"type": "array", "items": FREE},
    "topologyName": STRING,
}))


@dataclass(frozen=True)
class PlacementApi:
    """One kind the emulator serves, with its pinned version's schema and its source."""

    group: str
    version: str
    plural: str
    kind: str
    schema: Schema
    source: str
    namespaced: bool = True
    status: bool = True

    @property
    def resource(self) -> str:
        """The emulator's key: group/version/plural."""
        return f"{self.group}/{self.version}/{self.plural}"


KUBERNETES = "Kubernetes v1.36 k8s.io/api/scheduling/v1alpha2/types.go"
WORKLOAD_API = (
    PlacementApi("scheduling.k8s.io", "v1alpha2", "workloads", "Workload",
                 WORKLOAD_API_WORKLOAD, KUBERNETES, status=False),
    PlacementApi("scheduling.k8s.io", "v1alpha2", "podgroups", "PodGroup",
                 WORKLOAD_API_POD_GROUP, KUBERNETES),
)
VOLCANO = (PlacementApi("scheduling.volcano.sh", "v1beta1", "podgroups", "PodGroup",
                        VOLCANO_POD_GROUP,
                        "Volcano v1.12 volcano.sh/apis pkg/apis/scheduling/v1beta1"),)
COSCHEDULING = (PlacementApi("scheduling.x-k8s.io", "v1alpha1", "podgroups", "PodGroup",
                             COSCHEDULING_POD_GROUP,
                             "scheduler-plugins v0.31.8 apis/scheduling/v1alpha1"),)
KUEUE = (
    PlacementApi("kueue.x-k8s.io", "v1beta1", "workloads", "Workload", KUEUE_WORKLOAD,
                 "Kueue v0.13.4 apis/kueue/v1beta1/workload_types.go"),
    PlacementApi("kueue.x-k8s.io", "v1beta1", "resourceflavors", "ResourceFlavor",
                 KUEUE_RESOURCE_FLAVOR, "Kueue v0.13.4 apis/kueue/v1beta1/"
                 "resourceflavor_types.go", namespaced=False, status=False),
)
EVERY_PLACEMENT_API = (*WORKLOAD_API, *VOLCANO, *COSCHEDULING, *KUEUE)
