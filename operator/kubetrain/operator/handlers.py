"""The thin kopf layer: observe TrainingJobs and their children, reconcile, apply.

What is observed comes from kopf indexes (in-memory views kept current by watches),
so a reconcile costs no API reads: only the creates, deletes and status patches
that `reconcile` decided. A reconcile of a job runs on its own events, on its pods'
events and on a timer (which also scrapes rank 0's /metrics).

Two facts a watch reports late are bridged in memory per job, as Kubernetes
controllers do ("expectations"): pods this operator just created or deleted, and
the status it just wrote. After a restart the memory is empty and the indexes,
filled before any handler runs, are the truth again.
"""

from __future__ import annotations

import logging
import threading
import time
import urllib.request
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

import kopf
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from kubetrain.operator import children
from kubetrain.operator.command import OperatorConfig
from kubetrain.operator.metrics import OperatorMetrics
from kubetrain.operator.observed import Observed, WorkerPod, metrics_sample, worker_pod
from kubetrain.operator.reconcile import (
    Action,
    CountRestart,
    CreateObject,
    DeleteJob,
    DeletePod,
    RecordEvent,
    WriteStatus,
    reconcile,
    reject,
)

from kubetrain.api.manifest import InvalidManifest, parse_job
from kubetrain.api.trainingjob import GROUP, PLURAL, VERSION

USER_AGENT = "kubetrain-operator"
# A create or delete the watch has not reported after this long is presumed lost.
EXPECTATION_TIMEOUT_SECONDS = 120.0

JobKey = tuple[str, str]  # (namespace, name)


