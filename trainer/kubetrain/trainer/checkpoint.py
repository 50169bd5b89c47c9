"""Checkpoints: sharded `torch.distributed.checkpoint` saves to S3 or disk, committed atomically.

Use (what the training loop does; every call is collective: all ranks, same order):

    app_state = {
        "model": ModelState(model, optimizer),   # FSDP2 / DDP / plain; reshards on load
        "scheduler": scheduler,                   # anything with state_dict/load_state_dict
        "data": train_dataset,                    # TokenDataset: the global sample position
        "train": train_progress,                  # the loop's own Stateful: best val loss...
        "scaler": grad_scaler,                    # when fp16
        "rng": RandomState(),                     # torch / cuda RNG of every rank
    }
    checkpointer = Checkpointer(job.spec, rank=rank, world_size=world)
    start = checkpointer.load_latest(app_state) or 0   # None: nothing to resume from
    ...
    if step % spec.checkpoint.every_steps == 0 or stopping or finished:
        checkpointer.save(step, app_state, blocking=stopping or finished)
    checkpointer.close()                           # waits for an upload in flight

`save` with `blocking=False` and `spec.checkpoint.async` returns once the state
is staged (copied to host memory by `dcp.async_save`); uploading and committing
run in background threads over a separate gloo group, so training continues.
The next `save`, `wait()` and `close()` wait for it and re-raise its error.
Otherwise `save` returns after the commit.

Layout under `spec.checkpoint.uri` (s3://bucket/prefix, file:///path or a path):

    step-00000500/__0_0.distcp ...   one DCP file per rank, plus DCP's .metadata
    step-00000500/checkpoint.json    the manifest: step, time, world size, every
                                     file's size and sha256, the model dimensions
                                     and the job spec that produced it

A checkpoint is *committed* when its manifest exists: rank 0 writes it last,
after every rank has uploaded its file and reported its size and hash.
Readers (`latest_checkpoint`, `load_latest`) ignore folders without one, and
verify every file against it before loading: a truncated or modified file is
refused (`CorruptCheckpoint`), never loaded, and the next older committed
checkpoint is used instead. A checkpoint whose model dimensions differ from the
job's is refused with `IncompatibleCheckpoint`. `keepLast` rotation deletes the
oldest committed checkpoints (manifest first, so a half-deleted one is never
"committed") and the debris of interrupted saves; it never touches the newest.

How files get to S3: DCP's own FileSystemWriter (one file per rank) writes through
a small file-system adapter onto the storage layer, so each rank's file streams
straight into its object as DCP serialises it - a multipart upload with several
parts in flight, retried per request - and its sha256 is computed from the very
bytes sent. Serialisation and upload overlap, and no local disk is needed (pods
often have little ephemeral storage). The alternative, writing DCP to a local
staging folder and uploading afterwards, costs a full extra write and read of
the checkpoint and adds their time to every save. Loading downloads a checkpoint
(all files, verified) to a scratch folder and reads it with DCP's FileSystemReader.
When the job has no committed checkpoint, `spec.checkpoint.resumeFrom` (another
job's checkpoint URI, or one checkpoint folder) is loaded instead.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import re
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystemBase
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
from torch.distributed.checkpoint.stateful import Stateful

from kubetrain.api.trainingjob import ModelDims, StorageSpec, TrainingJobSpec
from kubetrain.trainer.storage import LocalStorage, Storage, open_storage

log = logging.getLogger(__name__)

MANIFEST_NAME = "checkpoint.json"
MANIFEST_FORMAT = "kubetrain-checkpoint-v1"
_STEP_FOLDER = re.compile(r"^step-(\d+)$")


def step_folder(step: int) -> str:
    """The folder name of the checkpoint of `step`."""
    return f"step-{step:08d}"


class CorruptCheckpoint(RuntimeError):
    """A committed checkpoint whose files do not match its manifest."""


class IncompatibleCheckpoint(ValueError):
    """A checkpoint made by a different model than the job's."""


@dataclass(frozen=True)
class CheckpointInfo:
    """A committed checkpoint: its step, URI, commit time and the world size that wrote it."""

    step: int
    uri: str
    time: datetime
    world_size: int


# --- Stateful wrappers -----------------------------------------------------------------


