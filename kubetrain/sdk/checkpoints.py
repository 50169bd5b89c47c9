"""Own code's checkpoint folders: where they go, which are complete, and the marker that says so.

Your code writes each checkpoint as a folder under `checkpoint_dir()` (KUBETRAIN_CHECKPOINT_DIR,
a pod-local directory) and calls `mark_complete(folder, step)` once it is fully written.
Completeness is never guessed: only a marked folder is uploaded to spec.checkpoint.uri
(kubetrain.trainer.checkpoint_sync), and before your command starts kubetrain restores
the newest uploaded one here, where `latest_checkpoint()` finds it.

Two kinds of folder:
- written by rank 0 alone (`torch.save`, transformers' Trainer without FSDP): rank 0's mark
  makes it complete; the other ranks' marks say only that they are done with it;
- sharded, every rank writing its part (torch DCP): every rank marks it with `sharded=True`
  as soon as its own part is written (for `dcp.save`, when the call returned on that rank).
  No barrier is needed before the mark: a pod's part counts once every rank of that pod
  marked it, and the checkpoint once every pod's part is up, so a rank that marks first
  waits for nobody and a checkpoint is never taken before all of it is written.

The marker is `<folder>/.kubetrain/complete-rank-<RANK>.json`, written atomically; a folder
kubetrain restored or completed from the uploaded copy has `.kubetrain/restored.json`. A
mark made after `stop_agreed()` said yes is a stop mark (`Mark.stop`): it names the process,
which has nothing left to save, so kubetrain's entry ends it if it has not exited
`LINGER_SECONDS` later (kubetrain.trainer.own_code).

`mark_finished()`, the last call of a process whose work is done, writes
`<checkpoint_dir>/.kubetrain/finished-rank-<RANK>.json`: once every process of the pod has
written one, kubetrain's entry ends those still running `LINGER_SECONDS` after the last
(a teardown that hangs) and the pod exits 0.
Torch-free; this module's functions are the one reading of the markers.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from kubetrain.sdk.stop import stopping

CHECKPOINT_DIR_ENV = "KUBETRAIN_CHECKPOINT_DIR"
# Outside a cluster (no KUBETRAIN_CHECKPOINT_DIR): a folder beside the script's working dir.
DEFAULT_CHECKPOINT_DIR = "checkpoints"
MARKER_DIR = ".kubetrain"
RESTORED_MARKER = "restored.json"
_RANK_MARKER_PREFIX = "complete-rank-"
_FINISHED_MARKER_PREFIX = "finished-rank-"
T = TypeVar("T")
# torchrun's count of the restarts in place of its processes: which attempt marked.
RESTART_COUNT_ENV = "TORCHELASTIC_RESTART_COUNT"


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


@dataclass(frozen=True)
class Mark:
    """One rank's statement that its part of a checkpoint folder is written."""

    step: int
    rank: int
    world_size: int
    local_world_size: int
    group_rank: int  # torchrun's node rank: which pod of the group wrote this part
    group_world_size: int
    sharded: bool
    stop: bool = False  # made after the stop was agreed: the process's last save
    process: ProcessIdentity | None = None  # the process that marked (None: not known)
    time: float = 0.0  # when, in seconds since the epoch


@dataclass(frozen=True)
class ProcessIdentity:
    """A process as the kernel knows it: its pid and its start time (clock ticks after
    boot, /proc/PID/stat's 22nd field), which tells it apart from a later process that
    reuses the pid."""

    pid: int
    started: int

    @classmethod
    def of(cls, pid: int) -> ProcessIdentity | None:
        """The process `pid` now, or None when there is none (or no /proc to ask)."""
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return None
        # The command name (field 2) may hold spaces and parentheses: count after its end.
        return cls(pid, int(stat.rsplit(")", 1)[1].split()[19]))

    def alive(self) -> bool:
        """Whether this very process still runs (not a zombie, not a newer one's pid)."""
        now = ProcessIdentity.of(self.pid)
        if now != self:
            return False
        try:
            state = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return False
        return state != "Z"


