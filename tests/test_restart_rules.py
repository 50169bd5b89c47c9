"""One rulebook, two runners: the same failures through `kubetrain run`'s policy and the
operator's reconcile give the same decisions (kubetrain.restart_rules).

Each case is a job's story of failed attempts. The local side asks what the runner asks:
the class its runner gives each failed node (`node_failure_class`, from what the node left:
its trainer's words, the run's OOM-kill count, whether the runner lost it itself) and what
follows the attempt (`after_attempt`, over the run's counted failures). The operator side
plays the story through `reconcile`: worker 1 (and, in some cases, worker 0 with it)
fails at the case's step, the restart's replacement is created once its backoff is over
(found by probing the clock, not computed), the group runs again, and the next failure
comes. Both must restart after the same delay, or end the job for the same reason, and
agree on the micro-batch after out-of-memory restarts.

A failure torchrun restarts in place on Kubernetes (`kubetrain run` runs it with no
restarts of its own) reaches the operator as a trainer's end on its lifeline, the pods
running on: both must still restart, or end the job for the same reason, and count the
same restarts. Past the pod's budget of restarts in place (PET_MAX_RESTARTS =
maxRestarts) torchrun gives up and the pod ends: the operator judges the pod's end, as
`kubetrain run` judges the same failure.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, get_args

import pytest

import kubetrain.operator.reconcile as reconcile_module
from kubetrain.api.manifest import parse_job
from kubetrain.api.trainingjob import TrainingJob
from kubetrain.local.recovery import (
    GroupFailure,
    ProgressClock,
    after_attempt,
    node_failure_class,
)
from kubetrain.operator.actions import CreateObject, WriteStatus
from kubetrain.operator.facts import Observed, TrainerEnd, WorkerPod
from kubetrain.operator.reconcile import reconcile
from kubetrain.operator.recovery import retry_kind_of
from kubetrain.protocol import (
    ENDS_THE_POD,
    FAILURE_CLASSES,
    OUT_OF_MEMORY_CLASSES,
    TRAINER_CLASSES,
    TRAINER_EXIT_CODES,
    TrainerFailure,
    is_signal_exit,
)
from kubetrain.restart_rules import Advance, RetryKind

START = datetime(2025, 1, 1, 12, 0, 0, tzinfo=UTC)
MICRO_BATCH = 8


@dataclass(frozen=True)
class Local:
    """What a failed node left locally, from which the runner classes it: its trainer's
    class in the termination log, the run's OOM-kill count going up, the runner's own kill."""

    said: str | None = None
    oom_killed: bool = False
    lost: bool = False


@dataclass(frozen=True)
class Failure:
    """One failed attempt as each runner sees it: a process's exit status locally, a pod's
    container status on Kubernetes. `failure_class` is the local runner's class, unless
    `local` gives what the node left for the runner to class it. `also`: worker 0 failed in
    the same moment (the same poll locally, the same pass on Kubernetes)."""

    local_exit: int | None
    pod: dict[str, Any]
    failure_class: str = "Unknown"
    step: int = 0
    local: Local | None = None
    also: Failure | None = None

    def at(self, step: int) -> Failure:
        return Failure(self.local_exit, self.pod, self.failure_class, step, self.local,
                       self.also)


def crash(code: int) -> Failure:
    return Failure(code, {"exit_code": code})


def trainer(failure_class: str, code: int = 1) -> Failure:
    """A failure only the trainer saw: torchrun exits `code`, the class is in its message."""
    said = TrainerFailure(failure_class, f"{failure_class} at micro-batch {MICRO_BATCH}",
                          nodes=("node-b",) if failure_class == "PreflightFailed" else ())
    return Failure(code, {"exit_code": code, "trainer_failure": said}, failure_class)


# SIGKILL from outside: Unknown to both (a lost node is the runner's own kill, LOST_NODE).
KILLED = Failure(-9, {"exit_code": 137, "reason": "Error"})
EVICTED = Failure(None, {"exit_code": None, "reason": "Evicted"})  # no exit code (a hang locally)
OOM_KILLED = Failure(137, {"exit_code": 137, "reason": "OOMKilled"}, "OOMKilled")
# The runner lost the node itself (--kill-worker-at-step); on Kubernetes its node was lost.
LOST_NODE = Failure(-9, {"exit_code": None, "node_lost": True}, local=Local(lost=True))
# A rank killed by the kernel's OOM killer, and the pod's other rank timing out on it: the
# container's reason (the cgroup's OOM count locally) and the trainer's words disagree.
OOM_KILLED_AFTER_A_TIMEOUT = Failure(
    1, {"exit_code": 1, "reason": "OOMKilled",
        "trainer_failure": TrainerFailure("CollectiveTimeout", "a peer vanished")},
    local=Local(said="CollectiveTimeout", oom_killed=True))


@dataclass(frozen=True)
class Outcome:
    """What followed one failure: a restart after `delay`, or the job's end and why."""

    restart: bool
    delay: float
    ending: str | None
    micro_batch_size: int


