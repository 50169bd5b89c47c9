"""A restart in place under kubetrain.trainer.launch against plain torchrun, on this machine.

One torchrun agent with 2 ranks (tiny preset, gloo on CPU, a checkpoint every 4 steps,
allowed one restart in place), as in a worker pod: at step 8 one rank is killed with
SIGKILL, torchrun restarts the group in place, and the seconds from the kill to rank 0's
"resumed from" line and to its first step after it are timed. The same job runs under
`python -m torch.distributed.run -m kubetrain.trainer` (each new rank a new interpreter
importing torch and the loop) and under `python -m kubetrain.trainer.launch` (each rank
forked from the server that imported them once), alternating, `--runs` times each.

    .venv/bin/python -u bench/restart_in_place.py [--runs 3]
    python -u bench/restart_in_place.py --processes 1 --precision bf16   # one GPU: NCCL

Prints each run's two figures and the medians, and the launcher's median over plain
torchrun's (goal for issue 33: the trainer kill under 4 s on the whole loop, where this
is most of the time). Beside them, the CPU seconds the whole run took, every process of
it counted (this process is their subreaper, so even an orphaned fork server is reaped
into its children's usage): what a pod's start and restart cost a loaded node.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
KILL_AT_STEP = 8
_PR_SET_CHILD_SUBREAPER = 36

COMMANDS = {
    "torchrun": [sys.executable, "-m", "torch.distributed.run"],
    "launch": [sys.executable, "-m", "kubetrain.trainer.launch"],
}


def corpus(folder: Path) -> str:
    """The tests' small corpus: stdlib sources, a 2048-entry tokenizer (kubetrain prepare)."""
    from kubetrain.local.workspace import copy_stdlib_sources
    from kubetrain.trainer.prepare import prepare

    text = copy_stdlib_sources(folder / "text", max_bytes=300_000, max_file_bytes=20_000)
    return prepare([str(text)], str(folder / "corpus"), vocab_size=2048,
                   shard_tokens=16 * 1024, validation_fraction=0.1, progress=False).train_uri


def write_job(folder: Path, train: str, precision: str) -> Path:
    from kubetrain.local.launch import free_port

    spec = {
        "image": "kubetrain/trainer:bench",
        "model": {"preset": "tiny"},
        "data": {"train": train, "seqLen": 64},
        "optimization": {"maxSteps": 16, "microBatchSize": 8, "warmupSteps": 5},
        "evaluation": {"everySteps": 0},
        "parallelism": {"precision": precision},
        "checkpoint": {"uri": str(folder / "checkpoints"), "everySteps": 4, "export": False},
        "metrics": {"port": free_port(), "logEverySteps": 1},
    }
    job = folder / "job.yaml"
    job.write_text(yaml.safe_dump({"apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob",
                                   "metadata": {"name": "restart"}, "spec": spec}))
    return job


def ranks(agent: int) -> list[int]:
    """The agent's training processes (named kt-rank-N), children or grandchildren."""
    from kubetrain.local.node import descendants, rank_processes

    return list(rank_processes(descendants(agent)))


def children_cpu() -> float:
    """CPU seconds of every process reaped so far below this one."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def reap_orphans() -> None:
    """Wait for every process left below this one (orphans come here: the subreaper)."""
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


def one_run(launcher: str, folder: Path, train: str, processes: int,
            precision: str, trace: bool) -> tuple[float, float, float]:
    """Seconds from the kill to rank 0's resume and to its first step after it, and the
    CPU seconds of the whole run."""
    cpu_before = children_cpu()
    job = write_job(folder, train, precision)
    log = folder / "metrics.jsonl"
    command = [*COMMANDS[launcher], "--standalone", f"--nproc-per-node={processes}",
               "--max-restarts=1",
               *(["-m", "kubetrain.trainer"] if launcher == "torchrun" else []),
               str(job), "--metrics-log", str(log)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    agent = subprocess.Popen(command, env=env, cwd=folder, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    lines: list[tuple[float, str]] = []

    def read() -> None:
        assert agent.stdout is not None
        for line in agent.stdout:
            lines.append((time.monotonic(), line))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 300
        while not any(event.get("event") == "step" and event["step"] >= KILL_AT_STEP
                      for event in events(log)):
            if agent.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{launcher}: never reached step {KILL_AT_STEP}:\n"
                                   + "".join(line for _, line in lines[-40:]))
            time.sleep(0.02)
        killed = time.monotonic()
        os.kill(max(ranks(agent.pid)), signal.SIGKILL)
        agent.wait(timeout=300)
    finally:
        if agent.poll() is None:
            agent.kill()
    reader.join(timeout=10)
    reap_orphans()
    cpu = children_cpu() - cpu_before
    after = [(at - killed, line) for at, line in lines if at >= killed]
    if trace:
        print("".join(f"  {at:6.2f}s  {line[:160].rstrip()}\n" for at, line in after), end="")
    resumed = next(at for at, line in after if line.startswith("resumed from "))
    stepped = next(at for at, line in after if at >= resumed and line.startswith("step "))
    if agent.returncode != 0:
        raise RuntimeError(f"{launcher}: exit {agent.returncode}")
    return resumed, stepped, cpu


def events(log: Path) -> list[dict[str, object]]:
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="runs of each launcher (default 3)")
    parser.add_argument("--processes", type=int, default=2,
                        help="training processes under the agent (default 2; 1 on one GPU)")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"],
                        help="the job's parallelism.precision (default fp32; bf16 on a GPU)")
    parser.add_argument("--trace", action="store_true",
                        help="print every output line after the kill, with its time")
    args = parser.parse_args()
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1)
    results: dict[str, list[tuple[float, float, float]]] = {name: [] for name in COMMANDS}
    with tempfile.TemporaryDirectory(prefix="kubetrain-restart-") as tmp:
        print("preparing the corpus", flush=True)
        train = corpus(Path(tmp))
        for run in range(args.runs):
            for launcher in COMMANDS:
                folder = Path(tmp) / f"{launcher}-{run}"
                folder.mkdir()
                resumed, stepped, cpu = one_run(launcher, folder, train, args.processes,
                                                args.precision, args.trace)
                results[launcher].append((resumed, stepped, cpu))
                print(f"run {run + 1} {launcher:<8}  kill → resumed {resumed:5.2f}s  "
                      f"→ first step {stepped:5.2f}s  CPU of the run {cpu:5.2f}s", flush=True)
    medians = {name: tuple(statistics.median(figures) for figures in zip(*runs, strict=True))
               for name, runs in results.items()}
    print(f"\nkill -9 of one of {args.processes} ranks, restart in place "
          f"({args.runs} runs each, medians):")
    for name, (resumed, stepped, cpu) in medians.items():
        print(f"  {name:<8}  resumed {resumed:5.2f}s  first step {stepped:5.2f}s  "
              f"CPU {cpu:5.2f}s")
    ratio = medians["launch"][1] / medians["torchrun"][1]
    print(f"launch / torchrun, kill to first step: {ratio:.2f}")
    print(f"launch / torchrun, CPU of the run: {medians['launch'][2] / medians['torchrun'][2]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
