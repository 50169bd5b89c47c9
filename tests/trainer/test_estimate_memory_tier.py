"""`kubetrain estimate` and the in-memory checkpoint tier (issue 34): the tier's host memory
per worker pod on its own line, and a tier over maxWorkerMemory refused with its numbers,
also for a model.init job, whose size only its config.json knows."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from kubetrain.api.presets import PRESETS
from kubetrain.cli import main
from kubetrain.sizing import parameter_count
from kubetrain.trainer.export import hf_config

GIB = 2**30


def _manifest(model: dict[str, Any], memory: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob",
            "metadata": {"name": "tiered"},
            "spec": {"image": "x", "model": model,
                     "workers": {"replicas": 4, "minReplicas": 2, "maxReplicas": 4,
                                 "procsPerWorker": 2},
                     "data": {"train": "s3://d/train", "seqLen": 1024},
                     "optimization": {"microBatchSize": 4, "gradientAccumulationSteps": 4},
                     "checkpoint": {"uri": "s3://c/tiered", "memory": memory}}}


@dataclass
class _Done:
    returncode: int
    stdout: str
    stderr: str


def _estimate(tmp_path: Path, manifest: dict[str, Any], capsys: pytest.CaptureFixture[str],
              torch_free: bool = False) -> _Done:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(manifest))
    arguments = ["estimate", str(path), "--gpu-memory", "80"]
    if torch_free:  # as the rest of estimate: torch poisoned in a fresh interpreter
        program = ("import sys; sys.modules['torch'] = None; from kubetrain.cli import main; "
                   f"sys.exit(main({arguments!r}))")
        ran = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                             timeout=60)
        return _Done(ran.returncode, ran.stdout, ran.stderr)
    code = main(arguments)
    out, err = capsys.readouterr()
    return _Done(code, out, err)


def _per_worker_gib(parameters: int, world: int, replicas: int, procs: int) -> float:
    """shard (fp32 weights + two AdamW moments, 1/world each, + 1 MiB of the rest)
    x 2 versions x (1 + replicas) x processes per worker."""
    shard = -(-parameters * 12 // world) + 2**20
    return shard * 2 * (1 + replicas) * procs / GIB


def test_the_tier_is_its_own_line_sized_at_min_replicas_and_at_the_asked_world(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    done = _estimate(tmp_path, _manifest({"preset": "llama-1b"},
                                         {"everySteps": 2, "replicas": 1}), capsys,
                     torch_free=True)
    assert done.returncode == 0, done.stdout + done.stderr
    parameters = parameter_count(PRESETS["llama-1b"].dims)
    line = next(line for line in done.stdout.splitlines()
                if "in-memory checkpoints (checkpoint.memory)" in line)
    assert float(line.split()[-1]) == round(_per_worker_gib(parameters, 4, 1, 2), 2)
    assert "x 2 versions x 2 copies (1 + replicas) x 2 processes per worker" in done.stdout
    at_eight = next(line for line in done.stdout.splitlines() if "at 8 processes" in line)
    assert f"{_per_worker_gib(parameters, 8, 1, 2):.2f}" in at_eight
    # Without the tier there is no such line.
    manifest = _manifest({"preset": "llama-1b"}, {})
    del manifest["spec"]["checkpoint"]["memory"]
    assert "in-memory checkpoints" not in _estimate(tmp_path, manifest, capsys).stdout


def test_a_tier_over_max_worker_memory_is_refused_with_its_numbers(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # A preset's size is known to the spec: its validation refuses it (exit 2).
    refused = _estimate(tmp_path, _manifest({"preset": "llama-1b"}, {
        "everySteps": 2, "replicas": 1, "maxWorkerMemory": "20Gi"}), capsys)
    assert refused.returncode == 2
    assert "spec.checkpoint.memory.maxWorkerMemory (20Gi) is less than the tier needs" in (
        refused.stderr)
    # A model.init job's size is known only from its config.json: estimate refuses it (1).
    dims = PRESETS["llama-1b"].dims
    folder = tmp_path / "pretrained"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(hf_config(dims, 4096, 0)))
    model = {"init": str(folder), "preset": "custom"}
    needed = _per_worker_gib(parameter_count(dims), 4, 1, 2)
    too_small = _estimate(tmp_path, _manifest(model, {
        "everySteps": 2, "replicas": 1, "maxWorkerMemory": "20Gi"}), capsys)
    assert too_small.returncode == 1, too_small.stdout + too_small.stderr
    assert ("does NOT fit spec.checkpoint.memory.maxWorkerMemory (20Gi, 20.00 GiB): the tier "
            "needs") in too_small.stdout
    assert f"= {needed:.2f} GiB per worker pod at 4 processes" in too_small.stdout
    fits = _estimate(tmp_path, _manifest(model, {
        "everySteps": 2, "replicas": 1, "maxWorkerMemory": "30Gi"}), capsys)
    assert fits.returncode == 0, fits.stdout + fits.stderr
    assert "does NOT fit" not in fits.stdout



def _staged(tmp_path: Path, gpu_memory: str, capsys: pytest.CaptureFixture[str]) -> list[str]:
    """The estimate's lines for llama-1b on one process with both tiers: S3 saves every 500
    steps, asynchronous, and the in-memory tier every 10 (it snapshots first)."""
    manifest = {"apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob",
                "metadata": {"name": "staged"},
                "spec": {"image": "x", "model": {"preset": "llama-1b"},
                         "workers": {"replicas": 1, "procsPerWorker": 1},
                         "data": {"train": "s3://d/train", "seqLen": 2048},
                         "optimization": {"microBatchSize": 4, "gradientAccumulationSteps": 1},
                         "checkpoint": {"uri": "s3://c/staged", "async": True,
                                        "everySteps": 500, "memory": {"everySteps": 10}}}}
    path = tmp_path / "staged.yaml"
    path.write_text(yaml.safe_dump(manifest))
    assert main(["estimate", str(path), "--gpu-memory", gpu_memory]) == 0
    return capsys.readouterr().out.splitlines()


def _path_of(lines: list[str], tier: str) -> str:
    return lines[lines.index(f"  {tier}") + 1].strip()


def test_estimate_says_how_each_tier_stages_on_the_gpu_and_counts_the_s3_staging_buffer(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    memory, s3 = "in-memory checkpoints (checkpoint.memory)", "S3 checkpoints (checkpoint.async)"
    roomy = _staged(tmp_path, "141", capsys)  # an H200: room for both shards on the GPU
    assert _path_of(roomy, memory).startswith("device-side first phase")
    assert _path_of(roomy, s3).startswith("device-side first phase")
    # Less room: the tier that snapshots first takes it, the other copies to the host.
    tight = _staged(tmp_path, "64", capsys)
    assert _path_of(tight, memory).startswith("device-side first phase")
    assert _path_of(tight, s3).startswith("overlapped host copy")
    assert _path_of(_staged(tmp_path, "48", capsys), memory).startswith("overlapped host copy")

    shard = -(-parameter_count(PRESETS["llama-1b"].dims) * 12 // 1) + 2**20
    buffer = next(line for line in roomy if line.startswith("  S3 staging buffer"))
    assert float(buffer.split()[-1]) == round(shard / GIB, 2)
    assert "x 1 processes per worker" in roomy[roomy.index(buffer) + 1]
