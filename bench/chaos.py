"""Fault mix: one training job under a schedule of faults, against the same job uninterrupted.

    sudo .venv/bin/python bench/chaos.py [--steps 240] [--straggle-seconds 20]

Runs the whole loop of tests/cluster/whole_loop.py on this machine (kmock's emulator with
the stand-in scheduler and node lifecycle controller; the operator's pod and the workers'
pods as containers of the images built from this tree, run by the node agent in
containerd; moto's S3 over HTTP): a 2-worker `tiny` job (one process and one CPU thread
per worker, a checkpoint every 8 steps), first uninterrupted, then again under faults
injected from outside the processes at a compressed rate (each once the job trains again
after the previous one and has passed a checkpoint):

- trainer kill: kill -9 of worker 1's trainer; torchrun restarts the group in place;
- container kill: kill -9 of every process of worker 1's container; the pod fails and
  the operator replaces it;
- straggler: a CFS quota of --straggle-cpu (0.1 CPU) on worker 1's container cgroup,
  lifted after --straggle-seconds. At 0.2 CPU a run at 09:10 UTC, 2026-11-26 saw worker 1
  compute only 1.31x the median rank, at the rule's bar of 1.3: its slow streaks broke,
  the straggler was judged 11.6 s after the quota, and the cause booked 0.21 of the loss
  (by design, an interval under the bar is not a straggler's). 0.1 CPU makes it plain;
- node loss: worker 1's node loses power (agent.lose_node: its pods' interfaces go down,
  their processes die, its heartbeats stop), restored once training is back;
- OOM: a second job. A running container's memory limit cannot be lowered under its use
  on this machine's cgroup v1 (the kernel refuses with EBUSY rather than OOM-killing), and
  one set just above it would kill at an unpredictable moment, if at all; so this is the
  whole loop's out-of-memory scenario (1100 MiB for a micro-batch of 16 that needs more),
  against the same job started at the micro-batch the operator healed it to.

For each fault it prints the seconds until the operator showed it (the first matching
event, condition or status.lastFailure on the job, polled every 0.25 s), the seconds
until training again (rank 0 printed a step after resuming), the steps redone, and the
goodput lost: the seconds from the fault until rank 0 printed a step past the one it had
reached, less the uninterrupted run's time for the steps made meanwhile. Overall:
goodput as the uninterrupted wall time over the faulted wall time (apply to Succeeded),
and the operator's own status.goodput. Every status change the job showed is printed at
the end, and so is what the operator logged from the node loss until training again.
Needs root, containerd, runc and the images (`make images`; built here when not
cached, about a minute more); skips, saying why, without them. About 4 minutes on 2 cores.

    sudo .venv/bin/python bench/chaos.py --memory-tier [--s3-every 50] [--memory-every 2]

The in-memory checkpoint tier (spec.checkpoint.memory, issue 34) instead: the three crash
faults (trainer kill, container kill, node loss), each at --s3-every x k + 40 % of it steps
(70, 120, 170 by default), on the same job twice: with S3 checkpoints only, every
--s3-every steps, then with the memory tier too, every --memory-every steps (1 partner
copy). Per fault: the steps redone, the reads of model state from S3 (GETs of DCP's data
files, counted in moto's server in this process, from the fault until the job is back
past the step it had reached; zero expected with the tier for all three) and the tier the
restore used (rank 0's `resumed from` line: memory://memory is every rank's own memory,
memory://partner a copy sent by a partner, else the S3 checkpoint). Also the operator's
MemoryCopiesShareNode events: after the node loss both pods may run on the one node left.
--steps defaults to 4 x --s3-every there (a 40-step smoke took about 2 minutes).

    sudo .venv/bin/python bench/chaos.py --fault-tolerance [--steps 1000] [--heartbeat-ms 1000]
        [--collective-ms 10000] [--procs-per-group 1]

Replica groups (spec.faultTolerance, issue 49) instead: a job of 3 groups of one pod (one
process each, or --procs-per-group with FSDP2 across them; a checkpoint every 20 steps),
uninterrupted and then with group 1's trainer killed, then its container, then a node lost
(group 1's if that leaves the lighthouse and a group running, else the other:
`a_node_to_lose`), each 2 steps past a checkpoint at least 20 steps after the last fault;
beside it today's whole-group restart, the same 3 workers without groups, uninterrupted
and under the same three faults (the node of worker 1). Per fault: for the groups, the
seconds the healthy groups lost (the longest gap between two of their steps, by the
trainers' own clocks, from the fault until the quorum was whole again, less their median
step; goal at most 1 s) and the rejoin (from the fault until the group healed from a live
one); for the whole-group restart, the seconds lost as the fault mix prices them. Goodput
of each faulted job against its uninterrupted twin, and its final loss (worker 0's mean
over the last LOSS_WINDOW steps) against the twin's after as many samples trained: the
groups' goal a ratio of at most 1 + LOSS_TOLERANCE plus twice its standard error. About 10
minutes on 2 cores (18 with --procs-per-group 2).
"""

from __future__ import annotations

import argparse
import functools
import logging
import math
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests" / "cluster"), str(REPO / "images" / "offline")]

