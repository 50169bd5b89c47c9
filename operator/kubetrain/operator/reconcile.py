"""The operator's decisions: `reconcile(job, observed, now) -> actions`, a pure function.

Level-based: the actions depend only on the job (spec and the status the operator
last wrote), the observed children and the time, so running it again after any
partial application, or after an operator restart, converges without duplicating
or orphaning a pod. The kopf handlers (`kubetrain.operator.handlers`) observe and
apply; nothing here performs I/O.

`ReconcilePass` holds one pass's state (the status being decided, the actions so far) and
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
  recreated, because the survivors cannot re-form without it; with spec.faultTolerance
  the broken pods' replica groups are recreated, each whole (one torchrun group each),
  and the other groups train on untouched, their lighthouse kept (`lifecycle`);
- while a restart is in progress, pods with an older restart-attempt label belong to
  it: they are replaced within it and never counted twice (also after an operator
  restart between recording a restart and deleting its pods);
- a trainer that torchrun restarts in place (its pod runs on) is recorded and counted
  while its pod's budget of restarts in place lasts, and ends the job only for a
  permanent or repeated exit code, which stops the pass there; past the budget its pod's
  own end is judged (kubetrain.operator.recovery);
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

from datetime import datetime
from typing import Any

from kubetrain.api.trainingjob import (
    FINISHED,
    Condition,
    TrainingJob,
    TrainingJobStatus,
)
from kubetrain.operator import kstatus, lifecycle, nodes, observation, recovery, scheduling
from kubetrain.operator.actions import (
    Action,
    RecordEvent,
    WriteStatus,
)
from kubetrain.operator.facts import Observed
from kubetrain.operator.lifecycle import INVALID_SPEC
from kubetrain.operator.reconcile_pass import ReconcilePass


def reconcile(job: TrainingJob, observed: Observed, now: datetime) -> list[Action]:
    """The actions that move the job's children and status towards its spec."""
    if job.spec.managed_elsewhere:
        return []  # another controller (spec.managedBy) runs it: no pods, no status writes
    previous = job.status or TrainingJobStatus()
    decision = ReconcilePass(job, observed, now, previous.model_copy(deep=True))
    lifecycle.retry_invalid_spec(decision)
    status = decision.status
    observation.observe(decision)
    scheduling.choose(decision)
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
        recovery.warn_unmarked_checkpoints(decision, [
            pod for pod in decision.live_pods() if pod.phase in FINISHED])
        lifecycle.clean_up(decision)
    elif job.spec.run_policy.suspend:
        status.workers.desired = 0
        lifecycle.suspend(decision)
        scheduling.release(decision)  # suspend releases the group and the Kueue Workload
    elif not scheduling.admit(decision):
        pass  # Kueue has not admitted the job (or evicted it): it waits suspended
    else:
        _run(decision, previous.workers.desired if previous.phase != "Suspended" else 0)
    if status.phase in FINISHED:
        scheduling.release(decision)  # the group's objects go; the Kueue Workload finishes

    kstatus.summarize(status, now)  # Ready, Reconciling, Stalled: from the phase just decided
    return _with_status(decision.actions, previous, status)


def _run(decision: ReconcilePass, previous_desired: int) -> None:
    """The steps of a job that is neither finished nor suspended, in order."""
    status = decision.status
    if status.phase == "Suspended":
        lifecycle.resume(decision)
    status.workers.desired = decision.replicas
    nodes.expire_avoidance(decision)
    nodes.lose_silent_pods(decision)
    lifecycle.ensure_service_and_config(decision)
    lifecycle.ensure_lighthouse(decision)
    nodes.keep_schedulable(decision)
    recovery.continue_restart(decision)
    recovery.record_restarts_in_place(decision)
    if status.phase in FINISHED:
        # A trainer's end ended the job (a permanent or repeated exit code): the pass stops
        # with the end recorded; every later step was for a running job, and the next pass
        # (the trainer's next end, a pod's event, the resync) cleans up the finished job.
        return
    recovery.handle_failures(decision)
    if status.phase not in FINISHED:
        recovery.detect_hang(decision)
        nodes.replace_stragglers(decision)
    if status.phase in FINISHED:
        lifecycle.clean_up(decision)
        return
    lifecycle.scale(decision, previous_desired)
    # The gang's objects before any pod: no pod is created without its group.
    if not recovery.wait_out_backoff(decision) and scheduling.ensure_group(decision):
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
