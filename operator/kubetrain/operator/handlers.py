"""The thin kopf layer: observe TrainingJobs and their children, reconcile, apply.

What is observed comes from kopf indexes (in-memory views kept current by watches),
so a reconcile costs no API reads: only the creates, deletes and status patches
that `reconcile` decided. A reconcile of a job runs on its own events, on its pods'
events, when its restart's backoff ends, on a trainer's end its lifeline saw, and on
one operator-wide resync loop over the job index (which also scrapes rank 0's
/metrics). The loop is not a kopf timer on purpose: a per-object timer makes kopf put a
finalizer on every TrainingJob, an extra write per job that GitOps tools would see as
drift.

With leader election (not --standalone) every replica watches, but only the one
holding the Lease (`kubetrain.operator.leader`) reconciles.

What a watch reports late is bridged in memory per job, as Kubernetes controllers
do (`kubetrain.operator.expectations`): the children this operator just created,
updated or deleted, and the status it just wrote. After a restart the memory is empty
and the indexes, filled before any handler runs, are the truth again. The writes
themselves are `kubetrain.operator.applier`'s.

An own-code job (spec.trainer) reports its progress to the status endpoint
(`kubetrain.operator.trainer_status_setup`): the controller admits it, has its Secret
`<job>-status` created before its first pods (an action the applier carries out, first
in the pass), reads its latest report where it would scrape rank 0, and forgets it once it
finished or is deleted.

`TrainingJobController` wires kopf to the rest: when passes run is
`kubetrain.operator.pass_scheduler`'s, reading rank 0's /metrics
`kubetrain.operator.rank0_scrape`'s, the writes `kubetrain.operator.applier`'s.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

import kopf
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from kubetrain import pod_conventions
from kubetrain.api.manifest import InvalidManifest, parse_job
from kubetrain.api.scheduling import managed_elsewhere
from kubetrain.api.trainingjob import FINISHED, GROUP, PLURAL, VERSION, TrainingJob
from kubetrain.operator import gang, kueue
from kubetrain.operator.actions import Action, CreateStatusSecret, ReconcileAt
from kubetrain.operator.applier import ActionApplier
from kubetrain.operator.config import OperatorConfig
from kubetrain.operator.expectations import (
    ConfigMapVersion,
    Expectations,
    config_map_version,
    job_identity,
)
from kubetrain.operator.facts import (
    Observed,
    final_metrics,
    node_reachable,
    worker_pod,
)
from kubetrain.operator.leader import LeaderElection
from kubetrain.operator.lifeline_watch import LifelineWatch
from kubetrain.operator.metrics import OperatorMetrics
from kubetrain.operator.pass_scheduler import JobKey, JobMemory, PassScheduler
from kubetrain.operator.rank0_scrape import scrape_rank0
from kubetrain.operator.reconcile import reconcile, reject
from kubetrain.operator.scheduling_facts import GroupObject, group_object
from kubetrain.operator.trainer_status_setup import StatusReporting, advertise
from kubetrain.operator.writer import ApiWriter
from kubetrain.protocol import lifeline_port

USER_AGENT = "kubetrain-operator"
# The placement objects a job owns (its gang's group, its Kueue Workload), each kind
# indexed by job; and Kueue's ResourceFlavors, by name.
PLACEMENT_APIS = (*gang.GANG_APIS, kueue.KUEUE_WORKLOAD)


def _index_id(api: gang.Api) -> str:
    """A kopf index's id for a placement kind: tj_<group>_<plural>, dots as underscores."""
    return "tj_" + api.group.replace(".", "_").replace("-", "_") + "_" + api.plural


