"""Fixtures of the trainer tests: a tiny job on the shared prepared corpus, and how to launch it.

Training runs in real processes: `torchrun --standalone` with gloo on CPU for
several ranks, plain `python -m kubetrain.trainer` for one (a group of one, as a
notebook gets), each with one CPU thread so two ranks share the two cores.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from kubetrain.local.launch import free_port
from kubetrain.local.node import descendants, rank_processes

JobFactory = Callable[..., Path]


def deep_merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in overrides.items():
        merged[key] = (deep_merge(merged[key], value)
                       if isinstance(value, dict) and isinstance(merged.get(key), dict) else value)
    return merged


def write_tiny_job(prepared_corpus: Any, folder: Path, name: str = "tiny",
                   **spec: Any) -> Path:
    """`folder`/`name`/job.yaml: a `tiny`-preset TrainingJob on the corpus (seqLen 64)
    with `spec` overrides."""
    base = {
        "image": "kubetrain/trainer:test",
        "model": {"preset": "tiny"},
        "data": {"train": prepared_corpus.train_uri, "seqLen": 64},
        "optimization": {"maxSteps": 20, "microBatchSize": 8, "warmupSteps": 5},
        "evaluation": {"everySteps": 0, "batches": 4},
        "parallelism": {"precision": "fp32"},
        "checkpoint": {"uri": str(folder / name / "checkpoints"), "everySteps": 1000,
                       "export": False},
        "metrics": {"port": free_port(), "logEverySteps": 1},
        # The suite's host is shared by three test workers at once: a rank of a 4-rank job
        # can be starved for every one of its link exchanges (CI, stop 78: 0.60 GB/s against
        # the median's 1.36). The preflight measures such a rank again before failing it,
        # but the starving can outlast both rounds here with no fault in the job. Tests
        # here judge links only where a rank is far slower; test_preflight's links section
        # starves a rank on purpose and judges at the default.
        "runPolicy": {"preflight": {"minBandwidthFraction": 0.1}},
    }
    manifest = {"apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob",
                "metadata": {"name": name}, "spec": deep_merge(base, spec)}
    path = folder / name / "job.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(manifest))
    return path


@pytest.fixture
def tiny_job(prepared_corpus: Any, tmp_path: Path) -> JobFactory:
    """Writes a `tiny`-preset TrainingJob on the corpus (seqLen 64) with `spec` overrides."""

    def write(name: str = "tiny", **spec: Any) -> Path:
        return write_tiny_job(prepared_corpus, tmp_path, name, **spec)

    return write


class Launcher:
    """Starts trainer processes for a job file and reads what they logged."""

    free_port = staticmethod(free_port)

    def command(self, job: Path, ranks: int, *, in_pod: bool = False,
                plain_torchrun: bool = False) -> list[str]:
        """For several ranks, torchrun as a worker pod runs it (kubetrain.trainer.launch: the
        ranks fork from a server that imported the loop once, about half the wall time of a
        4-rank launch on 2 cores, and it serves the pod's lifeline where KUBETRAIN_POD_NAME
        is set), or torchrun itself (`plain_torchrun`); for one, a plain process (a group of
        one) unless `in_pod`."""
        trainer = ["-m", "kubetrain.trainer"]
        trainer_args = [str(job), "--metrics-log", str(self.log(job))]
        if ranks == 1 and not in_pod:
            return [sys.executable, *trainer, *trainer_args]
        launch = ["-m", "torch.distributed.run"] if plain_torchrun else [
            "-m", "kubetrain.trainer.launch"]
        return [sys.executable, *launch, "--standalone", f"--nproc-per-node={ranks}",
                *(trainer if plain_torchrun else []), *trainer_args]

    def env(self) -> dict[str, str]:
        return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}

    def log(self, job: Path) -> Path:
        return job.with_name("metrics.jsonl")

    def run(self, job: Path, ranks: int, timeout: float = 180) -> str:
        """Run the job to completion; what its launch printed."""
        done = subprocess.run(self.command(job, ranks), env=self.env(), capture_output=True,
                              text=True, timeout=timeout)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
        return done.stdout

    def train(self, job: Path, ranks: int, timeout: float = 180) -> list[dict[str, Any]]:
        """Run the job to completion and return its metrics-log events."""
        self.run(job, ranks, timeout)
        return self.events(job)

    def worker_pid(self, agent: int, rank: int, timeout: float = 60) -> int:
        """The pid of torchrun `agent`'s worker for `rank` (named kt-rank-N), once it runs:
        the agent's child, or under kubetrain.trainer.launch its fork server's."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for pid, its_rank in rank_processes(descendants(agent)).items():
                if its_rank == rank:
                    return pid
            time.sleep(0.02)
        raise AssertionError(f"torchrun (pid {agent}) started no worker for rank {rank}")

    @contextlib.contextmanager
    def paused(self, pid: int, stopped: tuple[float, float], running: tuple[float, float],
               between: tuple[Path, int, int] | None = None,
               computing_only: bool = False) -> Iterator[None]:
        """Stop `pid` on a duty cycle (a throttled node), from outside: SIGSTOP for a random
        period drawn from `stopped` seconds, then SIGCONT for one drawn from `running`.
        Random periods, so the pauses do not keep landing in the same part of each step.
        With `between=(job, first, last)`, only from when that job's metrics log has step
        `first` until it has step `last`: the start-up (imports, rendezvous, the model) and
        the shutdown are then neither judged nor slowed down twelvefold.
        With `computing_only`, each stop waits (up to 50 ms) until the process's main thread
        is on or waiting for a CPU (state R), not blocked in a collective: a slow GPU or a
        throttled CPU slows a rank's compute, while a stop inside a collective would book
        the pause as the rank's own wait (once most of an interval, under the other
        worker's load). Not longer: the whole group can be blocked for half a second on a
        loaded machine, and an interval without a stop is not slow."""
        done = threading.Event()
        main_thread = Path(f"/proc/{pid}/task/{pid}/stat")

        def computing() -> bool:
            try:
                return main_thread.read_text().rsplit(")", 1)[1].split()[0] == "R"
            except (OSError, IndexError):
                return True  # gone: the kill below says so

        def logged(step: int) -> bool:
            assert between is not None
            try:
                return any(event["step"] >= step for event in self.events(between[0], "step"))
            except ValueError:  # a line half written
                return False

        def pause_and_resume() -> None:
            while between is not None and not done.is_set() and not logged(between[1]):
                time.sleep(0.02)
            draw = random.Random(0)
            while not done.is_set() and not (between is not None and logged(between[2])):
                waited_until = time.monotonic() + 0.05
                while computing_only and not computing() and time.monotonic() < waited_until:
                    time.sleep(0.001)
                try:
                    os.kill(pid, signal.SIGSTOP)
                    time.sleep(draw.uniform(*stopped))
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    return
                time.sleep(draw.uniform(*running))

        pauser = threading.Thread(target=pause_and_resume, daemon=True)
        pauser.start()
        try:
            yield
        finally:
            done.set()
            pauser.join()
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    def events(self, job: Path, kind: str | None = None) -> list[dict[str, Any]]:
        """The metrics-log events of `job` (only those of `kind` when given). A line the
        trainer is still writing (no newline yet) is not read: a clean clone's run parsed
        one half-written and failed."""
        log = self.log(job)
        if not log.exists():
            return []
        text = log.read_text()
        complete = text[:text.rfind("\n") + 1]
        found = [json.loads(line) for line in complete.splitlines() if line.strip()]
        return [event for event in found if kind is None or event["event"] == kind]


