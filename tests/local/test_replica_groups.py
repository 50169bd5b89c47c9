"""`kubetrain run` with replica groups (spec.faultTolerance): the groups as the operator runs
them, on this machine.

A user's story: the same manifest with faultTolerance runs under `kubetrain run` (2 groups
of 2 simulated nodes); one group's node is lost mid-run (`--kill-worker-at-step`); the
runner restarts that group alone while the other trains on, the restarted group heals from
the live one instead of reading a checkpoint, and the run's one metrics log says each step
once.
"""

from __future__ import annotations

import itertools
import re
import sys
import time
from pathlib import Path

import pytest

from kubetrain.api.manifest import parse_job
from kubetrain.local.launch import AgentLaunch
from kubetrain.local.metrics_log import append_event, parse_lines
from kubetrain.local.node import Node
from kubetrain.local.replica_groups import EventRelay, group_metrics_log
from kubetrain.local.runner import LocalRun
from kubetrain.local.workspace import Workspace
from tests.local.runs import events, finish, of_kind, start_run, tiny_job

HEARTBEAT_MS = 1000
# The restarted group must be back before the live one finishes: here a restart took 18 s
# (torch's import, the rendezvous, the heal) while 4 processes shared 2 cores, and the live
# group's 180 steps after the kill ~45 s.
MAX_STEPS = 200
KILL_AT = 20


@pytest.mark.slow
def test_a_lost_node_restarts_its_replica_group_alone_which_heals_from_the_live_one(
        tmp_path: Path, corpus: Path) -> None:
    name = "groups"
    manifest = tiny_job(name, corpus, "data", "checkpoints", max_steps=MAX_STEPS)
    # A step logged each step, so the live group's pauses are measured step by step.
    manifest["spec"]["metrics"]["logEverySteps"] = 1
    manifest["spec"]["checkpoint"]["everySteps"] = 50
    manifest["spec"]["evaluation"]["everySteps"] = 100
    # 2 groups of 2 simulated nodes (pods): each group is a torchrun group of 2 agents.
    manifest["spec"]["workers"]["replicas"] = 4
    manifest["spec"]["faultTolerance"] = {"replicaGroups": 2,
                                          "heartbeatTimeoutMilliseconds": HEARTBEAT_MS}
    code, output = finish(start_run(tmp_path, manifest, "--kill-worker-at-step", str(KILL_AT)))
    assert code == 0, output
    assert "in 2 replica groups under torchft's lighthouse" in output
    assert "restarting replica group 1 alone" in output, output
    run = tmp_path / "runs" / name
    groups = [parse_lines(group_metrics_log(run / "metrics.jsonl", group).read_text())
              for group in range(2)]

    # Group 0 never stopped: its longest pause between two steps, from the kill to the end,
    # is the lighthouse's heartbeat timeout and a few steps, not the restart of group 1.
    # (The group whose torchrun starts first trains alone until the other joins and heals
    # from it: group 0's first step may be past 1, but before the kill.)
    steps = of_kind(groups[0], "step")
    first = steps[0]["step"]
    assert first < KILL_AT, f"group 0 joined at step {first}, after the kill's step"
    assert [event["step"] for event in steps] == list(range(first, MAX_STEPS + 1))
    killed_at = next(event["time"] for event in steps if event["step"] == KILL_AT)
    times = [event["time"] for event in steps if event["time"] >= killed_at]
    assert max(b - a for a, b in itertools.pairwise(times)) < HEARTBEAT_MS / 1000 + 4, times
    # It trained alone for a while, then with group 1 again; the samples passed over meanwhile
    # are counted.
    quorums = [(event["step"], event["groups"]) for event in of_kind(groups[0], "quorum")]
    assert [size for _, size in quorums][-2:] == [1, 2], quorums
    assert of_kind(groups[0], "quorum")[-1]["skipped_samples"] > 0

    # Group 1 started again (a second `start`), healed from group 0 past the kill, read no
    # checkpoint though some existed, and finished with it.
    assert len(of_kind(groups[1], "start")) == 2, (of_kind(groups[1], "start"), output)
    (healed,) = [event for event in of_kind(groups[1], "healed") if event["step"] > KILL_AT]
    assert not of_kind(groups[1], "resumed") and of_kind(groups[0], "checkpoint")
    assert of_kind(groups[1], "finished")[0]["step"] == MAX_STEPS

    # The run's one log: each step once, in order; the heal and the quorum's changes, once
    # each, with the group that logged them; one failure, counted as one restart.
    merged = events(tmp_path, name)
    assert [event["step"] for event in of_kind(merged, "step")] == list(range(1, MAX_STEPS + 1))
    assert [(event["step"], event["group"]) for event in of_kind(merged, "healed")
            if event["step"] > KILL_AT] == [(healed["step"], 1)]
    assert [(event["step"], event["groups"]) for event in of_kind(merged, "quorum")
            ] == sorted(set(quorums + [(e["step"], e["groups"])
                                       for e in of_kind(groups[1], "quorum")]))
    assert len(of_kind(merged, "failure")) == 1
    # The end, as the group that wrote the checkpoints logged it: it exported the model.
    finished = of_kind(merged, "finished")[-1]
    assert finished["step"] == MAX_STEPS and finished["export_uri"], finished
    assert "exported model" in output
    assert f"step {healed['step']}: replica group 1 healed from a live group" in output
    assert (run / "logs" / "lighthouse.log").exists()