def discover_placement_apis(api: client.ApiClient) -> frozenset[str]:
    """The gang mechanisms and "Kueue" whose APIs the API server's discovery lists.

    GET /apis, the aggregated group list (as `kubectl api-versions` reads it); the client's
    ApisApi asks for /apis/, which an API server answers alike and the test emulator not."""
    request = api.param_serialize("GET", "/apis", header_params={"Accept": "application/json"},
                                  auth_settings=["BearerToken"])
    answer = api.call_api(*request)
    answer.read()
    if not 200 <= answer.status <= 299:
        raise ApiException(status=answer.status, reason=answer.reason)
    listed = json.loads(answer.data or b"{}")
    served = {version.get("groupVersion", "") for group in listed.get("groups") or []
              for version in group.get("versions") or []}
    kueue_served = {"Kueue"} if kueue.KUEUE_WORKLOAD.api_version in served else set()
    return gang.served_mechanisms(served) | kueue_served

@dataclass(frozen=True)
class Indexes:
    """kopf's in-memory views: jobs, and the pods, services and config maps of each job."""

    jobs: kopf.Index  # (namespace, name) -> [job]
    pods: kopf.Index  # (namespace, job name) -> [pod]
    services: kopf.Index  # (namespace, job name) -> [Service name]
    config_maps: kopf.Index  # (namespace, job name) -> [(generation, micro-batch) held]
    nodes: kopf.Index  # node name -> [True]
    # One per placement kind: (namespace, job name) -> [GroupObject].
    groups: tuple[kopf.Index, ...] = ()
    flavors: kopf.Index | None = None  # ResourceFlavor name -> [kueue.Flavor]


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

    def __init__(self, config: OperatorConfig, api: client.ApiClient,
                 status: StatusReporting | None = None) -> None:
        self.config = config
        self.api = api
        self.status = status
        self.metrics = OperatorMetrics()
        self.applier = ActionApplier(ApiWriter(api), self.metrics, USER_AGENT, config.identity)
        self.passes = PassScheduler()
        self.election = None if config.standalone else LeaderElection(
            api, config.lease_namespace, config.identity, lease_seconds=config.lease_seconds,
            retry_seconds=config.lease_retry_seconds, on_elected=self._elected)
        self._resync: asyncio.Task[None] | None = None
        # Trainer restarts in place, which only each pod's lifeline shows (issue 33).
        self.lifelines = LifelineWatch(self._trainer_ended)
        self._news: set[asyncio.Future[None]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._indexes: Indexes | None = None
        self._executor: concurrent.futures.Executor | None = None
        # The placement APIs the cluster serves, discovered at start-up (kopf watches the
        # kinds it finds then: installing Volcano, say, takes an operator restart).
        self.served: frozenset[str] = frozenset()

    def register(self, registry: kopf.OperatorRegistry) -> None:
        """Attach the handlers to a kopf registry."""
        job = (GROUP, VERSION, PLURAL)
        owned = {pod_conventions.JOB_LABEL: kopf.PRESENT}
        _attach(kopf.index(*job, id="tj_jobs", registry=registry), self.index_job)
        _attach(kopf.index("v1", "pods", id="tj_pods", labels=owned, registry=registry),
                self.index_pod)
        _attach(kopf.index("v1", "services", id="tj_services", labels=owned, registry=registry),
                self.index_service)
        _attach(kopf.index("v1", "configmaps", id="tj_configmaps", labels=owned,
                           registry=registry), self.index_config_map)
        _attach(kopf.index("v1", "nodes", id="tj_nodes", when=node_reachable,
                           registry=registry), self.index_node)
        for api in PLACEMENT_APIS:
            _attach(kopf.index(api.group, api.version, api.plural, id=_index_id(api),
                               labels=owned, registry=registry), self.index_group)
        flavors = kueue.RESOURCE_FLAVOR
        _attach(kopf.index(flavors.group, flavors.version, flavors.plural,
                           id=_index_id(flavors), registry=registry), self.index_flavor)
        # Kueue's admission and eviction come as its Workload's status: news for the job.
        workloads = kueue.KUEUE_WORKLOAD
        _attach(kopf.on.event(workloads.group, workloads.version, workloads.plural,
                              labels=owned, registry=registry), self.on_placement_event)
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
        return {(namespace, labels[pod_conventions.JOB_LABEL]): dict(body)}

    @staticmethod
    async def index_service(namespace: str, name: str, labels: kopf.Labels,
                            **_: Any) -> dict[JobKey, str]:
        # By name: a job with spec.faultTolerance has its lighthouse's Service too.
        return {(namespace, labels[pod_conventions.JOB_LABEL]): name}

    @staticmethod
    async def index_config_map(namespace: str, labels: kopf.Labels,
                               annotations: kopf.Annotations,
                               **_: Any) -> dict[JobKey, ConfigMapVersion]:
        return {(namespace, labels[pod_conventions.JOB_LABEL]): config_map_version(annotations)}

    @staticmethod
    async def index_node(name: str, **_: Any) -> dict[str, bool]:
        return {name: True}

    @staticmethod
    async def index_group(namespace: str, labels: kopf.Labels, body: kopf.Body,
                          **_: Any) -> dict[JobKey, GroupObject]:
        return {(namespace, labels[pod_conventions.JOB_LABEL]): group_object(body)}

    @staticmethod
    async def index_flavor(name: str, body: kopf.Body, **_: Any) -> dict[str, kueue.Flavor]:
        return {name: kueue.flavor(body)}

    # --- triggers -------------------------------------------------------------------

    async def on_job_event(self, type: str | None, uid: str, namespace: str, name: str,
                           body: kopf.Body, **_: Any) -> None:
        if type == "DELETED":
            self.passes.forget(job_identity(uid, namespace, name))
            self.applier.job_gone(uid, namespace, name)
            if self.status is not None:
                self.status.forget(namespace, name)
            self.lifelines.forget((namespace, name))
            self.passes.cancel_wake((namespace, name))
            return
        if type == "MODIFIED" and self._own_status_echo(job_identity(uid, namespace, name),
                                                        body):
            return
        await self._reconcile_in_thread((namespace, name))

    async def on_pod_event(self, type: str | None, name: str, namespace: str,
                           labels: kopf.Labels, body: kopf.Body, **_: Any) -> None:
        job = labels[pod_conventions.JOB_LABEL]
        if type == "ADDED" and self._own_echo(name, namespace, job, body):
            return
        await self._reconcile_in_thread((namespace, job))

    async def on_placement_event(self, type: str | None, namespace: str, labels: kopf.Labels,
                                 **_: Any) -> None:
        await self._reconcile_in_thread((namespace, labels[pod_conventions.JOB_LABEL]))

    async def start(self, settings: kopf.OperatorSettings, tj_jobs: kopf.Index,
                    tj_pods: kopf.Index, tj_services: kopf.Index, tj_configmaps: kopf.Index,
                    tj_nodes: kopf.Index, **indexes: Any) -> None:
        """Keep the indexes and kopf's thread pool (startup runs before any watch), learn
        which placement APIs the cluster serves, then resync."""
        self._indexes = Indexes(tj_jobs, tj_pods, tj_services, tj_configmaps, tj_nodes,
                                groups=tuple(indexes[_index_id(api)] for api in PLACEMENT_APIS),
                                flavors=indexes[_index_id(kueue.RESOURCE_FLAVOR)])
        self._executor = settings.execution.executor
        self._loop = asyncio.get_running_loop()
        self.served = await self._loop.run_in_executor(self._executor, self._discover)
        self.lifelines.start(self._loop)
        if self.election is None:  # standalone: this replica acts from now on
            await asyncio.get_running_loop().run_in_executor(self._executor, self._advertise)
        self._resync = asyncio.create_task(self.resync())

    def _discover(self) -> frozenset[str]:
        """The placement APIs served; none when discovery fails (every job then runs
        without a gang unless its spec names one, which then waits and says why)."""
        log = logging.getLogger(__name__)
        try:
            served = discover_placement_apis(self.api)
        except (ApiException, OSError, ValueError) as error:
            log.error("API discovery failed (%s): no gang or Kueue API is used", error)
            return frozenset()
        log.info("placement APIs served: %s", ", ".join(sorted(served)) or "none")
        return served

    async def stop_resync(self, **_: Any) -> None:
        await self.lifelines.close()
        self.passes.cancel_wakes()
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

    def _elected(self) -> None:
        self.passes.forget_all()  # another leader may have acted since this one remembered
        self._advertise()

    def _advertise(self) -> None:
        """Route the status Service to this replica, which acts from now on."""
        config = self.config
        if self.status is None or not config.status_service or not config.pod_ip:
            return
        try:
            advertise(self.api, config.status_namespace, config.status_service, config.pod_ip,
                      self.status.endpoint.port)
        except ApiException as error:
            logging.getLogger(__name__).error(
                "the status Service %s does not route to this replica: %s %s",
                config.status_service, error.status, error.reason)

    # Events that only echo this process's own writes bring no news: skipping their
    # reconciles halves the passes while jobs start (the resync still visits every job).

    def _own_status_echo(self, identity: str, job: kopf.Body) -> bool:
        """The job as this process last wrote its status, with the spec it last saw."""
        memory = self.passes.known(identity)
        return memory is not None and memory.expected.is_status_echo(job)

    def _own_echo(self, name: str, namespace: str, job: str, pod: kopf.Body) -> bool:
        """A pod this process created, seen for the first time and still Pending."""
        owners = pod.get("metadata", {}).get("ownerReferences") or [{}]
        memory = self.passes.known(job_identity(owners[0].get("uid"), namespace, job))
        return memory is not None and memory.expected.is_created_echo(name, pod)

    def reconcile(self, key: JobKey, indexes: Indexes, *, scrape: bool = False) -> None:
        """Bring one job towards its spec; safe to run any number of times, from any thread:
        one pass of a job at a time, triggers meanwhile folded into one more
        (`kubetrain.operator.pass_scheduler`)."""
        bodies = _snapshot(indexes.jobs, key)
        if not bodies or not self.acting():
            return
        memory = self.passes.memory(job_identity(bodies[0].get("metadata", {}).get("uid"), *key))

        def one_pass(scrape: bool) -> None:
            bodies = _snapshot(indexes.jobs, key)  # afresh: the job may have changed
            if bodies and self.acting():
                self._reconcile_once(bodies[0], key, memory, indexes, scrape)

        self.passes.run(memory, scrape, one_pass)

    def _reconcile_once(self, body: dict[str, Any], key: JobKey, memory: JobMemory,
                        indexes: Indexes, scrape: bool) -> None:
        """Observe, decide and apply once."""
        meta = body.get("metadata", {})
        if meta.get("deletionTimestamp"):
            return
        if managed_elsewhere((body.get("spec") or {}).get("managedBy")):
            return  # another controller (spec.managedBy) runs it: nothing to do, nothing to say
        with self.metrics.reconcile_duration.time():
            now = _now()
            expected = memory.expected
            if expected.status is not None:
                body = {**body, "status": expected.status}
            try:
                job = parse_job(body)
            except InvalidManifest as error:
                actions = reject(body.get("status"), meta.get("generation"), str(error), now)
            else:
                observed = self.observe(key, expected, indexes, now)
                before: list[Action] = []
                if job.spec.trainer is not None:
                    observed = replace(observed, metrics=self.reported(key))
                    before = self._own_code_reporting(job, expected)
                else:
                    if scrape:
                        observed = replace(observed, metrics=scrape_rank0(
                            observed.pods, job.spec.metrics.port,
                            self.config.scrape_timeout_seconds))
                    if observed.metrics is None:
                        observed = replace(observed, metrics=final_metrics(observed.pods))
                    observed = replace(observed, trainer_ends=self.lifelines.ends(key),
                                       silent_pods=self.lifelines.silent(key))
                    self.lifelines.follow(key, observed.pods,
                                          lifeline_port(job.spec.metrics.port),
                                          job.spec.workers.procs_per_worker)
                actions = [*before, *reconcile(job, observed, now)]
                self._wake_when_asked(key, actions)
            self.applier.apply(body, expected, actions)

    def _wake_when_asked(self, key: JobKey, actions: list[Action]) -> None:
        """Schedule the pass a ReconcileAt asks for (a restart's backoff ends then): its
        replacements are created then, not at the next resync (up to resyncSeconds later,
        10 s by default) or whatever event comes first. From the pass's thread."""
        for action in actions:
            if isinstance(action, ReconcileAt) and self._loop is not None:
                delay = (action.time - datetime.now(UTC)).total_seconds()
                self._loop.call_soon_threadsafe(self._wake_in, key, max(delay, 0.0))

    def _wake_in(self, key: JobKey, delay: float) -> None:
        """On the event loop: reconcile `key` in `delay` seconds (replacing an earlier wake)."""
        self.passes.wake_in(key, delay, self._reconcile_soon)

    def _trainer_ended(self, key: JobKey) -> None:
        """A lifeline saw a trainer end (on the event loop): reconcile the job now."""
        self._reconcile_soon(key)

    def _reconcile_soon(self, key: JobKey) -> None:
        """From the event loop: a pass over the job in a worker thread, held until done."""
        task = asyncio.ensure_future(self._reconcile_in_thread(key))
        self._news.add(task)  # held until done: the loop keeps only weak references
        task.add_done_callback(self._news.discard)

    def reported(self, key: JobKey) -> Any:
        """An own-code job's latest report to the status endpoint, as observed progress."""
        return self.status.sample(*key) if self.status is not None else None

    def _own_code_reporting(self, job: TrainingJob, expected: Expectations) -> list[Action]:
        """Admit an own-code job to the status endpoint (forget a finished one), and the
        action that creates its Secret before its pods, until this process has: first in
        the pass, so that when the Secret is refused the applier stops there and the pods
        are not created to run without reporting (the next pass tries again first)."""
        if self.status is None:
            return []
        namespace, name = job.metadata.namespace or "default", job.metadata.name
        if job.status is not None and job.status.phase in FINISHED:
            self.status.forget(namespace, name)
            return []
        self.status.admit(job)
        if expected.status_secret:
            return []
        return [CreateStatusSecret(self.status.secret(job))]

    def observe(self, key: JobKey, expected: Expectations, indexes: Indexes,
                now: datetime) -> Observed:
        """The job's children as the indexes show them, corrected by this process's own writes."""
        pods = expected.pods({pod.name: pod for pod in (
            worker_pod(raw, indexes.nodes) for raw in _snapshot(indexes.pods, key))}, now)
        # The lighthouse's pod is the job's, but no worker: observed apart.
        lighthouse = pod_conventions.lighthouse_name(key[1])
        services = _snapshot(indexes.services, key)
        service, config = expected.held(
            service=key[1] in services,
            config_map=next(iter(_snapshot(indexes.config_maps, key)), None))
        groups = expected.groups(obj for index in indexes.groups
                                 for obj in _snapshot(index, key))
        flavors = {} if indexes.flavors is None else {
            name: found[0] for name in _keys(indexes.flavors)
            if (found := _snapshot(indexes.flavors, name))}
        return Observed(pods=tuple(pod for pod in pods if pod.name != lighthouse),
                        lighthouse=next((pod for pod in pods if pod.name == lighthouse), None),
                        lighthouse_service=expected.held_lighthouse_service(
                            lighthouse in services),
                        service=service,
                        config_generation=config[0] if config is not None else None,
                        config_micro_batch=config[1] if config is not None else None,
                        groups=groups, served=self.served, flavors=flavors)
