"""Storage benchmark: kubetrain's checkpoint and data paths against raw boto3, one moto server.

    python bench/storage.py [--checkpoint-mb 192] [--dataset-mb 128] [--rounds 7]
                            [--train-steps 150]

Prints four ratios, each measured in this run against a baseline on the same server
(timed rounds interleave kubetrain and its baseline, so both see the same load on a
shared machine, and each ratio compares medians over the rounds):
- checkpoint save throughput / raw boto3 multipart upload of the same bytes  (goal >= 0.8)
- time training is blocked by an async save / by a synchronous save          (goal <= 0.1)
- dataset read throughput / raw boto3 GETs of the same shards                 (goal >= 0.8)
- fraction of step time spent waiting for data in a training run             (goal <= 0.02)
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")

import boto3
import numpy as np
import torch
import torch.distributed as dist
from boto3.s3.transfer import TransferConfig

from kubetrain.api.manifest import parse_job
from kubetrain.api.trainingjob import StorageSpec, TrainingJobSpec
from kubetrain.trainer.checkpoint import Checkpointer, ModelState
from kubetrain.trainer.data import TokenDataset
from kubetrain.trainer.prepare import DatasetIndex, ShardInfo, token_dtype
from kubetrain.trainer.storage import open_storage


def _job(endpoint: str, checkpoint_uri: str, train_uri: str, asynchronous: bool) -> TrainingJobSpec:
    return parse_job({
        "apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob",
        "metadata": {"name": "bench"},
        "spec": {"image": "bench", "model": {"preset": "tiny"},
                 "data": {"train": train_uri, "seqLen": 256},
                 "optimization": {"maxSteps": 1000, "microBatchSize": 8},
                 "checkpoint": {"uri": checkpoint_uri, "keepLast": 1, "async": asynchronous},
                 "storage": {"endpoint": endpoint, "region": "us-east-1"}},
    }).spec


def _checkpoint_state(megabytes: int) -> dict[str, ModelState]:
    # AdamW keeps two moments per parameter: parameters are a third of the bytes.
    width = 1024
    layers = max(1, megabytes * 1024 * 1024 // 3 // (4 * width * width))
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width, bias=False)
                                  for _ in range(layers)))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, width)).sum().backward()
    optimizer.step()
    return {"model": ModelState(model, optimizer)}


def bench_checkpoint(endpoint: str, bucket: str, megabytes: int,
                     rounds: int) -> tuple[float, float]:
    """(save throughput ratio to raw multipart upload, async-blocked / sync-save time)."""
    app = _checkpoint_state(megabytes)
    sync_job = _job(endpoint, f"s3://{bucket}/ckpt-sync", "unused", asynchronous=False)
    async_job = _job(endpoint, f"s3://{bucket}/ckpt-async", "unused", asynchronous=True)
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    config = TransferConfig(multipart_chunksize=16 * 1024 * 1024, max_concurrency=8)
    with tempfile.TemporaryDirectory() as scratch:
        sync_saver = Checkpointer(sync_job, rank=0, world_size=1)
        async_saver = Checkpointer(async_job, rank=0, world_size=1)
        sync_saver.save(1, app)  # warm-up: connections, DCP planning caches
        # Baseline: the same files, uploaded with boto3's multipart transfer manager.
        store = open_storage(f"s3://{bucket}/ckpt-sync/step-00000001",
                             StorageSpec(endpoint=endpoint, region="us-east-1"))
        files = json.loads(store.read_bytes("checkpoint.json"))["files"]
        local = Path(scratch) / "baseline"
        for name in files:
            store.download_file(name, local / name)
        total = sum(entry["bytes"] for entry in files.values())
        # Interleaved, so that all three see the same load on a shared machine.
        sync_times, blocked_times, raw_times = [], [], []
        for step in range(2, 2 + rounds):
            start = time.perf_counter()
            sync_saver.save(step, app)
            sync_times.append(time.perf_counter() - start)
            start = time.perf_counter()
            async_saver.save(step, app, blocking=False)
            blocked_times.append(time.perf_counter() - start)
            async_saver.wait()
            start = time.perf_counter()
            for name in files:
                client.upload_file(str(local / name), bucket, f"raw/{step}/{name}",
                                   Config=config)
            raw_times.append(time.perf_counter() - start)
        sync_saver.close()
        async_saver.close()
    sync, raw = statistics.median(sync_times), statistics.median(raw_times)
    blocked = statistics.median(blocked_times)
    print(f"checkpoint: {total / 2**20:.0f} MiB, medians of {rounds} rounds; kubetrain sync "
          f"save {sync:.2f}s ({total / sync / 2**20:.0f} MiB/s), raw multipart upload "
          f"{raw:.2f}s ({total / raw / 2**20:.0f} MiB/s); async save blocked {blocked:.3f}s")
    return raw / sync, blocked / sync


def _upload_shards(endpoint: str, bucket: str, name: str, megabytes: int, shard_kb: int) -> str:
    """Random token shards with a valid index, as `kubetrain prepare` would write them."""
    store = open_storage(f"s3://{bucket}/{name}/train",
                         StorageSpec(endpoint=endpoint, region="us-east-1"))
    vocab = 2048
    dtype = token_dtype(vocab)
    tokens_per_shard = shard_kb * 1024 // np.dtype(dtype).itemsize
    rng = np.random.default_rng(0)
    shards = []
    for number in range(max(1, megabytes * 1024 // shard_kb)):
        data = rng.integers(0, vocab, tokens_per_shard, dtype=dtype).tobytes()
        name = f"shard-{number:05d}.bin"
        store.write_bytes(name, data)
        shards.append(ShardInfo.of(name, tokens_per_shard, data))
    index = DatasetIndex(dtype=dtype, vocab_size=vocab, eos_token_id=0, tokenizer_sha256="",
                         shard_tokens=tokens_per_shard, shards=tuple(shards))
    store.write_bytes("index.json", index.to_json())
    return store.uri


def bench_data_read(endpoint: str, bucket: str, train_uri: str, rounds: int) -> float:
    """Dataset read throughput over one epoch / raw GETs of the same shards, as many at
    once as the dataset's prefetch threads."""
    spec = StorageSpec(endpoint=endpoint, region="us-east-1")
    index = DatasetIndex.load(open_storage(train_uri, spec))
    total = sum(shard.bytes for shard in index.shards)
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    prefix = train_uri.removeprefix(f"s3://{bucket}/")
    raw_times, epoch_times = [], []
    for _ in range(rounds):
        dataset = TokenDataset(train_uri, seq_len=2048, micro_batch_size=8, storage=spec)
        with ThreadPoolExecutor(dataset.prefetch_shards) as getters:
            start = time.perf_counter()
            for _ in getters.map(lambda key: client.get_object(Bucket=bucket, Key=key)["Body"]
                                 .read(), [f"{prefix}/{shard.name}" for shard in index.shards]):
                pass
            raw_times.append(time.perf_counter() - start)

        start = time.perf_counter()
        for _ in range(dataset.samples_per_epoch // 8):
            next(dataset)
        epoch_times.append(time.perf_counter() - start)
        dataset.close()
    ours, raw = statistics.median(epoch_times), statistics.median(raw_times)
    print(f"dataset: {total / 2**20:.0f} MiB in {len(index.shards)} shards, medians of {rounds} "
          f"rounds; kubetrain epoch {ours:.2f}s ({total / ours / 2**20:.0f} MiB/s), raw GETs "
          f"({dataset.prefetch_shards} at once) {raw:.2f}s ({total / raw / 2**20:.0f} MiB/s)")
    return raw / ours


def bench_data_wait(endpoint: str, bucket: str, train_uri: str, steps: int) -> float:
    """The trainer's own data-wait ratio over a run of the tiny preset streaming from S3."""
    from kubetrain.trainer.loop import Trainer

    spec = parse_job({
        "apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob",
        "metadata": {"name": "bench"},
        "spec": {"image": "bench", "model": {"preset": "tiny"},
                 "data": {"train": train_uri, "seqLen": 256},
                 "optimization": {"maxSteps": steps, "microBatchSize": 8},
                 "evaluation": {"everySteps": 0},
                 "checkpoint": {"uri": f"s3://{bucket}/train-run", "everySteps": steps,
                                "export": False},
                 "storage": {"endpoint": endpoint, "region": "us-east-1"},
                 "metrics": {"logEverySteps": 10}},
    }).spec
    with tempfile.TemporaryDirectory() as folder:
        log = Path(folder) / "metrics.jsonl"
        Trainer(spec, metrics_log=log, serve_metrics=False).fit()
        events = [json.loads(line) for line in log.read_text().splitlines()]
    logged = [event for event in events if event["event"] == "step"]
    # Each logged ratio covers the steps since the previous log line: weight by their time.
    seconds = [event["step_time"] * 10 for event in logged]
    waited = sum(event["data_wait_ratio"] * time for event, time in zip(logged, seconds,
                                                                        strict=True))
    shard_tokens = DatasetIndex.load(open_storage(train_uri, spec.storage)).shard_tokens
    boundaries = steps * 8 * 256 // shard_tokens
    print(f"training (kubetrain Trainer, tiny preset): {steps} steps in {sum(seconds):.2f}s, "
          f"{waited:.3f}s waiting for data, about {boundaries} shard boundaries crossed")
    return waited / sum(seconds)


def _start_moto() -> tuple[subprocess.Popen[bytes], str]:
    """moto's S3 server in its own process, as a remote store would be: its request
    handling then does not compete with the measured code for this process's GIL."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    for _ in range(100):
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return server, endpoint
        except OSError:
            time.sleep(0.1)
    server.kill()
    raise RuntimeError("moto server did not start")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint-mb", type=int, default=192)
    parser.add_argument("--dataset-mb", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=7,
                        help="timed rounds of each comparison (medians are compared)")
    parser.add_argument("--train-steps", type=int, default=150,
                        help="a multiple of 10 (the metrics log interval)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    server, endpoint = _start_moto()
    bucket = "bench"
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        save_ratio, blocked_ratio = bench_checkpoint(endpoint, bucket, args.checkpoint_mb,
                                                    args.rounds)
        train_uri = _upload_shards(endpoint, bucket, "large", args.dataset_mb, shard_kb=4096)
        # An epoch takes a fraction of a second: more rounds steady the medians.
        read_ratio = bench_data_read(endpoint, bucket, train_uri, 3 * args.rounds)
        # Small shards, so that the run crosses a shard boundary every 16 steps.
        small_uri = _upload_shards(endpoint, bucket, "small", 4, shard_kb=64)
        wait_fraction = bench_data_wait(endpoint, bucket, small_uri, args.train_steps)
    finally:
        dist.destroy_process_group()
        server.terminate()
        server.wait()
    print()
    print(f"checkpoint save throughput / raw multipart upload: {save_ratio:.2f}  (goal >= 0.8)")
    print(f"async save blocking / sync save:                   {blocked_ratio:.3f} (goal <= 0.1)")
    print(f"dataset read throughput / raw GETs:                {read_ratio:.2f}  (goal >= 0.8)")
    print(f"data wait / step time in training:                 {wait_fraction:.3%} "
          "(goal <= 2%)")


if __name__ == "__main__":
    main()
