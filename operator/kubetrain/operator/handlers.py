"""The thin kopf layer: observe TrainingJobs and their children, reconcile, apply.

What is observed comes from kopf indexes (in-memory views kept current by watches),
so a reconcile costs no API reads: only the creates, deletes and status patches
that `reconcile` decided. A reconcile of a job runs on its own events, on its pods'
events and on one operator-wide resync loop over the job index (which also scrapes
rank 0's /metrics). The loop is not a kopf timer on purpose: a per-object timer makes
kopf put a finalizer on every TrainingJob, an extra write per job that GitOps tools
would see as drift.

With leader election (not --standalone) every replica watches, but only the one
holding the Lease (`kubetrain.operator.leader`) reconciles.

What a watch reports late is bridged in memory per job, as Kubernetes controllers
do ("expectations"): the children this operator just created, updated or deleted,
and the status it just wrote. After a restart the memory is empty and the indexes,
filled before any handler runs, are the truth again.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import json
import logging
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

import kopf
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from kubetrain.api.manifest import InvalidManifest, parse_job
from kubetrain.api.trainingjob import GROUP, PLURAL, VERSION, TrainingJobStatus
from kubetrain.operator import children
from kubetrain.operator.config import OperatorConfig
from kubetrain.operator.leader import LeaderElection
from kubetrain.operator.metrics import OperatorMetrics
from kubetrain.operator.observed import (
    Observed,
    WorkerPod,
    final_metrics,
    metrics_sample,
    node_reachable,
    worker_pod,
)
from kubetrain.operator.reconcile import (
    Action,
    CountFailure,
    CountRestart,
    CreateObject,
    DeleteJob,
    DeletePod,
    RecordEvent,
    UpdateConfigMap,
    WriteStatus,
    reconcile,
    reject,
)
from kubetrain.operator.writer import ApiWriter

USER_AGENT = "kubetrain-operator"
# The API server refuses longer event messages.
EVENT_MESSAGE_LIMIT = 1024
# A create or delete the watch has not reported after this long is presumed lost.
EXPECTATION_TIMEOUT_SECONDS = 120.0

JobKey = tuple[str, str]  # (namespace, name)


@dataclass(frozen=True)
class Indexes:
    """kopf's in-memory views: jobs, and the pods, services and config maps of each job."""

    jobs: kopf.Index  # (namespace, name) -> [job]
    pods: kopf.Index  # (namespace, job name) -> [pod]
    services: kopf.Index  # (namespace, job name) -> ["Service"]
    config_maps: kopf.Index  # (namespace, job name) -> [(generation, micro-batch) held]
    nodes: kopf.Index  # node name -> [True]


@dataclass
class JobMemory:
    """What this process did to one job that its watches may not show yet.

    Also whether a reconcile of the job is running (`running`), and whether triggers
    arrived meanwhile (`again`, `scrape`): one thread at a time reconciles a job.
    """

    lock: threading.Lock = field(default_factory=threading.Lock)
    running: bool = False
    again: bool = False
    scrape: bool = False
    status: dict[str, Any] | None = None
    created: dict[str, tuple[WorkerPod, float]] = field(default_factory=dict)
    deleted: dict[str, float] = field(default_factory=dict)
    # Service and ConfigMap written: kind -> (version written, when); a ConfigMap's version
    # is (generation, micro-batch), the Service's 0.
    children: dict[str, tuple[Any, float]] = field(default_factory=dict)
    # The API server's last refusal of a child, already reported as a FailedCreate event.
    refused: str = ""


# Statuses with which the API server refuses an object itself (validation, admission,
# authorisation): retrying the same object cannot succeed until someone changes something.
REFUSED_STATUSES = frozenset({400, 403, 422})


def _server_message(error: ApiException) -> str:
    """The API server's own explanation in an error response, else its reason."""
    try:
        return str(json.loads(error.body or "")["message"])
    except (TypeError, ValueError, KeyError):
        return str(error.reason)


