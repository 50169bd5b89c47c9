"""The `kubetrain` rendezvous backend (kubetrain.trainer.rendezvous): in real torchrun agents,
found through its entry point and restarting a group after a failed worker; its handlers,
each one agent's, on a real store (threads for agents): rounds, ranks in torch's order, a
replacement, late and redundant agents, the last call, timeouts and closing."""

from __future__ import annotations

import contextlib
import os
import random
import re
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousParameters,
    RendezvousTimeoutError,
    rendezvous_handler_registry,
)

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
def test_a_failed_worker_rejoins_through_the_backend(
        tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    endpoint = f"127.0.0.1:{free_port()}"
    agents = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
         "--rdzv-backend", RENDEZVOUS_BACKEND, "--rdzv-endpoint", endpoint, "--rdzv-id", "rejoin",
         "--max-restarts", "1", "--monitor-interval", "0.1", str(script),
         str(tmp_path / "failed-once")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        # A fresh store for the workers at each round, as in the pods (worker_env.torchrun_env).
        env={**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
        for _ in range(2)]
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


# --- the handlers, one per agent, on a real store --------------------------------------


@pytest.fixture
def store_port() -> Iterator[int]:
    """Worker 0's rendezvous store, served from this process (TORCH_DISABLE_SHARE... as
    in the pods: the round's workers meet at an address rank 0 publishes)."""
    server = TCPStore("127.0.0.1", 0, is_master=True, multi_tenant=True,
                      wait_for_workers=False)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
        yield server.port
    del server


def agent(port: int, pod: int, min_nodes: int, max_nodes: int, **config: Any) -> Any:
    """The handler torchrun's agent of worker pod `pod` would use (its descriptor: the pod's
    hostname, PID 1 of its container, its process's first handler)."""
    address = f"job-worker-{pod}.job.default.svc"
    handler = create_handler(RendezvousParameters(
        backend=RENDEZVOUS_BACKEND, endpoint=f"127.0.0.1:{port}", run_id="job-uid",
        min_nodes=min_nodes, max_nodes=max_nodes, local_addr=address, is_host=False,
        **config))
    handler.descriptor = f"{address} 1 0"
    return handler


def joining(pool: ThreadPoolExecutor, handlers: list[Any]) -> list[Future[Any]]:
    """Each handler's next_rendezvous, in a thread of its own, in a random order."""
    order = list(handlers)
    random.Random(53).shuffle(order)
    futures = {id(h): pool.submit(h.next_rendezvous) for h in order}
    return [futures[id(h)] for h in handlers]


def formed(futures: list[Future[Any]]) -> list[tuple[int, int]]:
    return [(info.rank, info.world_size) for info in (f.result(timeout=30) for f in futures)]


def until(check: Callable[[], bool], what: str, timeout: float = 20) -> None:
    event = threading.Event()
    waited = 0.0
    while not check():
        assert waited < timeout, f"timed out waiting for {what}"
        event.wait(0.05)
        waited += 0.05


def test_a_round_forms_once_every_agent_joined_with_ranks_in_torchs_order(
        store_port: int) -> None:
    pods = [0, 1, 2, 10, 11, 3]  # torch sorts descriptors as text: worker-10 before worker-2
    handlers = [agent(store_port, pod, 6, 6) for pod in pods]
    with ThreadPoolExecutor(6) as pool:
        futures = joining(pool, handlers)
        assert formed(futures) == [(0, 6), (1, 6), (4, 6), (2, 6), (3, 6), (5, 6)]
    # Worker 0, which hosts the store, is rank 0: the workers meet at its address.
    addresses = {f.result().bootstrap_store_info.master_addr for f in futures}
    assert addresses == {"job-worker-0.job.default.svc"}


def test_a_replaced_agent_opens_the_next_round_and_the_others_restart_into_it(
        store_port: int) -> None:
    handlers = [agent(store_port, pod, 4, 4) for pod in range(4)]
    with ThreadPoolExecutor(8) as pool:
        assert formed(joining(pool, handlers)) == [(0, 4), (1, 4), (2, 4), (3, 4)]
        # Worker 2's node is lost; its replacement pod's agent has its name (and PID 1).
        replacement = agent(store_port, 2, 4, 4)
        joined = pool.submit(replacement.next_rendezvous)
        survivors = [handlers[i] for i in (0, 1, 3)]
        until(lambda: all(h.num_nodes_waiting() > 0 for h in survivors),
              "the survivors to see a node waiting")
        rejoined = [pool.submit(h.next_rendezvous) for h in survivors]
        assert formed([*rejoined[:2], joined, rejoined[2]]) == [(0, 4), (1, 4), (2, 4), (3, 4)]
    assert {h.round for h in [*survivors, replacement]} == {1}


def test_a_late_agent_waits_for_the_next_round_which_the_members_then_join(
        store_port: int) -> None:
    # Elastic, 2 to 4: the round forms at its last call with those who came.
    handlers = [agent(store_port, pod, 2, 4, last_call_timeout=1) for pod in range(3)]
    with ThreadPoolExecutor(4) as pool:
        assert formed(joining(pool, handlers[:2])) == [(0, 2), (1, 2)]
        late = pool.submit(handlers[2].next_rendezvous)
        until(lambda: handlers[0].num_nodes_waiting() == 1, "the late agent to be seen")
        rejoined = [pool.submit(h.next_rendezvous) for h in handlers[:2]]
        assert formed([*rejoined, late]) == [(0, 3), (1, 3), (2, 3)]


def test_a_newcomer_waits_for_the_members_however_long_they_take_to_restart(
        store_port: int) -> None:
    # Elastic, 1 to 2, as the whole loop's hsdp job: worker 0's group lost worker 1 and
    # went on alone. Worker 1's new pod (a newcomer to that round: its predecessor was
    # not in it) must not form a round of its own at its last call while worker 0 stops
    # its workers, which takes longer (a checkpoint on SIGTERM): each of the two would
    # then keep closing rounds the other came too late for.
    alone = agent(store_port, 0, 1, 2, last_call_timeout=1)
    newcomer = agent(store_port, 1, 1, 2, last_call_timeout=1)
    with ThreadPoolExecutor(2) as pool, closed_at_the_end(store_port):
        assert formed([pool.submit(alone.next_rendezvous)]) == [(0, 1)]
        joined = pool.submit(newcomer.next_rendezvous)
        until(lambda: alone.num_nodes_waiting() == 1, "worker 0 to see the newcomer")
        threading.Event().wait(2.5)  # past the newcomer's last call, twice over
        assert not joined.done()
        assert formed([pool.submit(alone.next_rendezvous), joined]) == [(0, 2), (1, 2)]


def test_members_of_the_last_round_keep_their_seats_before_newcomers_take_the_rest(
        store_port: int) -> None:
    member = agent(store_port, 0, 1, 2, last_call_timeout=1)
    newcomers = [agent(store_port, pod, 1, 2, last_call_timeout=1) for pod in (1, 2)]
    with ThreadPoolExecutor(3) as pool, closed_at_the_end(store_port):
        assert formed([pool.submit(member.next_rendezvous)]) == [(0, 1)]
        waiting = [pool.submit(h.next_rendezvous) for h in newcomers]
        until(lambda: member.num_nodes_waiting() == 2, "worker 0 to see both newcomers")
        # Two newcomers fill the next round's two seats between them, but form nothing
        # without a member: worker 0 restarts into it and keeps its seat.
        threading.Event().wait(1.5)
        assert not any(w.done() for w in waiting)
        rejoined = pool.submit(member.next_rendezvous)
        assert rejoined.result(timeout=30).rank == 0 and rejoined.result().world_size == 2
        until(lambda: sum(w.done() for w in waiting) == 1, "one newcomer to get the seat")
        # The other waits for a seat without asking the full group to restart.
        threading.Event().wait(0.5)
        assert sum(w.done() for w in waiting) == 1 and member.num_nodes_waiting() == 0
        [left] = [w for w in waiting if not w.done()]
        agent(store_port, 99, 1, 2).shutdown()  # closing wakes it
        with pytest.raises(RendezvousClosedError):
            left.result(timeout=10)


@contextlib.contextmanager
def closed_at_the_end(port: int) -> Iterator[None]:
    """Close the rendezvous as the block ends, whatever it asserted, from an agent of its
    own (a handler's store connection is busy while its thread waits): it wakes the
    agents' threads still waiting in it, which the pool's end would wait for."""
    try:
        yield
    finally:
        agent(port, 99, 1, 1).shutdown()


def test_a_full_round_keeps_an_extra_agent_waiting_until_a_member_restarts(
        store_port: int) -> None:
    members = [agent(store_port, pod, 2, 2) for pod in range(2)]
    extra = agent(store_port, 5, 1, 2)
    with ThreadPoolExecutor(4) as pool:
        assert formed(joining(pool, members)) == [(0, 2), (1, 2)]
        waiting = pool.submit(extra.next_rendezvous)
        threading.Event().wait(0.5)
        # No room: it waits without asking the members to restart.
        assert not waiting.done() and members[0].num_nodes_waiting() == 0
        restarted = pool.submit(members[1].next_rendezvous)  # its worker failed
        # Worker 1 restarted first: worker 5 takes the seat worker 0 then comes too late for.
        assert formed([restarted, waiting]) == [(0, 2), (1, 2)]
        # Worker 0 sees the new round's two (its answer is at most a poll old).
        until(lambda: members[0].num_nodes_waiting() == 2, "worker 0 to see the new round")


def test_a_round_that_never_fills_times_out_and_a_closed_one_refuses(
        store_port: int) -> None:
    alone = agent(store_port, 0, 2, 2, join_timeout=1)
    with pytest.raises(RendezvousTimeoutError):
        alone.next_rendezvous()
    waiting, closing = agent(store_port, 1, 3, 3), agent(store_port, 2, 3, 3)
    with ThreadPoolExecutor(2) as pool:
        joined = pool.submit(waiting.next_rendezvous)
        threading.Event().wait(0.3)
        closing.shutdown()  # an agent that finished closes the rendezvous for all
        with pytest.raises(RendezvousClosedError):
            joined.result(timeout=10)
    assert waiting.is_closed()
    with pytest.raises(RendezvousClosedError):
        agent(store_port, 3, 3, 3).next_rendezvous()


def test_sixty_four_agents_form_a_round_and_reform_it_around_a_replacement(
        store_port: int) -> None:
    # Issue 53: each agent touches the store a few times a round, whatever the group's size
    # (bench/scale.py times it up to 1,024 agents).
    size = 64
    with ThreadPoolExecutor(16) as pool:
        handlers = list(pool.map(lambda pod: agent(store_port, pod, size, size), range(size)))
    with ThreadPoolExecutor(size + 1) as pool:
        ranks = formed(joining(pool, handlers))
        assert sorted(ranks) == [(rank, size) for rank in range(size)]
        replacement = agent(store_port, 33, size, size)
        joined = pool.submit(replacement.next_rendezvous)
        survivors = [h for pod, h in enumerate(handlers) if pod != 33]
        until(lambda: all(h.num_nodes_waiting() > 0 for h in survivors),
              "every survivor to see the replacement waiting")
        rejoined = formed([pool.submit(h.next_rendezvous) for h in survivors] + [joined])
    assert sorted(rejoined) == [(rank, size) for rank in range(size)]
    assert rejoined[-1] == ranks[33], "the replacement takes its predecessor's rank"


def test_an_agent_that_outlives_the_store_host_ends_without_an_error() -> None:
    # The store lives in worker 0's agent: an agent that finishes after it cannot close the
    # rendezvous, and says so (torchrun then exits 0 for a finished group, as with c10d).
    server = TCPStore("127.0.0.1", 0, is_master=True, multi_tenant=True,
                      wait_for_workers=False)
    late = agent(server.port, 1, 2, 2)
    del server
    assert late.shutdown() is False
    with pytest.raises(RendezvousConnectionError):
        late.is_closed()
