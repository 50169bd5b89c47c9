"""What a reconcile pass reads into status (kubetrain.operator.observation), as tables:
the effective batch split, the world size, and rank 0's metrics as progress and
checkpoints. The steps themselves run through `reconcile` in test_reconcile."""

from __future__ import annotations

import copy
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from kubetrain.api.manifest import parse_job
from kubetrain.api.trainingjob import EffectiveBatch, TrainingJobStatus
from kubetrain.operator.facts import MetricsSample
from kubetrain.operator.observation import effective_batch, record_metrics, world_size

sys.path.insert(0, str(Path(__file__).parent))
from test_reconcile import EARLIER, NOW, make_job

URI = "s3://checkpoints/demo"


def batch_job(minimal_manifest: dict[str, Any], micro: int = 8) -> Any:
    manifest = copy.deepcopy(minimal_manifest)
    manifest["spec"]["optimization"] = {"microBatchSize": micro, "globalBatchTokens": 1 << 20}
    return make_job(manifest)


def test_world_size_is_workers_times_processes_per_worker(minimal_manifest: dict) -> None:
    manifest = copy.deepcopy(minimal_manifest)
    manifest["spec"]["workers"] = {"replicas": 3, "procsPerWorker": 4}
    assert world_size(parse_job(manifest)) == 12


@pytest.mark.parametrize(("case", "previous", "micro", "reset"), [
    ("none yet: the spec's", None, 8, False),
    ("a healed micro-batch is kept", {"micro_batch_size": 2, "spec_micro_batch_size": 8}, 2,
     False),
    ("one recorded before the spec was known is kept",
     {"micro_batch_size": 4, "spec_micro_batch_size": None}, 4, False),
    ("the user changed the spec's micro-batch: theirs now",
     {"micro_batch_size": 2, "spec_micro_batch_size": 16}, 8, True),
    ("not a divisor of the spec's: the spec's", {"micro_batch_size": 3}, 8, False),
    ("larger than the spec's: the spec's", {"micro_batch_size": 16}, 8, False),
])
def test_the_effective_micro_batch_and_the_accumulation_that_keeps_the_global_batch(
        minimal_manifest: dict, case: str, previous: dict | None, micro: int,
        reset: bool) -> None:
    job = batch_job(minimal_manifest)
    spec = job.spec
    before = (EffectiveBatch(gradient_accumulation_steps=1, out_of_memory_restarts=1, **previous)
              if previous is not None else None)
    effective, was_reset = effective_batch(spec, before, world_size(job))
    assert (effective.micro_batch_size, was_reset) == (micro, reset), case
    assert effective.spec_micro_batch_size == spec.optimization.micro_batch_size
    # Micro-batch times accumulation is the spec's: the global batch does not change.
    fresh = spec.gradient_accumulation(world_size(job))
    assert effective.micro_batch_size * effective.gradient_accumulation_steps == (
        spec.optimization.micro_batch_size * fresh), case
    kept = before is not None and effective.micro_batch_size == before.micro_batch_size
    assert effective.out_of_memory_restarts == (1 if kept else 0), case
    if before is not None:
        assert before.gradient_accumulation_steps == 1  # the previous value is not changed


def sample(**values: Any) -> MetricsSample:
    return MetricsSample(**values)


def test_rank_0s_metrics_become_progress_and_checkpoints() -> None:
    status = TrainingJobStatus()
    checkpoint_time = NOW - timedelta(minutes=1)
    record_metrics(status, sample(step=40, max_steps=100, loss=2.1234567, step_time=0.5,
                                  last_step_time=NOW - timedelta(seconds=5), checkpoint_step=30,
                                  checkpoint_time=checkpoint_time, best_checkpoint_step=20,
                                  best_checkpoint_val_loss=2.5, wall_seconds={
                                      "productive": 90.0, "restart": 10.0}), URI, NOW)
    progress = status.progress
    assert (progress.step, progress.max_steps, progress.loss) == (40, 100, 2.123457)
    assert progress.updated_at == NOW - timedelta(seconds=5)
    assert progress.eta_seconds == round((100 - 40) * 0.5)
    assert status.latest_checkpoint is not None
    assert (status.latest_checkpoint.step, status.latest_checkpoint.uri,
            status.latest_checkpoint.time) == (30, URI, checkpoint_time)
    assert status.best_checkpoint is not None and status.best_checkpoint.step == 20
    assert status.best_checkpoint.uri.startswith(URI + "/")
    assert status.goodput is not None and status.goodput.ratio == 0.9


@pytest.mark.parametrize(("case", "step", "last_step_time", "moves"), [
    ("a new step moves the time", 11, None, True),
    ("the same step with a newer step time moves it", 10, NOW - timedelta(seconds=1), True),
    ("the same step scraped again keeps it (a hang shows)", 10, None, False),
    ("the same step with an older step time keeps it", 10, EARLIER - timedelta(hours=1), False),
])
def test_progress_moves_only_when_training_did(case: str, step: int, last_step_time: Any,
                                               moves: bool) -> None:
    status = TrainingJobStatus.model_validate(
        {"progress": {"step": 10, "updatedAt": EARLIER.isoformat()}})
    record_metrics(status, sample(step=step, last_step_time=last_step_time), URI, NOW)
    expected = min(last_step_time or NOW, NOW) if moves else EARLIER
    assert (status.progress.step, status.progress.updated_at) == (step, expected), case


def test_no_checkpoint_before_the_trainer_commits_one() -> None:
    status = TrainingJobStatus()
    # The trainer's gauges read step 0 until its first commit, with no commit time.
    record_metrics(status, sample(step=3, checkpoint_step=0, best_checkpoint_step=0,
                                  best_checkpoint_val_loss=3.0), URI, NOW)
    assert status.latest_checkpoint is None and status.best_checkpoint is None
