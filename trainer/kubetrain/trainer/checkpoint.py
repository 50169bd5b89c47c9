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
is staged: `dcp.async_save` through the staging both tiers share (staging.py,
`StateDictStaging`), into one host buffer kept from save to save. On the CPU the copy
is done on return; on a GPU it runs beside the next step's forward and backward, and
the next optimizer step waits for it (the loop's `Staging.before_update`). Uploading
and committing run in background threads over a separate gloo group, once the copy has
landed, so training continues. The next `save`, `wait()` and `close()` wait for it and
re-raise its error.
Otherwise `save` returns after the commit, and only the `keepLast` rotation
(deleting older checkpoints) runs on in the background, waited for the same way; a
rotation that fails is logged and never raised, so a clean-up never stops training.

Layout under `spec.checkpoint.uri` (s3://bucket/prefix, file:///path or a path):

    step-00000500/__0_0.distcp ...   one DCP file per rank, plus DCP's .metadata
    step-00000500/checkpoint.json    the manifest: step, time, world size, every
                                     file's size and the digest (BLAKE3) of each of
                                     its 1 MiB chunks, the model dimensions and the
                                     job spec that produced it; with keepBest, the
                                     validation loss at its step and the best
                                     checkpoint so far (kept out of rotation)

A checkpoint is *committed* when its manifest exists: rank 0 writes it last,
after every rank has uploaded its file and reported its size and hashes.
Readers (`latest_checkpoint`, `load_latest`) ignore folders without one.
A checkpoint whose model dimensions differ from the job's is refused with
`IncompatibleCheckpoint`. `keepLast` rotation deletes the oldest committed
checkpoints (manifest first, so a half-deleted one is never "committed") and the
debris of interrupted saves; it never touches the newest.

Loading reads only what each rank needs. DCP's load plan says which stored items
(a rank's saved shard of a tensor, or a pickled value) this rank must read, and
where each lies (file, offset, length); `_StorageReader` fetches exactly the
chunks covering those ranges (S3 ranged GETs, local seeks; several in flight,
a bounded window held in memory), so with FSDP at an unchanged world size a rank
reads its own file plus the head chunk of other ranks' files (where the small
replicated entries are packed, see `_StreamingWriter`), not the whole checkpoint.
Integrity without whole-file reads: a whole-file hash can only be checked by
reading the whole file, so the manifest records the digest of every 1 MiB chunk
of every file instead (computed from the very bytes uploaded, while streaming).
Before loading, rank 0 checks every file's size against a listing of the folder
(a truncated or missing file), and every rank fetches and verifies `.metadata`.
Every chunk a rank fetches is verified before any byte of it is used; a
mismatch raises `CorruptCheckpoint` inside DCP's read step, which DCP reports to
every rank, so all ranks refuse the checkpoint together and the next older
committed one is loaded instead. Bytes nobody reads cannot reach the model, so
they need no check. A refused load may already have copied verified tensors
into the model; loading the older checkpoint overwrites every one of them, and
when no intact checkpoint is left the job fails rather than train on them.

How files get to S3: DCP's own FileSystemWriter (one file per rank) writes through
a small file-system adapter onto the storage layer, so each rank's file streams
straight into its object as DCP serialises it - a multipart upload with several
parts in flight, retried per request - and its digests are computed from the very
bytes sent. Serialisation and upload overlap, and no local disk is needed (pods
often have little ephemeral storage). The alternative, writing DCP to a local
staging folder and uploading afterwards, costs a full extra write and read of
the checkpoint and adds their time to every save.

When the job has no committed checkpoint, `spec.checkpoint.resumeFrom` (another
job's checkpoint URI, or one checkpoint folder) is loaded instead.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import io
import json
import logging
import math
import os
import pickle
import re
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.futures
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemBase
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
)
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.checkpoint.storage import WriteResult

from kubetrain.api.trainingjob import ModelDims, StorageSpec, TrainingJobSpec, step_folder
from kubetrain.trainer.distributed import all_ranks_agree, broadcast_from_rank0
from kubetrain.trainer.staging import Staging, StateDictStaging
from kubetrain.trainer.storage import (
    DIGEST,
    HASH_CHUNK,
    PART_SIZE,
    TRANSFER_CONCURRENCY,
    Storage,
    chunk_digests,
    open_storage,
)

log = logging.getLogger(__name__)

MANIFEST_NAME = "checkpoint.json"
# v3: a digest per HASH_CHUNK (1 MiB) chunk of every file, its algorithm named. v2 (sha256
# chunk digests) is still read; v1 (one sha256 per file) cannot be verified range by range.
MANIFEST_FORMAT = "kubetrain-checkpoint-v3"
_MANIFEST_V2 = "kubetrain-checkpoint-v2"
METADATA_NAME = ".metadata"  # DCP's own index of the stored items
_STEP_FOLDER = re.compile(r"^step-(\d+)$")


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
    val_loss: float | None = None  # of the evaluation at its step, when it had one
    best: bool = False  # the best checkpoint kept out of rotation (keepBest), as of its commit


@dataclass(frozen=True)
class BestCheckpoint:
    """The checkpoint with the lowest validation loss so far (checkpoint.keepBest)."""

    step: int
    val_loss: float
    uri: str


# --- Stateful wrappers -----------------------------------------------------------------


# Options of torch's optimizers that choose how a step is computed, not what it computes.
_KERNEL_OPTIONS = ("fused", "foreach")


class ModelState(Stateful):
    """Model and optimizer as DCP state: DTensor shards under FSDP2, so loads reshard."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optimizer": optimizer_state}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # The param groups come back with the saving process's options, the optimizer's
        # kernel among them; which kernel runs is this process's choice (its device, its
        # grad scaler: optim.build_optimizer), and a grad scaler that disagrees with the
        # kernel fails the step (it hands a fused optimizer its scale to apply).
        kernel = {key: self.optimizer.defaults[key] for key in _KERNEL_OPTIONS
                  if key in self.optimizer.defaults}
        set_state_dict(self.model, self.optimizer, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optimizer"])
        for group in self.optimizer.param_groups:
            group.update(kernel)


class ModelWeights(Stateful):
    """Only the model's entries of a checkpoint (DCP reads just the keys asked for)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return {"model": get_model_state_dict(self.model)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state_dict["model"])


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
    if manifest.get("format") == _MANIFEST_V2:
        # The same record with sha256 digests under another name: read as v3.
        manifest["digest"] = "sha256"
        for entry in manifest["files"].values():
            entry["chunks"] = entry.pop("chunk_sha256")
    elif manifest.get("format") != MANIFEST_FORMAT:
        log.warning("ignoring the checkpoint %s/%s: its format is %r, this version reads %r",
                    store.uri, key, manifest.get("format"), MANIFEST_FORMAT)
        return None
    return manifest


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
    and its size and chunk hashes are recorded in `files` for the manifest. DCP writes its
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
        self.files[name] = {"bytes": upload.tell(), "chunks": upload.chunk_digests()}

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        data = self._held.pop(str(path))
        self.store.write_bytes(str(new_path), data)
        self.files[str(new_path)] = {"bytes": len(data), "chunks": chunk_digests(data)}

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
    """DCP's FileSystemWriter (one file per rank) writing through `_StorageFileSystem`.

    Each file holds its small entries first (pickled values, then tensors by size):
    the replicated ones that DCP spreads over the ranks' files (optimizer step
    counters, ...) are needed by every loading rank, and packed at the head of a file
    they cost another rank one verification chunk of it rather than one per entry.
    """

    def __init__(self, store: Storage) -> None:
        # sync_files: durability comes from the storage's commit (atomic rename, multipart
        # completion), not from fsync.
        super().__init__("", single_file_per_rank=True, sync_files=False)
        self._storage_fs = _StorageFileSystem(store)
        self.fs = self._storage_fs  # type: ignore[assignment]  # DCP types it as FileSystem
        self.path = self._storage_fs.init_path("")

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> torch.futures.Future[
            list[WriteResult]]:
        small_first = sorted(plan.items, key=_stored_size)
        return super().write_data(dataclasses.replace(plan, items=small_first), planner)

    @property
    def files(self) -> dict[str, dict[str, Any]]:
        """Name → {bytes, chunks (their `DIGEST`s)} of the files this rank wrote."""
        return self._storage_fs.files


def _stored_size(item: WriteItem) -> int:
    """The bytes of a tensor entry; 0 for a pickled value (written before the tensors)."""
    if item.tensor_data is None:
        return 0
    return math.prod(item.tensor_data.size) * item.tensor_data.properties.dtype.itemsize


# --- reading only the ranges a rank needs ---------------------------------------------


class _VerifiedFile:
    """Ranges of one committed checkpoint file, fetched in whole verified chunks.

    `fetch_ahead(ranges)` plans the chunk-aligned pieces (at most `PART_SIZE` each)
    covering the ranges a rank will read, in offset order, and fetches them in
    parallel, at most `TRANSFER_CONCURRENCY` pieces ahead of the reader; `read`
    returns the bytes of one range and releases the pieces behind it.
    """

    def __init__(self, store: Storage, name: str, manifest: dict[str, Any],
                 pool: ThreadPoolExecutor) -> None:
        self.store, self.name, self.pool = store, name, pool
        entry = manifest["files"][name]
        self.size, self.chunk = int(entry["bytes"]), HASH_CHUNK
        self.algorithm: str = manifest["digest"]
        self.digests: list[str] = entry["chunks"]
        self.bytes_read = 0
        self._pieces: list[tuple[int, int]] = []
        self._starts: list[int] = []
        self._fetched: dict[int, Future[bytes]] = {}
        self._submitted = 0

    def fetch_ahead(self, ranges: list[tuple[int, int]]) -> None:
        """Plan the pieces covering `ranges` ((offset, length), any order) and start them."""
        chunks = sorted({index for offset, length in ranges
                         for index in range(offset // self.chunk,
                                            (offset + length - 1) // self.chunk + 1)})
        per_piece = PART_SIZE // self.chunk
        run: list[int] = []
        for index in [*chunks, None]:
            if run and (index != run[-1] + 1 or len(run) == per_piece):
                self._pieces.append((run[0] * self.chunk,
                                     min((run[-1] + 1) * self.chunk, self.size)))
                run = []
            if index is not None:
                run.append(index)
        self._starts = [start for start, _ in self._pieces]
        self._submit_until(TRANSFER_CONCURRENCY)

    def read(self, offset: int, length: int) -> bytes:
        """The verified bytes `offset .. offset + length` (inside the planned ranges)."""
        first = bisect.bisect_right(self._starts, offset) - 1
        last = bisect.bisect_right(self._starts, offset + length - 1) - 1
        self._submit_until(last + 1 + TRANSFER_CONCURRENCY)
        parts = []
        for number in range(first, last + 1):
            start, _ = self._pieces[number]
            data = self._fetched[number].result()
            parts.append(memoryview(data)[max(0, offset - start):offset + length - start])
        for behind in [number for number in self._fetched if number < first]:
            del self._fetched[behind]
        return b"".join(parts)

    def _submit_until(self, count: int) -> None:
        while self._submitted < min(count, len(self._pieces)):
            self._fetched[self._submitted] = self.pool.submit(self._fetch,
                                                              *self._pieces[self._submitted])
            self._submitted += 1

    def _fetch(self, start: int, end: int) -> bytes:
        data = self.store.read_range(self.name, start, end - start)
        self.bytes_read += len(data)
        first = start // self.chunk
        got = chunk_digests(data, self.algorithm)
        if len(data) != end - start or got != self.digests[first:first + len(got)]:
            raise CorruptCheckpoint(
                f"{self.store.uri}/{self.name}: bytes {start}..{end} do not match the digests "
                "the manifest records for them: truncated or modified"
            )
        return data


class _StorageReader(dcp.StorageReader):
    """DCP's reader over one committed checkpoint folder, reading only the planned ranges.

    The same item layout as DCP's FileSystemReader (`_StorageInfo`: file, offset,
    length; a tensor is a `torch.save` record, a value pickled bytes), read through
    `_VerifiedFile`. `metadata` is DCP's `.metadata`, already read and verified.
    """

    def __init__(self, store: Storage, manifest: dict[str, Any], metadata: Metadata) -> None:
        super().__init__()
        self.store, self.manifest, self.metadata = store, manifest, metadata
        self.bytes_read = 0

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Nothing to reset: one reader serves one load."""

    def read_metadata(self) -> Metadata:
        return self.metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool) -> None:
        """The metadata is the one passed in; nothing else to set up."""

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future[None]:
        where = self.metadata.storage_data
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(where[item.storage_index].relative_path, []).append(item)
        with ThreadPoolExecutor(TRANSFER_CONCURRENCY, thread_name_prefix="ckpt-read") as pool:
            for name, items in per_file.items():
                items.sort(key=lambda item: where[item.storage_index].offset)
                source = _VerifiedFile(self.store, name, self.manifest, pool)
                source.fetch_ahead([(where[item.storage_index].offset,
                                     where[item.storage_index].length) for item in items])
                for item in items:
                    info = where[item.storage_index]
                    if info.transform_descriptors:
                        raise CorruptCheckpoint(f"{self.store.uri}/{name} was written with "
                                                f"DCP extensions {info.transform_descriptors}")
                    self._load_item(item, source.read(info.offset, info.length), planner)
                self.bytes_read += source.bytes_read
        done: torch.futures.Future[None] = torch.futures.Future()
        done.set_result(None)
        return done

    @staticmethod
    def _load_item(item: ReadItem, data: bytes, planner: LoadPlanner) -> None:
        if item.type == LoadItemType.BYTE_IO:
            planner.load_bytes(item, io.BytesIO(data))
            return
        saved = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        saved = narrow_tensor_by_index(saved, item.storage_offsets, item.lengths)
        target = planner.resolve_tensor(item).detach()
        if target.size() != saved.size():
            raise CorruptCheckpoint(f"{item.storage_index}: stored as {tuple(saved.size())}, "
                                    f"expected {tuple(target.size())}")
        target.copy_(saved)
        planner.commit_tensor(item, target)


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
        on_commit: Callable[[CheckpointInfo], None] | None = None,
        optional_state: frozenset[str] = frozenset(),
        staging: Staging | None = None,
    ) -> None:
        """`model_dims` defaults to `spec.model.resolve()`; pass the dims actually built
        (e.g. with the tokenizer's vocabulary). `on_commit` runs on rank 0 after each
        commit (in the background thread for async saves). `optional_state` names the
        app_state entries that checkpoints of older kubetrain versions lack: loading such
        a checkpoint leaves them as they are instead of refusing it. `staging` is where
        asynchronous saves stage (the attempt's, shared with the in-memory tier; default:
        in place, on the caller's thread)."""
        self.spec = spec
        self.rank = rank
        self.world_size = world_size
        self.model_dims = model_dims or spec.model.resolve()
        self.store = open_storage(spec.checkpoint.uri, spec.storage)
        self.on_commit = on_commit
        self.optional_state = optional_state
        # Async saves run their collectives in a background thread: on a group of their
        # own, so they never interleave with the training loop's collectives.
        self._group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        self._finisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")
        self._staging = staging or Staging(torch.device("cpu"))
        self._stager = StateDictStaging(self._staging.area("S3 checkpoints"))
        self._in_flight: Future[None] | None = None
        # Marks where `save` waits on the other ranks (the loop sets its `WaitClock.inside`):
        # a rank signalled while blocked there on a peer that is gone gives up within its
        # stop deadline (distributed.StopRequest), as it does in a step's collectives.
        self.waiting_on_peers: Callable[[], contextlib.AbstractContextManager[None]] = (
            contextlib.nullcontext)
        self.last_step: int | None = None
        self.latest: CheckpointInfo | None = None
        # The same on every rank: validation losses are reduced over the group.
        self.best: BestCheckpoint | None = None

    @property
    def staging_path(self) -> str | None:
        """How the first asynchronous save was staged on a GPU ("device-side first phase"
        or "overlapped host copy"); None in place (the CPU) or before the first."""
        return self._stager.area.path

    # --- saving ---------------------------------------------------------------------

    def improves_best(self, val_loss: float) -> bool:
        """Whether a checkpoint with `val_loss` would become the best one (keepBest only)."""
        return self.spec.checkpoint.keep_best and (
            self.best is None or val_loss < self.best.val_loss)

    def save(self, step: int, app_state: dict[str, Any], *, blocking: bool = True,
             val_loss: float | None = None) -> None:
        """Save `app_state` as the checkpoint of `step` (collective).

        Non-blocking only when `spec.checkpoint.async` is set; a step that was
        already saved or loaded is skipped. `val_loss` is the validation loss of
        an evaluation at this step: with keepBest, the lowest one's checkpoint is kept.
        """
        with self.waiting_on_peers():  # the last save's commit gathers from every rank
            self.wait()
        if step == self.last_step:
            return
        self.last_step = step
        folder = self.store.join(step_folder(step))
        if val_loss is not None and self.improves_best(val_loss):
            self.best = BestCheckpoint(step, val_loss, folder.uri)
        best = self.best
        if self.rank == 0:
            # Debris of an interrupted save of this step must not mix with the new files.
            folder.delete([obj.key for obj in folder.list()])
        with self.waiting_on_peers():
            self._barrier()
        writer = _StreamingWriter(folder)
        # DCP plans and finishes a save with collectives on every rank, and the commit
        # gathers every rank's files: a rank blocked there on a lost peer gives up as in a
        # step's collectives (StopRequest) once signalled. Its writes count as inside too,
        # so a save longer than the stop deadline is given up if a signal comes meanwhile.
        if blocking or not self.spec.checkpoint.async_:
            with self.waiting_on_peers():
                dcp.save(app_state, storage_writer=writer, process_group=self._group)
                self._commit(step, writer.files, val_loss, best)
            if self.rank == 0:  # deleting old checkpoints need not hold training up
                self._in_flight = self._finisher.submit(self._rotate, best)
        else:
            # The staged state is in host memory already: no copying ahead from a device,
            # as DCP's writer does when it stages itself (FileSystemWriter.stage).
            writer.per_thread_copy_ahead = 0
            with self.waiting_on_peers():
                written = dcp.async_save(app_state, storage_writer=writer,
                                         process_group=self._group, async_stager=self._stager)
            if isinstance(written, AsyncSaveResponse):  # our stager's: a future of staging
                written = written.upload_completion
            self._in_flight = self._finisher.submit(self._commit_after, written, step, writer,
                                                    val_loss, best)

    def _commit_after(self, written: Future[Any], step: int, writer: _StreamingWriter,
                      val_loss: float | None, best: BestCheckpoint | None) -> None:
        written.result()
        self._commit(step, writer.files, val_loss, best)
        if self.rank == 0:
            self._rotate(best)

    def _commit(self, step: int, files: dict[str, dict[str, Any]], val_loss: float | None,
                best: BestCheckpoint | None) -> None:
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
            "digest": DIGEST,
            "files": {name: entry for rank_files in every for name, entry in rank_files.items()},
            "model": self.model_dims.model_dump(),
            "config": self.spec.wire(),
        }
        if val_loss is not None:
            manifest["val_loss"] = val_loss
        if best is not None:  # so that a resumed job keeps it out of rotation too
            manifest["best"] = {"step": best.step, "val_loss": best.val_loss}
        self.store.write_bytes(f"{folder}/{MANIFEST_NAME}",
                               json.dumps(manifest, indent=1).encode())
        self.latest = dataclasses.replace(_info(self.store, folder, manifest), val_loss=val_loss,
                                          best=best is not None and best.step == step)
        if self.on_commit is not None:
            self.on_commit(self.latest)

    def _rotate(self, best: BestCheckpoint | None = None) -> None:
        """Keep the newest `keepLast` committed checkpoints and `best`; delete older folders.

        Older folders are older committed checkpoints and interrupted saves; folders
        newer than the newest commit are left alone. One listing and two batched
        deletes, whatever the number of checkpoints: it runs on every commit. A failure
        is logged, never raised: the checkpoint is committed, a clean-up must not stop
        training, and the next commit's rotation deletes what this one left.
        """
        try:
            self._delete_rotated(best)
        except Exception:
            log.warning("rotating the checkpoints under %s failed; training goes on, and the "
                        "next checkpoint's rotation retries", self.store.uri, exc_info=True)

    def _delete_rotated(self, best: BestCheckpoint | None) -> None:
        folders: dict[int, list[str]] = {}
        for obj in self.store.list():
            match = _STEP_FOLDER.match(obj.key.partition("/")[0])
            if match:
                folders.setdefault(int(match.group(1)), []).append(obj.key)
        committed = sorted((step for step, keys in folders.items()
                            if f"{step_folder(step)}/{MANIFEST_NAME}" in keys), reverse=True)
        if not committed:  # gone since the commit (deleted by hand, expired): nothing is older
            return
        kept = set(committed[:self.spec.checkpoint.keep_last])
        if best is not None:
            kept.add(best.step)
        doomed = [key for step, keys in folders.items()
                  if step < committed[0] and step not in kept for key in keys]
        manifests = [key for key in doomed if key.endswith(f"/{MANIFEST_NAME}")]
        self.store.delete(manifests)  # de-commit first
        self.store.delete([key for key in doomed if key not in set(manifests)])

    def wait(self) -> None:
        """Block until a background save has committed (and a rotation ended); re-raise the
        save's error."""
        self._stager.land()
        if self._in_flight is not None:
            in_flight, self._in_flight = self._in_flight, None
            in_flight.result()

    def close(self) -> None:
        """Wait for a save in flight and stop the background thread."""
        try:
            self.wait()
        finally:
            self._finisher.shutdown(wait=True)
            self._stager.close()

    # --- loading --------------------------------------------------------------------

    def load_latest(self, app_state: dict[str, Any]) -> int | None:
        """Load the newest intact committed checkpoint of this job (or of `resumeFrom`).

        Returns its step, or None when there is nothing to resume from. Collective.
        """
        sources = [self.spec.checkpoint.uri]
        if self.spec.checkpoint.resume_from:
            sources.append(self.spec.checkpoint.resume_from)
        for uri in sources:
            candidates = broadcast_from_rank0(
                self._candidates(uri) if self.rank == 0 else None, self._group)
            for info in candidates:
                manifest = self._load(info.uri, app_state)
                if manifest is not None:
                    self.last_step = info.step
                    own = uri == self.spec.checkpoint.uri
                    self.latest = info if own else None
                    if own and "best" in manifest:
                        best = manifest["best"]
                        self.best = BestCheckpoint(int(best["step"]), float(best["val_loss"]),
                                                   self.store.join(step_folder(best["step"])).uri)
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

    def load_best(self, app_state: dict[str, Any]) -> int | None:
        """Load the best checkpoint (keepBest) into `app_state`, e.g. {"model": ModelWeights};
        its step, or None when there is none. Collective."""
        if self.best is None:
            return None
        if self._load(self.best.uri, app_state) is None:
            raise CorruptCheckpoint(f"the best checkpoint {self.best.uri} failed verification "
                                    "(see the warnings above)")
        return self.best.step

    def _load(self, uri: str, app_state: dict[str, Any]) -> dict[str, Any] | None:
        """Verify and load one checkpoint: its manifest, or None (on every rank) when it is
        corrupt."""
        self._staging.before_update()  # a load writes what a snapshot in flight reads
        store = open_storage(uri, self.spec.storage)
        manifest = _read_manifest(store, "")
        if manifest is None:
            raise CorruptCheckpoint(f"{uri}: its manifest disappeared while loading")
        self._check_compatible(manifest, uri)
        try:
            if self.rank == 0:
                _check_sizes(store, manifest)
            metadata = _read_metadata(store, manifest)
            error = ""
        except (CorruptCheckpoint, FileNotFoundError) as problem:
            error = str(problem)
        if not all_ranks_agree(not error, self._group):
            log.warning("refusing checkpoint %s: %s", uri,
                        error or "another rank found it corrupt")
            return None
        reader = _StorageReader(store, manifest, metadata)
        saved = {key.partition(".")[0] for key in metadata.state_dict_metadata}
        absent = sorted(key for key in self.optional_state & app_state.keys() if key not in saved)
        if absent:
            log.info("%s holds no %s (an older kubetrain wrote it): left as they are",
                     uri, ", ".join(absent))
        state = {key: value for key, value in app_state.items() if key not in absent}
        try:
            dcp.load(state, storage_reader=reader, process_group=self._group)
        except CheckpointException as failed:
            # DCP gathers every rank's read errors: all ranks see the same failures here.
            problems = [error for error, _ in failed.failures.values()]
            if not all(isinstance(error, CorruptCheckpoint | FileNotFoundError)
                       for error in problems):
                raise
            log.warning("refusing checkpoint %s: %s", uri,
                        "; ".join(str(error) for error in problems))
            return None
        total = sum(int(entry["bytes"]) for entry in manifest["files"].values())
        log.info("rank %d loaded %s, reading %d of its %d bytes", self.rank, uri,
                 reader.bytes_read, total)
        return manifest

    # Coordination runs on the checkpoint's gloo group: CPU objects work with any backend.

    def _barrier(self) -> None:
        if self._group is not None:
            dist.barrier(group=self._group)


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
        # The architecture (and INL dynamics) change the parameters without changing a
        # dimension: said apart here, before the state dict's missing or unexpected keys
        # would say it less plainly. Checkpoints from before model.architecture are
        # transformers'.
        saved_model = manifest.get("config", {}).get("model", {})
        saved_architecture = saved_model.get("architecture", "transformer")
        if saved_architecture != self.spec.model.architecture:
            raise IncompatibleCheckpoint(
                f"the checkpoint {uri} was made by a model with architecture "
                f"{saved_architecture} (spec.model.architecture), here it is "
                f"{self.spec.model.architecture}: set spec.model.architecture: "
                f"{saved_architecture} to resume from it, or use a new spec.checkpoint.uri "
                "to train this model from scratch"
            )
        saved_on = bool(saved_model.get("dynamics", {}).get("enabled", False))
        if saved_on != self.spec.model.dynamics.enabled:
            state = {True: "on", False: "off"}
            raise IncompatibleCheckpoint(
                f"the checkpoint {uri} was made by a model with INL dynamics "
                f"{state[saved_on]} (spec.model.dynamics.enabled), here they are "
                f"{state[not saved_on]}: set spec.model.dynamics.enabled: "
                f"{str(saved_on).lower()} to resume from it, or use a new "
                "spec.checkpoint.uri to train this model from scratch"
            )


def _check_sizes(store: Storage, manifest: dict[str, Any]) -> None:
    """Every file of the manifest exists with its recorded size (one listing)."""
    sizes = {obj.key: obj.size for obj in store.list()}
    for name, expected in manifest["files"].items():
        if sizes.get(name) != expected["bytes"]:
            found = "missing" if name not in sizes else f"{sizes[name]} bytes"
            raise CorruptCheckpoint(f"{store.uri}/{name} is {found}, but the manifest says "
                                    f"{expected['bytes']} bytes: truncated or modified")


def _read_metadata(store: Storage, manifest: dict[str, Any]) -> Metadata:
    """DCP's `.metadata`, verified against the manifest."""
    data = store.read_bytes(METADATA_NAME)
    if chunk_digests(data, manifest["digest"]) != manifest["files"][METADATA_NAME]["chunks"]:
        raise CorruptCheckpoint(f"{store.uri}/{METADATA_NAME} does not match the digests the "
                                "manifest records for it: truncated or modified")
    return cast(Metadata, pickle.loads(data))


__all__ = [
    "BestCheckpoint", "CheckpointInfo", "Checkpointer", "CorruptCheckpoint",
    "IncompatibleCheckpoint", "ModelState", "ModelWeights", "RandomState",
    "committed_checkpoints", "latest_checkpoint", "step_folder",
]
