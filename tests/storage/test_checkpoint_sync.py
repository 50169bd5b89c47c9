"""Own code's checkpoint sync against moto's S3 over HTTP: upload, commit, keepLast, restore."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kubetrain.api.trainingjob import StorageSpec
from kubetrain.sdk import checkpoints, latest_checkpoint, mark_complete
from kubetrain.trainer.checkpoint_sync import COMMIT, CheckpointSync, commits, restore
from kubetrain.trainer.storage import Storage, open_storage


@pytest.fixture
def remote(s3_bucket: str, s3_spec: StorageSpec) -> Storage:
    return open_storage(f"s3://{s3_bucket}/jobs/mine", s3_spec)


def _as_rank(monkeypatch: pytest.MonkeyPatch, rank: int, local_world: int = 1,
             group_rank: int = 0, groups: int = 1) -> None:
    for name, value in (("RANK", rank), ("WORLD_SIZE", local_world * groups),
                        ("LOCAL_WORLD_SIZE", local_world), ("GROUP_RANK", group_rank),
                        ("GROUP_WORLD_SIZE", groups)):
        monkeypatch.setenv(name, str(value))


def _save(pod: Path, step: int, files: dict[str, bytes]) -> Path:
    folder = pod / f"step-{step}"
    for name, data in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    return folder


def _contents(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*")
            if p.is_file() and p.relative_to(folder).parts[0] != ".kubetrain"}


def test_a_marked_folder_is_uploaded_committed_and_restored_whole(
        tmp_path: Path, remote: Storage, monkeypatch: pytest.MonkeyPatch) -> None:
    _as_rank(monkeypatch, 0)
    written = {"model.pt": os.urandom(3000), "optim/state.pt": os.urandom(1000)}
    folder = _save(tmp_path / "pod", 100, written)
    mark_complete(folder, 100)
    report = CheckpointSync(tmp_path / "pod", remote, keep_last=2).sync_once()
    assert report.uploaded == ["step-100"] and report.committed == ["step-100"]
    assert [(c.folder, c.step) for c in commits(remote)] == [("step-100", 100)]

    fresh = tmp_path / "new-pod"
    restored = restore(fresh, remote)
    assert restored == fresh / "step-100" and _contents(restored) == written
    monkeypatch.setenv(checkpoints.CHECKPOINT_DIR_ENV, str(fresh))
    assert latest_checkpoint() == restored
    # The restored copy is never uploaded again.
    assert CheckpointSync(fresh, remote, keep_last=2).sync_once().uploaded == []


def test_a_folder_never_marked_complete_is_never_uploaded_and_is_reported(
        tmp_path: Path, remote: Storage, monkeypatch: pytest.MonkeyPatch) -> None:
    _as_rank(monkeypatch, 0)
    _save(tmp_path, 5, {"model.pt": b"half written"})
    report = CheckpointSync(tmp_path, remote, keep_last=2).sync_once()
    assert report.unmarked == ["step-5"] and report.uploaded == []
    assert remote.list() == []
    assert restore(tmp_path / "elsewhere", remote) is None


def test_keep_last_deletes_older_commits_only_after_a_newer_one_commits(
        tmp_path: Path, remote: Storage, monkeypatch: pytest.MonkeyPatch) -> None:
    _as_rank(monkeypatch, 0)
    sync = CheckpointSync(tmp_path, remote, keep_last=2)
    for step in (10, 20, 30):
        mark_complete(_save(tmp_path, step, {"model.pt": os.urandom(100)}), step)
        sync.sync_once()
    assert [c.step for c in commits(remote)] == [20, 30]
    assert not any(info.key.startswith("step-10/") for info in remote.list())
    # Locally too: the two newest stay, the uploaded older one goes.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-20", "step-30"]


def test_a_failed_upload_keeps_the_previous_good_checkpoint(
        tmp_path: Path, remote: Storage, s3_bucket: str, monkeypatch: pytest.MonkeyPatch,
        faulty_s3: Callable[..., Any]) -> None:
    _as_rank(monkeypatch, 0)
    good = {"model.pt": os.urandom(500)}
    mark_complete(_save(tmp_path / "pod", 1, good), 1)
    CheckpointSync(tmp_path / "pod", remote, keep_last=1).sync_once()

    # Every request to S3 fails from here on: refused, so that no retry's backoff is waited
    # out (with 500s botocore's 10 attempts took a minute).
    broken = faulty_s3(fault_ratio=1.0, faults=("403",))
    unreachable = open_storage(f"s3://{s3_bucket}/jobs/mine",
                               StorageSpec(endpoint=broken.endpoint, region="us-east-1"))
    mark_complete(_save(tmp_path / "pod", 2, {"model.pt": os.urandom(500)}), 2)
    report = CheckpointSync(tmp_path / "pod", unreachable, keep_last=1).sync_once()
    assert report.failed and report.committed == []
    assert [c.step for c in commits(remote)] == [1]  # keepLast 1, yet step 1 is still there
    restored = restore(tmp_path / "after", remote)
    assert restored is not None and _contents(restored) == good


def _shard(pod: Path, step: int, monkeypatch: pytest.MonkeyPatch, group_rank: int) -> Path:
    """Pod `group_rank` of 2, ranks 2g and 2g+1: each writes its DCP shard, then marks it."""
    folder = pod / f"step-{step}"
    for local in range(2):
        rank = 2 * group_rank + local
        _as_rank(monkeypatch, rank, local_world=2, group_rank=group_rank, groups=2)
        _save(pod, step, {f"__{rank}_0.distcp": f"shard {rank} at {step}".encode()})
        if rank == 0:
            _save(pod, step, {".metadata": b"dcp metadata"})
        mark_complete(folder, step, sharded=True)
    return folder


def test_a_sharded_folder_commits_once_every_pod_uploaded_its_part_and_each_pod_gets_it_all(
        tmp_path: Path, remote: Storage, monkeypatch: pytest.MonkeyPatch) -> None:
    pod0, pod1 = tmp_path / "pod0", tmp_path / "pod1"
    _shard(pod0, 50, monkeypatch, group_rank=0)
    _shard(pod1, 50, monkeypatch, group_rank=1)
    sync0, sync1 = CheckpointSync(pod0, remote, 2), CheckpointSync(pod1, remote, 2)

    first = sync0.sync_once()  # pod 1's part is not up yet: nothing to restore
    assert first.uploaded == ["step-50"] and first.waiting == ["step-50"]
    assert not remote.join("step-50").exists(COMMIT) and restore(tmp_path / "x", remote) is None
    assert sync1.sync_once().handed_over == ["step-50"]  # uploaded: the commit is pod 0's
    assert sync0.sync_once().committed == ["step-50"]
    sync1.sync_once()  # sees the commit, fetches pod 0's files
    sync0.sync_once()  # and pod 0 fetches pod 1's

    whole = {".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp"}
    for pod in (pod0, pod1):
        assert set(_contents(pod / "step-50")) == whole
        assert checkpoints.complete_here(pod / "step-50") == 50
    restored = restore(tmp_path / "new-pod", remote)
    assert restored is not None and set(_contents(restored)) == whole


def test_a_pod_whose_part_is_up_ends_its_drain_when_only_part_0s_pod_can_commit(
        tmp_path: Path, remote: Storage, monkeypatch: pytest.MonkeyPatch) -> None:
    """Worker 0 killed after the save, before its upload (the group is recreated): worker 1's
    entry uploads its part and ends its final sync, rather than wait out the deadline for a
    commit only pod 0 could write (90 s more in a CI run of tests/e2e/test_own_code.py's
    worker-0 kill). Pod 0, when it is the one left, waits for the missing part."""
    _shard(tmp_path / "pod0", 50, monkeypatch, group_rank=0)  # never uploaded: pod 0 is gone
    _shard(tmp_path / "pod1", 50, monkeypatch, group_rank=1)
    started = time.monotonic()
    report = CheckpointSync(tmp_path / "pod1", remote, 2).drain(started + 60, interval=0.05)
    assert time.monotonic() - started < 30, "pod 1 waited for a commit it cannot write"
    assert report.uploaded == ["step-50"] and report.handed_over == ["step-50"]
    assert report.waiting == [] and not remote.join("step-50").exists(COMMIT)

    _shard(tmp_path / "pod1", 60, monkeypatch, group_rank=1)  # never uploaded: pod 1 is gone
    _shard(tmp_path / "pod0", 60, monkeypatch, group_rank=0)
    started = time.monotonic()
    report = CheckpointSync(tmp_path / "pod0", remote, 2).drain(started + 0.5, interval=0.05)
    assert time.monotonic() - started >= 0.5  # part 1 might still come: until the deadline
    assert "step-60" in report.waiting and not remote.join("step-60").exists(COMMIT)


def test_rank_zeros_checkpoint_reaches_the_pods_that_did_not_write_it(
        tmp_path: Path, remote: Storage, monkeypatch: pytest.MonkeyPatch) -> None:
    """After a restart in place rank 0 may run in another pod: every pod holds the newest."""
    _as_rank(monkeypatch, 0, local_world=1, group_rank=0, groups=2)
    mark_complete(_save(tmp_path / "pod0", 7, {"model.pt": b"weights"}), 7)
    CheckpointSync(tmp_path / "pod0", remote, 2).sync_once()
    (tmp_path / "pod1").mkdir()
    report = CheckpointSync(tmp_path / "pod1", remote, 2).sync_once()
    assert report.completed_here == ["step-7"] and report.uploaded == []
    assert _contents(tmp_path / "pod1" / "step-7") == {"model.pt": b"weights"}


def test_a_new_job_starts_from_resume_from_when_its_own_uri_has_nothing(
        tmp_path: Path, remote: Storage, s3_bucket: str, s3_spec: StorageSpec,
        monkeypatch: pytest.MonkeyPatch) -> None:
    _as_rank(monkeypatch, 0)
    other = open_storage(f"s3://{s3_bucket}/jobs/earlier", s3_spec)
    mark_complete(_save(tmp_path / "earlier", 900, {"model.pt": b"earlier weights"}), 900)
    CheckpointSync(tmp_path / "earlier", other, 3).sync_once()
    restored = restore(tmp_path / "pod", remote, fallback=other)
    assert restored is not None and _contents(restored) == {"model.pt": b"earlier weights"}
