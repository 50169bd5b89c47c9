"""Own code's checkpoints (spec.trainer) between the pod's local folder and spec.checkpoint.uri.

The user's code writes checkpoint folders into KUBETRAIN_CHECKPOINT_DIR and marks each one
complete (kubetrain.sdk.checkpoints, the one reading of the markers). This module:

- uploads every marked folder: each pod uploads its part (rank 0's folder is one part, held
  by rank 0's pod; a sharded DCP folder has one part per pod, each pod holding its ranks'
  files), then the part's manifest, `<folder>/.kubetrain/part-<i>-of-<n>.json`, after its
  files; the pod holding part 0 writes `<folder>/.kubetrain/commit.json` once every part's
  manifest is there. The commit is written last, so a half-uploaded folder is never restored;
- keeps checkpoint.keepLast committed folders: only after a commit succeeded are older ones
  deleted (their commit first, so no reader sees a half-deleted one), so a failed upload
  never costs the previous good checkpoint;
- restores, before the command starts, the newest committed folder (from checkpoint.uri, else
  checkpoint.resumeFrom) into the local folder, and keeps every pod's copy of the newest
  commit whole: after a sharded save each pod fetches the other pods' files, so that a
  restart in place (torchrun's, with a new membership) finds the whole checkpoint locally,
  as on a shared filesystem;
- never uploads a folder nobody marked, and says which ones it saw (`SyncReport.unmarked`)
  so that the caller can warn.

Torch-free: it runs beside the user's command in kubetrain.trainer.own_code, and uses the
project's one storage layer.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from kubetrain.sdk.checkpoints import (
    MARKER_DIR,
    Part,
    complete_here,
    mark_restored,
    marks,
    ready_part,
    restored_step,
)
from kubetrain.trainer.storage import TRANSFER_CONCURRENCY, Storage

log = logging.getLogger(__name__)

COMMIT = f"{MARKER_DIR}/commit.json"


def part_key(part: Part) -> str:
    """The manifest of one pod's part, relative to its folder."""
    return f"{MARKER_DIR}/part-{part.index}-of-{part.parts}.json"


@dataclass(frozen=True)
class Commit:
    """A committed folder under the checkpoint URI: its name, step and files (with sizes)."""

    folder: str
    step: int
    files: dict[str, int]


@dataclass
class SyncReport:
    """What one pass did: parts uploaded, folders committed and copied whole here, failures
    (the folder and why; retried at the next pass), and marked-never folders seen.

    Of the folders marked here and not committed yet, `waiting` are part 0's, whose commit
    this pod writes once the other pods' parts are up; `handed_over` are another part's,
    uploaded: their commit is part 0's pod's to write, and nothing this pod does helps it.
    """

    uploaded: list[str] = field(default_factory=list)
    committed: list[str] = field(default_factory=list)
    completed_here: list[str] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)
    unmarked: list[str] = field(default_factory=list)
    waiting: list[str] = field(default_factory=list)
    handed_over: list[str] = field(default_factory=list)


def _files(folder: Path) -> dict[str, int]:
    """The folder's files (relative paths and sizes), without kubetrain's markers."""
    return {path.relative_to(folder).as_posix(): path.stat().st_size
            for path in sorted(folder.rglob("*"))
            if path.is_file() and path.relative_to(folder).parts[0] != MARKER_DIR}


def commits(remote: Storage) -> list[Commit]:
    """The committed folders under `remote`, oldest step first."""
    found = []
    for info in remote.list():
        folder, _, rest = info.key.partition("/")
        if rest != COMMIT:
            continue
        try:
            document = json.loads(remote.read_bytes(info.key))
            found.append(Commit(folder, int(document["step"]),
                                {str(k): int(v) for k, v in document["files"].items()}))
        except (ValueError, KeyError, TypeError, FileNotFoundError):
            log.warning("ignoring %s/%s: not a commit kubetrain wrote", remote.uri, info.key)
    return sorted(found, key=lambda commit: (commit.step, commit.folder))