class ModelState(Stateful):
    """Model and optimizer as DCP state: DTensor shards under FSDP2, so loads reshard."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optimizer": optimizer_state}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optimizer"])


class RandomState(Stateful):
    """The torch (and CUDA) RNG states of every rank, gathered into one checkpoint entry.

    A rank restores its own state when the world size is unchanged; after a
    resize rank r takes saved rank r mod (old world size).
    """

    def state_dict(self) -> dict[str, Any]:
        own = {"cpu": torch.get_rng_state(),
               "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}
        states: list[Any] = [None] * _world_size()
        if dist.is_initialized():
            dist.all_gather_object(states, own)
        else:
            states = [own]
        # One bytes entry: DCP keeps a single copy of non-tensor values across ranks.
        buffer = io.BytesIO()
        torch.save(states, buffer)
        return {"states": buffer.getvalue()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        states = torch.load(io.BytesIO(state_dict["states"]))
        own = states[_rank() % len(states)]
        torch.set_rng_state(own["cpu"])
        if own["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(own["cuda"])


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


# --- finding checkpoints ----------------------------------------------------------------


def _read_manifest(store: Storage, folder: str) -> dict[str, Any] | None:
    try:
        key = f"{folder}/{MANIFEST_NAME}" if folder else MANIFEST_NAME
        manifest: dict[str, Any] = json.loads(store.read_bytes(key))
    except FileNotFoundError:
        return None
    return manifest if manifest.get("format") == MANIFEST_FORMAT else None


def _info(store: Storage, folder: str, manifest: dict[str, Any]) -> CheckpointInfo:
    return CheckpointInfo(step=int(manifest["step"]), uri=store.join(folder).uri,
                          time=datetime.fromisoformat(manifest["time"]),
                          world_size=int(manifest["world_size"]))


def committed_checkpoints(uri: str, storage: StorageSpec | None = None) -> list[CheckpointInfo]:
    """Every committed checkpoint under `uri`, newest first."""
    store = open_storage(uri, storage)
    found = []
    for obj in store.list():
        folder, _, name = obj.key.rpartition("/")
        if name == MANIFEST_NAME and _STEP_FOLDER.match(folder):
            manifest = _read_manifest(store, folder)
            if manifest is not None:
                found.append(_info(store, folder, manifest))
    return sorted(found, key=lambda info: info.step, reverse=True)


def latest_checkpoint(uri: str, storage: StorageSpec | None = None) -> CheckpointInfo | None:
    """The newest committed checkpoint under `uri`, or None."""
    found = committed_checkpoints(uri, storage)
    return found[0] if found else None


# --- writing DCP files straight to storage --------------------------------------------


class _StorageFileSystem(FileSystemBase):
    """DCP's file interface over one checkpoint folder of a Storage.

    Each file DCP writes streams straight into its object (`Storage.open_upload`),
    and its size and sha256 are recorded in `files` for the manifest. DCP writes its
    `.metadata` under a temporary name and renames it; that small file is held in
    memory until the rename stores it under its final name.
    """

    def __init__(self, store: Storage) -> None:
        self.store = store
        self.files: dict[str, dict[str, Any]] = {}
        self._held: dict[str, bytes] = {}

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[io.IOBase]:
        if mode != "wb":
            raise ValueError(f"checkpoint files are only written here, not opened {mode!r}")
        name = str(path)
        if name.endswith(".tmp"):
            held = io.BytesIO()
            yield held
            self._held[name] = held.getvalue()
            return
        with self.store.open_upload(name) as upload:
            yield upload
        self.files[name] = {"bytes": upload.tell(), "sha256": upload.sha256()}

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        data = self._held.pop(str(path))
        self.store.write_bytes(str(new_path), data)
        self.files[str(new_path)] = {"bytes": len(data),
                                     "sha256": hashlib.sha256(data).hexdigest()}

    def concat_path(self, path: str | os.PathLike[str], suffix: str) -> str:
        return f"{path}/{suffix}" if str(path) else suffix

    def init_path(self, path: str | os.PathLike[str]) -> str:
        return ""  # keys are relative to the checkpoint folder the store is rooted at

    def mkdir(self, path: str | os.PathLike[str]) -> None:
        """Folders need no creating in object storage."""

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False

    def exists(self, path: str | os.PathLike[str]) -> bool:
        return self.store.exists(str(path))

    def rm_file(self, path: str | os.PathLike[str]) -> None:
        self.store.delete([str(path)])


class _StreamingWriter(dcp.FileSystemWriter):
    """DCP's FileSystemWriter (one file per rank) writing through `_StorageFileSystem`."""

    def __init__(self, store: Storage) -> None:
        # sync_files: durability comes from the storage's commit (atomic rename, multipart
        # completion), not from fsync.
        super().__init__("", single_file_per_rank=True, sync_files=False)
        self._storage_fs = _StorageFileSystem(store)
        self.fs = self._storage_fs  # type: ignore[assignment]  # DCP types it as FileSystem
        self.path = self._storage_fs.init_path("")

    @property
    def files(self) -> dict[str, dict[str, Any]]:
        """Name → {bytes, sha256} of the files this rank wrote."""
        return self._storage_fs.files


# --- the checkpointer -------------------------------------------------------------------


