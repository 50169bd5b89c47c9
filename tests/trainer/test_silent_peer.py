"""A peer that goes silent (its node lost: no answer, no connection reset) under a real
torchrun, and a long but healthy step (issue 33 item 1).

A silent peer is a rank stopped with SIGSTOP: its process and connections stay, nothing
answers, as when a node's network goes down. The surviving rank blocks in a collective
with it; when its torchrun agent then stops it (as it does once the lost rank's
replacement joins the rendezvous), it must exit within the stop deadline derived from
its step time, not wait for torchrun's 30 s shutdown timeout or gloo's. A rank stopped
for a second and a half and then resumed is a long step: nothing may restart, and the
operator's lifelines may not take its pod for lost."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from kubetrain.operator.facts import WorkerPod
from kubetrain.operator.lifeline_watch import LifelineWatch
from kubetrain.protocol import lifeline_port
from kubetrain.trainer.distributed import STOP_DEADLINE_FLOOR


def _start(launcher: Any, job: Any, pod: str | None = None) -> subprocess.Popen[str]:
    command = launcher.command(job, ranks=2, in_pod=pod is not None)
    command.insert(command.index("--standalone") + 1, "--max-restarts=1")
    env = launcher.env() if pod is None else {**launcher.env(), "KUBETRAIN_POD_NAME": pod}
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _until_step(launcher: Any, job: Any, agent: subprocess.Popen[str], step: int) -> None:
    deadline = time.monotonic() + 120
    while not any(e["step"] >= step for e in launcher.events(job, "step")):
        assert agent.poll() is None and time.monotonic() < deadline, "training never began"
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def test_a_rank_blocked_on_a_silent_peer_exits_within_its_stop_deadline(
        tiny_job: Any, launcher: Any) -> None:
    job = tiny_job("silent", optimization={"maxSteps": 40, "microBatchSize": 8,
                                           "warmupSteps": 5},
                   checkpoint={"everySteps": 8, "export": False},
                   runPolicy={"preflight": {"enabled": False}})
    agent = _start(launcher, job)
    try:
        _until_step(launcher, job, agent, 12)
        survivor, silent = (launcher.worker_pid(agent.pid, rank) for rank in (0, 1))
        os.kill(silent, signal.SIGSTOP)  # the node goes silent
        time.sleep(1.0)  # the survivor is now blocked in a collective with it
        stopped_at = time.monotonic()
        os.kill(survivor, signal.SIGTERM)  # its agent stops it, to re-form the group
        while _alive(survivor):
            assert time.monotonic() - stopped_at < 60, "the survivor never exited"
            time.sleep(0.02)
        exited = time.monotonic() - stopped_at
        os.kill(silent, signal.SIGKILL)  # the lost node's processes are gone for good
        output, _ = agent.communicate(timeout=180)
    finally:
        if agent.poll() is None:
            agent.kill()
        with contextlib.suppress(ProcessLookupError, NameError):
            os.kill(silent, signal.SIGKILL)
    print(f"the survivor exited {exited:.2f}s after its SIGTERM (floor "
          f"{STOP_DEADLINE_FLOOR:g}s); torchrun's own shutdown timeout is 30s")
    assert agent.returncode == 0, output[-4000:]
    assert "stop not agreed" in output and "a peer is gone" in output, output[-4000:]
    assert exited < 30, exited
    # torchrun re-formed the group in place, which resumed from its checkpoint and finished.
    resumed = launcher.events(job, "resumed")
    assert len(resumed) == 1 and resumed[0]["step"] >= 8, resumed
    assert launcher.events(job, "finished")[-1]["step"] == 40


def test_a_step_many_times_longer_than_the_others_restarts_nothing(
        tiny_job: Any, launcher: Any) -> None:
    job = tiny_job("long-step", optimization={"maxSteps": 30, "microBatchSize": 8,
                                              "warmupSteps": 5},
                   checkpoint={"everySteps": 8, "export": False},
                   runPolicy={"preflight": {"enabled": False}})
    # As in a pod, with the operator's lifelines following the pod's (its launcher beats,
    # whatever a rank does).
    port = yaml.safe_load(job.read_text())["spec"]["metrics"]["port"]
    loop = asyncio.new_event_loop()
    lifelines = LifelineWatch(lambda key: None, retry_seconds=0.1)
    lifelines.start(loop)
    following = threading.Thread(target=loop.run_forever, daemon=True)
    following.start()
    key = ("default", "long-step")
    lifelines.follow(key, [WorkerPod(name="long-step-worker-0", index=0, restart_attempt=0,
                                     phase="Running", ip="127.0.0.1")],
                     lifeline_port(port), 2)
    silent: set[str] = set()
    agent = _start(launcher, job, pod="long-step-worker-0")
    try:
        _until_step(launcher, job, agent, 10)
        slow = launcher.worker_pid(agent.pid, 1)
        os.kill(slow, signal.SIGSTOP)  # one step takes 1.5 s more than the others
        stopped = time.monotonic()
        while time.monotonic() - stopped < 1.5:
            silent |= lifelines.silent(key)
            time.sleep(0.01)
        os.kill(slow, signal.SIGCONT)
        output, _ = agent.communicate(timeout=180)
    finally:
        if agent.poll() is None:
            agent.kill()
        asyncio.run_coroutine_threadsafe(lifelines.close(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        following.join(10)
    assert agent.returncode == 0, output[-4000:]
    assert silent == set(), "the long step was taken for a lost node"
    assert lifelines.ends(key) == (), lifelines.ends(key)
    steps = launcher.events(job, "step")
    longest = max(e["step_time"] for e in steps)
    typical = sorted(e["step_time"] for e in steps)[len(steps) // 2]
    print(f"longest step {longest:.2f}s, median {typical:.3f}s")
    assert longest > 5 * typical, (longest, typical)
    assert launcher.events(job, "resumed") == [], "the long step restarted the group"
    assert "stop not agreed" not in output
    assert launcher.events(job, "finished")[-1]["step"] == 30


def test_the_stop_deadline_follows_the_latest_steps_not_a_slow_stretch_long_past() -> None:
    # A straggler's slow steps (or a first evaluation) long before the signal must not keep
    # the deadline long: after STOP_DEADLINE_RECENT short steps it is the floor again.
    import torch
    import torch.distributed as dist

    from kubetrain.trainer.distributed import STOP_DEADLINE_RECENT, StopRequest

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        stop = StopRequest()
        cpu = torch.device("cpu")
        stop.agreed(cpu)  # the first boundary: start-up is no step
        time.sleep(1.0)
        stop.agreed(cpu)  # one slow step
        assert stop.longest_span >= 1.0 and stop.deadline() >= 4.0
        for _ in range(STOP_DEADLINE_RECENT - 1):
            stop.agreed(cpu)
        assert stop.longest_span >= 1.0, "still among the latest steps"
        stop.agreed(cpu)
        assert stop.longest_span < 0.5 and stop.deadline() == STOP_DEADLINE_FLOOR
    finally:
        dist.destroy_process_group()


# Rank 0 and rank 1 measure three steps together; then rank 1 goes silent (alive, never
# answering: no connection reset) and rank 0 enters a collective between two steps: the
# logged interval's gathers (as the loop marks them), evaluation's closing sum, an S3
# checkpoint's barrier, a synchronous save's own collectives past that barrier (DCP's plan,
# the commit's gather: rank 1 went silent just after the barrier), or an in-memory
# snapshot's wait for its last copy to the partner.
_BLOCKED = """
import contextlib, sys, time, torch, torch.distributed as dist
from pathlib import Path
from kubetrain.api.presets import PRESETS
from kubetrain.api.trainingjob import TrainingJobSpec
from kubetrain.trainer.checkpoint import Checkpointer, ModelState
from kubetrain.trainer.data import TokenDataset
from kubetrain.trainer.distributed import StopRequest
from kubetrain.trainer.evaluation import evaluate
from kubetrain.trainer.memory_checkpoint import MemoryCheckpoints
from kubetrain.trainer.model import Transformer
from kubetrain.trainer.parallelize import ParallelModel
from kubetrain.trainer.rank_timing import WaitClock
rank, port, where, validation, folder = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3],
                                         sys.argv[4], Path(sys.argv[5]))
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
clock = WaitClock()
stop = StopRequest(inside_since=lambda: clock.inside_since)
stop.install()
spec = TrainingJobSpec.model_validate({
    "image": "kubetrain/trainer:test", "data": {"train": "s3://bucket/train"},
    "checkpoint": {"uri": str(folder / "checkpoints"), "async": where != "checkpoint-write",
                   "memory": {"everySteps": 1}}})
