"""The streaming dataset: one global sample order, split over ranks, resumable at any size."""

from __future__ import annotations

import gc
import hashlib
import itertools
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from kubetrain.api.manifest import parse_job
from kubetrain.api.trainingjob import StorageSpec
from kubetrain.trainer.data import CorruptShard, TokenDataset, build_datasets
from kubetrain.trainer.prepare import INDEX_NAME, DatasetIndex, PreparedDataset
from kubetrain.trainer.storage import open_storage

SEQ, BATCH = 32, 2


def _datasets(uri: str, world: int, **options: object) -> list[TokenDataset]:
    return [TokenDataset(uri, seq_len=SEQ, micro_batch_size=BATCH, rank=rank, world_size=world,
                         seed=7, **options) for rank in range(world)]  # type: ignore[arg-type]


def _run(datasets: list[TokenDataset], micro_steps: int) -> list[np.ndarray]:
    """The rows every rank sees, in global order (rank 0's batch, rank 1's, ...)."""
    rows = []
    for _ in range(micro_steps):
        for dataset in datasets:
            inputs, targets = next(dataset)
            assert inputs.dtype == targets.dtype and str(inputs.dtype) == "torch.int64"
            assert inputs.shape == targets.shape == (BATCH, SEQ)
            assert (inputs[:, 1:] == targets[:, :-1]).all()
            rows.extend(torch.cat([inputs[:, :1], targets], dim=1).numpy())
    return rows


def _copy_of_split(prepared: PreparedDataset, tmp_path: Path) -> Path:
    """A copy of the training split that a test may damage."""
    source = Path(prepared.train_uri.removeprefix("file://"))
    return Path(shutil.copytree(source, tmp_path / "train"))


