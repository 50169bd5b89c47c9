"""What this operator process did to one TrainingJob that its watches may not show yet.

Kubernetes controllers call this "expectations": a pod just created is not in the
watch's index for a moment, a pod just deleted is still there, a ConfigMap just
rewritten still shows its old version, and the status just written comes back as
an event. `Expectations` remembers those writes and corrects the indexed picture
until the watch catches up (or, for a create or delete that never shows, until
`EXPECTATION_TIMEOUT_SECONDS` pass). After a restart the memory is empty and the
indexes are the truth again.

It holds no API client and reads no index: the controller (`handlers`) hands it
what the indexes show, and the applier (`applier`) tells it what it wrote.
Deciding what to do about the result is `reconcile`'s.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from kubetrain.api.trainingjob import TrainingJobStatus
from kubetrain.operator import children
from kubetrain.operator.facts import WorkerPod
from kubetrain.operator.scheduling_facts import GroupObject
from kubetrain.pod_conventions import COMPONENT_LABEL, LIGHTHOUSE_COMPONENT

# A placement object by (apiVersion, kind, name).
GroupKey = tuple[str, str, str]

# A create or delete the watch has not reported after this long is presumed lost.
EXPECTATION_TIMEOUT_SECONDS = 120.0


def job_identity(uid: str | None, namespace: str, name: str) -> str:
    """What this process remembers a job by: its uid (a job deleted and created again under
    the same name is another job), or, for a job without one, its namespace and name, so
    that two such jobs never share a memory. A uid has no slash."""
    return uid or f"{namespace}/{name}"

# What a ConfigMap was built from: (job generation, micro-batch size).
ConfigMapVersion = tuple[int, int | None]


def _annotated(annotations: Mapping[str, str], key: str) -> int | None:
    value = annotations.get(key, "")
    return int(value) if value.isdigit() else None


def config_map_version(annotations: Mapping[str, str]) -> ConfigMapVersion:
    """What the job's ConfigMap was built from, read from its annotations.

    The one reading of them: the ConfigMap index keeps this for what the cluster holds,
    and `held_version` for what this process wrote, and the two are compared for equality.
    """
    return (_annotated(annotations, children.GENERATION_ANNOTATION) or 0,
            _annotated(annotations, children.MICRO_BATCH_ANNOTATION))


# What `Expectations.children` remembers the lighthouse's Service by (the others: their kind).
LIGHTHOUSE_SERVICE = "LighthouseService"


def child_key(manifest: Mapping[str, Any]) -> str:
    """What a written child is remembered by: its kind (the job's Service, its ConfigMap),
    or LIGHTHOUSE_SERVICE for the lighthouse's Service."""
    labels = manifest["metadata"].get("labels") or {}
    if labels.get(COMPONENT_LABEL) == LIGHTHOUSE_COMPONENT:
        return LIGHTHOUSE_SERVICE
    return str(manifest["kind"])


def held_version(manifest: Mapping[str, Any]) -> ConfigMapVersion | int:
    """What a child was built from: the ConfigMap's `config_map_version`, 0 for the Service."""
    if manifest["kind"] != "ConfigMap":
        return 0
    return config_map_version(manifest["metadata"].get("annotations") or {})


@dataclass
class Expectations:
    """One job's writes by this process that its watches may not show yet.

    Written by the applier (one reconcile of a job at a time), read by the controller.
    `clock` is monotonic seconds; the timeout counts on it.
    """

    # The status as last written (with its observed generation): the job's own echo.
    status: dict[str, Any] | None = None
    # Pods created: name -> (the pod as created, when).
    created: dict[str, tuple[WorkerPod, float]] = field(default_factory=dict)
    # Pods deleted: name -> when.
    deleted: dict[str, float] = field(default_factory=dict)
    # Service, ConfigMap and the lighthouse's Service written: `child_key` ->
    # (`held_version`, when).
    children: dict[str, tuple[Any, float]] = field(default_factory=dict)
    # The API server's last refusal of a child, already reported as a FailedCreate event:
    # the same refusal comes back at each pass until someone changes something.
    refused: str = ""
    # Own code: the job's Secret <job>-status exists (created, or found created).
    status_secret: bool = False
    # Placement objects (a gang's group, a Kueue Workload) created and deleted, as pods.
    created_groups: dict[GroupKey, tuple[GroupObject, float]] = field(default_factory=dict)
    deleted_groups: dict[GroupKey, float] = field(default_factory=dict)
    clock: Callable[[], float] = time.monotonic

    # --- what the applier wrote ------------------------------------------------------

    def wrote_status(self, status: dict[str, Any]) -> None:
        """The job's status is now `status`."""
        self.status = status

    def created_pod(self, pod: WorkerPod) -> None:
        """`pod` was created (or was already there)."""
        self.created[pod.name] = (pod, self.clock())

    def deleted_pod(self, name: str) -> None:
        """The pod `name` was deleted (or was already gone)."""
        self.deleted[name] = self.clock()

    def created_group(self, group: GroupObject) -> None:
        """The placement object `group` was created (or was already there); a deletion of
        the same name just before (a renewed Workload) is over."""
        key = (group.api_version, group.kind, group.name)
        self.deleted_groups.pop(key, None)
        self.created_groups[key] = (group, self.clock())

    def deleted_group(self, key: GroupKey) -> None:
        """The placement object `key` was deleted (or was already gone)."""
        self.created_groups.pop(key, None)
        self.deleted_groups[key] = self.clock()

    def wrote_child(self, manifest: Mapping[str, Any]) -> None:
        """The Service, ConfigMap or lighthouse Service `manifest` was created or updated."""
        self.children[child_key(manifest)] = (held_version(manifest), self.clock())

    # --- the indexed picture, corrected ----------------------------------------------

    def pods(self, indexed: Mapping[str, WorkerPod], now: datetime) -> tuple[WorkerPod, ...]:
        """The job's pods: `indexed` (by name), with pods deleted marked deleting and pods
        created added (seen at `now`) until the index shows them, or the wait times out."""
        seen = dict(indexed)
        clock = self.clock()
        for name, since in list(self.deleted.items()):
            fresh = clock - since < EXPECTATION_TIMEOUT_SECONDS
            if name in seen and not seen[name].deleting and fresh:
                seen[name] = replace(seen[name], deleting=True)
            else:
                del self.deleted[name]
        for name, (pod, since) in list(self.created.items()):
            if name not in seen and clock - since < EXPECTATION_TIMEOUT_SECONDS:
                seen[name] = replace(pod, created_at=now)
            else:
                del self.created[name]
        return tuple(seen.values())

    def groups(self, indexed: Iterable[GroupObject]) -> tuple[GroupObject, ...]:
        """The job's placement objects: `indexed`, with those deleted marked deleting and
        those created added until the index shows them, or the wait times out."""
        seen = {(obj.api_version, obj.kind, obj.name): obj for obj in indexed}
        clock = self.clock()
        for key, since in list(self.deleted_groups.items()):
            if key in seen and not seen[key].deleting and \
                    clock - since < EXPECTATION_TIMEOUT_SECONDS:
                seen[key] = replace(seen[key], deleting=True)
            else:
                del self.deleted_groups[key]
        for key, (group, since) in list(self.created_groups.items()):
            if key not in seen and clock - since < EXPECTATION_TIMEOUT_SECONDS:
                seen[key] = group
            else:
                del self.created_groups[key]
        return tuple(seen.values())

    def held(self, service: bool,
             config_map: ConfigMapVersion | None) -> tuple[bool, ConfigMapVersion | None]:
        """Whether the Service is there and the ConfigMap's version (None: not there), as the
        indexes show them (`service`, `config_map`) or as last written until they agree."""
        indexed: dict[str, Any] = {"Service": 0 if service else None, "ConfigMap": config_map}
        self._correct(indexed)
        return indexed["Service"] is not None, indexed["ConfigMap"]

    def held_lighthouse_service(self, service: bool) -> bool:
        """Whether the lighthouse's Service is there, as the index shows it (`service`) or as
        created until they agree."""
        indexed: dict[str, Any] = {LIGHTHOUSE_SERVICE: 0 if service else None}
        self._correct(indexed)
        return indexed[LIGHTHOUSE_SERVICE] is not None

    def _correct(self, indexed: dict[str, Any]) -> None:
        """Replace the versions in `indexed` (by `child_key`) with those written, until the
        index shows them or the wait times out; the written ones of other keys are left."""
        clock = self.clock()
        for key, (version, since) in list(self.children.items()):
            if key not in indexed:
                continue
            if indexed[key] == version or clock - since >= EXPECTATION_TIMEOUT_SECONDS:
                del self.children[key]
            else:
                indexed[key] = version

    # --- echoes: events that bring no news -------------------------------------------

    def is_status_echo(self, job: Mapping[str, Any]) -> bool:
        """The job as this process last wrote its status, with the spec it last saw."""
        if self.status is None:
            return False
        # Parsed: the status patches leave out fields still at their defaults.
        status = TrainingJobStatus.model_validate(job.get("status") or {}).wire()
        return (status == self.status
                and status.get("observedGeneration") == job.get("metadata", {}).get("generation"))

    def is_created_echo(self, name: str, pod: Mapping[str, Any]) -> bool:
        """A pod this process created, seen for the first time and still Pending."""
        return (name in self.created
                and (pod.get("status") or {}).get("phase", "Pending") == "Pending")