def _snapshot(index: kopf.Index, key: Any) -> list[Any]:
    """The values under `key`, copied: kopf updates indexes on its loop while handlers read."""
    while True:
        try:
            return list(index.get(key, []))
        except RuntimeError:  # changed size during iteration: read again
            continue


def _keys(index: kopf.Index) -> list[Any]:
    """The keys of an index, copied (see `_snapshot`)."""
    while True:
        try:
            return list(index)
        except RuntimeError:
            continue


def _annotated(annotations: Mapping[str, str], key: str) -> int | None:
    value = annotations.get(key, "")
    return int(value) if value.isdigit() else None


def _held_version(manifest: Mapping[str, Any]) -> Any:
    """What a child was built from: (job generation, micro-batch) for the ConfigMap, 0 for
    the Service."""
    if manifest["kind"] != "ConfigMap":
        return 0
    annotations = manifest["metadata"].get("annotations") or {}
    return (_annotated(annotations, children.GENERATION_ANNOTATION) or 0,
            _annotated(annotations, children.MICRO_BATCH_ANNOTATION))


def _now() -> datetime:
    # Kubernetes times have whole seconds; so do the operator's decisions.
    return datetime.now(UTC).replace(microsecond=0)


def _attach(decorator: Callable[[Any], Any], handler: Callable[..., Any]) -> None:
    """Register `handler` with a kopf decorator.

    kopf's handler protocols list only its own keyword arguments, not the index
    arguments (tj_jobs=...) it passes by name, so the handlers go through Any here.
    """
    decorator(handler)