from recovery import operator_lines, print_timeline  # noqa: E402
from whole_loop import (  # noqa: E402
    NAMESPACE,
    Cluster,
    a_node_to_lose,
    advanced_after_resume,
    break_groups,
    losses_printed,
    missing_host_support,
    out_of_memory_job,
    quorums,
    replica_groups_job,
    resumes,
    standalone,
    steps_printed,
    training_job,
)

from kubetrain.api.fault_tolerance import FaultToleranceSpec  # noqa: E402
from kubetrain.trainer.silent_peers import SAID as SILENT_PEER  # noqa: E402

EVERY = 8
WORKER = 1  # the worker every fault hits: worker 0 hosts the rendezvous
OOM_STEPS = 12  # the out-of-memory job and its baseline started at the healed micro-batch
STARTED = time.monotonic()


def say(text: str) -> None:
    print(f"[{time.monotonic() - STARTED:6.1f}s] {text}", flush=True)


@dataclass
class Signal:
    """One thing the operator showed on the job, and when this script first saw it."""

    at: float
    what: str


@dataclass
class Watcher:
    """Polls a job's status and events every 0.25 s and keeps every change it saw."""

    cluster: Cluster
    name: str
    signals: list[Signal] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def __enter__(self) -> Watcher:
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _loop(self) -> None:
        seen: set[str] = set()
        events = 0
        while not self._stop.wait(0.25):
            try:
                status = self.cluster.job(self.name).get("status") or {}
                listed = [e for e in self.cluster.core.list_namespaced_event(
                    NAMESPACE).items if e.involved_object.name == self.name]
            # The job is not there yet, or is being deleted.
            except Exception:
                continue
            now = time.monotonic()
            shown = [f"phase {status.get('phase')}"]
            shown += [f"condition {c['type']}={c['status']} ({c.get('reason', '')})"
                      for c in status.get("conditions") or []]
            failure = status.get("lastFailure")
            if failure:  # each failure once, though two may read alike
                shown.append(f"lastFailure {failure.get('class')} of {failure.get('pod')} "
                             f"(exit {failure.get('exitCode')})\0{failure.get('time')}")
            self.signals += [Signal(now, what.split("\0")[0]) for what in shown
                             if what not in seen]
            seen = set(shown)
            self.signals += [Signal(now, f"event {e.reason}: {(e.message or '')[:90]}")
                             for e in listed[events:]]
            events = len(listed)

    def first(self, after: float, until: float, matches: Callable[[str], bool]) -> Signal | None:
        return next((s for s in self.signals
                     if after <= s.at <= until and matches(s.what)), None)


@dataclass
class Row:
    fault: str
    at_step: int | None
    detected: float | None
    shown_as: str
    training_again: float | None
    redone: int
    lost: float


def wait(cluster: Cluster, what: str, check: Callable[[], Any], timeout: float = 300) -> Any:
    """cluster.wait_for, polling every 0.1 s: these times are the figures."""
    return cluster.wait_for(what, check, timeout, every=0.1)


def printed(cluster: Cluster, name: str) -> int:
    return max(steps_printed(cluster.trainer_lines(name)), default=0)


def worker_pod(cluster: Cluster, name: str) -> str:
    return f"{name}-worker-{WORKER}"


class Uninterrupted(NamedTuple):
    wall: float  # seconds from apply to Succeeded
    step_seconds: float  # seconds per step while training
    status: dict[str, Any]
    lines: list[str]  # what worker 0 printed


def run_uninterrupted(cluster: Cluster, name: str, manifest: dict[str, Any]) -> Uninterrupted:
    applied = time.monotonic()
    cluster.apply(manifest)
    wait(cluster, f"{name}'s first step", lambda: printed(cluster, name) >= 1)
    first = time.monotonic()
    cluster.wait_for_phase(name, "Succeeded", timeout=600)
    done = time.monotonic()
    steps = manifest["spec"]["optimization"]["maxSteps"]
    status, lines = cluster.job(name)["status"], cluster.worker_lines(name, 0)
    cluster.delete(name)
    return Uninterrupted(done - applied, (done - first) / max(1, steps - 1), status, lines)


# The training loss two runs of a job are compared by: the mean over a window of steps
# (each step's last print, after any redo), which evens out the micro-batches' noise.
LOSS_WINDOW = 100
# --fault-tolerance: the faulted groups' loss over their uninterrupted twin's at as many
# samples trained, at most this beyond twice the two windows' noise (docs/fault-tolerance.md,
# "The loss": the local bench's run, by validation loss, ended 0.9 % above its twin there).
LOSS_TOLERANCE = 0.02


def window_loss(losses: dict[int, float], end: int) -> tuple[float, float] | None:
    """The mean loss of the LOSS_WINDOW steps up to `end`, and its standard error (each
    step's loss is one micro-batch's: ±10 % from step to step on the tiny preset)."""
    window = [loss for step, loss in losses.items() if end - LOSS_WINDOW < step <= end]
    if len(window) < 2:
        return None
    return statistics.fmean(window), statistics.stdev(window) / math.sqrt(len(window))


