"""Own code under the operator, as pure decisions: reported progress, goodput from reported
steps, failure classes, node avoidance, the preflight and the unmarked-checkpoint warning."""

from __future__ import annotations

import copy
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

from kubetrain.api.manifest import parse_job
from kubetrain.api.trainingjob import TrainingJob
from kubetrain.operator.actions import RecordEvent, WriteStatus
from kubetrain.operator.facts import Observed, WorkerPod, reported_sample
from kubetrain.operator.observation import step_goodput
from kubetrain.operator.reconcile import reconcile
from kubetrain.operator.trainer_status_endpoint import StatusReports
from kubetrain.protocol import Report, TrainerFailure, unmarked_checkpoints

NOW = datetime(2025, 1, 1, 12, 0, 0, tzinfo=UTC)
START = NOW - timedelta(minutes=10)


def own_job(minimal_manifest: dict[str, Any], status: dict[str, Any] | None = None,
            **run_policy: Any) -> TrainingJob:
    manifest = copy.deepcopy(minimal_manifest)
    for typed in ("image", "model", "data"):
        del manifest["spec"][typed]
    manifest["metadata"].update(namespace="ml", uid="uid-1", generation=1)
    manifest["spec"]["trainer"] = {"image": "me/train:1", "command": ["python", "train.py"]}
    manifest["spec"]["workers"] = {"replicas": 2, "minReplicas": 1, "maxReplicas": 4}
    manifest["spec"]["runPolicy"] = {"backoffSeconds": 0, "maxRestarts": 3, **run_policy}
    if status is not None:
        manifest["status"] = status
    return parse_job(manifest)


def running(**extra: Any) -> dict[str, Any]:
    since = START.isoformat()
    return {"phase": "Running", "observedGeneration": 1, "startTime": since,
            "workers": {"desired": 2, "ready": 2},
            "conditions": [{"type": "Running", "status": "True", "reason": "WorkersRunning",
                            "lastTransitionTime": since}],
            **extra}


def pod(index: int, phase: str = "Running", **facts: Any) -> WorkerPod:
    return WorkerPod(name=f"demo-worker-{index}", index=index, restart_attempt=0, phase=phase,
                     ready=phase == "Running", created_at=START, **facts)


def report(step: int | None, **fields: Any) -> Report:
    values: dict[str, Any] = dict(total_steps=100, loss=2.0, learning_rate=None, epoch=None,
                                  progress_percent=None, remaining_seconds=None, metrics={},
                                  reported_at=NOW, received_at=NOW)
    values.update(fields)
    return Report(step=step, **values)


def status_after(job: TrainingJob, observed: Observed, now: datetime = NOW) -> dict[str, Any]:
    actions = reconcile(job, observed, now)
    writes = [action for action in actions if isinstance(action, WriteStatus)]
    return writes[0].status if writes else job.status.wire() if job.status else {}


def events(job: TrainingJob, observed: Observed) -> list[RecordEvent]:
    return [a for a in reconcile(job, observed, NOW) if isinstance(a, RecordEvent)]


def test_a_report_becomes_progress_with_the_codes_own_eta(minimal_manifest: dict) -> None:
    job = own_job(minimal_manifest, running(progress={"step": 10}))
    sample = reported_sample(report(40, remaining_seconds=90, loss=float("nan")))
    status = status_after(job, Observed(pods=(pod(0), pod(1)), service=True,
                                        config_generation=1, metrics=sample))
    progress = status["progress"]
    assert (progress["step"], progress["maxSteps"], progress["etaSeconds"]) == (40, 100, 90)
    assert "loss" not in progress  # a diverged loss is left unreported
    assert progress["updatedAt"] == NOW.isoformat().replace("+00:00", "Z")


def test_the_end_of_training_post_without_a_step_finishes_the_step_count(
        minimal_manifest: dict) -> None:
    # transformers' KubeflowCallback posts a step at most every 5 s; its on_train_end post is
    # progress 100 % with no current_step.
    job = own_job(minimal_manifest, running(progress={"step": 37, "maxSteps": 40}))
    end = reported_sample(report(None, total_steps=None, progress_percent=100,
                                 remaining_seconds=0))
    status = status_after(job, Observed(pods=(pod(0), pod(1)), service=True,
                                        config_generation=1, metrics=end))
    progress = status["progress"]
    assert (progress["step"], progress["maxSteps"], progress["etaSeconds"]) == (40, 40, 0)
    # A report at 100 % that names its step keeps that step.
    named = reported_sample(report(39, total_steps=40, progress_percent=100))
    status = status_after(job, Observed(pods=(pod(0), pod(1)), service=True,
                                        config_generation=1, metrics=named))
    assert status["progress"]["step"] == 39


