"""Model FLOPs utilisation of kubetrain on a GPU: the 1B preset at sequence length 2048.

    python bench/mfu.py [--steps 30] [--micro-batch 4]              # one GPU
    torchrun --nproc-per-node 8 bench/mfu.py                        # FSDP2 over 8 GPUs

Trains `llama-1b` (vocabulary 128256) in bf16 with torch.compile and strategy
fsdp through the real `Trainer`, on the standard library's sources prepared by
`kubetrain prepare`, and prints the tokens per second and MFU that kubetrain
itself reports (its metrics log), leaving out the compile warm-up. MFU is
against the device's peak dense bf16 FLOP/s (989 TFLOP/s for H100/H200); the goal
is >= 0.5 on one H100. With one process the model trains unwrapped under bf16
autocast (FSDP2 over a world of one would shard nothing); under torchrun with
several GPUs it is sharded with FSDP2. Without CUDA it prints why and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

import torch

from kubetrain.api.manifest import parse_job
from kubetrain.local.workspace import copy_stdlib_sources
from kubetrain.trainer import Trainer
from kubetrain.trainer.prepare import prepare

LOG_EVERY = 5
WARM_UP_INTERVALS = 2  # torch.compile and the allocator settle during the first steps


def corpus(folder: Path) -> str:
    """About 2 MB of the standard library's sources, tokenized with a 2048-token BPE."""
    texts = copy_stdlib_sources(folder / "text", max_bytes=2_000_000)
    return prepare([str(texts)], str(folder / "data"), vocab_size=2048,
                   validation_fraction=0.0, progress=False).train_uri


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--micro-batch", type=int, default=4)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/mfu.py measures GPU utilisation and needs CUDA: no CUDA device here, "
              "skipped.")
        return 0
    rank = int(os.environ.get("RANK", "0"))
    # Every rank prepares into its own folder; prepare is deterministic, so the data agree.
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        job = parse_job({
            "apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob",
            "metadata": {"name": "mfu"},
            "spec": {
                "image": "bench",
                "model": {"preset": "llama-1b", "vocabSize": 128_256},
                "data": {"train": corpus(folder), "seqLen": 2048},
                "optimization": {"maxSteps": args.steps, "warmupSteps": 5,
                                 "microBatchSize": args.micro_batch},
                "evaluation": {"everySteps": 0},
                "parallelism": {"strategy": "fsdp", "precision": "bf16", "compile": True},
                "checkpoint": {"uri": str(folder / "checkpoints"), "everySteps": 100_000,
                               "export": False},
                "metrics": {"logEverySteps": LOG_EVERY},
            },
        })
        log = folder / "metrics.jsonl"
        Trainer(job, metrics_log=log, serve_metrics=False).fit()
        if rank != 0:
            return 0
        events = [json.loads(line) for line in log.read_text().splitlines()]
    steps = [e for e in events if e["event"] == "step"][WARM_UP_INTERVALS:]
    tokens_per_second = statistics.mean(e["tokens_per_second"] for e in steps)
    mfu = statistics.mean(e["mfu"] for e in steps)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    print(f"device: {torch.cuda.get_device_name()} x {world}")
    print(f"llama-1b, seq 2048, micro-batch {args.micro_batch}, bf16, compile: "
          f"{tokens_per_second:,.0f} tokens/s, {tokens_per_second / world:,.0f} per GPU")
    print(f"MFU: {mfu:.1%}  (goal >= 50% on one H100)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
