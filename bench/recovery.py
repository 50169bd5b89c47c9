"""Whole-loop recovery: seconds from a fault until training advances, steps redone, goodput.

Runs the whole loop of tests/e2e/test_whole_loop.py on this machine (kmock's emulator
with the stand-in scheduler and node lifecycle controller of tests/cluster; the operator
as a process; the node agent running the pods; moto's S3 over HTTP) and, for the same
2-worker `tiny` job (60 steps, a checkpoint every 4):

- none: an uninterrupted run, the baseline;
- b: kill -9 of worker 1's trainer at step 6 (torchrun restarts it in place);
- b-pod: kill -9 of worker 1's whole container (trainer and torchrun) at step 6: the
  pod fails and the operator replaces it;
- f: worker 1's node loses power at step 6 (heartbeats stop, its processes die).

For each it prints the seconds from the fault until rank 0 prints a step after
resuming (goal for b: ≤ 60 s), the steps redone, and the goodput: the time of the
steps kept (each step's own duration, as rank 0 printed it, last run of each step)
over the wall time from `kubectl apply` to Succeeded; also the ratio of that goodput
to the uninterrupted run's, and the operator's own status.goodput.ratio.

Run: `.venv/bin/python bench/recovery.py` (as root: the node agent makes network
namespaces; about 4 minutes on 2 cores).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests" / "cluster"), str(REPO / "tests" / "e2e")]

import test_whole_loop as loop  # noqa: E402
from controllers import NodeLifecycle, Scheduler  # noqa: E402
from emulator import EmulatedCluster  # noqa: E402

STEPS = 60
FAULT_AT = 6


def _kill_trainer(cluster: loop.Cluster, name: str) -> None:
    os.kill(cluster.trainer_pid(f"{name}-worker-1"), signal.SIGKILL)


def _kill_container(cluster: loop.Cluster, name: str) -> None:
    for pid in cluster.agent.pod(f"{name}-worker-1", loop.NAMESPACE).processes():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _lose_node(cluster: loop.Cluster, name: str) -> None:
    worker = next(p for p in cluster.pods(name) if p["metadata"]["name"].endswith("-1"))
    cluster.agent.lose_node(worker["spec"]["nodeName"])


def _kept_step_seconds(lines: list[str]) -> float:
    """The duration of each step as rank 0 printed it, the last time it ran."""
    kept: dict[int, float] = {}
    for line in lines:
        if match := re.match(r"step (\d+)/\d+ \|.* \| ([\d.]+) ms/step", line):
            kept[int(match.group(1))] = float(match.group(2)) / 1000
    return sum(kept.values())


def run(cluster: loop.Cluster, name: str,
        fault: Callable[[loop.Cluster, str], None] | None) -> dict[str, float]:
    """One job, with `fault` at step FAULT_AT; its recovery figures."""
    started = time.monotonic()
    cluster.apply(loop.training_job(name, cluster.s3, optimization={"maxSteps": STEPS}))
    recovery = redone = 0.0
    if fault is not None:
        loop._wait_for_printed_step(cluster, name, FAULT_AT)
        fault(cluster, name)
        faulted = time.monotonic()
        cluster.wait_for("training to advance again",
                         lambda: loop._advanced_after_resume(cluster.trainer_lines(name)), 300,
                         every=0.1)
        recovery = time.monotonic() - faulted
    cluster.wait_for_phase(name, "Succeeded", timeout=600)
    wall = time.monotonic() - started
    lines = cluster.trainer_lines(name)
    if fault is not None:
        redone = loop._resume_and_redone(lines)[1]
    status = cluster.job(name)["status"]
    for node in cluster.agent.nodes:
        if node.lost:
            cluster.agent.restore_node(node.name)
    cluster.delete(name)
    return {"recovery": recovery, "redone": redone, "wall": wall,
            "goodput": _kept_step_seconds(lines) / wall,
            "operator_goodput": float((status.get("goodput") or {}).get("ratio") or "nan")}


def main() -> None:
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # moto's request log
    with tempfile.TemporaryDirectory(prefix="kubetrain-recovery-") as folder, \
            EmulatedCluster(Path(folder)) as api, Scheduler(api=api.api_client()), \
            NodeLifecycle(api=api.api_client()), \
            loop.whole_loop(api, Path(folder) / "loop") as cluster:
        results = {label: run(cluster, f"bench-{label}", fault) for label, fault in
                   (("none", None), ("b", _kill_trainer), ("b-pod", _kill_container),
                    ("f", _lose_node))}
    base = results["none"]["goodput"]
    print(f"whole loop, 2 workers x 1 process, tiny preset, {STEPS} steps, checkpoint every "
          f"{loop.EVERY}; fault at step {FAULT_AT}")
    print(f"{'scenario':<38}{'fault→advancing':>16}{'redone':>8}{'wall':>8}{'goodput':>9}"
          f"{'/none':>7}{'operator':>10}")
    names = {"none": "none (uninterrupted)", "b": "b: kill -9 of worker 1's trainer",
             "b-pod": "b: kill -9 of worker 1's container",
             "f": "f: worker 1's node lost"}
    for label, figures in results.items():
        print(f"{names[label]:<38}{figures['recovery']:>15.1f}s{figures['redone']:>8.0f}"
              f"{figures['wall']:>7.0f}s{figures['goodput']:>9.2f}"
              f"{figures['goodput'] / base:>7.2f}{figures['operator_goodput']:>10.2f}")


if __name__ == "__main__":
    main()
