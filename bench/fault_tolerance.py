"""Replica groups under torchft (spec.faultTolerance) against a whole-group restart.

    .venv/bin/python -u bench/fault_tolerance.py [--steps 160] [--groups 2]

One `tiny` job (gloo on CPU, one CPU thread per process, a checkpoint every 20 steps)
runs four times on this machine, each process a real torchrun worker
(`kubetrain.trainer.launch`):

1. **plain.** One torchrun group of --groups ranks, uninterrupted: the baseline. Its
   strategy is ddp, as replica groups of one rank are: each rank holds the whole model
   and one all-reduce of the gradients crosses them.
2. **groups.** --groups replica groups of one rank each, beside torchft's lighthouse
   (`pod_conventions.lighthouse_command`, 1 s heartbeat timeout), uninterrupted. Same
   processes, same global batch: its median step over plain's is the per-step cost of
   the quorum and the all-reduce across groups (goal 1.05 or less on the CPU).
3. **groups, faulted.** The last group has two faults:
   - at step --steps/6, its rank gets SIGKILL and torchrun restarts it in place (a trainer
     kill);
   - at step --steps/3, the whole group, agent and rank, gets SIGKILL and the bench
     starts it again (a container or node loss).
4. **plain, faulted.** The same two faults hit the plain job's last rank, then its whole
   group. This is today's recovery: every rank goes back to the last checkpoint.

For each fault it prints:

- the **pause**: the longest wait, after the kill, for the job's step counter (group 0's in
  the groups runs, rank 0's in the plain ones) to pass the highest step it had reached,
  less a median step. This is what the fault cost the healthy part. The goal is 1 s or
  less for groups.
- the **rejoin**: the seconds from the kill to the group's `healed` event (groups only).

Each faulted run's goodput is its uninterrupted twin's wall time over its own, from the
start to the job's last step. Its final validation loss is compared with the twin's curve
(evaluated EVAL_POINTS times) where the twin had trained as many samples: the groups' run
passes over the absent group's share of each degraded step, which a comparison at the same
step would count against it (4.5 % higher at step 300 in a run here, a third of whose steps
were degraded). Tolerance: LOSS_TOLERANCE. About 3
minutes on 2 cores. Needs torchft (`pip install 'kubetrain[fault-tolerance]'`); without
it, it says so and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from restart_in_place import corpus, ranks  # noqa: E402  (the tests' corpus, a bench's helper)

CHECKPOINT_EVERY = 20
HEARTBEAT_MS = 1000
# How far a faulted run's final validation loss may be from its uninterrupted twin's. The
# groups' run passes over the absent group's samples (a few dozen steps of one group's
# share) and so trains on slightly different data; the plain run redoes steps exactly.
LOSS_TOLERANCE = 0.02
EVAL_POINTS = 15
MICRO_BATCH = 8


@dataclass
class Run:
    """One run's processes and what they logged: by group (plain: one group)."""

    folder: Path
    jobs: list[Path]
    lighthouse: subprocess.Popen[bytes] | None = None
    agents: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)
    kills: list[tuple[str, float]] = field(default_factory=list)  # (fault, unix time)
    wall: float = 0.0  # seconds from the first start to the job's last step

    def events(self, group: int, kind: str) -> list[dict[str, Any]]:
        log = self.jobs[group].with_name("metrics.jsonl")
        if not log.exists():
            return []
        # (A line still being written, without its newline, is read next time.)
        return [event for line in log.read_text().splitlines(keepends=True)
                if line.endswith("\n") and line.strip()
                for event in [json.loads(line)] if event["event"] == kind]


def write_jobs(folder: Path, train: str, steps: int, groups: int, replicated: bool,
               eval_every: int) -> list[Path]:
    """The job as `groups` replica groups of one rank (one file each: its own metrics
    port), or as one group of `groups` ranks; evaluated every `eval_every` steps."""
    from kubetrain.local.launch import free_port

    paths = []
    for group in range(groups if replicated else 1):
        spec: dict[str, Any] = {
            "image": "kubetrain/trainer:bench",
            "model": {"preset": "tiny"},
            "data": {"train": train, "seqLen": 64},
            "optimization": {"maxSteps": steps, "microBatchSize": MICRO_BATCH, "warmupSteps": 5},
            "evaluation": {"everySteps": eval_every, "batches": 8},
            "parallelism": {"precision": "fp32", "strategy": "ddp"},
            "checkpoint": {"uri": str(folder / "checkpoints"), "everySteps": CHECKPOINT_EVERY,
                           "export": False},
            "metrics": {"port": free_port(), "logEverySteps": 1},
        }
        if replicated:
            spec["workers"] = {"replicas": groups}
            spec["faultTolerance"] = {"replicaGroups": groups,
                                      "heartbeatTimeoutMilliseconds": HEARTBEAT_MS}
        path = folder / f"group-{group}" / "job.yaml"
        path.parent.mkdir(parents=True)
        path.write_text(yaml.safe_dump({"apiVersion": "kubetrain.io/v1alpha1",
                                        "kind": "TrainingJob", "metadata": {"name": "ft"},
                                        "spec": spec}))
        paths.append(path)
    return paths