def samples_trained(lines: list[str], groups: int) -> dict[int, float]:
    """The steps' worth of samples a job had trained by each step worker 0 printed: a step
    counts the share of the replica groups in its quorum (`step N: G of M replica groups in
    the quorum` says when that changed; a job that printed none had every group)."""
    changes = quorums(lines)
    trained, by_step = 0.0, {}
    for step in sorted(losses_printed(lines)):
        present = [size for at, size in changes if at <= step]
        trained += (present[-1] if present else groups) / groups
        by_step[step] = trained
    return by_step


def recover(cluster: Cluster, name: str, inject: Callable[[], None],
            after: Callable[[], None] | None = None,
            logged: list[tuple[float, str]] | None = None
            ) -> tuple[float, int, float, float, int]:
    """Inject a crash-like fault; wait until training is back past the step it had reached.

    Returns (the fault's time, the step reached then, seconds until training again,
    the time back past that step, steps redone); `after` runs once training is again.
    With `logged`, what the operator logged until then goes there (seconds after the fault).
    """
    before = cluster.trainer_lines(name)
    known = len(resumes(before))
    reached = max(steps_printed(before), default=0)
    faulted, faulted_at = time.monotonic(), time.time()
    inject()
    wait(cluster, f"{name} to train again",
         lambda: advanced_after_resume(cluster.trainer_lines(name), resumes=known + 1), 400)
    again = time.monotonic() - faulted
    if logged is not None:
        logged += operator_lines(cluster, faulted_at, time.time())
    if after is not None:
        after()

    def past() -> bool:
        lines = cluster.trainer_lines(name)
        last = max(i for i, line in enumerate(lines) if line.startswith("resumed from "))
        return max(steps_printed(lines[last:]), default=0) > reached

    wait(cluster, f"{name} past step {reached}", past, 400)
    back = time.monotonic()
    redone = sum(r for _, r in resumes(cluster.trainer_lines(name))[known:])
    return faulted, reached, again, back, redone


def power_off(cluster: Cluster, name: str, lost: list[str], target: str) -> None:
    """Power off node `target`, or the node of job `name`'s pod `target`; its name is
    appended to `lost`."""
    node = next((pod["spec"]["nodeName"] for pod in cluster.pods(name)
                 if pod["metadata"]["name"] == target), target)
    lost.append(node)
    cluster.agent.lose_node(node)


def lose_node(cluster: Cluster, name: str, lost: list[str]) -> None:
    """Power off the node of the job's worker WORKER; its name is appended to `lost`."""
    power_off(cluster, name, lost, worker_pod(cluster, name))