@dataclass
class JobMemory:
    """What this process did to one job that its watches may not show yet."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    status: dict[str, Any] | None = None
    created: dict[str, tuple[WorkerPod, float]] = field(default_factory=dict)
    deleted: dict[str, float] = field(default_factory=dict)
    children: dict[str, float] = field(default_factory=dict)  # Service, ConfigMap created


def _snapshot(index: kopf.Index, key: Any) -> list[Any]:
    """The values under `key`, copied: kopf updates indexes on its loop while handlers read."""
    while True:
        try:
            return list(index.get(key, []))
        except RuntimeError:  # changed size during iteration: read again
            continue


def _now() -> datetime:
    # Kubernetes times have whole seconds; so do the operator's decisions.
    return datetime.now(UTC).replace(microsecond=0)


class TrainingJobController:
    """The kopf handlers of one operator, with its API clients, memory and metrics."""

    def __init__(self, config: OperatorConfig, api: client.ApiClient) -> None:
        self.config = config
        self.core = client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.metrics = OperatorMetrics()
        self.memory: dict[str, JobMemory] = {}  # by job uid
        self.phases: dict[str, str] = {}  # by job uid, for the jobs-by-phase gauge
        self._memory_lock = threading.Lock()

    def register(self, registry: kopf.OperatorRegistry) -> None:
        """Attach the handlers to a kopf registry."""
        job = (GROUP, VERSION, PLURAL)
        owned = {children.JOB_LABEL: kopf.PRESENT}
        kopf.index(*job, id="tj_jobs", registry=registry)(self.index_job)
        kopf.index("v1", "pods", id="tj_pods", labels=owned, registry=registry)(self.index_pod)
        kopf.index("v1", "services", id="tj_services", labels=owned,
                   registry=registry)(self.index_child)
        kopf.index("v1", "configmaps", id="tj_configmaps", labels=owned,
                   registry=registry)(self.index_child)
        kopf.index("v1", "nodes", id="tj_nodes", registry=registry)(self.index_node)
        kopf.on.event(*job, registry=registry)(self.on_job_event)
        kopf.on.event("v1", "pods", labels=owned, registry=registry)(self.on_pod_event)
        kopf.timer(*job, interval=self.config.resync_seconds, registry=registry)(self.on_timer)

    # --- indexes: what is observed --------------------------------------------------

    @staticmethod
    def index_job(namespace: str, name: str, body: kopf.Body, **_: Any) -> dict[JobKey, Any]:
        return {(namespace, name): dict(body)}

    @staticmethod
    def index_pod(namespace: str, labels: kopf.Labels, body: kopf.Body,
                  **_: Any) -> dict[JobKey, Any]:
        return {(namespace, labels[children.JOB_LABEL]): dict(body)}

    @staticmethod
    def index_child(namespace: str, labels: kopf.Labels, body: kopf.Body,
                    **_: Any) -> dict[JobKey, str]:
        return {(namespace, labels[children.JOB_LABEL]): body["kind"]}

    @staticmethod
    def index_node(name: str, **_: Any) -> dict[str, bool]:
        return {name: True}

    # --- triggers -------------------------------------------------------------------

    def on_job_event(self, type: str | None, body: kopf.Body, uid: str, tj_pods: kopf.Index,
                     tj_services: kopf.Index, tj_configmaps: kopf.Index, tj_nodes: kopf.Index,
                     **_: Any) -> None:
        if type == "DELETED":
            with self._memory_lock:
                self.memory.pop(uid, None)
                self.phases.pop(uid, None)
            self.metrics.count_phases(self.phases)
            return
        if body.get("metadata", {}).get("deletionTimestamp"):
            return
        self.reconcile(dict(body), tj_pods, tj_services, tj_configmaps, tj_nodes)

    def on_pod_event(self, namespace: str, labels: kopf.Labels, tj_jobs: kopf.Index,
                     tj_pods: kopf.Index, tj_services: kopf.Index, tj_configmaps: kopf.Index,
                     tj_nodes: kopf.Index, **_: Any) -> None:
        for job in _snapshot(tj_jobs, (namespace, labels[children.JOB_LABEL])):
            self.reconcile(job, tj_pods, tj_services, tj_configmaps, tj_nodes)

    def on_timer(self, body: kopf.Body, tj_pods: kopf.Index, tj_services: kopf.Index,
                 tj_configmaps: kopf.Index, tj_nodes: kopf.Index, **_: Any) -> None:
        self.reconcile(dict(body), tj_pods, tj_services, tj_configmaps, tj_nodes, scrape=True)

    # --- observe, decide, apply -----------------------------------------------------

    def _memory(self, uid: str) -> JobMemory:
        with self._memory_lock:
            return self.memory.setdefault(uid, JobMemory())

    def reconcile(self, body: dict[str, Any], pods: kopf.Index, services: kopf.Index,
                  config_maps: kopf.Index, nodes: kopf.Index, *, scrape: bool = False) -> None:
        """One level-based pass over one job; safe to run any number of times."""
        meta = body.get("metadata", {})
        key = (meta.get("namespace", ""), meta.get("name", ""))
        memory = self._memory(meta.get("uid", ""))
        with memory.lock, self.metrics.reconcile_duration.time():
            now = _now()
            if memory.status is not None:
                body = {**body, "status": memory.status}
            try:
                job = parse_job(body)
            except InvalidManifest as error:
                actions = reject(body.get("status"), meta.get("generation"), str(error), now)
            else:
                observed = self.observe(key, memory, pods, services, config_maps, nodes, now)
                if scrape:
                    observed = replace(observed, metrics=self.scrape(
                        observed.pods, job.spec.metrics.port))
                actions = reconcile(job, observed, now)
            self.apply(body, memory, actions)

    def observe(self, key: JobKey, memory: JobMemory, pods: kopf.Index, services: kopf.Index,
                config_maps: kopf.Index, nodes: kopf.Index, now: datetime) -> Observed:
        """The job's children as the indexes show them, corrected by this process's own writes."""
        seen = {pod.name: pod for pod in (worker_pod(raw, nodes) for raw in _snapshot(pods, key))}
        clock = time.monotonic()
        for name, since in list(memory.deleted.items()):
            fresh = clock - since < EXPECTATION_TIMEOUT_SECONDS
            if name in seen and not seen[name].deleting and fresh:
                seen[name] = replace(seen[name], deleting=True)
            else:
                del memory.deleted[name]
        for name, (pod, since) in list(memory.created.items()):
            if name not in seen and clock - since < EXPECTATION_TIMEOUT_SECONDS:
                seen[name] = replace(pod, created_at=now)
            else:
                del memory.created[name]
        kinds = set(_snapshot(services, key)) | set(_snapshot(config_maps, key))
        for kind, since in list(memory.children.items()):
            if kind in kinds or clock - since >= EXPECTATION_TIMEOUT_SECONDS:
                del memory.children[kind]
        kinds |= memory.children.keys()
        return Observed(pods=tuple(seen.values()), service="Service" in kinds,
                        config_map="ConfigMap" in kinds)

    def scrape(self, pods: Iterable[WorkerPod], port: int) -> Any:
        """Rank 0's training metrics, or None when it is not up or not answering."""
        rank0 = next((pod for pod in pods
                      if pod.index == 0 and pod.phase == "Running" and pod.ip), None)
        if rank0 is None:
            return None
        url = f"http://{rank0.ip}:{port}/metrics"
        try:
            with urllib.request.urlopen(url, timeout=self.config.scrape_timeout_seconds) as reply:
                return metrics_sample(reply.read().decode())
        except (OSError, ValueError) as error:
            logging.getLogger(__name__).info("no metrics from %s: %s", url, error)
            return None

    def apply(self, body: Mapping[str, Any], memory: JobMemory, actions: list[Action]) -> None:
        """Carry out the actions in order; stop at the first API error (the timer retries)."""
        meta = body["metadata"]
        namespace, name = meta.get("namespace", ""), meta["name"]
        for action in actions:
            try:
                self._apply_one(namespace, name, body, memory, action)
            except ApiException as error:
                self.metrics.api_errors.inc()
                logging.getLogger(__name__).warning(
                    "%s/%s: %s failed: %s %s", namespace, name, type(action).__name__,
                    error.status, error.reason)
                return

    def _apply_one(self, namespace: str, name: str, body: Mapping[str, Any], memory: JobMemory,
                   action: Action) -> None:
        if isinstance(action, WriteStatus):
            self.custom.patch_namespaced_custom_object_status(
                GROUP, VERSION, namespace, PLURAL, name, {"status": action.patch})
            memory.status = action.status
            phase = action.status.get("phase")
            if phase:
                self.phases[body["metadata"].get("uid", "")] = phase
                self.metrics.count_phases(self.phases)
        elif isinstance(action, CreateObject):
            self._create(namespace, memory, action.manifest)
        elif isinstance(action, DeletePod):
            try:
                self.core.delete_namespaced_pod(
                    action.name, namespace, grace_period_seconds=action.grace_period_seconds)
                self.metrics.pods_deleted.inc()
            except ApiException as error:
                if error.status != 404:
                    raise
            memory.deleted[action.name] = time.monotonic()
        elif isinstance(action, DeleteJob):
            self.custom.delete_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURAL, name, propagation_policy="Background")
        elif isinstance(action, RecordEvent):
            kopf.event(dict(body), type=action.type, reason=action.reason,
                       message=action.message)
        elif isinstance(action, CountRestart):
            self.metrics.group_restarts.labels(action.reason).inc()
            if action.hang:
                self.metrics.hang_restarts.inc()

    def _create(self, namespace: str, memory: JobMemory, manifest: dict[str, Any]) -> None:
        kind = manifest["kind"]
        create = {"Pod": self.core.create_namespaced_pod,
                  "Service": self.core.create_namespaced_service,
                  "ConfigMap": self.core.create_namespaced_config_map}[kind]
        try:
            create(namespace, manifest)
            if kind == "Pod":
                self.metrics.pods_created.inc()
        except ApiException as error:
            if error.status != 409:  # already there: created before a restart, or by a peer
                raise
        if kind == "Pod":
            pod = worker_pod(manifest)
            memory.created[pod.name] = (pod, time.monotonic())
        else:
            memory.children[kind] = time.monotonic()
