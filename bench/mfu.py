"""Model FLOPs utilisation of kubetrain on a GPU: the 1B preset at sequence length 2048.

    python bench/mfu.py [--steps 30] [--micro-batch 4] [--variants bf16-full,bf16,fp8]
    torchrun --nproc-per-node 8 bench/mfu.py [--variant bf16]       # FSDP2 over 8 GPUs

Trains `llama-1b` (vocabulary 128256) with torch.compile and strategy fsdp through
the real `Trainer`, on the standard library's sources prepared by `kubetrain
prepare`, and prints the tokens per second and MFU that kubetrain itself reports
(its metrics log, wall time between synchronised log steps), leaving out the
compile warm-up. MFU is against the device's peak dense bf16 FLOP/s (989 TFLOP/s
for H100/H200), for fp8 too, so the variants compare directly; the goal is >= 0.5
on one H100 in bf16, and fp8 >= 1.3x bf16's tokens/s.

Variants (one fresh process each, so each has its own compile and peak memory):
- `bf16-full`: bf16, the loss through the full logits (KUBETRAIN_OUTPUT_LOSS=full,
  what the trainer did before loss.py);
- `bf16-chunked`: bf16, the pure-PyTorch chunked loss;
- `bf16`: bf16, the loss the trainer picks (Liger's fused one when installed);
- `fp8`: parallelism.precision fp8 (torchao), the loss the trainer picks.
Each prints its peak GPU memory (the allocator's peak reservation plus what the
process holds outside it: CUDA context, cuBLAS workspaces) next to `kubetrain
estimate` for the same job (goal: within 10 %).

With one process the model trains unwrapped under bf16 autocast (FSDP2 over a
world of one would shard nothing); under torchrun with several GPUs it is sharded
with FSDP2 and runs the one `--variant` given. Without CUDA it prints why and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

import torch

from kubetrain.api.manifest import parse_job
from kubetrain.api.trainingjob import TrainingJob
from kubetrain.local.workspace import copy_stdlib_sources
from kubetrain.trainer import Trainer
from kubetrain.trainer.estimate import GIB, estimate_memory, job_plan
from kubetrain.trainer.loss import OUTPUT_LOSS_ENV
from kubetrain.trainer.prepare import prepare

LOG_EVERY = 5
WARM_UP_INTERVALS = 2  # torch.compile and the allocator settle during the first steps
VARIANTS = {  # name: (precision, KUBETRAIN_OUTPUT_LOSS)
    "bf16-full": ("bf16", "full"),
    "bf16-chunked": ("bf16", "chunked"),
    "bf16": ("bf16", "auto"),
    "fp8": ("fp8", "auto"),
}


def corpus(folder: Path) -> str:
    """About 2 MB of the standard library's sources, tokenized with a 2048-token BPE."""
    texts = copy_stdlib_sources(folder / "text", max_bytes=2_000_000)
    return prepare([str(texts)], str(folder / "data"), vocab_size=2048,
                   validation_fraction=0.0, progress=False).train_uri


def training_job(train_uri: str, folder: Path, precision: str, steps: int,
                 micro_batch: int) -> TrainingJob:
    return parse_job({
        "apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob",
        "metadata": {"name": "mfu"},
        "spec": {
            "image": "bench",
            "model": {"preset": "llama-1b", "vocabSize": 128_256},
            "data": {"train": train_uri, "seqLen": 2048},
            "optimization": {"maxSteps": steps, "warmupSteps": 5,
                             "microBatchSize": micro_batch},
            "evaluation": {"everySteps": 0},
            "parallelism": {"strategy": "fsdp", "precision": precision, "compile": True},
            "checkpoint": {"uri": str(folder / "checkpoints"), "everySteps": 100_000,
                           "export": False},
            "metrics": {"logEverySteps": LOG_EVERY},
        },
    })


