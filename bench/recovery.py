"""Whole-loop recovery: seconds from a fault until training advances, steps redone, goodput.

Runs the whole loop of tests/cluster/whole_loop.py on this machine (kmock's emulator
with the stand-in scheduler and node lifecycle controller of tests/cluster; the operator's
pod and the workers' pods as containers of the images built by images/offline, run by
the node agent in containerd; moto's S3 over HTTP) and, for the same
2-worker `tiny` job (60 steps, a checkpoint every 4):

- none: an uninterrupted run, the baseline;
- b: kill -9 of worker 1's trainer at step 6 (torchrun restarts it in place);
- b-pod: kill -9 of worker 1's whole container (trainer and torchrun) at step 6: the
  pod fails and the operator replaces it;
- f: worker 1's node loses power at step 6 (heartbeats stop, its processes die);
- f0: worker 0's node instead, the rendezvous host's: the whole group is recreated (not
  run unless --rows names it).
- own: an own-code job (spec.trainer: the whole loop's FSDP2 + DCP script, a save every 4
  steps, uploads every second), worker 1's container killed at step 6; the steps redone
  are the script's own (its goodput column is blank: it prints no step times).

For each it prints the seconds from the fault until rank 0 prints a step after
resuming (goal for b: ≤ 60 s), the steps redone, and the goodput: the time of the
steps kept (each step's own duration, as rank 0 printed it, last run of each step)
over the wall time from `kubectl apply` to Succeeded; also the ratio of that goodput
to the uninterrupted run's, and the operator's own status.goodput.ratio. The container
kill is also broken down (goal: ≤ 15 s from the kill to the next step): the node agent
reports the pod Failed, the operator deletes it, the pod is gone, its replacement is
created, its container started, rank 0 resumed (rendezvous and checkpoint load done),
and the first step after it. So is the node loss (goal: ≤ 15 s, issue 33): the node goes
silent; the operator notices (status.lastFailure NodeLost, or worker 1 replaced: its
trainer's lifeline stopped beating, or the node was marked NotReady); the group stopped
(worker 0's trainer, blocked in a collective with the lost rank, has exited); the
replacement pod runs; rank 0 resumed; the first step.

After the node loss's stages it prints what explains them: each line rank 0's pod printed
(torchrun's and the trainer's) and each line the operator logged, from the fault until the
first step, with the seconds after the fault at which it was seen or logged; and so for
the trainer kill, rank 0's pod's lines (torchrun's timestamps and the trainer's start-up).

Run: `.venv/bin/python bench/recovery.py` (as root: containers and network namespaces;
builds the images first if they are not cached; about 5 minutes on 2 cores);
`--rows none,f` runs only those rows (none, b, b-pod, f, f0, own; none is the baseline of
the goodput ratio, and is always run).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
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
sys.path[:0] = [str(REPO / "tests" / "cluster"), str(REPO / "images" / "offline")]

import whole_loop as loop  # noqa: E402
from build_images import build_images  # noqa: E402
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


def _lose_node(cluster: loop.Cluster, name: str, index: int = 1) -> None:
    worker = next(p for p in cluster.pods(name) if p["metadata"]["name"].endswith(f"-{index}"))
    cluster.agent.lose_node(worker["spec"]["nodeName"])


def _lose_node_of_worker_0(cluster: loop.Cluster, name: str) -> None:
    _lose_node(cluster, name, 0)


# The container-kill path, stage by stage: each is the first moment its check holds.
STAGES = ("failure seen", "pod deleting", "pod deleted", "pod created", "container started",
          "resumed", "first step")


def _container_kill_stages(cluster: loop.Cluster, name: str, old_uid: str,
                           faulted: float) -> dict[str, float]:
    """Seconds from the fault to each of STAGES, polling the API and rank 0's log."""
    worker = f"{name}-worker-1"
    seen: dict[str, float] = {}
    deadline = faulted + 300
    while "first step" not in seen and time.monotonic() < deadline:
        pods = {pod["metadata"]["name"]: pod for pod in cluster.pods(name)}
        pod = pods.get(worker)
        uid = pod["metadata"]["uid"] if pod else None
        phase = (pod or {}).get("status", {}).get("phase")
        lines = cluster.trainer_lines(name)
        resumed = [i for i, line in enumerate(lines) if line.startswith("resumed from ")]
        checks = {
            "failure seen": uid != old_uid or phase == "Failed",
            "pod deleting": uid != old_uid or bool(pod["metadata"].get("deletionTimestamp")),
            "pod deleted": uid != old_uid,
            "pod created": uid not in (None, old_uid),
            "container started": uid not in (None, old_uid) and phase == "Running",
            "resumed": bool(resumed),
            "first step": bool(resumed) and bool(loop.steps_printed(lines[resumed[-1]:])),
        }
        now = time.monotonic() - faulted
        for stage in STAGES:
            if checks[stage] and stage not in seen:
                seen[stage] = now
        time.sleep(0.05)
    return seen