def start(run: Run, group: int, processes: int, lighthouse: str | None) -> None:
    from kubetrain.pod_conventions import LIGHTHOUSE_ENV, REPLICA_GROUP_ENV

    job = run.jobs[group]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    if lighthouse is not None:
        env |= {REPLICA_GROUP_ENV: str(group), LIGHTHOUSE_ENV: lighthouse}
    output = job.with_name(f"output-{len(run.kills)}.txt").open("wb")
    run.agents[group] = subprocess.Popen(
        [sys.executable, "-m", "kubetrain.trainer.launch", "--standalone",
         f"--nproc-per-node={processes}", "--max-restarts=2", str(job),
         "--metrics-log", str(job.with_name("metrics.jsonl"))],
        env=env, cwd=job.parent, stdout=output, stderr=subprocess.STDOUT,
        start_new_session=True)


def lose(agent: subprocess.Popen[bytes]) -> None:
    """SIGKILL the agent and every process under it at once, as a lost node."""
    from kubetrain.local.node import descendants

    for pid in [agent.pid, *descendants(agent.pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    agent.wait()


def one_run(folder: Path, train: str, steps: int, groups: int, replicated: bool,
            faulted: bool) -> Run:
    from kubetrain.api.manifest import load_job
    from kubetrain.local.launch import free_port
    from kubetrain.pod_conventions import lighthouse_command

    # The uninterrupted runs' loss curve (an evaluation every EVAL_POINTS-th of the run);
    # the faulted runs' final loss only, out of the faults' way.
    eval_every = steps if faulted else max(1, steps // EVAL_POINTS)
    run = Run(folder, write_jobs(folder, train, steps, groups, replicated, eval_every))
    address = None
    if replicated:
        port = free_port()
        command = lighthouse_command(load_job(run.jobs[0]), bind=f"127.0.0.1:{port}")
        run.lighthouse = subprocess.Popen(
            [str(Path(sys.executable).with_name(command[0])), *command[1:]],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        address = f"http://127.0.0.1:{port}"
    started = time.time()
    for group in range(len(run.jobs)):
        start(run, group, 1 if replicated else groups, address)
    last = len(run.jobs) - 1
    try:
        if faulted:
            for fault, at_step in (("trainer kill", steps // 6), ("group loss", steps // 3)):
                wait_for_step(run, last, at_step)
                run.kills.append((fault, time.time()))
                if fault == "trainer kill":  # the last rank: torchrun restarts it in place
                    os.kill(max(ranks(run.agents[last].pid)), signal.SIGKILL)
                else:
                    lose(run.agents[last])
                    start(run, last, 1 if replicated else groups, address)
        for group, agent in run.agents.items():
            if agent.wait(timeout=600) != 0:
                raise RuntimeError(f"{folder.name} group {group}: exit {agent.returncode}")
    finally:
        for agent in run.agents.values():
            if agent.poll() is None:
                lose(agent)
        if run.lighthouse is not None:
            run.lighthouse.kill()
            run.lighthouse.wait()
    # Until the job reached its last step: in the groups runs the first group there (a
    # group started again may have to start up before it can end).
    run.wall = min(event["time"] for group in range(len(run.jobs))
                   for event in run.events(group, "step") if event["step"] == steps) - started
    return run


def wait_for_step(run: Run, group: int, step: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not any(event["step"] >= step for event in run.events(group, "step")):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{run.folder.name}: group {group} never reached step {step}")
        time.sleep(0.02)


def median_step(run: Run) -> float:
    times = [event["time"] for event in run.events(0, "step")][10:]
    return statistics.median(b - a for a, b in itertools.pairwise(times))


def pauses(run: Run, step_time: float) -> list[float]:
    """Per fault: the longest wait after the kill for group 0 (rank 0) to pass the highest
    step it had reached, until the next fault, less a median step."""
    reached = [(event["time"], event["step"]) for event in run.events(0, "step")]
    found = []
    ends = [at for _, at in run.kills[1:]] + [float("inf")]
    for (_, killed), until in zip(run.kills, ends, strict=True):
        best = max((step for at, step in reached if at < killed), default=0)
        last_progress, longest = killed, 0.0
        for at, step in reached:
            if killed <= at < until and step > best:
                longest = max(longest, at - last_progress)
                best, last_progress = step, at
        found.append(longest - step_time)
    return found


def rejoins(run: Run) -> list[float]:
    """Per fault: the seconds from the kill to the last group's next `healed`."""
    healed = [event["time"] for event in run.events(len(run.jobs) - 1, "healed")]
    return [min((at for at in healed if at > killed), default=float("nan")) - killed
            for _, killed in run.kills]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="steps of each run")
    parser.add_argument("--groups", type=int, default=2, help="replica groups (ranks of plain)")
    args = parser.parse_args()
    if importlib.util.find_spec("torchft") is None:
        print("skipped: torchft is not installed (pip install 'kubetrain[fault-tolerance]')")
        return 0
    with tempfile.TemporaryDirectory(prefix="kubetrain-ft-bench-") as tmp:
        print("preparing the corpus", flush=True)
        train = corpus(Path(tmp))
        runs = {}
        for name, replicated, faulted in (("plain", False, False), ("groups", True, False),
                                          ("groups, faulted", True, True),
                                          ("plain, faulted", False, True)):
            folder = Path(tmp) / name.replace(", ", "-")
            folder.mkdir()
            runs[name] = run = one_run(folder, train, args.steps, args.groups, replicated,
                                       faulted)
            print(f"{name:<16} {run.wall:6.1f}s wall, median step "
                  f"{median_step(run) * 1000:6.1f} ms", flush=True)
        report(runs, batch=MICRO_BATCH * args.groups)
    return 0


def final_val_loss(run: Run) -> float:
    """Group 0's (rank 0's) validation loss at the last step."""
    return float(run.events(0, "eval")[-1]["val_loss"])


def val_loss_at(run: Run, step: float) -> float:
    """The uninterrupted `run`'s validation loss at `step`, between its evaluations."""
    points = [(event["step"], event["val_loss"]) for event in run.events(0, "eval")]
    for (a, loss_a), (b, loss_b) in itertools.pairwise(points):
        if a <= step <= b:
            return float(loss_a + (loss_b - loss_a) * (step - a) / (b - a))
    raise ValueError(f"step {step} is outside the evaluated {points[0][0]}..{points[-1][0]}")


def steps_trained(run: Run, steps: int, batch: int) -> float:
    """The run's steps less the whole-batch equivalent of the samples its groups passed
    over (the absent group's share of each degraded step; group 0's count)."""
    quorums = run.events(0, "quorum")
    skipped = quorums[-1]["skipped_samples"] if quorums else 0
    return steps - skipped / batch


def report(runs: dict[str, Run], batch: int) -> None:
    """The figures of the module docstring (the runs' logs are still there); `batch`: the
    samples of a whole step."""
    cost = median_step(runs["groups"]) / median_step(runs["plain"])
    print(f"\nper-step cost of the quorum, groups / plain median step: {cost:.3f} (goal <= 1.05)")
    for name in ("groups, faulted", "plain, faulted"):
        run, twin = runs[name], runs[name.split(",")[0]]
        print(f"{name}: goodput {twin.wall / run.wall:.2f} of the uninterrupted run "
              f"({run.wall - twin.wall:+.1f}s)")
        steps = run.events(0, "eval")[-1]["step"]
        equal = steps_trained(run, steps, batch)
        ratio = final_val_loss(run) / val_loss_at(twin, equal)
        print(f"  final validation loss {final_val_loss(run):.4f}; uninterrupted "
              f"{final_val_loss(twin):.4f} at step {steps}, {val_loss_at(twin, equal):.4f} at "
              f"step {equal:.1f} (as many samples trained): {ratio:.4f} "
              f"(tolerance {1 - LOSS_TOLERANCE:.2f} to {1 + LOSS_TOLERANCE:.2f})")
        lost = pauses(run, median_step(twin))
        joined = rejoins(run) if name.startswith("groups") else [float("nan")] * len(lost)
        for (fault, _), pause, rejoin in zip(run.kills, lost, joined, strict=True):
            print(f"  {fault:<13} pause {pause:5.2f}s"
                  + (f", rejoin {rejoin:5.2f}s" if rejoin == rejoin else ""))


if __name__ == "__main__":
    sys.exit(main())
