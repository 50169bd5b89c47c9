"""Failures and restarts: the steps of a reconcile pass that answer failed, lost, stuck and
hung workers, and the pure functions that decide them.

- a restart in progress (status.restart) covers the pods of older restart attempts that
  break while the group re-forms: they are replaced within it, never counted twice
  (`continue_restart`), and its replacements wait out its backoff (`wait_out_backoff`);
- every failed pod is classed (`kubetrain.operator.failures`) and recorded in
  status.lastFailure and status.failures, with an event and a metric; so is every trainer
  failure that torchrun restarted in place, which only its lifeline shows
  (`record_restarts_in_place`, `kubetrain.operator.lifeline_watch`). torchrun restarts a pod's
  trainers in place while that pod's budget (PET_MAX_RESTARTS = runPolicy.maxRestarts,
  `restart_rules.restarts_in_place`) lasts: such a restart is counted in status.restarts
  and shown, and ends the job only for a permanent or repeated exit code, never for
  maxRestarts (`count_restart_in_place`); past the budget the pod ends, and its own end is
  judged as any failed pod's (an out-of-memory kill halves the micro-batch);
- then, in order: a permanent exit code fails the job; out of memory restarts the
  group with half the micro-batch or fails it; a failed preflight avoids the nodes it
  named and restarts the group; repeated failures on one node avoid it; the same exit
  code repeated with no progress fails the job; anything else restarts the broken pods,
  the whole group when worker 0 (the rendezvous host) is among them, or with
  spec.faultTolerance the broken pods' replica groups, whole, and no other
  (`handle_failures`, `ReconcilePass.replaced_with`). A group that lost its quorum
  (QuorumLost) is one of them: when every group lost it, every group restarts, and they
  resume from the latest checkpoint together;
- a step that has not advanced for progressDeadlineSeconds restarts the group
  (`detect_hang`).

The rules themselves (retry kinds, the streak, backoff, maxRestarts, halving, the advice)
are `kubetrain.restart_rules`, which `kubetrain run` applies too. The steps read and write
the pass's `ReconcilePass` (`kubetrain.operator.reconcile_pass`) through its primitives; no
Kubernetes, no clock but the pass's `now`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Final

from kubetrain import pod_conventions
from kubetrain import restart_rules as rules
from kubetrain.api.trainingjob import (
    RestartStatus,
    RunPolicy,
    TrainingJobStatus,
    WorkerFailure,
)
from kubetrain.memory_budget import out_of_memory_note
from kubetrain.operator import children, lifecycle, nodes, observation
from kubetrain.operator.actions import CountFailure, CountRestart, ReconcileAt, UpdateConfigMap
from kubetrain.operator.facts import (
    DISRUPTION_REASONS,
    IN_PLACE,
    TrainerEnd,
    TrainerFailure,
    WorkerPod,
)
from kubetrain.operator.failures import classify, describe
from kubetrain.operator.reconcile_pass import NO_BACKOFF_REASONS, ReconcilePass

# status.lastFailure.message is cut here: a termination message may hold 4 KiB.
FAILURE_MESSAGE_LIMIT: Final = 1024
# A pod that fails this soon after its trainer's end was recorded as a restart in place
# failed as a whole (`_retract_restart_in_place`).
IN_PLACE_RETRACT_SECONDS: Final = 10
# The reason of a restart torchrun did in place: its event, and the restarts metric's label.
RESTARTED_IN_PLACE: Final = "RestartedInPlace"
# Trainer ends this close after a recorded one are the same restart in place: the ranks of
# a hung group time out of one collective together. torchrun's next round takes longer
# (start-up, rendezvous, checkpoint load) before a trainer can fail again.
IN_PLACE_INCIDENT_SECONDS: Final = 5
# Restarts that re-form the whole group: a hang, a new micro-batch every rank must use,
# and a failed preflight (every rank takes part in the check). Read only for a restart
# an operator recorded before status.restart said so itself.
WHOLE_GROUP_REASONS: Final = ("ProgressDeadlineExceeded", "OutOfMemory", "PreflightFailed")
# Restarts with their own limit instead of maxRestarts, and no backoff (nothing to wait
# out). Read only for a restart recorded before status.restart, as above.
UNCOUNTED_REASONS: Final = ("OutOfMemory", "StragglerReplaced")
# How status.lastFailure's message ends for a trainer's end past its pod's budget of
# restarts in place, instead of the lifeline's IN_PLACE: the pod's own end follows.
LEFT_TO_THE_POD: Final = ("torchrun has no restart in place left in this pod "
                          "(runPolicy.maxRestarts): the pod ends")


# --- pure rules ---------------------------------------------------------------------------


def retry_kind_of(pod: WorkerPod, permanent_exit_codes: Collection[int]) -> rules.RetryKind:
    """The pod's retry kind (`kubetrain.restart_rules.retry_kind`): from its exit code, its
    failure class, and whether Kubernetes or its node ended it."""
    return rules.retry_kind(pod.exit_code, permanent_exit_codes,
                            failure_class=classify(pod, permanent_exit_codes),
                            disrupted=pod.node_lost or pod.reason in DISRUPTION_REASONS)


def broken(pods: list[WorkerPod], policy: RunPolicy, held_back: Collection[str],
           now: datetime) -> tuple[list[WorkerPod], list[WorkerPod]]:
    """Of `pods`: the failed ones (or lost with their node), and those stuck Pending past
    runPolicy.pendingDeadlineSeconds (not those avoidance holds back, nor those a scheduling
    gate holds: Kueue's pod integration waiting to admit the group)."""
    failed = [pod for pod in pods if pod.phase == "Failed" or (pod.node_lost and pod.active)]
    stuck: list[WorkerPod] = []
    if policy.pending_deadline_seconds is not None:
        limit = timedelta(seconds=policy.pending_deadline_seconds)
        stuck = [pod for pod in pods if pod.phase == "Pending" and not pod.node_lost
                 and pod.name not in held_back and not pod.gated
                 and pod.created_at is not None and now >= pod.created_at + limit]
    return failed, stuck


def restart_in_progress(status: TrainingJobStatus) -> RestartStatus | None:
    """The restart the job is in (phase Restarting), from status.restart.

    A status an operator wrote before status.restart existed has the reason only in the
    Restarting condition; the rest follows from it as that operator decided it.
    """
    if status.phase != "Restarting":
        return None
    restart = status.restart
    if restart is not None and restart.attempt == status.restart_attempt:
        return restart
    condition = next((c for c in status.conditions if c.type == "Restarting"), None)
    reason = (condition.reason if condition is not None else None) or "Restarting"
    return RestartStatus(reason=reason, attempt=status.restart_attempt,
                         time=status.last_restart_time or datetime.min.replace(tzinfo=UTC),
                         counted=reason not in UNCOUNTED_REASONS,
                         whole_group=reason in WHOLE_GROUP_REASONS)


def replacements_due(status: TrainingJobStatus, policy: RunPolicy) -> datetime | None:
    """When the restart in progress may create its pods: after its delay
    (`restart_rules.restart_delay`); None
    when no restart is in progress."""
    restart = restart_in_progress(status)
    if restart is None:
        return None
    delay = rules.restart_delay(policy, status.restarts, counted=restart.counted,
                                node_lost=restart.reason in NO_BACKOFF_REASONS)
    return restart.time + timedelta(seconds=delay)


def covered_by_restart(restart: RestartStatus, older: list[WorkerPod], policy: RunPolicy,
                       held_back: Collection[str], now: datetime,
                       moved_off: Collection[str] = (),
                       group_of: Callable[[int], int | None] | None = None) -> list[WorkerPod]:
    """The pods of older restart attempts that the restart in progress deletes.

    A broken one is replaced within it, and in a whole-group restart (or once worker 0
    breaks) every older pod goes; with replica groups (`group_of`, a worker index's group:
    spec.faultTolerance), every older pod of a broken one's group, and worker 0 is no
    other group's host. So does one on a straggler's node the restart began to avoid
    (`moved_off`): a straggler's pod that a Replace had recorded but not yet deleted when
    the operator stopped, which nothing else would ever move. Permanent failures are not
    covered: they still fail the job.
    """
    failed, stuck = broken(older, policy, held_back, now)
    codes = policy.permanent_exit_codes
    covered = [pod for pod in failed if retry_kind_of(pod, codes) != "permanent"] + stuck
    covered += [pod for pod in older
                if pod.node in moved_off and pod not in covered and not pod.deleting]
    if restart.whole_group:
        return older
    if group_of is not None:
        groups = {group_of(pod.index) for pod in covered}
        return [pod for pod in older if group_of(pod.index) in groups]
    if any(pod.index == 0 for pod in covered):
        return older
    return covered


def most_telling_last(failed: list[WorkerPod], kinds: Mapping[str, str]) -> list[WorkerPod]:
    """The failed pods in the order they are recorded: the one status.lastFailure keeps
    last. The others are often its consequence: a rank out of memory breaks its peers'
    collectives, which end Unknown."""
    return sorted(failed, key=lambda pod: kinds[pod.name] != "Unknown")


def unreported_nodes(failure: TrainerFailure, pods: list[WorkerPod], attempt: int) -> set[str]:
    """The nodes of the attempt's pods where no rank reported to the preflight check.

    A rank stopped before it ran its check never said where it runs; the trainer then
    lists the nodes of the ranks that did report, and the failing ones are the group's
    other nodes. None when every pod shares a node with a rank that reported.
    """
    if not failure.reported_nodes:
        return set()
    return ({pod.node for pod in pods if pod.restart_attempt == attempt and pod.node}
            - set(failure.reported_nodes))


def preflight_nodes(failed: list[WorkerPod], pods: list[WorkerPod], attempt: int) -> list[str]:
    """The nodes a failed preflight check names: those the trainer said failed, and those
    where no rank reported."""
    named: set[str] = set()
    for pod in failed:
        if pod.trainer_failure is not None:
            named |= set(pod.trainer_failure.nodes) | unreported_nodes(
                pod.trainer_failure, pods, attempt)
    return sorted(named)


def restart_cause(failed: list[WorkerPod], stuck: list[WorkerPod], kinds: Mapping[str, str],
                  policy: RunPolicy) -> tuple[str, str]:
    """The reason and message of a restart for `failed` and `stuck` pods."""
    if failed:
        reason = "NodeLost" if all(pod.node_lost for pod in failed) else "WorkerFailed"
        return reason, "; ".join(describe(pod, kinds[pod.name]) for pod in failed)
    return "PendingTimeout", "; ".join(
        f"{pod.name} was Pending for over {policy.pending_deadline_seconds}s" for pod in stuck)


# --- the steps ------------------------------------------------------------------------------


def wait_out_backoff(decision: ReconcilePass) -> bool:
    """Whether the restart in progress still waits out its backoff: then it creates no pods
    yet, and asks for the pass that will, when the backoff ends."""
    due = replacements_due(decision.status, decision.job.spec.run_policy)
    if due is None or decision.now >= due:
        return False
    decision.actions.append(ReconcileAt(due))
    return True


def continue_restart(decision: ReconcilePass) -> None:
    """Delete, without counting again, the pods the restart in progress already covers.

    A restart is recorded in status (restarts, restartAttempt, restart) before its pods
    are deleted, so an operator stopped in between finds them still there; a worker may
    also break while the group re-forms. While the job is Restarting, a pod labelled
    with an older restart attempt belongs to that restart (`covered_by_restart`).
    """
    status = decision.status
    restart = restart_in_progress(status)
    if restart is None:
        return
    older = [pod for pod in decision.live_pods() if pod.restart_attempt < status.restart_attempt]
    # The straggler's node a Replace began to avoid: its pod moves off it. A node avoided
    # for its failures keeps the live pods on it (a replica group there trains on); they
    # move off it if they fail there.
    moved_off = {entry.node for entry in status.avoided_nodes
                 if entry.time >= restart.time and entry.reason == "Straggler"}
    job = decision.job
    group_of = (None if job.spec.fault_tolerance is None
                else functools.partial(pod_conventions.replica_group_of, job))
    for pod in covered_by_restart(restart, older, job.spec.run_policy,
                                  decision.held_back, decision.now, moved_off, group_of):
        decision.delete(pod, restart.reason)


def handle_failures(decision: ReconcilePass) -> None:
    """Fail the job or restart workers for failed, lost and stuck pods: the failed ones as
    `kubetrain.restart_rules.judge` answers them, which `kubetrain run` asks too."""
    policy = decision.job.spec.run_policy
    failed, stuck = broken([pod for pod in decision.live_pods() if pod.index < decision.replicas],
                           policy, decision.held_back, decision.now)
    if not failed and not stuck:
        return
    kinds = {pod.name: classify(pod, policy.permanent_exit_codes) for pod in failed}
    record_failures(decision, failed, kinds)
    broken_pods = failed + stuck
    if failed:
        ends = [rules.Ended(pod.exit_code, kinds[pod.name],
                            retry_kind_of(pod, policy.permanent_exit_codes), pod.node_lost)
                for pod in failed]
        status = decision.status
        judgement = rules.judge(ends, status.failure_streak, status.progress.step, policy)
        pod = next(pod for pod, end in zip(failed, ends, strict=True)
                   if end is judgement.ended)
        if judgement.rule == "permanent":
            decision.finish("Failed", "PermanentError",
                            f"{describe(pod, kinds[pod.name])}, listed in "
                            "runPolicy.permanentExitCodes: fix the configuration or code and "
                            "create the job again")
            return
        if judgement.rule == "out_of_memory":
            heal_out_of_memory(decision, pod, kinds[pod.name], broken_pods)
            return
        if judgement.rule == "preflight":
            preflight = [one for one in failed if kinds[one.name] == "PreflightFailed"]
            fail_preflight(decision, preflight, kinds, broken_pods)
            return
        nodes.count_node_failures(decision, failed, kinds)
        status.failure_streak = judgement.streak
        if judgement.rule == "repeated":
            fail_repeated(decision, describe(pod, kinds[pod.name]))
            return
    reason, message = restart_cause(failed, stuck, kinds, policy)
    decision.restart(reason, message, broken_pods,
                     whole_group=decision.takes_every_worker(broken_pods))


def record_failures(decision: ReconcilePass, failed: list[WorkerPod],
                    kinds: Mapping[str, str]) -> None:
    """status.lastFailure and the counts by class, an event and a metric per failed pod.

    Runs once per failure: the same pass restarts the pods (or ends the job), and a
    restart in progress covers any pod that fails before it is replaced.
    """
    status = decision.status
    for pod in most_telling_last(failed, kinds):
        kind = kinds[pod.name]
        text = describe(pod, kind)
        _retract_restart_in_place(decision, pod)
        status.failures[kind] = status.failures.get(kind, 0) + 1
        status.last_failure = WorkerFailure(
            class_=kind, pod=pod.name, node=pod.node, exit_code=pod.exit_code,
            message=text[:FAILURE_MESSAGE_LIMIT], time=decision.now)
        decision.event("WorkerFailure", f"{pod.name} on {pod.node or 'an unknown node'}: "
                       f"{kind}: {text}", warning=True)
        decision.actions.append(CountFailure(kind))
    warn_unmarked_checkpoints(decision, failed)


def warn_unmarked_checkpoints(decision: ReconcilePass, ended: list[WorkerPod]) -> None:
    """A warning per ended own-code pod whose entry found checkpoint folders nobody marked
    complete, and so uploaded none of them (called once per ending pod)."""
    for pod in ended:
        if pod.unmarked_checkpoints:
            decision.event("CheckpointNotMarked", f"{pod.name}: checkpoint folders "
                           f"{', '.join(pod.unmarked_checkpoints)} were never marked complete, "
                           "so they were not uploaded and cannot be resumed from: call "
                           "kubetrain.sdk.mark_complete(folder, step) once each is written "
                           "(docs/own-code.md)", warning=True)


def _retract_restart_in_place(decision: ReconcilePass, pod: WorkerPod) -> None:
    """A pod that fails just after its trainer's end was recorded as a restart in place
    (its container was killed whole: the lifeline closed before the pod's status came)
    failed once: the pod's own record replaces that one in status.failures, and the restart
    that follows it replaces the in-place one in status.restarts (and its replica group's),
    and the streak."""
    status = decision.status
    last = status.last_failure
    if (last is None or last.pod != pod.name or last.time is None or not _trainer_end(last)
            or decision.now - last.time > timedelta(seconds=IN_PLACE_RETRACT_SECONDS)):
        return
    left = status.failures.get(last.class_, 0) - 1
    if left > 0:
        status.failures[last.class_] = left
    else:
        status.failures.pop(last.class_, None)
    if IN_PLACE not in last.message:
        return  # left to the pod (`LEFT_TO_THE_POD`): no restart was counted
    status.restarts = max(0, status.restarts - 1)
    decision.count_group_restarts([pod], -1)
    streak = status.failure_streak
    if streak is not None and last.exit_code == streak.exit_code:
        status.failure_streak = (streak.model_copy(update={"count": streak.count - 1})
                                 if streak.count > 1 else None)


def record_restarts_in_place(decision: ReconcilePass) -> None:
    """Record the trainer failures torchrun restarted in place, as `record_failures` does a
    failed pod's: status.lastFailure and the count by class, an event and a metric; and
    count each restart (`count_restart_in_place`) while the pod's budget of restarts in
    place lasts (`restart_rules.restarts_in_place`). Past it, the pod ends: the failure is
    shown as the lifeline told it, and the pod's own end is judged when it comes
    (`handle_failures`, which retracts this record then).

    The lifelines (`kubetrain.operator.lifeline_watch`) saw them; a pod's end is news while its
    pod still runs (a pod that failed, or is being deleted, is the pod's own story) and
    while it is newer than status.lastFailure, which records it once.
    """
    status = decision.status
    policy = decision.job.spec.run_policy
    running = {pod.name: pod for pod in decision.live_pods()
               if pod.phase == "Running" and pod.exit_code is None and not pod.node_lost}
    ends = decision.observed.trainer_ends
    for end in ends:
        pod = running.get(end.pod)
        last = status.last_failure
        if pod is None or (last is not None and last.time is not None and end.time <= last.time):
            continue
        done = restarts_in_place_done(pod, ends, end)
        in_place = rules.restarts_in_place(policy, done)
        message = (end.message if in_place else
                   f"{end.message.replace(IN_PLACE, '').rstrip('; ')}; {LEFT_TO_THE_POD}")
        status.failures[end.failure_class] = status.failures.get(end.failure_class, 0) + 1
        status.last_failure = WorkerFailure(
            class_=end.failure_class, pod=pod.name, node=pod.node, exit_code=end.exit_code,
            message=message[:FAILURE_MESSAGE_LIMIT], time=end.time)
        decision.event("WorkerFailure", f"{pod.name} on {pod.node or 'an unknown node'}: "
                       f"{end.failure_class}: {message}", warning=True)
        decision.actions.append(CountFailure(end.failure_class))
        if in_place and not count_restart_in_place(decision, end, last, done):
            return


def restarts_in_place_done(pod: WorkerPod, ends: Sequence[TrainerEnd], end: TrainerEnd) -> int:
    """The restarts in place torchrun did in `pod` before the one `end` belongs to, from its
    trainers' ends since the pod was created: ends within IN_PLACE_INCIDENT_SECONDS of the
    first of a restart are its other ranks (one restart, one of the budget). Only ends the
    lifelines still keep count (300 s; none from before an operator restart): an end then
    taken as within the budget is retracted when the pod's own end follows
    (`_retract_restart_in_place`)."""
    times = sorted({seen.time for seen in ends
                    if seen.pod == pod.name and seen.time < end.time
                    and (pod.created_at is None or seen.time >= pod.created_at)} | {end.time})
    done, first = -1, times[0]
    for time in times:
        if done < 0 or time - first > timedelta(seconds=IN_PLACE_INCIDENT_SECONDS):
            done, first = done + 1, time
    return done


def _trainer_end(failure: WorkerFailure) -> bool:
    """Whether status.lastFailure records a trainer's end its pod outlived, restarted in
    place or left to the pod."""
    return IN_PLACE in failure.message or LEFT_TO_THE_POD in failure.message


def same_restart_in_place(end: TrainerEnd, previous: WorkerFailure | None) -> bool:
    """Whether `end` belongs to the restart the previous status.lastFailure recorded (in
    place, or its pod's end): another rank's end within IN_PLACE_INCIDENT_SECONDS of it."""
    return (previous is not None and previous.time is not None and _trainer_end(previous)
            and timedelta(0) <= end.time - previous.time
            <= timedelta(seconds=IN_PLACE_INCIDENT_SECONDS))


def count_restart_in_place(decision: ReconcilePass, end: TrainerEnd,
                           previous: WorkerFailure | None = None, done_in_pod: int = 0) -> bool:
    """Count the group restart torchrun did in place after `end`, within its pod's budget
    (`done_in_pod` before it), or end the job: a permanent exit code fails it, and so does
    the same exit code repeated with no progress, as `handle_failures` and `kubetrain run`
    judge the same failure. Spent maxRestarts do not: torchrun restarts within its pod's
    budget whatever the job's count, so the restart counts in status.restarts, the backoff
    of later restarts and the progress deadline's start (status.lastRestartTime), and
    maxRestarts is judged at a pod's own end. Another rank's end in the same restart
    (`same_restart_in_place` with `previous`, the status.lastFailure before `end`) is a
    failure recorded, not a restart. False when the job ended.
    """
    if same_restart_in_place(end, previous):
        return True
    status = decision.status
    policy = decision.job.spec.run_policy
    what = f"{end.pod}'s trainer: {end.failure_class}: {end.message}"
    kind = rules.retry_kind(end.exit_code, policy.permanent_exit_codes,
                            failure_class=end.failure_class)
    if kind == "permanent":
        decision.finish("Failed", "PermanentError",
                        f"{what}; exit code {end.exit_code} is listed in "
                        "runPolicy.permanentExitCodes: fix the configuration or code and "
                        "create the job again")
        return False
    if kind == "code" and repeated_failure(decision, end.exit_code, what):
        return False
    status.restarts += 1
    status.last_restart_time = end.time
    decision.count_group_restarts(pod for pod in decision.observed.pods if pod.name == end.pod)
    decision.event(RESTARTED_IN_PLACE, f"{what}: restart {status.restarts} "
                   f"(runPolicy.maxRestarts: {policy.max_restarts}), done by torchrun inside "
                   f"the running pods: {end.pod}'s restart in place {done_in_pod + 1} of "
                   f"{policy.max_restarts}", warning=True)
    decision.actions.append(CountRestart(RESTARTED_IN_PLACE))
    return True


def fail_preflight(decision: ReconcilePass, failed: list[WorkerPod], kinds: Mapping[str, str],
                   broken_pods: list[WorkerPod]) -> None:
    """Avoid the nodes the preflight check named and restart the whole group without
    them: a counted restart, so a check that fails on every node ends the job."""
    said = "; ".join(describe(pod, kinds[pod.name]) for pod in failed)
    named = preflight_nodes(failed, list(decision.observed.pods), decision.status.restart_attempt)
    for node in named:
        nodes.avoid_node(decision, node, "PreflightFailed", said)
    where = f" on {', '.join(named)}" if named else " (the trainer named no node)"
    decision.restart("PreflightFailed", f"the preflight check failed{where}: {said}",
                     broken_pods, whole_group=True)


def heal_out_of_memory(decision: ReconcilePass, pod: WorkerPod, kind: str,
                       broken_pods: list[WorkerPod]) -> None:
    """Restart the group with half the micro-batch, or fail with reason OutOfMemory."""
    spec = decision.job.spec
    effective = decision.status.effective
    assert effective is not None  # observation set it
    current = effective.micro_batch_size
    what = f"{describe(pod, kind)}: out of memory at micro-batch {current}"
    # The in-memory tier's tmpfs counts against the cgroup; halving never shrinks it.
    tier = out_of_memory_note(spec) if kind == "OOMKilled" else ""
    what += f"; {tier}" if tier else ""
    verdict = rules.after_out_of_memory(
        spec, current, effective.out_of_memory_restarts, observation.world_size(decision.job),
        reason=f"{pod.name} {kind} at micro-batch {current}", now=decision.now)
    smaller = verdict.effective
    if smaller is None:
        said = pod.trainer_failure.message if pod.trainer_failure is not None else ""
        decision.finish("Failed", "OutOfMemory",
                        f"{what}, and {verdict.why_not}: {rules.estimate_advice(said)}")
        return
    decision.status.effective = smaller
    decision.event("MicroBatchHalved",
                   f"{pod.name} ran out of memory ({kind}) at micro-batch {current}: the group "
                   f"restarts with micro-batch {smaller.micro_batch_size} and gradient "
                   f"accumulation {smaller.gradient_accumulation_steps} (global batch "
                   "unchanged; the spec is not changed, status.effective holds the values; "
                   f"out-of-memory restart {smaller.out_of_memory_restarts} of at most "
                   f"{verdict.limit})" + (f"; {tier}" if tier else ""))
    decision.restart("OutOfMemory", what, broken_pods, whole_group=True, counted=False)
    # Before any replacement exists: the new pods read the new micro-batch.
    as_run = lifecycle.job_as_run(decision.job, decision.status)
    decision.actions.append(UpdateConfigMap(children.config_map(as_run)))


def repeated_failure(decision: ReconcilePass, exit_code: int | None, what: str) -> bool:
    """Lengthen the streak of a failure's exit code (`what` says which failure); True when
    it failed the job."""
    assert exit_code is not None  # "code" failures always have one
    status = decision.status
    streak = status.failure_streak = rules.next_streak(status.failure_streak, exit_code,
                                                       status.progress.step)
    if not rules.repeated(streak, decision.job.spec.run_policy):
        return False
    fail_repeated(decision, what)
    return True


def fail_repeated(decision: ReconcilePass, what: str) -> None:
    """Fail the job for the streak in status.failureStreak, which reached its limit."""
    streak = decision.status.failure_streak
    assert streak is not None
    policy = decision.job.spec.run_policy
    decision.finish("Failed", "RepeatedFailure",
                    f"{what} in {streak.count} attempts in a row with no "
                    f"progress past step {streak.step} (runPolicy.repeatedFailureLimit: "
                    f"{policy.repeated_failure_limit}): check the trainer's logs (kubectl logs)")


def detect_hang(decision: ReconcilePass) -> None:
    """Restart the whole group when the step has not advanced for longer than its deadline
    (`restart_rules.hang_deadline`, `is_hung`): since the last step, the last restart, or
    the group running; startupDeadlineSeconds, where set, until the attempt's first step."""
    status = decision.status
    if status.phase != "Running":
        return
    stepped_at = status.progress.updated_at
    attempt = max((mark for mark in (status.last_restart_time, decision.condition_since("Running"))
                   if mark is not None), default=None)
    stepped = stepped_at is not None and (attempt is None or stepped_at > attempt)
    deadline, field = rules.hang_deadline(decision.job.spec.run_policy, stepped)
    since = stepped_at if stepped else attempt
    if (deadline is None or since is None
            or not rules.is_hung((decision.now - since).total_seconds(), deadline)):
        return
    what = (f"the training step ({status.progress.step}) has not advanced for {deadline}s"
            if stepped else f"the attempt has taken no training step in {deadline}s")
    decision.restart("ProgressDeadlineExceeded", f"{what} (runPolicy.{field})", [],
                     whole_group=True)
