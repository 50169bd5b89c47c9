"""The operator's own Prometheus metrics (served on --metrics-port, 9090 by default).

One registry per running operator, so several operators in one process (tests of
peering) keep separate counts. Trainer metrics are the trainer's, not here.
"""

from __future__ import annotations

from collections import Counter as Tally

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

PHASES = ("Pending", "Running", "Restarting", "Suspended", "Succeeded", "Failed")


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

    def count_phases(self, phases: dict[str, str]) -> None:
        """Set the jobs gauge from each job's current phase."""
        tally = Tally(phases.values())
        for phase in PHASES:
            self.jobs.labels(phase).set(tally.get(phase, 0))
