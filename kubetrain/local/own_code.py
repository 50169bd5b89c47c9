"""What `kubetrain run` adds for own code (spec.trainer): node folders, commits seen as events.

kubetrain's trainer writes its own metrics log; own code does not, so the runner writes the
events it can observe from outside (kubetrain.local.metrics_log.append_event): a `resumed`
event when an attempt starts from a committed checkpoint, which kubetrain's entry restores
before the command runs, and a `checkpoint` event for each folder committed under
checkpoint.uri since (the commits kubetrain.trainer.checkpoint_sync writes last, so a
checkpoint shown is one a restart would restore). Each simulated node has its own
checkpoint folder, runs/JOB/nodes/worker-I/checkpoints, emptied at every attempt as a new
pod's emptyDir is: every attempt resumes from what was uploaded, never from a node's
leftovers. Step events come from the local status endpoint
(kubetrain.local.trainer_status_endpoint).

Own code's goodput (`ReportedGoodput`) is judged from those steps by the operator's rule
(kubetrain.operator.observation.step_goodput): the time between two reported steps of one
attempt is productive, except its share spent on steps an earlier attempt had reported,
which is lost progress; the rest of the wall time is downtime. The runner appends it as a
`goodput` event after each attempt, which the summary and the report read.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kubetrain.api.trainingjob import TrainingJob
from kubetrain.local.metrics_log import Event, parse_lines
from kubetrain.local.workspace import Workspace
from kubetrain.restart_rules import Advance

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


@dataclass(frozen=True)
class Commit:
    """A checkpoint folder committed under a URI, and its step."""

    folder: str
    step: int


@dataclass(frozen=True)
class CommitListing:
    """The checkpoints committed under one URI (`uri`, as the storage layer names it):
    `commits()` lists them, oldest step first, and may raise OSError while the storage
    is unreachable."""

    uri: str
    commits: Callable[[], Sequence[Commit]]


# Opens the listing of a URI. The `kubetrain run` command gives it to the runner, reading
# with the trainer's storage layer (kubetrain.trainer.checkpoint_sync.commits): the local
# runner, like the operator, imports nothing of the trainer.
OpenListing = Callable[[str], CommitListing]


class CommittedCheckpoints:
    """The commits under the job's checkpoint URI (and resumeFrom), as metrics-log events."""

    def __init__(self, job: TrainingJob, open_listing: OpenListing) -> None:
        spec = job.spec
        self.remote = open_listing(spec.checkpoint.uri)
        self.fallback = (open_listing(spec.checkpoint.resume_from)
                         if spec.checkpoint.resume_from else None)
        self.world_size = spec.workers.replicas * spec.workers.procs_per_worker
        # Commits from earlier runs of the job are in the metrics log already.
        self.seen = {commit.folder for commit in self._commits(self.remote)}
        self._polled = 0.0

    @staticmethod
    def _commits(listing: CommitListing) -> Sequence[Commit]:
        return listing.commits()

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


class ReportedGoodput:
    """Own code's goodput in `kubetrain run`, from the steps it reported, across attempts and
    runs of the job (a `goodput` event carries the totals and the furthest step to the next).

    `attempt` at each launch, `stepped` at each step event, `event` for the totals now.
    """

    def __init__(self, seconds: dict[str, float] | None = None, since: float | None = None,
                 furthest: int | None = None) -> None:
        self.productive = (seconds or {}).get("productive", 0.0)
        self.lost = (seconds or {}).get("lost_progress", 0.0)
        self.wall_before = sum((seconds or {}).values())
        self.since = since  # when the wall time before ends: the last event, else the launch
        self.furthest = furthest  # the furthest step reported by any attempt
        self.redone_until: int | None = None  # ... by the attempts before this one
        self.resumed_step: int | None = None  # the checkpoint this attempt resumed from
        self.first_step: int | None = None  # this attempt's first reported step
        self._last: tuple[int, float] | None = None  # this attempt's last step and its time

    @classmethod
    def resumed(cls, metrics_log: Path) -> ReportedGoodput:
        """The accounting as the job's last own-code `goodput` event left it (none: fresh)."""
        text = metrics_log.read_text() if metrics_log.exists() else ""
        last = next((event for event in reversed(parse_lines(text))
                     if event["event"] == "goodput" and "furthest_step" in event), None)
        if last is None:
            return cls()
        seconds = {str(cause): float(value) for cause, value in last["seconds"].items()}
        furthest = last["furthest_step"]
        return cls(seconds, float(last["time"]), furthest if isinstance(furthest, int) else None)

    def attempt(self, launched_at: float, resumed_step: int | None = None) -> None:
        """A new attempt of the group was launched at `launched_at` (unix seconds), from the
        checkpoint of `resumed_step` (None: from scratch)."""
        if self.since is None:
            self.since = launched_at
        self.redone_until = self.furthest
        self.resumed_step = resumed_step
        self.first_step = None
        self._last = None

    def stepped(self, event: Event) -> None:
        """A `step` event of the current attempt: the time since its previous one is booked."""
        step, at = event.get("step"), event.get("time")
        if not isinstance(step, int) or not isinstance(at, int | float):
            return
        if self.first_step is None:
            self.first_step = step
        if self._last is not None and step > self._last[0] and at >= self._last[1]:
            productive, lost = Advance(self._last[0], step, at - self._last[1],
                                       self.redone_until, self.resumed_step,
                                       self.first_step).booked()
            self.productive += productive
            self.lost += lost
        if self._last is None or step > self._last[0]:
            self._last = (step, float(at))
        self.furthest = max(step, self.furthest or 0)

    def seconds(self, now: float) -> dict[str, float]:
        """Seconds by cause from the job's first launch to `now`: productive, lost progress
        (redone steps) and downtime (start-up, restarts, backoff)."""
        wall = self.wall_before + max(0.0, now - (self.since if self.since is not None else now))
        productive = min(self.productive, wall)
        lost = min(self.lost, wall - productive)
        return {"productive": round(productive, 3), "lost_progress": round(lost, 3),
                "downtime": round(wall - productive - lost, 3)}

    def event(self, now: float) -> Event:
        """The metrics log's `goodput` event of the totals at `now`."""
        seconds = self.seconds(now)
        wall = sum(seconds.values())
        return {"event": "goodput", "seconds": seconds, "furthest_step": self.furthest,
                "ratio": round(seconds["productive"] / wall, 4) if wall > 0 else 1.0,
                "time": now}