# The node-loss path, stage by stage, as for the container kill.
NODE_LOSS_STAGES = ("silent", "noticed", "group stopped", "replacement running", "resumed",
                    "first step")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def _node_loss_stages(cluster: loop.Cluster, name: str, old_uid: str, survivor: int,
                      faulted: float, timeline: list[tuple[float, str]]) -> dict[str, float]:
    """Seconds from the node going silent to each of NODE_LOSS_STAGES; each line rank 0's
    pod prints meanwhile goes to `timeline` with the seconds at which it was first seen."""
    worker = f"{name}-worker-1"
    seen: dict[str, float] = {"silent": 0.0}
    deadline = faulted + 300
    printed = len(cluster.trainer_lines(name))
    while "first step" not in seen and time.monotonic() < deadline:
        pods = {pod["metadata"]["name"]: pod for pod in cluster.pods(name)}
        pod = pods.get(worker)
        uid = pod["metadata"]["uid"] if pod else None
        replaced = uid != old_uid
        phase = (pod or {}).get("status", {}).get("phase")
        failure = (cluster.job(name).get("status") or {}).get("lastFailure") or {}
        lines = cluster.trainer_lines(name)
        resumed = [i for i, line in enumerate(lines) if line.startswith("resumed from ")]
        timeline += [(time.monotonic() - faulted, line) for line in lines[printed:]]
        printed = len(lines)
        checks = {
            "noticed": replaced or failure.get("class") == "NodeLost"
            or bool((pod or {}).get("metadata", {}).get("deletionTimestamp")),
            "group stopped": not _alive(survivor),
            "replacement running": uid not in (None, old_uid) and phase == "Running",
            "resumed": bool(resumed),
            "first step": bool(resumed) and bool(loop.steps_printed(lines[resumed[-1]:])),
        }
        now = time.monotonic() - faulted
        for stage in NODE_LOSS_STAGES[1:]:
            if checks[stage] and stage not in seen:
                seen[stage] = now
        time.sleep(0.05)
    return seen


def _print_stages(title: str, order: tuple[str, ...], stages: dict[str, float]) -> None:
    print(f"\n{title}, stage by stage (seconds after the fault; each stage's time since the "
          "one before):")
    previous = 0.0
    for stage in order:
        if stage in stages:
            print(f"  {stage:<20}{stages[stage]:>7.2f}s{stages[stage] - previous:>+8.2f}s")
            previous = stages[stage]
        else:
            print(f"  {stage:<20}{'not seen':>8}")


def _rank0_until_advancing(cluster: loop.Cluster, name: str, faulted: float,
                           before: int) -> list[tuple[float, str]]:
    """Until training advances after a resume: each line rank 0's pod printed after its
    first `before` (those of before the fault), with the seconds after the fault at which
    it was first seen (polled every 0.05 s)."""
    seen: list[tuple[float, str]] = []
    deadline = faulted + 300
    while time.monotonic() < deadline:
        lines = cluster.trainer_lines(name)
        seen += [(time.monotonic() - faulted, line) for line in lines[before + len(seen):]]
        if loop.advanced_after_resume(lines):
            return seen
        time.sleep(0.05)
    raise AssertionError(f"waited 300s for training to advance again\n{cluster.report()}")


def operator_lines(cluster: loop.Cluster, since: float, until: float) -> list[tuple[float, str]]:
    """The operator's log lines stamped between `since` and `until` (seconds since the
    epoch), each with its seconds after `since` (its stamps are UTC, to the millisecond)."""
    found = []
    for line in cluster.operator.log_tail(5000).splitlines():
        try:
            stamp = datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").replace(
                tzinfo=datetime.UTC).timestamp()
        except ValueError:
            continue
        if since - 1 <= stamp <= until:
            found.append((stamp - since, line[24:]))
    return found


