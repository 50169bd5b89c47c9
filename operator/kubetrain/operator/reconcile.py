"""The operator's decisions: `reconcile(job, observed, now) -> actions`, a pure function.

Level-based: the actions depend only on the job (spec and the status the operator
last wrote), the observed children and the time, so running it again after any
partial application, or after an operator restart, converges without duplicating
or orphaning a pod. The kopf handlers (`kubetrain.operator.handlers`) observe and
apply; nothing here performs I/O.

`_Decision` holds one pass's state (the status being decided, the actions so far) and
its primitives (condition, event, delete, finish, restart); `reconcile` runs the steps
in order. The steps live with their policy: `observation` (status from the children and
rank 0's metrics), `lifecycle` (phases, suspend, scale, children, clean-up), `nodes`
(stragglers, avoidance, lost nodes) and `restarts` (failed, stuck and hung workers,
under the rules `kubetrain.restart_rules` shares with `kubetrain run`).

Recovery policy, in the order it is checked:
- a finished job only cleans up (cleanPodPolicy) and expires (ttlSecondsAfterFinished);
- activeDeadlineSeconds fails the job; rank 0 exiting 0 completes it;
- suspend deletes the pods and keeps the job;
- every failed pod gets a failure class (kubetrain.operator.failures), recorded in
  status.lastFailure and status.failures, an event and a metric;
- a failed pod is classed by its exit code: permanent codes fail the job, the same
  non-signal code repeated without progress fails it, anything else is retried;
  pods on lost nodes and pods Pending past their deadline are retried too;
- a worker out of memory (OOMKilled, CUDAOutOfMemory) restarts the whole group with the
  micro-batch halved and the accumulation doubled (runPolicy.outOfMemory: Halve), written
  to status.effective and the ConfigMap, never to the spec; such restarts do not count
  against maxRestarts and need no backoff (the cause is fixed, not waited out); with
  nothing smaller left, or action Fail, the job fails with reason OutOfMemory;
- a retry replaces the broken pods under their names with the next restart-attempt
  label; when worker 0 (the rendezvous host) is among them, the whole group is
  recreated, because the survivors cannot re-form without it;
- while a restart is in progress, pods with an older restart-attempt label belong to
  it: they are replaced within it and never counted twice (also after an operator
  restart between recording a restart and deleting its pods);
- a trainer that torchrun restarts in place (its pod runs on) is recorded and counted
  while its pod's budget of restarts in place lasts, and ends the job only for a
  permanent or repeated exit code, which stops the pass there; past the budget its pod's
  own end is judged (kubetrain.operator.restarts);
- a step that has not advanced for progressDeadlineSeconds restarts the group;
- every restart counts against maxRestarts and waits an exponential backoff, but one
  for a lost node: its pods go to another node at once.

Slow and broken nodes (kubetrain.operator.nodes, with the rules of stragglers and
avoidance):
- a rank slower than runPolicy.stragglers allows, for its window of intervals, sets the
  Straggler condition and posts an event naming its pod, node and slowness; with action
  Replace its node is avoided and its pod deleted with the normal grace (the group
  checkpoints on the SIGTERM) and recreated off that node, the whole group when it is
  worker 0's; such restarts are not counted in maxRestarts but have their own limit
  (status.stragglerReplacements, at most maxRestarts);
- a PreflightFailed failure avoids the nodes the trainer named and restarts the group
  (a counted restart, so a check that keeps failing ends the job);
- two Unknown, CollectiveTimeout or GPUError failures on one node within an hour avoid it;
- avoided nodes (status.avoidedNodes) get a required anti-affinity on every pod created
  until they expire (runPolicy.avoidNodesFor); pods the avoidance leaves unschedulable
  either wait while the job runs elastic on minReplicas, or make it avoid less.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

from kubetrain import restart_rules
from kubetrain.api.trainingjob import (
    FINISHED,
    Condition,
    RankSlowness,
    RestartStatus,
    TrainingJob,
    TrainingJobStatus,
)
from kubetrain.operator import kstatus, lifecycle, nodes, observation, restarts
from kubetrain.operator.actions import (
    Action,
    CountFailure,
    CountRestart,
    CreateObject,
    DeleteJob,
    DeletePod,
    ReconcileAt,
    RecordEvent,
    UpdateConfigMap,
    WriteStatus,
)
from kubetrain.operator.lifecycle import INVALID_SPEC
from kubetrain.operator.observation import goodput_status
from kubetrain.operator.observed import Observed, WorkerPod

# The actions (kubetrain.operator.actions) are read from here by the handlers and tests.
__all__ = [
    "HUNG_GROUP_GRACE_SECONDS", "Action", "CountFailure", "CountRestart", "CreateObject",
    "DeleteJob", "DeletePod", "ReconcileAt", "RecordEvent", "UpdateConfigMap", "WriteStatus",
    "goodput_status", "merge_patch", "reconcile", "reject",
]

# Seconds a hung group's pods get between SIGTERM and SIGKILL: enough to flush logs.
HUNG_GROUP_GRACE_SECONDS = 5


# --- the decision -------------------------------------------------------------------


@dataclass
class _Decision:
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

    @property
    def name(self) -> str:
        return self.job.metadata.name

    @property
    def replicas(self) -> int:
        return self.job.spec.workers.replicas

    def live_pods(self) -> list[WorkerPod]:
        return [pod for pod in self.observed.pods
                if not pod.deleting and pod.name not in self.deleted]

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
        """Count a restart and delete the pods to replace (all of them for a whole-group one).

        An uncounted restart (out of memory: its own limit) spends no maxRestarts and waits
        no backoff; nor does a lost node's (`restarts.restart_delay`).
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
        scope = "the whole group" if whole_group else ", ".join(pod.name for pod in broken)
        delay = restarts.restart_delay(policy, self.status.restarts, reason, counted)
        which = (f"restart {self.status.restarts} of {policy.max_restarts}" if counted
                 else "not counted in runPolicy.maxRestarts")
        text = (f"{message}: restarting {scope} ({which}, in {delay:g}s); workers resume "
                "from the latest checkpoint")
        self.condition("Restarting", True, reason, text)
        self.condition("Running", False, reason)
        self.event(reason, text, warning=True)
        self.actions.append(CountRestart(reason, hang=reason == "ProgressDeadlineExceeded"))
        to_delete = self.live_pods() if whole_group else broken
        for pod in to_delete:
            self.delete(pod, reason)


