"""torchrun's rendezvous for kubetrain: rounds that each agent joins in a few store operations.

Every restart of a group is a new rendezvous round: the agent whose worker failed (or a
replacement pod's) asks for one, the others learn of it and stop their workers, and all of
them join. torch's dynamic rendezvous (the c10d backend) keeps a round's whole membership
in one value of the store on worker 0, which every agent reads and writes back with a
compare-and-set for each step it takes (leave the round, wait for the next, join it, beat),
polling it once a second meanwhile. That value grows with the group (100 KB at 1,024
agents, 20 ms to pickle and unpickle, plus a stack walk per step for its event log), and
the steps of all the agents pass one after another through it, each retried by every agent
that lost the race: in bench/scale.py 64 agents took 7 to 12 s to form the round after one
was replaced, 128 took 35 s, and 256 formed none within two minutes (issue 53).

The `kubetrain` backend (PET_RDZV_BACKEND in the pods the operator makes and in `kubetrain
run`; torchrun finds it through the `torchrun.handlers` entry point) keeps torchrun's
rendezvous (the c10d backend's store on worker 0, min and max nodes, the last call, the
join timeout, newcomers waiting, closing) with keys that each agent touches a fixed number
of times per round, none of them holding more than one agent's part but the members' list:

- an agent joining round R appends its descriptor (its address, pid and a number within
  its process, as torch's) to `nodes.R`, then counts itself in `joined.R` (an atomic add);
- the agent that counts the max-th, or once min have joined the first whose last call
  passes (`last_call_timeout`, 30 s by default), writes the round's members once
  (compare-and-set): the first of `nodes.R`, sorted as torch sorts them, so that worker
  0's agent, which hosts the store, is rank 0 whenever it is in;
- every other agent waits for `members.R` on the store, which wakes it (no polling), and
  finds its rank there; one that is not there (it came late) is counted in round R + 1,
  which the members see as `num_nodes_waiting`, and waits for one of them to restart and
  open it: a newcomer never runs a last call of its own, which would close rounds alone
  while the members stop their workers (each side then too late for the other's), and
  the members keep their seats before newcomers take those left. One that came when
  round R was full waits for R + 1 to open, uncounted;
- a replacement pod's agent has its predecessor's descriptor (the pod's hostname, PID 1 of
  its container): finding itself among the members of the last round, it opens the next
  one at once, and the others restart into it without waiting for anything to expire.

A running agent asks `num_nodes_waiting` every monitor interval: one add of 0 to the next
round's counter, at most every `poll_seconds(max_nodes)` (0.1 s up to 100 nodes, a
thousandth of a second per node above that, a second from 1,000 nodes on: at most about
1,000 small reads a second).

What it gives up: agents on the plain c10d backend cannot join its rounds (the state is
not c10d's), and an agent that dies after joining a round that has not formed yet stays
counted in it (torch's heartbeats would drop it after 15 s): the group's start then fails
on it and restarts without it. Round keys stay in the store for the job's life (a few
bytes per agent and round).
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from kubetrain.protocol import RENDEZVOUS_BACKEND as BACKEND  # torchrun's --rdzv-backend

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous import (
        RendezvousHandler,
        RendezvousInfo,
        RendezvousParameters,
    )

log = logging.getLogger(__name__)

JOIN_TIMEOUT_SECONDS = 600  # torch's defaults
LAST_CALL_SECONDS = 30
# How long one wait on the store lasts where nothing else bounds it: a redundant agent
# waits for the next round in waits this long.
IDLE_WAIT_SECONDS = 600.0
CLOSED = "closed"  # the members' list of a round closed before it formed

_local_ids = itertools.count()  # torch's number of a handler within its process


def handler() -> Callable[[RendezvousParameters], RendezvousHandler]:
    """The entry point torchrun loads (group `torchrun.handlers`): the handler's creator."""
    return create_handler


