"""The one storage layer: objects under an `s3://bucket/prefix`, a `file:///path` or a plain path.

Every part of the trainer that touches datasets, checkpoints or exports goes through
`open_storage(uri, spec)`. A `Storage` is rooted at a location; keys are relative,
`/`-separated paths below it, and `join()` gives the storage of a sub-folder.

    store = open_storage("s3://bucket/runs/demo", job.spec.storage)
    store.write_bytes("notes/a.txt", b"hi")
    [obj.key for obj in store.list("notes/")]   # ["notes/a.txt"]
    store.join("notes").read_bytes("a.txt")     # b"hi"

S3: the endpoint and region come from `spec.storage`; credentials only from the
standard AWS environment variables / default chain (a Secret mounted as env,
IRSA / workload identity, the node role) and are never logged, raised or passed
around by this module. Requests retry with backoff on throttling, 5xx and
connection resets (botocore's "adaptive" mode); reads also retry a body cut off
mid-stream, which botocore does not. Uploads send CRC32 checksums that S3 checks;
whole-object reads check S3's checksum, except `read_unchecked`, whose caller checks
a digest of its own instead (the training dataset, against its index). Large files
go through boto3's transfer manager (multipart, several parts in flight);
`open_upload` streams data of unknown length the same way while it is being
produced (checkpoints), and
`read_range` fetches part of an object (a ranged GET) so that a reader takes only
the bytes it needs. An interrupted multipart upload leaves invisible parts behind:
give checkpoint buckets an AbortIncompleteMultipartUpload lifecycle rule
(docs/troubleshooting.md).

Integrity: kubetrain's own records (dataset indexes, checkpoint manifests) name
their digest algorithm - BLAKE3 (`DIGEST`) for everything written now, sha256 in
older ones - and `digest` / `chunk_digests` compute either. An `Upload` records the
digest of every `HASH_CHUNK` bytes it writes (the last chunk may be shorter), so
that a reader of any byte range can verify exactly the chunks that cover it
without reading the rest.

Local paths: writes are atomic (a temporary file renamed into place), so a reader
never sees half an object, matching S3's semantics.

A missing object raises `FileNotFoundError` on both backends.
Torch-free: the `kubetrain prepare` command imports it.
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import tempfile
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Protocol, TypeVar

import blake3

if TYPE_CHECKING:
    from kubetrain.api.trainingjob import StorageSpec

# Multipart part size and parallelism of the transfer manager: 16 MiB parts keep the
# part count low for multi-GB checkpoint shards while still splitting 100 MB files.
PART_SIZE = 16 * 1024 * 1024
TRANSFER_CONCURRENCY = 8
MAX_ATTEMPTS = 10
# The unit of integrity checks for partial reads (see the module docstring): small enough
# that a reader's ranges pull in little extra, large enough that an 80 GB checkpoint has
# 80k hashes (a 5 MB manifest). A part is a whole number of chunks: parts hash alone.
HASH_CHUNK = 1024 * 1024
assert PART_SIZE % HASH_CHUNK == 0

# BLAKE3 is a cryptographic hash like sha256 and about four times faster on one core
# (SIMD); every dataset shard and checkpoint byte is hashed, on the trainer's CPU.
# sha256 verifies what older versions wrote.
DIGEST = "blake3"


class Hasher(Protocol):
    """What hashlib's and blake3's hash objects have in common."""

    def update(self, data: Any, /) -> object: ...

    def hexdigest(self) -> str: ...


_HASHERS: dict[str, Callable[[], Hasher]] = {"blake3": blake3.blake3, "sha256": hashlib.sha256}


def hasher(algorithm: str = DIGEST) -> Hasher:
    """A fresh hash object of `algorithm`: `update(bytes)`, then `hexdigest()`."""
    try:
        return _HASHERS[algorithm]()
    except KeyError:
        raise ValueError(f"unknown digest algorithm {algorithm!r}: this version verifies "
                         f"{', '.join(_HASHERS)}; upgrade kubetrain to read this data") from None


def digest(data: Any, algorithm: str = DIGEST) -> str:
    """The hex digest of `data` (bytes-like); the GIL is released while hashing."""
    hashed = hasher(algorithm)
    hashed.update(data)
    return hashed.hexdigest()


@dataclass(frozen=True)
class ObjectInfo:
    """One object found by `Storage.list`: its key relative to the storage root, and size."""

    key: str
    size: int


class Storage(ABC):
    """Objects below one root location; see the module docstring."""

    @property
    @abstractmethod
    def uri(self) -> str:
        """The root as a URI (`s3://bucket/prefix` or `file:///abs/path`)."""

    @abstractmethod
    def join(self, *parts: str) -> Storage:
        """The storage rooted at a sub-folder of this one."""

    @abstractmethod
    def read_bytes(self, key: str) -> bytes:
        """The whole object; `FileNotFoundError` when it does not exist."""

    @abstractmethod
    def read_unchecked(self, key: str) -> bytes:
        """The whole object without the store's own checksum, for a caller that checks a
        digest of its own instead; `FileNotFoundError` when it does not exist."""

    @abstractmethod
    def read_range(self, key: str, offset: int, length: int) -> bytes:
        """`length` bytes of the object from `offset` (fewer only past its end)."""

    @abstractmethod
    def write_bytes(self, key: str, data: bytes) -> None:
        """Create or replace an object atomically."""

    @abstractmethod
    def upload_file(self, local_path: str | Path, key: str) -> None:
        """Copy a local file to `key` (multipart and parallel on S3)."""

    @abstractmethod
    def open_upload(self, key: str) -> AbstractContextManager[Upload]:
        """A stream whose bytes become the object `key` when the block ends without error.

        Written data is sent while the writer goes on (S3: multipart, several parts in
        flight); on an error nothing is created.
        """

    @abstractmethod
    def download_file(self, key: str, local_path: str | Path) -> None:
        """Copy `key` to a local file, creating its folder."""

    @abstractmethod
    def list(self, prefix: str = "") -> list[ObjectInfo]:
        """Every object whose key starts with `prefix`, sorted by key."""

    @abstractmethod
    def exists(self, key: str) -> bool:
        """Whether the object exists."""

    @abstractmethod
    def delete(self, keys: Sequence[str]) -> None:
        """Delete objects; keys that do not exist are ignored."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.uri!r})"


