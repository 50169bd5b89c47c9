"""The streaming, resumable training data: token shards (from `kubetrain prepare`) to batches.

Use (what the training loop does):

    train, validation = build_datasets(job.spec, rank=rank, world_size=world)
    inputs, targets = next(train)        # int64 [micro_batch_size, seq_len], CPU views
    state = train.state_dict()           # {"position": ..., ...}: identical on every rank
    train.load_state_dict(state)         # continue exactly there, with any world size
    validation.rewind()                  # before each evaluation pass: the same batches
    train.close()                        # stop the prefetch threads

or `TokenDataset(uri, seq_len=..., micro_batch_size=..., rank=..., world_size=...)`.

The order of samples is defined once for the whole job, independent of the
number of ranks:
- a *sample* is `seq_len + 1` consecutive tokens of one shard, starting at a
  multiple of `seq_len` (so inputs and targets of neighbouring samples share one
  token and no token is wasted); the tail of a shard shorter than that is skipped;
- epoch `e` visits the shards in a permutation drawn from `(seed, e)` and the
  samples of each shard in a permutation drawn from `(seed, e, shard)`; with
  `shuffle=False` both are the identity;
- the *position* is the number of samples the whole job has consumed. Each call
  to `next()` is one micro-step of every rank together: rank `r` of `W` takes
  the samples at `position + r * B ... position + r * B + B - 1` and every rank
  advances the position by `W * B`.
So ranks never share a sample, and a job resumed from a checkpoint with another
world size continues at the same global sample: nothing is repeated or skipped.

Every rank streams the shards it needs, in order, from S3 or disk, while training
runs: `prefetch_shards` background threads download the shards after the current
one (verifying size and digest against the index), and one more shard is queued
behind them, so that a thread that finishes early starts the next download
instead of waiting for the reader to move on. At most `prefetch_shards + 2`
shards are held in memory and the dataset is never downloaded whole. Ranks read
the same shards (each keeps only its own samples): at 2-4 bytes per token that
costs a few MB/s per rank even for large global batches, and it is what keeps the
order independent of the world size. No DataLoader worker processes are needed:
building a batch is an index copy.

In a `torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=N)` (it is an
`IterableDataset`), worker `w` takes the micro-steps `w, w + N, w + 2N, ...` of its
rank, and the loader, which yields its workers' batches in turn, hands out exactly the
sequence the dataset gives without it. Each worker streams with its own storage
client and threads. Workers' positions do not flow back: after `n` batches from a
loader, `skip(n)` moves the dataset's position past them.
"""

from __future__ import annotations

import bisect
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view
from torch.utils.data import IterableDataset, get_worker_info

from kubetrain.trainer.prepare import INDEX_NAME, DatasetIndex, ShardInfo
from kubetrain.trainer.storage import Storage, open_storage

if TYPE_CHECKING:
    from kubetrain.api.trainingjob import StorageSpec, TrainingJobSpec


class CorruptShard(RuntimeError):
    """A shard whose bytes do not match its index entry (size or digest)."""


class _Run(NamedTuple):
    """The global positions `start .. end - 1` of one epoch, which all lie in one shard."""

    start: int
    end: int
    order: np.ndarray  # the shard's sample order: position p is sample order[p - start]
    rows: np.ndarray  # the shard's samples, as rows


