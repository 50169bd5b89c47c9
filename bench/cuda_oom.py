"""CUDA out of memory on a real GPU: the class the trainer reports, and the healed micro-batch.

    python bench/cuda_oom.py

`kubetrain run` of a job whose micro-batch cannot fit one GPU (64 sequences of 4096
tokens through a ~0.4B-parameter model, bf16, no activation checkpointing: some 200
GiB of activations). The trainer catches torch.OutOfMemoryError, writes its class into
the termination message and exits; the runner reads it and restarts with half the
micro-batch until one fits. Prints each failure's class as the trainer reported it,
the micro-batch history and the run's summary. Skips (exit 0) without CUDA.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import yaml

JOB = {
    "apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob",
    "metadata": {"name": "cuda-oom", "annotations": {"kubetrain.io/prepare-from": "python-stdlib"}},
    "spec": {
        "image": "bench", "workers": {"replicas": 1},
        "model": {"preset": "custom", "dim": 2048, "nLayers": 8, "nHeads": 16},
        "data": {"train": "data/train", "seqLen": 4096},
        "optimization": {"maxSteps": 3, "microBatchSize": 64, "gradientAccumulationSteps": 1,
                         "warmupSteps": 1},
        "parallelism": {"precision": "bf16"},
        "evaluation": {"everySteps": 0},
        "checkpoint": {"uri": "checkpoints", "everySteps": 100, "export": False},
        "metrics": {"logEverySteps": 1},
    },
}


def main() -> int:
    if not torch.cuda.is_available():
        print("cuda_oom: skipped, no CUDA device")
        return 0
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "job.yaml").write_text(yaml.safe_dump(JOB))
        done = subprocess.run([sys.executable, "-m", "kubetrain", "run", "job.yaml"], cwd=folder,
                              capture_output=True, text=True, timeout=1800)
        log = Path(folder) / "runs" / "cuda-oom" / "metrics.jsonl"
        events = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
        unexpected = [e for e in events if e["event"] == "failure"
                      and e["class"] != "CUDAOutOfMemory"]
        if unexpected:  # why the worker failed otherwise: the end of its logs
            for worker_log in sorted((Path(folder) / "runs" / "cuda-oom" / "logs").glob("*")):
                lines = worker_log.read_text(errors="replace").splitlines()
                # the trainer's own traceback, not torchrun's agent's that follows it
                first = next((i for i, line in enumerate(lines) if "Traceback" in line), 0)
                print(f"--- {worker_log.name}, from its first traceback:")
                print("\n".join(lines[first:first + 60]))
    failures = [e for e in events if e["event"] == "failure"]
    for failure in failures:
        print(f"failure class {failure['class']} at micro-batch {failure['micro_batch_size']}: "
              f"{failure['reason']}")
    print(f"micro-batch history: {[f['micro_batch_size'] for f in failures]} -> healed; "
          f"kubetrain run exited {done.returncode}")
    print("\n".join(done.stdout.splitlines()[-12:]))
    return 0 if failures and failures[0]["class"] == "CUDAOutOfMemory" else 1


if __name__ == "__main__":
    sys.exit(main())
