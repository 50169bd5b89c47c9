"""Rank 0 leaves its last gauges in the container's termination log when it exits.

The operator reads /metrics only while the trainer runs; the kubelet copies the
termination log into the pod's status, where the operator reads the last step and
checkpoint of a run that ended between two scrapes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kubetrain.api.trainingjob import TrainingJob
from kubetrain.operator.facts import metrics_sample
from kubetrain.trainer import metrics


def _reporter(manifest: dict[str, Any], tmp_path: Path) -> metrics.Reporter:
    spec = TrainingJob.model_validate(manifest).spec
    return metrics.Reporter(spec, enabled=True, metrics_log=tmp_path / "metrics.jsonl",
                            job_name="demo", serve=False)


def test_rank_0_leaves_its_last_step_and_checkpoint_in_the_termination_log(
        minimal_manifest: dict[str, Any], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    log = tmp_path / "termination-log"
    log.touch()  # the kubelet creates it in the container
    monkeypatch.setenv("KUBETRAIN_TERMINATION_LOG", str(log))
    reporter = _reporter(minimal_manifest, tmp_path)
    metrics.STEP.set(24)
    reporter.checkpointed(24, "s3://checkpoints/demo/step-00000024", 1.7e9)
    reporter.close()

    assert len(log.read_bytes()) <= 4096
    last = metrics_sample(log.read_text())
    assert (last.step, last.checkpoint_step) == (24, 24)
    assert last.checkpoint_time is not None


def test_no_termination_log_is_written_outside_a_pod(
        minimal_manifest: dict[str, Any], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    log = tmp_path / "termination-log"
    monkeypatch.setenv("KUBETRAIN_TERMINATION_LOG", str(log))
    _reporter(minimal_manifest, tmp_path).close()
    assert not log.exists()