class Checkpointer:
    """Saves and loads the job's checkpoints; see the module docstring."""

    def __init__(
        self,
        spec: TrainingJobSpec,
        *,
        rank: int,
        world_size: int,
        model_dims: ModelDims | None = None,
        scratch_dir: str | Path | None = None,
        on_commit: Callable[[CheckpointInfo], None] | None = None,
    ) -> None:
        """`model_dims` defaults to `spec.model.resolve()`; pass the dims actually built
        (e.g. with the tokenizer's vocabulary). `on_commit` runs on rank 0 after each
        commit (in the background thread for async saves). Loading downloads a
        checkpoint into `scratch_dir` (default: the system's temporary folder)."""
        self.spec = spec
        self.rank = rank
        self.world_size = world_size
        self.model_dims = model_dims or spec.model.resolve()
        self.store = open_storage(spec.checkpoint.uri, spec.storage)
        self.on_commit = on_commit
        self._scratch = Path(scratch_dir or tempfile.gettempdir()) / "kubetrain-checkpoints"
        # Async saves run their collectives in a background thread: on a group of their
        # own, so they never interleave with the training loop's collectives.
        self._group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        self._finisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")
        self._in_flight: Future[None] | None = None
        self.last_step: int | None = None
        self.latest: CheckpointInfo | None = None

    # --- saving ---------------------------------------------------------------------

    def save(self, step: int, app_state: dict[str, Any], *, blocking: bool = True) -> None:
        """Save `app_state` as the checkpoint of `step` (collective).

        Non-blocking only when `spec.checkpoint.async` is set; a step that was
        already saved or loaded is skipped.
        """
        self.wait()
        if step == self.last_step:
            return
        self.last_step = step
        folder = self.store.join(step_folder(step))
        if self.rank == 0:
            # Debris of an interrupted save of this step must not mix with the new files.
            folder.delete([obj.key for obj in folder.list()])
        self._barrier()
        writer = _StreamingWriter(folder)
        if blocking or not self.spec.checkpoint.async_:
            dcp.save(app_state, storage_writer=writer, process_group=self._group)
            self._commit(step, writer.files)
        else:
            written = dcp.async_save(app_state, storage_writer=writer, process_group=self._group)
            if isinstance(written, AsyncSaveResponse):  # only with an asynchronous stager
                written = written.upload_completion
            self._in_flight = self._finisher.submit(self._commit_after, written, step, writer)

    def _commit_after(self, written: Future[Any], step: int, writer: _StreamingWriter) -> None:
        written.result()
        self._commit(step, writer.files)

    def _commit(self, step: int, files: dict[str, dict[str, Any]]) -> None:
        """Gather every rank's file sizes and hashes; rank 0 writes the manifest (the commit)."""
        every: list[Any] = [None] * self.world_size
        if self._group is not None:
            dist.all_gather_object(every, files, group=self._group)
        else:
            every = [files]
        if self.rank != 0:
            return
        folder = step_folder(step)
        manifest = {
            "format": MANIFEST_FORMAT, "step": step,
            "time": datetime.now(UTC).isoformat(), "world_size": self.world_size,
            "files": {name: entry for rank_files in every for name, entry in rank_files.items()},
            "model": self.model_dims.model_dump(),
            "config": self.spec.wire(),
        }
        self.store.write_bytes(f"{folder}/{MANIFEST_NAME}",
                               json.dumps(manifest, indent=1).encode())
        self.latest = _info(self.store, folder, manifest)
        self._rotate()
        if self.on_commit is not None:
            self.on_commit(self.latest)

    def _rotate(self) -> None:
        """Keep the newest `keepLast` committed checkpoints; delete older folders.

        Older folders are older committed checkpoints and interrupted saves; folders
        newer than the newest commit are left alone.
        """
        committed = committed_checkpoints(self.store.uri, self.spec.storage)
        kept = {step_folder(info.step) for info in committed[:self.spec.checkpoint.keep_last]}
        newest = committed[0].step
        doomed: dict[str, list[str]] = {}
        for obj in self.store.list():
            folder = obj.key.partition("/")[0]
            match = _STEP_FOLDER.match(folder)
            if match and int(match.group(1)) < newest and folder not in kept:
                doomed.setdefault(folder, []).append(obj.key)
        for folder, keys in sorted(doomed.items()):
            manifest = f"{folder}/{MANIFEST_NAME}"
            self.store.delete([manifest])  # de-commit first
            self.store.delete([key for key in keys if key != manifest])

    def wait(self) -> None:
        """Block until a background save has committed; re-raise its error."""
        if self._in_flight is not None:
            in_flight, self._in_flight = self._in_flight, None
            in_flight.result()

    def close(self) -> None:
        """Wait for a save in flight and stop the background thread."""
        try:
            self.wait()
        finally:
            self._finisher.shutdown(wait=True)

    # --- loading --------------------------------------------------------------------

    def load_latest(self, app_state: dict[str, Any]) -> int | None:
        """Load the newest intact committed checkpoint of this job (or of `resumeFrom`).

        Returns its step, or None when there is nothing to resume from. Collective.
        """
        sources = [self.spec.checkpoint.uri]
        if self.spec.checkpoint.resume_from:
            sources.append(self.spec.checkpoint.resume_from)
        for uri in sources:
            candidates = self._broadcast(self._candidates(uri) if self.rank == 0 else None)
            for info in candidates:
                if self._load(info, app_state):
                    self.last_step = info.step
                    self.latest = info if uri == self.spec.checkpoint.uri else None
                    return info.step
            if candidates:
                raise CorruptCheckpoint(f"no intact committed checkpoint under {uri}: every "
                                        "one failed verification (see the warnings above)")
        return None

    def _candidates(self, uri: str) -> list[CheckpointInfo]:
        store = open_storage(uri, self.spec.storage)
        manifest = _read_manifest(store, "")
        if manifest is not None:  # the URI names one checkpoint folder
            return [CheckpointInfo(int(manifest["step"]), store.uri,
                                   datetime.fromisoformat(manifest["time"]),
                                   int(manifest["world_size"]))]
        return committed_checkpoints(uri, self.spec.storage)

    def _load(self, info: CheckpointInfo, app_state: dict[str, Any]) -> bool:
        """Verify and load one checkpoint; False (on every rank) when it is corrupt."""
        store = open_storage(info.uri, self.spec.storage)
        manifest = _read_manifest(store, "")
        if manifest is None:
            raise CorruptCheckpoint(f"{info.uri}: its manifest disappeared while loading")
        self._check_compatible(manifest, info.uri)
        self._scratch.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=self._scratch) as scratch:
            try:
                folder = self._fetch_verified(store, manifest, Path(scratch))
                error = ""
            except (CorruptCheckpoint, FileNotFoundError) as problem:
                folder, error = Path(scratch), str(problem)
            if not self._all_ranks_agree(not error):
                log.warning("refusing checkpoint %s: %s", info.uri,
                            error or "another rank found it corrupt")
                return False
            dcp.load(app_state, checkpoint_id=str(folder), process_group=self._group)
        return True

    def _fetch_verified(self, store: Storage, manifest: dict[str, Any], scratch: Path) -> Path:
        """A local folder holding the checkpoint's files, each checked against the manifest."""
        local = isinstance(store, LocalStorage)
        folder = store.root if isinstance(store, LocalStorage) else scratch
        for name, expected in manifest["files"].items():
            if not local:
                store.download_file(name, folder / name)
            digest = _file_digest(folder / name)
            if digest != expected:
                raise CorruptCheckpoint(
                    f"{store.uri}/{name} is {digest['bytes']} bytes with sha256 "
                    f"{digest['sha256'][:12]}..., but the manifest says {expected['bytes']} "
                    f"bytes with sha256 {expected['sha256'][:12]}...: truncated or modified"
                )
        return folder

    # Coordination runs on the checkpoint's gloo group: CPU objects work with any backend.

    def _barrier(self) -> None:
        if self._group is not None:
            dist.barrier(group=self._group)

    def _broadcast(self, value: Any) -> Any:
        if self._group is None:
            return value
        holder = [value]
        dist.broadcast_object_list(holder, src=0, group=self._group)
        return holder[0]

    def _all_ranks_agree(self, ok: bool) -> bool:
        if self._group is None:
            return ok
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self._group)
        return bool(flag.item())

    def _check_compatible(self, manifest: dict[str, Any], uri: str) -> None:
        saved = ModelDims(**manifest["model"])
        if saved != self.model_dims:
            different = ", ".join(
                f"{name}: {getattr(saved, name)} there, {getattr(self.model_dims, name)} here"
                for name in ModelDims.model_fields
                if getattr(saved, name) != getattr(self.model_dims, name)
            )
            raise IncompatibleCheckpoint(
                f"the checkpoint {uri} was made by a different model ({different}): "
                "spec.model must match the checkpoint's model to resume from it; use a new "
                "spec.checkpoint.uri to train this model from scratch"
            )


def _file_digest(path: Path) -> dict[str, Any]:
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(8 * 1024 * 1024):
            digest.update(chunk)
            size += len(chunk)
    return {"bytes": size, "sha256": digest.hexdigest()}


__all__ = [
    "CheckpointInfo", "Checkpointer", "CorruptCheckpoint", "IncompatibleCheckpoint",
    "ModelState", "RandomState", "committed_checkpoints", "latest_checkpoint", "step_folder",
]