def print_timeline(title: str, lines: list[tuple[float, str]], width: int = 150) -> None:
    print(f"\n{title} (seconds after the fault):")
    for at, line in lines:
        print(f"  {at:>7.2f}s  {line[:width]}")


def _kept_step_seconds(lines: list[str]) -> float:
    """The duration of each step as rank 0 printed it, the last time it ran."""
    kept: dict[int, float] = {}
    for line in lines:
        if match := re.match(r"step (\d+)/\d+ \|.* \| ([\d.]+) ms/step", line):
            kept[int(match.group(1))] = float(match.group(2)) / 1000
    return sum(kept.values())


def run(cluster: loop.Cluster, name: str, fault: Callable[[loop.Cluster, str], None] | None,
        stages: dict[str, float] | None = None,
        timeline: dict[str, list[tuple[float, str]]] | None = None) -> dict[str, float]:
    """One job, with `fault` at step FAULT_AT; its recovery figures.

    With `stages`, the fault is a container kill or a node loss and its path is timed into
    it; for a node loss, rank 0's pod's lines and the operator's go to `timeline`, and for a
    trainer kill rank 0's pod's.
    """
    started = time.monotonic()
    cluster.apply(loop.training_job(name, cluster.s3, optimization={"maxSteps": STEPS}))
    recovery = redone = 0.0
    if fault is not None:
        loop.Cluster.wait_for_printed_step(cluster, name, FAULT_AT)
        old_uid = next(pod["metadata"]["uid"] for pod in cluster.pods(name)
                       if pod["metadata"]["name"].endswith("-1"))
        survivor = cluster.trainer_pid(f"{name}-worker-0")
        before = len(cluster.trainer_lines(name))
        fault(cluster, name)
        faulted, faulted_at = time.monotonic(), time.time()
        if stages is not None and fault is _lose_node:
            rank0: list[tuple[float, str]] = []
            stages.update(_node_loss_stages(cluster, name, old_uid, survivor, faulted, rank0))
            if timeline is not None:
                timeline["the node loss: what rank 0's pod printed"] = rank0
                timeline["the node loss: what the operator printed"] = operator_lines(
                    cluster, faulted_at, time.time())
        elif stages is not None:
            stages.update(_container_kill_stages(cluster, name, old_uid, faulted))
        printed = _rank0_until_advancing(cluster, name, faulted, before)
        recovery = time.monotonic() - faulted
        if fault is _kill_trainer and timeline is not None:
            timeline["the trainer kill: what rank 0's pod printed"] = printed
        if fault is _lose_node_of_worker_0 and timeline is not None:
            timeline["worker 0's node lost: what rank 0's pods printed"] = printed
            timeline["worker 0's node lost: what the operator printed"] = operator_lines(
                cluster, faulted_at, time.time())
    cluster.wait_for_phase(name, "Succeeded", timeout=600)
    wall = time.monotonic() - started
    lines = cluster.trainer_lines(name)
    if fault is not None:
        redone = loop.resume_and_redone(lines)[1]
    status = cluster.job(name)["status"]
    for node in cluster.agent.nodes:
        if node.lost:
            cluster.agent.restore_node(node.name)
    cluster.delete(name)
    return {"recovery": recovery, "redone": redone, "wall": wall,
            "goodput": _kept_step_seconds(lines) / wall,
            "operator_goodput": float((status.get("goodput") or {}).get("ratio") or "nan")}


# Own code (spec.trainer): the whole loop's FSDP2 + DCP script, a save every OWN_CODE_EVERY
# steps of at least OWN_CODE_STEP_SECONDS, uploads every second (KUBETRAIN_SYNC_SECONDS).
OWN_CODE_EVERY = 4
OWN_CODE_STEP_SECONDS = 0.3


