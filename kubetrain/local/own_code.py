"""What `kubetrain run` adds for own code (spec.trainer): node folders, commits seen as events.

kubetrain's trainer writes its own metrics log; own code does not, so the runner writes the
events it can observe from outside (kubetrain.local.metrics_log.append_event): a `resumed`
event when an attempt starts from a committed checkpoint, which kubetrain's entry restores
before the command runs, and a `checkpoint` event for each folder committed under
checkpoint.uri since (the commits kubetrain.trainer.checkpoint_sync writes last, so a
checkpoint shown is one a restart would restore). Each simulated node has its own
checkpoint folder, runs/JOB/nodes/worker-I/checkpoints, emptied at every attempt as a new
pod's emptyDir is: every attempt resumes from what was uploaded, never from a node's
leftovers. Step events come from the local status endpoint (kubetrain.local.status_endpoint).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

from kubetrain.api.trainingjob import TrainingJob
from kubetrain.local.metrics_log import Event
from kubetrain.local.workspace import Workspace

# How often the runner lists the checkpoint URI for new commits while the group runs.
COMMIT_POLL_SECONDS = 2.0


def node_checkpoint_dir(workspace: Workspace, index: int) -> Path:
    """Simulated node `index`'s KUBETRAIN_CHECKPOINT_DIR (a pod's emptyDir)."""
    return workspace.root / "nodes" / f"worker-{index}" / "checkpoints"


def fresh_node_dirs(workspace: Workspace, replicas: int) -> list[Path]:
    """Every node's checkpoint folder, emptied: an attempt starts as new pods do."""
    folders = []
    for index in range(replicas):
        folder = node_checkpoint_dir(workspace, index)
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        folders.append(folder)
    return folders


class CommittedCheckpoints:
    """The commits under the job's checkpoint URI (and resumeFrom), as metrics-log events."""

    def __init__(self, job: TrainingJob) -> None:
        from kubetrain.trainer.storage import open_storage

        spec = job.spec
        self.remote: Any = open_storage(spec.checkpoint.uri, spec.storage)
        self.fallback: Any = (open_storage(spec.checkpoint.resume_from, spec.storage)
                              if spec.checkpoint.resume_from else None)
        self.world_size = spec.workers.replicas * spec.workers.procs_per_worker
        # Commits from earlier runs of the job are in the metrics log already.
        self.seen = {commit.folder for commit in self._commits(self.remote)}
        self._polled = 0.0

    @staticmethod
    def _commits(storage: Any) -> list[Any]:
        from kubetrain.trainer.checkpoint_sync import commits

        return commits(storage)

    def resumed(self) -> Event | None:
        """The `resumed` event of an attempt about to start: the step kubetrain's entry will
        restore (the newest commit of checkpoint.uri, else of resumeFrom), or None."""
        for source in (self.remote, self.fallback):
            if source is None:
                continue
            found = self._commits(source)
            if found:
                return {"event": "resumed", "step": found[-1].step,
                        "world_size": self.world_size, "uri": f"{source.uri}/{found[-1].folder}",
                        "time": time.time()}
        return None

    def new(self, *, now: float | None = None, force: bool = False) -> list[Event]:
        """A `checkpoint` event per commit not seen before, oldest first (listed at most every
        COMMIT_POLL_SECONDS unless `force`)."""
        now = time.monotonic() if now is None else now
        if not force and now - self._polled < COMMIT_POLL_SECONDS:
            return []
        self._polled = now
        try:
            found = self._commits(self.remote)
        except OSError:
            return []  # storage briefly unreachable: the next poll sees the commits
        events: list[Event] = []
        for commit in found:
            if commit.folder in self.seen:
                continue
            self.seen.add(commit.folder)
            events.append({"event": "checkpoint", "step": commit.step,
                           "uri": f"{self.remote.uri}/{commit.folder}", "time": time.time()})
        return events