def checkpoint_dir() -> Path:
    """The directory your checkpoint folders go in (created if missing)."""
    path = Path(os.environ.get(CHECKPOINT_DIR_ENV) or DEFAULT_CHECKPOINT_DIR)
    path.mkdir(parents=True, exist_ok=True)
    return path


def mark_complete(path: str | os.PathLike[str], step: int, *, sharded: bool = False) -> None:
    """Say that checkpoint folder `path`, of training step `step`, is fully written.

    Call it after the save has returned on this rank: for a folder rank 0 wrote alone, on
    rank 0 (a call on another rank is allowed and only says that rank is done with it); for
    a folder every rank wrote part of (torch DCP), on every rank with `sharded=True`, as
    soon as that rank's save returned. No barrier is needed first.
    """
    if step < 0:
        raise ValueError(f"step must be 0 or more, got {step}")
    rank = _env_int("RANK", 0)
    world_size = _env_int("WORLD_SIZE", 1)
    mark = Mark(step=step, rank=rank, world_size=world_size,
                local_world_size=_env_int("LOCAL_WORLD_SIZE", world_size),
                group_rank=_env_int("GROUP_RANK", 0),
                group_world_size=_env_int("GROUP_WORLD_SIZE", 1), sharded=sharded,
                stop=stopping(), process=ProcessIdentity.of(os.getpid()), time=time.time())
    folder = Path(path)
    _write_json(folder / MARKER_DIR / f"{_RANK_MARKER_PREFIX}{rank}.json", {
        "step": mark.step, "rank": mark.rank, "worldSize": mark.world_size,
        "localWorldSize": mark.local_world_size, "groupRank": mark.group_rank,
        "groupWorldSize": mark.group_world_size, "sharded": mark.sharded,
        "stop": mark.stop, "time": mark.time, **_process_fields(mark.process)})


@dataclass(frozen=True)
class Finished:
    """One process's statement that its work is done: what is left is its teardown."""

    rank: int
    local_rank: int
    local_world_size: int
    attempt: int  # torchrun's restart count when it marked
    process: ProcessIdentity | None
    time: float  # when, in seconds since the epoch


def mark_finished() -> None:
    """Say that this process has done all its work: its last checkpoint is marked and
    nothing it does from here on (freeing its process group, the interpreter's exit) is
    needed. Call it last, on every rank, before `destroy_process_group()`.

    A process group's teardown can hang (gloo's and NCCL's destructors, threads that are not
    daemons): once every process of the pod has marked its finish, kubetrain's entry ends
    any still running `LINGER_SECONDS` later and the pod exits 0, instead of holding its
    node until someone deletes the job. After a stop (`stop_agreed()` said yes) it does
    nothing: the process was stopped, not finished, and its stop mark already has it ended.
    """
    if stopping():
        return
    world_size = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0)
    _write_json(checkpoint_dir() / MARKER_DIR / f"{_FINISHED_MARKER_PREFIX}{rank}.json", {
        "rank": rank, "localRank": _env_int("LOCAL_RANK", 0),
        "localWorldSize": _env_int("LOCAL_WORLD_SIZE", world_size),
        "attempt": _env_int(RESTART_COUNT_ENV, 0), "time": time.time(),
        **_process_fields(ProcessIdentity.of(os.getpid()))})


def finished_marks(local_dir: Path) -> list[Finished]:
    """The finish marks in `local_dir` (unreadable ones skipped, as for `marks`)."""
    return _read_markers(local_dir, _FINISHED_MARKER_PREFIX, lambda data: Finished(
        rank=int(data["rank"]), local_rank=int(data["localRank"]),
        local_world_size=int(data["localWorldSize"]), attempt=int(data["attempt"]),
        process=_process_of(data), time=float(data["time"])))


def forget_finished(local_dir: Path) -> None:
    """Remove the finish marks of the processes an earlier start of the pod ran."""
    for path in (local_dir / MARKER_DIR).glob(f"{_FINISHED_MARKER_PREFIX}*.json"):
        path.unlink(missing_ok=True)


def mark_restored(folder: Path, step: int) -> None:
    """Mark `folder` as a whole copy of an uploaded checkpoint (the restore writes it last)."""
    _write_json(folder / MARKER_DIR / RESTORED_MARKER, {"step": step})


