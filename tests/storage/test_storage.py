"""The storage layer behaves the same on local disk and on S3 (moto over HTTP)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import blake3
import pytest

from kubetrain.api.trainingjob import StorageSpec
from kubetrain.trainer.storage import (
    HASH_CHUNK,
    PART_SIZE,
    Storage,
    open_object,
    open_storage,
)


def test_objects_round_trip_and_list_below_their_prefix(store: Storage) -> None:
    store.write_bytes("a/one.bin", b"1")
    store.join("a").write_bytes("two.bin", b"22")
    store.write_bytes("ab/three.bin", b"333")

    assert [(o.key, o.size) for o in store.list()] == [
        ("a/one.bin", 1), ("a/two.bin", 2), ("ab/three.bin", 3)]
    assert [o.key for o in store.list("a/")] == ["a/one.bin", "a/two.bin"]
    assert [o.key for o in store.list("a")] == ["a/one.bin", "a/two.bin", "ab/three.bin"]
    assert [o.key for o in store.list("a/one")] == ["a/one.bin"]
    assert [o.key for o in store.join("a").list()] == ["one.bin", "two.bin"]
    assert store.join("a", "two.bin").uri == store.uri + "/a/two.bin"
    assert store.read_bytes("a/two.bin") == b"22"
    assert store.exists("a/one.bin") and not store.exists("a/missing")

    store.delete(["a/one.bin", "a/never-existed"])
    assert [o.key for o in store.list("a/")] == ["a/two.bin"]


def test_missing_objects_raise_file_not_found(store: Storage, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        store.read_bytes("nothing/here")
    with pytest.raises(FileNotFoundError):
        store.download_file("nothing/here", tmp_path / "out")


def test_a_root_does_not_list_its_siblings_with_a_longer_name(store: Storage) -> None:
    parent = store.join("runs")
    parent.write_bytes("run10/x", b"x")
    assert parent.join("run1").list() == []


def test_large_files_upload_in_parts_and_download_intact(store: Storage, tmp_path: Path) -> None:
    data = os.urandom(PART_SIZE + 12345)  # two multipart parts on S3
    (tmp_path / "big").write_bytes(data)
    store.upload_file(tmp_path / "big", "big/file")
    store.download_file("big/file", tmp_path / "copy" / "file")
    assert (tmp_path / "copy" / "file").read_bytes() == data
    assert store.list("big/")[0].size == len(data)


def test_range_and_unchecked_reads_return_those_bytes(store: Storage) -> None:
    data = os.urandom(5000)
    store.write_bytes("blob", data)
    assert store.read_unchecked("blob") == data
    assert store.read_range("blob", 1234, 100) == data[1234:1334]
    assert store.read_range("blob", 4990, 100) == data[4990:]  # shorter past the end
    assert store.read_range("blob", 0, 0) == b""


def test_open_object_splits_a_uri_into_folder_and_key(s3_spec: StorageSpec, s3_bucket: str,
                                                      tmp_path: Path) -> None:
    folder, key = open_object(f"s3://{s3_bucket}/deep/tokenizer.json", s3_spec)
    assert (folder.uri, key) == (f"s3://{s3_bucket}/deep", "tokenizer.json")
    folder, key = open_object((tmp_path / "t.json").as_uri())
    assert (folder.uri, key) == (tmp_path.as_uri(), "t.json")


def test_unsupported_schemes_are_refused() -> None:
    with pytest.raises(ValueError, match="gs://"):
        open_storage("gs://bucket/x")


def test_credentials_never_appear_in_reprs_or_errors(s3_spec: StorageSpec, s3_bucket: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    secret = "kubetrain-test-secret-value"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    store = open_storage(f"s3://{s3_bucket}/p", s3_spec)
    with pytest.raises(FileNotFoundError) as missing:
        store.read_bytes("absent")
    assert secret not in repr(store) + str(missing.value) + store.uri


def test_dot_files_are_objects_too_and_deleting_the_last_one_leaves_nothing(
        store: Storage) -> None:
    store.write_bytes("step/.metadata", b"m")  # DCP's metadata file is a dot file
    assert [o.key for o in store.list()] == ["step/.metadata"]
    store.delete(["step/.metadata"])
    assert store.list() == [] and not store.exists("step/.metadata")
    if store.uri.startswith("file://"):
        assert not Path(store.uri.removeprefix("file://"), "step").exists()


def test_injected_faults_slow_transfers_down_but_lose_nothing(
        faulty_s3: Callable[..., Any], s3_bucket: str, tmp_path: Path) -> None:
    proxy = faulty_s3(fault_ratio=0.2, seed=1)
    store = open_storage(f"s3://{s3_bucket}/faulty",
                         StorageSpec(endpoint=proxy.endpoint, region="us-east-1"))
    blobs = {f"obj-{n}": os.urandom(50_000 + n) for n in range(12)}
    for key, data in blobs.items():
        store.write_bytes(key, data)
    big = os.urandom(PART_SIZE + 1000)
    (tmp_path / "big").write_bytes(big)
    store.upload_file(tmp_path / "big", "big")
    store.download_file("big", tmp_path / "back")

    assert all(store.read_bytes(key) == data for key, data in blobs.items())
    assert all(store.read_unchecked(key) == data for key, data in blobs.items())
    assert store.read_range("big", PART_SIZE - 10, 100) == big[PART_SIZE - 10:PART_SIZE + 90]
    assert (tmp_path / "back").read_bytes() == big
    assert [o.key for o in store.list()] == sorted([*blobs, "big"])
    assert set(proxy.injected) == {"500", "reset", "truncate"}


def test_a_streamed_upload_appears_whole_on_success_and_not_at_all_on_error(
        store: Storage) -> None:
    data = os.urandom(PART_SIZE * 2 + 777)  # three parts on S3
    with store.open_upload("streamed") as stream:
        for start in range(0, len(data), 1_000_003):
            stream.write(data[start:start + 1_000_003])
        assert stream.tell() == len(data)
    assert store.read_bytes("streamed") == data
    assert stream.chunk_digests() == [blake3.blake3(data[at:at + HASH_CHUNK]).hexdigest()
                                      for at in range(0, len(data), HASH_CHUNK)]

    with pytest.raises(RuntimeError, match="writer failed"), \
            store.open_upload("never") as stream:
        stream.write(data)
        raise RuntimeError("writer failed")
    assert not store.exists("never")
    assert [o.key for o in store.list()] == ["streamed"]