def reconcile(job: TrainingJob, observed: Observed, now: datetime) -> list[Action]:
    """The actions that move the job's children and status towards its spec."""
    previous = job.status or TrainingJobStatus()
    decision = _Decision(job, observed, now, previous.model_copy(deep=True))
    lifecycle.retry_invalid_spec(decision)
    status = decision.status
    observation.observe(decision)
    nodes.release_pods_of_lost_nodes(decision)

    limit = job.spec.run_policy.active_deadline_seconds
    if status.phase in FINISHED:
        lifecycle.clean_up(decision)
    elif lifecycle.deadline_passed(limit, status.start_time, now):
        decision.finish("Failed", "DeadlineExceeded",
                        f"the job ran longer than runPolicy.activeDeadlineSeconds ({limit}s)")
        lifecycle.clean_up(decision)
    elif lifecycle.rank0_succeeded(observed.pods):
        decision.finish("Succeeded", "Completed", "worker 0 exited 0: training is complete")
        restarts.warn_unmarked_checkpoints(decision, [
            pod for pod in decision.live_pods() if pod.phase in FINISHED])
        lifecycle.clean_up(decision)
    elif job.spec.run_policy.suspend:
        status.workers.desired = 0
        lifecycle.suspend(decision)
    else:
        _run(decision, previous.workers.desired if previous.phase != "Suspended" else 0)

    kstatus.summarize(status, now)  # Ready, Reconciling, Stalled: from the phase just decided
    return _with_status(decision.actions, previous, status)


def _run(decision: _Decision, previous_desired: int) -> None:
    """The steps of a job that is neither finished nor suspended, in order."""
    status = decision.status
    if status.phase == "Suspended":
        lifecycle.resume(decision)
    status.workers.desired = decision.replicas
    nodes.expire_avoidance(decision)
    nodes.lose_silent_pods(decision)
    lifecycle.ensure_service_and_config(decision)
    nodes.keep_schedulable(decision)
    restarts.continue_restart(decision)
    restarts.record_restarts_in_place(decision)
    if status.phase in FINISHED:
        # A trainer's end ended the job (a permanent or repeated exit code): the pass stops
        # with the end recorded; every later step was for a running job, and the next pass
        # (the trainer's next end, a pod's event, the resync) cleans up the finished job.
        return
    restarts.handle_failures(decision)
    if status.phase not in FINISHED:
        restarts.detect_hang(decision)
        nodes.replace_stragglers(decision)
    if status.phase in FINISHED:
        lifecycle.clean_up(decision)
        return
    lifecycle.scale(decision, previous_desired)
    if not restarts.wait_out_backoff(decision):
        lifecycle.create_missing(decision)
    lifecycle.update_phase(decision)
    nodes.report_avoidance(decision)
    nodes.report_memory_copies(decision)


def reject(job_status: dict[str, Any] | None, generation: int | None, message: str,
           now: datetime) -> list[Action]:
    """Actions for a job whose spec does not parse: Failed with reason InvalidSpec, once."""
    previous = TrainingJobStatus.model_validate(job_status or {})
    status = previous.model_copy(deep=True)
    already = any(c.type == "Failed" and c.status == "True" and c.reason == INVALID_SPEC
                  and c.message == message for c in status.conditions)
    actions: list[Action] = []
    if not already:
        status.phase = "Failed"
        status.completion_time = now
        status.conditions = [c for c in status.conditions if c.type != "Failed"] + [Condition(
            type="Failed", status="True", reason=INVALID_SPEC, message=message,
            last_transition_time=now)]
        actions.append(RecordEvent("Warning", INVALID_SPEC, message))
    status.observed_generation = generation
    kstatus.summarize(status, now)
    return _with_status(actions, previous, status)


def merge_patch(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """The JSON merge patch (RFC 7386) that turns `old` into `new`; empty when equal."""
    patch: dict[str, Any] = {key: None for key in old.keys() - new.keys()}
    for key, value in new.items():
        if isinstance(value, dict) and isinstance(old.get(key), dict):
            nested = merge_patch(old[key], value)
            if nested:
                patch[key] = nested
        elif key not in old or old[key] != value:
            patch[key] = value
    return patch


def _with_status(actions: list[Action], previous: TrainingJobStatus,
                 status: TrainingJobStatus) -> list[Action]:
    """Prepend the status write when the status changed: it records each decision first."""
    patch = merge_patch(previous.wire(), status.wire())
    if not patch:
        return actions
    return [WriteStatus(status.wire(), patch), *actions]