def _write_json(path: Path, document: dict[str, object]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(json.dumps(document))
    os.replace(temporary, path)  # atomic: a reader sees the whole marker or none


def marks(folder: Path) -> list[Mark]:
    """The ranks' marks in `folder` (unreadable ones skipped: a marker is written atomically,
    so one that does not parse was not written by `mark_complete`)."""
    return _read_markers(folder, _RANK_MARKER_PREFIX, lambda data: Mark(
        step=int(data["step"]), rank=int(data["rank"]), world_size=int(data["worldSize"]),
        local_world_size=int(data["localWorldSize"]), group_rank=int(data["groupRank"]),
        group_world_size=int(data["groupWorldSize"]), sharded=bool(data["sharded"]),
        stop=bool(data.get("stop")), process=_process_of(data),
        time=float(data.get("time", 0.0))))


def _read_markers(folder: Path, prefix: str, parse: Callable[[dict[str, Any]], T]) -> list[T]:
    """Each marker `folder`/.kubetrain/`prefix`*.json parsed, in name order; one that does
    not read or parse is skipped."""
    found = []
    for path in sorted((folder / MARKER_DIR).glob(f"{prefix}*.json")):
        try:
            found.append(parse(json.loads(path.read_text())))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return found


def _process_fields(process: ProcessIdentity | None) -> dict[str, object]:
    """A marker's fields naming the process that wrote it (none when it is not known)."""
    return {} if process is None else {"pid": process.pid, "processStarted": process.started}


def _process_of(data: dict[str, Any]) -> ProcessIdentity | None:
    return (ProcessIdentity(int(data["pid"]), int(data["processStarted"]))
            if "pid" in data else None)


def restored_step(folder: Path) -> int | None:
    """The step of a folder kubetrain restored whole from the upload, else None."""
    try:
        return int(json.loads((folder / MARKER_DIR / RESTORED_MARKER).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


@dataclass(frozen=True)
class Part:
    """What this pod holds of a marked folder and must upload: part `index` of `parts`."""

    step: int
    index: int
    parts: int


def ready_part(folder: Path) -> Part | None:
    """This pod's part of `folder` when it is completely written here, else None.

    Rank 0's folder: part 0 of 1 once rank 0 marked it. Sharded: part `group_rank` of
    `group_world_size` once every rank of this pod (local_world_size of them) marked it.
    """
    found = marks(folder)
    whole = [mark for mark in found if not mark.sharded and mark.rank == 0]
    if whole:
        return Part(step=whole[0].step, index=0, parts=1)
    sharded = [mark for mark in found if mark.sharded]
    if not sharded:
        return None
    first = sharded[0]
    same = [m for m in sharded if (m.step, m.group_rank) == (first.step, first.group_rank)]
    if len(same) < first.local_world_size:
        return None
    return Part(step=first.step, index=first.group_rank, parts=first.group_world_size)


def complete_here(folder: Path) -> int | None:
    """The step of `folder` when this pod holds all of it, else None: restored whole, rank
    0's own folder, or a sharded folder every rank of the group marked (one pod)."""
    step = restored_step(folder)
    if step is not None:
        return step
    part = ready_part(folder)
    if part is not None and part.parts == 1:
        return part.step
    return None


def latest_checkpoint() -> Path | None:
    """The newest checkpoint folder this pod holds whole (the restored one, or one your code
    wrote and marked since), or None: then start from scratch."""
    best: tuple[int, Path] | None = None
    for folder in checkpoint_dir().iterdir():
        if not folder.is_dir() or folder.name.startswith("."):
            continue
        step = complete_here(folder)
        if step is not None and (best is None or step > best[0]):
            best = (step, folder)
    return best[1] if best else None


def stop_marks(local_dir: Path) -> list[Mark]:
    """Every stop mark in the folders under `local_dir`: the processes that saved their last
    checkpoint (the one they marked after `stop_agreed()`)."""
    if not local_dir.is_dir():
        return []
    return [mark for folder in local_dir.iterdir()
            if folder.is_dir() and not folder.name.startswith(".")
            for mark in marks(folder) if mark.stop]
