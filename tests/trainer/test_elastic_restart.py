"""torchrun restarting its workers in place: the path a surviving pod takes when the
operator replaces a lost peer, or when a rank is signalled (scale-down, eviction)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest


def _sigterm_one_rank_at(launcher: Any, job: Any, step: int) -> None:
    """Train `job` on 2 ranks under torchrun --max-restarts=1 and SIGTERM one rank once
    `step` is logged, as Kubernetes does to an evicted pod: every rank saves the same
    checkpoint, the signalled rank exits 143 and the other 75; torchrun then restarts
    both in place, on the same store, and they must resume and finish."""
    command = launcher.command(job, ranks=2)
    command.insert(command.index("--standalone") + 1, "--max-restarts=1")
    agent = subprocess.Popen(command, env=launcher.env(), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not any(e["step"] >= step for e in launcher.events(job, "step")):
            assert agent.poll() is None and time.monotonic() < deadline, "training never began"
            time.sleep(0.1)
        os.kill(launcher.worker_pid(agent.pid, 1), signal.SIGTERM)
        output, _ = agent.communicate(timeout=150)
    finally:
        if agent.poll() is None:
            agent.kill()
    assert agent.returncode == 0, output[-4000:]


@pytest.mark.slow
def test_a_signalled_rank_makes_torchrun_restart_the_group_in_place_from_its_checkpoint(
    tiny_job: Any, launcher: Any,
) -> None:
    job = tiny_job("in-place", optimization={"maxSteps": 40, "microBatchSize": 8,
                                             "warmupSteps": 5},
                   checkpoint={"everySteps": 1000, "export": False})
    _sigterm_one_rank_at(launcher, job, step=8)

    saved = [e["step"] for e in launcher.events(job, "checkpoint")]
    resumed = launcher.events(job, "resumed")
    assert len(resumed) == 1 and resumed[0]["step"] == saved[0] >= 8
    assert launcher.events(job, "finished")[-1]["step"] == 40


@pytest.mark.slow
def test_with_dropout_a_group_restarted_from_its_checkpoint_logs_the_uninterrupted_losses(
    tiny_job: Any, launcher: Any,
) -> None:
    """The dropout variant of the in-place restart: the checkpoint carries each rank's
    random generators, so the resumed ranks draw the masks the uninterrupted run drew and
    every step's loss is the same. Restarted ranks reseed, so without the saved generators
    the steps after the resume would differ."""
    spec = {"model": {"preset": "tiny", "dropout": 0.1},
            "optimization": {"maxSteps": 16, "microBatchSize": 8, "warmupSteps": 3},
            "checkpoint": {"everySteps": 1000, "export": False}}
    reference = tiny_job("dropout-steady", **spec)
    steady = {e["step"]: e["loss"] for e in launcher.train(reference, ranks=2)
              if e["event"] == "step"}

    job = tiny_job("dropout-restarted", **spec)
    _sigterm_one_rank_at(launcher, job, step=5)

    (resumed,) = launcher.events(job, "resumed")
    assert 5 <= resumed["step"] < 16, "the restart resumed from a checkpoint before the end"
    # A step redone after the restart logs its loss again: the last one counts.
    restarted = {e["step"]: e["loss"] for e in launcher.events(job, "step")}
    assert restarted == steady


def _pending_sigterm(pid: int) -> bool:
    """Whether a SIGTERM waits for stopped process `pid` (its shared pending set); raises
    ProcessLookupError once it has ended."""
    try:
        status = dict(line.split(":", 1) for line in
                      Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    except FileNotFoundError:
        raise ProcessLookupError(pid) from None
    if status["State"].split()[0] in ("Z", "X"):
        raise ProcessLookupError(pid)
    return bool(int(status["ShdPnd"], 16) & (1 << (signal.SIGTERM - 1)))


def _state(pid: int) -> str:
    """Process `pid`'s state letter and name, or "gone"."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return "gone"
    return stat.rsplit(")", 1)[1].split()[0] + " " + stat[stat.index("(") + 1:stat.rindex(")")]


HOLDER = Path(__file__).with_name("hold_at_step.py")


def _stop_the_agent_as_its_ranks_finish(launcher: Any, job: Path) -> float | None:
    """Run `job` on 2 ranks; once the last step is logged (past the last step boundary:
    the final save, the export and the report are left), hold both ranks (SIGSTOP), send
    their agent SIGTERM, and let them go on once it has signalled them. Seconds from then
    until the agent ended; None when a rank ended before it could be held, or while held
    (the agent's SIGTERM ends a rank at once past its handler's removal, after the final
    save and export): then nothing was tried."""
    # A session of its own: a failed check kills the agent's whole tree, not the agent alone
    # (a clean clone's failure left its fork server and ranks running).
    agent = subprocess.Popen(launcher.command(job, ranks=2), env=launcher.env(),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
    try:
        ranks = [launcher.worker_pid(agent.pid, rank) for rank in (0, 1)]
        deadline = time.monotonic() + 120
        # Held by a process of its own, the moment the last step is logged (hold_at_step.py
        # says why not by this one).
        holder = subprocess.Popen([sys.executable, str(HOLDER), str(launcher.log(job)), "12",
                                   *map(str, ranks)])
        try:
            while holder.poll() is None and agent.poll() is None:
                assert time.monotonic() < deadline, "training never ended"
                time.sleep(0.05)
            try:
                held = holder.wait(timeout=10) == 0  # once the agent ended: its last look
            except subprocess.TimeoutExpired:
                held = False  # the agent ended without the last step logged
        finally:
            holder.kill()
            holder.wait()
        if held:
            os.kill(agent.pid, signal.SIGTERM)
        try:
            while held and not all(_pending_sigterm(pid) for pid in ranks):
                assert time.monotonic() < deadline, "the agent never signalled its ranks"
                time.sleep(0.01)
        except ProcessLookupError:
            held = False
        if not held:
            # What each rank was, for a run where every try ends here.
            states = {pid: _state(pid) for pid in ranks}
            logged = [e["event"] for e in launcher.events(job, None)][-4:]
            print(f"not held: the holder exited {holder.returncode}; ranks {states}; "
                  f"last events {logged}")
            return None
        for pid in ranks:
            os.kill(pid, signal.SIGCONT)
        continued = time.monotonic()
        output, _ = agent.communicate(timeout=60)
        stopped = time.monotonic() - continued
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(agent.pid, signal.SIGKILL)  # what is left of the tree, if anything
        agent.wait()
    (finished,) = launcher.events(job, "finished")
    assert finished["step"] == 12, output[-3000:]
    return stopped


def test_ranks_signalled_as_they_finish_let_their_stopping_agent_go_at_once(
    tiny_job: Any, launcher: Any,
) -> None:
    """The agent stops its ranks (a new member at the rendezvous, the pod deleted) just as
    they finish, past their last step: they end their run as they would have, and must not
    then wait for the stopping agent to read their result, which it would give up on only
    at its 30 s shutdown timeout, holding the group's restart up that long."""
    for attempt in range(3):  # on a loaded machine a rank may finish before it is held
        job = tiny_job(f"finishing-{attempt}",
                       optimization={"maxSteps": 12, "microBatchSize": 8, "warmupSteps": 2},
                       checkpoint={"everySteps": 1000, "export": True})
        stopped = _stop_the_agent_as_its_ranks_finish(launcher, job)
        if stopped is not None:
            break
    assert stopped is not None, "the ranks finished before they could be held, three times"
    print(f"the agent ended {stopped:.2f}s after its ranks went on; its shutdown timeout is 30s")
    assert stopped < 10