def run_faulted(cluster: Cluster, name: str, manifest: dict[str, Any], step_s: float,
                straggle_s: float, straggle_cpu: float, logged: list[tuple[float, str]]
                ) -> tuple[float, list[Row], Watcher, dict[str, Any]]:
    """The job under the faults; what the operator logged after the node loss to `logged`."""
    rows: list[Row] = []
    applied = time.monotonic()
    with Watcher(cluster, name) as watcher:
        cluster.apply(manifest)

        def settle() -> None:
            """Until the job has passed a checkpoint since the last fault."""
            target = (printed(cluster, name) // EVERY + 1) * EVERY + 2
            wait(cluster, f"{name} at step {target}", lambda: printed(cluster, name) >= target)

        def crash(fault: str, inject: Callable[[], None], shown: Callable[[str], bool],
                  after: Callable[[], None] | None = None,
                  logs: list[tuple[float, str]] | None = None) -> None:
            settle()
            say(f"{fault} at step {printed(cluster, name)}")
            faulted, reached, again, back, redone = recover(cluster, name, inject, after, logs)
            net = printed(cluster, name) - reached
            signal = watcher.first(faulted, time.monotonic() + 5, shown)
            row = Row(fault, reached, signal.at - faulted if signal else None,
                      signal.what if signal else "not shown", again, redone,
                      back - faulted - net * step_s)
            rows.append(row)
            say(f"  training again after {again:.1f}s, {redone} steps redone, "
                f"{row.lost:.1f}s lost; shown as: {row.shown_as}")

        pod = worker_pod(cluster, name)
        crash("trainer kill", lambda: cluster.kill_trainer(pod), lambda what: True)
        crash("container kill", lambda: cluster.kill_container(pod),
              lambda what: "lastFailure" in what or what.startswith("event Worker"))

        settle()
        reached = printed(cluster, name)
        say(f"straggler at step {reached}: worker {WORKER} at {straggle_cpu:g} CPU for "
            f"{straggle_s:.0f}s")
        faulted = time.monotonic()
        cluster.throttle(pod, straggle_cpu)
        try:
            time.sleep(straggle_s)
            ranks = (cluster.job(name).get("status") or {}).get("ranks")
        finally:
            cluster.unthrottle(pod)
        lifted = printed(cluster, name)
        wait(cluster, f"{name} past step {lifted}", lambda: printed(cluster, name) > lifted)
        back = time.monotonic()
        signal = watcher.first(faulted, back + 5, lambda what: "Straggler=True" in what
                               or what.startswith("event Straggler"))
        rows.append(Row("straggler", reached, signal.at - faulted if signal else None,
                        signal.what if signal else "not shown", None, 0,
                        back - faulted - (printed(cluster, name) - reached) * step_s))
        say(f"  lifted at step {lifted}; {rows[-1].lost:.1f}s lost; shown as: "
            f"{rows[-1].shown_as}; status.ranks before the lift: {ranks}")

        lost_node: list[str] = []
        try:
            def lose() -> None:
                lose_node(cluster, name, lost_node)

            crash("node loss", lose,
                  lambda what: "NodeLost" in what or "lastFailure" in what,
                  after=lambda: cluster.agent.restore_node(lost_node[0]), logs=logged)
        finally:
            for node in lost_node:
                cluster.agent.restore_node(node)
        say(f"  {lost_node[0]} restored")
        cluster.wait_for_phase(name, "Succeeded", timeout=600)
        wall = time.monotonic() - applied
        time.sleep(0.5)  # the watcher's last look
    status = cluster.job(name)["status"]
    cluster.delete(name)
    return wall, rows, watcher, status


def run_oom(cluster: Cluster) -> tuple[Row, str]:
    """The OOM job, then the same job at the micro-batch it healed to; the fault's row."""
    name = "chaos-oom"
    applied = time.monotonic()
    with Watcher(cluster, name) as watcher:
        cluster.apply(out_of_memory_job(name, cluster.s3, 16, OOM_STEPS))
        say("OOM: a job whose micro-batch of 16 needs more than its 1100 MiB")

        def oom_killed() -> bool:
            """containerd's OOM event for one of the job's containers, as the node agent has
            it (the pod's Failed status lasts only until the operator deletes it)."""
            return any(pod.name.startswith(name) and pod.oom_killed
                       for pod in list(cluster.agent.running.values()))

        cluster.wait_for("the first OOM kill", oom_killed, 400, every=0.05)
        faulted = time.monotonic()

        def trained_again() -> bool:
            lines = cluster.trainer_lines(name)
            starts = [i for i, line in enumerate(lines) if line.startswith("training from step")]
            return len(starts) > 1 and bool(steps_printed(lines[starts[-1]:]))

        wait(cluster, f"{name} to train again", trained_again, 400)
        again = time.monotonic() - faulted
        cluster.wait_for_phase(name, "Succeeded", timeout=600)
        wall = time.monotonic() - applied
        time.sleep(0.5)
    status = cluster.job(name)["status"]
    healed = status["effective"]["microBatchSize"]
    redone = sum(r for _, r in resumes(cluster.trainer_lines(name)))
    signal = watcher.first(faulted - 1, faulted + again + 5,
                           lambda what: "OOMKilled" in what or "MicroBatch" in what)
    say(f"  OOM seen, training again after {again:.1f}s at micro-batch {healed}; "
        f"shown as: {signal.what if signal else 'not shown'}")
    cluster.delete(name)
    say(f"OOM baseline: the same job started at micro-batch {healed}")
    base_wall = run_uninterrupted(cluster, f"{name}-base", out_of_memory_job(
        f"{name}-base", cluster.s3, healed, OOM_STEPS)).wall
    row = Row("OOM (second job)", None, signal.at - faulted if signal else None,
              signal.what if signal else "not shown", again, redone, wall - base_wall)
    note = (f"OOM job: {wall:.1f}s from apply to Succeeded (micro-batch 16 → {healed}, "
            f"failures {status.get('failures')}) against {base_wall:.1f}s started at "
            f"{healed}")
    return row, note


class ModelStateReads:
    """GETs of model state (DCP's `.distcp` data files) that this process's moto server
    answers, with when: S3Response's key GET, wrapped while inside `with`."""

    def __init__(self) -> None:
        self.reads: list[tuple[float, str, str]] = []  # (time, bucket, key)

    def __enter__(self) -> ModelStateReads:
        from moto.s3.responses import S3Response

        self._original = original = S3Response._key_response_get
        reads = self.reads

        def counted(response: Any, query: dict[str, Any], key_name: str) -> Any:
            if key_name.endswith(".distcp"):
                reads.append((time.monotonic(), response.bucket_name, key_name))
            return original(response, query, key_name)

        S3Response._key_response_get = counted  # type: ignore[method-assign,assignment]
        return self

    def __exit__(self, *_: object) -> None:
        from moto.s3.responses import S3Response

        S3Response._key_response_get = self._original  # type: ignore[method-assign]

    def count(self, name: str, after: float, until: float) -> int:
        """Model-state reads of job `name`'s checkpoints (s3://checkpoints/<name>) between."""
        return sum(1 for at, bucket, key in self.reads if after <= at <= until
                   and bucket == "checkpoints" and key.startswith(f"{name}/"))


@dataclass
class TierRow:
    run: str
    fault: str
    at_step: int
    training_again: float
    redone: int
    s3_reads: int
    resumed_from: str


def restore_tier(lines: list[str]) -> str:
    """The tier of rank 0's last `resumed from` line: memory, partner or S3 (with its step)."""
    last = next(line for line in reversed(lines) if line.startswith("resumed from "))
    uri = last.split()[2]
    tier = uri.split("/")[2] if uri.startswith("memory://") else "S3"
    return f"{tier} ({uri.rsplit('/', 1)[-1]})"


def run_tier(cluster: Cluster, name: str, manifest: dict[str, Any], label: str,
             s3_every: int, reads: ModelStateReads) -> tuple[list[TierRow], Watcher]:
    """The three crash faults on one job, each at s3_every x k + 40 % of s3_every steps."""
    rows: list[TierRow] = []
    pod = worker_pod(cluster, name)
    lost_node: list[str] = []
    faults: list[tuple[str, Callable[[], None], Callable[[], None] | None]] = [
        ("trainer kill", lambda: cluster.kill_trainer(pod), None),
        ("container kill", lambda: cluster.kill_container(pod), None),
        ("node loss", lambda: lose_node(cluster, name, lost_node),
         lambda: cluster.agent.restore_node(lost_node[0])),
    ]

    def at_least(step: int) -> Callable[[], bool]:
        return lambda: printed(cluster, name) >= step

    with Watcher(cluster, name) as watcher:
        cluster.apply(manifest)
        try:
            for k, (fault, inject, after) in enumerate(faults, start=1):
                target = s3_every * k + s3_every * 2 // 5
                wait(cluster, f"{name} at step {target}", at_least(target))
                say(f"{label}: {fault} at step {printed(cluster, name)}")
                faulted, reached, again, back, redone = recover(cluster, name, inject, after)
                row = TierRow(label, fault, reached, again, redone,
                              reads.count(name, faulted, back),
                              restore_tier(cluster.trainer_lines(name)))
                rows.append(row)
                say(f"  training again after {again:.1f}s, {redone} steps redone, "
                    f"{row.s3_reads} S3 reads of model state, restored from {row.resumed_from}")
        finally:
            for node in lost_node:
                cluster.agent.restore_node(node)
        cluster.wait_for_phase(name, "Succeeded", timeout=600)
        time.sleep(0.5)  # the watcher's last look
    cluster.delete(name)
    return rows, watcher


def memory_tier_rows(cluster: Cluster, steps: int, s3_every: int, memory_every: int) -> int:
    """--memory-tier: the same three faults with S3 only and with the memory tier; prints
    the rows and returns the exit code (1 when a fault with the tier read model state
    from S3, was not restored from memory, or redid more steps than its interval)."""
    def job(name: str, memory: dict[str, Any] | None) -> dict[str, Any]:
        checkpoint: dict[str, Any] = {"everySteps": s3_every}
        if memory is not None:
            checkpoint["memory"] = memory
        return training_job(name, cluster.s3, optimization={"maxSteps": steps},
                            checkpoint=checkpoint)

    with ModelStateReads() as reads:
        s3_rows, _ = run_tier(cluster, "chaos-s3", job("chaos-s3", None),
                              f"S3 every {s3_every}", s3_every, reads)
        memory_rows, watcher = run_tier(
            cluster, "chaos-mem", job("chaos-mem", {"everySteps": memory_every, "replicas": 1}),
            f"memory every {memory_every}", s3_every, reads)
    print(f"\nwhole loop, 2 workers x 1 process, tiny preset, {steps} steps, S3 checkpoint "
          f"every {s3_every}; faults on worker {WORKER}")
    print(f"{'fault':<16}{'checkpoints':<18}{'at step':>8}{'training again':>16}{'redone':>8}"
          f"{'S3 reads':>10}  restored from")
    for plain, tiered in zip(s3_rows, memory_rows, strict=True):
        for row in (plain, tiered):
            print(f"{row.fault:<16}{row.run:<18}{row.at_step:>8}{row.training_again:>15.1f}s"
                  f"{row.redone:>8}{row.s3_reads:>10}  {row.resumed_from}")
    shared = [s for s in watcher.signals if "MemoryCopiesShareNode" in s.what]
    print("\nMemoryCopiesShareNode on the tier's job: "
          + ("; ".join(s.what for s in shared) if shared else "never shown"))
    # Issue 34's goals: no S3 read, at most the memory interval redone, restored from memory.
    missed = 0
    print()
    for row in memory_rows:
        goal = (row.s3_reads == 0 and row.redone <= memory_every
                and not row.resumed_from.startswith("S3"))
        missed += not goal
        print(f"{row.fault} with the tier: {row.s3_reads} S3 reads, {row.redone} steps redone "
              f"(at most {memory_every}), from {row.resumed_from}: "
              f"{'met' if goal else 'MISSED'}")
    return 1 if missed else 0


# --fault-tolerance: the groups, their checkpoint interval, and issue 49's goal.
GROUPS = 3
GROUPS_EVERY = 20
HEALTHY_LOST_GOAL = 1.0  # seconds the healthy groups may lose per fault


@dataclass
class GroupRow:
    """One fault of the groups' job (`lost`: the healthy groups'), or of the plain one."""

    fault: str
    run: str
    at_step: int
    lost: float
    rejoin: float | None  # the groups: from the fault until the group healed


def groups_job(cluster: Cluster, name: str, steps: int, groups: bool,
               heartbeat_ms: int, collective_ms: int, procs: int) -> dict[str, Any]:
    """3 workers of `procs` processes; with `groups`, each its own replica group."""
    if groups:
        return replica_groups_job(name, cluster.s3, groups=GROUPS, steps=steps,
                                  heartbeat_ms=heartbeat_ms, collective_ms=collective_ms,
                                  checkpoint_every=GROUPS_EVERY, procs_per_worker=procs)
    return training_job(name, cluster.s3, workers={"replicas": GROUPS, "procsPerWorker": procs},
                        optimization={"maxSteps": steps,
                                      "globalBatchTokens": 4 * 64 * GROUPS * procs},
                        checkpoint={"everySteps": GROUPS_EVERY})


def settle_groups_job(cluster: Cluster, name: str) -> None:
    """Until 2 steps past the first checkpoint 20 or more steps after now (the last fault's
    recovery): a whole-group restart resumes from it, the groups need none."""
    target = ((printed(cluster, name) + 20) // GROUPS_EVERY + 1) * GROUPS_EVERY + 2
    wait(cluster, f"{name} at step {target}", lambda: printed(cluster, name) >= target)


def group_fault(cluster: Cluster, name: str, fault: str, inject: Callable[[str], None]
                ) -> GroupRow:
    """Break group 1 with `inject(pod)` once settled (for a node loss, `inject(node)` on a
    node `a_node_to_lose` picks: group 1's, or the other), until the broken groups healed
    and the quorum is whole again; what the healthy groups lost beyond their median step."""
    settle_groups_job(cluster, name)
    if fault == "node loss":
        target, broken = a_node_to_lose(cluster, name, GROUPS, WORKER)
    else:
        target, broken = f"{name}-worker-{WORKER}", [WORKER]
    say(f"{fault} of {target} (group {', '.join(map(str, broken))}) at step "
        f"{printed(cluster, name)}")
    live = [index for index in range(GROUPS) if index not in broken]

    def silenced() -> int:
        """The live groups' all-reduces ended because the lighthouse named a peer silent
        (silent_peers.py), not by a reset from it or between all-reduces."""
        return sum(SILENT_PEER in line for index in live
                   for line in cluster.worker_lines(name, index))

    before = silenced()
    done = break_groups(cluster, name, GROUPS, broken, lambda: inject(target))
    lost = max(max(gaps) - statistics.median(gaps) for gaps in (
        [seconds for _, seconds in stepped] for stepped in done.steps.values()))
    say(f"  healed after {done.healed_after:.1f}s; the healthy groups lost "
        f"{lost:.2f}s; the quorum whole again from step {done.whole_at}; all-reduces "
        f"ended on the lighthouse's word that a peer was silent: {silenced() - before}")
    return GroupRow(fault, "replica groups", done.at_step, lost, done.healed_after)


def fault_tolerance_rows(cluster: Cluster, steps: int, heartbeat_ms: int,
                         collective_ms: int, procs: int) -> int:
    """--fault-tolerance: prints the rows; 1 when a fault cost the healthy groups more
    than the goal."""
    walls: dict[str, float] = {}
    lines: dict[str, list[str]] = {}  # what worker 0 printed, by run
    rows: list[GroupRow] = []
    for run, groups in (("replica groups", True), ("whole-group restart", False)):
        name = "chaos-groups" if groups else "chaos-plain"
        say(f"{run}: uninterrupted")
        base = run_uninterrupted(
            cluster, f"{name}-base",
            groups_job(cluster, f"{name}-base", steps, groups, heartbeat_ms, collective_ms,
                       procs))
        walls[f"{run} uninterrupted"] = base.wall
        lines[f"{run} uninterrupted"] = base.lines
        step_s = base.step_seconds
        if groups:  # a group dropped with nothing broken: the heartbeat timeout too short
            sizes = [size for _, size in quorums(base.lines)]
            whole = sizes.index(GROUPS) if GROUPS in sizes else len(sizes)
            dips = sum(size < GROUPS for size in sizes[whole:])
            say(f"  the quorum shrank {dips} times with no fault")
        say(f"  {walls[f'{run} uninterrupted']:.1f}s, {step_s * 1000:.0f} ms per step")
        say(f"{run}: under faults")
        applied = time.monotonic()
        cluster.apply(groups_job(cluster, name, steps, groups, heartbeat_ms, collective_ms,
                                 procs))
        lost_nodes: list[str] = []
        faults = (("trainer kill", cluster.kill_trainer),
                  ("container kill", cluster.kill_container),
                  ("node loss", functools.partial(power_off, cluster, name, lost_nodes)))
        try:
            for fault, inject in faults:
                if groups:
                    rows.append(group_fault(cluster, name, fault, inject))
                    continue
                settle_groups_job(cluster, name)
                say(f"{fault} of worker {WORKER} at step {printed(cluster, name)}")
                pod = worker_pod(cluster, name)
                faulted, reached, again, back, redone = recover(
                    cluster, name, functools.partial(inject, pod))
                net = printed(cluster, name) - reached
                rows.append(GroupRow(fault, run, reached, back - faulted - net * step_s,
                                     None))
                say(f"  training again after {again:.1f}s, {redone} steps redone, "
                    f"{rows[-1].lost:.1f}s lost")
        finally:
            for node in lost_nodes:
                cluster.agent.restore_node(node)
        cluster.wait_for_phase(name, "Succeeded", timeout=600)
        walls[f"{run} faulted"] = time.monotonic() - applied
        lines[f"{run} faulted"] = cluster.worker_lines(name, 0)
        cluster.delete(name)
    print(f"\nwhole loop, {GROUPS} workers x {procs} process(es), tiny preset, {steps} steps, "
          f"checkpoint every {GROUPS_EVERY}, the groups' heartbeat timeout {heartbeat_ms} ms "
          f"and collective timeout {collective_ms} ms; faults on worker {WORKER}")
    print(f"{'fault':<16}{'run':<22}{'at step':>8}{'lost':>8}{'rejoin':>9}")
    for row in rows:
        rejoin = "—" if row.rejoin is None else f"{row.rejoin:.1f}s"
        print(f"{row.fault:<16}{row.run:<22}{row.at_step:>8}{row.lost:>7.2f}s{rejoin:>9}")
    print()
    for run in ("replica groups", "whole-group restart"):
        calm_wall, faulted = walls[f"{run} uninterrupted"], walls[f"{run} faulted"]
        print(f"{run}: uninterrupted {calm_wall:.1f}s, under the three faults {faulted:.1f}s: "
              f"goodput {calm_wall / faulted:.2f}")
    missed = 0
    for run in ("replica groups", "whole-group restart"):
        # The faulted run's last steps against the twin's after as many samples: a step a
        # group missed trained without its share, and a whole-group restart redoes its
        # lost steps with the same batches.
        under_faults = losses_printed(lines[f"{run} faulted"])
        trained = max(samples_trained(lines[f"{run} faulted"], GROUPS).values(), default=0.0)
        same = next((step for step, done in samples_trained(
            lines[f"{run} uninterrupted"], GROUPS).items() if done >= trained - 0.5), 0)
        broken = window_loss(under_faults, max(under_faults, default=0))
        calm = window_loss(losses_printed(lines[f"{run} uninterrupted"]), same)
        if calm is None or broken is None:
            print(f"{run}: no step lines to compare the loss by")
            missed += 1
            continue
        # The two windows' noise (standard error of the ratio) is allowed twice beyond the
        # tolerance: the claim is that the curves differ by no more than that, not that
        # two windows of single micro-batches' losses agree to 2 %.
        ratio, noise = broken[0] / calm[0], math.hypot(broken[1], calm[1]) / calm[0]
        met = ratio <= 1 + LOSS_TOLERANCE + 2 * noise
        missed += not met
        print(f"{run}: loss over the last {LOSS_WINDOW} steps under the faults "
              f"{broken[0]:.4f} ({trained:.0f} steps' worth of samples); the uninterrupted "
              f"run's over its {LOSS_WINDOW} steps to step {same} {calm[0]:.4f}: ratio "
              f"{ratio:.4f} (standard error {noise:.4f}), at most 1 + {LOSS_TOLERANCE:g} + "
              f"twice that: {'met' if met else 'MISSED'}")
    for row in rows:
        if row.run == "replica groups":
            met = row.lost <= HEALTHY_LOST_GOAL
            missed += not met
            print(f"{row.fault}: the healthy groups lost {row.lost:.2f}s, goal at most "
                  f"{HEALTHY_LOST_GOAL:g}s: {'met' if met else 'MISSED'}")
    return 1 if missed else 0


# Issue 33: at most this many seconds lost per fault.
LOST_GOALS = {"trainer kill": 4.0, "container kill": 7.0, "node loss": 16.0}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=None,
                        help="training steps (default 240; 4 x --s3-every with --memory-tier; 1000 "
                        "with --fault-tolerance)")
    parser.add_argument("--straggle-seconds", type=float, default=20)
    parser.add_argument("--straggle-cpu", type=float, default=0.1,
                        help="the straggler's CPU quota (default 0.1)")
    parser.add_argument("--memory-tier", action="store_true",
                        help="the in-memory checkpoint tier's rows instead of the fault mix")
    parser.add_argument("--s3-every", type=int, default=50,
                        help="--memory-tier: the S3 checkpoint interval (default 50)")
    parser.add_argument("--memory-every", type=int, default=2,
                        help="--memory-tier: the memory tier's interval (default 2)")
    parser.add_argument("--fault-tolerance", action="store_true",
                        help="replica groups' rows (spec.faultTolerance) instead of the mix")
    heartbeat = FaultToleranceSpec.model_fields["heartbeat_timeout_milliseconds"].default
    parser.add_argument("--heartbeat-ms", type=int, default=heartbeat,
                        help="--fault-tolerance: the groups' heartbeatTimeoutMilliseconds "
                        f"(default {heartbeat}, the API's): the shortest a healthy group "
                        "can lose")
    collective = FaultToleranceSpec.model_fields["collective_timeout_milliseconds"].default
    parser.add_argument("--collective-ms", type=int, default=collective,
                        help="--fault-tolerance: the groups' collectiveTimeoutMilliseconds "
                        f"(default {collective}, the API's): what a lost node costs them")
    parser.add_argument("--procs-per-group", type=int, default=1,
                        help="--fault-tolerance: trainer processes in each group's pod (default "
                        "1; issue 49's shape is 2, FSDP2 across them)")
    args = parser.parse_args()
    if args.steps is None:
        args.steps = (4 * args.s3_every if args.memory_tier
                      # The groups' node loss comes near step 260; at 60 ms a step, 600
                      # steps ended before the lost groups' pods were back to heal.
                      else 1000 if args.fault_tolerance else 240)
    reason = missing_host_support()
    if reason is not None:
        print(f"bench/chaos.py: skipped: {reason}")
        return 0
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # moto's request log
    def job(name: str) -> dict[str, Any]:
        return training_job(name, cluster.s3, optimization={"maxSteps": args.steps},
                            checkpoint={"everySteps": EVERY})

    code = 0
    with standalone("kubetrain-chaos-", say) as cluster:
        if args.memory_tier:
            say("whole loop up; the in-memory tier's rows")
            code = memory_tier_rows(cluster, args.steps, args.s3_every, args.memory_every)
        elif args.fault_tolerance:
            say("whole loop up; the replica groups' rows")
            code = fault_tolerance_rows(cluster, args.steps, args.heartbeat_ms,
                                        args.collective_ms, args.procs_per_group)
        else:
            say("whole loop up; the uninterrupted run")
            base_wall, step_s, base_status, _ = run_uninterrupted(cluster, "chaos-base",
                                                                  job("chaos-base"))
            say(f"  {base_wall:.1f}s from apply to Succeeded, {step_s * 1000:.0f} ms per step")
            say("the same job under faults")
            logged: list[tuple[float, str]] = []
            wall, rows, watcher, status = run_faulted(cluster, "chaos", job("chaos"), step_s,
                                                      args.straggle_seconds,
                                                      args.straggle_cpu, logged)
            say(f"  {wall:.1f}s from apply to Succeeded")
            oom_row, oom_note = run_oom(cluster)
            # Printed before the whole loop stops: its figures survive a failed tear-down.
            report(args.steps, rows, oom_row, oom_note, base_wall, wall, base_status, status,
                   watcher, logged)
    print(f"\nthe whole benchmark took {time.monotonic() - STARTED:.0f}s")
    return code


def report(steps: int, rows: list[Row], oom_row: Row, oom_note: str, base_wall: float,
           wall: float, base_status: dict[str, Any], status: dict[str, Any], watcher: Watcher,
           logged: list[tuple[float, str]]) -> None:
    """The fault mix's table, goodput, issue 33's goals and what the job showed."""
    print(f"\nwhole loop, 2 workers x 1 process, tiny preset, {steps} steps, checkpoint "
          f"every {EVERY}; faults on worker {WORKER}")
    print(f"{'fault':<18}{'at step':>8}{'detected':>10}{'training again':>16}{'redone':>8}"
          f"{'lost':>8}  shown as")
    for row in [*rows, oom_row]:
        detected = "—" if row.detected is None else f"{row.detected:.1f}s"
        again = "—" if row.training_again is None else f"{row.training_again:.1f}s"
        at = "—" if row.at_step is None else str(row.at_step)
        print(f"{row.fault:<18}{at:>8}{detected:>10}{again:>16}{row.redone:>8}"
              f"{row.lost:>7.1f}s  {row.shown_as}")
    lost = sum(row.lost for row in rows)
    print(f"\nuninterrupted: {base_wall:.1f}s; under the four faults: {wall:.1f}s; "
          f"goodput against uninterrupted {base_wall / wall:.2f} ({wall - base_wall:.1f}s "
          f"longer; the faults' losses above sum to {lost:.1f}s, priced at the uninterrupted "
          "run's step time: the two differ as the shared machine's load does)")
    print(f"status.goodput uninterrupted: {base_status.get('goodput')}")
    print(f"status.goodput under faults:  {status.get('goodput')}")
    print(oom_note)
    # Issue 33's goals: the lost seconds per fault, and goodput's exact causes.
    print()
    for row in rows:
        goal = LOST_GOALS.get(row.fault)
        if goal is not None:
            print(f"{row.fault}: {row.lost:.1f}s lost, goal at most {goal:g}s: "
                  f"{'met' if row.lost <= goal else 'MISSED'}; shown: {row.shown_as}")
    badput = (status.get("goodput") or {}).get("badputSeconds") or {}
    straggled = next((row.lost for row in rows if row.fault == "straggler"), None)
    if straggled:
        booked = float(badput.get("straggler", 0.0))
        within = "within" if abs(booked / straggled - 1) <= 0.2 else "OUTSIDE"
        print(f"straggler cause {booked:.2f}s against {straggled:.2f}s lost while it "
              f"straggled: {booked / straggled:.2f} ({within} 20 %)")
    redone = sum(row.redone for row in rows)
    base_badput = (base_status.get("goodput") or {}).get("badputSeconds") or {}
    print(f"lostProgress {float(badput.get('lostProgress', 0.0)):.3f}s for {redone} steps "
          f"redone; straggler cause of the uninterrupted run "
          f"{float(base_badput.get('straggler', 0.0)):.3f}s")
    print("\nwhat the faulted job showed (seconds after it was first seen):")
    start = watcher.signals[0].at if watcher.signals else 0.0
    for signal in watcher.signals:
        print(f"  {signal.at - start:7.1f}s  {signal.what}")
    print_timeline("the node loss: what the operator logged until training again", logged)


if __name__ == "__main__":
    sys.exit(main())
