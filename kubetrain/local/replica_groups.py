"""Replica groups (spec.faultTolerance) in a local run: the lighthouse, and one log of events.

On Kubernetes the operator runs torchft's lighthouse as a pod of the job, each replica
group as a torchrun group of its own, and restarts a failed group alone
(kubetrain.operator.reconcile_pass). `kubetrain run` does the same on this machine: it
starts the lighthouse on loopback for the whole run (`lighthouse`), gives each group its
own rendezvous, and restarts a group whose node failed without stopping the others
(kubetrain.local.runner).

Each group's rank 0 reports as the only rank 0 of a plain job does, so each group writes a
metrics log of its own (`group_metrics_log`). The run's one log, which the progress bar,
the restart policy, the summary and the report read, gets each step, evaluation and
checkpoint once, from whichever group logs it first (`EventRelay`): the groups train the
same steps, and a group that comes back after a failure heals at its peers' step and logs
only steps that were logged already; a step older than one passed on (own code's groups
report now and then, each on its own clock) is not passed on. A group's quorum changes and
heals are passed on as they come, with the group that saw them.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kubetrain.api.trainingjob import TrainingJob
from kubetrain.local.launch import RENDEZVOUS_HOST, free_port
from kubetrain.local.metrics_log import Event, MetricsLogReader, append_event
from kubetrain.pod_conventions import LIGHTHOUSE_PROGRAM, lighthouse_command

INSTALL = "pip install 'kubetrain[fault-tolerance]' (or pip install torchft)"
# The lighthouse is a Rust binary that listens within milliseconds; a loaded machine is
# given some slack before the run gives up on it.
LIGHTHOUSE_START_SECONDS = 30.0

# Events the groups log alike, passed on once per step (or once per attempt).
_ONCE_PER_STEP = {"step", "eval", "checkpoint"}
_ONCE_PER_ATTEMPT = {"start", "resumed"}


class LighthouseError(RuntimeError):
    """The lighthouse could not start: torchft missing, or it did not listen in time."""


def lighthouse_program() -> str:
    """torchft's lighthouse beside this interpreter (a virtual environment's bin folder),
    else on PATH; LighthouseError naming the install otherwise."""
    beside = Path(sys.executable).with_name(LIGHTHOUSE_PROGRAM)
    found = str(beside) if beside.exists() else shutil.which(LIGHTHOUSE_PROGRAM)
    if found is None:
        raise LighthouseError(f"spec.faultTolerance needs torchft's {LIGHTHOUSE_PROGRAM}, "
                              f"which is not installed: {INSTALL}")
    return found


@contextmanager
def lighthouse(job: TrainingJob, log: Path) -> Iterator[str]:
    """torchft's lighthouse for `job`, as the operator runs it but on loopback, until the
    block ends: its address (`http://127.0.0.1:PORT`) for the groups' TORCHFT_LIGHTHOUSE.
    Its output goes to `log`."""
    port = free_port()
    command = lighthouse_command(job, bind=f"{RENDEZVOUS_HOST}:{port}")
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as output:
        # (It logs every quorum request at info, lines per group per step, as in its pod.)
        process = subprocess.Popen([lighthouse_program(), *command[1:]], stdin=subprocess.DEVNULL,
                                   stdout=output, stderr=subprocess.STDOUT,
                                   env={**os.environ, "RUST_LOG": os.environ.get("RUST_LOG",
                                                                                 "warn")})
    try:
        _wait_until_listening(process, port, log)
        yield f"http://{RENDEZVOUS_HOST}:{port}"
    finally:
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _wait_until_listening(process: subprocess.Popen[bytes], port: int, log: Path) -> None:
    deadline = time.monotonic() + LIGHTHOUSE_START_SECONDS
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise LighthouseError(f"{LIGHTHOUSE_PROGRAM} exited with {process.returncode} "
                                  f"before listening; its output is in {log}")
        with socket.socket() as probe:
            if probe.connect_ex((RENDEZVOUS_HOST, port)) == 0:
                return
        time.sleep(0.05)
    process.kill()
    process.wait()
    raise LighthouseError(f"{LIGHTHOUSE_PROGRAM} did not listen on port {port} within "
                          f"{LIGHTHOUSE_START_SECONDS:g}s; its output is in {log}")


def group_metrics_log(run_log: Path, group: int) -> Path:
    """Where group `group`'s rank 0 writes its events: beside the run's log."""
    return run_log.with_name(f"{run_log.stem}.group-{group}{run_log.suffix}")


class EventRelay:
    """Follows every group's metrics log and appends to the run's log each event it has not
    had yet (see the module docstring). `attempt()` starts over for a whole-job restart,
    whose groups log their steps again from a checkpoint."""

    def __init__(self, run_log: Path, groups: int) -> None:
        self.run_log = run_log
        self.readers = [MetricsLogReader(path, _size(path)) for path in
                        (group_metrics_log(run_log, group) for group in range(groups))]
        self._seen: set[tuple[object, ...]] = set()
        self._last_step: int | None = None  # the furthest `step` passed on this attempt
        self._finished_exported: bool | None = None  # the `finished` passed on: exported?

    def attempt(self) -> None:
        """A new attempt of every group begins: its events are new again."""
        self._seen.clear()
        self._last_step = None
        self._finished_exported = None

    def pump(self) -> None:
        """Append what the groups logged since the last call."""
        for group, reader in enumerate(self.readers):
            for event in reader.read_new():
                if self._first(event):
                    append_event(self.run_log, {**event, "group": group})

    def _first(self, event: Event) -> bool:
        kind, step = event["event"], event.get("step")
        key: tuple[object, ...]
        if kind in _ONCE_PER_STEP:
            key = (kind, step)
        elif kind in _ONCE_PER_ATTEMPT:
            key = (kind,)
        elif kind == "quorum":  # every live group sees the same change
            key = (kind, step, event.get("groups"))
        elif kind == "finished":  # the first, or the group's that exported the model
            exported = event.get("export_uri") is not None
            if self._finished_exported is None or (exported and not self._finished_exported):
                self._finished_exported = exported
                return True
            return False
        else:  # heals, goodput: each as it comes
            return True
        if key in self._seen:
            return False
        if kind == "step" and isinstance(step, int):
            # Own code's groups report a step now and then, each on its own clock: one
            # group's older step, read after another's newer one, would send the run's
            # progress back.
            if self._last_step is not None and step < self._last_step:
                return False
            self._last_step = step
        self._seen.add(key)
        return True


def _size(path: Path) -> int:
    """Bytes already in `path` (an earlier run's events, not this run's), 0 if none."""
    return path.stat().st_size if path.exists() else 0
