"""Failures a restart in place cannot cure end the pod: the worker stops its torchrun agent.

torchrun restarts failed workers in place up to --max-restarts (PET_MAX_RESTARTS in a
pod). For a device out of memory (the same micro-batch runs out again) that only burns
time: the trainer writes its termination message and asks its agent to stop, so the pod
fails and the operator (or `kubetrain run`) restarts it with half the micro-batch. Here
2 real ranks under torchrun, allowed 3 restarts, run out of memory in their first step
(oom_worker.py: a model that raises torch.OutOfMemoryError above LIMIT sequences);
torchrun ends after the first attempt. The preflight's case is in test_preflight.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

WORKER = Path(__file__).with_name("oom_worker.py")


def test_out_of_memory_under_torchrun_ends_the_agent_without_a_restart_in_place(
        tiny_job, launcher, tmp_path: Path) -> None:
    job = tiny_job("oom-torchrun", optimization={"maxSteps": 6, "microBatchSize": 8})
    termination_log = tmp_path / "termination-log"
    termination_log.touch()  # the kubelet creates it in the container
    env = {**launcher.env(), "KUBETRAIN_TERMINATION_LOG": str(termination_log)}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         "--max-restarts=3", str(WORKER), str(job), str(tmp_path / "metrics.jsonl"), "4"],
        env=env, capture_output=True, text=True, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode != 0, output[-3000:]
    # One attempt: its start was printed once, a rank ran out of memory (the other may
    # be stopped by the agent first), and the agent, signalled, restarted nobody.
    assert output.count("training from step 0 to 6 with 2 processes") == 1, output[-4000:]
    assert 1 <= output.count("CUDAOutOfMemory at micro-batch 8") <= 2, output[-4000:]
    assert "Received 15 death signal" in output, output[-4000:]
    first = termination_log.read_text().splitlines()[0]
    assert first.startswith('kubetrain_worker_failure_info{class="CUDAOutOfMemory"'), first