def register_rendezvous() -> None:
    """Register the backend with torchrun's registry in this process, where the entry point
    was not found (own code's image may hold kubetrain as files, not as a distribution)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    # Registering the creator the entry point registered already is no error.
    rendezvous_handler_registry.register(BACKEND, create_handler)


def poll_seconds(max_nodes: int) -> float:
    """Seconds a running agent's `num_nodes_waiting` is answered from memory, for a group of
    up to `max_nodes`."""
    return min(1.0, max(0.1, max_nodes / 1000))


def create_handler(params: RendezvousParameters) -> RendezvousHandler:
    """The handler torchrun's agent uses, on the store the c10d backend would use (hosted
    by the agent whose host is the endpoint's: worker 0's)."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend

    global _latest
    _, store = create_backend(params)
    _latest = _handler_class()(
        store, params.run_id, params.min_nodes, params.max_nodes,
        params.local_addr or socket.getfqdn(),
        join_seconds=params.get_as_int("join_timeout", JOIN_TIMEOUT_SECONDS) or 0,
        last_call_seconds=params.get_as_int("last_call_timeout", LAST_CALL_SECONDS) or 0)
    return _latest


_latest: Any = None  # this process's newest handler: the one its agent (torchrun) runs on


def arrive_at_exit_barrier() -> None:
    """Count this process's agent in torchrun's exit barrier for its round, as the agent
    counts itself once its workers have succeeded; nothing where there is nothing to count
    (no kubetrain rendezvous here, no round yet), a warning where the store is gone.

    For an agent about to be stopped because its pod's processes have all finished and one
    hangs in its teardown (kubetrain.trainer.own_code): stopped, the agent never reaches the
    barrier, and the agents whose processes exited wait there for it, for torch's 300 s,
    holding their pods; worker 0's too, which hosts the store and so waits for every other.
    """
    if _latest is not None:
        _latest.arrive_at_exit_barrier()


def _handler_class() -> type[Any]:
    """`Rendezvous`, defined on first use: its base class is torch's, and this module stays
    torch-free to import (own code's entry imports it, then loads torch beside its restore)."""
    global _RENDEZVOUS
    if _RENDEZVOUS is None:
        _RENDEZVOUS = _define()
    return _RENDEZVOUS


_RENDEZVOUS: type[Any] | None = None