def download(remote: Storage, commit: Commit, local_dir: Path) -> Path:
    """Make `local_dir/<folder>` a whole copy of `commit`: fetch the files it lacks (or holds
    at another size), several at once (a sharded checkpoint has a file per rank, and each
    fetch waits mostly on the network), check every size, then mark it restored, last."""
    target = local_dir / commit.folder
    folder = remote.join(commit.folder)

    def fetch(name: str, size: int) -> None:
        path = target / name
        partial = path.with_name(f".{path.name}.partial")
        folder.download_file(name, partial)
        if partial.stat().st_size != size:
            raise OSError(f"{remote.uri}/{commit.folder}/{name}: {partial.stat().st_size} "
                          f"bytes downloaded, the commit says {size}")
        partial.replace(path)

    missing = {name: size for name, size in commit.files.items()
               if not ((target / name).is_file() and (target / name).stat().st_size == size)}
    with ThreadPoolExecutor(min(TRANSFER_CONCURRENCY, max(1, len(missing))),
                            thread_name_prefix="restore") as fetching:
        for fetched in [fetching.submit(fetch, name, size) for name, size in missing.items()]:
            fetched.result()  # the first error is raised, once every fetch has ended
    mark_restored(target, commit.step)
    return target


def restore(local_dir: Path, remote: Storage, fallback: Storage | None = None) -> Path | None:
    """Before the command starts: the newest committed folder of `remote` (else of
    `fallback`, checkpoint.resumeFrom) copied whole into `local_dir`; None when neither has
    one (the command starts from scratch)."""
    for source in (remote, fallback):
        if source is None:
            continue
        found = commits(source)
        if found:
            newest = found[-1]
            if complete_here(local_dir / newest.folder) == newest.step:
                return local_dir / newest.folder
            log.info("restoring %s/%s (step %d)", source.uri, newest.folder, newest.step)
            return download(source, newest, local_dir)
    return None


