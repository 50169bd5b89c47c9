"""What the `kubetrain run` tests share: a tiny job of kubetrain's trainer, starting the
command in a folder of its own as a user would, waiting for it, and reading the metrics log
it leaves (`runs/NAME/metrics.jsonl`)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from kubetrain.local.launch import free_port
from kubetrain.local.metrics_log import parse_lines
from kubetrain.local.node import rank_processes

RUN_TIMEOUT = 240


def tiny_job(name: str, corpus: Path, data: str, checkpoints: str, *, max_steps: int,
             storage: dict[str, Any] | None = None,
             run_policy: dict[str, Any] | None = None) -> dict[str, Any]:
    """A job that trains the tiny preset in well under a minute on 2 simulated nodes."""
    spec: dict[str, Any] = {
        "image": "ghcr.io/kubetrain/trainer:0.1.0",
        "workers": {"replicas": 2, "procsPerWorker": 1},
        "model": {"preset": "tiny"},
        "data": {"train": f"{data}/train", "seqLen": 64},
        "optimization": {"maxSteps": max_steps, "microBatchSize": 8, "warmupSteps": 10,
                         "learningRate": 3e-3},
        "parallelism": {"strategy": "fsdp", "precision": "fp32"},
        "evaluation": {"everySteps": 20, "batches": 4},
        "checkpoint": {"uri": checkpoints, "everySteps": 20},
        "metrics": {"port": free_port(), "logEverySteps": 5},
        "runPolicy": {"maxRestarts": 2, "backoffSeconds": 1, "progressDeadlineSeconds": 120,
                      **(run_policy or {})},
    }
    if storage:
        spec["storage"] = storage
    return {
        "apiVersion": "kubetrain.io/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": name,
                     "annotations": {"kubetrain.io/prepare-from": str(corpus)}},
        "spec": spec,
    }


def start_run(folder: Path, manifest: dict[str, Any], *extra: str) -> subprocess.Popen[str]:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "job.yaml").write_text(yaml.safe_dump(manifest))
    return subprocess.Popen(
        [sys.executable, "-m", "kubetrain", "run", "job.yaml", *extra],
        cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


def finish(run: subprocess.Popen[str], timeout: float = RUN_TIMEOUT) -> tuple[int, str]:
    """The run's exit status and output; after `timeout` seconds it is interrupted (as ^C
    would) and the test fails with its output."""
    try:
        output, _ = run.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        run.send_signal(signal.SIGINT)
        try:
            output, _ = run.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            run.kill()
            output, _ = run.communicate()
        pytest.fail(f"kubetrain run did not finish in {timeout}s:\n{output}")
    return run.returncode, output


def wait_for_step(run: subprocess.Popen[str], folder: Path, name: str, step: int) -> None:
    log = folder / "runs" / name / "metrics.jsonl"
    deadline = time.monotonic() + RUN_TIMEOUT
    while time.monotonic() < deadline and run.poll() is None:
        if log.exists() and any(e["event"] == "step" and e["step"] >= step
                                for e in parse_lines(log.read_text())):
            return
        time.sleep(0.2)
    pytest.fail(f"the run never reached step {step}")


def training_processes(folder: Path) -> list[int]:
    """The trainer ranks (kt-rank-N, not the torchrun agents) of runs started in `folder`."""
    found = []
    everything = (int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit())
    for pid in rank_processes(everything):
        with contextlib.suppress(OSError):
            if Path(os.readlink(f"/proc/{pid}/cwd")) == folder:
                found.append(pid)
    return found


def events(folder: Path, name: str) -> list[dict[str, Any]]:
    return parse_lines((folder / "runs" / name / "metrics.jsonl").read_text())


def of_kind(found: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [event for event in found if event["event"] == kind]
