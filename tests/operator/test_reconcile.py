"""Table-driven tests of the pure reconcile: every transition, failure class and restart case."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import yaml

from kubetrain.api.manifest import parse_job
from kubetrain.api.trainingjob import TrainingJob
from kubetrain.operator.actions import (
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
from kubetrain.operator.facts import MetricsSample, Observed, WorkerPod, worker_pod
from kubetrain.operator.failures import classify
from kubetrain.operator.reconcile import merge_patch, reconcile, reject
from kubetrain.operator.reconcile_pass import HUNG_GROUP_GRACE_SECONDS
from kubetrain.operator.recovery import retry_kind_of
from kubetrain.restart_rules import backoff_seconds

NOW = datetime(2025, 1, 1, 12, 0, 0, tzinfo=UTC)
EARLIER = NOW - timedelta(hours=1)


def make_job(minimal_manifest: dict[str, Any], replicas: int = 2, status: dict | None = None,
             generation: int = 1, min_replicas: int = 1, **run_policy: Any) -> TrainingJob:
    manifest = copy.deepcopy(minimal_manifest)
    manifest["metadata"].update(namespace="ml", uid="uid-1", generation=generation)
    manifest["spec"]["workers"] = {"replicas": replicas, "minReplicas": min_replicas,
                                   "maxReplicas": 4}
    manifest["spec"]["runPolicy"] = {"backoffSeconds": 10, "maxRestarts": 3, **run_policy}
    if status is not None:
        manifest["status"] = status
    return parse_job(manifest)


def pod(index: int, phase: str = "Running", attempt: int = 0, **facts: Any) -> WorkerPod:
    facts.setdefault("created_at", EARLIER)
    return WorkerPod(name=f"demo-worker-{index}", index=index, restart_attempt=attempt,
                     phase=phase, ready=phase == "Running", **facts)


# The job's pods with a worker index: not its lighthouse (spec.faultTolerance).
WORKER_SELECTOR = "kubetrain.io/job-name=demo,kubetrain.io/worker-index"


def running_status(**extra: Any) -> dict[str, Any]:
    since = EARLIER.isoformat()
    return {
        "phase": "Running", "observedGeneration": 1, "startTime": since,
        "workers": {"desired": 2, "ready": 2, "selector": WORKER_SELECTOR},
        "conditions": [
            {"type": "Created", "status": "True", "reason": "ChildrenCreated",
             "lastTransitionTime": since},
            {"type": "Running", "status": "True", "reason": "WorkersRunning",
             "lastTransitionTime": since},
        ],
        "progress": {"step": 0},
        **extra,
    }


@dataclass
class Outcome:
    """The actions of one reconcile, summarised for assertions."""

    actions: list[Any]
    created: list[tuple[str, str, str]] = field(default_factory=list)  # kind, name, attempt
    deleted: list[DeletePod] = field(default_factory=list)
    events: list[tuple[str, str]] = field(default_factory=list)
    status: dict[str, Any] | None = None
    restarts: list[CountRestart] = field(default_factory=list)
    job_deleted: bool = False
    wakes: list[datetime] = field(default_factory=list)  # ReconcileAt: a pass asked for

    @classmethod
    def of(cls, actions: list[Any]) -> Outcome:
        out = cls(actions)
        for action in actions:
            if isinstance(action, CreateObject):
                meta = action.manifest["metadata"]
                attempt = meta["labels"].get("kubetrain.io/restart-attempt", "")
                out.created.append((action.manifest["kind"], meta["name"], attempt))
            elif isinstance(action, DeletePod):
                out.deleted.append(action)
            elif isinstance(action, RecordEvent):
                out.events.append((action.type, action.reason))
            elif isinstance(action, WriteStatus):
                out.status = action.status
            elif isinstance(action, CountRestart):
                out.restarts.append(action)
            elif isinstance(action, DeleteJob):
                out.job_deleted = True
            elif isinstance(action, ReconcileAt):
                out.wakes.append(action.time)
        return out

    @property
    def deleted_names(self) -> list[str]:
        return sorted(action.name for action in self.deleted)

    def condition(self, kind: str) -> dict[str, Any] | None:
        assert self.status is not None
        return next((c for c in self.status["conditions"] if c["type"] == kind), None)


def run(job: TrainingJob, *pods: WorkerPod, now: datetime = NOW, service: bool = True,
        metrics: MetricsSample | None = None) -> Outcome:
    held = (job.metadata.generation or 0) if service else None
    observed = Observed(pods=pods, service=service, config_generation=held, metrics=metrics)
    return Outcome.of(reconcile(job, observed, now))


# --- creation and steady state -----------------------------------------------------------


def test_new_job_creates_service_config_map_and_every_worker(minimal_manifest: dict) -> None:
    out = run(make_job(minimal_manifest), service=False)
    assert out.created == [("Service", "demo", ""), ("ConfigMap", "demo-config", ""),
                           ("Pod", "demo-worker-0", "0"), ("Pod", "demo-worker-1", "0")]
    assert out.status is not None and out.status["phase"] == "Pending"
    assert out.status["workers"] == {"desired": 2, "ready": 0,
                                     "selector": WORKER_SELECTOR}
    assert out.condition("Created")["status"] == "True"
    assert out.events == [("Normal", "Created")]
    assert isinstance(out.actions[0], WriteStatus), "the decision is recorded before acting"


def test_status_is_not_written_again_when_nothing_changed(minimal_manifest: dict) -> None:
    first = run(make_job(minimal_manifest), pod(0), pod(1))
    assert first.status is not None and first.status["phase"] == "Running"
    again = run(make_job(minimal_manifest, status=first.status), pod(0), pod(1))
    assert again.actions == []


@pytest.mark.parametrize(("existing", "expected"), [
    pytest.param([pod(0)], [("Pod", "demo-worker-1", "0")], id="one-pod-created-before-crash"),
    pytest.param([pod(0), pod(1)], [], id="all-created-before-crash"),
    pytest.param([pod(0), pod(1, deleting=True)], [], id="replacement-waits-for-old-name"),
])
def test_operator_restart_never_duplicates_pods(minimal_manifest: dict, existing: list,
                                                expected: list) -> None:
    status = running_status(phase="Pending")
    out = run(make_job(minimal_manifest, status=status), *existing)
    assert out.created == expected
    assert out.deleted == []


def test_operator_restart_mid_restart_finishes_it_without_counting_again(
        minimal_manifest: dict) -> None:
    # Crashed after writing "restart 1" and deleting worker 1, before re-creating it.
    status = running_status(phase="Restarting", restarts=1, restartAttempt=1,
                            lastRestartTime=(NOW - timedelta(minutes=1)).isoformat())
    out = run(make_job(minimal_manifest, status=status), pod(0))
    assert out.created == [("Pod", "demo-worker-1", "1")]
    assert out.restarts == []
    assert out.status is None or out.status["restarts"] == 1


def test_all_workers_running_makes_the_job_running(minimal_manifest: dict) -> None:
    status = running_status(phase="Pending", startTime=None)
    status["conditions"] = status["conditions"][:1]
    out = run(make_job(minimal_manifest, status=status), pod(0), pod(1))
    assert out.status is not None and out.status["phase"] == "Running"
    assert out.status["startTime"] == NOW.isoformat().replace("+00:00", "Z")
    assert out.status["workers"]["ready"] == 2
    assert out.events == [("Normal", "Running")]


# --- retry kinds (kubetrain.restart_rules; not failure classes) -----------------------


@pytest.mark.parametrize(("facts", "expected"), [
    ({"exit_code": 2}, "permanent"),
    ({"exit_code": 127}, "permanent"),
    ({"exit_code": 1}, "code"),
    ({"exit_code": 137, "reason": "OOMKilled"}, "retryable"),
    ({"exit_code": 1, "reason": "OOMKilled"}, "retryable"),
    ({"exit_code": 143}, "retryable"),
    ({"exit_code": 75}, "retryable"),
    ({"exit_code": None, "reason": "Evicted"}, "retryable"),
    ({"exit_code": 1, "node_lost": True}, "retryable"),
    ({"exit_code": 1, "reason": "DisruptionTarget"}, "code"),
    ({"exit_code": 1, "reason": "DeadlineExceeded"}, "retryable"),
])
def test_retry_kinds(facts: dict, expected: str) -> None:
    assert retry_kind_of(pod(1, "Failed", **facts), [2, 126, 127]) == expected


def test_failed_worker_is_replaced_alone_after_backoff(minimal_manifest: dict) -> None:
    job = make_job(minimal_manifest, status=running_status())
    # Killed from outside (SIGKILL, not the OOM killer): a retry, not a smaller micro-batch.
    out = run(job, pod(0), pod(1, "Failed", exit_code=137, reason="Error"))
    assert out.deleted_names == ["demo-worker-1"]
    assert out.created == []
    assert out.status is not None
    assert (out.status["phase"], out.status["restarts"], out.status["restartAttempt"]) == (
        "Restarting", 1, 1)
    assert out.condition("Restarting")["reason"] == "WorkerFailed"
    assert out.events == [("Warning", "WorkerFailure"), ("Warning", "WorkerFailed")]
    assert [r.reason for r in out.restarts] == ["WorkerFailed"]

    # A pass when the backoff ends, asked for by the pass that began it: no API event
    # would come then.
    due = NOW + timedelta(seconds=backoff_seconds(job.spec.run_policy, 1))
    assert out.wakes == [due]

    # Once the old pod is gone: nothing during the backoff, the replacement after it.
    job = make_job(minimal_manifest, status=out.status)
    during = run(job, pod(0), now=NOW + timedelta(seconds=5))
    assert during.created == []
    assert during.wakes == [due]
    after = run(job, pod(0), now=due)
    assert after.created == [("Pod", "demo-worker-1", "1")]
    assert after.restarts == []
    assert after.wakes == []


def test_losing_worker_zero_restarts_the_whole_group(minimal_manifest: dict) -> None:
    job = make_job(minimal_manifest, status=running_status())
    out = run(job, pod(0, "Failed", exit_code=137), pod(1))
    assert out.deleted_names == ["demo-worker-0", "demo-worker-1"]
    assert "the whole group" in out.condition("Restarting")["message"]


def test_backoff_doubles_and_is_capped(minimal_manifest: dict) -> None:
    job = make_job(minimal_manifest, backoffSeconds=10, maxBackoffSeconds=60)
    assert [backoff_seconds(job.spec.run_policy, n) for n in range(1, 6)] == [10, 20, 40, 60, 60]


def test_pod_already_being_replaced_is_not_counted_again(minimal_manifest: dict) -> None:
    status = running_status(phase="Restarting", restarts=1, restartAttempt=1,
                            lastRestartTime=NOW.isoformat())
    out = run(make_job(minimal_manifest, status=status), pod(0),
              pod(1, "Failed", exit_code=137, deleting=True))
    assert out.restarts == [] and out.deleted == [] and out.created == []


def test_permanent_exit_code_fails_the_job_and_keeps_the_failed_pod(
        minimal_manifest: dict) -> None:
    out = run(make_job(minimal_manifest, status=running_status()), pod(0),
              pod(1, "Failed", exit_code=2))
    assert out.status is not None and out.status["phase"] == "Failed"
    assert out.condition("Failed")["reason"] == "PermanentError"
    assert out.deleted_names == ["demo-worker-0"], "cleanPodPolicy Running keeps failed pods"
    assert out.status["completionTime"]
    assert ("Warning", "PermanentError") in out.events


def test_same_exit_code_without_progress_fails_after_the_limit(minimal_manifest: dict) -> None:
    status = running_status()
    for attempt in range(3):
        job = make_job(minimal_manifest, status=status, repeatedFailureLimit=3)
        out = run(job, pod(0), pod(1, "Failed", attempt=attempt, exit_code=1))
        assert out.status is not None
        status = out.status
        if attempt < 2:
            assert status["phase"] == "Restarting"
            assert status["failureStreak"] == {"exitCode": 1, "count": attempt + 1, "step": 0}
    assert status["phase"] == "Failed"
    assert out.condition("Failed")["reason"] == "RepeatedFailure"


def test_progress_between_failures_resets_the_streak(minimal_manifest: dict) -> None:
    status = running_status(failureStreak={"exitCode": 1, "count": 2, "step": 0},
                            progress={"step": 50})
    job = make_job(minimal_manifest, status=status, repeatedFailureLimit=3)
    out = run(job, pod(0), pod(1, "Failed", exit_code=1))
    assert out.status is not None and out.status["phase"] == "Restarting"
    assert out.status["failureStreak"] == {"exitCode": 1, "count": 1, "step": 50}


def test_restarts_beyond_max_restarts_fail_the_job(minimal_manifest: dict) -> None:
    status = running_status(restarts=3, restartAttempt=3)
    out = run(make_job(minimal_manifest, status=status, maxRestarts=3), pod(0, attempt=3),
              pod(1, "Failed", attempt=3, exit_code=137))
    assert out.status is not None and out.status["phase"] == "Failed"
    assert out.condition("Failed")["reason"] == "MaxRestartsExceeded"
    assert out.restarts == []


def test_the_failure_that_exhausts_max_restarts_is_the_last_failure(
        minimal_manifest: dict) -> None:
    # An operator before failure classes wrote lastFailure as a sentence: still read.
    status = running_status(lastFailure="demo-worker-0 exited with code 1")
    out = run(make_job(minimal_manifest, status=status, maxRestarts=0), pod(0),
              pod(1, "Failed", exit_code=137, reason="Error", node="node-b"))
    assert out.status is not None and out.status["phase"] == "Failed"
    assert out.status["lastFailure"] == {
        "class": "Unknown", "pod": "demo-worker-1", "node": "node-b", "exitCode": 137,
        "message": "demo-worker-1 exited with code 137", "time": "2025-01-01T12:00:00Z"}


def test_losing_worker_0_with_its_node_restarts_the_group_without_waiting_on_a_checkpoint(
        minimal_manifest: dict) -> None:
    # Worker 1 waits on its lost peer in a collective: it cannot take part in a checkpoint,
    # so it gets the short grace, not the template's, and the group restarts soon.
    out = run(make_job(minimal_manifest, status=running_status()),
              pod(0, "Running", node_lost=True), pod(1))
    assert out.deleted == [DeletePod("demo-worker-0", "NodeLost", 0),
                           DeletePod("demo-worker-1", "NodeLost", HUNG_GROUP_GRACE_SECONDS)]


def test_pod_on_a_lost_node_is_force_deleted_and_replaced(minimal_manifest: dict) -> None:
    out = run(make_job(minimal_manifest, status=running_status()), pod(0),
              pod(1, "Running", node_lost=True))
    assert out.deleted == [DeletePod("demo-worker-1", "NodeLost", 0)]
    assert [r.reason for r in out.restarts] == ["NodeLost"]


def test_a_lost_node_s_pod_is_replaced_with_no_backoff_though_the_restart_counts(
        minimal_manifest: dict) -> None:
    # Its second counted restart: any other failure would wait 2 x backoffSeconds (20 s).
    job = make_job(minimal_manifest, status=running_status(restarts=1))
    out = run(job, pod(0), pod(1, "Running", node_lost=True))
    assert out.status is not None and out.status["restarts"] == 2
    assert "(restart 2 of 3, in 0s)" in out.condition("Restarting")["message"]
    assert out.wakes == []  # nothing to wait for
    # The pod is gone (force-deleted): its replacement comes in the same second.
    again = run(make_job(minimal_manifest, status=out.status), pod(0))
    assert again.created == [("Pod", "demo-worker-1", "1")]
    # A failure of the pod's own still waits its backoff.
    failed = run(job, pod(0), pod(1, "Failed", exit_code=137, reason="Error"))
    assert failed.status is not None
    assert run(make_job(minimal_manifest, status=failed.status), pod(0)).created == []


def test_pod_pending_past_its_deadline_is_recreated(minimal_manifest: dict) -> None:
    job = make_job(minimal_manifest, status=running_status(phase="Pending"),
                   pendingDeadlineSeconds=60)
    fresh = run(job, pod(0), pod(1, "Pending", created_at=NOW - timedelta(seconds=30)))
    assert fresh.deleted == []
    stuck = run(job, pod(0), pod(1, "Pending", created_at=NOW - timedelta(seconds=61)))
    assert stuck.deleted_names == ["demo-worker-1"]
    assert [r.reason for r in stuck.restarts] == ["PendingTimeout"]


def test_active_deadline_fails_the_job(minimal_manifest: dict) -> None:
    status = running_status(startTime=(NOW - timedelta(seconds=100)).isoformat())
    out = run(make_job(minimal_manifest, status=status, activeDeadlineSeconds=100),
              pod(0), pod(1))
    assert out.status is not None and out.status["phase"] == "Failed"
    assert out.condition("Failed")["reason"] == "DeadlineExceeded"
    assert out.deleted_names == ["demo-worker-0", "demo-worker-1"]


# --- completion and cleanup ---------------------------------------------------------------


def test_rank_zero_exiting_zero_completes_and_stops_the_others(minimal_manifest: dict) -> None:
    out = run(make_job(minimal_manifest, status=running_status()),
              pod(0, "Succeeded", exit_code=0), pod(1))
    assert out.status is not None and out.status["phase"] == "Succeeded"
    assert out.condition("Succeeded")["reason"] == "Completed"
    assert out.condition("Running")["status"] == "False"
    assert out.deleted_names == ["demo-worker-1"]
    assert out.events == [("Normal", "Completed")]


@pytest.mark.parametrize(("policy", "deleted"), [
    ("None", []),
    ("Running", ["demo-worker-0"]),
    ("All", ["demo-worker-0", "demo-worker-1"]),
])
def test_clean_pod_policy_after_failure(minimal_manifest: dict, policy: str,
                                        deleted: list[str]) -> None:
    status = running_status(phase="Failed", completionTime=NOW.isoformat())
    out = run(make_job(minimal_manifest, status=status, cleanPodPolicy=policy),
              pod(0), pod(1, "Failed", exit_code=2))
    assert out.deleted_names == deleted


def test_ttl_after_finished_deletes_the_job(minimal_manifest: dict) -> None:
    status = running_status(phase="Succeeded", completionTime=NOW.isoformat())
    job = make_job(minimal_manifest, status=status, ttlSecondsAfterFinished=30)
    assert not run(job, now=NOW + timedelta(seconds=29)).job_deleted
    assert run(job, now=NOW + timedelta(seconds=30)).job_deleted


# --- suspend, resume, scale ---------------------------------------------------------------


def test_suspend_deletes_the_pods_and_resume_recreates_them(minimal_manifest: dict) -> None:
    job = make_job(minimal_manifest, status=running_status(), suspend=True)
    out = run(job, pod(0), pod(1))
    assert out.deleted_names == ["demo-worker-0", "demo-worker-1"]
    assert out.status is not None and out.status["phase"] == "Suspended"
    assert out.status["workers"]["desired"] == 0
    assert out.events == [("Normal", "Suspended")]
    assert out.restarts == []

    resumed = run(make_job(minimal_manifest, status=out.status, suspend=False))
    assert resumed.created == [("Pod", "demo-worker-0", "0"), ("Pod", "demo-worker-1", "0")]
    assert resumed.status is not None and resumed.status["phase"] == "Pending"
    assert resumed.condition("Suspended")["reason"] == "Resumed"
    assert ("Normal", "Resumed") in resumed.events
    assert ("Normal", "Scaled") not in resumed.events


def test_scaling_up_adds_workers_and_down_removes_the_highest(minimal_manifest: dict) -> None:
    up = run(make_job(minimal_manifest, replicas=3, status=running_status(),
                      progressDeadlineSeconds=None), pod(0), pod(1))
    assert up.created == [("Pod", "demo-worker-2", "0")]
    assert ("Normal", "Scaled") in up.events
    assert up.status is not None and up.status["phase"] == "Running"

    down_status = running_status(workers={"desired": 3, "ready": 3})
    down = run(make_job(minimal_manifest, replicas=2, status=down_status,
                        progressDeadlineSeconds=None),
               pod(0), pod(1), pod(2))
    assert down.deleted == [DeletePod("demo-worker-2", "ScaledDown")]
    assert down.restarts == []


# --- hang detection and progress ----------------------------------------------------------


def test_step_not_advancing_past_the_deadline_restarts_the_group(minimal_manifest: dict) -> None:
    updated = NOW - timedelta(seconds=601)
    status = running_status(progress={"step": 40, "updatedAt": updated.isoformat()})
    job = make_job(minimal_manifest, status=status, progressDeadlineSeconds=600)
    stalled = MetricsSample(step=40, last_step_time=updated)
    out = run(job, pod(0), pod(1), metrics=stalled)
    # No checkpoint can be agreed in a hung group: the pods get a short grace, not 300 s.
    assert out.deleted == [DeletePod(f"demo-worker-{i}", "ProgressDeadlineExceeded",
                                     HUNG_GROUP_GRACE_SECONDS) for i in range(2)]
    assert out.restarts == [CountRestart("ProgressDeadlineExceeded", hang=True)]
    assert out.condition("Restarting")["reason"] == "ProgressDeadlineExceeded"
    assert ("Warning", "ProgressDeadlineExceeded") in out.events

    advancing = MetricsSample(step=41, last_step_time=NOW - timedelta(seconds=1))
    fine = run(job, pod(0), pod(1), metrics=advancing)
    assert fine.deleted == [] and fine.restarts == []


def test_metrics_become_progress_and_latest_checkpoint(minimal_manifest: dict) -> None:
    sample = MetricsSample(step=120, max_steps=1000, epoch=1.25, loss=2.5,
                           tokens_per_second=1234.5,
                           last_step_time=NOW - timedelta(seconds=2), checkpoint_step=100,
                           checkpoint_time=NOW - timedelta(seconds=30))
    out = run(make_job(minimal_manifest, status=running_status()), pod(0), pod(1),
              metrics=sample)
    assert out.status is not None
    assert out.status["progress"] == {
        "step": 120, "maxSteps": 1000, "epoch": 1.25, "loss": 2.5, "tokensPerSecond": 1234.5,
        "updatedAt": (NOW - timedelta(seconds=2)).isoformat().replace("+00:00", "Z")}
    assert out.status["latestCheckpoint"]["step"] == 100
    assert out.status["latestCheckpoint"]["uri"] == "s3://checkpoints/demo"
    assert "bestCheckpoint" not in out.status  # no keepBest checkpoint reported


def test_the_best_checkpoint_of_rank_0s_metrics_becomes_status(minimal_manifest: dict) -> None:
    from kubetrain.operator.facts import metrics_sample

    sample = metrics_sample("kubetrain_step 130\nkubetrain_best_checkpoint_step 80\n"
                            "kubetrain_best_checkpoint_validation_loss 2.125\n")
    out = run(make_job(minimal_manifest, status=running_status()), pod(0), pod(1),
              metrics=sample)
    assert out.status is not None
    assert out.status["bestCheckpoint"] == {
        "step": 80, "validationLoss": 2.125, "uri": "s3://checkpoints/demo/step-00000080"}
    # Before any best checkpoint the gauges read 0: no status.
    none_yet = metrics_sample("kubetrain_step 5\nkubetrain_best_checkpoint_step 0\n"
                              "kubetrain_best_checkpoint_validation_loss 0\n")
    out = run(make_job(minimal_manifest, status=running_status()), pod(0), pod(1),
              metrics=none_yet)
    assert out.status is not None and "bestCheckpoint" not in out.status


def test_metrics_become_goodput_and_an_eta_from_the_recent_step_time(
        minimal_manifest: dict) -> None:
    # Seven redone steps of 84 ms: under a second, and still lost progress.
    seconds = {"productive": 900.4, "data_wait": 10.0, "startup": 40.2, "downtime": 49.4,
               "oom": 12.6, "lost_progress": 7 * 0.084, "straggler": 0.4321}
    sample = MetricsSample(step=400, max_steps=1000, step_time=1.5,
                           last_step_time=NOW - timedelta(seconds=2), wall_seconds=seconds)
    out = run(make_job(minimal_manifest, status=running_status()), pod(0), pod(1),
              metrics=sample)
    assert out.status is not None
    assert out.status["progress"]["etaSeconds"] == (1000 - 400) * 1.5
    goodput = out.status["goodput"]
    wall = sum(seconds.values())
    assert goodput["wallSeconds"] == pytest.approx(wall, abs=5e-4)
    assert goodput["productiveSeconds"] == 900.4
    assert goodput["ratio"] == round(900.4 / wall, 4)
    assert goodput["badputSeconds"] == {
        "dataWait": 10.0, "checkpointSave": 0, "checkpointLoad": 0, "startup": 40.2,
        "evaluation": 0, "lostProgress": 0.588, "downtime": 49.4, "oom": 12.6,
        "straggler": 0.432, "preflight": 0, "degraded": 0}
    # The figures add up to the wall time (to the millisecond each is shown with).
    assert goodput["productiveSeconds"] + sum(goodput["badputSeconds"].values()) == \
        pytest.approx(goodput["wallSeconds"], abs=len(seconds) * 5e-4)


# --- admission ----------------------------------------------------------------------------


def test_invalid_spec_fails_once_with_reason_invalid_spec() -> None:
    message = "spec.workers.minReplicas (4) is greater than maxReplicas (2)"
    first = Outcome.of(reject(None, 1, message, NOW))
    assert first.status is not None and first.status["phase"] == "Failed"
    assert first.condition("Failed") == {
        "type": "Failed", "status": "True", "reason": "InvalidSpec", "message": message,
        "lastTransitionTime": "2025-01-01T12:00:00Z"}
    assert first.events == [("Warning", "InvalidSpec")]
    assert reject(first.status, 1, message, NOW + timedelta(seconds=5)) == []


def test_corrected_spec_gets_a_fresh_start(minimal_manifest: dict) -> None:
    failed = Outcome.of(reject(None, 1, "bad", NOW)).status
    out = run(make_job(minimal_manifest, status=failed, generation=2), service=False)
    assert out.status is not None and out.status["phase"] == "Pending"
    assert len(out.created) == 4


def test_merge_patch_sets_changes_and_removes_dropped_fields() -> None:
    old = {"phase": "Failed", "completionTime": "t", "workers": {"desired": 2, "ready": 1}}
    new = {"phase": "Pending", "workers": {"desired": 2, "ready": 2}}
    assert merge_patch(old, new) == {"phase": "Pending", "completionTime": None,
                                     "workers": {"ready": 2}}
    assert merge_patch(new, new) == {}


# --- an operator stopped between recording a restart and deleting its pods ---------------


def _recorded_restart(reason: str) -> dict[str, Any]:
    """Status right after a restart was written: restart 1, attempt 1, Restarting."""
    status = running_status(phase="Restarting", restarts=1, restartAttempt=1,
                            lastRestartTime=NOW.isoformat())
    status["conditions"].append({"type": "Restarting", "status": "True", "reason": reason,
                                 "lastTransitionTime": NOW.isoformat()})
    return status


@pytest.mark.parametrize(("reason", "pods", "deleted"), [
    pytest.param("WorkerFailed", [pod(0), pod(1, "Failed", exit_code=137)],
                 ["demo-worker-1"], id="failed-worker-not-yet-deleted"),
    pytest.param("WorkerFailed", [pod(0), pod(1, "Failed", exit_code=1)],
                 ["demo-worker-1"], id="exit-code-streak-not-counted-again"),
    pytest.param("WorkerFailed", [pod(0, "Failed", exit_code=137), pod(1)],
                 ["demo-worker-0", "demo-worker-1"], id="worker-zero-takes-the-whole-group"),
    pytest.param("ProgressDeadlineExceeded", [pod(0), pod(1)],
                 ["demo-worker-0", "demo-worker-1"], id="hang-restart-of-running-pods"),
])
def test_restart_recorded_before_a_crash_is_finished_not_counted_again(
        minimal_manifest: dict, reason: str, pods: list[WorkerPod], deleted: list[str]) -> None:
    status = _recorded_restart(reason)
    job = make_job(minimal_manifest, status=status)
    out = run(job, *pods)
    assert out.deleted_names == deleted
    assert out.restarts == [] and out.events == []
    assert out.status is None or (out.status["restarts"], out.status["restartAttempt"]) == (1, 1)

    # Once they are gone, the replacements come with the recorded attempt, still restart 1.
    later = NOW + timedelta(seconds=backoff_seconds(job.spec.run_policy, 1))
    survivors = [p for p in pods if p.name not in deleted]
    after = run(job, *survivors, now=later)
    assert after.created == [("Pod", name, "1") for name in deleted]
    assert after.restarts == []


def test_a_survivor_failing_while_the_group_re_forms_joins_the_same_restart(
        minimal_manifest: dict) -> None:
    status = _recorded_restart("WorkerFailed")
    out = run(make_job(minimal_manifest, replicas=3, status=status), pod(0),
              pod(1, attempt=1), pod(2, "Failed", exit_code=75))
    assert out.deleted_names == ["demo-worker-2"]
    assert out.restarts == []


def test_a_permanent_failure_during_a_restart_still_fails_the_job(minimal_manifest: dict) -> None:
    out = run(make_job(minimal_manifest, status=_recorded_restart("WorkerFailed")), pod(0),
              pod(1, "Failed", exit_code=2))
    assert out.status is not None and out.status["phase"] == "Failed"
    assert out.condition("Failed")["reason"] == "PermanentError"


def test_a_failure_after_the_restart_completed_is_a_new_restart(minimal_manifest: dict) -> None:
    status = running_status(restarts=1, restartAttempt=1)
    out = run(make_job(minimal_manifest, status=status), pod(0, attempt=1),
              pod(1, "Failed", exit_code=137))
    assert out.deleted_names == ["demo-worker-1"]
    assert out.status is not None and out.status["restarts"] == 2


# --- the trainer's config snapshot follows the spec -----------------------------------------


def test_a_changed_spec_updates_the_config_map_and_keeps_the_running_workers(
        minimal_manifest: dict) -> None:
    training = running_status(progress={"step": 5, "updatedAt": NOW.isoformat()})
    job = make_job(minimal_manifest, status=training, generation=2)
    observed = Observed(pods=(pod(0), pod(1)), service=True, config_generation=1)
    out = Outcome.of(reconcile(job, observed, NOW))
    updates = [a for a in out.actions if isinstance(a, UpdateConfigMap)]
    assert len(updates) == 1
    manifest = updates[0].manifest
    assert manifest["metadata"]["annotations"]["kubetrain.io/job-generation"] == "2"
    assert parse_job(yaml.safe_load(manifest["data"]["job.yaml"])).spec == job.spec
    assert out.deleted == [] and out.created == [] and out.restarts == []
    assert out.events == [("Normal", "ConfigUpdated")]
    assert out.status is not None and out.status["observedGeneration"] == 2

    # Once the watch shows the new snapshot, nothing more happens.
    settled = make_job(minimal_manifest, status=out.status, generation=2)
    again = reconcile(settled, replace(observed, config_generation=2), NOW)
    assert again == []


def test_pod_terminating_on_a_lost_node_is_force_deleted_to_free_its_name(
        minimal_manifest: dict) -> None:
    # The taint eviction controller marked it for deletion; no kubelet will ever confirm it.
    out = run(make_job(minimal_manifest, status=running_status()), pod(0),
              pod(1, "Running", node_lost=True, deleting=True))
    assert DeletePod("demo-worker-1", "NodeLost", 0) in out.deleted


@pytest.mark.parametrize(("ready", "reachable"), [
    ("True", True), ("False", True), ("Unknown", False), (None, True)])
def test_a_node_is_lost_once_its_ready_condition_is_unknown(ready: str | None,
                                                            reachable: bool) -> None:
    from kubetrain.operator.facts import node_reachable, worker_pod

    status = {"conditions": [{"type": "Ready", "status": ready}] if ready else []}
    assert node_reachable(status) is reachable
    nodes = {"node-a"} if node_reachable(status) else set()
    bound = {"metadata": {"name": "demo-worker-1"}, "spec": {"nodeName": "node-a"},
             "status": {"phase": "Running"}}
    assert worker_pod(bound, nodes).node_lost is not reachable


def test_no_latest_checkpoint_before_the_trainer_commits_one(minimal_manifest: dict) -> None:
    # What rank 0's /metrics reads before its first checkpoint: step 0, timestamp 0.
    from kubetrain.operator.facts import metrics_sample

    sample = metrics_sample("kubetrain_step 3\nkubetrain_latest_checkpoint_step 0\n"
                            "kubetrain_latest_checkpoint_timestamp_seconds 0\n")
    out = run(make_job(minimal_manifest, status=running_status()), pod(0), pod(1),
              metrics=sample)
    assert out.status is not None and out.status["progress"]["step"] == 3
    assert "latestCheckpoint" not in out.status


def test_status_takes_the_last_step_and_checkpoint_from_rank_0s_termination_message(
        minimal_manifest: dict) -> None:
    # The run ended after the last scrape (step 20): rank 0's exit left its last gauges.
    from kubetrain.operator.facts import final_metrics

    last = ("kubetrain_step 24.0\nkubetrain_max_steps 24.0\nkubetrain_epoch 2.0\n"
            "kubetrain_loss 6.5\n"
            "kubetrain_latest_checkpoint_step 24.0\n"
            "kubetrain_latest_checkpoint_timestamp_seconds 1.7e+09\n")
    status = running_status(progress={"step": 20, "maxSteps": 24},
                            latestCheckpoint={"step": 20, "uri": "s3://checkpoints/demo"})
    pods = (pod(0, "Succeeded", exit_code=0, termination_message=last), pod(1))
    out = run(make_job(minimal_manifest, status=status), *pods, metrics=final_metrics(pods))
    assert out.status is not None and out.status["phase"] == "Succeeded"
    assert out.status["progress"]["step"] == 24 and out.status["progress"]["loss"] == 6.5
    assert out.status["progress"]["epoch"] == 2.0
    assert out.status["latestCheckpoint"]["step"] == 24
    assert final_metrics((pod(0), pod(1))) is None  # running: its /metrics is the source


def test_a_distillation_jobs_progress_carries_both_terms_of_its_loss(
        minimal_manifest: dict) -> None:
    from kubetrain.operator.facts import metrics_sample

    exposition = ("kubetrain_step 7\nkubetrain_loss 4.25\nkubetrain_ce_loss 6.5\n"
                  "kubetrain_kd_loss 2.0\n")
    distilled = {**minimal_manifest, "spec": {**minimal_manifest["spec"],
                                               "distillation": {"teacher": "s3://m/t"}}}
    out = run(make_job(distilled, status=running_status()), pod(0), pod(1),
              metrics=metrics_sample(exposition))
    assert out.status is not None
    progress = out.status["progress"]
    assert (progress["loss"], progress["ceLoss"], progress["kdLoss"]) == (4.25, 6.5, 2.0)
    # A job without a teacher exports no such gauges, and status shows no such terms.
    plain = "kubetrain_step 7\nkubetrain_loss 4.25\n"
    out = run(make_job(minimal_manifest, status=running_status()), pod(0), pod(1),
              metrics=metrics_sample(plain))
    assert out.status is not None
    assert "ceLoss" not in out.status["progress"] and "kdLoss" not in out.status["progress"]


# --- failure classes from real pod-status shapes -----------------------------------------


def _failed_pod(container: dict[str, Any] | None = None, *, node: str = "node-a",
                **status: Any) -> dict[str, Any]:
    """A worker pod manifest as the API server returns it once its trainer container ended."""
    terminated = {"terminated": {"finishedAt": "2025-01-01T11:59:00Z", **(container or {})}}
    return {
        "metadata": {"name": "demo-worker-1", "labels": {
            "kubetrain.io/worker-index": "1", "kubetrain.io/restart-attempt": "0"},
            "creationTimestamp": "2025-01-01T11:00:00Z"},
        "spec": {"nodeName": node},
        "status": {"phase": "Failed", **status,
                   "containerStatuses": [{"name": "trainer", "state": terminated}]},
    }


def _trainer_said(failure_class: str, message: str) -> str:
    """A termination message as kubetrain.trainer.metrics writes it for a failed trainer."""
    return (f'kubetrain_worker_failure_info{{class="{failure_class}",message="{message}",'
            f'micro_batch_size="8"}} 1.0\nkubetrain_step 12.0\n')


DISRUPTION = "DisruptionTarget"
FAILURE_SHAPES = [
    ("OOMKilled", _failed_pod({"exitCode": 137, "reason": "OOMKilled"})),
    # Exit 137 with the OOM in the pod's own reason (the container's says only Error).
    ("OOMKilled", _failed_pod({"exitCode": 137, "reason": "Error"}, reason="OOMKilled",
                              message="container trainer was OOM-killed")),
    ("CUDAOutOfMemory", _failed_pod({"exitCode": 1, "reason": "Error", "message": _trainer_said(
        "CUDAOutOfMemory", "CUDA out of memory. Tried to allocate 2.00 GiB")})),
    ("Evicted", _failed_pod({"exitCode": 137, "reason": "Error"}, reason="Evicted",
                            message="The node was low on resource: memory.")),
    ("Evicted", _failed_pod({"exitCode": 143, "reason": "Error"}, conditions=[
        {"type": DISRUPTION, "status": "True", "reason": "EvictionByEvictionAPI"}])),
    ("Preempted", _failed_pod({"exitCode": 143, "reason": "Error"}, conditions=[
        {"type": DISRUPTION, "status": "True", "reason": "PreemptionByScheduler"}])),
    ("Preempted", _failed_pod({"exitCode": 143, "reason": "Error"}, reason="Terminated",
                              message="Pod was terminated in response to imminent node "
                              "shutdown.")),
    ("NodeLost", _failed_pod({"exitCode": 137, "reason": "Error"}, conditions=[
        {"type": DISRUPTION, "status": "True", "reason": "DeletionByTaintManager"}])),
    ("NodeLost", _failed_pod({"exitCode": 0}, node="gone")),  # its node left the cluster
    ("CollectiveTimeout", _failed_pod({"exitCode": 1, "reason": "Error", "message": _trainer_said(
        "CollectiveTimeout", "gloo: Timed out waiting 1800000ms for recv operation")})),
    ("GPUError", _failed_pod({"exitCode": 1, "reason": "Error", "message": _trainer_said(
        "GPUError", "CUDA error: uncorrectable ECC error encountered")})),
    ("PreflightFailed", _failed_pod({"exitCode": 1, "reason": "Error", "message": _trainer_said(
        "PreflightFailed", "rank 1: matmul differs from the reference")})),
    ("UserError", _failed_pod({"exitCode": 2, "reason": "Error"})),
    ("Unknown", _failed_pod({"exitCode": 1, "reason": "Error"})),
    ("Unknown", _failed_pod({"exitCode": 137, "reason": "Error"})),  # a kill from outside
]


@pytest.mark.parametrize(("expected", "manifest"), FAILURE_SHAPES,
                         ids=[f"{c}-{i}" for i, (c, _) in enumerate(FAILURE_SHAPES)])
def test_every_failure_class_from_a_real_pod_status(expected: str, manifest: dict) -> None:
    observed = worker_pod(manifest, nodes={"node-a"})
    assert classify(observed, [2, 126, 127]) == expected


def test_a_failure_is_recorded_in_status_an_event_and_the_metric(minimal_manifest: dict) -> None:
    job = make_job(minimal_manifest, status=running_status(failures={"NodeLost": 2}))
    failed = worker_pod(FAILURE_SHAPES[9][1], nodes={"node-a"})  # CollectiveTimeout
    out = run(job, pod(0, node="node-b"), replace(failed, created_at=EARLIER))
    assert out.status is not None
    assert out.status["lastFailure"] == {
        "class": "CollectiveTimeout", "pod": "demo-worker-1", "node": "node-a", "exitCode": 1,
        "message": "demo-worker-1 exited with code 1: gloo: Timed out waiting 1800000ms for "
                   "recv operation", "time": "2025-01-01T12:00:00Z"}
    assert out.status["failures"] == {"NodeLost": 2, "CollectiveTimeout": 1}
    event = next(a for a in out.actions if isinstance(a, RecordEvent)
                 and a.reason == "WorkerFailure")
    assert event.message.startswith("demo-worker-1 on node-a: CollectiveTimeout: ")
    assert [a.failure_class for a in out.actions if isinstance(a, CountFailure)] == [
        "CollectiveTimeout"]
    # Once recorded, the pod being replaced is not counted again.
    again = run(make_job(minimal_manifest, status=out.status), pod(0),
                replace(failed, deleting=True))
    assert again.status is None or again.status["failures"] == out.status["failures"]


def test_the_specific_failure_is_the_last_failure_not_its_peers_consequence(
        minimal_manifest: dict) -> None:
    oom = worker_pod(FAILURE_SHAPES[0][1], nodes={"node-a"})
    peer = pod(0, "Failed", exit_code=1, reason="Error", node="node-b")
    out = run(make_job(minimal_manifest, status=running_status()), peer,
              replace(oom, created_at=EARLIER))
    assert out.status is not None
    assert out.status["lastFailure"]["class"] == "OOMKilled"
    assert out.status["failures"] == {"OOMKilled": 1, "Unknown": 1}


# --- out of memory: halve the micro-batch, keep the global batch ------------------------


def _oom_job(minimal_manifest: dict, status: dict, micro: int = 8, accumulation: int = 2,
             **out_of_memory: Any) -> TrainingJob:
    manifest = copy.deepcopy(minimal_manifest)
    manifest["spec"]["optimization"] = {"microBatchSize": micro,
                                        "gradientAccumulationSteps": accumulation}
    return make_job(manifest, status=status, outOfMemory=out_of_memory)


def _config_snapshot(out: Outcome) -> dict[str, Any]:
    update = next(a for a in out.actions if isinstance(a, UpdateConfigMap))
    assert update.manifest["metadata"]["annotations"]["kubetrain.io/micro-batch-size"] == str(
        update_micro(update))
    return dict(yaml.safe_load(update.manifest["data"]["job.yaml"]))


def update_micro(update: UpdateConfigMap) -> int:
    snapshot = yaml.safe_load(update.manifest["data"]["job.yaml"])
    return int(snapshot["status"]["effective"]["microBatchSize"])


def test_an_oom_killed_worker_restarts_the_group_with_half_the_micro_batch(
        minimal_manifest: dict) -> None:
    job = _oom_job(minimal_manifest, running_status(restarts=1, restartAttempt=1))
    oom = replace(worker_pod(FAILURE_SHAPES[0][1], nodes={"node-a"}), restart_attempt=1)
    out = run(job, pod(0, attempt=1), oom)
    assert out.status is not None
    assert out.status["phase"] == "Restarting"
    assert out.status["effective"] == {
        "microBatchSize": 4, "gradientAccumulationSteps": 4, "outOfMemoryRestarts": 1,
        "specMicroBatchSize": 8, "reason": "demo-worker-1 OOMKilled at micro-batch 8",
        "time": "2025-01-01T12:00:00Z"}
    # Not counted in maxRestarts; a new restart attempt for every pod; no backoff.
    assert (out.status["restarts"], out.status["restartAttempt"]) == (1, 2)
    assert out.deleted_names == ["demo-worker-0", "demo-worker-1"]
    assert ("Normal", "MicroBatchHalved") in out.events
    assert out.condition("Restarting")["reason"] == "OutOfMemory"
    # The spec is never written: the trainer reads the halved values from the ConfigMap.
    snapshot = _config_snapshot(out)
    assert snapshot["spec"]["optimization"]["microBatchSize"] == 8
    assert snapshot["status"]["effective"]["microBatchSize"] == 4
    assert parse_job(snapshot).micro_batch_size == 4
    # The status write comes before the ConfigMap's, both before any pod exists again.
    kinds = [type(a).__name__ for a in out.actions]
    assert kinds.index("WriteStatus") < kinds.index("UpdateConfigMap")
    after = run(make_job(minimal_manifest | {"spec": job.spec.wire()}, status=out.status),
                now=NOW)
    assert [c[1] for c in after.created] == ["demo-worker-0", "demo-worker-1"]


def test_the_global_batch_is_kept_with_global_batch_tokens_too(minimal_manifest: dict) -> None:
    manifest = copy.deepcopy(minimal_manifest)
    # 2 workers x 6 sequences x 1024 tokens x 3 micro-steps: 36864 tokens a step.
    manifest["spec"]["optimization"] = {"microBatchSize": 6, "globalBatchTokens": 36864}
    job = make_job(manifest, status=running_status())
    oom = worker_pod(FAILURE_SHAPES[2][1], nodes={"node-a"})  # CUDAOutOfMemory
    out = run(job, pod(0), replace(oom, created_at=EARLIER))
    assert out.status is not None
    effective = out.status["effective"]
    assert (effective["microBatchSize"], effective["gradientAccumulationSteps"]) == (3, 6)
    assert 2 * 3 * 1024 * 6 == 36864


def test_oom_at_the_smallest_micro_batch_fails_the_job_with_estimates_advice(
        minimal_manifest: dict) -> None:
    effective = {"microBatchSize": 2, "gradientAccumulationSteps": 8, "outOfMemoryRestarts": 2}
    job = _oom_job(minimal_manifest, running_status(effective=effective), minMicroBatch=2)
    out = run(job, pod(0), replace(worker_pod(FAILURE_SHAPES[0][1], nodes={"node-a"}),
                                   created_at=EARLIER))
    assert out.status is not None and out.status["phase"] == "Failed"
    failed = out.condition("Failed")
    assert failed["reason"] == "OutOfMemory"
    assert "no smaller micro-batch is left (runPolicy.outOfMemory.minMicroBatch: 2" in (
        failed["message"])
    assert "kubetrain estimate" in failed["message"]
    assert ("Warning", "OutOfMemory") in out.events


def test_oom_restarts_have_their_own_limit_of_log2_of_the_micro_batch(
        minimal_manifest: dict) -> None:
    status = running_status()
    seen = []
    for _ in range(5):
        job = _oom_job(minimal_manifest, status)
        oom = replace(worker_pod(FAILURE_SHAPES[0][1], nodes={"node-a"}), created_at=EARLIER,
                      restart_attempt=status.get("restartAttempt", 0))
        out = run(job, pod(0, attempt=status.get("restartAttempt", 0)), oom)
        assert out.status is not None
        status = out.status
        seen.append(status["effective"]["microBatchSize"])
        if status["phase"] == "Failed":
            break
    assert seen == [4, 2, 1, 1]  # log2(8) = 3 halvings, then the job fails
    assert status["restarts"] == 0
    assert out.condition("Failed")["reason"] == "OutOfMemory"


def test_action_fail_ends_the_job_at_the_first_oom(minimal_manifest: dict) -> None:
    job = _oom_job(minimal_manifest, running_status(), action="Fail")
    out = run(job, pod(0), replace(worker_pod(FAILURE_SHAPES[0][1], nodes={"node-a"}),
                                   created_at=EARLIER))
    assert out.status is not None and out.status["phase"] == "Failed"
    assert "runPolicy.outOfMemory.action is Fail" in out.condition("Failed")["message"]


def test_a_config_map_left_at_the_old_micro_batch_is_rewritten(minimal_manifest: dict) -> None:
    effective = {"microBatchSize": 4, "gradientAccumulationSteps": 4, "outOfMemoryRestarts": 1}
    job = _oom_job(minimal_manifest, running_status(effective=effective))
    observed = Observed(pods=(pod(0), pod(1)), service=True, config_generation=1,
                        config_micro_batch=8)
    updates = [a for a in reconcile(job, observed, NOW) if isinstance(a, UpdateConfigMap)]
    assert [update_micro(u) for u in updates] == [4]
    current = Observed(pods=(pod(0), pod(1)), service=True, config_generation=1,
                       config_micro_batch=4)
    assert not [a for a in reconcile(job, current, NOW) if isinstance(a, UpdateConfigMap)]


def test_status_effective_shows_the_spec_batch_before_any_oom(minimal_manifest: dict) -> None:
    out = run(_oom_job(minimal_manifest, running_status()), pod(0), pod(1))
    assert out.status is not None
    assert out.status["effective"] == {"microBatchSize": 8, "gradientAccumulationSteps": 2,
                                       "outOfMemoryRestarts": 0, "specMicroBatchSize": 8}


def test_a_new_micro_batch_in_the_spec_replaces_the_healed_one(minimal_manifest: dict) -> None:
    # Healed from 8 to 4; then the user writes 16 into the spec (in Git, say).
    effective = {"microBatchSize": 4, "gradientAccumulationSteps": 4, "outOfMemoryRestarts": 1,
                 "specMicroBatchSize": 8}
    out = run(_oom_job(minimal_manifest, running_status(effective=effective), micro=16),
              pod(0), pod(1))
    assert out.status is not None
    assert out.status["effective"] == {"microBatchSize": 16, "gradientAccumulationSteps": 2,
                                       "outOfMemoryRestarts": 0, "specMicroBatchSize": 16}
    assert ("Normal", "MicroBatchReset") in out.events


# --- restarts in place (the lifelines, issue 33 item 2) -----------------------------------


TRAINING = {"step": 40, "updatedAt": NOW.isoformat()}  # the step advanced just now


def _with_ends(job: TrainingJob, *pods: WorkerPod, ends: tuple[Any, ...]) -> Outcome:
    observed = Observed(pods=pods, service=True, config_generation=job.metadata.generation,
                        trainer_ends=ends)
    return Outcome.of(reconcile(job, observed, NOW))


def test_a_trainer_restarted_in_place_is_recorded_once_with_its_class(
        minimal_manifest: dict) -> None:
    from kubetrain.operator.actions import CountFailure
    from kubetrain.operator.facts import TrainerEnd

    killed = TrainerEnd(pod="demo-worker-1", time=NOW - timedelta(seconds=1),
                        failure_class="Unknown", message="the trainer ended without a word")
    out = _with_ends(make_job(minimal_manifest, status=running_status(progress=TRAINING)),
                     pod(0), pod(1, node="node-b"), ends=(killed,))
    assert out.status is not None
    assert out.status["lastFailure"] == {
        "class": "Unknown", "pod": "demo-worker-1", "node": "node-b",
        "message": "the trainer ended without a word",
        "time": (NOW - timedelta(seconds=1)).isoformat().replace("+00:00", "Z")}
    assert out.status["failures"] == {"Unknown": 1}
    assert ("Warning", "WorkerFailure") in out.events
    assert [a.failure_class for a in out.actions if isinstance(a, CountFailure)] == ["Unknown"]
    # torchrun restarted the group in place: no pod is deleted, but the restart counts
    # (maxRestarts, the backoff of later ones, the progress deadline's start), as
    # `kubetrain run` counts the same failure.
    assert out.deleted == [] and out.status["phase"] == "Running"
    assert out.status["restarts"] == 1 and out.status["restartAttempt"] == 0
    assert out.status["lastRestartTime"] == out.status["lastFailure"]["time"]
    assert [r.reason for r in out.restarts] == ["RestartedInPlace"]
    assert ("Warning", "RestartedInPlace") in out.events
    # The next pass sees the same end again (the lifelines keep it a while): nothing new.
    again = _with_ends(make_job(minimal_manifest, status=out.status), pod(0),
                       pod(1, node="node-b"), ends=(killed,))
    assert again.status is None or again.status["failures"] == {"Unknown": 1}
    assert ("Warning", "WorkerFailure") not in again.events
    # A later one (a collective that timed out) is news.
    timed_out = TrainerEnd(pod="demo-worker-0", time=NOW, failure_class="CollectiveTimeout",
                           message="the trainer exited 88", exit_code=88)
    third = _with_ends(make_job(minimal_manifest, status=out.status), pod(0),
                       pod(1, node="node-b"), ends=(killed, timed_out))
    assert third.status is not None
    assert third.status["failures"] == {"Unknown": 1, "CollectiveTimeout": 1}
    assert third.status["lastFailure"]["class"] == "CollectiveTimeout"
    assert third.status["lastFailure"]["exitCode"] == 88
    assert third.status["restarts"] == 2 and third.status["failureStreak"]["exitCode"] == 88


def test_the_ranks_of_one_restart_in_place_count_one_restart(minimal_manifest: dict) -> None:
    from kubetrain.operator.facts import TrainerEnd

    # A hung group: both ranks time out of the same collective, a second apart.
    ends = tuple(TrainerEnd(pod=f"demo-worker-{index}", time=NOW + timedelta(seconds=index),
                            failure_class="CollectiveTimeout", exit_code=88,
                            message="the trainer exited 88; torchrun restarts the group in "
                                    "place") for index in (0, 1))
    first = _with_ends(make_job(minimal_manifest, status=running_status(progress=TRAINING)),
                       pod(0), pod(1), ends=ends[:1])
    assert first.status is not None
    out = _with_ends(make_job(minimal_manifest, status=first.status), pod(0), pod(1), ends=ends)
    assert out.status is not None
    assert out.status["failures"] == {"CollectiveTimeout": 2}
    assert out.status["restarts"] == 1 and out.status["failureStreak"]["count"] == 1
    assert out.restarts == [] and ("Warning", "RestartedInPlace") not in out.events
    # A failure of the next round is a restart of its own.
    later = TrainerEnd(pod="demo-worker-1", time=NOW + timedelta(seconds=30),
                       failure_class="Unknown", message="gone")
    third = _with_ends(make_job(minimal_manifest, status=out.status), pod(0), pod(1),
                       ends=(*ends, later))
    assert third.status is not None and third.status["restarts"] == 2


def test_a_restart_in_place_within_its_pods_budget_counts_though_max_restarts_are_spent(
        minimal_manifest: dict) -> None:
    from kubetrain.operator.facts import TrainerEnd

    # The job's two restarts were spent replacing pods; worker 1 is a new pod, whose
    # torchrun has its own budget (PET_MAX_RESTARTS=2) and restarts in place whatever
    # status.restarts says: counted and shown, and the job runs on.
    killed = TrainerEnd(pod="demo-worker-1", time=NOW, failure_class="Unknown",
                        message="the trainer ended without a word; torchrun restarts the "
                                "group in place")
    spent = make_job(minimal_manifest, status=running_status(progress=TRAINING, restarts=2),
                     maxRestarts=2)
    out = _with_ends(spent, pod(0), pod(1), ends=(killed,))
    assert out.status is not None and out.status["phase"] == "Running"
    assert out.status["restarts"] == 3 and out.status["failures"] == {"Unknown": 1}
    assert [r.reason for r in out.restarts] == ["RestartedInPlace"]
    [shown] = [a.message for a in out.actions
               if isinstance(a, RecordEvent) and a.reason == "RestartedInPlace"]
    assert "demo-worker-1's restart in place 1 of 2" in shown, shown
    assert out.deleted == [] and out.created == []


def test_an_out_of_memory_kill_past_the_pods_budget_is_left_to_the_pod_which_halves(
        minimal_manifest: dict) -> None:
    from kubetrain.operator.facts import TrainerEnd
    from kubetrain.operator.recovery import LEFT_TO_THE_POD

    # maxRestarts 2, both spent, and worker 1's torchrun restarted in place twice already:
    # its budget is spent too. The kernel's OOM kill of its trainer (no word on the
    # lifeline) ends the pod, not the job: the pod's OOMKilled end halves the micro-batch.
    in_place = "; torchrun restarts the group in place"
    earlier = tuple(TrainerEnd(pod="demo-worker-1", time=NOW - timedelta(seconds=seconds),
                               failure_class="Unknown", message=f"killed{in_place}")
                    for seconds in (60, 30))
    oom = TrainerEnd(pod="demo-worker-1", time=NOW, failure_class="Unknown",
                     message=f"the trainer ended without a word{in_place}")
    status = running_status(progress=TRAINING, restarts=2, failures={"Unknown": 2},
                            lastFailure={"class": "Unknown", "pod": "demo-worker-1",
                                         "message": f"killed{in_place}",
                                         "time": (NOW - timedelta(seconds=30)).isoformat()})
    job = make_job(minimal_manifest, status=status, maxRestarts=2)
    out = _with_ends(job, pod(0), pod(1), ends=(*earlier, oom))
    assert out.status is not None and out.status["phase"] == "Running"
    assert out.status["restarts"] == 2 and out.restarts == []
    assert out.status["failures"] == {"Unknown": 3}
    assert out.status["lastFailure"]["message"] == (
        f"the trainer ended without a word; {LEFT_TO_THE_POD}")
    assert ("Warning", "RestartedInPlace") not in out.events
    assert out.deleted == [] and out.created == []
    # torchrun gives up; the pod's own end names the OOM kill, and out of memory heals
    # (it spends no maxRestarts); the trainer's end is retracted for it.
    failed = pod(1, phase="Failed", exit_code=1, reason="OOMKilled")
    after = _with_ends(make_job(minimal_manifest, status=out.status, maxRestarts=2), pod(0),
                       failed, ends=(*earlier, oom))
    assert after.status is not None and after.status["phase"] == "Restarting"
    assert after.status["restart"]["reason"] == "OutOfMemory"
    assert after.status["effective"]["microBatchSize"] < make_job(
        minimal_manifest).spec.optimization.micro_batch_size
    assert after.status["restarts"] == 2
    assert after.status["failures"] == {"Unknown": 2, "OOMKilled": 1}


def test_a_restart_in_place_that_ends_the_job_ends_the_pass_there(
        minimal_manifest: dict) -> None:
    from kubetrain.operator.facts import TrainerEnd

    invalid = TrainerEnd(pod="demo-worker-1", time=NOW, failure_class="Unknown",
                         message="the trainer exited 2", exit_code=2)
    # Worker 2 is missing and worker 0 failed: a running job would create the one and
    # restart the other in this pass.
    job = make_job(minimal_manifest, replicas=3, status=running_status(progress=TRAINING))
    out = _with_ends(job, pod(0, phase="Failed", exit_code=1), pod(1), ends=(invalid,))
    assert out.status is not None and out.status["phase"] == "Failed"
    assert out.condition("Failed")["reason"] == "PermanentError"
    # The end is recorded and nothing else acts: no pod created, deleted or cleaned up,
    # no failure of worker 0 recorded, no restart.
    assert [type(a).__name__ for a in out.actions] == [
        "WriteStatus", "RecordEvent", "CountFailure", "RecordEvent"]
    assert out.events == [("Warning", "WorkerFailure"), ("Warning", "PermanentError")]
    assert out.status["failures"] == {"Unknown": 1} and out.status.get("restarts", 0) == 0
    # The next pass finds the job finished and cleans up (cleanPodPolicy Running).
    after = _with_ends(make_job(minimal_manifest, replicas=3, status=out.status),
                       pod(0, phase="Failed", exit_code=1), pod(1), ends=(invalid,))
    assert [(d.name, d.reason) for d in after.deleted] == [("demo-worker-1", "JobFinished")]
    assert after.created == []


def test_under_max_restarts_0_a_trainer_end_is_left_to_its_pods_own_end(
        minimal_manifest: dict) -> None:
    from kubetrain.operator.facts import TrainerEnd

    # torchrun gets PET_MAX_RESTARTS=0 and restarts nothing in place: the pod is ending, and
    # its end names what the lifeline could not (the kernel's OOM kill is healed by halving
    # the micro-batch, never failed as MaxRestartsExceeded).
    killed = TrainerEnd(pod="demo-worker-0", time=NOW, failure_class="Unknown",
                        message="the trainer ended without a word")
    job = make_job(minimal_manifest, status=running_status(progress=TRAINING), maxRestarts=0)
    out = _with_ends(job, pod(0), pod(1), ends=(killed,))
    assert out.status is not None and out.status["phase"] == "Running"
    assert out.status["failures"] == {"Unknown": 1} and out.status.get("restarts", 0) == 0
    assert out.restarts == [] and ("Warning", "RestartedInPlace") not in out.events


def test_a_trainer_end_in_a_pod_that_failed_or_goes_is_the_pods_own_story(
        minimal_manifest: dict) -> None:
    from kubetrain.operator.facts import TrainerEnd

    end = TrainerEnd(pod="demo-worker-1", time=NOW, failure_class="Unknown", message="gone")
    for gone in (pod(1, deleting=True), pod(1, phase="Failed", exit_code=137)):
        job = make_job(minimal_manifest, status=running_status(progress=TRAINING))
        out = _with_ends(job, pod(0), gone, ends=(end,))
        assert out.status is not None
        assert "gone" not in out.status.get("lastFailure", {}).get("message", "")


def test_a_pod_whose_trainer_went_silent_is_replaced_as_lost_and_its_node_avoided(
        minimal_manifest: dict) -> None:
    job = make_job(minimal_manifest, status=running_status(progress=TRAINING))
    observed = Observed(pods=(pod(0, node="node-a"), pod(1, node="node-b")), service=True,
                        config_generation=job.metadata.generation,
                        silent_pods=frozenset({"demo-worker-1"}))
    out = Outcome.of(reconcile(job, observed, NOW))
    assert out.status is not None
    # Replaced at once, with no grace (nothing there answers), before any node controller
    # marks node-b; the survivor stays for torchrun to re-form the group with the new pod.
    assert [(d.name, d.grace_period_seconds) for d in out.deleted] == [("demo-worker-1", 0)]
    assert out.status["lastFailure"]["class"] == "NodeLost"
    assert out.status["lastFailure"]["node"] == "node-b"
    [avoided] = out.status["avoidedNodes"]
    assert (avoided["node"], avoided["reason"]) == ("node-b", "Unreachable")
    assert ("Warning", "NodeAvoided") in out.events
    # A silent pod that is already going is left to its deletion.
    going = Observed(pods=(pod(0, node="node-a"), pod(1, node="node-b", deleting=True)),
                     service=True, config_generation=job.metadata.generation,
                     silent_pods=frozenset({"demo-worker-1"}))
    again = Outcome.of(reconcile(job, going, NOW))
    assert again.deleted == [] and (again.status or {}).get("avoidedNodes") in (None, [])


def test_worker_pods_tolerate_a_lost_node_briefly_unless_the_template_says_otherwise(
        minimal_manifest: dict) -> None:
    from kubetrain.operator.children import worker_pod

    def tolerations(job: TrainingJob) -> list[dict[str, Any]]:
        return worker_pod(job, 1, 0)["spec"].get("tolerations") or []

    assert tolerations(make_job(minimal_manifest)) == [
        {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute",
         "tolerationSeconds": 10},
        {"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute",
         "tolerationSeconds": 10}]
    assert {t["tolerationSeconds"] for t in tolerations(
        make_job(minimal_manifest, nodeLossTolerationSeconds=4))} == {4}
    assert tolerations(make_job(minimal_manifest, nodeLossTolerationSeconds=None)) == []
    # The template's own toleration for a key wins; the other key still gets the policy's.
    manifest = copy.deepcopy(minimal_manifest)
    theirs = {"key": "node.kubernetes.io/unreachable", "operator": "Exists",
              "effect": "NoExecute", "tolerationSeconds": 600}
    manifest.setdefault("spec", {})
    job = make_job(manifest)
    job.spec.workers.template.tolerations = [theirs]
    assert tolerations(job) == [theirs, {
        "key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute",
        "tolerationSeconds": 10}]


def test_a_pod_that_fails_just_after_its_trainer_ended_failed_once(
        minimal_manifest: dict) -> None:
    # The kernel killed the whole container (memory): the lifeline closed first and the end
    # was recorded as a restart in place, then the pod's status came. One failure, the pod's.
    from kubetrain.operator.facts import TrainerEnd

    end = TrainerEnd(pod="demo-worker-1", time=NOW - timedelta(seconds=2),
                     failure_class="Unknown",
                     message="the trainer ended without a word; torchrun restarts the group "
                             "in place")
    first = _with_ends(make_job(minimal_manifest, status=running_status(progress=TRAINING)),
                       pod(0), pod(1), ends=(end,))
    assert first.status is not None and first.status["failures"] == {"Unknown": 1}
    failed = pod(1, phase="Failed", exit_code=137, reason="OOMKilled")
    out = _with_ends(make_job(minimal_manifest, status=first.status), pod(0), failed,
                     ends=(end,))
    assert out.status is not None
    assert out.status["failures"] == {"OOMKilled": 1}
    assert out.status["lastFailure"]["class"] == "OOMKilled"
    # Nor is it a restart in place: the pod's own restart replaces that one, here out of
    # memory's, which spends no maxRestarts.
    assert first.status["restarts"] == 1
    assert out.status["restarts"] == 0 and out.status["restart"]["reason"] == "OutOfMemory"