@dataclass(frozen=True)
class Case:
    failures: list[Failure]
    run_policy: dict[str, Any] = field(default_factory=dict)


CASES = {
    "the-same-crash-at-one-step-repeats": Case([crash(1)] * 3),
    "progress-between-crashes-starts-a-new-streak": Case(
        [crash(1), crash(1).at(5), crash(1).at(5), crash(1).at(5)], {"maxRestarts": 5}),
    "kills-are-retried-until-max-restarts": Case([KILLED] * 4),
    "restart-me-75-never-repeats": Case([crash(75)] * 4),
    "exit-128-is-an-exit-code-not-a-signal": Case([crash(128)] * 3),
    "no-exit-code-is-retried": Case([EVICTED] * 4),
    "a-permanent-code-fails-at-once": Case([crash(2)]),
    "a-permanent-code-after-retries": Case([KILLED, crash(127)]),
    "kills-between-crashes-leave-the-streak": Case(
        [crash(1), KILLED, crash(1), KILLED, crash(1)], {"maxRestarts": 5}),
    "different-codes-are-no-streak": Case([crash(1), crash(3), crash(1), crash(3)]),
    "the-backoff-doubles-up-to-its-cap": Case(
        [KILLED] * 4, {"backoffSeconds": 7, "maxBackoffSeconds": 20, "maxRestarts": 5}),
    "out-of-memory-halves-until-nothing-is-left": Case([OOM_KILLED] * 4),
    "out-of-memory-spends-no-restarts": Case([KILLED, KILLED, KILLED, OOM_KILLED, KILLED]),
    "cuda-out-of-memory-with-action-fail": Case([trainer("CUDAOutOfMemory")],
                                                {"outOfMemory": {"action": "Fail"}}),
    "a-permanent-code-wins-over-out-of-memory": Case([trainer("CUDAOutOfMemory")],
                                                     {"permanentExitCodes": [1]}),
    "failed-preflights-are-no-streak": Case([trainer("PreflightFailed")] * 4),
    "collective-timeouts-repeat-like-crashes": Case([trainer("CollectiveTimeout")] * 3),
    # The check order: out of memory on one worker outranks a crash on another (its
    # consequence), whichever worker has the lower index.
    "an-oom-kill-outranks-a-crash-on-another-worker": Case(
        [Failure(137, OOM_KILLED.pod, "OOMKilled", also=crash(1))]),
    # The class precedence: the kernel's OOM kill outranks what the trainer wrote.
    "an-oom-kill-outranks-the-trainers-collective-timeout": Case([OOM_KILLED_AFTER_A_TIMEOUT]),
    # No backoff after a lost node: its workers go to another node, nothing to wait out.
    "a-lost-node-is-replaced-without-a-backoff": Case([LOST_NODE] * 2),
}


