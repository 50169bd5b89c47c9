"""Carry out what `reconcile` decided for one TrainingJob: the API writes and the counts.

`ActionApplier.apply` turns each action into its Kubernetes write (create, patch,
delete, event) or its operator metric, in order, stopping at the first API error
(the next pass decides again). It tells the job's `Expectations` what it wrote, so
the next observation sees it before the watches do, and keeps the jobs-by-phase
gauge from the statuses it wrote.

It decides nothing and reads nothing from the cluster; which actions to take is
`reconcile`'s, and when to take them the controller's (`handlers`).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from kubernetes.client.exceptions import ApiException

from kubetrain.operator.actions import (
    Action,
    CountFailure,
    CountQuorumChange,
    CountRestart,
    CreateObject,
    CreateStatusSecret,
    DeleteJob,
    DeleteObject,
    DeletePod,
    PatchObject,
    ReconcileAt,
    RecordEvent,
    UpdateConfigMap,
    WriteStatus,
)
from kubetrain.operator.expectations import Expectations, job_identity
from kubetrain.operator.facts import worker_pod
from kubetrain.operator.metrics import OperatorMetrics
from kubetrain.operator.scheduling_facts import group_object
from kubetrain.operator.writer import ApiWriter

# The API server refuses longer event messages.
EVENT_MESSAGE_LIMIT = 1024

# Statuses with which the API server refuses an object itself (validation, admission,
# authorisation): retrying the same object cannot succeed until someone changes something.
REFUSED_STATUSES = frozenset({400, 403, 422})

_log = logging.getLogger(__name__)


def server_message(error: ApiException) -> str:
    """The API server's own explanation in an error response, else its reason."""
    try:
        return str(json.loads(error.body or "")["message"])
    except (TypeError, ValueError, KeyError):
        return str(error.reason)