def open_storage(uri: str, spec: StorageSpec | None = None) -> Storage:
    """The storage rooted at `uri`: `s3://bucket/prefix`, `file:///path` or a plain path."""
    if uri.startswith("s3://"):
        bucket, _, prefix = uri.removeprefix("s3://").partition("/")
        if not bucket:
            raise ValueError(f"{uri}: an S3 URI needs a bucket: s3://bucket/prefix")
        return S3Storage(bucket, prefix.strip("/"), _S3Connection.for_spec(spec))
    if "://" in uri and not uri.startswith("file://"):
        raise ValueError(f"{uri}: unsupported scheme; use s3://bucket/prefix, file:///path "
                         "or a plain path")
    return LocalStorage(Path(uri.removeprefix("file://")).expanduser().resolve())


def open_object(uri: str, spec: StorageSpec | None = None) -> tuple[Storage, str]:
    """The storage of the folder holding the object at `uri`, and the object's key in it."""
    parent, _, name = uri.rstrip("/").rpartition("/")
    if not name or parent == "s3:/":
        raise ValueError(f"{uri}: expected the URI of an object, e.g. s3://bucket/tokenizer.json")
    if parent in {"", "file://"}:  # "name.json" or "file:///name.json"
        parent = "." if not parent else "/"
    return open_storage(parent, spec), name


def _join_key(*parts: str) -> str:
    return "/".join(part.strip("/") for part in parts if part.strip("/"))


_Read = TypeVar("_Read")


def _read_all(response: dict[str, Any]) -> bytes:
    return bytes(response["Body"].read())


# --- local ---------------------------------------------------------------------------


_PARTIAL = ".partial"


def chunk_digests(data: Any, algorithm: str = DIGEST) -> list[str]:
    """The hex digest of every `HASH_CHUNK` bytes of `data` (bytes-like), the last one
    shorter."""
    view = memoryview(data).cast("B")
    return [digest(view[start:start + HASH_CHUNK], algorithm)
            for start in range(0, len(view), HASH_CHUNK)]


class Upload(io.RawIOBase, ABC):
    """The stream `Storage.open_upload` yields: `write`, `tell`, and the `DIGEST` of every
    `HASH_CHUNK` of what was written (complete once the `with` block has ended)."""

    def writable(self) -> bool:
        return True

    @abstractmethod
    def chunk_digests(self) -> list[str]:
        """The hex digest of each `HASH_CHUNK` bytes written, in order (as `chunk_digests`)."""