def _job(minimal_manifest: dict, run_policy: dict[str, Any],
         status: dict[str, Any] | None = None) -> TrainingJob:
    manifest = copy.deepcopy(minimal_manifest)
    manifest["metadata"].update(namespace="ml", uid="uid-1", generation=1)
    manifest["spec"]["workers"] = {"replicas": 2, "minReplicas": 1, "maxReplicas": 4}
    manifest["spec"]["optimization"] = {"microBatchSize": MICRO_BATCH,
                                        "gradientAccumulationSteps": 1}
    manifest["spec"]["runPolicy"] = {"backoffSeconds": 10, "maxBackoffSeconds": 60,
                                     "maxRestarts": 3, "repeatedFailureLimit": 3,
                                     "pendingDeadlineSeconds": None, **run_policy}
    if status is not None:
        manifest["status"] = status
    return parse_job(manifest)


# --- kubetrain run ---------------------------------------------------------------------------


def _seen_locally(failure: Failure, index: int, job: TrainingJob) -> GroupFailure:
    """The GroupFailure the runner makes of simulated node `index` ending as `failure` says."""
    kind, lost = failure.failure_class, False
    if failure.local is not None:
        assert failure.local_exit is not None
        kind = node_failure_class(failure.local_exit, failure.local.said,
                                  failure.local.oom_killed,
                                  job.spec.run_policy.permanent_exit_codes,
                                  lost=failure.local.lost)
        lost = failure.local.lost
    return GroupFailure(f"worker {index} failed at step {failure.step}", failure.local_exit,
                        failure.step, kind, node_lost=lost)


def local_outcomes(job: TrainingJob, failures: list[Failure]) -> list[Outcome]:
    """The decisions `kubetrain run` takes, failure by failure, as LocalRun.run asks them."""
    spec = job.spec
    world_size = spec.workers.replicas * spec.workers.procs_per_worker
    counted: list[GroupFailure] = []
    micro, healed = MICRO_BATCH, 0
    outcomes = []
    for failure in failures:
        ended = [_seen_locally(failure.also, 0, job)] if failure.also is not None else []
        ended.append(_seen_locally(failure, 1, job))
        decision = after_attempt(spec, counted, ended, micro_batch_size=micro,
                                 out_of_memory_restarts=healed, world_size=world_size)
        if decision.counted is not None:
            counted.append(decision.counted)
        elif decision.micro_batch_size is not None:
            micro, healed = decision.micro_batch_size, healed + 1
        outcomes.append(Outcome(decision.restart, decision.delay, decision.ending, micro))
        if not decision.restart:
            break
    return outcomes


# --- the operator ----------------------------------------------------------------------------


def _pass(job: TrainingJob, pods: list[WorkerPod], now: datetime) -> tuple[list[Any],
                                                                           dict[str, Any]]:
    actions = reconcile(job, Observed(pods=tuple(pods), service=True, config_generation=1), now)
    status = next((a.status for a in actions if isinstance(a, WriteStatus)),
                  job.status.wire() if job.status else {})
    return actions, status


def _worker(index: int, attempt: int, phase: str = "Running", **facts: Any) -> WorkerPod:
    return WorkerPod(name=f"demo-worker-{index}", index=index, restart_attempt=attempt,
                     phase=phase, ready=phase == "Running", created_at=START, node="node-a",
                     **facts)


def _created(actions: list[Any]) -> set[int]:
    return {int(a.manifest["metadata"]["name"].rsplit("-", 1)[1]) for a in actions
            if isinstance(a, CreateObject) and a.manifest["kind"] == "Pod"}


