"""What checkpoints cost a training step: the in-memory tier's snapshots and the S3 tier's
asynchronous saves, against the same steps without them, in one run.

    python bench/memory_checkpoints.py [--preset tiny] [--steps 20] [--rounds 5] [--batch 8]
    python bench/memory_checkpoints.py --device cuda --preset llama-1b

One process, one group of one, the trainer's own model (the preset's dimensions), AdamW
(fused on CUDA) and the tiers as the loop drives them: the in-memory tier
(`MemoryCheckpoints`: a snapshot of the model, the optimizer's state, RNG and a data
position into a memory-mapped file under /dev/shm, committed by its meta file) and the S3
tier (`Checkpointer.save(blocking=False)` into a local folder), both staging through
staging.py, whose wait the step takes right before its optimizer step, as the loop does.

On the CPU (the default; goal: ratio <= 1.03): steps alternate, one with a snapshot after
it and one without, and which of the two goes first alternates too, so machine noise hits
both and neither always follows a snapshot; the median step of each is compared. Prints
the step time of both, the train part of the steps with a snapshot apart from the
snapshot's blocking part (median and max), the ratio and, as the run's own noise floor, the
ratio between the steps without a snapshot of alternate pairs (nothing differs between
them but noise).

On CUDA (bf16 autocast, micro-batch --batch x --seq-len; defaults 4 x 2048): for each
staging path, the device-side first phase and the overlapped host copy alone, rounds of
`--steps` steps without snapshots, with one every 5 steps and with one every step, the
order rotating from round to round; each step is timed to the end of its device work.
Prints the plain step, each ratio (mean step against the plain mean; goals <= 1.02 and
<= 1.05 at every 5 steps for the two paths, <= 1.15 at every step), the blocking per
snapshot (what the snapshot's step and the one after it, which waits for the copy before
its optimizer step, take beyond two plain steps; goals <= 15 ms and <= 50 ms median), the
host time of `save()` itself, the device-to-host rate of a snapshot with nothing beside
it, and whether a snapshot taken at step N and restored after step N+1 ran holds step N's
state bit for bit. `--device cuda` without CUDA prints that it skipped and exits 0.

Both devices then print the S3 tier's row: the blocking part of `--s3-saves` asynchronous
saves (goal <= 50 ms on CUDA), the staging path taken, and the steps beside the background
upload against plain steps (goal within 5 %).
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from kubetrain.api.trainingjob import PRESETS, TrainingJobSpec
from kubetrain.trainer.architecture import build_model
from kubetrain.trainer.checkpoint import Checkpointer, ModelState, RandomState
from kubetrain.trainer.memory_checkpoint import MemoryCheckpoints
from kubetrain.trainer.staging import Staging

GB = 1e9


class _Position:
    """A data position, as TokenDataset keeps it."""

    def __init__(self) -> None:
        self.position = 0

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = int(state["position"])


@dataclass
class _Training:
    """The model, its optimizer and state, and one training step as the loop takes it."""

    device: torch.device
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    app_state: dict[str, Any]
    inputs: torch.Tensor
    position: _Position
    step: int = 0

    def train_step(self, staging: Staging) -> None:
        """Forward and backward, the wait for a snapshot in flight, the optimizer step."""
        autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if self.device.type == "cuda"
                    else contextlib.nullcontext())
        with autocast:
            loss = self.model(self.inputs, self.inputs) / self.inputs.numel()
        loss.backward()
        staging.before_update()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.position.position = self.step

    def synchronize(self) -> None:
        """Wait for the training stream's work (not the staging stream's), as the loop does."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def state_bytes(self) -> int:
        params = list(self.model.parameters())
        return sum(t.numel() * t.element_size() for t in params) + sum(
            value.numel() * value.element_size() for p in params
            for value in self.optimizer.state.get(p, {}).values()
            if isinstance(value, torch.Tensor))


def _spec(folder: Path) -> TrainingJobSpec:
    return TrainingJobSpec.model_validate({
        "image": "bench", "data": {"train": "s3://bench/train"},
        "checkpoint": {"uri": str(folder), "async": True, "keepLast": 1,
                       "memory": {"everySteps": 1}}})