# Own code's groups: torchft's Manager in the user's script, 0.05 s a step; the kill comes
# at the first report at or past OWN_KILL_AT, and group 1's restart (the entry, torchrun,
# torch's import, the heal) is back long before group 0 ends: 28 s after the kill. (With
# 300 steps, 13.5 s, a from-nothing run of 0d3e3ba on a machine 1.85x slower than the day
# before saw group 0 end before group 1 was back.)
OWN_STEPS = 600
OWN_KILL_AT = 30


@pytest.mark.slow
def test_own_torchft_code_runs_in_groups_and_a_lost_node_restarts_its_group_alone(
        tmp_path: Path) -> None:
    """An own-code job with faultTolerance (tests/own_code/torchft_ddp.py, reporting through
    kubetrain.sdk) runs here as on Kubernetes: each group a torchrun of its own beside the
    lighthouse, told its group; group 1's node lost mid-run restarts alone and heals from
    group 0, which trains on; the run's log has each reported step once, in order."""
    name = "own-groups"
    script = Path(__file__).parents[1] / "own_code" / "torchft_ddp.py"
    manifest = {
        "apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob",
        "metadata": {"name": name},
        "spec": {
            "trainer": {"image": "ghcr.io/me/train:1", "command": ["python", str(script)],
                        "args": ["--steps", str(OWN_STEPS), "--step-seconds", "0.05",
                                 "--report"]},
            "workers": {"replicas": 2, "procsPerWorker": 1},
            "faultTolerance": {"replicaGroups": 2, "heartbeatTimeoutMilliseconds": HEARTBEAT_MS},
            "checkpoint": {"uri": "checkpoints"},
            "runPolicy": {"maxRestarts": 2, "backoffSeconds": 1},
        },
    }
    code, output = finish(start_run(tmp_path, manifest, "--kill-worker-at-step",
                                    str(OWN_KILL_AT)))
    assert code == 0, output
    assert "in 2 replica groups under torchft's lighthouse" in output
    assert "restarting replica group 1 alone" in output, output
    logs = tmp_path / "runs" / name / "logs"

    def printed(worker: int, prefix: str) -> list[int]:
        return [int(match) for match in re.findall(
            rf"^{prefix} (\d+)", (logs / f"worker-{worker}.log").read_text(), re.MULTILINE)]

    # Group 0 trained every step to the end, one torchrun all along; group 1 was started
    # twice and healed from group 0 past the kill.
    steps = printed(0, "own-code step")
    assert steps == list(range(steps[0], OWN_STEPS + 1)), steps
    assert (logs / "worker-0.log").read_text().count("=== kubetrain run: attempt") == 1
    assert (logs / "worker-1.log").read_text().count("=== kubetrain run: attempt") == 2
    healed = [step for step in printed(1, "own-code healed at step") if step > OWN_KILL_AT]
    assert healed, (f"group 1 printed no heal past step {OWN_KILL_AT}; group 0 ended at step "
                    f"{steps[-1]}; group 1's log:\n{(logs / 'worker-1.log').read_text()[-4000:]}")
    assert printed(1, "own-code step")[-1] == OWN_STEPS
    # Each group reported to its own endpoint; the run's log has each step once, in order.
    merged = of_kind(events(tmp_path, name), "step")
    reported = [event["step"] for event in merged]
    assert reported == sorted(set(reported)) and reported[-1] == OWN_STEPS, reported
    assert all("group" in event for event in merged), "a report passed by no group's log"
    assert len(of_kind(events(tmp_path, name), "failure")) == 1