def operator_outcomes(minimal_manifest: dict, case: Case) -> list[Outcome]:
    """The operator's decisions, failure by failure, played through reconcile."""
    job = _job(minimal_manifest, case.run_policy)
    attempts = {0: 0, 1: 0}
    now = START
    _, status = _pass(job, [_worker(0, 0), _worker(1, 0)], now)  # the group runs
    outcomes = []
    for failure in case.failures:
        now += timedelta(hours=1)
        status = copy.deepcopy(status)
        status["progress"] = {**status.get("progress", {}), "step": failure.step}
        job = _job(minimal_manifest, case.run_policy, status)
        failed = _worker(1, attempts[1], "Failed", **failure.pod)
        first = (_worker(0, attempts[0], "Failed", **failure.also.pod)
                 if failure.also is not None else _worker(0, attempts[0]))
        actions, status = _pass(job, [first, failed], now)
        micro = status["effective"]["microBatchSize"]
        if status["phase"] == "Failed":
            ending = next(c["reason"] for c in status["conditions"] if c["type"] == "Failed")
            outcomes.append(Outcome(False, 0.0, ending, micro))
            break
        assert status["phase"] == "Restarting"
        restarted = status["restartAttempt"]
        deleted = {a.name for a in actions if type(a).__name__ == "DeletePod"}
        survivors = [_worker(0, attempts[0])] if "demo-worker-0" not in deleted else []
        job = _job(minimal_manifest, case.run_policy, status)

        def replaced_by(seconds: float, job: TrainingJob = job,
                        survivors: list[WorkerPod] = survivors, since: datetime = now) -> bool:
            return 1 in _created(_pass(job, survivors, since + timedelta(seconds=seconds))[0])

        low, high = 0, 3600  # the first whole second at which the replacement is created
        assert replaced_by(high)
        while low < high:
            middle = (low + high) // 2
            low, high = (low, middle) if replaced_by(middle) else (middle + 1, high)
        outcomes.append(Outcome(True, float(low), None, micro))
        for index in (0, 1):
            if f"demo-worker-{index}" in deleted:
                attempts[index] = restarted
        now += timedelta(seconds=low)
        running = [_worker(0, attempts[0]), _worker(1, attempts[1])]
        _, status = _pass(job, running, now)
        assert status["phase"] == "Running", status["conditions"]
    return outcomes


# Failures torchrun restarts in place on Kubernetes: the trainer process ends, its pod runs
# on. Killed (a signal exit), its lifeline ends without a word; `pod` is the pod's own end
# once torchrun's budget is spent (torchrun exits 1, the container's reason says the rest).
KILLED_IN_PLACE = Failure(-9, {"exit_code": 1})  # kill -9 of the trainer
OOM_KILLED_IN_PLACE = Failure(-9, {"exit_code": 1, "reason": "OOMKilled"}, "OOMKilled")
IN_PLACE_CASES = {
    "kills-in-place-until-max-restarts": Case([KILLED_IN_PLACE] * 4),
    "an-oom-kill-past-the-pods-budget-halves": Case([KILLED_IN_PLACE] * 3
                                                    + [OOM_KILLED_IN_PLACE]),
    "an-oom-kill-under-max-restarts-0-halves": Case([OOM_KILLED_IN_PLACE], {"maxRestarts": 0}),
    "the-same-crash-in-place-repeats": Case([crash(1)] * 3),
    "progress-between-crashes-in-place": Case(
        [crash(1), crash(1).at(5), crash(1).at(5), crash(1).at(5)], {"maxRestarts": 5}),
    "a-permanent-code-in-place-after-a-kill": Case([KILLED_IN_PLACE, crash(2)]),
    "collective-timeouts-in-place-repeat": Case([trainer("CollectiveTimeout", 88)] * 3),
}


def operator_in_place_outcomes(minimal_manifest: dict, case: Case) -> tuple[list[Outcome], int]:
    """The operator's decisions on the same failures seen on worker 1's lifeline, and the
    restarts it counted (status.restarts). No backoff: torchrun restarts at once. A failure
    the operator leaves to the pod (past its budget) is followed by the pod's end, and
    what that leads to is the outcome: it must be the case's last."""
    job = _job(minimal_manifest, case.run_policy)
    now = START
    running = [_worker(0, 0), _worker(1, 0)]
    _, status = _pass(job, running, now)
    ends: list[TrainerEnd] = []
    outcomes = []
    for number, failure in enumerate(case.failures, 1):
        now += timedelta(minutes=1)
        status = copy.deepcopy(status)
        status["progress"] = {**status.get("progress", {}), "step": failure.step}
        job = _job(minimal_manifest, case.run_policy, status)
        said = failure.local_exit is not None and not is_signal_exit(failure.local_exit)
        ends.append(TrainerEnd(pod="demo-worker-1", time=now,
                               failure_class=failure.failure_class if said  # type: ignore[arg-type]
                               else "Unknown", message="ended",
                               exit_code=failure.local_exit if said else None))
        restarts = status.get("restarts", 0)
        actions = reconcile(job, Observed(pods=tuple(running), service=True, config_generation=1,
                                          trainer_ends=tuple(ends)), now)
        status = next(a.status for a in actions if isinstance(a, WriteStatus))
        if status["phase"] == "Running" and status.get("restarts", 0) == restarts:
            assert number == len(case.failures), "left to the pod before the case's end"
            failed = _worker(1, 0, "Failed", **failure.pod)
            job = _job(minimal_manifest, case.run_policy, status)
            _, status = _pass(job, [running[0], failed], now)
            assert status["phase"] in ("Restarting", "Failed"), status["phase"]
        micro = status["effective"]["microBatchSize"]
        if status["phase"] == "Failed":
            ending = next(c["reason"] for c in status["conditions"] if c["type"] == "Failed")
            outcomes.append(Outcome(False, 0.0, ending, micro))
            break
        assert status["phase"] in ("Running", "Restarting")
        outcomes.append(Outcome(True, 0.0, None, micro))
    return outcomes, status.get("restarts", 0)