def run_own_code(cluster: loop.Cluster, name: str) -> dict[str, float]:
    """The container kill of worker 1 at step FAULT_AT for an own-code job: seconds until
    rank 0 trains a step after resuming, steps redone (from the script's own lines)."""
    started = time.monotonic()
    cluster.apply(loop.own_code_job(name, cluster.s3, steps=STEPS, save_every=OWN_CODE_EVERY,
                                    step_seconds=OWN_CODE_STEP_SECONDS))

    def trained_since_resume() -> bool:
        lines = cluster.trainer_lines(name)
        marks = [i for i, line in enumerate(lines) if line.startswith("own-code resumed from")]
        return bool(marks) and bool(loop.own_code_steps(lines[marks[-1]:]))

    # At step FAULT_AT once a checkpoint is committed in S3: a pod lost before the upload
    # pass (every second) restarts the group from nothing, and rank 0 prints no resume.
    cluster.wait_for(f"{name} at step {FAULT_AT} with a checkpoint in S3", lambda: max(
        loop.own_code_steps(cluster.trainer_lines(name)), default=0) >= FAULT_AT
        and bool(loop.own_code_commits(cluster, name)), 300, every=0.1)
    _kill_container(cluster, name)
    faulted = time.monotonic()
    cluster.wait_for("own code to train again", trained_since_resume, 300, every=0.1)
    recovery = time.monotonic() - faulted
    cluster.wait_for_phase(name, "Succeeded", timeout=600)
    wall = time.monotonic() - started
    steps = loop.own_code_steps(cluster.trainer_lines(name))
    status = cluster.job(name)["status"]
    cluster.delete(name)
    return {"recovery": recovery, "redone": len(steps) - len(set(steps)), "wall": wall,
            "goodput": float("nan"),  # the script prints no step times
            "operator_goodput": float((status.get("goodput") or {}).get("ratio") or "nan")}


ROWS = ("none", "b", "b-pod", "f", "f0", "own")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default=",".join(row for row in ROWS if row != "f0"),
                        help="the rows to run, comma-separated (none is always run)")
    rows = {"none", *parser.parse_args().rows.split(",")}
    if unknown := rows - set(ROWS):
        parser.error(f"--rows: no row {', '.join(sorted(unknown))} (rows: {', '.join(ROWS)})")
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # moto's request log
    with tempfile.TemporaryDirectory(prefix="kubetrain-recovery-") as folder, \
            loop.node_runtime(Path(folder), build_images()) as node, \
            EmulatedCluster(Path(folder)) as api, Scheduler(api=api.api_client()), \
            NodeLifecycle(api=api.api_client()), \
            loop.whole_loop(api, Path(folder) / "loop", node) as cluster:
        stages: dict[str, float] = {}
        node_loss: dict[str, float] = {}
        timeline: dict[str, list[tuple[float, str]]] = {}
        breakdowns = {"b-pod": stages, "f": node_loss}
        results = {label: run(cluster, f"bench-{label}", fault, breakdowns.get(label), timeline)
                   for label, fault in (("none", None), ("b", _kill_trainer),
                                        ("b-pod", _kill_container), ("f", _lose_node),
                                        ("f0", _lose_node_of_worker_0))
                   if label in rows}
        if "own" in rows:
            loop.add_own_code_scripts(cluster)
            try:
                results["own"] = run_own_code(cluster, "bench-own")
            except AssertionError as error:  # the other rows still print
                print(f"own code: {str(error).splitlines()[0]}", flush=True)
    base = results["none"]["goodput"]
    print(f"whole loop, 2 workers x 1 process, tiny preset, {STEPS} steps, checkpoint every "
          f"{loop.EVERY}; fault at step {FAULT_AT}")
    print(f"{'scenario':<42}{'fault→advancing':>16}{'redone':>8}{'wall':>8}{'goodput':>9}"
          f"{'/none':>7}{'operator':>10}")
    names = {"none": "none (uninterrupted)", "b": "b: kill -9 of worker 1's trainer",
             "b-pod": "b: kill -9 of worker 1's container",
             "f": "f: worker 1's node lost", "f0": "f0: worker 0's node lost",
             "own": "own code: kill -9 of worker 1's container"}
    for label, figures in results.items():
        print(f"{names[label]:<42}{figures['recovery']:>15.1f}s{figures['redone']:>8.0f}"
              f"{figures['wall']:>7.0f}s{figures['goodput']:>9.2f}"
              f"{figures['goodput'] / base:>7.2f}{figures['operator_goodput']:>10.2f}")

    if "b-pod" in rows:
        _print_stages("the container kill", STAGES, stages)
    if "f" in rows:
        _print_stages("the node loss", NODE_LOSS_STAGES, node_loss)
    for title, lines in timeline.items():
        print_timeline(title, lines)


if __name__ == "__main__":
    main()