def _define() -> type[Any]:
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import (
        RendezvousClosedError,
        RendezvousConnectionError,
        RendezvousError,
        RendezvousHandler,
        RendezvousInfo,
        RendezvousStoreInfo,
        RendezvousTimeoutError,
    )

    def reached(call: Callable[..., Any]) -> Callable[..., Any]:
        """A store that cannot be reached (its host, worker 0's agent, is gone) is a
        RendezvousConnectionError, as torch's c10d backend makes it."""

        @functools.wraps(call)
        def calling(*args: Any, **kwargs: Any) -> Any:
            try:
                return call(*args, **kwargs)
            except (ValueError, RuntimeError, TimeoutError) as error:
                raise RendezvousConnectionError(
                    f"the rendezvous store cannot be reached: {error}") from error

        return calling

    class Rendezvous(RendezvousHandler):
        """torchrun's rendezvous handler for one agent: see the module docstring."""

        def __init__(self, store: Any, run_id: str, min_nodes: int, max_nodes: int,
                     address: str, *, join_seconds: float = JOIN_TIMEOUT_SECONDS,
                     last_call_seconds: float = LAST_CALL_SECONDS) -> None:
            self.store = store
            self.run_id = run_id
            self.min_nodes, self.max_nodes = min_nodes, max_nodes
            self.address = address
            # As torch's descriptor: sorted by address, then pid, then this number.
            self.descriptor = f"{address} {os.getpid()} {next(_local_ids)}"
            self.join_seconds = join_seconds
            self.last_call_seconds = last_call_seconds
            self.poll = poll_seconds(max_nodes)
            self.round: int | None = None  # the last round this agent was a member of
            self._waiting: tuple[float, int] = (-1.0, 0)  # (asked at, answer)
            self._bootstrap: RendezvousStoreInfo | None = None
            self._shared_store: Any = None
            self.store.compare_set(self._key("round"), "", "0")

        def _key(self, name: str, round_: int | None = None) -> str:
            return f"kubetrain.rendezvous.{self.run_id}/{name}" + (
                "" if round_ is None else f".{round_}")

        # --- torchrun's calls -------------------------------------------------------

        def get_backend(self) -> str:
            return BACKEND

        @property
        def use_agent_store(self) -> bool:
            return os.getenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "0") != "1"

        def get_run_id(self) -> str:
            return self.run_id

        @reached
        def next_rendezvous(self) -> RendezvousInfo:
            """Join the next round (see the module docstring) and wait until it forms."""
            deadline = time.monotonic() + self.join_seconds
            round_ = self.round + 1 if self.round is not None else self._latest_round()
            opens = True  # whether this agent may open the round and run its last call
            while True:
                self._refuse_if_closed()
                members = self._members(round_)
                joined = members is None
                if members is None:
                    members = self._join(round_, deadline, opens=opens)
                    self._refuse_if_closed()
                if joined and self.descriptor in members:
                    break
                # Not a member: a replacement whose predecessor was one opens the next
                # round; one that came when the round was full waits until a member
                # restarts and opens it; one that came late joins it, seen as waiting, but
                # leaves opening it to a member.
                replacement = self.descriptor in members
                if not replacement and len(members) >= self.max_nodes:
                    self._wait_for(self._key("opened", round_ + 1), None)
                opens = replacement
                round_ += 1
            self.round = round_
            rank, world = members.index(self.descriptor), len(members)
            log.info("rendezvous %s: round %d formed, rank %d of %d", self.run_id, round_,
                     rank, world)
            return self._info(round_, rank, world)

        @reached
        def num_nodes_waiting(self) -> int:
            """Agents that joined the round after this agent's: asked from the store at most
            every `poll` seconds."""
            if self.round is None:
                return 0
            asked_at, answer = self._waiting
            now = time.monotonic()
            if now - asked_at >= self.poll:
                answer = int(self.store.add(self._key("joined", self.round + 1), 0))
                self._waiting = (now, answer)
            return answer

        @reached
        def is_closed(self) -> bool:
            return bool(self.store.check([self._key("closed")]))

        @reached
        def set_closed(self) -> None:
            """Close the rendezvous for every agent, waking any that waits for a round."""
            self.store.set(self._key("closed"), "1")
            latest = self._latest_round()
            self.store.compare_set(self._key("members", latest), "", CLOSED)
            self.store.set(self._key("opened", latest + 1), "1")

        def arrive_at_exit_barrier(self) -> None:
            """See the module's function of this name."""
            # torch's own barrier, on the round's store the agent was given (_info): its
            # keys are private to torch, and a change of them fails the test that ends a
            # pod whose peer waits there (tests/storage/test_own_code_entry.py).
            from torch.distributed.elastic.agent.server.api import _TERMINAL_STATE_SYNC_ID
            from torch.distributed.elastic.utils.store import _barrier_nonblocking

            if self.round is None:
                return
            try:
                members = self._members(self.round) or []
                _barrier_nonblocking(self._round_store(self.round), len(members),
                                     _TERMINAL_STATE_SYNC_ID)
            except (ValueError, RuntimeError, TimeoutError) as error:
                log.warning("rendezvous %s: not counted in torchrun's exit barrier: %s",
                            self.run_id, error)

        def shutdown(self) -> bool:
            """Close the rendezvous as this agent ends; False where the store is gone (its
            host ended first), as torch's handler answers."""
            try:
                self.set_closed()
            except RendezvousError as error:
                log.warning("rendezvous %s not closed: %s", self.run_id, error)
                return False
            return True

        # --- a round ----------------------------------------------------------------

        def _latest_round(self) -> int:
            return int(self.store.get(self._key("round")))

        def _refuse_if_closed(self) -> None:
            if self.is_closed():
                raise RendezvousClosedError

        def _members(self, round_: int) -> list[str] | None:
            """The round's members once it formed (sorted: rank order); None before."""
            key = self._key("members", round_)
            if not self.store.check([key]):
                return None
            text = self.store.get(key).decode()
            return [] if text == CLOSED else text.split("\n")

        def _join(self, round_: int, deadline: float, *, opens: bool) -> list[str]:
            """Join the round and wait until it forms; its members. An agent that may not
            open the round (it came late to the last one) is counted in it, so that the
            last round's members restart, and waits until one of them opens it."""
            self.store.append(self._key("nodes", round_), self.descriptor + "\n")
            count = int(self.store.add(self._key("joined", round_), 1))
            if opens:
                self.store.set(self._key("opened", round_), "1")
                self.store.compare_set(self._key("round"), str(round_ - 1), str(round_))
            else:
                if not self._wait_for(self._key("opened", round_), deadline):
                    raise RendezvousTimeoutError
                self._refuse_if_closed()
                count = int(self.store.add(self._key("joined", round_), 0))
            if count >= self.max_nodes:
                return self._form(round_, self.max_nodes)
            key = self._key("members", round_)
            if count >= self.min_nodes and self.min_nodes < self.max_nodes:
                # The last call: once it passes, whoever joined forms the round.
                last_call = time.monotonic() + self.last_call_seconds
                if not self._wait_for(key, min(last_call, deadline)):
                    if time.monotonic() >= deadline:
                        raise RendezvousTimeoutError
                    count = int(self.store.add(self._key("joined", round_), 0))
                    return self._form(round_, min(count, self.max_nodes))
            elif not self._wait_for(key, deadline):
                raise RendezvousTimeoutError
            members = self._members(round_)
            assert members is not None
            return members

        def _form(self, round_: int, count: int) -> list[str]:
            """Write the round's members unless another agent wrote them first; the members
            written. They are the first `count` to join, the last round's members first
            (a replacement counts as its predecessor): a running group keeps its seats and
            newcomers take those left."""
            joined = [d for d in self.store.get(self._key("nodes", round_)).decode()
                      .split("\n") if d]
            last = set(self._members(round_ - 1) or []) if round_ > 0 else set()
            seated = sorted(joined, key=lambda descriptor: descriptor not in last)[:count]
            members = sorted(seated, key=_sort_key)
            written = self.store.compare_set(self._key("members", round_), "",
                                             "\n".join(members)).decode()
            return [] if written == CLOSED else written.split("\n")

        def _wait_for(self, key: str, until: float | None) -> bool:
            """Wait until `key` exists in the store (it wakes the waiter), at most until
            `until` (monotonic; None: for as long as it takes, unless closed)."""
            while True:
                left = IDLE_WAIT_SECONDS if until is None else until - time.monotonic()
                if left <= 0:
                    return False
                try:
                    self.store.wait([key], timedelta(seconds=min(left, IDLE_WAIT_SECONDS)))
                    return True
                except dist.DistStoreError:  # timed out
                    if until is None:
                        self._refuse_if_closed()

        def _info(self, round_: int, rank: int, world: int) -> RendezvousInfo:
            """What torchrun's agent gets for the round: as torch's dynamic rendezvous gives
            it, a store of the round's own (a prefix of the rendezvous store) and the
            address its workers meet at."""
            store = self._round_store(round_)
            if not self.use_agent_store:
                return RendezvousInfo(store, rank, world, RendezvousStoreInfo.build(
                    rank, store, local_addr=self.address))
            if self._bootstrap is None or (rank == 0 and self._shared_store is None):
                port = 0
                if rank == 0:
                    self._shared_store = dist.TCPStore(host_name=self.address, port=0,
                                                       is_master=True, multi_tenant=True)
                    port = self._shared_store.port
                self._bootstrap = RendezvousStoreInfo.build(
                    rank, store, local_addr=self.address, server_port=port)
            return RendezvousInfo(store, rank, world, self._bootstrap)

        def _round_store(self, round_: int) -> Any:
            """The round's own store, as torch's dynamic rendezvous makes it."""
            return dist.PrefixStore(f"torch.rendezvous.{self.run_id}.{round_}", self.store)

    return Rendezvous


def _sort_key(descriptor: str) -> tuple[str, int, int]:
    """torch's order of node descriptors: address, then pid, then the handler's number."""
    address, pid, local_id = descriptor.split(" ")
    return address, int(pid), int(local_id)
