"""The restart policy's own rules (kubetrain.operator.recovery): the restart in progress kept
as data in status.restart, what it covers, and the nodes a failed preflight names. The
steps themselves run through `reconcile` in test_reconcile; the rules both runners share,
in tests/test_restart_rules.py."""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from kubetrain.api.trainingjob import RestartStatus, TrainingJobStatus
from kubetrain.operator.recovery import (
    covered_by_restart,
    preflight_nodes,
    replacements_due,
    restart_in_progress,
)
from kubetrain.protocol import TrainerFailure

sys.path.insert(0, str(Path(__file__).parent))
from test_reconcile import NOW, make_job, pod, run, running_status


def _restarting(restart: dict[str, Any] | None, condition_reason: str | None) -> dict[str, Any]:
    """Status of a job in its first restart (attempt 1), with the restart recorded as data,
    as a Restarting condition's reason, or both."""
    status = running_status(phase="Restarting", restarts=1, restartAttempt=1,
                            lastRestartTime=NOW.isoformat())
    status["conditions"] = [c for c in status["conditions"] if c["type"] != "Running"]
    if condition_reason is not None:
        status["conditions"].append({"type": "Restarting", "status": "True",
                                     "reason": condition_reason,
                                     "lastTransitionTime": NOW.isoformat()})
    if restart is not None:
        status["restart"] = {"attempt": 1, "time": NOW.isoformat(), **restart}
    return status


# --- status.restart (issue 38: the reason was read back from the condition's text) ------------


def test_a_restart_is_written_to_status_as_data(minimal_manifest: dict) -> None:
    out = run(make_job(minimal_manifest, status=running_status()), pod(0),
              pod(1, "Failed", exit_code=137, reason="Error"))
    assert out.status is not None
    assert out.status["restart"] == {"reason": "WorkerFailed", "attempt": 1,
                                     "time": "2025-01-01T12:00:00Z", "counted": True,
                                     "wholeGroup": False}


def test_an_out_of_memory_restart_says_it_is_uncounted_and_whole(minimal_manifest: dict) -> None:
    out = run(make_job(minimal_manifest, status=running_status()), pod(0),
              pod(1, "Failed", exit_code=137, reason="OOMKilled"))
    assert out.status is not None
    restart = out.status["restart"]
    assert (restart["reason"], restart["counted"], restart["wholeGroup"]) == (
        "OutOfMemory", False, True)


def test_the_restart_in_progress_is_read_from_status_not_the_conditions_text(
        minimal_manifest: dict) -> None:
    # The condition is for people; its reason is not what the operator decides from.
    status = _restarting({"reason": "OutOfMemory", "counted": False, "wholeGroup": True},
                         condition_reason="SomethingElse")
    job = make_job(minimal_manifest, status=status)
    # Worker 1 of the old attempt still runs: an uncounted whole-group restart takes it too,
    # with its own reason, and the missing worker 0 is created at once (no backoff).
    out = run(job, pod(1, attempt=0))
    assert [(d.name, d.reason) for d in out.deleted] == [("demo-worker-1", "OutOfMemory")]
    assert out.created == [("Pod", "demo-worker-0", "1")]


def test_a_whole_group_restart_takes_every_older_pod_once_worker_0_is_gone(
        minimal_manifest: dict) -> None:
    # Worker 0 failed and was deleted; the operator stopped before deleting worker 1.
    status = _restarting({"reason": "WorkerFailed", "counted": True, "wholeGroup": True},
                         condition_reason="WorkerFailed")
    out = run(make_job(minimal_manifest, status=status), pod(1, attempt=0))
    assert out.deleted_names == ["demo-worker-1"]


def test_a_restart_recorded_before_status_restart_is_read_from_its_condition() -> None:
    status = TrainingJobStatus.model_validate(_restarting(None, condition_reason="OutOfMemory"))
    restart = restart_in_progress(status)
    assert restart is not None
    assert (restart.reason, restart.counted, restart.whole_group) == ("OutOfMemory", False, True)


