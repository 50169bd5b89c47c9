"""The trainer out of memory: its handler, its termination message, and the halved micro-batch.

A micro-batch that does not fit makes the trainer write its failure class, the
micro-batch and the error into the termination message and exit 87; the operator
reads the class from there (tests/operator covers what it then decides). Restarted
with status.effective's smaller micro-batch, the trainer keeps the global batch, so
its loss curve is the spec's.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from kubetrain.operator.facts import WorkerPod
from kubetrain.operator.failures import classify
from kubetrain.protocol import EXIT_OUT_OF_MEMORY, trainer_failure

WORKER = Path(__file__).with_name("oom_worker.py")
# Losses of the same global batch split into micro-batches of 8 or of 4 x 2 differ only by
# the order of float32 additions; over 12 Adam steps that stays far below this.
CURVE_TOLERANCE = 1e-4


def _with_effective(job: Path, micro: int, out_of_memory_restarts: int = 1) -> Path:
    """The job as the operator's ConfigMap gives it after an OOM restart: status.effective."""
    manifest = yaml.safe_load(job.read_text())
    manifest["status"] = {"effective": {"microBatchSize": micro, "gradientAccumulationSteps": 0,
                                        "outOfMemoryRestarts": out_of_memory_restarts}}
    healed = job.with_name("healed.yaml")
    healed.write_text(yaml.safe_dump(manifest))
    return healed


def _run_worker(job: Path, log: Path, limit: int, termination_log: Path,
                launcher: Any, *how: str) -> subprocess.CompletedProcess[str]:
    termination_log.touch()  # the kubelet creates it in the container
    env = {**launcher.env(), "KUBETRAIN_TERMINATION_LOG": str(termination_log)}
    return subprocess.run([sys.executable, str(WORKER), str(job), str(log), str(limit), *how],
                          env=env, capture_output=True, text=True, timeout=180)


def _losses(events: list[dict[str, Any]]) -> dict[int, float]:
    return {int(e["step"]): float(e["loss"]) for e in events if e["event"] == "step"}


def test_an_out_of_memory_step_is_classified_in_the_termination_message(
        tiny_job: Any, launcher: Any, tmp_path: Path) -> None:
    job = tiny_job("oom", optimization={"maxSteps": 4, "microBatchSize": 8, "warmupSteps": 1})
    termination_log = tmp_path / "termination-log"
    done = _run_worker(job, tmp_path / "oom.jsonl", 4, termination_log, launcher)
    assert done.returncode == EXIT_OUT_OF_MEMORY, done.stderr[-3000:]
    assert "CUDAOutOfMemory at micro-batch 8" in done.stderr

    message = termination_log.read_text()
    assert len(message.encode()) <= 4096
    failure = trainer_failure(message)
    assert failure is not None
    assert (failure.failure_class, failure.micro_batch_size) == ("CUDAOutOfMemory", 8)
    assert "CUDA out of memory. Tried to allocate" in failure.message
    # The pod this container ends in: torchrun exits 1, the message tells the class.
    pod = WorkerPod(name="oom-worker-0", index=0, restart_attempt=0, phase="Failed",
                    exit_code=1, reason="Error", termination_message=message,
                    trainer_failure=failure)
    assert classify(pod, [2, 126, 127]) == "CUDAOutOfMemory"


def test_a_triton_kernel_out_of_memory_is_classified_too(
        tiny_job: Any, launcher: Any, tmp_path: Path) -> None:
    """Liger's fused loss is Triton: its failed allocation is a plain RuntimeError."""
    job = tiny_job("oom", optimization={"maxSteps": 4, "microBatchSize": 8, "warmupSteps": 1})
    termination_log = tmp_path / "termination-log"
    done = _run_worker(job, tmp_path / "oom.jsonl", 4, termination_log, launcher, "triton")
    assert done.returncode == EXIT_OUT_OF_MEMORY, done.stderr[-3000:]
    failure = trainer_failure(termination_log.read_text())
    assert failure is not None and failure.failure_class == "CUDAOutOfMemory"
    assert "Triton Error [CUDA]: out of memory" in failure.message


