"""The operator's own Prometheus metrics (served on --metrics-port, 9090 by default).

One registry per running operator, so several operators in one process (tests of
peering) keep separate counts. Trainer metrics are the trainer's, not here.
"""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

PHASES = ("Pending", "Running", "Restarting", "Suspended", "Succeeded", "Failed")


class _JobGauge(Collector):
    """A gauge whose series follow each job's status: `name{namespace,job,<labels>}`.

    A job's series are replaced as a whole at each status write and dropped with the job
    or its finish, so a rank that left the group, or a node no longer avoided, leaves no
    stale series behind.
    """

    def __init__(self, name: str, documentation: str, labels: tuple[str, ...] = ()) -> None:
        self.name, self.documentation, self.labels = name, documentation, labels
        # (namespace, job) -> that job's series: their own label values, and the value.
        self.jobs: dict[tuple[str, str], list[tuple[tuple[str, ...], float]]] = {}

    def show(self, namespace: str, job: str,
             series: list[tuple[tuple[str, ...], float]]) -> None:
        """The job's series from now on; none drops the job's."""
        if series:
            self.jobs[(namespace, job)] = series
        else:
            self.jobs.pop((namespace, job), None)

    def describe(self) -> list[GaugeMetricFamily]:
        return []

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(self.name, self.documentation,
                                   labels=["namespace", "job", *self.labels])
        for (namespace, job), series in sorted(self.jobs.items()):
            for values, value in series:
                family.add_metric([namespace, job, *values], value)
        yield family


class OperatorMetrics:
    """kubetrain_operator_* metrics of one operator process."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.jobs = Gauge("kubetrain_operator_jobs", "TrainingJobs by phase.", ["phase"],
                          registry=self.registry)
        self.reconcile_duration = Histogram(
            "kubetrain_operator_reconcile_duration_seconds",
            "Time to observe, decide and apply one reconcile of one job.",
            registry=self.registry)
        self.pods_created = Counter("kubetrain_operator_pods_created",
                                    "Pods created (workers, and lighthouses).",
                                    registry=self.registry)
        self.pods_deleted = Counter("kubetrain_operator_pods_deleted",
                                    "Pods deleted (workers, and lighthouses).",
                                    registry=self.registry)
        self.group_restarts = Counter(
            "kubetrain_operator_group_restarts", "Worker restarts by reason.", ["reason"],
            registry=self.registry)
        self.hang_restarts = Counter(
            "kubetrain_operator_hang_restarts",
            "Restarts because the training step stopped advancing.", registry=self.registry)
        # Named for the workers, not the operator: what dashboards and alerts ask about.
        self.worker_failures = Counter(
            "kubetrain_worker_failures", "Worker pod failures by failure class "
            "(status.lastFailure.class).", ["class"], registry=self.registry)
        # spec.faultTolerance. The counter misses no change between two scrapes, however
        # short the quorum's dip; the gauge says where each job stands.
        self.quorum_changes = Counter(
            "kubetrain_quorum_changes", "Changes in a job's quorum of replica groups "
            "(QuorumChanged events), by direction: shrank or grew.", ["direction"],
            registry=self.registry)
        self.replica_groups = _JobGauge(
            "kubetrain_replica_groups", "A fault-tolerant job's replica groups "
            "(status.replicaGroups): all of them (total), those whose pods are all ready "
            "(ready), and those in the last quorum worker 0's trainer stepped in "
            "(in_quorum).", ("state",))
        self.registry.register(self.replica_groups)
        self.api_errors = Counter("kubetrain_operator_api_errors",
                                  "Kubernetes API calls that failed.", registry=self.registry)
        self.rank_slowness = _JobGauge(
            "kubetrain_rank_slowness", "Each rank's compute time per step over the median "
            "rank's, at the last judged interval (runPolicy.stragglers).", ("rank",))
        self.registry.register(self.rank_slowness)
        self.avoided_nodes = _JobGauge(
            "kubetrain_avoided_nodes", "Nodes the job's new pods keep off (status.avoidedNodes: "
            "stragglers replaced, failed preflight checks, repeated failures).")
        self.registry.register(self.avoided_nodes)

    def show_job_status(self, namespace: str, job: str, status: Mapping[str, Any] | None) -> None:
        """Set the gauges that follow the job's status, kubetrain_rank_slowness,
        kubetrain_avoided_nodes and kubetrain_replica_groups (none once it finished or is
        gone)."""
        status = status or {}
        if status.get("phase") in ("Succeeded", "Failed"):
            status = {}
        groups = status.get("replicaGroups") or {}
        self.replica_groups.show(namespace, job, [
            ((state,), float(groups[field])) for state, field in (
                ("total", "groups"), ("ready", "ready"), ("in_quorum", "inQuorum"))
            if groups.get(field) is not None])
        avoided = len(status.get("avoidedNodes") or [])
        self.avoided_nodes.show(namespace, job, [((), avoided)] if avoided else [])
        ranks = (status.get("ranks") or {}).get("ranks") or []
        self.rank_slowness.show(namespace, job, [
            ((str(rank["rank"]),), float(rank["slowness"])) for rank in ranks])

    def count_phases(self, phases: dict[str, str]) -> None:
        """Set the jobs gauge from each job's current phase."""
        tally = Tally(phases.values())
        for phase in PHASES:
            self.jobs.labels(phase).set(tally.get(phase, 0))
