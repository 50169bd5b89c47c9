"""A restart's rendezvous: torchrun's c10d backend against kubetrain's (its own rounds).

    .venv/bin/python -u bench/rendezvous.py [--kills 4] [--runs 2]

Two torchrun agents on this machine (2 nodes x 1 process, a real gloo group doing an
all-reduce every 50 ms), as two worker pods: kill -9 of node 1's worker, as a trainer
kill, and the time until each agent's new worker process started and until both had formed
the new group, `--kills` times in a run; runs alternate between the backends, so the
machine's load falls on both alike. What separates the backends is the rendezvous: the
new processes' imports are the same. Prints each backend's median and their ratio.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kubetrain.local.launch import free_port  # noqa: E402
from kubetrain.protocol import RENDEZVOUS_BACKEND  # noqa: E402

WORKER = """
import os, sys, time
launched = time.time()
import torch, torch.distributed as dist
dist.init_process_group("gloo")
total = torch.ones(1)
dist.all_reduce(total)
os.write(1, f"ready {dist.get_rank()} launched {launched:.3f} formed {time.time():.3f}\\n".encode())
while True:
    dist.all_reduce(total)
    time.sleep(0.05)
"""


def restarts(backend: str, kills: int, script: Path) -> list[tuple[float, float]]:
    """Per kill: seconds until the later of the two new workers started, and until both
    had formed the group (their first all-reduce done)."""
    endpoint = f"127.0.0.1:{free_port()}"
    lines: list[str] = []
    agents = []
    for node in range(2):
        agent = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
             "--nproc-per-node", "1", "--rdzv-backend", backend, "--rdzv-endpoint", endpoint,
             "--rdzv-id", "bench", "--max-restarts", str(kills), "--monitor-interval", "0.1",
             str(script)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            # A fresh store for the workers at each round, as in the pods (worker_env.torchrun_env).
            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                 "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
        agents.append(agent)
        threading.Thread(target=lambda a=agent: lines.extend(a.stdout or ()), daemon=True).start()
        time.sleep(0.5 if node == 0 else 0)  # node 0 hosts the store

    def ready_since(first: int, timeout: float = 120) -> list[str]:
        deadline = time.monotonic() + timeout
        while True:
            ready = [line for line in lines[first:] if line.startswith("ready")]
            if len(ready) >= 2:
                return ready
            if time.monotonic() > deadline:
                raise SystemExit("no group formed:\n" + "".join(lines))
            time.sleep(0.02)

    try:
        ready_since(0)
        figures = []
        for _ in range(kills):
            time.sleep(1.0)
            [worker] = subprocess.check_output(["pgrep", "-P", str(agents[1].pid)]).split()
            first, killed = len(lines), time.time()
            os.kill(int(worker), signal.SIGKILL)
            ready = ready_since(first)
            launched = max(_figure("launched", line) for line in ready)
            formed = max(_figure("formed", line) for line in ready)
            figures.append((launched - killed, formed - killed))
        return figures
    finally:
        for agent in agents:
            agent.kill()
            agent.wait()


def _figure(name: str, line: str) -> float:
    found = re.search(rf"{name} ([\d.]+)", line)
    assert found is not None, line
    return float(found[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=4, help="kills per run")
    parser.add_argument("--runs", type=int, default=2, help="runs per backend, alternating")
    args = parser.parse_args()
    backends = ("c10d", RENDEZVOUS_BACKEND)
    seen: dict[str, list[tuple[float, float]]] = {backend: [] for backend in backends}
    with tempfile.TemporaryDirectory() as folder:
        script = Path(folder) / "worker.py"
        script.write_text(WORKER)
        for run in range(args.runs):
            for backend in backends:
                figures = restarts(backend, args.kills, script)
                seen[backend] += figures
                print(f"run {run + 1}, {backend:>9}: " + "  ".join(
                    f"started {a:.2f}s formed {b:.2f}s" for a, b in figures), flush=True)
    medians = {backend: tuple(statistics.median(f[i] for f in figures) for i in (0, 1))
               for backend, figures in seen.items()}
    for backend, (started, formed) in medians.items():
        print(f"{backend:>9}: median after a worker's kill: both new workers started "
              f"{started:.2f}s, group formed {formed:.2f}s")
    base, ours = medians["c10d"][1], medians[RENDEZVOUS_BACKEND][1]
    print(f"group formed, {RENDEZVOUS_BACKEND} / c10d: {ours / base:.2f} "
          f"({base - ours:.2f}s sooner)")


if __name__ == "__main__":
    main()