def test_the_halved_micro_batch_trains_the_same_curve_as_the_spec(
        tiny_job: Any, launcher: Any, tmp_path: Path) -> None:
    optimization = {"maxSteps": 12, "microBatchSize": 8, "gradientAccumulationSteps": 1,
                    "warmupSteps": 2}
    spec_run = tiny_job("spec", optimization=optimization)
    full = _losses(launcher.train(spec_run, ranks=1))

    healed = _with_effective(tiny_job("healed", optimization=optimization), micro=4)
    # The device that cannot hold 8 sequences trains at 4, twice per step.
    done = _run_worker(healed, tmp_path / "healed.jsonl", 4, tmp_path / "termination-log",
                       launcher)
    assert done.returncode == 0, done.stderr[-3000:]
    log = (tmp_path / "healed.jsonl").read_text().splitlines()
    halved = _losses([json.loads(line) for line in log if line.strip()])

    assert sorted(halved) == sorted(full) == list(range(1, 13))
    difference = max(abs(halved[step] - full[step]) for step in full)
    print(f"largest loss difference, micro-batch 8x1 vs 4x2: {difference:.2e}")
    assert difference < CURVE_TOLERANCE


def test_the_restart_after_an_out_of_memory_books_the_lost_time_as_oom(
        tiny_job: Any, launcher: Any, tmp_path: Path) -> None:
    job = tiny_job("booked", optimization={"maxSteps": 4, "microBatchSize": 8,
                                           "gradientAccumulationSteps": 1, "warmupSteps": 1})
    failed = _run_worker(job, tmp_path / "first.jsonl", 4, tmp_path / "termination-log",
                         launcher)
    assert failed.returncode == EXIT_OUT_OF_MEMORY, failed.stderr[-3000:]

    # Restarted as the operator restarts it: half the micro-batch, one OOM restart counted.
    healed = _with_effective(job, micro=4, out_of_memory_restarts=1)
    done = _run_worker(healed, tmp_path / "second.jsonl", 4, tmp_path / "termination-log",
                       launcher)
    assert done.returncode == 0, done.stderr[-3000:]
    log = (tmp_path / "second.jsonl").read_text().splitlines()
    seconds = [json.loads(line) for line in log if '"goodput"' in line][-1]["seconds"]
    print(f"goodput after the OOM restart: oom {seconds['oom']:.2f}s, "
          f"downtime {seconds['downtime']:.2f}s, lost progress {seconds['lost_progress']:.2f}s")
    assert seconds["oom"] > 0
    assert seconds["downtime"] == seconds["lost_progress"] == 0.0


def test_the_halving_under_tensor_parallelism_keeps_the_global_batch_over_data_parallel_ranks(
) -> None:
    # 2 pods x 4 processes, tensorParallel 2: 4 data-parallel ranks, each pair of a
    # tensor-parallel group reading the same micro-batches. The accumulation the operator
    # and `kubetrain run` put into status.effective after an out-of-memory restart is the
    # one the trainer counts over its mesh, and the global batch stays the spec's tokens.
    from kubetrain.api.trainingjob import TrainingJobSpec
    from kubetrain.operator.observation import effective_batch
    from kubetrain.restart_rules import after_out_of_memory
    from kubetrain.trainer.mesh_shape import mesh_shape

    spec = TrainingJobSpec.model_validate({
        "image": "kubetrain/trainer:test", "model": {"preset": "tiny"},
        "data": {"train": "s3://data/train", "seqLen": 64},
        "workers": {"replicas": 2, "procsPerWorker": 4},
        "optimization": {"microBatchSize": 8, "globalBatchTokens": 8 * 64 * 4 * 2},
        "parallelism": {"strategy": "hsdp", "tensorParallel": 2},
        "checkpoint": {"uri": "s3://data/checkpoints"}})
    processes = 8
    data_parallel = mesh_shape(spec.parallelism, 4, processes).dp_size
    assert data_parallel == 4
    started, _ = effective_batch(spec, None, processes)
    assert started.gradient_accumulation_steps == spec.gradient_accumulation(data_parallel) == 2
    halved = after_out_of_memory(spec, 8, 0, processes, reason="worker-1 OOMKilled").effective
    assert halved is not None and halved.micro_batch_size == 4
    # What the trainer runs with (loop.py's meter: over its mesh's data-parallel ranks).
    assert halved.gradient_accumulation_steps == spec.gradient_accumulation(data_parallel, 4)
    tokens = halved.micro_batch_size * halved.gradient_accumulation_steps * 64 * data_parallel
    assert tokens == spec.optimization.global_batch_tokens