class _FileUpload(Upload):
    """Writes to a local file, hashing each chunk on the way."""

    def __init__(self, handle: BinaryIO) -> None:
        super().__init__()
        self._handle = handle
        self._digests: list[str] = []
        self._chunk = hasher()
        self._written = 0

    def tell(self) -> int:
        return self._written

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self._handle.write(view)
        done = 0
        while done < len(view):
            room = HASH_CHUNK - self._written % HASH_CHUNK
            self._chunk.update(view[done:done + room])
            step = min(room, len(view) - done)
            done += step
            self._written += step
            if self._written % HASH_CHUNK == 0:
                self._digests.append(self._chunk.hexdigest())
                self._chunk = hasher()
        return len(view)

    def chunk_digests(self) -> list[str]:
        tail = [self._chunk.hexdigest()] if self._written % HASH_CHUNK else []
        return self._digests + tail


class LocalStorage(Storage):
    """Files below a local folder."""

    def __init__(self, root: Path) -> None:
        self.root = root

    @property
    def uri(self) -> str:
        return self.root.as_uri()

    def join(self, *parts: str) -> LocalStorage:
        return LocalStorage(self.root.joinpath(*(p for p in parts if p.strip("/"))))

    def _path(self, key: str) -> Path:
        return self.root / key if key else self.root

    def read_bytes(self, key: str) -> bytes:
        return self._path(key).read_bytes()

    def read_unchecked(self, key: str) -> bytes:
        return self.read_bytes(key)

    def read_range(self, key: str, offset: int, length: int) -> bytes:
        with open(self._path(key), "rb") as handle:
            handle.seek(offset)
            return handle.read(length)

    def write_bytes(self, key: str, data: bytes) -> None:
        with self.open_upload(key) as handle:
            handle.write(data)

    def upload_file(self, local_path: str | Path, key: str) -> None:
        with open(local_path, "rb") as source, self.open_upload(key) as handle:
            shutil.copyfileobj(source, handle, PART_SIZE)

    def download_file(self, key: str, local_path: str | Path) -> None:
        Path(local_path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(self._path(key), local_path)

    @contextmanager
    def open_upload(self, key: str) -> Iterator[Upload]:
        target = self._path(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.",
                                         suffix=_PARTIAL)
        try:
            with os.fdopen(fd, "wb") as handle:
                yield _FileUpload(handle)
            os.chmod(temporary, 0o644)  # mkstemp makes 0600; objects are plain files
            os.replace(temporary, target)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        # Visit only what the prefix can match: in the folder it names, the entries whose
        # name starts with its last part (listing one file of a large folder stays cheap).
        folder, _, stem = prefix.rpartition("/")
        start = self.root / folder
        if not start.is_dir():
            return []
        found = []
        for entry in os.scandir(start):
            if not entry.name.startswith(stem):
                continue
            paths = ([Path(entry.path)] if not entry.is_dir() else
                     [Path(inner, name) for inner, _, names in os.walk(entry.path)
                      for name in names])
            for path in paths:
                if path.name.endswith(_PARTIAL):  # an atomic write in flight
                    continue
                found.append(ObjectInfo(path.relative_to(self.root).as_posix(),
                                        path.stat().st_size))
        return sorted(found, key=lambda info: info.key)

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def delete(self, keys: Sequence[str]) -> None:
        for key in keys:
            path = self._path(key)
            path.unlink(missing_ok=True)
            # Folders exist only to hold objects (as on S3): drop the ones left empty.
            for folder in path.parents:
                if folder == self.root or not folder.is_relative_to(self.root):
                    break
                try:
                    folder.rmdir()
                except OSError:
                    break


# --- S3 ------------------------------------------------------------------------------


@dataclass(frozen=True)
class _S3Connection:
    """A boto3 client and transfer settings shared by every S3Storage of one endpoint."""

    client: Any
    transfer_config: Any
    part_uploads: ThreadPoolExecutor

    @staticmethod
    def for_spec(spec: StorageSpec | None) -> _S3Connection:
        endpoint = spec.endpoint if spec else None
        region = spec.region if spec else None
        # Per process too: a forked child (a DataLoader worker) must not share the parent's
        # pooled sockets or part-upload threads, which do not survive the fork.
        key = (endpoint, region, os.getpid())
        if key not in _CONNECTIONS:
            import boto3
            from boto3.s3.transfer import TransferConfig
            from botocore.config import Config

            config = Config(
                retries={"mode": "adaptive", "max_attempts": MAX_ATTEMPTS},
                # One pooled connection per concurrent part, plus the prefetch threads.
                max_pool_connections=TRANSFER_CONCURRENCY * 4,
                connect_timeout=10,
                read_timeout=60,
                # Whole-object reads ask for S3's checksum themselves (`read_bytes`); reads
                # that the caller verifies by its own digest skip it.
                response_checksum_validation="when_required",
            )
            # Credentials: never passed here; boto3 resolves env vars / web identity / role.
            client = boto3.session.Session().client(
                "s3", endpoint_url=endpoint, region_name=region, config=config
            )
            transfer = TransferConfig(
                multipart_threshold=PART_SIZE,
                multipart_chunksize=PART_SIZE,
                max_concurrency=TRANSFER_CONCURRENCY,
                use_threads=True,
            )
            parts = ThreadPoolExecutor(TRANSFER_CONCURRENCY, thread_name_prefix="s3-part")
            _CONNECTIONS[key] = _S3Connection(client, transfer, parts)
        return _CONNECTIONS[key]


# boto3 clients are thread-safe and expensive to build: one per (endpoint, region, process).
_CONNECTIONS: dict[tuple[str | None, str | None, int], _S3Connection] = {}


def _is_missing(error: Exception) -> bool:
    from botocore.exceptions import ClientError

    if not isinstance(error, ClientError):
        return False
    code = str(error.response.get("Error", {}).get("Code", ""))
    return code in {"404", "NoSuchKey", "NotFound"}


class S3Storage(Storage):
    """Objects below `s3://bucket/prefix`."""

    def __init__(self, bucket: str, prefix: str, connection: _S3Connection) -> None:
        self.bucket = bucket
        self.prefix = prefix
        self._connection = connection
        self._client = connection.client

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"

    def join(self, *parts: str) -> S3Storage:
        return S3Storage(self.bucket, _join_key(self.prefix, *parts), self._connection)

    def _key(self, key: str) -> str:
        return _join_key(self.prefix, key)

    def read_bytes(self, key: str) -> bytes:
        return self._get(key, _read_all, ChecksumMode="ENABLED")

    def read_unchecked(self, key: str) -> bytes:
        # The caller checks its own digest: S3's CRC would only spend CPU on the same bytes.
        return self._get(key, _read_all)

    def read_range(self, key: str, offset: int, length: int) -> bytes:
        # S3 has no checksum of an arbitrary range; readers verify the chunks they read.
        if length <= 0:
            return b""
        return self._get(key, _read_all, Range=f"bytes={offset}-{offset + length - 1}")

    def _get(self, key: str, consume: Callable[[dict[str, Any]], _Read],
             **options: str) -> _Read:
        """`consume` applied to a GET's response, retried whole if the body breaks off."""
        from http.client import HTTPException

        from botocore.exceptions import (
            ConnectionError,
            IncompleteReadError,
            ReadTimeoutError,
            ResponseStreamingError,
        )
        from urllib3.exceptions import ProtocolError

        # botocore retries a failed request, but not a body that breaks off mid-read.
        for attempt in range(1, MAX_ATTEMPTS + 1):
            try:
                response = self._client.get_object(Bucket=self.bucket, Key=self._key(key),
                                                   **options)
                return consume(response)
            # OSError and HTTPException: a connection that breaks below botocore. urllib3's
            # ProtocolError: one reset while botocore itself reads a body inside get_object
            # (seen resuming through the storage tests' fault proxy: the manifest's read
            # failed the resume instead of being tried again).
            except (ConnectionError, IncompleteReadError, ReadTimeoutError,
                    ResponseStreamingError, OSError, HTTPException, ProtocolError):
                if attempt == MAX_ATTEMPTS:
                    raise
                time.sleep(min(0.05 * 2**attempt, 5.0))
            except Exception as error:
                if _is_missing(error):
                    raise FileNotFoundError(f"{self.uri}/{key}") from None
                raise
        raise AssertionError("unreachable")

    def write_bytes(self, key: str, data: bytes) -> None:
        self._client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data)

    def upload_file(self, local_path: str | Path, key: str) -> None:
        self._client.upload_file(
            str(local_path), self.bucket, self._key(key), Config=self._connection.transfer_config
        )

    @contextmanager
    def open_upload(self, key: str) -> Iterator[Upload]:
        upload = _StreamingUpload(self._client, self.bucket, self._key(key),
                                  self._connection.part_uploads)
        try:
            yield upload
            upload.complete()
        except BaseException:
            upload.abort()
            raise

    def download_file(self, key: str, local_path: str | Path) -> None:
        Path(local_path).parent.mkdir(parents=True, exist_ok=True)
        try:
            self._client.download_file(
                self.bucket, self._key(key), str(local_path),
                Config=self._connection.transfer_config,
            )
        except Exception as error:
            if _is_missing(error):
                raise FileNotFoundError(f"{self.uri}/{key}") from None
            raise

    def _pages(self, prefix: str) -> Iterator[dict[str, Any]]:
        paginator = self._client.get_paginator("list_objects_v2")
        yield from paginator.paginate(Bucket=self.bucket, Prefix=prefix)

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        # The root prefix ends with "/" so that s3://b/run1 does not list s3://b/run10.
        root = f"{self.prefix}/" if self.prefix else ""
        found = []
        for page in self._pages(root + prefix):
            for item in page.get("Contents", []):
                found.append(ObjectInfo(item["Key"][len(root):], int(item["Size"])))
        return sorted(found, key=lambda info: info.key)

    def exists(self, key: str) -> bool:
        try:
            self._client.head_object(Bucket=self.bucket, Key=self._key(key))
        except Exception as error:
            if _is_missing(error):
                return False
            raise
        return True

    def delete(self, keys: Sequence[str]) -> None:
        # DeleteObjects takes at most 1000 keys per request.
        for start in range(0, len(keys), 1000):
            batch = [{"Key": self._key(key)} for key in keys[start:start + 1000]]
            if batch:
                self._client.delete_objects(
                    Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True}
                )


