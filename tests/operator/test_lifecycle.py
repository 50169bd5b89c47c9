"""The lifecycle rules (kubetrain.operator.lifecycle) as tables: the active deadline,
completion, what a finished job cleans up, and the job as the ConfigMap snapshot carries it.
The steps themselves run through `reconcile` in test_reconcile."""

from __future__ import annotations

import sys
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from kubetrain.api.trainingjob import EffectiveBatch, TrainingJobStatus
from kubetrain.operator.lifecycle import deadline_passed, job_as_run, rank0_succeeded, to_clean_up

sys.path.insert(0, str(Path(__file__).parent))
from test_reconcile import EARLIER, NOW, make_job, pod


@pytest.mark.parametrize(("case", "limit", "start", "passed"), [
    ("no activeDeadlineSeconds never passes", None, EARLIER, False),
    ("a job not started yet has no deadline", 60, None, False),
    ("a second short of the limit", 3600, EARLIER + timedelta(seconds=1), False),
    ("at the limit exactly", 3600, EARLIER, True),
    ("past it", 60, EARLIER, True),
])
def test_the_active_deadline_counts_from_the_start(case: str, limit: int | None,
                                                   start: datetime | None, passed: bool) -> None:
    assert deadline_passed(limit, start, NOW) is passed, case


@pytest.mark.parametrize(("case", "pods", "done"), [
    ("worker 0 exited 0", [pod(0, "Succeeded"), pod(1, "Running")], True),
    ("another worker exiting 0 is not completion", [pod(0, "Running"), pod(1, "Succeeded")],
     False),
    ("worker 0 failed", [pod(0, "Failed"), pod(1, "Succeeded")], False),
    ("a succeeded worker 0 being deleted (a restart took it) is not completion",
     [pod(0, "Succeeded", deleting=True)], False),
    ("no pods", [], False),
])
def test_the_job_completes_when_worker_0_exits_0(case: str, pods: list, done: bool) -> None:
    assert rank0_succeeded(pods) is done, case


@pytest.mark.parametrize(("case", "phase", "succeeded", "policy", "deleted"), [
    ("a succeeded job stops its running pods even with policy None", "Running", True, "None",
     True),
    ("a failed job with policy None keeps them for debugging", "Running", False, "None", False),
    ("policy Running stops a failed job's active pods", "Pending", False, "Running", True),
    ("policy Running keeps the finished ones", "Failed", False, "Running", False),
    ("policy All deletes the finished ones too", "Failed", False, "All", True),
    ("policy None keeps a finished pod of a succeeded job", "Succeeded", True, "None", False),
])
def test_clean_pod_policy_decides_which_pods_a_finished_job_deletes(
        case: str, phase: str, succeeded: bool, policy: str, deleted: bool) -> None:
    assert to_clean_up(pod(1, phase), succeeded, policy) is deleted, case


def test_the_job_as_run_carries_the_effective_micro_batch_and_leaves_the_job_as_it_was(
        minimal_manifest: dict[str, Any]) -> None:
    job = make_job(minimal_manifest)
    spec_micro = job.spec.optimization.micro_batch_size
    status = TrainingJobStatus(effective=EffectiveBatch(
        micro_batch_size=max(1, spec_micro // 2), gradient_accumulation_steps=2))
    as_run = job_as_run(job, status)
    assert as_run.micro_batch_size == max(1, spec_micro // 2)
    assert as_run.status is status and as_run.spec == job.spec
    assert job.status is None and job.micro_batch_size == spec_micro