class ActionApplier:
    """The API writes and metric counts of one operator process, from any thread.

    Events it records name `component` (the operator) and `instance` (this replica) as
    their source, as `kubectl describe` shows them.
    """

    def __init__(self, writer: ApiWriter, metrics: OperatorMetrics, component: str,
                 instance: str) -> None:
        self.writer = writer
        self.metrics = metrics
        self.component = component
        self.instance = instance
        self._phases: dict[str, str] = {}  # by job_identity, for the jobs-by-phase gauge
        self._phases_lock = threading.Lock()

    def apply(self, body: Mapping[str, Any], expected: Expectations,
              actions: list[Action]) -> None:
        """Carry out the actions in order; stop at the first API error (the timer retries)."""
        meta = body["metadata"]
        namespace, name = meta.get("namespace", ""), meta["name"]
        for action in actions:
            try:
                self._apply_one(namespace, name, body, expected, action)
            except ApiException as error:
                self.metrics.api_errors.inc()
                message = server_message(error)
                _log.warning("%s/%s: %s failed: %s %s: %s", namespace, name,
                             type(action).__name__, error.status, error.reason, message)
                if isinstance(action, CreateObject) and error.status in REFUSED_STATUSES:
                    self._report_refusal(namespace, body, expected, action, message)
                return

    def job_gone(self, uid: str, namespace: str, name: str) -> None:
        """Drop a deleted job from the gauges that follow jobs."""
        self._count_phase(job_identity(uid, namespace, name), None)
        self.metrics.show_job_status(namespace, name, None)

    def _count_phase(self, job: str, phase: str | None) -> None:
        """Set (None: drop) the job's phase and recount the jobs gauge from a copy.

        Executor threads write phases while others count them: the table changes only under
        the lock, and the gauge is set from it under the lock too, so the last count set is
        the latest table's.
        """
        with self._phases_lock:
            if phase is None:
                self._phases.pop(job, None)
            else:
                self._phases[job] = phase
            self.metrics.count_phases(dict(self._phases))

    def _report_refusal(self, namespace: str, body: Mapping[str, Any], expected: Expectations,
                        action: CreateObject, message: str) -> None:
        """Tell the user, once per distinct message, why the server refuses a child.

        A pod refused by admission (a missing PriorityClass or ServiceAccount, a quota)
        would otherwise leave the job Pending with the reason only in the operator's log:
        it goes to a Warning event on the job, as a ReplicaSet reports FailedCreate.
        """
        text = f"{action.manifest['kind']} {action.manifest['metadata']['name']}: {message}"
        if expected.refused == text:
            return
        expected.refused = text
        event = RecordEvent("Warning", "FailedCreate", text)
        try:
            self.writer.create(namespace, self._event(body, event))
        except ApiException as error:
            _log.warning("event FailedCreate not recorded: %s", server_message(error))

    def _apply_one(self, namespace: str, name: str, body: Mapping[str, Any],
                   expected: Expectations, action: Action) -> None:
        if isinstance(action, WriteStatus):
            self.writer.patch_job_status(namespace, name, action.patch)
            expected.wrote_status(action.status)
            self.metrics.show_job_status(namespace, name, action.status)
            phase = action.status.get("phase")
            if phase:
                self._count_phase(job_identity(body["metadata"].get("uid"), namespace, name),
                                  phase)
        elif isinstance(action, CreateObject):
            self._create(namespace, expected, action.manifest)
        elif isinstance(action, CreateStatusSecret):
            try:
                self.writer.create(namespace, action.manifest)
            except ApiException as error:
                if error.status != 409:  # already there: made before an operator restart
                    raise
            expected.status_secret = True
        elif isinstance(action, UpdateConfigMap):
            meta = action.manifest["metadata"]
            self.writer.patch_config_map(namespace, meta["name"], {
                "metadata": {"annotations": meta["annotations"]}, "data": action.manifest["data"]})
            expected.wrote_child(action.manifest)
        elif isinstance(action, DeletePod):
            self._delete_pod(namespace, expected, action)
        elif isinstance(action, DeleteJob):
            self.writer.delete_job(namespace, name)
        elif isinstance(action, PatchObject):
            try:
                self.writer.patch_object(namespace, action.api_version, action.kind,
                                         action.name, action.patch, status=action.status)
            except ApiException as error:
                if error.status != 404:  # gone meanwhile (its job deleted): nothing to do
                    raise
        elif isinstance(action, DeleteObject):
            try:
                self.writer.delete_object(namespace, action.api_version, action.kind,
                                          action.name)
            except ApiException as error:
                if error.status != 404:  # already gone
                    raise
            expected.deleted_group((action.api_version, action.kind, action.name))
        elif isinstance(action, RecordEvent):
            self.writer.create(namespace, self._event(body, action))
        elif isinstance(action, CountRestart):
            self.metrics.group_restarts.labels(action.reason).inc()
            if action.hang:
                self.metrics.hang_restarts.inc()
        elif isinstance(action, CountFailure):
            self.metrics.worker_failures.labels(action.failure_class).inc()
        elif isinstance(action, CountQuorumChange):
            self.metrics.quorum_changes.labels("shrank" if action.shrank else "grew").inc()
        elif isinstance(action, ReconcileAt):
            pass  # no API call: the handlers schedule the pass (`_wake_when_asked`)

    def _event(self, job: Mapping[str, Any], action: RecordEvent) -> dict[str, Any]:
        """A core/v1 Event about the job (what `kubectl describe tj` lists)."""
        meta = job["metadata"]
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        return {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta.get("namespace")},
            "involvedObject": {"apiVersion": job.get("apiVersion"), "kind": job.get("kind"),
                               "name": meta["name"], "namespace": meta.get("namespace"),
                               "uid": meta.get("uid")},
            "type": action.type, "reason": action.reason,
            "message": action.message[:EVENT_MESSAGE_LIMIT],
            "source": {"component": self.component}, "reportingComponent": self.component,
            "reportingInstance": self.instance,
            "firstTimestamp": now, "lastTimestamp": now, "count": 1,
        }

    def _create(self, namespace: str, expected: Expectations,
                manifest: dict[str, Any]) -> None:
        kind = manifest["kind"]
        try:
            self.writer.create(namespace, manifest)
            if kind == "Pod":
                self.metrics.pods_created.inc()
        except ApiException as error:
            if error.status != 409:  # already there: created before a restart, or by a peer
                raise
        if kind == "Pod":
            expected.created_pod(worker_pod(manifest))
        elif manifest["apiVersion"] == "v1":
            expected.wrote_child(manifest)
        else:  # a placement object: a gang's group, a Kueue Workload
            expected.created_group(group_object(manifest))

    def _delete_pod(self, namespace: str, expected: Expectations, action: DeletePod) -> None:
        try:
            self.writer.delete_pod(namespace, action.name, action.grace_period_seconds)
            self.metrics.pods_deleted.inc()
        except ApiException as error:
            if error.status != 404:  # already gone
                raise
        expected.deleted_pod(action.name)
