"""`kubetrain run` out of memory under a real memory limit: it heals and keeps the curve.

The limit is a cgroup's (memory.limit_in_bytes on cgroup v1, memory.max on v2) that the
test makes and puts the whole run in (runner, torchrun agent and trainer, as a pod's
container holds them): the kernel's OOM killer ends the trainer when a micro-batch does
not fit, and the runner reads the cgroup's OOM-kill count, as a container runtime does.
RLIMIT_AS was not used: torch reserves address space far beyond what it touches, so a
virtual-memory limit fails at import, not at the micro-batch.

The limit is not a number written here: a reference run at the micro-batch the job
should heal to, with the job's global batch, measures its peak in its own cgroup, and
the limited run gets that peak plus a margin well under what twice the micro-batch adds
(measured: ~750 MB at 4 sequences, ~950 MB at 8, ~1400 MB at 16).
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml
from host_tools import unavailable

from kubetrain.local.launch import free_port
from kubetrain.local.memory import memory_cgroup
from kubetrain.local.metrics_log import parse_lines

pytestmark = pytest.mark.slow

MARGIN = 64 << 20  # under the ~200 MB that doubling the micro-batch adds
STEPS = 6
CURVE_TOLERANCE = 1e-4  # the same global batch, summed in another order at worst
TIMEOUT = 400
CGROUP_EXIT_SECONDS = 10  # how long processes that are exiting may stay in the cgroup


def _new_cgroup() -> Path | None:
    """A fresh memory cgroup this process may write, or None where there is none."""
    own = memory_cgroup(Path("/proc/self/cgroup").read_text())
    if own is None or not os.access(own, os.W_OK):
        return None
    name = f"kubetrain-test-{uuid.uuid4().hex[:8]}"
    # v2 keeps processes out of inner nodes: a sibling under the parent, not a child.
    folder = own / name if (own / "memory.limit_in_bytes").exists() else own.parent / name
    try:
        folder.mkdir()
    except OSError:
        return None
    return folder


@contextmanager
def memory_limited(limit: int | None) -> Iterator[Path]:
    """A cgroup for one run, with `limit` bytes of memory (None: unlimited); removed after."""
    folder = _new_cgroup()
    if folder is None:
        unavailable("no writable memory cgroup here (needs root and cgroupfs)")
    try:
        if limit is not None:
            v1 = folder / "memory.limit_in_bytes"
            (v1 if v1.exists() else folder / "memory.max").write_text(str(limit))
        yield folder
    finally:
        _remove(folder)


def _remove(folder: Path) -> None:
    """Remove a run's cgroup once its processes are gone. The run's command has returned,
    but a process that is still exiting stays a member (rmdir: EBUSY) for a moment: wait
    for them; any left after that outlived the run, and that is an error."""
    deadline = time.monotonic() + CGROUP_EXIT_SECONDS
    while (members := (folder / "cgroup.procs").read_text().split()) and (
            time.monotonic() < deadline):
        time.sleep(0.1)
    left = {pid: _command_line(pid) for pid in members}
    for pid in members:
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)
    while True:
        try:
            folder.rmdir()
            break
        except OSError as error:
            if error.errno != errno.EBUSY or time.monotonic() > deadline + 5:
                raise
            time.sleep(0.1)
    assert not left, f"processes outlived the run in {folder}: {left}"


def _command_line(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return "(gone)"


def _peak(folder: Path) -> int:
    v1 = folder / "memory.max_usage_in_bytes"
    return int((v1 if v1.exists() else folder / "memory.peak").read_text())


def _job(name: str, corpus: Path, micro: int, accumulation: int) -> dict[str, Any]:
    """Attention over 256 tokens in a narrow model: memory grows fast with the micro-batch,
    compute stays small (16 sequences a step, a few seconds on one CPU thread)."""
    return {
        "apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob",
        "metadata": {"name": name, "annotations": {"kubetrain.io/prepare-from": str(corpus)}},
        "spec": {
            "image": "ghcr.io/kubetrain/trainer:0.1.0",
            "workers": {"replicas": 1},
            "model": {"preset": "custom", "dim": 64, "nLayers": 2, "nHeads": 4, "ffnDim": 256},
            "data": {"train": "data/train", "seqLen": 256},
            "optimization": {"maxSteps": STEPS, "microBatchSize": micro,
                             "gradientAccumulationSteps": accumulation, "warmupSteps": 1,
                             "learningRate": 3e-3},
            "parallelism": {"precision": "fp32"},
            "evaluation": {"everySteps": 0},
            "checkpoint": {"uri": "checkpoints", "everySteps": 3, "export": False},
            "metrics": {"port": free_port(), "logEverySteps": 1},
            "runPolicy": {"maxRestarts": 0, "backoffSeconds": 1},
        },
    }


def _run_in(cgroup: Path, folder: Path, manifest: dict[str, Any]) -> tuple[int, str]:
    """`kubetrain run` as a user would, its every process in `cgroup` from the start."""
    folder.mkdir(parents=True)
    (folder / "job.yaml").write_text(yaml.safe_dump(manifest))
    enter = f"echo $$ > {cgroup / 'cgroup.procs'} && exec \"$@\""
    done = subprocess.run(["sh", "-c", enter, "sh", sys.executable, "-m", "kubetrain", "run",
                           "job.yaml"], cwd=folder, capture_output=True, text=True,
                          timeout=TIMEOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return done.returncode, done.stdout + done.stderr


def _losses(folder: Path, name: str) -> dict[int, float]:
    found = parse_lines((folder / "runs" / name / "metrics.jsonl").read_text())
    return {int(e["step"]): float(e["loss"]) for e in found if e["event"] == "step"}


def test_a_run_out_of_memory_heals_to_a_micro_batch_that_fits_and_keeps_the_curve(
        tmp_path: Path, corpus: Path) -> None:
    # The reference: the healed split (4 x 4) of the job's global batch of 16 sequences.
    with memory_limited(None) as cgroup:
        code, output = _run_in(cgroup, tmp_path / "reference", _job("ref", corpus, 4, 4))
        peak = _peak(cgroup)
    assert code == 0, output

    limit = peak + MARGIN
    with memory_limited(limit) as cgroup:
        code, output = _run_in(cgroup, tmp_path / "healed", _job("oom", corpus, 16, 1))
    assert code == 0, output
    summary = next(line for line in output.splitlines() if line.lstrip().startswith(
        "micro-batch "))
    history = [int(size) for size in summary.split("(")[0].split()[1::2]]
    print(f"limit {limit >> 20} MiB (reference peak {peak >> 20} MiB); {summary.strip()}")
    assert history[0] == 16 and history[-1] <= 8, summary
    assert "OOMKilled" in output
    assert "training again" in summary, summary  # the time from the OOM to the next step

    # Each failure is in the metrics log with its class: the run report counts them.
    logged = parse_lines((tmp_path / "healed" / "runs" / "oom" / "metrics.jsonl").read_text())
    failures = [(e["class"], e["micro_batch_size"]) for e in logged if e["event"] == "failure"]
    assert failures == [("OOMKilled", size) for size in history[:-1]]

    healed, reference = _losses(tmp_path / "healed", "oom"), _losses(
        tmp_path / "reference", "ref")
    assert sorted(healed) == sorted(reference) == list(range(1, STEPS + 1))
    difference = max(abs(healed[step] - reference[step]) for step in reference)
    print(f"largest loss difference from the reference: {difference:.2e} "
          f"(tolerance {CURVE_TOLERANCE})")
    assert difference < CURVE_TOLERANCE
