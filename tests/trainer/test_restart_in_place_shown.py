"""A trainer killed under a real torchrun (the pods' launcher), which restarts the group in
place: the pod's lifeline (kubetrain.trainer.lifeline) tells the operator's lifelines
(kubetrain.operator.lifeline_watch) at once, once, and goodput books the downtime and the steps
redone (issue 33 item 2)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import threading
import time
from typing import Any

import yaml

from kubetrain.operator.facts import WorkerPod
from kubetrain.operator.lifeline_watch import LifelineWatch
from kubetrain.protocol import lifeline_port


class _Following:
    """The operator's lifelines on their own event loop, in a thread, as in the operator."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.news: list[tuple[str, str]] = []
        self.lifelines = LifelineWatch(self.news.append, settle_seconds=0.0, retry_seconds=0.1)
        self.lifelines.start(self.loop)
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.lifelines.close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def test_a_trainer_killed_under_torchrun_is_seen_at_once_and_goodput_books_the_restart(
        tiny_job: Any, launcher: Any) -> None:
    job = tiny_job("killed", optimization={"maxSteps": 36, "microBatchSize": 8,
                                           "warmupSteps": 5},
                   checkpoint={"everySteps": 8, "export": False},
                   runPolicy={"preflight": {"enabled": False}})
    port = yaml.safe_load(job.read_text())["spec"]["metrics"]["port"]
    command = launcher.command(job, ranks=2, in_pod=True)
    command.insert(command.index("--standalone") + 1, "--max-restarts=1")
    # In a pod: the operator sets KUBETRAIN_POD_NAME, and the launcher serves its lifeline.
    env = {**launcher.env(), "KUBETRAIN_POD_NAME": "killed-worker-0"}
    following = _Following()
    key = ("default", "killed")
    pod = WorkerPod(name="killed-worker-0", index=0, restart_attempt=0, phase="Running",
                    ip="127.0.0.1")
    following.lifelines.follow(key, [pod], lifeline_port(port), 2)
    agent = subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not any(e["step"] >= 12 for e in launcher.events(job, "step")):
            assert agent.poll() is None and time.monotonic() < deadline, "training never began"
            time.sleep(0.05)
        killed_at = time.monotonic()
        os.kill(launcher.worker_pid(agent.pid, 1), signal.SIGKILL)
        while not following.lifelines.ends(key):
            assert time.monotonic() - killed_at < 10, "the lifelines never saw the kill"
            time.sleep(0.01)
        seen = time.monotonic() - killed_at
        output, _ = agent.communicate(timeout=150)
    finally:
        if agent.poll() is None:
            agent.kill()
        following.close()
    assert agent.returncode == 0, output[-4000:]
    print(f"the kill seen by the operator's lifelines {seen * 1000:.0f} ms after SIGKILL")
    # One failure: the killed rank's. Rank 0 failed only because its peer vanished (or was
    # stopped by its agent), and the finished run ended in order.
    ends = following.lifelines.ends(key)
    assert [(end.pod, end.failure_class, end.exit_code) for end in ends] == [
        ("killed-worker-0", "Unknown", None)], ends
    assert following.news == [key]
    # torchrun restarted both in place; they resumed from step 8 and finished.
    resumed = launcher.events(job, "resumed")
    assert len(resumed) == 1 and resumed[0]["step"] == 8, resumed
    assert launcher.events(job, "finished")[-1]["step"] == 36
    # Goodput books the restart: the time between attempts, and the steps done again.
    booked = launcher.events(job, "goodput")[-1]["seconds"]
    print(f"goodput after the in-place restart: downtime {booked['downtime']:.2f}s, "
          f"lost progress {booked['lost_progress']:.2f}s, startup {booked['startup']:.2f}s")
    assert booked["downtime"] > 0 and booked["lost_progress"] > 0, booked
