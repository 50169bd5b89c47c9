"""The in-memory checkpoint tier (memory_checkpoint.py): where partner copies go, what a
snapshot restores, that a torn one is never used, and, under real torchrun on gloo, that a
killed trainer resumes from its own memory and a lost node from its partner's copy, with
no checkpoint read from S3."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful

from kubetrain.api.trainingjob import TrainingJobSpec
from kubetrain.local.node import descendants
from kubetrain.trainer.checkpoint import ModelState, RandomState
from kubetrain.trainer.goodput import CHECKPOINT_LOAD, S3_TIER, STARTUP, GoodputLedger
from kubetrain.trainer.memory_checkpoint import (
    FOLDER_ENV,
    NODE_ENV,
    MemoryCheckpoints,
    Part,
    _complete_step,
    _holders,
    copies_on_own_node,
    load_tier,
    partners,
)

# --- partners --------------------------------------------------------------------------


@pytest.mark.parametrize("nodes", [
    ["a", "a", "b", "b"],
    ["a", "b", "a", "b", "c", "c"],
    ["n1"] * 4 + ["n2"] * 4,
    ["x", "y", "y", "x", "z"],
    ["a", "a", "b"],  # the largest node holds more than half: one copy must stay on it
])
def test_partners_are_on_another_node_wherever_one_exists_and_each_rank_holds_one_copy(
    nodes: list[str],
) -> None:
    chosen = partners(nodes, replicas=1)
    assert all(len(ranks) == 1 and ranks[0] != rank for rank, ranks in enumerate(chosen))
    held = sorted(ranks[0] for ranks in chosen)
    assert held == list(range(len(nodes))), "every rank holds exactly one copy"
    largest = max(nodes.count(node) for node in set(nodes))
    same_node = [rank for rank, ranks in enumerate(chosen) if nodes[ranks[0]] == nodes[rank]]
    if largest * 2 <= len(nodes):
        assert same_node == []
    else:  # only ranks of the crowded node can be left with a partner beside them
        assert same_node and all(nodes[rank] == max(set(nodes), key=nodes.count)
                                 for rank in same_node)
        assert len(same_node) <= 2 * largest - len(nodes)


def test_two_replicas_go_to_two_other_ranks_and_one_node_keeps_copies_beside_each_rank() -> None:
    nodes = ["a", "a", "b", "b", "c", "c"]
    for rank, ranks in enumerate(partners(nodes, replicas=2)):
        assert len(set(ranks)) == 2 and rank not in ranks
        assert all(nodes[other] != nodes[rank] for other in ranks)
    alone = partners(["only"] * 3, replicas=1)
    assert sorted(ranks[0] for ranks in alone) == [0, 1, 2]
    assert partners(["one"], replicas=2) == [[]]


def test_the_log_says_when_copies_stay_on_their_own_node_and_is_silent_otherwise() -> None:
    one_node = ["only"] * 2
    said = copies_on_own_node(one_node, partners(one_node, replicas=1))
    assert said is not None
    assert "2 of 2 ranks keep their partner copy on their own node" in said
    assert "every rank runs on node only and no other node exists" in said
    assert "not the loss of that node" in said
    crowded = ["a", "a", "b"]
    said = copies_on_own_node(crowded, partners(crowded, replicas=1))
    assert said is not None and "1 of 3 ranks" in said and "more than half" in said
    for nodes in (["a", "b"], ["n1"] * 4 + ["n2"] * 4, ["x", "y", "y", "x", "z"]):
        assert copies_on_own_node(nodes, partners(nodes, replicas=1)) is None
    assert copies_on_own_node(one_node, partners(one_node, replicas=0)) is None


# --- snapshots in one process ------------------------------------------------------------


class _Position(Stateful):
    def __init__(self) -> None:
        self.position = 0

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.position = int(state_dict["position"])


def _spec(tmp_path: Path) -> TrainingJobSpec:
    return TrainingJobSpec.model_validate({
        "image": "kubetrain/trainer:test", "data": {"train": "s3://bucket/train"},
        "checkpoint": {"uri": str(tmp_path / "s3"), "memory": {"everySteps": 1}}})


def _state(seed: int) -> tuple[dict[str, Any], torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return ({"model": ModelState(model, optimizer), "data": _Position(),
             "rng": RandomState()}, model, optimizer)


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        loss = model(torch.randn(4, 8)).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


@pytest.fixture
def group_of_one() -> Any:
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_snapshot_restores_weights_optimizer_rng_and_position_exactly(
    tmp_path: Path, group_of_one: Any,
) -> None:
    app_state, model, optimizer = _state(seed=1)
    tier = MemoryCheckpoints(_spec(tmp_path), rank=0, world_size=1, folder=tmp_path / "mem")
    _train(model, optimizer, 3)
    app_state["data"].position = 3
    tier.save(3, app_state)
    expected_weights = [p.detach().clone() for p in model.parameters()]
    expected_moments = [optimizer.state[p]["exp_avg"].clone() for p in model.parameters()]
    expected_draw = torch.randn(5)  # what the restored generator must draw next
    tier.close()

    # A fresh process's objects: other weights, no optimizer state, another generator.
    fresh_state, fresh_model, fresh_optimizer = _state(seed=2)
    torch.manual_seed(99)
    restarted = MemoryCheckpoints(_spec(tmp_path), rank=0, world_size=1,
                                  folder=tmp_path / "mem")
    restored = restarted.load_latest(fresh_state)
    assert restored is not None and (restored.step, restored.tier) == (3, "memory")
    for got, want in zip(fresh_model.parameters(), expected_weights, strict=True):
        assert torch.equal(got, want)
    for param, want in zip(fresh_model.parameters(), expected_moments, strict=True):
        assert torch.equal(fresh_optimizer.state[param]["exp_avg"], want)
    assert fresh_state["data"].position == 3
    assert torch.equal(torch.randn(5), expected_draw)
    # The restored optimizer takes the step the original takes.
    torch.manual_seed(5)
    _train(model, optimizer, 1)
    torch.manual_seed(5)
    _train(fresh_model, fresh_optimizer, 1)
    for got, want in zip(fresh_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(got, want)
    restarted.close()


def test_snapshots_after_the_first_reuse_its_layout_and_still_hold_each_steps_state(
    tmp_path: Path, group_of_one: Any,
) -> None:
    """From the second snapshot on, the model's part is not walked afresh (its plan); it must
    still copy each step's values, and follow the optimizer when its state is replaced
    (as a restore from S3 does)."""
    app_state, model, optimizer = _state(seed=1)
    folder = tmp_path / "mem"
    tier = MemoryCheckpoints(_spec(tmp_path), rank=0, world_size=1, folder=folder)
    for step in (1, 2, 3):
        _train(model, optimizer, 1)
        tier.save(step, app_state)
    # The optimizer's state swapped for new tensors of other values, then one more step.
    for param in model.parameters():
        optimizer.state[param] = {key: value.clone() + 1 if key != "step" else value.clone()
                                  for key, value in optimizer.state[param].items()}
    _train(model, optimizer, 1)
    tier.save(4, app_state)
    expected_weights = [p.detach().clone() for p in model.parameters()]
    expected_moments = [optimizer.state[p]["exp_avg_sq"].clone() for p in model.parameters()]
    tier.close()

    fresh_state, fresh_model, fresh_optimizer = _state(seed=2)
    restarted = MemoryCheckpoints(_spec(tmp_path), rank=0, world_size=1, folder=folder)
    restored = restarted.load_latest(fresh_state)
    restarted.close()
    assert restored is not None and restored.step == 4
    for got, want in zip(fresh_model.parameters(), expected_weights, strict=True):
        assert torch.equal(got, want)
    for param, want in zip(fresh_model.parameters(), expected_moments, strict=True):
        assert torch.equal(fresh_optimizer.state[param]["exp_avg_sq"], want)


def test_a_torn_snapshot_falls_back_to_the_one_before_it_and_then_to_nothing(
    tmp_path: Path, group_of_one: Any,
) -> None:
    app_state, model, optimizer = _state(seed=1)
    folder = tmp_path / "mem"
    tier = MemoryCheckpoints(_spec(tmp_path), rank=0, world_size=1, folder=folder)
    _train(model, optimizer, 1)
    tier.save(1, app_state)
    at_one = [p.detach().clone() for p in model.parameters()]
    _train(model, optimizer, 1)
    tier.save(2, app_state)
    tier.close()
    # Killed in the middle of step 2's snapshot: its data written, its commit never.
    newest = max(folder.glob("*.meta"), key=lambda path: path.stat().st_mtime_ns)
    newest.unlink()

    fresh_state, fresh_model, _ = _state(seed=3)
    restarted = MemoryCheckpoints(_spec(tmp_path), rank=0, world_size=1, folder=folder)
    restored = restarted.load_latest(fresh_state)
    assert restored is not None and restored.step == 1
    for got, want in zip(fresh_model.parameters(), at_one, strict=True):
        assert torch.equal(got, want)
    restarted.close()

    # Torn the other way too (meta without its data): nothing complete is left.
    for data in folder.glob("*.data"):
        data.write_bytes(b"")
    again = MemoryCheckpoints(_spec(tmp_path), rank=0, world_size=1, folder=folder)
    assert again.load_latest(_state(seed=4)[0]) is None
    assert list(folder.iterdir()) == [], "a torn or stale snapshot is cleared away"
    again.close()


def test_a_newer_s3_checkpoint_wins_over_memory(tmp_path: Path, group_of_one: Any) -> None:
    app_state, _, _ = _state(seed=1)
    folder = tmp_path / "mem"
    tier = MemoryCheckpoints(_spec(tmp_path), rank=0, world_size=1, folder=folder)
    tier.save(4, app_state)
    tier.close()
    (part,) = tier.held()
    assert (part.step, part.world_size) == (4, 1)
    behind = MemoryCheckpoints(_spec(tmp_path), rank=0, world_size=1, folder=folder,
                               s3_latest_step=lambda: 6)
    assert behind.load_latest(app_state) is None
    behind.close()


def test_only_a_step_with_every_ranks_part_at_this_world_size_and_lineage_is_complete() -> None:
    def part(owner: int, step: int, world: int = 2, lineage: str = "a") -> Part:
        return Part(owner, step, world, lineage, data_bytes=64, slot=step % 2)

    inventory = [[part(0, 4), part(0, 6), part(1, 6, lineage="b")],
                 [part(1, 4), part(1, 6), part(0, 8, world=3)]]
    assert _complete_step(inventory, world_size=2) == (6, "a")
    assert _complete_step(inventory, world_size=3) is None
    # Rank 1 lost its folder (a replaced pod): rank 0's copy of its part is used.
    assert _holders([[part(0, 4), part(1, 4)], []], 4, "a") == {0: 0, 1: 0}
    assert _complete_step([[part(0, 4)], [part(1, 6)]], world_size=2) is None


# --- the whole trainer under torchrun ---------------------------------------------------


def _memory_job(tiny_job: Any, name: str, max_steps: int) -> Path:
    path: Path = tiny_job(name, optimization={"maxSteps": max_steps, "microBatchSize": 8,
                                              "warmupSteps": 3},
                          checkpoint={"everySteps": 1000, "export": False,
                                      "memory": {"everySteps": 2}})
    return path


def _wait_for_step(launcher: Any, job: Path, step: int, agents: list[subprocess.Popen[str]],
                   timeout: float = 150) -> None:
    deadline = time.monotonic() + timeout
    while not any(e["step"] >= step for e in launcher.events(job, "step")):
        assert all(agent.poll() is None for agent in agents), "an agent ended early"
        assert time.monotonic() < deadline, f"step {step} was never logged"
        time.sleep(0.05)


def _s3_checkpoints(job: Path) -> list[Path]:
    return sorted((job.parent / "checkpoints").glob("step-*/checkpoint.json"))


@pytest.mark.slow
def test_a_killed_trainer_resumes_from_its_own_memory_without_reading_s3(
    tiny_job: Any, launcher: Any, tmp_path: Path,
) -> None:
    job = _memory_job(tiny_job, "memory-kill", max_steps=24)
    command = launcher.command(job, ranks=2)
    command.insert(command.index("--standalone") + 1, "--max-restarts=1")
    env = {**launcher.env(), FOLDER_ENV: str(tmp_path / "shm")}
    agent = subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        _wait_for_step(launcher, job, 7, [agent])
        assert _s3_checkpoints(job) == [], "no S3 checkpoint exists before the kill"
        os.kill(launcher.worker_pid(agent.pid, rank=1), signal.SIGKILL)
        killed_at = max(e["step"] for e in launcher.events(job, "step"))
        output, _ = agent.communicate(timeout=240)
    finally:
        if agent.poll() is None:
            agent.kill()
    assert agent.returncode == 0, output[-4000:]
    (resumed,) = launcher.events(job, "resumed")
    assert resumed["uri"].startswith("memory://memory/"), resumed
    assert killed_at - 2 <= resumed["step"] <= killed_at + 1
    assert f"resumed from {resumed['uri']}" in output  # the trainer's log names the tier
    # Goodput books the load to the memory tier; the first attempt's fresh start to none.
    tiers = launcher.events(job, "goodput")[-1]["checkpoint_load_tiers"]
    assert tiers["memory"] > 0 and tiers["partner"] == tiers["s3"] == 0, tiers
    assert launcher.events(job, "finished")[-1]["step"] == 24
    assert not (tmp_path / "shm").exists() or not any((tmp_path / "shm").rglob("*.data")), \
        "a finished job frees its memory"


@pytest.mark.slow
def test_a_lost_node_resumes_from_its_partners_copy_on_the_other_node(
    tiny_job: Any, launcher: Any, tmp_path: Path,
) -> None:
    """Two torchrun agents stand for two nodes, each with its own memory folder and node
    name. Node b is lost whole (its agent, its process and its memory); a replacement node
    joins, and the survivor's restarted rank hands over the copy it kept of b's part."""
    job = _memory_job(tiny_job, "memory-node-loss", max_steps=24)
    port = launcher.free_port()

    def node(name: str, restarts: int) -> subprocess.Popen[str]:
        # torchrun as a worker pod runs it (kubetrain.trainer.launch).
        command = [sys.executable, "-m", "kubetrain.trainer.launch", "--nnodes=2",
                   "--nproc-per-node=1", "--rdzv-backend=c10d",
                   f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=memory-node-loss",
                   f"--max-restarts={restarts}", str(job),
                   "--metrics-log", str(launcher.log(job))]
        # As in a worker pod (worker_env.torchrun_env): a fresh store at each rendezvous round.
        env = {**launcher.env(), FOLDER_ENV: str(tmp_path / name), NODE_ENV: name,
               "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
        return subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)

    survivor = node("node-a", restarts=2)
    # Node a hosts the rendezvous, as worker 0's pod does: node b starts once node a's store
    # listens. (A 1 s head start was not enough on a slow machine, where torch's import
    # takes 3-6 s: node b hosted the store, and its loss took the survivor's rendezvous.)
    deadline = time.monotonic() + 120
    while not _listens(port):
        assert survivor.poll() is None and time.monotonic() < deadline, \
            "node a's rendezvous never listened"
        time.sleep(0.05)
    lost = node("node-b", restarts=0)
    replacement = None
    try:
        _wait_for_step(launcher, job, 7, [survivor, lost])
        for pid in [*descendants(lost.pid), lost.pid]:  # the node's launch, all of it
            os.kill(pid, signal.SIGKILL)
        killed_at = max(e["step"] for e in launcher.events(job, "step"))
        lost.wait(timeout=30)
        shutil.rmtree(tmp_path / "node-b")  # the node's memory went with it
        replacement = node("node-c", restarts=0)
        output, _ = survivor.communicate(timeout=300)
        # torchrun's exit barrier holds the replacement until both agents are done, which on
        # a loaded machine takes more than a minute after the survivor's
        try:
            replaced, _ = replacement.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            replacement.kill()
            replaced, _ = replacement.communicate()
            raise AssertionError(
                f"the replacement node ran on 240 s after the survivor ended "
                f"({survivor.returncode}):\n--- replacement\n{replaced[-6000:]}"
                f"\n--- survivor\n{output[-4000:]}") from None
    finally:
        for agent in (survivor, lost, replacement):
            if agent is not None and agent.poll() is None:
                agent.kill()
    assert survivor.returncode == 0, output[-4000:]
    resumed = launcher.events(job, "resumed")
    assert resumed and resumed[-1]["uri"].startswith("memory://partner/"), resumed
    assert killed_at - 2 <= resumed[-1]["step"] <= killed_at + 1
    assert f"resumed from {resumed[-1]['uri']}" in output + replaced
    tiers = launcher.events(job, "goodput")[-1]["checkpoint_load_tiers"]
    assert tiers["partner"] > 0 and tiers["s3"] == 0, tiers
    assert [e for e in launcher.events(job, "checkpoint") if e["step"] < 24] == [], \
        "no S3 checkpoint existed to resume from"
    assert _s3_checkpoints(job)[-1].parent.name == "step-00000024"
    assert launcher.events(job, "finished")[-1]["step"] == 24


def _listens(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def test_a_restore_from_own_memory_books_the_memory_tier_and_from_s3_the_s3_tier(
    tmp_path: Path, group_of_one: Any,
) -> None:
    """goodput's checkpoint_load by tier: the ledger rides in the snapshot (as in the
    trainer's app_state) and the resume books its load to the tier the state came from."""
    clock = [100.0]
    ledger = GoodputLedger(attempt_started=100.0, clock=lambda: clock[0])
    app_state, _, _ = _state(seed=1)
    app_state |= {"goodput": ledger, "checkpoint_load_tiers": ledger.tier_state}
    clock[0] += 2.0
    ledger.charge_load(load_tier(None, None))  # a fresh start: nothing to resume from
    clock[0] += 1.5
    ledger.charge_load(S3_TIER)  # an earlier resume from S3, kept in the snapshot
    tier = MemoryCheckpoints(_spec(tmp_path), rank=0, world_size=1, folder=tmp_path / "mem")
    tier.save(4, app_state)
    tier.close()

    restarted = GoodputLedger(attempt_started=200.0, clock=lambda: clock[0])
    fresh, _, _ = _state(seed=2)
    fresh |= {"goodput": restarted, "checkpoint_load_tiers": restarted.tier_state}
    clock[0] = 203.0
    restarted.charge(STARTUP)
    again = MemoryCheckpoints(_spec(tmp_path), rank=0, world_size=1, folder=tmp_path / "mem")
    restored = again.load_latest(fresh)
    again.close()
    clock[0] = 203.25
    restarted.charge_load(load_tier(restored, restored.step if restored else None))
    restarted.resume(None)
    assert restarted.load_seconds == pytest.approx({"memory": 0.25, "partner": 0.0,
                                                     "s3": 1.5})
    assert restarted.seconds[CHECKPOINT_LOAD] == pytest.approx(2.0 + 1.5 + 0.25)

    # S3 holds a newer checkpoint than memory: the memory tier gives way and S3 is booked.
    tier = MemoryCheckpoints(_spec(tmp_path), rank=0, world_size=1, folder=tmp_path / "mem")
    tier.save(6, fresh)
    tier.close()
    behind = MemoryCheckpoints(_spec(tmp_path), rank=0, world_size=1, folder=tmp_path / "mem",
                               s3_latest_step=lambda: 8)
    later = GoodputLedger(attempt_started=300.0, clock=lambda: clock[0])
    clock[0] = 300.5  # (its startup is not charged apart: all of it is the load's)
    not_restored = behind.load_latest(app_state)
    behind.close()
    assert not_restored is None
    later.charge_load(load_tier(not_restored, 8))
    assert later.load_seconds == {"memory": 0.0, "partner": 0.0, "s3": 0.5}


def test_a_copy_blocked_on_a_rank_that_is_gone_never_holds_up_the_trainers_exit() -> None:
    # The background part of a snapshot, stuck (as in a send to a lost node's rank): the
    # process still ends when its main thread does, and its future says it is not done.
    script = ("import threading, sys\n"
              "from kubetrain.trainer.memory_checkpoint import in_background\n"
              "stuck = in_background(threading.Event().wait)\n"
              "print('done' if stuck.done() else 'in flight', flush=True)\n")
    ended = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                           timeout=60)
    assert ended.returncode == 0 and ended.stdout.strip() == "in flight", ended.stderr