def test_the_relay_passes_each_step_once_and_starts_over_for_a_whole_restart(
        tmp_path: Path) -> None:
    run_log = tmp_path / "metrics.jsonl"
    logs = [group_metrics_log(run_log, group) for group in range(2)]
    append_event(logs[0], {"event": "step", "step": 0, "note": "an earlier run's"})
    relay = EventRelay(run_log, groups=2)

    def log(group: int, *events: dict[str, object]) -> None:
        for event in events:
            append_event(logs[group], event)

    log(0, {"event": "start", "step": 0}, {"event": "step", "step": 1},
        {"event": "quorum", "step": 1, "groups": 2})
    log(1, {"event": "start", "step": 0}, {"event": "step", "step": 1},
        {"event": "quorum", "step": 1, "groups": 2}, {"event": "healed", "step": 1})
    relay.pump()
    # (Read group by group: group 0's events first, whoever logged first.)
    log(1, {"event": "step", "step": 2}, {"event": "checkpoint", "step": 2},
        {"event": "finished", "step": 2, "export_uri": None})
    log(0, {"event": "step", "step": 2})
    relay.pump()
    # The group that wrote the checkpoints exported the model: its end is passed on too.
    log(0, {"event": "checkpoint", "step": 2},
        {"event": "finished", "step": 2, "export_uri": "s3://b/export"})
    log(1, {"event": "finished", "step": 2, "export_uri": None})
    relay.pump()
    # Own code's groups report now and then: group 1's step 5, then group 0's older 4.
    log(1, {"event": "step", "step": 5})
    relay.pump()
    log(0, {"event": "step", "step": 4})
    relay.pump()
    relay.attempt()  # every group restarts from the checkpoint at step 2... and logs again
    log(1, {"event": "resumed", "step": 2}, {"event": "step", "step": 3})
    relay.pump()

    assert [(e["event"], e.get("step"), e["group"]) for e in parse_lines(run_log.read_text())] == [
        ("start", 0, 0), ("step", 1, 0), ("quorum", 1, 0), ("healed", 1, 1),
        ("step", 2, 0), ("checkpoint", 2, 1), ("finished", 2, 1), ("finished", 2, 0),
        ("step", 5, 1), ("resumed", 2, 1), ("step", 3, 1)]


# The node processes the watch tests give the runner: real processes that end as a node's
# torchrun agent would, without torch.
FINISHED = [sys.executable, "-c", "pass"]
LOST = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"]


def _watched(tmp_path: Path, corpus: Path, **due_in: float) -> tuple[LocalRun, list[Node]]:
    """A run of 2 replica groups of 1 node each, whose group `g` waits out a backoff of
    `due_in["g<g>"]` seconds after its node was lost; the other group's node finished."""
    manifest = tiny_job("watched", corpus, "data", "checkpoints", max_steps=20)
    manifest["spec"]["faultTolerance"] = {"replicaGroups": 2}
    run = LocalRun(parse_job(manifest), Workspace(tmp_path / "run"))
    run.workspace.logs.mkdir(parents=True)
    with (run.workspace.logs / "nodes.log").open("wb") as log:  # the processes keep theirs
        nodes = [Node(AgentLaunch(index, LOST if f"g{index}" in due_in else FINISHED, {}),
                      tmp_path, log) for index in range(2)]
    for node in nodes:
        node.process.wait()
    now = time.monotonic()
    run.group_restarts_due = {int(group[1:]): now + seconds for group, seconds in due_in.items()}
    return run, nodes


def test_a_group_waiting_out_its_backoff_is_dropped_once_the_others_finished(
        tmp_path: Path, corpus: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run, nodes = _watched(tmp_path, corpus, g1=600)

    def restart_group(group: int) -> list[Node]:
        pytest.fail(f"group {group} was started again after the others finished")

    started = time.monotonic()
    attempt = run._watch(nodes, restart_group)
    assert attempt.finished and not attempt.failures and attempt.stop is None
    assert time.monotonic() - started < 60, "the run waited out the backoff"
    assert run.group_restarts_due == {}
    assert "replica group 1 not started again: the other groups finished training" in (
        capsys.readouterr().err)


def test_when_every_group_waits_each_is_started_again_when_due(
        tmp_path: Path, corpus: Path) -> None:
    # Both lost, both due at once: no node is left to have finished, so neither is dropped.
    run, nodes = _watched(tmp_path, corpus, g0=0.5, g1=0.5)
    restarted: list[int] = []

    def restart_group(group: int) -> list[Node]:
        restarted.append(group)
        with (run.workspace.logs / f"restart-{group}.log").open("wb") as log:
            return [Node(AgentLaunch(group, FINISHED, {}), tmp_path, log)]

    attempt = run._watch(nodes, restart_group)
    assert attempt.finished and restarted == [0, 1]