@pytest.mark.parametrize("name", IN_PLACE_CASES)
def test_a_restart_in_place_counts_as_the_local_runners_restart(minimal_manifest: dict,
                                                               name: str) -> None:
    case = IN_PLACE_CASES[name]
    local = local_outcomes(_job(minimal_manifest, case.run_policy), case.failures)
    operator, counted = operator_in_place_outcomes(minimal_manifest, case)
    assert operator == [Outcome(o.restart, 0.0, o.ending, o.micro_batch_size) for o in local]
    # Out-of-memory restarts (a smaller micro-batch) spend no maxRestarts in either runner.
    micro_batches = [MICRO_BATCH] + [o.micro_batch_size for o in local]
    assert counted == sum(o.restart and micro_batches[i] == o.micro_batch_size
                          for i, o in enumerate(local))


@pytest.mark.parametrize("name", CASES)
def test_both_runners_take_the_same_decisions(minimal_manifest: dict, name: str) -> None:
    case = CASES[name]
    local = local_outcomes(_job(minimal_manifest, case.run_policy), case.failures)
    operator = operator_outcomes(minimal_manifest, case)
    assert operator == local
    assert not local[-1].restart or len(local) == len(case.failures)


def test_the_cases_cover_every_ending(minimal_manifest: dict) -> None:
    endings = {outcome.ending
               for case in CASES.values()
               for outcome in local_outcomes(_job(minimal_manifest, case.run_policy),
                                             case.failures)}
    assert endings >= {"PermanentError", "RepeatedFailure", "MaxRestartsExceeded",
                       "OutOfMemory"}


def test_both_runners_call_a_group_hung_at_the_same_moment(minimal_manifest: dict) -> None:
    """The hang boundary: a step that has not advanced for exactly progressDeadlineSeconds
    is not yet a hang in either runner; a second more is, in both."""
    deadline = 30
    job = _job(minimal_manifest, {"progressDeadlineSeconds": deadline})
    running = [_worker(0, 0), _worker(1, 0)]
    _, status = _pass(job, running, START)
    status = {**status, "progress": {"step": 5, "updatedAt": START.isoformat()}}
    job = _job(minimal_manifest, {"progressDeadlineSeconds": deadline}, status)
    operator, local = [], []
    for seconds in (deadline - 1, deadline, deadline + 1):
        after = _pass(job, running, START + timedelta(seconds=seconds))[1]
        operator.append(after.get("restart", {}).get("reason") == "ProgressDeadlineExceeded")
        clock = ProgressClock(step=5, since=0.0)  # as the runner's: reset at the step's advance
        local.append(clock.is_hung(job.spec.run_policy, float(seconds)))
    assert operator == local
    assert local == [False, False, True]