tier = (Checkpointer(spec, rank=rank, world_size=2) if where.startswith("checkpoint")
        else MemoryCheckpoints(spec, rank=rank, world_size=2, folder=folder / f"memory-{rank}",
                               node=f"node-{rank}") if where == "snapshot" else None)
for _ in range(3):
    stop.agreed(torch.device("cpu"))
if rank == 1:
    if where == "checkpoint-write":
        tier._barrier()  # the save's barrier: rank 0 goes on into DCP's own collectives
    time.sleep(600)
if where == "evaluation":
    model = ParallelModel(Transformer(PRESETS["tiny"].dims, max_seq_len=64),
                          contextlib.nullcontext, None, contextlib.nullcontext)
    data = TokenDataset(validation, seq_len=64, micro_batch_size=2, rank=0, world_size=2)
    print("blocked", flush=True)
    evaluate(model, data, 2, torch.device("cpu"), clock)
elif tier is not None:
    tier.waiting_on_peers = clock.inside  # as the loop sets it
    linear = torch.nn.Linear(4, 4)
    state = {"model": ModelState(linear, torch.optim.SGD(linear.parameters(), lr=0.1))}
    print("blocked", flush=True)
    for step in (1, 2):  # the snapshot's first returns; its copy to rank 1 never ends
        tier.save(step, state)
else:
    print("blocked", flush=True)
    with clock.inside():
        dist.all_reduce(torch.ones(1))
"""


@pytest.mark.parametrize("where", ["between-steps", "evaluation", "checkpoint",
                                   "checkpoint-write", "snapshot"])
def test_a_rank_blocked_outside_a_step_on_a_silent_peer_exits_within_its_stop_deadline(
        launcher: Any, prepared_corpus: Any, tmp_path: Path, where: str) -> None:
    from kubetrain.protocol import EXIT_RESTART

    port = launcher.free_port()
    ranks = [subprocess.Popen([sys.executable, "-c", _BLOCKED, str(rank), str(port), where,
                               prepared_corpus.validation_uri, str(tmp_path)],
                              env=launcher.env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    try:
        assert ranks[0].stdout is not None
        assert ranks[0].stdout.readline().strip() == "blocked"
        time.sleep(0.5)
        signalled = time.monotonic()
        ranks[0].send_signal(signal.SIGTERM)
        output, _ = ranks[0].communicate(timeout=60)
        exited = time.monotonic() - signalled
    finally:
        for process in ranks:
            process.kill()
    assert ranks[0].returncode == EXIT_RESTART, output
    assert "stop not agreed" in output, output
    assert exited < STOP_DEADLINE_FLOOR + 5, exited