class _StreamingUpload(Upload):
    """A write-only stream sent to S3 as a multipart upload while it is written.

    Written bytes are copied once, into a `PART_SIZE` buffer; each full buffer is
    handed to the shared part pool as it is (no further copies), at most
    `TRANSFER_CONCURRENCY` parts in flight per stream (writes wait beyond that, which
    bounds memory). The pool's thread also hashes its part's chunks (hashing releases
    the GIL, so this runs beside the writer). A stream shorter than one part is one
    PutObject.
    """

    def __init__(self, client: Any, bucket: str, key: str, pool: ThreadPoolExecutor) -> None:
        super().__init__()
        self._client, self._bucket, self._key, self._pool = client, bucket, key, pool
        self._buffer = bytearray(PART_SIZE)
        self._filled = 0
        self._written = 0
        self._upload_id: str | None = None
        self._parts: list[Future[tuple[dict[str, Any], list[str]]]] = []
        self._slots = threading.BoundedSemaphore(TRANSFER_CONCURRENCY)
        self._digests: list[str] = []

    def tell(self) -> int:
        return self._written

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            step = min(PART_SIZE - self._filled, len(view) - done)
            self._buffer[self._filled:self._filled + step] = view[done:done + step]
            self._filled += step
            done += step
            if self._filled == PART_SIZE:
                self._send(self._buffer)
                self._buffer, self._filled = bytearray(PART_SIZE), 0
        self._written += len(view)
        return len(view)

    def _send(self, part: bytearray) -> None:
        if self._upload_id is None:
            # CRC32 part checksums, as boto3's transfer manager sends: S3 checks each part
            # and the whole upload at completion (without, some stores checksum it all).
            self._upload_id = self._client.create_multipart_upload(
                Bucket=self._bucket, Key=self._key, ChecksumAlgorithm="CRC32")["UploadId"]
        self._slots.acquire()
        self._parts.append(self._pool.submit(self._upload_part, len(self._parts) + 1, part))

    def _upload_part(self, number: int, part: bytearray) -> tuple[dict[str, Any], list[str]]:
        try:
            digests = chunk_digests(part)
            response = self._client.upload_part(Bucket=self._bucket, Key=self._key,
                                                UploadId=self._upload_id, PartNumber=number,
                                                Body=part, ChecksumAlgorithm="CRC32")
            return {"PartNumber": number, "ETag": response["ETag"],
                    "ChecksumCRC32": response["ChecksumCRC32"]}, digests
        finally:
            self._slots.release()

    def complete(self) -> None:
        """Send what is left and create the object."""
        rest = self._buffer
        del rest[self._filled:]  # shrinks in place: no copy
        if self._upload_id is None:
            self._digests = chunk_digests(rest)
            self._client.put_object(Bucket=self._bucket, Key=self._key, Body=rest)
            return
        if self._filled:
            self._send(rest)
        parts = []
        for part in self._parts:
            sent, digests = part.result()
            parts.append(sent)
            self._digests += digests
        self._client.complete_multipart_upload(
            Bucket=self._bucket, Key=self._key, UploadId=self._upload_id,
            MultipartUpload={"Parts": parts},
        )

    def chunk_digests(self) -> list[str]:
        return list(self._digests)

    def abort(self) -> None:
        """Drop the parts sent so far; no object is created."""
        for part in self._parts:
            part.cancel()
        if self._upload_id is not None:
            for part in self._parts:
                if not part.cancelled():
                    part.exception()  # wait for it, whatever its outcome
            self._client.abort_multipart_upload(Bucket=self._bucket, Key=self._key,
                                                UploadId=self._upload_id)