@pytest.fixture(scope="session")  # stateless: module-scoped fixtures may train with it too
def launcher() -> Launcher:
    return Launcher()


@dataclass(frozen=True)
class HealthyRun:
    """A finished run nothing disturbed: its job file, what its launch printed, and its
    metrics-log events."""

    job: Path
    stdout: str
    events: list[dict[str, Any]]


HEALTHY_STEPS, HEALTHY_LOG_EVERY = 12, 4


@pytest.fixture(scope="session")
def healthy_runs(prepared_corpus: Any, tmp_path_factory: pytest.TempPathFactory,
                 launcher: Launcher) -> dict[int, HealthyRun]:
    """By number of ranks (2 under torchrun, 1 as a plain process): a healthy fsdp run of
    HEALTHY_STEPS steps, logged every HEALTHY_LOG_EVERY, with the preflight check on. The
    tests that only read what such a run shows (the preflight's passing line and its
    goodput, every rank's timing) share these two launches; tests/conftest.py keeps their
    modules on one pytest-xdist worker."""
    folder = tmp_path_factory.mktemp("healthy")
    runs = {}
    for ranks in (2, 1):
        job = write_tiny_job(prepared_corpus, folder, f"healthy-{ranks}",
                             optimization={"maxSteps": HEALTHY_STEPS},
                             metrics={"logEverySteps": HEALTHY_LOG_EVERY})
        runs[ranks] = HealthyRun(job, launcher.run(job, ranks), launcher.events(job))
    return runs
