"""The trainer's CUDA paths that no CPU test reaches, each a short real run on the GPU.

    python bench/gpu_checks.py          # skips without CUDA
    python bench/gpu_checks.py --cpu    # the same runs on the CPU, to check the script

- `dynamics+compile`: INL dynamics (model.dynamics) in bf16 with torch.compile;
- `distillation+compile`: a teacher trained and exported, then a student with INL
  dynamics distilled from it (spec.distillation) with torch.compile;
- `ssm-student+compile`: a state-space student (model.architecture ssm, sized from
  the teacher by model.fromTeacher) distilled from the same teacher with torch.compile.

Each prints its first and last loss and tokens/s, or FAILED with the error. Sized to
take seconds after compile: correctness of these paths on CUDA, not their speed.
(FSDP2 with NCCL is `torchrun --nproc-per-node N bench/mfu.py --variant bf16`.)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

import torch

from kubetrain.api.manifest import parse_job
from kubetrain.local.workspace import copy_stdlib_sources
from kubetrain.trainer import Trainer
from kubetrain.trainer.prepare import prepare

VOCAB = 2048
STEPS = 20


def job(name: str, train_uri: str, folder: Path, model: dict[str, Any],
        distillation: dict[str, Any] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "image": "bench",
        "model": {"vocabSize": VOCAB, **model},
        "data": {"train": train_uri, "seqLen": 512},
        "optimization": {"maxSteps": STEPS, "warmupSteps": 2, "microBatchSize": 8},
        "evaluation": {"everySteps": 0},
        "parallelism": {"precision": "bf16" if torch.cuda.is_available() else "fp32",
                        "compile": True},
        "checkpoint": {"uri": str(folder / name), "everySteps": 100_000},
        "metrics": {"logEverySteps": 5},
    }
    if distillation is not None:
        spec["distillation"] = distillation
    return {"apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob",
            "metadata": {"name": name}, "spec": spec}


def train(manifest: dict[str, Any], folder: Path) -> str:
    """Run a job; its first and last logged loss and its median tokens/s, as one line."""
    log = folder / f"{manifest['metadata']['name']}.jsonl"
    Trainer(parse_job(manifest), metrics_log=log, serve_metrics=False).fit()
    steps = [e for e in map(json.loads, log.read_text().splitlines()) if e["event"] == "step"]
    if not all(torch.isfinite(torch.tensor(e["loss"])) for e in steps):
        raise AssertionError(f"a loss is not finite: {[e['loss'] for e in steps]}")
    rates = sorted(e["tokens_per_second"] for e in steps)
    return (f"loss {steps[0]['loss']:.3f} -> {steps[-1]['loss']:.3f} over {STEPS} steps, "
            f"{rates[len(rates) // 2]:,.0f} tokens/s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="run on the CPU (checks the script)")
    args = parser.parse_args()
    if not args.cpu and not torch.cuda.is_available():
        print("bench/gpu_checks.py checks the trainer's CUDA paths: no CUDA device here, skipped.")
        return 0
    failures = 0
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        texts = copy_stdlib_sources(folder / "text", max_bytes=1_000_000)
        train_uri = prepare([str(texts)], str(folder / "data"), vocab_size=VOCAB,
                            validation_fraction=0.0, progress=False).train_uri
        student = {"preset": "custom", "dim": 256, "nLayers": 4, "nHeads": 4, "nKvHeads": 2,
                   "ffnDim": 768, "dynamics": {"enabled": True}}
        checks = {
            "dynamics+compile": lambda: train(job("dynamics", train_uri, folder, student),
                                              folder),
            "teacher (export)": lambda: train(job("teacher", train_uri, folder,
                                                  {"preset": "llama-125m"}), folder),
            "distillation+compile": lambda: train(job(
                "student", train_uri, folder, student,
                {"teacher": str(folder / "teacher" / "export")}), folder),
            "ssm-student+compile": lambda: train(job(
                "ssm-student", train_uri, folder,
                {"preset": "custom", "architecture": "ssm", "fromTeacher": True},
                {"teacher": str(folder / "teacher" / "export")}), folder),
        }
        for name, check in checks.items():
            try:
                print(f"{name:<22} ok: {check()}", flush=True)
            except Exception as error:
                traceback.print_exc()
                print(f"{name:<22} FAILED: {type(error).__name__}: {error}"[:600], flush=True)
                failures += 1
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