def run_variant(variant: str, train_uri: str, steps: int, micro_batch: int) -> dict[str, Any]:
    """Train one variant in this process; what rank 0 measured (empty on other ranks)."""
    precision, output_loss = VARIANTS[variant]
    os.environ[OUTPUT_LOSS_ENV] = output_loss
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        job = training_job(train_uri, folder, precision, steps, micro_batch)
        log = folder / "metrics.jsonl"
        torch.cuda.reset_peak_memory_stats()
        Trainer(job, metrics_log=log, serve_metrics=False).fit()
        if int(os.environ.get("RANK", "0")) != 0:
            return {}
        events = [json.loads(line) for line in log.read_text().splitlines()]
    free, total = torch.cuda.mem_get_info()
    outside_allocator = (total - free) - torch.cuda.memory_reserved()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    (start,) = [e for e in events if e["event"] == "start"]
    estimate = estimate_memory(job.spec, world, job_plan(job.spec, world),
                               start["output_loss"])
    steps_logged = [e for e in events if e["event"] == "step"][WARM_UP_INTERVALS:]
    return {
        "variant": variant, "world": world, "output_loss": start["output_loss"],
        "tokens_per_second": statistics.median(e["tokens_per_second"] for e in steps_logged),
        "mfu": statistics.median(e["mfu"] for e in steps_logged),
        "step_time": statistics.median(e["step_time"] for e in steps_logged),
        "peak_allocated": torch.cuda.max_memory_allocated(),
        "peak": torch.cuda.max_memory_reserved() + outside_allocator,
        "estimate": estimate.total,
    }


def report(result: dict[str, Any]) -> None:
    per_gpu = result["tokens_per_second"] / result["world"]
    print(f"{result['variant']:<13} loss {result['output_loss']:<8} "
          f"{result['tokens_per_second']:>9,.0f} tokens/s ({per_gpu:,.0f} per GPU), "
          f"{result['step_time'] * 1000:.0f} ms/step, MFU {result['mfu']:.1%}; "
          f"peak {result['peak'] / GIB:.1f} GiB (allocated {result['peak_allocated'] / GIB:.1f}),"
          f" estimate {result['estimate'] / GIB:.1f} GiB, measured/estimate "
          f"{result['peak'] / result['estimate']:.2f}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--variants", default="bf16-full,bf16,fp8",
                        help=f"comma-separated, of {', '.join(VARIANTS)} (one process)")
    parser.add_argument("--variant", choices=VARIANTS, default=None,
                        help="run only this one, in this process (what torchrun ranks do)")
    parser.add_argument("--train", help=argparse.SUPPRESS)  # a prepared corpus, from the parent
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/mfu.py measures GPU utilisation and needs CUDA: no CUDA device here, "
              "skipped.")
        return 0
    print(f"device: {torch.cuda.get_device_name()} x {os.environ.get('WORLD_SIZE', '1')}; "
          f"llama-1b, seq 2048, micro-batch {args.micro_batch}, compile", flush=True)

    if args.variant is not None or "WORLD_SIZE" in os.environ:
        # One variant in this process: under torchrun every rank runs it.
        with tempfile.TemporaryDirectory() as scratch:
            # Every rank prepares into its own folder; prepare is deterministic, so they agree.
            train = args.train or corpus(Path(scratch))
            result = run_variant(args.variant or "bf16", train, args.steps, args.micro_batch)
        if result:
            report(result)
            if args.result:
                Path(args.result).write_text(json.dumps(result))
        return 0

    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        train = corpus(Path(scratch))
        for variant in args.variants.split(","):
            out = Path(scratch) / f"{variant}.json"
            done = subprocess.run(
                [sys.executable, __file__, "--variant", variant, "--train", train,
                 "--steps", str(args.steps), "--micro-batch", str(args.micro_batch),
                 "--result", str(out)], capture_output=True, text=True)
            if done.returncode != 0 or not out.exists():
                print(f"{variant:<13} FAILED (exit {done.returncode}):\n"
                      f"{done.stdout[-2000:]}{done.stderr[-4000:]}", flush=True)
                continue
            results[variant] = json.loads(out.read_text())
            report(results[variant])
    if "bf16" in results:
        bf16 = results["bf16"]
        print(f"bf16 MFU {bf16['mfu']:.1%} (goal >= 50% on one H100)")
        for variant in ("bf16-full", "bf16-chunked", "fp8"):
            if variant in results:
                ratio = results[variant]["tokens_per_second"] / bf16["tokens_per_second"]
                print(f"{variant} / bf16 tokens/s: {ratio:.2f}"
                      + ("  (goal >= 1.3)" if variant == "fp8" else ""))
    return 0 if results else 1


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except Exception:
        traceback.print_exc()
        raise
