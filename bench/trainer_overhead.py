"""Trainer overhead: kubetrain's step time against a minimal hand-written PyTorch loop.

    python bench/trainer_overhead.py [--steps 60] [--rounds 3]

Both train the same model (same dimensions, seed and initial weights) with AdamW
and gradient clipping on the same batches from the same prepared shards, in this
process, one thread. kubetrain's time per step is what its metrics log reports
(fetch, forward/backward, clip, step, schedule, metrics, the agreed stop flag);
the baseline's is timed around the same work written as plainly as possible.
Rounds alternate the two so that machine noise hits both; the best round of each
is compared. Prints both times and the ratio (goal <= 1.05 on CPU).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kubetrain.api.manifest import parse_job
from kubetrain.api.trainingjob import TrainingJobSpec
from kubetrain.local.workspace import copy_stdlib_sources
from kubetrain.trainer import Trainer
from kubetrain.trainer.data import TokenDataset
from kubetrain.trainer.model import Transformer
from kubetrain.trainer.prepare import prepare

LOG_EVERY = 10


def corpus(folder: Path) -> str:
    """About 300 KB of the standard library's sources, prepared with a 2048-token BPE."""
    texts = copy_stdlib_sources(folder / "text", max_bytes=300_000)
    prepared = prepare([str(texts)], str(folder / "data"), vocab_size=2048,
                       shard_tokens=64 * 1024, validation_fraction=0.0, progress=False)
    return prepared.train_uri


def job_spec(train_uri: str, folder: Path, steps: int) -> TrainingJobSpec:
    manifest = {
        "apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob",
        "metadata": {"name": "overhead"},
        "spec": {
            "image": "bench",
            "model": {"preset": "custom", "dim": 128, "nLayers": 4, "nHeads": 8, "nKvHeads": 4,
                      "vocabSize": 2048, "tieEmbeddings": True},
            "data": {"train": train_uri, "seqLen": 128},
            "optimization": {"maxSteps": steps, "microBatchSize": 8, "warmupSteps": 2},
            "evaluation": {"everySteps": 0},
            "parallelism": {"precision": "fp32"},
            "checkpoint": {"uri": str(folder / "checkpoints"), "everySteps": 100_000,
                           "export": False},
            "metrics": {"logEverySteps": LOG_EVERY},
        },
    }
    return parse_job(manifest).spec


def kubetrain_step_time(spec: TrainingJobSpec, folder: Path) -> float:
    """Seconds per step as kubetrain logs them, leaving out the first (warm-up) interval."""
    log = folder / "metrics.jsonl"
    log.unlink(missing_ok=True)
    Trainer(spec, metrics_log=log, serve_metrics=False).fit()
    events = [json.loads(line) for line in log.read_text().splitlines()]
    steps = [event for event in events if event["event"] == "step"]
    return statistics.mean(event["step_time"] for event in steps[1:])


def baseline_step_time(spec: TrainingJobSpec) -> float:
    """Seconds per step of the plainest loop that does the same training."""
    opt = spec.optimization
    torch.manual_seed(opt.seed)
    model = Transformer(spec.model.resolve(), max_seq_len=spec.data.seq_len)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=opt.betas,
                                  weight_decay=opt.weight_decay)
    data = TokenDataset(spec.data.train, seq_len=spec.data.seq_len,
                        micro_batch_size=opt.micro_batch_size, seed=opt.seed)
    times: list[float] = []
    for _ in range(opt.max_steps):
        started = time.perf_counter()
        inputs, targets = next(data)
        loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if len(times) % LOG_EVERY == 0:
            float(loss.detach())  # kubetrain reads the loss back once per log interval
        times.append(time.perf_counter() - started)
    data.close()
    return statistics.mean(times[LOG_EVERY:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        spec = job_spec(corpus(folder), folder, args.steps)
        baseline, kubetrain = [], []
        for round_ in range(args.rounds):
            baseline.append(baseline_step_time(spec))
            kubetrain.append(kubetrain_step_time(
                spec.model_copy(update={"checkpoint": spec.checkpoint.model_copy(
                    update={"uri": str(folder / f"checkpoints-{round_}")})}), folder))
    best_baseline, best_kubetrain = min(baseline), min(kubetrain)
    print(f"hand-written loop: {best_baseline * 1000:.1f} ms/step   "
          f"(rounds: {', '.join(f'{t * 1000:.1f}' for t in baseline)})")
    print(f"kubetrain:         {best_kubetrain * 1000:.1f} ms/step   "
          f"(rounds: {', '.join(f'{t * 1000:.1f}' for t in kubetrain)})")
    print(f"ratio kubetrain / hand-written: {best_kubetrain / best_baseline:.3f}  (goal <= 1.05)")


if __name__ == "__main__":
    main()
