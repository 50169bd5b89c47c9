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


class _RankSlowness(Collector):
    """kubetrain_rank_slowness{namespace,job,rank}: each running job's ranks as status.ranks
    says. Replaced per job at each status write, and gone with the job or its finish, so a
    rank that left the group leaves no stale series."""

    def __init__(self) -> None:
        self.jobs: dict[tuple[str, str], list[tuple[int, float]]] = {}

    def describe(self) -> list[GaugeMetricFamily]:
        return []

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "kubetrain_rank_slowness", "Each rank's compute time per step over the median "
            "rank's, at the last judged interval (runPolicy.stragglers).",
            labels=["namespace", "job", "rank"])
        for (namespace, job), ranks in sorted(self.jobs.items()):
            for rank, slowness in ranks:
                family.add_metric([namespace, job, str(rank)], slowness)
        yield family


class _AvoidedNodes(Collector):
    """kubetrain_avoided_nodes{namespace,job}: how many nodes each unfinished job keeps off
    (status.avoidedNodes), from its last status write; a job avoiding none has no series."""

    def __init__(self) -> None:
        self.jobs: dict[tuple[str, str], int] = {}

    def describe(self) -> list[GaugeMetricFamily]:
        return []

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "kubetrain_avoided_nodes", "Nodes the job's new pods keep off (status.avoidedNodes: "
            "stragglers replaced, failed preflight checks, repeated failures).",
            labels=["namespace", "job"])
        for (namespace, job), count in sorted(self.jobs.items()):
            family.add_metric([namespace, job], count)
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
        self.pods_created = Counter("kubetrain_operator_pods_created", "Worker pods created.",
                                    registry=self.registry)
        self.pods_deleted = Counter("kubetrain_operator_pods_deleted", "Worker pods deleted.",
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
        self.api_errors = Counter("kubetrain_operator_api_errors",
                                  "Kubernetes API calls that failed.", registry=self.registry)
        self.rank_slowness = _RankSlowness()
        self.registry.register(self.rank_slowness)
        self.avoided_nodes = _AvoidedNodes()
        self.registry.register(self.avoided_nodes)

    def show_job_status(self, namespace: str, job: str, status: Mapping[str, Any] | None) -> None:
        """Set the gauges that follow the job's status, kubetrain_rank_slowness and
        kubetrain_avoided_nodes (none once it finished or is gone)."""
        finished = (status or {}).get("phase") in ("Succeeded", "Failed")
        avoided = len((status or {}).get("avoidedNodes") or [])
        if avoided and not finished:
            self.avoided_nodes.jobs[(namespace, job)] = avoided
        else:
            self.avoided_nodes.jobs.pop((namespace, job), None)
        ranks = ((status or {}).get("ranks") or {}).get("ranks") or []
        if not ranks or finished:
            self.rank_slowness.jobs.pop((namespace, job), None)
            return
        self.rank_slowness.jobs[(namespace, job)] = [
            (int(rank["rank"]), float(rank["slowness"])) for rank in ranks]

    def count_phases(self, phases: dict[str, str]) -> None:
        """Set the jobs gauge from each job's current phase."""
        tally = Tally(phases.values())
        for phase in PHASES:
            self.jobs.labels(phase).set(tally.get(phase, 0))