class TrainingJobController:
    """The kopf handlers of one operator, with its API clients, memory and metrics."""

    def __init__(self, config: OperatorConfig, api: client.ApiClient) -> None:
        self.config = config
        self.writer = ApiWriter(api)
        self.metrics = OperatorMetrics()
        self.memory: dict[str, JobMemory] = {}  # by job uid
        self.phases: dict[str, str] = {}  # by job uid, for the jobs-by-phase gauge
        self._memory_lock = threading.Lock()
        self.election = None if config.standalone else LeaderElection(
            api, config.lease_namespace, config.identity, lease_seconds=config.lease_seconds,
            retry_seconds=config.lease_retry_seconds, on_elected=self._forget)
        self._resync: asyncio.Task[None] | None = None
        self._indexes: Indexes | None = None
        self._executor: concurrent.futures.Executor | None = None

    def register(self, registry: kopf.OperatorRegistry) -> None:
        """Attach the handlers to a kopf registry."""
        job = (GROUP, VERSION, PLURAL)
        owned = {children.JOB_LABEL: kopf.PRESENT}
        _attach(kopf.index(*job, id="tj_jobs", registry=registry), self.index_job)
        _attach(kopf.index("v1", "pods", id="tj_pods", labels=owned, registry=registry),
                self.index_pod)
        _attach(kopf.index("v1", "services", id="tj_services", labels=owned, registry=registry),
                self.index_service)
        _attach(kopf.index("v1", "configmaps", id="tj_configmaps", labels=owned,
                           registry=registry), self.index_config_map)
        _attach(kopf.index("v1", "nodes", id="tj_nodes", when=node_reachable,
                           registry=registry), self.index_node)
        _attach(kopf.on.event(*job, registry=registry), self.on_job_event)
        _attach(kopf.on.event("v1", "pods", labels=owned, registry=registry), self.on_pod_event)
        _attach(kopf.on.startup(registry=registry), self.start)
        _attach(kopf.on.cleanup(registry=registry), self.stop_resync)

    # Every handler is a coroutine on kopf's event loop: kopf would run a plain function in
    # its thread pool, a thread hop per watch event. Only a reconcile that has work to do
    # goes to a thread (it blocks on API calls).

    # --- indexes: what is observed --------------------------------------------------

    @staticmethod
    async def index_job(namespace: str, name: str, body: kopf.Body,
                        **_: Any) -> dict[JobKey, Any]:
        return {(namespace, name): dict(body)}

    @staticmethod
    async def index_pod(namespace: str, labels: kopf.Labels, body: kopf.Body,
                        **_: Any) -> dict[JobKey, Any]:
        return {(namespace, labels[children.JOB_LABEL]): dict(body)}

    @staticmethod
    async def index_service(namespace: str, labels: kopf.Labels, body: kopf.Body,
                            **_: Any) -> dict[JobKey, str]:
        return {(namespace, labels[children.JOB_LABEL]): body["kind"]}

    @staticmethod
    async def index_config_map(namespace: str, labels: kopf.Labels,
                               annotations: kopf.Annotations,
                               **_: Any) -> dict[JobKey, tuple[int, int | None]]:
        return {(namespace, labels[children.JOB_LABEL]): (
            _annotated(annotations, children.GENERATION_ANNOTATION) or 0,
            _annotated(annotations, children.MICRO_BATCH_ANNOTATION))}

    @staticmethod
    async def index_node(name: str, **_: Any) -> dict[str, bool]:
        return {name: True}

    # --- triggers -------------------------------------------------------------------

    async def on_job_event(self, type: str | None, uid: str, namespace: str, name: str,
                           body: kopf.Body, **_: Any) -> None:
        if type == "DELETED":
            with self._memory_lock:
                self.memory.pop(uid, None)
            self._count_phase(uid, None)
            self.metrics.show_job_status(namespace, name, None)
            return
        if type == "MODIFIED" and self._own_status_echo(uid, body):
            return
        await self._reconcile_in_thread((namespace, name))

    async def on_pod_event(self, type: str | None, name: str, namespace: str,
                           labels: kopf.Labels, body: kopf.Body, **_: Any) -> None:
        if type == "ADDED" and self._own_echo(name, body):
            return
        await self._reconcile_in_thread((namespace, labels[children.JOB_LABEL]))

    async def start(self, settings: kopf.OperatorSettings, tj_jobs: kopf.Index,
                    tj_pods: kopf.Index, tj_services: kopf.Index, tj_configmaps: kopf.Index,
                    tj_nodes: kopf.Index, **_: Any) -> None:
        """Keep the indexes and kopf's thread pool (startup runs before any watch), then resync."""
        self._indexes = Indexes(tj_jobs, tj_pods, tj_services, tj_configmaps, tj_nodes)
        self._executor = settings.execution.executor
        self._resync = asyncio.create_task(self.resync())

    async def stop_resync(self, **_: Any) -> None:
        if self._resync is not None:
            self._resync.cancel()
            await asyncio.gather(self._resync, return_exceptions=True)

    async def resync(self) -> None:
        """Every resync_seconds, reconcile every job and scrape its progress, all at once."""
        while True:
            await asyncio.sleep(self.config.resync_seconds)
            if not self.acting():
                continue
            passes = [self._reconcile_in_thread(key, scrape=True)
                      for key in _keys(self.indexes.jobs)]
            for outcome in await asyncio.gather(*passes, return_exceptions=True):
                if isinstance(outcome, Exception):
                    logging.getLogger(__name__).error("resync failed", exc_info=outcome)

    async def _reconcile_in_thread(self, key: JobKey, *, scrape: bool = False) -> None:
        await asyncio.get_running_loop().run_in_executor(
            self._executor, functools.partial(self.reconcile, key, self.indexes, scrape=scrape))

    @property
    def indexes(self) -> Indexes:
        """kopf's indexes, known once the startup handler ran."""
        assert self._indexes is not None, "the startup handler has not run"
        return self._indexes

    # --- observe, decide, apply -----------------------------------------------------

    def acting(self) -> bool:
        """True when this replica may write: standalone, or the leader."""
        return self.election is None or self.election.is_leader()

    def _forget(self) -> None:
        """Drop what an earlier term remembered: another leader may have acted since."""
        with self._memory_lock:
            self.memory.clear()

    # Events that only echo this process's own writes bring no news: skipping their
    # reconciles halves the passes while jobs start (the resync still visits every job).

    def _own_status_echo(self, uid: str, job: kopf.Body) -> bool:
        """The job as this process last wrote its status, with the spec it last saw."""
        memory = self.memory.get(uid)
        if memory is None or memory.status is None:
            return False
        # Parsed: the status patches leave out fields still at their defaults.
        status = TrainingJobStatus.model_validate(job.get("status") or {}).wire()
        return (status == memory.status
                and status.get("observedGeneration") == job.get("metadata", {}).get("generation"))

    def _own_echo(self, name: str, pod: kopf.Body) -> bool:
        """A pod this process created, seen for the first time and still Pending."""
        owners = pod.get("metadata", {}).get("ownerReferences") or [{}]
        memory = self.memory.get(owners[0].get("uid", ""))
        return (memory is not None and name in memory.created
                and (pod.get("status") or {}).get("phase", "Pending") == "Pending")

    def _memory(self, uid: str) -> JobMemory:
        with self._memory_lock:
            return self.memory.setdefault(uid, JobMemory())

    def reconcile(self, key: JobKey, indexes: Indexes, *, scrape: bool = False) -> None:
        """Bring one job towards its spec; safe to run any number of times, from any thread.

        Triggers that arrive while the job is being reconciled do not wait for it (and hold
        a worker thread): they are folded into one more pass right after it, which reads
        the job afresh from the index.
        """
        bodies = _snapshot(indexes.jobs, key)
        if not bodies or not self.acting():
            return
        memory = self._memory(bodies[0].get("metadata", {}).get("uid", ""))
        with memory.lock:
            memory.scrape |= scrape
            if memory.running:
                memory.again = True
                return
            memory.running = True
        while True:
            with memory.lock:
                scrape, memory.scrape, memory.again = memory.scrape, False, False
            try:
                bodies = _snapshot(indexes.jobs, key)
                if bodies and self.acting():
                    self._reconcile_once(bodies[0], key, memory, indexes, scrape)
            except BaseException:
                with memory.lock:  # the next trigger or resync tries again
                    memory.running = False
                raise
            with memory.lock:
                if not memory.again:
                    memory.running = False
                    return

    def _reconcile_once(self, body: dict[str, Any], key: JobKey, memory: JobMemory,
                        indexes: Indexes, scrape: bool) -> None:
        """Observe, decide and apply once."""
        meta = body.get("metadata", {})
        if meta.get("deletionTimestamp"):
            return
        with self.metrics.reconcile_duration.time():
            now = _now()
            if memory.status is not None:
                body = {**body, "status": memory.status}
            try:
                job = parse_job(body)
            except InvalidManifest as error:
                actions = reject(body.get("status"), meta.get("generation"), str(error), now)
            else:
                observed = self.observe(key, memory, indexes, now)
                if scrape:
                    observed = replace(observed, metrics=self.scrape(
                        observed.pods, job.spec.metrics.port))
                if observed.metrics is None:
                    observed = replace(observed, metrics=final_metrics(observed.pods))
                actions = reconcile(job, observed, now)
            self.apply(body, memory, actions)

    def observe(self, key: JobKey, memory: JobMemory, indexes: Indexes,
                now: datetime) -> Observed:
        """The job's children as the indexes show them, corrected by this process's own writes."""
        seen = {pod.name: pod for pod in (worker_pod(raw, indexes.nodes)
                                          for raw in _snapshot(indexes.pods, key))}
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
        indexed: dict[str, Any] = {
            "Service": 0 if _snapshot(indexes.services, key) else None,
            "ConfigMap": next(iter(_snapshot(indexes.config_maps, key)), None)}
        for kind, (version, since) in list(memory.children.items()):
            if indexed[kind] == version or clock - since >= EXPECTATION_TIMEOUT_SECONDS:
                del memory.children[kind]
            else:
                indexed[kind] = version
        config = indexed["ConfigMap"]
        return Observed(pods=tuple(seen.values()), service=indexed["Service"] is not None,
                        config_generation=config[0] if config is not None else None,
                        config_micro_batch=config[1] if config is not None else None)

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
                message = _server_message(error)
                logging.getLogger(__name__).warning(
                    "%s/%s: %s failed: %s %s: %s", namespace, name, type(action).__name__,
                    error.status, error.reason, message)
                if isinstance(action, CreateObject) and error.status in REFUSED_STATUSES:
                    self._report_refusal(namespace, body, memory, action, message)
                return

    def _report_refusal(self, namespace: str, body: Mapping[str, Any], memory: JobMemory,
                        action: CreateObject, message: str) -> None:
        """Tell the user, once per distinct message, why the server refuses a child.

        A pod refused by admission (a missing PriorityClass or ServiceAccount, a quota)
        would otherwise leave the job Pending with the reason only in the operator's log:
        it goes to a Warning event on the job, as a ReplicaSet reports FailedCreate.
        """
        text = f"{action.manifest['kind']} {action.manifest['metadata']['name']}: {message}"
        if memory.refused == text:
            return
        memory.refused = text
        event = RecordEvent("Warning", "FailedCreate", text)
        try:
            self.writer.create(namespace, self._event(body, event))
        except ApiException as error:
            logging.getLogger(__name__).warning("event FailedCreate not recorded: %s",
                                                _server_message(error))

    def _apply_one(self, namespace: str, name: str, body: Mapping[str, Any], memory: JobMemory,
                   action: Action) -> None:
        if isinstance(action, WriteStatus):
            self.writer.patch_job_status(namespace, name, action.patch)
            memory.status = action.status
            self.metrics.show_job_status(namespace, name, action.status)
            phase = action.status.get("phase")
            if phase:
                self._count_phase(body["metadata"].get("uid", ""), phase)
        elif isinstance(action, CreateObject):
            self._create(namespace, memory, action.manifest)
        elif isinstance(action, UpdateConfigMap):
            meta = action.manifest["metadata"]
            self.writer.patch_config_map(namespace, meta["name"], {
                "metadata": {"annotations": meta["annotations"]}, "data": action.manifest["data"]})
            memory.children["ConfigMap"] = (_held_version(action.manifest), time.monotonic())
        elif isinstance(action, DeletePod):
            try:
                self.writer.delete_pod(namespace, action.name, action.grace_period_seconds)
                self.metrics.pods_deleted.inc()
            except ApiException as error:
                if error.status != 404:
                    raise
            memory.deleted[action.name] = time.monotonic()
        elif isinstance(action, DeleteJob):
            self.writer.delete_job(namespace, name)
        elif isinstance(action, RecordEvent):
            self.writer.create(namespace, self._event(body, action))
        elif isinstance(action, CountRestart):
            self.metrics.group_restarts.labels(action.reason).inc()
            if action.hang:
                self.metrics.hang_restarts.inc()
        elif isinstance(action, CountFailure):
            self.metrics.worker_failures.labels(action.failure_class).inc()

    def _count_phase(self, uid: str, phase: str | None) -> None:
        """Set (None: drop) the job's phase and recount the jobs gauge from a copy.

        Executor threads write phases while others count them: the table changes only under
        the lock, and the gauge is set from it under the lock too, so the last count set is
        the latest table's.
        """
        with self._memory_lock:
            if phase is None:
                self.phases.pop(uid, None)
            else:
                self.phases[uid] = phase
            self.metrics.count_phases(dict(self.phases))

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
            "source": {"component": USER_AGENT}, "reportingComponent": USER_AGENT,
            "reportingInstance": self.config.identity,
            "firstTimestamp": now, "lastTimestamp": now, "count": 1,
        }

    def _create(self, namespace: str, memory: JobMemory, manifest: dict[str, Any]) -> None:
        kind = manifest["kind"]
        try:
            self.writer.create(namespace, manifest)
            if kind == "Pod":
                self.metrics.pods_created.inc()
        except ApiException as error:
            if error.status != 409:  # already there: created before a restart, or by a peer
                raise
        if kind == "Pod":
            pod = worker_pod(manifest)
            memory.created[pod.name] = (pod, time.monotonic())
        else:
            memory.children[kind] = (_held_version(manifest), time.monotonic())