def test_a_repeated_step_is_no_progress_and_the_hang_restarts_the_group(
        minimal_manifest: dict) -> None:
    stalled_since = NOW - timedelta(seconds=120)
    job = own_job(minimal_manifest, running(progress={
        "step": 40, "updatedAt": stalled_since.isoformat()}), progressDeadlineSeconds=60)
    # The reporter keeps posting step 40: the step has not advanced for 120 s.
    status = status_after(job, Observed(pods=(pod(0), pod(1)), service=True,
                                        config_generation=1,
                                        metrics=reported_sample(report(40))))
    assert status["restart"]["reason"] == "ProgressDeadlineExceeded"
    assert status["phase"] == "Restarting" and status["restarts"] == 1


def test_goodput_counts_time_between_advances_within_an_attempt() -> None:
    first = step_goodput(None, START, None, None, START + timedelta(seconds=60))
    assert first is not None and first.productive_seconds == 0  # start-up is downtime
    steady = step_goodput(first, START, None, START + timedelta(seconds=60),
                          START + timedelta(seconds=360))
    assert steady is not None
    assert (steady.productive_seconds, steady.wall_seconds) == (300, 360)
    assert steady.badput_seconds.downtime == 60 and steady.ratio == round(300 / 360, 4)
    # A restart at 400 s: the advance across it (from 360 s to 500 s) is downtime.
    restarted = START + timedelta(seconds=400)
    after = step_goodput(steady, START, restarted, START + timedelta(seconds=360),
                         START + timedelta(seconds=500))
    assert after is not None
    assert (after.productive_seconds, after.wall_seconds) == (300, 500)
    assert after.badput_seconds.downtime == 200


def test_reported_steps_become_goodput_in_status(minimal_manifest: dict) -> None:
    advanced = NOW - timedelta(seconds=30)
    job = own_job(minimal_manifest, running(progress={"step": 10,
                                                      "updatedAt": advanced.isoformat()}))
    status = status_after(job, Observed(pods=(pod(0), pod(1)), service=True,
                                        config_generation=1,
                                        metrics=reported_sample(report(20))))
    goodput = status["goodput"]
    assert goodput["productiveSeconds"] == 30 and goodput["wallSeconds"] == 600
    assert goodput["badputSeconds"]["downtime"] == 570


def test_steps_a_resumed_attempt_trains_again_are_lost_progress_not_goodput(
        minimal_manifest: dict) -> None:
    # Attempt 1 reports steps 10 and 20 and is lost; attempt 2 resumed from the checkpoint at
    # step 15 and reports 16, 20 and 24: its 4 s from 16 to 20 redo attempt 1's steps.
    reports = StatusReports(b"k" * 32)
    served = reports.admission("ml", "demo", f"Bearer {reports.admit('ml', 'demo', 'uid-1')}")
    job = own_job(minimal_manifest, running())
    for seconds, step in ((100, 10), (110, 20), (130, 16), (134, 20), (138, 24)):
        at = START + timedelta(seconds=seconds)
        reports.record(served, report(step, received_at=at))
        latest = reports.latest("ml", "demo")
        assert latest is not None
        job = own_job(minimal_manifest, status_after(job, Observed(
            pods=(pod(0), pod(1)), service=True, config_generation=1,
            metrics=reported_sample(latest)), at))
    assert latest is not None and latest.redone_until == 20
    assert job.status is not None and job.status.goodput is not None
    goodput = job.status.goodput.wire()
    # Productive: 10 -> 20 in attempt 1 (10 s) and 20 -> 24 in attempt 2 (4 s); the jump back
    # to 16 is downtime (the restart), 16 -> 20 lost progress.
    assert (goodput["productiveSeconds"], goodput["wallSeconds"]) == (14, 138)
    assert goodput["badputSeconds"]["lostProgress"] == 4
    assert goodput["badputSeconds"]["downtime"] == 120
    assert goodput["ratio"] == round(14 / 138, 4)


