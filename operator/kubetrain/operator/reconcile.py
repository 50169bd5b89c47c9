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
(stragglers, avoidance, lost nodes), and the failures and restarts below.

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
- a step that has not advanced for progressDeadlineSeconds restarts the group;
- every restart counts against maxRestarts and waits an exponential backoff.

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
from datetime import datetime, timedelta
from typing import Any, Literal

from kubetrain.api.trainingjob import (
    Condition,
    EffectiveBatch,
    FailureStreak,
    RankSlowness,
    TrainingJob,
    TrainingJobStatus,
    WorkerFailure,
)
from kubetrain.operator import avoidance, children, lifecycle, nodes, observation
from kubetrain.operator.actions import (
    Action,
    CountFailure,
    CountRestart,
    CreateObject,
    DeleteJob,
    DeletePod,
    RecordEvent,
    UpdateConfigMap,
    WriteStatus,
)
from kubetrain.operator.failures import classify, describe
from kubetrain.operator.lifecycle import INVALID_SPEC
from kubetrain.operator.observation import goodput_status
from kubetrain.operator.observed import (
    DISRUPTION_REASONS,
    Observed,
    TrainerFailure,
    WorkerPod,
)
from kubetrain.protocol import OUT_OF_MEMORY_CLASSES

# The actions (kubetrain.operator.actions) are read from here by the handlers and tests.
__all__ = [
    "HUNG_GROUP_GRACE_SECONDS", "Action", "CountFailure", "CountRestart", "CreateObject",
    "DeleteJob", "DeletePod", "RecordEvent", "UpdateConfigMap", "WriteStatus", "goodput_status",
    "merge_patch", "reconcile", "reject",
]

FINISHED = ("Succeeded", "Failed")
# Seconds a hung group's pods get between SIGTERM and SIGKILL: enough to flush logs.
HUNG_GROUP_GRACE_SECONDS = 5

# The trainer's exit code for "another rank was signalled; restart me into the new group".
RESTART_ME_EXIT_CODE = 75
# status.lastFailure.message is cut here: a termination message may hold 4 KiB.
FAILURE_MESSAGE_LIMIT = 1024
# Restarts that re-form the whole group: a hang, a new micro-batch every rank must use,
# and a failed preflight (every rank takes part in the check).
WHOLE_GROUP_REASONS = ("ProgressDeadlineExceeded", "OutOfMemory", "PreflightFailed")
# Restarts with their own limit instead of maxRestarts, and no backoff (nothing to wait out).
UNCOUNTED_REASONS = ("OutOfMemory", "StragglerReplaced")
ESTIMATE_ADVICE = (
    "run `kubetrain estimate` on the job for a configuration that fits: activation "
    "checkpointing (parallelism.activationCheckpointing), more workers with strategy fsdp, "
    "or more memory per worker (spec.workers.resources.limits.memory)")


# --- the decision -------------------------------------------------------------------


def backoff_seconds(job: TrainingJob, restarts: int) -> float:
    """Delay before the `restarts`-th restart's pods are created: doubles each time, capped."""
    policy = job.spec.run_policy
    if restarts <= 0:
        return 0.0
    return float(min(policy.backoff_seconds * 2 ** (restarts - 1), policy.max_backoff_seconds))