def test_any_number_of_ranks_sees_the_single_rank_sequence(
        prepared_corpus: PreparedDataset) -> None:
    single = _run(_datasets(prepared_corpus.train_uri, 1), 60)
    for world in (2, 3):
        split = _run(_datasets(prepared_corpus.train_uri, world), 60 // world)
        assert np.array_equal(np.stack(split), np.stack(single))


def test_resuming_with_another_world_size_repeats_and_skips_nothing(
        prepared_corpus: PreparedDataset) -> None:
    uri = prepared_corpus.train_uri
    first = _datasets(uri, 2)
    seen = _run(first, 5)
    state = first[0].state_dict()
    for world in (1, 3, 2):  # 2 ranks, then 1, 3 and 2 again, each from the last state
        resumed = _datasets(uri, world)
        for dataset in resumed:
            dataset.load_state_dict(state)
        seen += _run(resumed, 6)
        state = resumed[0].state_dict()
        assert all(dataset.state_dict() == state for dataset in resumed)
    ids = [row.tobytes() for row in seen]
    reference = [row.tobytes() for row in _run(_datasets(uri, 1), len(seen) // BATCH)]
    assert ids == reference


def test_every_sample_appears_once_per_epoch_in_a_seeded_order(
        prepared_corpus: PreparedDataset) -> None:
    dataset = _datasets(prepared_corpus.train_uri, 1)[0]
    per_epoch = dataset.samples_per_epoch
    first = [dataset.sample_ids(p) for p in range(per_epoch)]
    second = [dataset.sample_ids(p) for p in range(per_epoch, 2 * per_epoch)]
    assert len(set(first)) == per_epoch and set(first) == set(second) and first != second
    other_seed = TokenDataset(prepared_corpus.train_uri, seq_len=SEQ, micro_batch_size=BATCH,
                              seed=8)
    assert [other_seed.sample_ids(p) for p in range(per_epoch)] != first
    ordered = TokenDataset(prepared_corpus.train_uri, seq_len=SEQ, micro_batch_size=BATCH,
                           shuffle=False)
    assert [ordered.sample_ids(p) for p in range(per_epoch)] == sorted(first)


def test_streaming_from_s3_matches_local_and_holds_few_shards(
        prepared_corpus: PreparedDataset, s3_bucket: str, s3_spec: StorageSpec) -> None:
    remote = open_storage(f"s3://{s3_bucket}/corpus/train", s3_spec)
    local = Path(prepared_corpus.train_uri.removeprefix("file://"))
    for path in local.iterdir():
        remote.upload_file(path, path.name)
    from_s3 = TokenDataset(remote.uri, seq_len=SEQ, micro_batch_size=BATCH, seed=7,
                           prefetch_shards=1, storage=s3_spec)
    from_disk = _datasets(prepared_corpus.train_uri, 1)[0]
    most_held = 0
    for _ in range(from_s3.samples_per_epoch // BATCH):
        assert all(np.array_equal(a, b) for a, b in
                   zip(next(from_s3), next(from_disk), strict=True))
        most_held = max(most_held, len(from_s3._shards))
    assert most_held <= 3  # the current shard, prefetch_shards downloading, one queued
    from_s3.close()


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_dataloader_workers_hand_out_the_ranks_own_sequence(
        start_method: str, prepared_corpus: PreparedDataset, s3_bucket: str,
        s3_spec: StorageSpec) -> None:
    remote = open_storage(f"s3://{s3_bucket}/loader/train", s3_spec)
    for path in Path(prepared_corpus.train_uri.removeprefix("file://")).iterdir():
        remote.upload_file(path, path.name)
    # Rank 1 of 2, read in this process first (the parent's S3 client is in use at fork).
    def rank_one() -> TokenDataset:
        return TokenDataset(remote.uri, seq_len=SEQ, micro_batch_size=BATCH, rank=1,
                            world_size=2, seed=7, storage=s3_spec)
    alone = rank_one()
    expected = [next(alone) for _ in range(13)]
    dataset = rank_one()
    # Earlier tests in this process may have left dead gloo groups as garbage (an in-process
    # Trainer.fit): a forked worker that collects one hangs in its destructor, so none
    # goes with the fork.
    gc.collect()
    loader = DataLoader(dataset, batch_size=None, num_workers=2,
                        multiprocessing_context=start_method)
    batches = list(itertools.islice(loader, 12))
    for got, want in zip(batches, expected, strict=False):
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert len(batches) == 12
    dataset.skip(12)  # what the loader consumed: the dataset continues after it
    assert all(torch.equal(a, b) for a, b in zip(next(dataset), expected[12], strict=True))
    alone.close()
    dataset.close()


def test_a_saved_position_from_another_order_is_refused(
        prepared_corpus: PreparedDataset) -> None:
    state = _datasets(prepared_corpus.train_uri, 1)[0].state_dict()
    longer = TokenDataset(prepared_corpus.train_uri, seq_len=SEQ * 2, micro_batch_size=BATCH)
    with pytest.raises(ValueError, match="seq_len"):
        longer.load_state_dict(state)


def test_a_tampered_shard_is_refused(prepared_corpus: PreparedDataset, tmp_path: Path) -> None:
    copy = _copy_of_split(prepared_corpus, tmp_path)
    shard = copy / prepared_corpus.train.shards[0].name
    data = bytearray(shard.read_bytes())
    data[10] ^= 0xFF
    shard.write_bytes(bytes(data))
    dataset = TokenDataset(str(copy), seq_len=SEQ, micro_batch_size=BATCH, shuffle=False)
    with pytest.raises(CorruptShard, match="truncated or modified"):
        for _ in itertools.count():
            next(dataset)


def test_an_index_from_before_blake3_is_read_and_still_verified(
        prepared_corpus: PreparedDataset, tmp_path: Path) -> None:
    # A v1 index: each shard's bare sha256, as kubetrain wrote before digests were labelled.
    copy = _copy_of_split(prepared_corpus, tmp_path)
    index = json.loads((copy / INDEX_NAME).read_text())
    index["format"] = "kubetrain-tokens-v1"
    for shard in index["shards"]:
        del shard["digest"]
        shard["sha256"] = hashlib.sha256((copy / shard["name"]).read_bytes()).hexdigest()
    (copy / INDEX_NAME).write_text(json.dumps(index))

    old, new = (TokenDataset(uri, seq_len=SEQ, micro_batch_size=BATCH, seed=7)
                for uri in (str(copy), prepared_corpus.train_uri))
    for _ in range(20):
        assert all(torch.equal(a, b) for a, b in zip(next(old), next(new), strict=True))

    shard = copy / index["shards"][0]["name"]
    data = bytearray(shard.read_bytes())
    data[10] ^= 0xFF  # same size: only the sha256 can tell
    shard.write_bytes(bytes(data))
    dataset = TokenDataset(str(copy), seq_len=SEQ, micro_batch_size=BATCH, shuffle=False)
    with pytest.raises(CorruptShard, match="truncated or modified"):
        for _ in itertools.count():
            next(dataset)


def test_an_index_with_an_unknown_digest_is_refused_when_opened(
        prepared_corpus: PreparedDataset, tmp_path: Path) -> None:
    copy = _copy_of_split(prepared_corpus, tmp_path)
    index = json.loads((copy / INDEX_NAME).read_text())
    index["shards"][0]["digest"] = "md5:0123"
    (copy / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"index.json: shard-00000.bin: unknown digest "
                                         r"algorithm 'md5'.*upgrade kubetrain"):
        TokenDataset(str(copy), seq_len=SEQ, micro_batch_size=BATCH)


@pytest.mark.parametrize("every_steps", [0, 5])
def test_a_validation_split_too_small_for_a_micro_batch_fails_only_a_job_that_evaluates(
        prepared_corpus: PreparedDataset, every_steps: int) -> None:
    """bench/cuda_oom.py on an H200: 64 sequences a micro-batch against an 11-sequence
    validation split failed every attempt at step 0 although the job never evaluates."""
    assert prepared_corpus.validation is not None
    def sequences(index: DatasetIndex) -> int:
        return sum((shard.tokens - 1) // SEQ for shard in index.shards)

    micro = sequences(prepared_corpus.validation) + 1  # one more than the split holds
    assert sequences(prepared_corpus.train) >= micro
    spec = parse_job({
        "apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob",
        "metadata": {"name": "small-validation"},
        "spec": {"image": "trainer", "model": {"preset": "tiny"},
                 "data": {"train": prepared_corpus.train_uri, "seqLen": SEQ},
                 "optimization": {"microBatchSize": micro},
                 "evaluation": {"everySteps": every_steps},
                 "checkpoint": {"uri": "file:///unused"}}}).spec
    if every_steps:
        with pytest.raises(ValueError, match=r"fewer than one micro-batch.*smaller seqLen"):
            build_datasets(spec, rank=0, world_size=1)
    else:
        train, validation = build_datasets(spec, rank=0, world_size=1)
        assert validation is None
        inputs, _ = next(train)
        assert inputs.shape == (micro, SEQ)
        train.close()
