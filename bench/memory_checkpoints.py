"""The in-memory checkpoint tier's cost: step time with a snapshot after every step against
the same steps without one, in one run.

    python bench/memory_checkpoints.py [--preset tiny] [--steps 20] [--rounds 5] [--batch 8]

One process, one thread, the trainer's own model (the preset's dimensions), AdamW and the
tier (`MemoryCheckpoints`, as the loop drives it: a snapshot of the model, the optimizer's
state, RNG and a data position, into a memory-mapped file under /dev/shm, committed by
its meta file) over a group of one. Steps alternate, one with a snapshot after it and one
without, and which of the two goes first alternates too, so machine noise hits both and
neither always follows a snapshot; the median step of each is compared. Prints the step
time of both, the train part of the steps with a snapshot apart from the snapshot's
blocking part (median and max), the ratio (goal <= 1.03 on CPU) and, as the run's own
noise floor, the ratio between the steps without a snapshot of alternate pairs (nothing
differs between them but noise). The commit and a partner copy run in the background and
are not part of the blocking time; with one process there is no partner.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from kubetrain.api.trainingjob import PRESETS, TrainingJobSpec
from kubetrain.trainer.architecture import build_model
from kubetrain.trainer.checkpoint import ModelState, RandomState
from kubetrain.trainer.memory_checkpoint import MemoryCheckpoints


class _Position:
    """A data position, as TokenDataset keeps it."""

    def __init__(self) -> None:
        self.position = 0

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = int(state["position"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--steps", type=int, default=20, help="step pairs per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)

    dims = PRESETS[args.preset].dims
    torch.manual_seed(0)
    model = build_model("transformer", dims, max_seq_len=args.seq_len)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    position = _Position()
    app_state = {"model": ModelState(model, optimizer), "data": position,
                 "rng": RandomState()}
    spec = TrainingJobSpec.model_validate({
        "image": "bench", "data": {"train": "s3://bench/train"},
        "checkpoint": {"uri": "s3://bench/checkpoints", "memory": {"everySteps": 1}}})
    root = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
    with tempfile.TemporaryDirectory(dir=root) as folder:
        tier = MemoryCheckpoints(spec, rank=0, world_size=1, folder=Path(folder))
        inputs = torch.randint(0, dims.vocab_size, (args.batch, args.seq_len))
        step = 0

        def train_step() -> None:
            nonlocal step
            loss = model(inputs, inputs) / inputs.numel()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            position.position = step

        for _ in range(3):  # warm up: allocator, optimizer state, the tier's mapped files
            train_step()
            tier.save(step, app_state)
        plain: list[float] = []
        tiered: list[float] = []
        trained: list[float] = []  # the train part of the steps with a snapshot
        blocking: list[float] = []
        for pair in range(args.rounds * args.steps):
            # Step by step, so drift hits both alike; which goes first alternates, so
            # neither always follows the other (a snapshot's copy leaves the caches cold).
            for with_tier in (False, True) if pair % 2 == 0 else (True, False):
                started = time.perf_counter()
                train_step()
                if with_tier:
                    trained.append(time.perf_counter() - started)
                    blocking.append(tier.save(step, app_state))
                (tiered if with_tier else plain).append(time.perf_counter() - started)
        tier.close()
        size = sum(path.stat().st_size for path in Path(folder).glob("*.data"))
    dist.destroy_process_group()

    base, snapshotted = statistics.median(plain), statistics.median(tiered)
    noise = statistics.median(plain[0::2]) / statistics.median(plain[1::2])
    print(f"model {args.preset}: {sum(p.numel() for p in model.parameters()):,} parameters, "
          f"{size / 2 ** 20:.1f} MiB in the tier's two slots")
    print(f"step without the tier   {base * 1000:8.2f} ms (median of {len(plain)})")
    print(f"step with a snapshot    {snapshotted * 1000:8.2f} ms (median of {len(tiered)})")
    print(f"  of which training     {statistics.median(trained) * 1000:8.2f} ms "
          f"({statistics.median(trained) / base:.3f} of a step without)")
    print(f"ratio                   {snapshotted / base:8.3f}  (goal <= 1.03)")
    print(f"noise floor             {noise:8.3f}  (steps without, alternate pairs against "
          "each other)")
    print(f"blocking per snapshot   {statistics.median(blocking) * 1000:8.2f} ms median, "
          f"{max(blocking) * 1000:.2f} ms max")


if __name__ == "__main__":
    main()