def _build(args: argparse.Namespace, device: torch.device) -> _Training:
    dims = PRESETS[args.preset].dims
    torch.manual_seed(0)
    model = build_model("transformer", dims, max_seq_len=args.seq_len).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    position = _Position()
    app_state = {"model": ModelState(model, optimizer), "data": position, "rng": RandomState()}
    inputs = torch.randint(0, dims.vocab_size, (args.batch, args.seq_len), device=device)
    return _Training(device, model, optimizer, app_state, inputs, position)


def _memory_root(args: argparse.Namespace) -> Path | None:
    if args.memory_folder:
        return Path(args.memory_folder)
    return Path("/dev/shm") if Path("/dev/shm").is_dir() else None


def _room(folder: Path | None, needed: int, what: str) -> bool:
    """Whether `folder` (None: the temporary folder) has `needed` bytes free; says so if not."""
    free = shutil.disk_usage(folder or tempfile.gettempdir()).free
    if free >= needed:
        return True
    print(f"\n{what}: skipped, {folder or tempfile.gettempdir()} has {free / 2**30:.1f} GiB "
          f"free and needs {needed / 2**30:.1f} GiB (--memory-folder, --s3-folder)")
    return False


# --- the in-memory tier on the CPU: alternate steps ------------------------------------


def _cpu_tier(args: argparse.Namespace, training: _Training) -> None:
    staging = Staging(training.device)
    with tempfile.TemporaryDirectory(dir=_memory_root(args)) as folder:
        tier = MemoryCheckpoints(_spec(Path(folder) / "s3"), rank=0, world_size=1,
                                 folder=Path(folder), staging=staging)
        for _ in range(3):  # warm up: allocator, optimizer state, the tier's mapped files
            training.train_step(staging)
            tier.save(training.step, training.app_state)
        plain: list[float] = []
        tiered: list[float] = []
        trained: list[float] = []  # the train part of the steps with a snapshot
        blocking: list[float] = []
        for pair in range(args.rounds * args.steps):
            # Step by step, so drift hits both alike; which goes first alternates, so
            # neither always follows the other (a snapshot's copy leaves the caches cold).
            for with_tier in (False, True) if pair % 2 == 0 else (True, False):
                started = time.perf_counter()
                training.train_step(staging)
                if with_tier:
                    trained.append(time.perf_counter() - started)
                    blocking.append(tier.save(training.step, training.app_state))
                (tiered if with_tier else plain).append(time.perf_counter() - started)
        tier.close()
        size = sum(path.stat().st_size for path in Path(folder).glob("*.data"))

    base, snapshotted = statistics.median(plain), statistics.median(tiered)
    noise = statistics.median(plain[0::2]) / statistics.median(plain[1::2])
    print(f"model {args.preset}: {_parameters(training):,} parameters, "
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


def _parameters(training: _Training) -> int:
    return sum(p.numel() for p in training.model.parameters())


# --- the in-memory tier on CUDA: runs of steps, per staging path -----------------------


@dataclass
class _Run:
    """The step times of one run of steps, and which steps took a snapshot."""

    every: int  # 0: no snapshots
    times: list[float]
    snapshotted: list[int]  # indices into times
    saves: list[float]  # host seconds in save()


def _timed_steps(training: _Training, staging: Staging, tier: MemoryCheckpoints | None,
                 steps: int, every: int) -> _Run:
    run = _Run(every, [], [], [])
    for index in range(steps):
        started = time.perf_counter()
        training.train_step(staging)
        if tier is not None and every and (index + 1) % every == 0:
            training.synchronize()  # the loop's _snapshot: the step's work first
            saving = time.perf_counter()
            tier.save(training.step, training.app_state)
            run.saves.append(time.perf_counter() - saving)
            run.snapshotted.append(index)
        training.synchronize()
        run.times.append(time.perf_counter() - started)
    return run


def _cuda_tier(args: argparse.Namespace, training: _Training, device_phase: bool,
               folder: Path) -> None:
    staging = Staging(training.device, device_phase=device_phase)
    tier = MemoryCheckpoints(_spec(folder / "s3"), rank=0, world_size=1, folder=folder,
                             staging=staging)
    for _ in range(3):  # warm up: registration of each slot's pages, the device buffer
        training.train_step(staging)
        tier.save(training.step, training.app_state)
    tier.wait()
    runs: dict[int, list[_Run]] = {0: [], 5: [], 1: []}
    order = list(runs)
    for round_ in range(args.rounds):
        for every in order[round_ % 3:] + order[:round_ % 3]:
            runs[every].append(_timed_steps(training, staging, tier, args.steps, every))
            tier.wait()
    # Nothing beside it: a snapshot from its call until it has landed.
    training.synchronize()
    started = time.perf_counter()
    tier.save(training.step, training.app_state)
    tier.wait()
    alone = time.perf_counter() - started
    exact = _bit_for_bit(training, staging, tier)
    tier.close(discard=True)

    plain = [t for run in runs[0] for t in run.times]
    base, base_mean = statistics.median(plain), statistics.mean(plain)
    path = tier.staging_path or "in place"
    print(f"\n{path}: the in-memory tier, {training.state_bytes() / 2**30:.2f} GiB a snapshot")
    print(f"  step without snapshots        {base * 1000:8.1f} ms median, "
          f"{base_mean * 1000:.1f} ms mean")
    for every, goal in ((5, "1.02" if device_phase else "1.05"), (1, "1.15")):
        steps = [t for run in runs[every] for t in run.times]
        # The snapshot's step and the next, which waits for the copy before its optimizer
        # step (at every step, each step is both).
        blocked = [run.times[i] - base if every == 1 else
                   run.times[i] + (run.times[i + 1] if i + 1 < len(run.times) else base)
                   - 2 * base for run in runs[every] for i in run.snapshotted]
        saves = [s for run in runs[every] for s in run.saves]
        label = f"a snapshot every {every} step{'s' if every > 1 else ''}"
        print(f"  {label:<30}{statistics.mean(steps) * 1000:8.1f} ms mean step, ratio "
              f"{statistics.mean(steps) / base_mean:.3f} (goal <= {goal})")
        print(f"    blocking per snapshot       {statistics.median(blocked) * 1000:8.1f} ms "
              f"median, {max(blocked) * 1000:.1f} ms max (goal <= "
              f"{'15' if device_phase else '50'} ms)")
        print(f"    host time in save()         {statistics.median(saves) * 1000:8.1f} ms "
              f"median, {max(saves) * 1000:.1f} ms max")
    print(f"  a snapshot alone, to landed   {alone * 1000:8.1f} ms, "
          f"{training.state_bytes() / alone / GB:.1f} GB/s device to host")
    print(f"  restored snapshot holds its step's state bit for bit: {'yes' if exact else 'NO'}")


def _bit_for_bit(training: _Training, staging: Staging, tier: MemoryCheckpoints) -> bool:
    """Snapshot step N, run step N+1 (which changes the weights) before anything waits,
    restore: the first parameter and the last optimizer moment equal step N's."""
    params = list(training.model.parameters())
    training.synchronize()
    tier.save(training.step, training.app_state)
    taken = training.step
    first = params[0].detach().to("cpu", copy=True)
    moment = training.optimizer.state[params[-1]]["exp_avg"].to("cpu", copy=True)
    training.train_step(staging)
    training.synchronize()
    changed = not torch.equal(params[0].detach().cpu(), first)
    restored = tier.load_latest(training.app_state)
    return (changed and restored is not None and restored.step == taken
            and torch.equal(params[0].detach().cpu().view(torch.uint8), first.view(torch.uint8))
            and torch.equal(training.optimizer.state[params[-1]]["exp_avg"].cpu(), moment))


# --- the S3 tier's staging ---------------------------------------------------------------


def _s3_row(args: argparse.Namespace, training: _Training) -> None:
    if not _room(args.s3_folder, 2 * training.state_bytes() + 2**30, "the S3 tier's row"):
        return
    staging = Staging(training.device)
    window = max(args.steps, 10)
    with tempfile.TemporaryDirectory(dir=args.s3_folder) as folder:
        committed: list[float] = []
        checkpointer = Checkpointer(_spec(Path(folder)), rank=0, world_size=1, staging=staging,
                                    on_commit=lambda _: committed.append(time.perf_counter()))
        plain: list[float] = []
        beside: list[float] = []
        blocking: list[float] = []
        background: list[float] = []
        for save in range(args.s3_saves + 1):  # the first: registration, allocation
            plain += [seconds for _, seconds in _steps(training, staging, window)]
            training.synchronize()
            started = time.perf_counter()
            checkpointer.save(training.step, training.app_state, blocking=False)
            blocked = time.perf_counter() - started
            ran = _steps(training, staging, window)
            checkpointer.wait()
            if save:
                blocking.append(blocked)
                background.append(committed[-1] - started)
                # The steps that began before the commit: those beside the upload.
                beside += ([seconds for began, seconds in ran if began < committed[-1]]
                           or [ran[0][1]])
        checkpointer.close()
    area = checkpointer.staging_path or "in place"
    print(f"\nS3 tier, asynchronous saves into a local folder ({area}):")
    print(f"  blocking per save             {statistics.median(blocking) * 1000:8.1f} ms "
          f"median, {max(blocking) * 1000:.1f} ms max (goal <= 50 ms on CUDA; "
          f"{statistics.median(blocking) / statistics.median(plain):.2f} steps)")
    print(f"  steps beside the upload       {statistics.median(beside) * 1000:8.1f} ms median "
          f"against {statistics.median(plain) * 1000:.1f} ms: ratio "
          f"{statistics.median(beside) / statistics.median(plain):.3f} (goal <= 1.05)")
    print(f"  save to committed             {statistics.median(background):8.2f} s median "
          f"({len(beside)} steps beside it in {len(blocking)} saves)")


def _steps(training: _Training, staging: Staging, count: int) -> list[tuple[float, float]]:
    """`count` steps: when each began, and its seconds."""
    times = []
    for _ in range(count):
        started = time.perf_counter()
        training.train_step(staging)
        training.synchronize()
        times.append((started, time.perf_counter() - started))
    return times


@contextlib.contextmanager
def _group_of_one() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--steps", type=int, default=None,
                        help="step pairs per round (CPU, default 20); steps a run (CUDA, 20)")
    parser.add_argument("--rounds", type=int, default=None, help="default 5 (CPU), 2 (CUDA)")
    parser.add_argument("--batch", type=int, default=None, help="default 8 (CPU), 4 (CUDA)")
    parser.add_argument("--seq-len", type=int, default=None,
                        help="default 256 (CPU), 2048 (CUDA)")
    parser.add_argument("--s3-saves", type=int, default=None, help="default 5 (CPU), 2 (CUDA)")
    parser.add_argument("--s3-folder", default=None,
                        help="where the S3 tier's checkpoints go (default: a temporary folder)")
    parser.add_argument("--memory-folder", default=None,
                        help="where the in-memory tier's slots go (default: /dev/shm)")
    args = parser.parse_args()
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("bench/memory_checkpoints.py --device cuda: CUDA is not available here, "
              "skipped (nothing measured)")
        return
    defaults = {"steps": 20, "rounds": 2 if cuda else 5, "batch": 4 if cuda else 8,
                "seq_len": 2048 if cuda else 256, "s3_saves": 2 if cuda else 5}
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if cuda:
        device = torch.device("cuda", torch.cuda.current_device())
        print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, "
              f"{args.preset}, micro-batch {args.batch} x {args.seq_len}, bf16 autocast")
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")
    with _group_of_one():
        training = _build(args, device)
        if cuda:
            for _ in range(3):  # warm up: the allocator, the optimizer's state
                training.train_step(Staging(device))
            root, size = _memory_root(args), training.state_bytes()
            for device_phase in (True, False):
                if _room(root, 2 * size + 2**30, "the in-memory tier's two slots"):
                    with tempfile.TemporaryDirectory(dir=root) as folder:
                        _cuda_tier(args, training, device_phase, Path(folder))
        else:
            _cpu_tier(args, training)
        _s3_row(args, training)


if __name__ == "__main__":
    main()
