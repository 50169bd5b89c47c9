"""torchrun restarting its workers in place: the path a surviving pod takes when the
operator replaces a lost peer, or when a rank is signalled (scale-down, eviction)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest


def _trainer_processes(agent: int) -> list[int]:
    """The training processes torchrun (pid `agent`) started."""
    children = Path(f"/proc/{agent}/task/{agent}/children").read_text().split()
    return [int(pid) for pid in children
            if b"kubetrain.trainer" in Path(f"/proc/{pid}/cmdline").read_bytes()]


def _sigterm_one_rank_at(launcher: Any, job: Any, step: int) -> None:
    """Train `job` on 2 ranks under torchrun --max-restarts=1 and SIGTERM one rank once
    `step` is logged, as Kubernetes does to an evicted pod: every rank saves the same
    checkpoint, the signalled rank exits 143 and the other 75; torchrun then restarts
    both in place, on the same store, and they must resume and finish."""
    command = launcher.command(job, ranks=2)
    command.insert(command.index("--standalone") + 1, "--max-restarts=1")
    agent = subprocess.Popen(command, env=launcher.env(), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not any(e["step"] >= step for e in launcher.events(job, "step")):
            assert agent.poll() is None and time.monotonic() < deadline, "training never began"
            time.sleep(0.1)
        os.kill(_trainer_processes(agent.pid)[-1], signal.SIGTERM)
        output, _ = agent.communicate(timeout=150)
    finally:
        if agent.poll() is None:
            agent.kill()
    assert agent.returncode == 0, output[-4000:]


@pytest.mark.slow
def test_a_signalled_rank_makes_torchrun_restart_the_group_in_place_from_its_checkpoint(
    tiny_job: Any, launcher: Any,
) -> None:
    job = tiny_job("in-place", optimization={"maxSteps": 40, "microBatchSize": 8,
                                             "warmupSteps": 5},
                   checkpoint={"everySteps": 1000, "export": False})
    _sigterm_one_rank_at(launcher, job, step=8)

    saved = [e["step"] for e in launcher.events(job, "checkpoint")]
    resumed = launcher.events(job, "resumed")
    assert len(resumed) == 1 and resumed[0]["step"] == saved[0] >= 8
    assert launcher.events(job, "finished")[-1]["step"] == 40


@pytest.mark.slow
def test_with_dropout_a_group_restarted_from_its_checkpoint_logs_the_uninterrupted_losses(
    tiny_job: Any, launcher: Any,
) -> None:
    """The dropout variant of the in-place restart: the checkpoint carries each rank's
    random generators, so the resumed ranks draw the masks the uninterrupted run drew and
    every step's loss is the same. Restarted ranks reseed, so without the saved generators
    the steps after the resume would differ."""
    spec = {"model": {"preset": "tiny", "dropout": 0.1},
            "optimization": {"maxSteps": 16, "microBatchSize": 8, "warmupSteps": 3},
            "checkpoint": {"everySteps": 1000, "export": False}}
    reference = tiny_job("dropout-steady", **spec)
    steady = {e["step"]: e["loss"] for e in launcher.train(reference, ranks=2)
              if e["event"] == "step"}

    job = tiny_job("dropout-restarted", **spec)
    _sigterm_one_rank_at(launcher, job, step=5)

    (resumed,) = launcher.events(job, "resumed")
    assert 5 <= resumed["step"] < 16, "the restart resumed from a checkpoint before the end"
    # A step redone after the restart logs its loss again: the last one counts.
    restarted = {e["step"]: e["loss"] for e in launcher.events(job, "step")}
    assert restarted == steady
