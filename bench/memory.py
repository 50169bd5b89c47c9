"""Peak memory of a training step, measured, next to what `kubetrain estimate` predicts.

    python bench/memory.py [--seq-len 1024] [--micro-batch 2]

A large-vocabulary model of small depth (vocabulary 128256, dim 512, 2 blocks, fp32
on CPU) trains two steps (forward, backward, clip, AdamW step; the second is the
steady state, with the optimizer state held) in a fresh subprocess per variant, once
with the loss through the full logits (`full`, what the trainer did before loss.py)
and once chunked (`chunked`, the default). Each subprocess reports its peak resident
memory above what it held before building the model (torch and the interpreter); the
estimate is `estimate_memory` for the same job on one process without its 1 GiB
allowance for a CUDA context.
Prints measured / estimated per variant (goal: within 10 %) and full / chunked.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from typing import Any

from kubetrain.api.manifest import parse_job
from kubetrain.api.trainingjob import TrainingJobSpec
from kubetrain.trainer.estimate import GIB, OutputLossName, estimate_memory, job_plan

VARIANTS: tuple[OutputLossName, ...] = ("full", "chunked")
STEPS = 2  # the first step creates the optimizer state; the second holds it during backward


def job(seq_len: int, micro_batch: int) -> TrainingJobSpec:
    return parse_job({
        "apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob",
        "metadata": {"name": "memory"},
        "spec": {
            "image": "bench",
            "model": {"preset": "custom", "dim": 512, "nLayers": 2, "nHeads": 8,
                      "nKvHeads": 8, "ffnDim": 1536, "vocabSize": 128_256,
                      "tieEmbeddings": False, "ropeTheta": 500_000.0},
            "data": {"train": "file:///unused", "seqLen": seq_len},
            "optimization": {"microBatchSize": micro_batch, "gradientAccumulationSteps": 1},
            "parallelism": {"strategy": "fsdp", "precision": "fp32"},
            "checkpoint": {"uri": "file:///unused"},
        },
    }).spec


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(variant: str, seq_len: int, micro_batch: int) -> dict[str, Any]:
    """Training steps in this process; peak resident bytes above the starting point."""
    import torch

    from kubetrain.trainer.loss import IMPLEMENTATIONS, OutputLoss
    from kubetrain.trainer.model import Transformer
    from kubetrain.trainer.optim import build_optimizer

    spec = job(seq_len, micro_batch)
    torch.manual_seed(0)
    tokens = torch.randint(0, spec.model.resolve().vocab_size, (micro_batch, seq_len + 1))
    baseline = _rss_bytes()
    if resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 > baseline * 1.05:
        raise RuntimeError("the process peaked before the step: the baseline would be wrong")

    model = Transformer(spec.model.resolve(), max_seq_len=seq_len)
    model.output_loss = OutputLoss(variant, IMPLEMENTATIONS[variant])
    optimizer = build_optimizer(model, spec.optimization, 1e-4, torch.device("cpu"))
    for _ in range(STEPS):
        loss = model(tokens[:, :-1], tokens[:, 1:]) / (micro_batch * seq_len)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return {"variant": variant, "peak": peak - baseline, "loss": float(loss)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(measure(args.worker, args.seq_len, args.micro_batch)))
        return 0

    spec = job(args.seq_len, args.micro_batch)
    dims = spec.model.resolve()
    print(f"fp32 training steps on CPU: vocabulary {dims.vocab_size}, dim {dims.dim}, "
          f"{dims.n_layers} blocks, {args.micro_batch} x {args.seq_len} tokens")
    print(f"  {'loss':<10}{'measured GiB':>14}{'estimate GiB':>14}{'measured/estimate':>20}")
    measured: dict[str, int] = {}
    for variant in VARIANTS:
        done = subprocess.run(
            [sys.executable, __file__, "--worker", variant, "--seq-len", str(args.seq_len),
             "--micro-batch", str(args.micro_batch)],
            capture_output=True, text=True, check=True,
            env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")})
        result = json.loads(done.stdout.splitlines()[-1])
        measured[variant] = result["peak"]
        estimate = estimate_memory(spec, 1, job_plan(spec, 1), variant)
        predicted = estimate.total - estimate.context  # no CUDA context on a CPU
        print(f"  {variant:<10}{result['peak'] / GIB:>14.2f}{predicted / GIB:>14.2f}"
              f"{result['peak'] / predicted:>20.3f}")
    print(f"peak memory full / chunked: {measured['full'] / measured['chunked']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