def test_status_restart_of_an_older_attempt_is_not_the_one_in_progress() -> None:
    # restartAttempt moved on without status.restart (an older operator wrote it).
    status = TrainingJobStatus.model_validate(_restarting(
        {"reason": "OutOfMemory", "counted": False, "wholeGroup": True, "attempt": 0},
        condition_reason="WorkerFailed"))
    restart = restart_in_progress(status)
    assert restart is not None and (restart.reason, restart.counted) == ("WorkerFailed", True)


@pytest.mark.parametrize(("counted", "restarts", "after"), [
    (True, 1, 10), (True, 3, 40), (False, 3, 0)])
def test_replacements_wait_out_a_counted_restarts_backoff(
        minimal_manifest: dict, counted: bool, restarts: int, after: float) -> None:
    status = _restarting({"reason": "WorkerFailed", "counted": counted, "wholeGroup": False},
                         "WorkerFailed")
    status["restarts"] = restarts
    job = make_job(minimal_manifest, status=status, maxRestarts=5)
    assert job.status is not None
    assert replacements_due(job.status, job.spec.run_policy) == NOW + timedelta(seconds=after)
    running = TrainingJobStatus.model_validate(running_status())
    assert replacements_due(running, job.spec.run_policy) is None


# --- what a restart covers, and the nodes a preflight names -------------------------------------


@pytest.mark.parametrize(("whole_group", "pods", "covered"), [
    (False, [pod(0), pod(1, "Failed", exit_code=1)], ["demo-worker-1"]),
    (False, [pod(0, "Failed", exit_code=137), pod(1)], ["demo-worker-0", "demo-worker-1"]),
    (True, [pod(0), pod(1)], ["demo-worker-0", "demo-worker-1"]),
    (False, [pod(0), pod(1, "Failed", exit_code=2)], []),  # permanent: handle_failures ends it
])
def test_a_restart_covers_its_broken_pods_or_the_whole_older_group(
        minimal_manifest: dict, whole_group: bool, pods: list, covered: list[str]) -> None:
    restart = RestartStatus(reason="WorkerFailed", attempt=1, time=NOW, whole_group=whole_group)
    policy = make_job(minimal_manifest).spec.run_policy
    assert sorted(p.name for p in covered_by_restart(restart, pods, policy, set(), NOW)) == covered


def test_a_failed_preflight_names_its_nodes_and_those_no_rank_reported_from() -> None:
    said = TrainerFailure("PreflightFailed", "rank 1 is slow", nodes=("node-b",),
                          reported_nodes=("node-a", "node-b"))
    failed = [pod(0, "Failed", attempt=1, exit_code=1, trainer_failure=said, node="node-a")]
    group = [*failed, pod(1, attempt=1, node="node-b"), pod(2, attempt=1, node="node-c"),
             pod(3, attempt=0, node="node-d")]  # worker 3's node is an older attempt's
    assert preflight_nodes(failed, group, attempt=1) == ["node-b", "node-c"]
    assert preflight_nodes(failed, group, attempt=2) == ["node-b"]


def test_a_pods_restarts_in_place_are_its_own_earlier_ends_one_per_restart() -> None:
    from kubetrain.operator.facts import TrainerEnd
    from kubetrain.operator.recovery import restarts_in_place_done

    def end(name: str, seconds: int) -> TrainerEnd:
        return TrainerEnd(pod=name, time=NOW + timedelta(seconds=seconds),
                          failure_class="Unknown", message="ended")

    # Worker 1 (created at NOW): its two ranks ended together at 10 s (one restart), then
    # one at 60 s; worker 0's end and one from worker 1's previous pod are not its own.
    ends = [end("demo-worker-1", -30), end("demo-worker-1", 10), end("demo-worker-1", 11),
            end("demo-worker-0", 40), end("demo-worker-1", 60), end("demo-worker-1", 90)]
    worker_1 = pod(1, created_at=NOW)
    assert [restarts_in_place_done(worker_1, ends, seen) for seen in ends
            if seen.pod == "demo-worker-1" and seen.time >= NOW] == [0, 0, 1, 2]
    # A pod whose creation is unknown counts every end of its name.
    assert restarts_in_place_done(pod(1, created_at=None), ends, ends[-1]) == 3
