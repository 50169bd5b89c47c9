"""End to end: the real trainer under torchrun, killed and resized, resumes losing nothing.

Every run trains the tiny preset on the prepared corpus streamed from moto's S3
and checkpoints there. The reference is one uninterrupted 2-rank run; the others
must end with the same exported weights (bit for bit at the same world size) and
see the same losses step by step (the same samples in the same order).
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import load_file

from kubetrain.api.trainingjob import StorageSpec
from kubetrain.local.launch import free_port
from kubetrain.local.metrics_log import MetricsLogReader
from kubetrain.local.node import descendants, rank_processes
from kubetrain.trainer.checkpoint import committed_checkpoints
from kubetrain.trainer.prepare import PreparedDataset
from kubetrain.trainer.storage import open_storage

pytestmark = pytest.mark.slow

MAX_STEPS = 24
EVERY = 4


def _manifest(path: Path, *, train: str, checkpoint: str, endpoint: str) -> Path:
    path.write_text(yaml.safe_dump({
        "apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob",
        "metadata": {"name": "resume"},
        "spec": {
            "image": "trainer",
            "model": {"preset": "tiny"},
            "data": {"train": train, "seqLen": 64},
            # A global batch of 1024 tokens: 2 micro-steps of 4 on 2 ranks, 4 on 1 rank.
            "optimization": {"maxSteps": MAX_STEPS, "microBatchSize": 4,
                             "globalBatchTokens": 1024, "warmupSteps": 3, "seed": 5},
            "parallelism": {"strategy": "fsdp", "precision": "fp32"},
            "evaluation": {"everySteps": 0},
            "checkpoint": {"uri": checkpoint, "everySteps": EVERY, "keepLast": 2,
                           "async": True},
            "storage": {"endpoint": endpoint, "region": "us-east-1"},
            "metrics": {"port": free_port(), "logEverySteps": 1},
        },
    }))
    return path


def _torchrun(manifest: Path, log: Path, ranks: int, restarts: int = 0) -> subprocess.Popen[bytes]:
    """torchrun as a worker pod runs it: kubetrain's launcher, whose ranks fork from a
    server that imported the training loop once."""
    return subprocess.Popen(
        [sys.executable, "-m", "kubetrain.trainer.launch", "--standalone",
         f"--nproc-per-node={ranks}", f"--max-restarts={restarts}",
         str(manifest), "--metrics-log", str(log)],
        env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=manifest.parent,
        stdout=subprocess.DEVNULL, stderr=open(log.with_suffix(".err"), "wb"),
    )


def _events(log: Path, kind: str) -> list[dict[str, Any]]:
    """The logged events of `kind`, read as the runner reads them: a line rank 0 is still
    writing waits (a clean clone's run parsed one half-written and failed)."""
    return [event for event in MetricsLogReader(log).read_new() if event["event"] == kind]


def _last_step(log: Path) -> int:
    steps = _events(log, "step")
    return steps[-1]["step"] if steps else 0


def _wait_for(condition: Callable[[], bool], process: subprocess.Popen[bytes],
              timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert process.poll() is None, "torchrun ended before the awaited moment"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _workers(agent: subprocess.Popen[bytes]) -> list[int]:
    """The training processes below torchrun's agent (children of its fork server)."""
    return sorted(rank_processes(descendants(agent.pid)))


def _stop(agent: subprocess.Popen[bytes]) -> None:
    """Kill whatever is left of a torchrun launch: its processes first, then the agent."""
    for pid in descendants(agent.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    if agent.poll() is None:
        agent.kill()
        agent.wait()


def _losses(log: Path) -> dict[int, float]:
    """The loss logged at each step; a step redone after a restart logs it again."""
    return {event["step"]: event["loss"] for event in _events(log, "step")}


@pytest.fixture(scope="module")
def corpus_on_s3(prepared_corpus: PreparedDataset, s3_endpoint: str,
                 new_bucket: Callable[[str], str]) -> str:
    """The prepared corpus copied to a bucket of its own; returns the train split's URI."""
    new_bucket("corpus")
    spec = StorageSpec(endpoint=s3_endpoint, region="us-east-1")
    source = Path(prepared_corpus.uri.removeprefix("file://"))
    target = open_storage("s3://corpus/prepared", spec)
    for path in source.rglob("*"):
        if path.is_file():
            target.upload_file(path, path.relative_to(source).as_posix())
    return f"{target.uri}/train"


@pytest.fixture(scope="module")
def reference(corpus_on_s3: str, s3_endpoint: str, new_bucket: Callable[[str], str],
              tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[int, float], Path]:
    """An uninterrupted 2-rank run: its losses by step and its exported weights file."""
    new_bucket("reference")
    folder = tmp_path_factory.mktemp("reference")
    manifest = _manifest(folder / "job.yaml", train=corpus_on_s3,
                         checkpoint="s3://reference/run", endpoint=s3_endpoint)
    run = _torchrun(manifest, folder / "metrics.jsonl", ranks=2)
    try:
        assert run.wait(timeout=180) == 0, (folder / "metrics.err").read_text()[-3000:]
    finally:
        _stop(run)
    weights = folder / "model.safetensors"
    open_storage("s3://reference/run/export", StorageSpec(endpoint=s3_endpoint)).download_file(
        "model.safetensors", weights)
    return _losses(folder / "metrics.jsonl"), weights


def _exported(s3_endpoint: str, uri: str, into: Path) -> dict[str, torch.Tensor]:
    open_storage(f"{uri}/export", StorageSpec(endpoint=s3_endpoint)).download_file(
        "model.safetensors", into)
    return load_file(into)


def test_kill_9_at_random_steps_and_mid_upload_under_s3_faults_resumes_bit_for_bit(
        reference: tuple[dict[int, float], Path], corpus_on_s3: str, s3_endpoint: str,
        s3_bucket: str, faulty_s3: Callable[..., Any], tmp_path: Path) -> None:
    reference_losses, reference_weights = reference
    # 5% of requests fail; uploads are slowed so a kill can land inside one.
    proxy = faulty_s3(fault_ratio=0.05, delay=0.15, seed=3)
    uri = f"s3://{s3_bucket}/job"
    manifest = _manifest(tmp_path / "job.yaml", train=corpus_on_s3, checkpoint=uri,
                         endpoint=proxy.endpoint)
    log = tmp_path / "metrics.jsonl"
    store_spec = StorageSpec(endpoint=s3_endpoint)
    store = open_storage(uri, store_spec)
    chooser = random.Random(11)

    def uploading() -> str | None:
        """A checkpoint folder this launch is writing: files, no manifest yet."""
        committed = {info.step for info in committed_checkpoints(uri, store_spec)}
        since, reached = _events(log, "start")[-1]["step"], _last_step(log)
        started = {obj.key.partition("/")[0] for obj in store.list()
                   if obj.key.startswith("step-")}
        pending = sorted(f for f in started if since < int(f[5:]) <= reached
                         and int(f[5:]) not in committed)
        return pending[-1] if pending else None

    first_kill = chooser.randint(EVERY + 1, 2 * EVERY + 2)
    moments: list[Callable[[], bool]] = [
        # A random step once a checkpoint exists, mid-interval or not.
        lambda: _last_step(log) >= first_kill and bool(committed_checkpoints(uri, store_spec)),
        lambda: uploading() is not None,  # inside a checkpoint upload
        lambda: _last_step(log) >= _events(log, "start")[-1]["step"] + chooser.randint(1, 4),
    ]
    interrupted = ""
    # Like the operator and `kubetrain run`, restart the group after each crash.
    for launch, moment in enumerate([*moments, None]):
        agent = _torchrun(manifest, log, ranks=2)
        try:
            if moment is None:
                assert agent.wait(timeout=180) == 0, (
                    (tmp_path / "metrics.err").read_text()[-3000:])
                break
            _wait_for(lambda: len(_events(log, "start")) > launch and moment(), agent)  # noqa: B023
            if launch == 1:
                interrupted = uploading() or ""
            os.kill(chooser.choice(_workers(agent)), signal.SIGKILL)
            assert agent.wait(timeout=120) != 0
        finally:
            _stop(agent)

    resumed = _events(log, "resumed")
    assert len(resumed) == 3 and all(event["world_size"] == 2 for event in resumed)
    # The crash mid-checkpoint resumed from the checkpoint before the interrupted one.
    assert interrupted and resumed[1]["step"] < int(interrupted[5:])
    assert sum(proxy.injected.values()) > 0

    final = _exported(s3_endpoint, uri, tmp_path / "model.safetensors")
    expected = load_file(reference_weights)
    assert final.keys() == expected.keys()
    assert all(torch.equal(final[name], expected[name]) for name in expected)
    assert _losses(log) == reference_losses


def test_two_ranks_then_one_then_two_continue_the_same_samples_and_loss(
        reference: tuple[dict[int, float], Path], corpus_on_s3: str, s3_endpoint: str,
        s3_bucket: str, tmp_path: Path) -> None:
    reference_losses, reference_weights = reference
    uri = f"s3://{s3_bucket}/job"
    manifest = _manifest(tmp_path / "job.yaml", train=corpus_on_s3, checkpoint=uri,
                         endpoint=s3_endpoint)
    log = tmp_path / "metrics.jsonl"
    for ranks, stop_after in ((2, 6), (1, 14), (2, None)):
        agent = _torchrun(manifest, log, ranks=ranks)
        try:
            if stop_after is not None:
                # A planned stop (eviction, scale-down): SIGTERM to every worker.
                _wait_for(lambda: _last_step(log) >= stop_after, agent)  # noqa: B023
                for worker in _workers(agent):
                    os.kill(worker, signal.SIGTERM)
            agent.wait(timeout=180)
        finally:
            _stop(agent)

    resumed = _events(log, "resumed")
    assert [event["world_size"] for event in resumed] == [1, 2]
    assert _events(log, "finished")[-1]["step"] == MAX_STEPS
    # Every step's loss matches the 2-rank reference: the same samples in the same order
    # (a repeated or skipped sample would change it by far more). One rank sums the
    # same tokens in another order, so this is equal within fp32 tolerance.
    losses = _losses(log)
    assert sorted(losses) == sorted(reference_losses)
    for step, loss in reference_losses.items():
        assert losses[step] == pytest.approx(loss, rel=1e-4), step
    final = _exported(s3_endpoint, uri, tmp_path / "model.safetensors")
    expected = load_file(reference_weights)
    for name, tensor in expected.items():
        torch.testing.assert_close(final[name], tensor, rtol=1e-3, atol=1e-5)