def test_a_resume_the_entry_reports_books_every_redone_step_though_reports_are_sparse(
        minimal_manifest: dict) -> None:
    # Attempt 1 reports steps 5 and 10 (every 5 s, 1 s a step) and is lost. Attempt 2's entry
    # restores the checkpoint of step 8 and says so; the script's reports come every 5 s, the
    # first at step 12, past the furthest reported (10): no report went back and no advance
    # covers a step attempt 1 reported. Steps 9 and 10 were redone all the same: 2 s.
    reports = StatusReports(b"k" * 32)
    served = reports.admission("ml", "demo", f"Bearer {reports.admit('ml', 'demo', 'uid-1')}")
    job = own_job(minimal_manifest, running())
    resumed = report(None, metrics={"resumed_step": "8"}, resumed_step=8)
    for seconds, sent in ((100, report(5)), (105, report(10)), (120, resumed),
                          (130, report(12)), (135, report(17)), (140, report(22))):
        at = START + timedelta(seconds=seconds)
        reports.record(served, replace(sent, received_at=at))
        latest = reports.latest("ml", "demo")
        assert latest is not None
        job = own_job(minimal_manifest, status_after(job, Observed(
            pods=(pod(0), pod(1)), service=True, config_generation=1,
            metrics=reported_sample(latest)), at))
    assert latest is not None and (latest.resumed_step, latest.first_step) == (8, 12)
    assert latest.step == 22 and latest.redone_until == 10  # the resume is no progress
    assert job.status is not None and job.status.goodput is not None
    goodput = job.status.goodput.wire()
    # Productive: 5 -> 10 (5 s) and 12 -> 22 (10 s); steps 9 and 10 at attempt 2's pace of
    # 1 s a step: 2 s of what was downtime until that pace was known.
    assert (goodput["productiveSeconds"], goodput["wallSeconds"]) == (15, 140)
    assert goodput["badputSeconds"]["lostProgress"] == 2
    assert goodput["badputSeconds"]["downtime"] == 123


def test_a_report_below_the_step_in_status_went_back_after_an_operator_restart() -> None:
    # The operator restarted while attempt 1 ran (status showed step 30); attempt 2's first
    # report (step 26) went back, so steps up to 30 are redone.
    reports = StatusReports(b"k" * 32)
    token = reports.admit("ml", "demo", "uid-1", step=30)
    job = reports.admission("ml", "demo", f"Bearer {token}")
    reports.record(job, report(26))
    assert reports.latest("ml", "demo").redone_until == 30  # type: ignore[union-attr]
    reports.record(job, report(40))
    reports.record(job, report(None, progress_percent=100))
    assert reports.latest("ml", "demo").redone_until == 30  # type: ignore[union-attr]


def test_own_code_failures_are_classed_and_retried_as_ours(minimal_manifest: dict) -> None:
    job = own_job(minimal_manifest, running())
    killed = pod(1, "Failed", exit_code=137, reason="OOMKilled", node="n1")
    status = status_after(job, Observed(pods=(pod(0), killed), service=True,
                                        config_generation=1))
    assert status["lastFailure"]["class"] == "OOMKilled"
    assert status["effective"]["outOfMemoryRestarts"] == 1  # halved, reaching the SDK
    assert status["restart"]["wholeGroup"] is True


def test_a_failed_preflight_avoids_the_named_node(minimal_manifest: dict) -> None:
    job = own_job(minimal_manifest, running())
    failed = pod(1, "Failed", exit_code=89, node="bad-node", termination_message="x",
                 trainer_failure=TrainerFailure("PreflightFailed", "NCCL all-reduce failed",
                                                nodes=("bad-node",)))
    status = status_after(job, Observed(pods=(pod(0, node="good"), failed), service=True,
                                        config_generation=1))
    assert [entry["node"] for entry in status["avoidedNodes"]] == ["bad-node"]
    assert status["restart"]["reason"] == "PreflightFailed"


def test_repeated_unknown_failures_on_a_node_avoid_it(minimal_manifest: dict) -> None:
    earlier = (NOW - timedelta(minutes=5)).isoformat()
    job = own_job(minimal_manifest, running(restarts=1, nodeFailures=[
        {"node": "flaky", "class": "Unknown", "time": earlier}]))
    failed = pod(1, "Failed", exit_code=1, node="flaky")
    status = status_after(job, Observed(pods=(pod(0, node="ok"), failed), service=True,
                                        config_generation=1))
    assert "flaky" in [entry["node"] for entry in status.get("avoidedNodes", [])]


def test_a_folder_never_marked_complete_gets_a_warning_once_the_pod_ends(
        minimal_manifest: dict) -> None:
    message = 'kubetrain_unmarked_checkpoints_info{folders="checkpoint-100,checkpoint-200"} 2\n'
    assert unmarked_checkpoints(message) == ("checkpoint-100", "checkpoint-200")
    job = own_job(minimal_manifest, running())
    failed = pod(1, "Failed", exit_code=1, unmarked_checkpoints=("checkpoint-100",))
    warned = [e for e in events(job, Observed(pods=(pod(0), failed), service=True,
                                              config_generation=1))
              if e.reason == "CheckpointNotMarked"]
    assert len(warned) == 1 and "checkpoint-100" in warned[0].message
    assert warned[0].type == "Warning"
    done = pod(0, "Succeeded", exit_code=0, unmarked_checkpoints=("checkpoint-300",))
    warned = [e for e in events(job, Observed(pods=(done, pod(1)), service=True,
                                              config_generation=1))
              if e.reason == "CheckpointNotMarked"]
    assert len(warned) == 1 and "checkpoint-300" in warned[0].message