@pytest.mark.parametrize("stepped", [False, True], ids=["starting", "stepped"])
def test_before_its_first_step_an_attempt_has_the_startup_deadline_in_both_runners(
        minimal_manifest: dict, stepped: bool) -> None:
    """startupDeadlineSeconds 90 and progressDeadlineSeconds 30. An attempt that has taken
    no step yet (the last step is an earlier attempt's) is hung only after 90 s of its
    start; one whose first step came 10 s in, 30 s after that step. Both runners agree on
    each second at the boundary, and the operator names the field that applied."""
    policy = {"progressDeadlineSeconds": 30, "startupDeadlineSeconds": 90}
    job = _job(minimal_manifest, policy)
    running = [_worker(0, 0), _worker(1, 0)]
    _, status = _pass(job, running, START)
    last_step = START + timedelta(seconds=10) if stepped else START - timedelta(seconds=100)
    status = {**status, "progress": {"step": 5, "updatedAt": last_step.isoformat()}}
    job = _job(minimal_manifest, policy, status)
    clock = ProgressClock(step=-1, since=0.0)  # as the runner's: started with the attempt
    if stepped:
        clock.observe(5, 10.0, is_step=True)
    boundary = 40 if stepped else 90
    operator, local = [], []
    for seconds in (31, boundary, boundary + 1):
        after = _pass(job, running, START + timedelta(seconds=seconds))[1]
        operator.append(after.get("restart", {}).get("reason") == "ProgressDeadlineExceeded")
        local.append(clock.is_hung(job.spec.run_policy, float(seconds)))
    assert operator == local
    assert local == [False, False, True]
    field = "progressDeadlineSeconds" if stepped else "startupDeadlineSeconds"
    assert clock.deadline(job.spec.run_policy)[1] == field
    restarting = next(c for c in after["conditions"] if c["type"] == "Restarting")
    assert f"(runPolicy.{field})" in restarting["message"]


# --- the protocol and the names ---------------------------------------------------------------


def test_the_protocols_classes_nest() -> None:
    assert set(FAILURE_CLASSES) >= TRAINER_CLASSES | OUT_OF_MEMORY_CLASSES
    assert ENDS_THE_POD <= TRAINER_CLASSES
    assert set(TRAINER_EXIT_CODES) == TRAINER_CLASSES
    assert len(set(TRAINER_EXIT_CODES.values())) == len(TRAINER_EXIT_CODES)


def test_a_retry_kind_is_not_a_failure_class() -> None:
    # reconcile called both `failure_class`: classify's CUDAOutOfMemory and the kind of
    # retry (permanent, retryable, code). The retry kind has its own name now.
    assert not hasattr(reconcile_module, "failure_class")
    assert not set(get_args(RetryKind)) & set(FAILURE_CLASSES)
    pod = _worker(1, 0, "Failed", exit_code=1)
    assert retry_kind_of(pod, [2]) == "code"


@pytest.mark.parametrize(("advance", "booked"), [
    # Within an attempt, the steps an earlier attempt reported (up to 20) are lost progress.
    (Advance(16, 24, 8.0, redone_until=20), (4.0, 4.0)),
    (Advance(20, 24, 4.0, redone_until=20), (4.0, 0.0)),
    (Advance(10, 20, 10.0), (10.0, 0.0)),
    # The attempt's first advance also books the steps from its checkpoint (8) to its first
    # report (12), up to the furthest reported (10), at its pace: 2 s before the advance.
    (Advance(12, 17, 5.0, redone_until=10, resumed_step=8, first_step=12), (5.0, 2.0)),
    (Advance(9, 14, 5.0, redone_until=10, resumed_step=8, first_step=9), (4.0, 2.0)),
    # ...only the first: a later advance books what it covers alone.
    (Advance(17, 22, 5.0, redone_until=10, resumed_step=8, first_step=12), (5.0, 0.0)),
    # Resumed past everything reported before: nothing was redone.
    (Advance(31, 36, 5.0, redone_until=30, resumed_step=30, first_step=31), (5.0, 0.0)),
    (Advance(5, 5, 3.0, redone_until=10), (0.0, 0.0)),
])
def test_an_advance_books_exactly_the_steps_it_redid(advance: Advance,
                                                      booked: tuple[float, float]) -> None:
    assert advance.booked() == pytest.approx(booked)
