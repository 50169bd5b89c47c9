"""One reconcile pass's state: the status being decided, the actions so far, and the
primitives every step uses (condition, event, delete, finish, restart).

A public type in a room of its own, so that `kubetrain.operator.reconcile`, which runs the
steps in order, and the rooms the steps live in (`observation`, `lifecycle`, `nodes`,
`recovery`) all import it, and none of them imports `reconcile` back. Pure: no Kubernetes,
no clock but the pass's `now`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Final, Literal

from kubetrain import restart_rules
from kubetrain.api.trainingjob import (
    Condition,
    RankSlowness,
    RestartStatus,
    TrainingJob,
    TrainingJobStatus,
)
from kubetrain.operator.actions import Action, CountRestart, DeletePod, RecordEvent
from kubetrain.operator.facts import Observed, WorkerPod
from kubetrain.pod_conventions import replica_group_of

# Seconds a hung group's pods get between SIGTERM and SIGKILL: enough to flush logs.
HUNG_GROUP_GRACE_SECONDS: Final = 5
# Counted restarts that wait no backoff: a lost node's pods are replaced on another node
# (the lost one is avoided), so there is nothing to wait out, and the survivors wait too.
NO_BACKOFF_REASONS: Final = ("NodeLost",)


@dataclass
class ReconcilePass:
    """The status being computed and the actions decided so far for one reconcile pass."""

    job: TrainingJob
    observed: Observed
    now: datetime
    status: TrainingJobStatus
    actions: list[Action] = field(default_factory=list)
    deleted: set[str] = field(default_factory=set)  # pods this pass deletes
    # Ranks that became stragglers in this pass's judged interval.
    new_stragglers: list[RankSlowness] = field(default_factory=list)
    # Pods held back by avoidance while the job runs elastic without them.
    held_back: set[str] = field(default_factory=set)
    too_few_nodes: bool = False  # this pass found pods that avoidance leaves unschedulable
    # Workers Kueue admitted (partial admission may admit fewer than replicas); None: the
    # job is not admitted through a Kueue Workload (kubetrain.operator.scheduling.admit).
    admitted: int | None = None

    @property
    def name(self) -> str:
        return self.job.metadata.name

    @property
    def replicas(self) -> int:
        """Workers the job runs now: spec.workers.replicas, or as many as Kueue admitted."""
        replicas = self.job.spec.workers.replicas
        return replicas if self.admitted is None else min(replicas, self.admitted)

    def live_pods(self) -> list[WorkerPod]:
        return [pod for pod in self.observed.pods
                if not pod.deleting and pod.name not in self.deleted]

    def takes_every_worker(self, broken: list[WorkerPod]) -> bool:
        """Whether replacing `broken` restarts the whole group: when worker 0, the rendezvous
        host the survivors cannot re-form without, is among them. Never with
        spec.faultTolerance: each replica group is its own torchrun group and restarts
        alone (`replaced_with`)."""
        return (self.job.spec.fault_tolerance is None
                and any(pod.index == 0 for pod in broken))

    def replaced_with(self, broken: list[WorkerPod]) -> list[WorkerPod]:
        """The live pods a restart of `broken` replaces: those pods, or with
        spec.faultTolerance every live pod of their replica groups (a group is one torchrun
        group of fixed size, re-formed whole; the other groups train on untouched)."""
        if self.job.spec.fault_tolerance is None:
            return broken
        groups = {replica_group_of(self.job, pod.index) for pod in broken}
        return [pod for pod in self.live_pods() if replica_group_of(self.job, pod.index) in groups]

    def count_group_restarts(self, pods: Iterable[WorkerPod], count: int = 1) -> None:
        """`count` more (one; -1 retracts one) in status.replicaGroups.restarts for each
        replica group of `pods`, restarted alone (spec.faultTolerance)."""
        seen = self.status.replica_groups  # (`observation` sized its restarts to the groups)
        if seen is None:
            return
        for group in {replica_group_of(self.job, pod.index) for pod in pods}:
            if group is not None and group < len(seen.restarts):
                seen.restarts[group] = max(0, seen.restarts[group] + count)

    def event(self, reason: str, message: str, warning: bool = False) -> None:
        self.actions.append(RecordEvent("Warning" if warning else "Normal", reason, message))

    def condition(self, kind: str, value: bool, reason: str, message: str = "") -> None:
        """Set one condition, keeping its transition time when its truth did not change."""
        text: Literal["True", "False"] = "True" if value else "False"
        existing = self.condition_of(kind)
        if existing is not None:
            if existing.status != text:
                existing.last_transition_time = self.now
            existing.status, existing.reason, existing.message = text, reason, message
        elif value:  # a condition that never held is simply absent
            self.status.conditions.append(Condition(
                type=kind, status=text, reason=reason, message=message,
                last_transition_time=self.now))

    def condition_of(self, kind: str) -> Condition | None:
        """The status condition of type `kind`, true or false; None when it never held."""
        return next((c for c in self.status.conditions if c.type == kind), None)

    def condition_since(self, kind: str) -> datetime | None:
        """When condition `kind` last became true; None while it is not."""
        existing = self.condition_of(kind)
        if existing is None or existing.status != "True":
            return None
        return existing.last_transition_time

    def delete(self, pod: WorkerPod, reason: str) -> None:
        # A pod on a lost node can never confirm. A hung group, or one that lost a rank
        # with its node (a silent peer, no connection reset), cannot agree on a checkpoint
        # (the stop flag's all-reduce waits on the missing rank), so the pod template's
        # long grace for that checkpoint would only delay the restart. A group that failed
        # its preflight has not trained since its checkpoint (and may wait on a stalled rank).
        if pod.node_lost:
            grace: int | None = 0
        elif reason in ("ProgressDeadlineExceeded", "NodeLost", "PreflightFailed"):
            grace = HUNG_GROUP_GRACE_SECONDS
        else:
            grace = None
        self.actions.append(DeletePod(pod.name, reason, grace))
        self.deleted.add(pod.name)

    # --- transitions -----------------------------------------------------------------

    def finish(self, phase: Literal["Succeeded", "Failed"], reason: str, message: str) -> None:
        self.status.phase = phase
        self.status.completion_time = self.now
        self.status.workers.desired = 0
        self.condition(phase, True, reason, message)
        self.condition("Running", False, reason)
        self.condition("Restarting", False, reason)
        self.event(reason, message, warning=phase == "Failed")

    def restart(self, reason: str, message: str, broken: list[WorkerPod], *,
                whole_group: bool, counted: bool = True) -> None:
        """Count a restart and delete the pods to replace (all of them for a whole-group one;
        with spec.faultTolerance, the whole replica groups of `broken`: `replaced_with`).

        An uncounted restart (out of memory: its own limit) spends no maxRestarts and waits
        no backoff; nor does a lost node's (`restart_rules.restart_delay`).
        """
        policy = self.job.spec.run_policy
        if counted and restart_rules.restarts_spent(policy, self.status.restarts):
            self.finish("Failed", "MaxRestartsExceeded",
                        f"{message}; the job already restarted {self.status.restarts} times "
                        f"(runPolicy.maxRestarts: {policy.max_restarts})")
            return
        if counted:
            self.status.restarts += 1
        self.status.restart_attempt += 1
        self.status.last_restart_time = self.now
        self.status.restart = RestartStatus(reason=reason, attempt=self.status.restart_attempt,
                                            time=self.now, counted=counted,
                                            whole_group=whole_group)
        self.status.phase = "Restarting"
        replaced = self.live_pods() if whole_group else self.replaced_with(broken)
        scope = "the whole group" if whole_group else ", ".join(pod.name for pod in replaced)
        resume = "workers resume from the latest checkpoint"
        if self.job.spec.fault_tolerance is not None and not whole_group:
            self.count_group_restarts(replaced)
            groups = sorted({str(replica_group_of(self.job, pod.index)) for pod in replaced})
            scope = f"replica group {', '.join(groups)} ({scope})"
            resume = ("the other replica groups train on, and the restarted group heals from "
                      "a live one (from the latest checkpoint when none is live)")
        delay = restart_rules.restart_delay(policy, self.status.restarts, counted=counted,
                                            node_lost=reason in NO_BACKOFF_REASONS)
        which = (f"restart {self.status.restarts} of {policy.max_restarts}" if counted
                 else "not counted in runPolicy.maxRestarts")
        text = f"{message}: restarting {scope} ({which}, in {delay:g}s); {resume}"
        self.condition("Restarting", True, reason, text)
        self.condition("Running", False, reason)
        self.event(reason, text, warning=True)
        self.actions.append(CountRestart(reason, hang=reason == "ProgressDeadlineExceeded"))
        for pod in replaced:
            self.delete(pod, reason)