class TokenDataset(IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
    """Batches of (inputs, targets) for one rank; an endless iterator over epochs."""

    def __init__(
        self,
        uri: str,
        *,
        seq_len: int,
        micro_batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        prefetch_shards: int = 2,
        storage: StorageSpec | None = None,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a world of {world_size}")
        self.uri = uri
        self.seq_len = seq_len
        self.micro_batch_size = micro_batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.shuffle = shuffle
        self.prefetch_shards = prefetch_shards
        self.storage = storage
        self._store: Storage = open_storage(uri, storage)
        self.index = DatasetIndex.load(self._store)
        self._samples = np.array(
            [max(0, (shard.tokens - 1) // seq_len) for shard in self.index.shards], dtype=np.int64
        )
        self.samples_per_epoch = int(self._samples.sum())
        if self.samples_per_epoch < world_size * micro_batch_size:
            raise ValueError(
                f"{uri} holds {self.samples_per_epoch} sequences of {seq_len + 1} tokens, fewer "
                f"than one micro-batch of all ranks ({world_size} x {micro_batch_size}): use "
                "more data or a smaller seqLen / microBatchSize"
            )
        self.position = 0
        self._stride = 1  # micro-steps per batch taken: N in one of N DataLoader workers
        self._epoch_cache: tuple[int, list[int], list[int]] | None = None
        self._sample_orders: dict[tuple[int, int], np.ndarray] = {}
        self._start_streaming()

    def _start_streaming(self) -> None:
        """Fresh prefetch threads and nothing held: in a new object or a new process."""
        self._downloads = ThreadPoolExecutor(max_workers=self.prefetch_shards,
                                             thread_name_prefix="shard-prefetch")
        self._shards: dict[int, Future[np.ndarray]] = {}  # shard -> its samples, as rows
        self._current_shard = -1
        self._run: _Run | None = None  # where the last batch came from

    def __getstate__(self) -> dict[str, Any]:
        """What a spawned DataLoader worker needs: no threads, clients or held shards."""
        state = self.__dict__.copy()
        for name in ("_store", "_downloads", "_shards", "_run"):
            del state[name]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._store = open_storage(self.uri, self.storage)
        self._start_streaming()

    # --- position ----------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        return self.position // self.samples_per_epoch

    @property
    def epochs_done(self) -> float:
        """Passes over the data so far, with the fraction of the current one."""
        return self.position / self.samples_per_epoch

    def state_dict(self) -> dict[str, Any]:
        """The global position and what it depends on; the same on every rank."""
        return {"position": self.position, "seq_len": self.seq_len, "seed": self.seed,
                "shuffle": self.shuffle, "samples_per_epoch": self.samples_per_epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position; refuses one that means other samples here."""
        for name in ("seq_len", "seed", "shuffle", "samples_per_epoch"):
            if name in state and state[name] != getattr(self, name):
                raise ValueError(
                    f"the data position was saved with {name}={state[name]}, but this run has "
                    f"{name}={getattr(self, name)} ({self.uri}): resuming would not continue "
                    "the same sample order; keep the data, seqLen and seed of the checkpoint"
                )
        self.position = int(state["position"])
        self._current_shard, self._run = -1, None  # re-plan the prefetch from the new position

    def rewind(self) -> None:
        """Back to the first sample: evaluation passes see the same batches each time."""
        self.position = 0
        self._current_shard, self._run = -1, None

    # --- iteration ---------------------------------------------------------------------

    def __iter__(self) -> TokenDataset:
        worker = get_worker_info()
        if worker is not None and self._stride == 1:
            # This is worker `id`'s own copy (forked or unpickled): start at its first
            # micro-step, step over the others', and stream with this process's client.
            self._stride = worker.num_workers
            self.skip(worker.id)
            self._store = open_storage(self.uri, self.storage)
            self._start_streaming()
        return self

    def skip(self, micro_steps: int) -> None:
        """Move the position past `micro_steps` micro-steps of every rank."""
        self.position += micro_steps * self.world_size * self.micro_batch_size
        self._current_shard, self._run = -1, None

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        # Called once per micro-step: kept to a few numpy calls (torch slicing costs more).
        first = self.position + self.rank * self.micro_batch_size
        rows = np.empty((self.micro_batch_size, self.seq_len + 1), dtype=np.int64)
        row = 0
        while row < self.micro_batch_size:
            # The rows that come from one shard are gathered (and widened) in one copy.
            run = self._run_at(first + row)
            offset = first + row - run.start
            samples = run.order[offset:offset + self.micro_batch_size - row]
            rows[row:row + len(samples)] = run.rows[samples]
            row += len(samples)
        self.position += self._stride * self.world_size * self.micro_batch_size
        return torch.from_numpy(rows[:, :-1]), torch.from_numpy(rows[:, 1:])

    def _run_at(self, position: int) -> _Run:
        """The run of positions in one shard that holds `position` (usually the last one)."""
        run = self._run
        if run is None or not run.start <= position < run.end:
            self._run = run = None  # let go of a finished shard before waiting for the next
            epoch, shard, local, left = self._locate(position)
            run = self._run = _Run(position - local, position + left,
                                   self._sample_order(epoch, shard), self._shard(shard, position))
        return run

    def sample_ids(self, position: int) -> tuple[int, int]:
        """(shard, sample within the shard) of the sample at a global position."""
        epoch, shard, local, _ = self._locate(position)
        return shard, int(self._sample_order(epoch, shard)[local])

    def _locate(self, position: int) -> tuple[int, int, int, int]:
        """(epoch, shard, slot in the shard's sample order, samples left in the shard)."""
        epoch, offset = divmod(position, self.samples_per_epoch)
        order, ends = self._epoch(epoch)
        slot = bisect.bisect_right(ends, offset)
        local = offset - (ends[slot - 1] if slot else 0)
        return epoch, order[slot], local, ends[slot] - offset

    def _epoch(self, epoch: int) -> tuple[list[int], list[int]]:
        """The shard order of an epoch and the cumulative sample counts along it."""
        if self._epoch_cache is None or self._epoch_cache[0] != epoch:
            order = self._shard_order(epoch)
            # Python lists: bisect on them is far cheaper per sample than numpy calls.
            self._epoch_cache = (epoch, order.tolist(),
                                 np.cumsum(self._samples[order]).tolist())
            self._sample_orders.clear()
        return self._epoch_cache[1], self._epoch_cache[2]

    def _shard_order(self, epoch: int) -> np.ndarray:
        count = len(self.index.shards)
        return (np.random.default_rng([self.seed, epoch]).permutation(count)
                if self.shuffle else np.arange(count))

    def _sample_order(self, epoch: int, shard: int) -> np.ndarray:
        if (epoch, shard) not in self._sample_orders:
            count = int(self._samples[shard])
            self._sample_orders[(epoch, shard)] = (
                np.random.default_rng([self.seed, epoch, shard]).permutation(count)
                if self.shuffle else np.arange(count)
            )
        return self._sample_orders[(epoch, shard)]

    # --- shards and prefetch -------------------------------------------------------------

    def _upcoming_shards(self, position: int) -> list[int]:
        """The shard holding `position` and the next `prefetch_shards + 1` in visiting order."""
        epoch, offset = divmod(position, self.samples_per_epoch)
        order, ends = self._epoch(epoch)
        slot = bisect.bisect_right(ends, offset)
        # One more than there are threads: a thread done early finds the next one queued.
        wanted = min(self.prefetch_shards + 2, int(np.count_nonzero(self._samples)))
        upcoming: list[int] = []
        while len(upcoming) < wanted:
            if slot == len(order):
                # Peek at the next epoch's order without disturbing the current one's cache.
                epoch, slot = epoch + 1, 0
                order = self._shard_order(epoch).tolist()
            shard = order[slot]
            if self._samples[shard] and shard not in upcoming:
                upcoming.append(shard)
            slot += 1
        return upcoming

    def _shard(self, shard: int, position: int) -> np.ndarray:
        """The samples of `shard` as rows of `seq_len + 1` tokens, downloaded ahead."""
        if shard != self._current_shard:
            # Entering a shard: hold it and the next ones, drop the ones behind.
            self._current_shard = shard
            upcoming = self._upcoming_shards(position)
            for behind in [held for held in self._shards if held not in upcoming]:
                del self._shards[behind]
            for ahead in upcoming:
                if ahead not in self._shards:
                    self._shards[ahead] = self._downloads.submit(
                        self._download, self.index.shards[ahead]
                    )
        return self._shards[shard].result()

    def _download(self, shard: ShardInfo) -> np.ndarray:
        data = self._store.read_unchecked(shard.name)
        if not shard.matches(data):
            raise CorruptShard(
                f"{self._store.uri}/{shard.name} does not match {INDEX_NAME} "
                f"({len(data)} bytes, expected {shard.bytes} with digest {shard.digest}): "
                "the shard was truncated or modified; run `kubetrain prepare` again"
            )
        tokens = np.frombuffer(data, dtype=self.index.dtype)
        # Sample i is tokens[i * seq_len : (i + 1) * seq_len + 1]: a strided view, no copy,
        # so a batch is one row gather.
        return sliding_window_view(tokens, self.seq_len + 1)[::self.seq_len]

    def close(self) -> None:
        """Stop the prefetch threads (after the downloads in flight) and drop held shards."""
        # Waiting keeps a download from outliving the dataset and its storage (at most
        # `prefetch_shards` of them, already under way).
        self._downloads.shutdown(wait=True, cancel_futures=True)
        self._shards.clear()
        self._current_shard, self._run = -1, None

    def __repr__(self) -> str:
        return (f"TokenDataset({self.uri!r}, rank {self.rank}/{self.world_size}, "
                f"position {self.position}, epoch {self.epoch})")


def build_datasets(
    spec: TrainingJobSpec, *, rank: int, world_size: int, micro_batch_size: int | None = None
) -> tuple[TokenDataset, TokenDataset | None]:
    """The training dataset of this rank and, if there is one, the validation dataset.

    Validation comes from `spec.data.validation`, else from the `validation` split
    that `kubetrain prepare` wrote beside the training split; it is not shuffled. With
    evaluation off (`evaluation.everySteps: 0`) none is opened, so a validation split
    smaller than one micro-batch of every rank cannot fail a job that never reads it.
    `micro_batch_size` overrides the spec's (an out-of-memory restart's smaller one): the
    position counts samples, so a step covers the same global samples at any split.
    """
    data, opt = spec.data, spec.optimization
    micro = micro_batch_size or opt.micro_batch_size
    train = TokenDataset(
        data.train, seq_len=data.seq_len, micro_batch_size=micro, rank=rank,
        world_size=world_size, seed=opt.seed, shuffle=data.shuffle,
        prefetch_shards=data.prefetch_shards, storage=spec.storage,
    )
    validation_uri = data.validation or _validation_beside(data.train, spec.storage)
    if validation_uri is None or not spec.evaluation.every_steps:
        return train, None
    validation = TokenDataset(
        validation_uri, seq_len=data.seq_len, micro_batch_size=micro, rank=rank,
        world_size=world_size, seed=opt.seed, shuffle=False, prefetch_shards=1,
        storage=spec.storage,
    )
    return train, validation


def _validation_beside(train_uri: str, storage: StorageSpec | None) -> str | None:
    parent, _, name = train_uri.rstrip("/").rpartition("/")
    if name != "train" or not parent:
        return None
    candidate = f"{parent}/validation"
    return candidate if open_storage(candidate, storage).exists(INDEX_NAME) else None