def failure_class(pod: WorkerPod, permanent_exit_codes: list[int]) -> str:
    """`permanent`, `retryable` or `code` (a plain non-zero exit: retried until it repeats)."""
    if pod.exit_code is not None and pod.exit_code in permanent_exit_codes:
        return "permanent"
    if (pod.exit_code is None or pod.exit_code >= 128 or pod.exit_code == RESTART_ME_EXIT_CODE
            or pod.node_lost or pod.reason in DISRUPTION_REASONS):
        return "retryable"
    return "code"


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
        no backoff.
        """
        policy = self.job.spec.run_policy
        if counted and self.status.restarts >= policy.max_restarts:
            self.finish("Failed", "MaxRestartsExceeded",
                        f"{message}; the job already restarted {self.status.restarts} times "
                        f"(runPolicy.maxRestarts: {policy.max_restarts})")
            return
        if counted:
            self.status.restarts += 1
        self.status.restart_attempt += 1
        self.status.last_restart_time = self.now
        self.status.phase = "Restarting"
        scope = "the whole group" if whole_group else ", ".join(pod.name for pod in broken)
        delay = backoff_seconds(self.job, self.status.restarts) if counted else 0.0
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

    # --- what the failure policy reads of nodes, lifecycle and observation -------------
    # (it calls those modules directly once it has a module of its own)

    @property
    def world_size(self) -> int:
        return observation.world_size(self.job)

    def avoid_node(self, node: str | None, reason: avoidance.AvoidReason, message: str) -> None:
        nodes.avoid_node(self, node, reason, message)

    def count_node_failures(self, failed: list[WorkerPod], kinds: dict[str, str]) -> None:
        nodes.count_node_failures(self, failed, kinds)

    def job_as_run(self) -> TrainingJob:
        return lifecycle.job_as_run(self.job, self.status)

    # --- failures and restarts -----------------------------------------------------------

    def broken(self, pods: list[WorkerPod]) -> tuple[list[WorkerPod], list[WorkerPod]]:
        """Of `pods`: the failed ones (or lost with their node), and those stuck Pending."""
        policy = self.job.spec.run_policy
        failed = [pod for pod in pods if pod.phase == "Failed" or (pod.node_lost and pod.active)]
        stuck: list[WorkerPod] = []
        if policy.pending_deadline_seconds is not None:
            limit = timedelta(seconds=policy.pending_deadline_seconds)
            stuck = [pod for pod in pods if pod.phase == "Pending" and not pod.node_lost
                     and pod.name not in self.held_back
                     and pod.created_at is not None and self.now >= pod.created_at + limit]
        return failed, stuck

    def continue_restart(self) -> None:
        """Delete, without counting again, the pods the restart in progress already covers.

        A restart is recorded in status (restarts, restartAttempt) before its pods are
        deleted, so an operator stopped in between finds them still there; a worker may
        also break while the group re-forms. While the job is Restarting, a pod labelled
        with an older restart attempt belongs to that restart: a broken one is replaced
        within it, and in a whole-group restart (worker 0 broke, or a hang) every older
        pod goes. Permanent failures are left to `handle_failures`: they still fail the job.
        """
        status = self.status
        if status.phase != "Restarting":
            return
        older = [pod for pod in self.live_pods() if pod.restart_attempt < status.restart_attempt]
        failed, stuck = self.broken(older)
        codes = self.job.spec.run_policy.permanent_exit_codes
        covered = [pod for pod in failed if failure_class(pod, codes) != "permanent"] + stuck
        restarting = next((c for c in status.conditions if c.type == "Restarting"), None)
        reason = (restarting.reason if restarting is not None else None) or "Restarting"
        whole_group = (reason in WHOLE_GROUP_REASONS
                       or any(pod.index == 0 for pod in covered))
        for pod in older if whole_group else covered:
            self.delete(pod, reason)

    def handle_failures(self) -> None:
        """Fail the job or restart workers for failed, lost and stuck pods."""
        policy = self.job.spec.run_policy
        failed, stuck = self.broken(
            [pod for pod in self.live_pods() if pod.index < self.replicas])
        if not failed and not stuck:
            return

        kinds = {pod.name: classify(pod, policy.permanent_exit_codes) for pod in failed}
        self.record_failures(failed, kinds)
        classes = {pod.name: failure_class(pod, policy.permanent_exit_codes) for pod in failed}
        permanent = [pod for pod in failed if classes[pod.name] == "permanent"]
        if permanent:
            self.finish("Failed", "PermanentError",
                        f"{describe(permanent[0], kinds[permanent[0].name])}, listed in "
                        "runPolicy.permanentExitCodes: fix the configuration or code and "
                        "create the job again")
            return
        broken = failed + stuck
        out_of_memory = [pod for pod in failed if kinds[pod.name] in OUT_OF_MEMORY_CLASSES]
        if out_of_memory:
            self.heal_out_of_memory(out_of_memory[0], kinds[out_of_memory[0].name], broken)
            return
        preflight = [pod for pod in failed if kinds[pod.name] == "PreflightFailed"]
        if preflight:
            self.fail_preflight(preflight, kinds, broken)
            return
        self.count_node_failures(failed, kinds)
        coded = [pod for pod in failed if classes[pod.name] == "code"]
        if coded and self.repeated_failure(coded[0], kinds[coded[0].name]):
            return

        if failed:
            reason = "NodeLost" if all(pod.node_lost for pod in failed) else "WorkerFailed"
            message = "; ".join(describe(pod, kinds[pod.name]) for pod in failed)
        else:
            reason = "PendingTimeout"
            message = "; ".join(f"{pod.name} was Pending for over "
                                f"{policy.pending_deadline_seconds}s" for pod in stuck)
        self.restart(reason, message, broken, whole_group=any(pod.index == 0 for pod in broken))

    def record_failures(self, failed: list[WorkerPod], kinds: dict[str, str]) -> None:
        """status.lastFailure and the counts by class, an event and a metric per failed pod.

        Runs once per failure: the same pass restarts the pods (or ends the job), and a
        restart in progress covers any pod that fails before it is replaced.
        """
        # The most telling failure is the last one: the others are often its consequence
        # (a rank out of memory breaks its peers' collectives, which end Unknown).
        ranked = sorted(failed, key=lambda pod: kinds[pod.name] != "Unknown")
        for pod in ranked:
            kind = kinds[pod.name]
            text = describe(pod, kind)
            node = pod.node or "an unknown node"
            self.status.failures[kind] = self.status.failures.get(kind, 0) + 1
            self.status.last_failure = WorkerFailure(
                class_=kind, pod=pod.name, node=pod.node, exit_code=pod.exit_code,
                message=text[:FAILURE_MESSAGE_LIMIT], time=self.now)
            self.event("WorkerFailure", f"{pod.name} on {node}: {kind}: {text}", warning=True)
            self.actions.append(CountFailure(kind))

    def fail_preflight(self, failed: list[WorkerPod], kinds: dict[str, str],
                       broken: list[WorkerPod]) -> None:
        """Avoid the nodes the preflight check named and restart the whole group without
        them: a counted restart, so a check that fails on every node ends the job."""
        said = "; ".join(describe(pod, kinds[pod.name]) for pod in failed)
        named: set[str] = set()
        for pod in failed:
            if pod.trainer_failure is not None:
                named |= set(pod.trainer_failure.nodes) | self.unreported_nodes(
                    pod.trainer_failure)
        nodes = sorted(named)
        for node in nodes:
            self.avoid_node(node, "PreflightFailed", said)
        where = f" on {', '.join(nodes)}" if nodes else " (the trainer named no node)"
        self.restart("PreflightFailed", f"the preflight check failed{where}: {said}", broken,
                     whole_group=True)

    def unreported_nodes(self, failure: TrainerFailure) -> set[str]:
        """The nodes of this attempt's pods where no rank reported to the preflight check.

        A rank stopped before it ran its check never said where it runs; the trainer then
        lists the nodes of the ranks that did report, and the failing ones are the group's
        other nodes. None when every pod shares a node with a rank that reported.
        """
        if not failure.reported_nodes:
            return set()
        attempt = [pod for pod in self.observed.pods
                   if pod.restart_attempt == self.status.restart_attempt and pod.node]
        return {pod.node for pod in attempt if pod.node} - set(failure.reported_nodes)

    def heal_out_of_memory(self, pod: WorkerPod, kind: str, broken: list[WorkerPod]) -> None:
        """Restart the group with half the micro-batch, or fail with reason OutOfMemory."""
        spec = self.job.spec
        effective = self.status.effective
        assert effective is not None  # observe_effective set it
        current = effective.micro_batch_size
        what = f"{describe(pod, kind)}: out of memory at micro-batch {current}"
        advice = ESTIMATE_ADVICE
        if pod.trainer_failure is not None and "kubetrain estimate" in pod.trainer_failure.message:
            advice = "see kubetrain estimate's advice above"
        smaller, why = spec.after_out_of_memory(current, effective.out_of_memory_restarts)
        limit = spec.out_of_memory_restart_limit()
        if smaller is not None:
            accumulation = spec.gradient_accumulation(self.world_size, smaller)
            self.status.effective = EffectiveBatch(
                micro_batch_size=smaller, gradient_accumulation_steps=accumulation,
                out_of_memory_restarts=effective.out_of_memory_restarts + 1,
                spec_micro_batch_size=spec.optimization.micro_batch_size,
                reason=f"{pod.name} {kind} at micro-batch {current}", time=self.now)
            self.event("MicroBatchHalved",
                       f"{pod.name} ran out of memory ({kind}) at micro-batch {current}: the "
                       f"group restarts with micro-batch {smaller} and gradient accumulation "
                       f"{accumulation} (global batch unchanged; the spec is not changed, "
                       f"status.effective holds the values; out-of-memory restart "
                       f"{effective.out_of_memory_restarts + 1} of at most {limit})")
            self.restart("OutOfMemory", what, broken, whole_group=True, counted=False)
            # Before any replacement exists: the new pods read the new micro-batch.
            self.actions.append(UpdateConfigMap(children.config_map(self.job_as_run())))
            return
        self.finish("Failed", "OutOfMemory", f"{what}, and {why}: {advice}")

    def repeated_failure(self, pod: WorkerPod, kind: str) -> bool:
        """Track the streak of one exit code; True when it failed the job."""
        assert pod.exit_code is not None  # "code" failures always have one
        step = self.status.progress.step
        streak = self.status.failure_streak
        if streak is not None and streak.exit_code == pod.exit_code and streak.step == step:
            streak.count += 1
        else:
            streak = self.status.failure_streak = FailureStreak(
                exit_code=pod.exit_code, count=1, step=step)
        limit = self.job.spec.run_policy.repeated_failure_limit
        if streak.count < limit:
            return False
        self.finish("Failed", "RepeatedFailure",
                    f"{describe(pod, kind)} in {streak.count} attempts in a row with no progress "
                    f"past step {step} (runPolicy.repeatedFailureLimit: {limit}): check the "
                    "trainer's logs (kubectl logs)")
        return True

    def detect_hang(self) -> None:
        deadline = self.job.spec.run_policy.progress_deadline_seconds
        if deadline is None or self.status.phase != "Running":
            return
        marks = [self.status.progress.updated_at, self.status.last_restart_time,
                 self.condition_since("Running")]
        since = max((mark for mark in marks if mark is not None), default=None)
        if since is None or self.now < since + timedelta(seconds=deadline):
            return
        step = self.status.progress.step
        self.restart("ProgressDeadlineExceeded",
                     f"the training step ({step}) has not advanced for {deadline}s "
                     "(runPolicy.progressDeadlineSeconds)", [], whole_group=True)

    def backing_off(self) -> bool:
        """Whether the restart in progress still waits out its backoff: no pods yet."""
        if self.status.phase == "Restarting" and self.status.last_restart_time is not None:
            restarting = next((c for c in self.status.conditions if c.type == "Restarting"), None)
            uncounted = restarting is not None and restarting.reason in UNCOUNTED_REASONS
            delay = 0.0 if uncounted else backoff_seconds(self.job, self.status.restarts)
            if self.now < self.status.last_restart_time + timedelta(seconds=delay):
                return True
        return False


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
        lifecycle.clean_up(decision)
    elif job.spec.run_policy.suspend:
        status.workers.desired = 0
        lifecycle.suspend(decision)
    else:
        if status.phase == "Suspended":
            lifecycle.resume(decision)
        status.workers.desired = decision.replicas
        nodes.expire_avoidance(decision)
        lifecycle.ensure_service_and_config(decision)
        nodes.keep_schedulable(decision)
        decision.continue_restart()
        decision.handle_failures()
        if status.phase not in FINISHED:
            decision.detect_hang()
            nodes.replace_stragglers(decision)
        if status.phase not in FINISHED:
            lifecycle.scale(decision,
                            previous.workers.desired if previous.phase != "Suspended" else 0)
            if not decision.backing_off():
                lifecycle.create_missing(decision)
            lifecycle.update_phase(decision)
            nodes.report_avoidance(decision)
        else:
            lifecycle.clean_up(decision)

    return _with_status(decision.actions, previous, status)


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
