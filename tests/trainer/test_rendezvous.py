"""The `kubetrain` rendezvous backend (kubetrain.trainer.rendezvous) in real torchrun agents:
found through its entry point, restarting a group after a failed worker, and joining the
same rounds as an agent on plain c10d (the state and its protocol are c10d's)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

from kubetrain.local.launch import free_port
from kubetrain.protocol import RENDEZVOUS_BACKEND
from kubetrain.trainer.rendezvous import create_handler, poll_seconds, register_rendezvous

# Rank 1 fails once, after the group formed (the marker file says it did); the next round
# finishes. (Only the failed worker's agent counts that round as a restart: the other's
# TORCHELASTIC_RESTART_COUNT stays 0, so the marker, not the count, tells the rounds apart.)
_WORKER = """
import os, sys
import torch, torch.distributed as dist
dist.init_process_group("gloo")
total = torch.ones(1)
dist.all_reduce(total)
os.write(1, f"rank {dist.get_rank()} of {int(total.item())}\\n".encode())
if dist.get_rank() == 1 and not os.path.exists(sys.argv[1]):
    open(sys.argv[1], "w").close()
    os._exit(1)
dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.timeout(180)
def test_a_failed_worker_rejoins_through_the_backend_beside_an_agent_on_plain_c10d(
        tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    endpoint = f"127.0.0.1:{free_port()}"
    agents = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
         "--rdzv-backend", backend, "--rdzv-endpoint", endpoint, "--rdzv-id", "rejoin",
         "--max-restarts", "1", "--monitor-interval", "0.1", str(script),
         str(tmp_path / "failed-once")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        # A fresh store for the workers at each round, as in the pods (worker_env.torchrun_env).
        env={**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
        for backend in (RENDEZVOUS_BACKEND, "c10d")]  # the rendezvous host on kubetrain's
    try:
        outputs = [agent.communicate(timeout=150)[0] for agent in agents]
    finally:
        for agent in agents:
            agent.kill()
    assert [agent.returncode for agent in agents] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    formed = sorted(re.findall(r"rank (\d) of (\d)", "".join(outputs)))
    # Two rounds, each of the whole group of two: rank 1's agent restarted after its
    # failure, rank 0's for the new round.
    assert (tmp_path / "failed-once").exists()
    assert formed == [("0", "2"), ("0", "2"), ("1", "2"), ("1", "2")], outputs


def test_the_backend_is_registered_once_whether_found_or_registered_here() -> None:
    register_rendezvous()
    register_rendezvous()  # no "already registered" error
    assert rendezvous_handler_registry._registry[RENDEZVOUS_BACKEND] is create_handler


@pytest.mark.parametrize(("nodes", "seconds"), [(1, 0.1), (100, 0.1), (400, 0.4),
                                                (1000, 1.0), (5000, 1.0)])
def test_the_poll_grows_with_the_group_up_to_torchs_second(nodes: int, seconds: float) -> None:
    assert poll_seconds(nodes) == pytest.approx(seconds)