class CheckpointSync:
    """One pod's uploads, commits, copies and deletions; `sync_once` is one pass."""

    def __init__(self, local_dir: Path, remote: Storage, keep_last: int) -> None:
        self.local_dir = local_dir
        self.remote = remote
        self.keep_last = keep_last
        self._uploaded: set[tuple[str, int]] = set()  # (folder, part index) sent by this pod
        self._committed: set[str] = set()  # folders known committed

    def _upload_part(self, folder: Path, part: Part) -> None:
        files = _files(folder)
        target = self.remote.join(folder.name)
        for name in files:
            target.upload_file(folder / name, name)
        manifest = {"step": part.step, "index": part.index, "parts": part.parts, "files": files}
        target.write_bytes(part_key(part), json.dumps(manifest).encode())  # after its files

    def _try_commit(self, folder: str, part: Part) -> bool:
        """Part 0's pod: the commit, once every part's manifest is up."""
        target = self.remote.join(folder)
        files: dict[str, int] = {}
        for index in range(part.parts):
            try:
                manifest = json.loads(target.read_bytes(
                    part_key(Part(part.step, index, part.parts))))
            except FileNotFoundError:
                return False
            if int(manifest["step"]) != part.step:
                return False  # an older save's part under the same name
            files.update({str(k): int(v) for k, v in manifest["files"].items()})
        target.write_bytes(COMMIT, json.dumps({"step": part.step, "files": files}).encode())
        return True

    def sync_once(self) -> SyncReport:
        """Upload what is ready, commit what is whole, copy the newest commit here, prune."""
        report = SyncReport()
        folders = [p for p in self.local_dir.iterdir()
                   if p.is_dir() and not p.name.startswith(".")] if self.local_dir.is_dir() else []
        ready: list[tuple[Path, Part]] = []
        for folder in folders:
            if restored_step(folder) is not None or folder.name in self._committed:
                continue
            part = ready_part(folder)
            if part is not None:
                ready.append((folder, part))
            elif not marks(folder):
                report.unmarked.append(folder.name)
        for folder, part in sorted(ready, key=lambda item: item[1].step):
            try:
                if (folder.name, part.index) not in self._uploaded:
                    self._upload_part(folder, part)
                    self._uploaded.add((folder.name, part.index))
                    report.uploaded.append(folder.name)
                if part.index == 0 and self._try_commit(folder.name, part):
                    self._committed.add(folder.name)
                    report.committed.append(folder.name)
                elif part.index != 0 and self.remote.join(folder.name).exists(COMMIT):
                    self._committed.add(folder.name)
                elif part.index != 0:
                    report.handed_over.append(folder.name)
                else:
                    report.waiting.append(folder.name)
            except Exception as error:  # the next pass retries; the previous commit stays
                log.warning("uploading checkpoint %s failed: %s", folder.name, error)
                report.failed.append((folder.name, str(error)))
        try:
            found = commits(self.remote)
            if report.committed:
                self._prune_remote(found)
            if found:
                newest = found[-1]
                self._committed.add(newest.folder)
                if complete_here(self.local_dir / newest.folder) is None:
                    download(self.remote, newest, self.local_dir)
                    report.completed_here.append(newest.folder)
            self._prune_local()
        except Exception as error:
            log.warning("checkpoint sync of %s failed: %s", self.remote.uri, error)
            report.failed.append(("", str(error)))
        return report

    def _prune_remote(self, found: list[Commit]) -> None:
        """Delete committed folders beyond keepLast, and abandoned parts older than them."""
        kept = found[-self.keep_last:]
        if not kept:
            return
        oldest_kept = kept[0].step
        by_folder: dict[str, list[str]] = {}
        for info in self.remote.list():
            by_folder.setdefault(info.key.partition("/")[0], []).append(info.key)
        kept_names = {commit.folder for commit in kept}
        for commit in found[:-self.keep_last]:
            keys = by_folder.get(commit.folder, [])
            commit_key = f"{commit.folder}/{COMMIT}"
            self.remote.delete([commit_key])  # first: never a half-deleted "committed" folder
            self.remote.delete([key for key in keys if key != commit_key])
        committed_names = {commit.folder for commit in found}
        for folder, keys in by_folder.items():
            if folder in committed_names or folder in kept_names:
                continue
            steps = []
            for key in keys:
                if key.startswith(f"{folder}/{MARKER_DIR}/part-"):
                    try:
                        steps.append(int(json.loads(self.remote.read_bytes(key))["step"]))
                    except (ValueError, KeyError, TypeError, FileNotFoundError):
                        continue
            if steps and max(steps) < oldest_kept:
                self.remote.delete(keys)

    def _prune_local(self) -> None:
        """Keep the keepLast newest folders this pod holds whole; delete older ones that are
        committed (never one that is not uploaded yet, nor one nobody marked)."""
        whole = []
        for folder in self.local_dir.iterdir():
            if folder.is_dir() and not folder.name.startswith("."):
                step = complete_here(folder)
                if step is not None:
                    whole.append((step, folder))
        whole.sort()
        for _, folder in whole[:-self.keep_last]:
            if folder.name in self._committed or restored_step(folder) is not None:
                shutil.rmtree(folder, ignore_errors=True)

    def drain(self, deadline: float, interval: float = 1.0) -> SyncReport:
        """Passes until nothing marked here waits for an upload or for a commit this pod
        writes, or `deadline` (time.monotonic()); the last pass's report, with every failure
        seen. A pod whose part is up does not wait for part 0's pod to commit it: when that
        pod is gone (a killed worker 0, the group recreated), the commit never comes, and
        waiting for it held this pod's end, and so the group's recreation, to the deadline."""
        failed: list[tuple[str, str]] = []
        while True:
            report = self.sync_once()
            failed += report.failed
            if (not report.waiting and not report.failed) or time.monotonic() >= deadline:
                report.failed = failed
                return report
            time.sleep(interval)
