"""What the operator sees of a job's placement objects: its gang objects (Workload and
PodGroup, Volcano's or scheduler-plugins' PodGroup) and its Kueue Workload, reduced to the
facts `kubetrain.operator.scheduling` decides on. Pure translations, as `facts` is for pods.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kubetrain.operator import gang, kueue
from kubetrain.operator.kueue import Admission


@dataclass(frozen=True)
class GroupObject:
    """One gang object or Kueue Workload of a job, as observed."""

    api_version: str
    kind: str
    name: str
    # Workers the group needs at once (minCount, minMember); a Kueue Workload's pod set's
    # minCount, else its count.
    min_count: int | None = None
    deleting: bool = False
    # The object's spec as stored: what a patch of a mutable one is compared with.
    spec: Mapping[str, Any] = field(default_factory=dict, compare=False)
    # A Kueue Workload's status conditions (type -> the condition) and admission.
    conditions: tuple[Mapping[str, Any], ...] = field(default=(), compare=False)
    admission: Admission | None = None

    @property
    def api(self) -> tuple[str, str]:
        return self.api_version, self.kind

    def holds(self, kind: str) -> bool:
        """Whether the condition `kind` is True (a Kueue Workload's)."""
        return any(c.get("type") == kind and c.get("status") == "True"
                   for c in self.conditions)

    def message_of(self, kind: str) -> str:
        return next((str(c.get("message") or "") for c in self.conditions
                     if c.get("type") == kind), "")


def _min_count(api: tuple[str, str], spec: Mapping[str, Any]) -> int | None:
    if api == (gang.WORKLOAD_API.api_version, gang.WORKLOAD_API.kind):
        templates = spec.get("podGroupTemplates") or [{}]
        return templates[0].get("schedulingPolicy", {}).get("gang", {}).get("minCount")
    if api == (gang.WORKLOAD_POD_GROUP.api_version, gang.WORKLOAD_POD_GROUP.kind):
        return spec.get("schedulingPolicy", {}).get("gang", {}).get("minCount")
    if api == (kueue.KUEUE_WORKLOAD.api_version, kueue.KUEUE_WORKLOAD.kind):
        pod_set = (spec.get("podSets") or [{}])[0]
        value = pod_set.get("minCount", pod_set.get("count"))
        return int(value) if value is not None else None
    value = spec.get("minMember")
    return int(value) if value is not None else None


def group_object(body: Mapping[str, Any]) -> GroupObject:
    """The facts about one gang object or Kueue Workload manifest."""
    meta = body.get("metadata") or {}
    spec = body.get("spec") or {}
    status = body.get("status") or {}
    api = (body.get("apiVersion", ""), body.get("kind", ""))
    is_kueue = api == (kueue.KUEUE_WORKLOAD.api_version, kueue.KUEUE_WORKLOAD.kind)
    return GroupObject(
        api_version=api[0], kind=api[1], name=meta.get("name", ""),
        min_count=_min_count(api, spec), deleting=bool(meta.get("deletionTimestamp")),
        spec=dict(spec),
        conditions=tuple(status.get("conditions") or ()) if is_kueue else (),
        admission=kueue.admission(status) if is_kueue else None)
