"""The local runner's restart, backoff and hang decisions (kubetrain.local.recovery).

The same cases through the operator's reconcile: tests/test_restart_rules.py."""

from __future__ import annotations

import pytest

from kubetrain.api.trainingjob import RunPolicy, TrainingJobSpec
from kubetrain.local.memory import memory_cgroup
from kubetrain.local.recovery import (
    GroupFailure,
    ProgressClock,
    after_failure,
    after_out_of_memory,
)
from kubetrain.protocol import is_signal_exit
from kubetrain.restart_rules import backoff_seconds

LOST = GroupFailure("worker 1 was lost", -9, step=10)


def crash(code: int = 1, step: int = 0) -> GroupFailure:
    return GroupFailure(f"worker 0 failed with exit code {code}", code, step)


def test_backoff_doubles_per_restart_up_to_the_maximum() -> None:
    policy = RunPolicy(backoff_seconds=3, max_backoff_seconds=20)
    delays = [backoff_seconds(policy, restart) for restart in range(6)]
    assert delays == [0, 3, 6, 12, 20, 20]


def test_lost_nodes_are_restarted_until_max_restarts_is_spent() -> None:
    policy = RunPolicy(max_restarts=2, backoff_seconds=1)
    first, second, third = (after_failure(policy, [LOST] * n) for n in (1, 2, 3))
    assert (first.restart, first.delay) == (True, backoff_seconds(policy, 1))
    assert (second.restart, second.delay) == (True, backoff_seconds(policy, 2))
    assert not third.restart
    assert "maxRestarts" in third.reason and third.ending == "MaxRestartsExceeded"


def test_zero_max_restarts_fails_on_the_first_failure() -> None:
    decision = after_failure(RunPolicy(max_restarts=0), [LOST])
    assert not decision.restart


@pytest.mark.parametrize("code", [2, 126, 127])
def test_permanent_exit_code_fails_without_retrying(code: int) -> None:
    decision = after_failure(RunPolicy(max_restarts=10), [crash(code)])
    assert not decision.restart
    assert "permanentExitCodes" in decision.reason and decision.ending == "PermanentError"


def test_same_crash_without_progress_fails_at_the_repeated_failure_limit() -> None:
    policy = RunPolicy(max_restarts=10, repeated_failure_limit=3)
    assert after_failure(policy, [crash(), crash()]).restart
    decision = after_failure(policy, [crash(), crash(), crash()])
    assert not decision.restart
    assert "repeatedFailureLimit" in decision.reason and decision.ending == "RepeatedFailure"


def test_repeated_crash_with_progress_in_between_keeps_restarting() -> None:
    policy = RunPolicy(max_restarts=10, repeated_failure_limit=3)
    assert after_failure(policy, [crash(step=0), crash(step=5), crash(step=5)]).restart
    assert not after_failure(policy, [crash(step=0), crash(step=5), crash(step=5),
                                      crash(step=5)]).restart


def test_a_crash_at_the_same_step_after_replaying_steps_is_a_repeated_failure() -> None:
    # Each attempt resumes from the step-10 checkpoint and trains to step 15, where it
    # crashes: the step never gets past where the streak began (the operator's rule).
    policy = RunPolicy(max_restarts=10, repeated_failure_limit=3)
    assert not after_failure(policy, [crash(step=15)] * 3).restart


def test_signal_kills_between_crashes_leave_the_streak_as_it_is() -> None:
    policy = RunPolicy(max_restarts=10, repeated_failure_limit=3)
    killed = GroupFailure("worker 1 was lost", -9, step=0)
    assert not after_failure(policy, [crash(), killed, crash(), killed, crash()]).restart


@pytest.mark.parametrize("code", [75, 128 + 9, -15])
def test_restart_me_and_signal_exits_never_make_a_streak(code: int) -> None:
    policy = RunPolicy(max_restarts=10, repeated_failure_limit=2)
    assert after_failure(policy, [crash(code)] * 3).restart


def test_exit_128_is_an_exit_code_not_a_signal() -> None:
    policy = RunPolicy(max_restarts=10, repeated_failure_limit=2)
    assert not after_failure(policy, [crash(128)] * 2).restart


def test_repeated_failed_preflights_are_not_a_streak() -> None:
    # A failed preflight has its own rule (the operator avoids the nodes it names).
    preflight = GroupFailure("worker 0 failed with exit code 1 (PreflightFailed)", 1, 0,
                             "PreflightFailed")
    assert after_failure(RunPolicy(max_restarts=10, repeated_failure_limit=2),
                         [preflight] * 3).restart


def test_different_exit_codes_are_not_a_repeated_failure() -> None:
    policy = RunPolicy(max_restarts=10, repeated_failure_limit=2)
    assert after_failure(policy, [crash(1), crash(3)]).restart


def test_repeated_signal_kills_are_always_retried() -> None:
    policy = RunPolicy(max_restarts=10, repeated_failure_limit=2)
    killed = GroupFailure("worker 1 was lost", -9, step=0)
    assert after_failure(policy, [killed, killed, killed]).restart


def test_hangs_are_retried_like_other_failures() -> None:
    hang = GroupFailure("no training progress for 31s", None, step=0)
    policy = RunPolicy(max_restarts=1, repeated_failure_limit=1)
    assert after_failure(policy, [hang]).restart
    assert not after_failure(policy, [hang, hang]).restart


@pytest.mark.parametrize(("code", "signalled"), [(-9, True), (137, True), (143, True),
                                                 (129, True), (128, False), (1, False),
                                                 (75, False)])
def test_signal_exits_are_told_apart_from_exit_codes(code: int, signalled: bool) -> None:
    assert is_signal_exit(code) is signalled


def test_progress_clock_resets_only_when_the_step_advances() -> None:
    policy = RunPolicy(progress_deadline_seconds=30)
    clock = ProgressClock(step=-1, since=100.0)
    clock.observe(0, 110.0)
    clock.observe(10, 120.0)
    clock.observe(10, 145.0)  # the same step again is no progress
    assert clock.stalled_for(145.0) == 25.0
    assert not clock.is_hung(policy, 150.0)
    assert clock.is_hung(policy, 151.0)
    clock.observe(20, 151.0)
    assert not clock.is_hung(policy, 151.0)


def test_progress_clock_counts_startup_against_the_deadline() -> None:
    clock = ProgressClock(step=-1, since=0.0)
    assert clock.is_hung(RunPolicy(progress_deadline_seconds=60), 61.0)


def test_the_startup_deadline_applies_until_the_attempts_first_step() -> None:
    policy = RunPolicy(progress_deadline_seconds=30, startup_deadline_seconds=300)
    clock = ProgressClock(step=-1, since=0.0)
    clock.observe(0, 5.0)  # the trainer's start: progress, but no step yet
    assert not clock.is_hung(policy, 300.0)
    assert clock.is_hung(policy, 306.0)
    clock.observe(1, 306.0, is_step=True)
    assert clock.deadline(policy) == (30, "progressDeadlineSeconds")
    assert clock.is_hung(policy, 337.0)


def test_hang_detection_can_be_disabled() -> None:
    clock = ProgressClock(step=-1, since=0.0)
    assert not clock.is_hung(RunPolicy(progress_deadline_seconds=None), 1e9)


# --- out of memory: the operator's rule, locally -------------------------------------------


def _spec(micro: int, **out_of_memory: object) -> TrainingJobSpec:
    return TrainingJobSpec.model_validate({
        "image": "x", "data": {"train": "data/train"}, "checkpoint": {"uri": "checkpoints"},
        "optimization": {"microBatchSize": micro, "gradientAccumulationSteps": 2},
        "runPolicy": {"outOfMemory": out_of_memory}})


OOM = GroupFailure("worker 0 failed with exit code 1 (OOMKilled) at step 0", 1, 0, "OOMKilled")


def test_out_of_memory_halves_the_micro_batch_and_doubles_the_accumulation() -> None:
    decision = after_out_of_memory(_spec(8), OOM, 8, 0, world_size=1)
    assert (decision.restart, decision.delay, decision.micro_batch_size) == (True, 0.0, 4)
    assert "gradient accumulation 4 (global batch unchanged)" in decision.reason


def test_a_micro_batch_that_is_not_a_power_of_two_halves_to_a_divisor() -> None:
    assert after_out_of_memory(_spec(6), OOM, 6, 0, world_size=1).micro_batch_size == 3
    assert after_out_of_memory(_spec(6), OOM, 3, 1, world_size=1).micro_batch_size == 1


@pytest.mark.parametrize(("spec", "current", "done", "why"), [
    (_spec(8, minMicroBatch=4), 4, 1, "no smaller micro-batch is left"),
    (_spec(8), 1, 3, "no smaller micro-batch is left"),
    (_spec(8, action="Fail"), 8, 0, "outOfMemory.action is Fail"),
    (_spec(8), 2, 3, "3 out-of-memory restarts already"),
])
def test_out_of_memory_fails_when_nothing_smaller_may_be_tried(
        spec: TrainingJobSpec, current: int, done: int, why: str) -> None:
    decision = after_out_of_memory(spec, OOM, current, done, world_size=1)
    assert not decision.restart and decision.ending == "OutOfMemory"
    assert why in decision.reason and "kubetrain estimate" in decision.reason


@pytest.mark.parametrize(("text", "expected"), [
    ("4:memory:/process_api/abc\n0::/\n", "/sys/fs/cgroup/memory/process_api/abc"),
    ("0::/user.slice/session-1.scope\n", None),  # v2, but no memory.events there
    ("1:cpu:/\n", None),
])
def test_the_run_finds_its_memory_cgroup(text: str, expected: str | None) -> None:
    found = memory_cgroup(text)
    assert (str(found) if found else None) == expected
