"""The quorum rules of the lighthouse the operator runs (`pod_conventions.lighthouse_command`).

torchft's real lighthouse, asked by torchft's own client as each group's Manager asks it:
no trainer runs, so each rule is shown in a few seconds and at the moment it matters. Last,
what the trainer reads from it to end an all-reduce with a group lost without a word, and
the forming of a quorum that names a group lost as it formed: its store's host, or another
member.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed import TCPStore
from torch.distributed.distributed_c10d import AllreduceOptions
from torchft._torchft import LighthouseClient

from kubetrain.api.trainingjob import TrainingJob
from kubetrain.local.replica_groups import lighthouse
from kubetrain.trainer.fault_tolerance import forming_watched
from kubetrain.trainer.silent_peers import SilentPeers, SilentReplicaGroups, silent_members

HEARTBEAT_MS = 300
COLLECTIVE_MS = 4000
PATIENCE = timedelta(seconds=30)


def _job(minimal_manifest: dict[str, Any]) -> TrainingJob:
    spec = minimal_manifest["spec"]
    spec["workers"] = {"replicas": 3}
    spec["faultTolerance"] = {"replicaGroups": 3,
                              "heartbeatTimeoutMilliseconds": HEARTBEAT_MS,
                              "collectiveTimeoutMilliseconds": COLLECTIVE_MS}
    return TrainingJob.model_validate(minimal_manifest)


class Group:
    """A replica group's Manager as the lighthouse sees it: a heartbeat every 50 ms from its
    server, whatever its loop does, until the group dies; quorum requests from its loop."""

    def __init__(self, address: str, name: str) -> None:
        self.client = LighthouseClient(address, connect_timeout=timedelta(seconds=5))
        self.id = f"demo-group-{name}"
        self.client.heartbeat(self.id)
        self._dead = threading.Event()
        threading.Thread(target=self._beat, daemon=True).start()

    def _beat(self) -> None:
        while not self._dead.wait(0.05):
            self.client.heartbeat(self.id)

    def dies(self) -> None:
        self._dead.set()

    def ask(self, pool: ThreadPoolExecutor, step: int) -> Future[Any]:
        """Ask for a quorum at `step`; the answer arrives when the lighthouse forms a quorum
        with this group in it."""
        return pool.submit(self.client.quorum, replica_id=self.id, timeout=PATIENCE,
                           address=f"{self.id}-manager", store_address="", step=step,
                           world_size=1)


@contextlib.contextmanager
def groups(address: str, names: list[str]) -> Iterator[list[Group]]:
    started = [Group(address, name) for name in names]
    try:
        yield started
    finally:
        for group in started:
            group.dies()


def test_groups_back_from_a_majority_loss_wait_for_the_survivor_in_its_collective(
        minimal_manifest: dict[str, Any], tmp_path: Path) -> None:
    """A node holding groups 0 and 2 is lost during an all-reduce: group 1 heartbeats but
    cannot ask for a quorum until its collective times out. The two replacements, back
    sooner, must not form a quorum of their own at the checkpoint's step (two of three
    heartbeating groups may): they wait for group 1 and get a quorum with it, whose step is
    the newest, so they heal from it and group 1 keeps what it trained."""
    with lighthouse(_job(minimal_manifest), tmp_path / "lighthouse.log") as address, \
            ThreadPoolExecutor(8) as pool, \
            groups(address, ["0:before", "1", "2:before"]) as old:
        first = [group.ask(pool, step=278) for group in old]
        assert {len(answer.result(timeout=10).participants) for answer in first} == {3}

        # The node goes silent; group 1 sits in the all-reduce with its groups.
        old[0].dies()
        old[2].dies()
        time.sleep(2 * HEARTBEAT_MS / 1000)  # 0 and 2 are dead to the lighthouse now
        with groups(address, ["0:after", "2:after"]) as replacements:
            back = [group.ask(pool, step=0) for group in replacements]
            asked = time.monotonic()

            # Longer than the heartbeat timeout (the join timeout it had): still no quorum.
            time.sleep(5 * HEARTBEAT_MS / 1000)
            assert not any(answer.done() for answer in back), \
                "the groups that came back formed a quorum without the live group 1"

            # Group 1's collective times out (before COLLECTIVE_MS here): it asks.
            quorums = [answer.result(timeout=10)
                       for answer in [*back, old[1].ask(pool, step=278)]]
            assert time.monotonic() - asked < COLLECTIVE_MS / 1000
    for quorum in quorums:
        steps = {member.replica_id: member.step for member in quorum.participants}
        assert steps == {old[1].id: 278, replacements[0].id: 0, replacements[1].id: 0}, \
            "one quorum of the three, the survivor's step the newest: the others heal from it"


def test_a_stalled_group_that_heartbeats_holds_the_others_no_longer_than_a_collective(
        minimal_manifest: dict[str, Any], tmp_path: Path) -> None:
    """The wait's bound: a group that heartbeats and never asks (a hung trainer) is left out
    of the quorum after collectiveTimeoutMilliseconds, and the others step on."""
    with lighthouse(_job(minimal_manifest), tmp_path / "lighthouse.log") as address, \
            ThreadPoolExecutor(8) as pool, \
            groups(address, ["0", "1", "2"]) as three:
        assert all(len(answer.result(timeout=10).participants) == 3
                   for answer in [group.ask(pool, step=5) for group in three])
        asked = time.monotonic()
        others = [group.ask(pool, step=6) for group in three[:2]]  # group 2 hangs
        quorums = [answer.result(timeout=COLLECTIVE_MS / 1000 + 10) for answer in others]
        waited = time.monotonic() - asked
    assert {member.replica_id for quorum in quorums for member in quorum.participants} == \
        {three[0].id, three[1].id}
    assert COLLECTIVE_MS / 1000 - 0.5 < waited < COLLECTIVE_MS / 1000 + 2, waited


class _Collective:
    """A step's all-reduce as the trainer holds it (`wait()`), that ends when told to."""

    def __init__(self) -> None:
        self.ended = threading.Event()

    def wait(self) -> bool:
        return self.ended.wait()


def test_a_silent_member_of_the_quorum_is_named_from_the_lighthouse_within_its_heartbeat(
        minimal_manifest: dict[str, Any], tmp_path: Path) -> None:
    """What the trainer reads to end an all-reduce with a group lost without a word
    (silent_peers.py): torchft's real status page names the quorum's members that stopped
    heartbeating, once the heartbeat timeout has passed, and no other."""
    timeout = HEARTBEAT_MS / 1000
    with lighthouse(_job(minimal_manifest), tmp_path / "lighthouse.log") as address, \
            ThreadPoolExecutor(8) as pool, \
            groups(address, ["0", "1", "2"]) as three:
        assert all(len(answer.result(timeout=10).participants) == 3
                   for answer in [group.ask(pool, step=5) for group in three])
        watch = SilentPeers(address, timeout)

        def page() -> str:
            with urllib.request.urlopen(f"{address}/status", timeout=5) as answer:
                return answer.read().decode()

        assert silent_members(page(), timeout) == []
        # A healthy all-reduce that takes its time: the wait ends with it, naming no one.
        slow = _Collective()
        threading.Timer(3 * timeout, slow.ended.set).start()
        assert watch.wait([slow]) == []
        assert slow.ended.is_set()

        # Group 2's node is lost while the others wait in an all-reduce with it.
        stuck = _Collective()
        three[2].dies()
        lost = time.monotonic()
        assert watch.wait([stuck]) == [three[2].id]
        named = time.monotonic() - lost
        assert not stuck.ended.is_set()  # left to its own thread, not waited for
        assert silent_members(page(), timeout) == [three[2].id]
    # The lighthouse counts a group gone after the heartbeat timeout; the trainer hears of
    # it at its next look, a quarter of the timeout later at most (and a heartbeat's 50 ms).
    assert timeout < named < 1.25 * timeout + 0.5, named
    stuck.ended.set()
    # A page of another form (another torchft's) names no one: the collective's own timeout
    # still ends the wait, as without this.
    assert silent_members("<html>no quorum here</html>", timeout) == []


def test_a_quorum_whose_store_is_on_a_lost_node_fails_its_forming_at_once_not_at_the_timeout(
        ) -> None:
    """A quorum formed as a node is lost can name a group of that node as its store's host
    (fault_tolerance.forming_watched): the others' forming fails within the
    heartbeat-sized bound, not the collective timeout; a live store forms the group."""
    from torchft.process_group import ProcessGroupGloo

    # (A group of one forms at once: the lighthouse is never asked, and nothing listens there.)
    nobody = SilentPeers("http://127.0.0.1:9", HEARTBEAT_MS / 1000)
    forming = forming_watched(ProcessGroupGloo, 0.5, nobody)(timeout=timedelta(seconds=30))
    # A lost host answers nothing: a listener whose queue of connections is full drops the
    # next one's SYN, as a vanished node's network does (a closed port would reset at once).
    with socket.socket() as lost:
        lost.bind(("127.0.0.1", 0))
        lost.listen(0)
        port = lost.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port), timeout=5):  # fills the queue
            started = time.monotonic()
            with pytest.raises(RuntimeError, match=r"did not answer within 0.5s"):
                forming.configure(f"127.0.0.1:{port}/torchft/7/0", "group-1", 0, 1)
            assert time.monotonic() - started < 3  # not the 30 s timeout

    # A live store: the group forms, and averages.
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                     timeout=timedelta(seconds=10))
    forming.configure(f"127.0.0.1:{store.port}/torchft/8/0", "group-1", 0, 1)
    tensor = torch.full((3,), 2.0)
    forming.allreduce([tensor], AllreduceOptions()).wait()
    assert tensor.tolist() == [2.0, 2.0, 2.0]


def test_a_quorum_member_lost_as_it_formed_fails_the_forming_within_its_heartbeat(
        minimal_manifest: dict[str, Any], tmp_path: Path) -> None:
    """A quorum formed as a node is lost can name a group of that node that does not host the
    store: gloo's forming waits for every member to connect, and the lighthouse's word
    (SilentPeers.form) ends it once that group is silent for the heartbeat timeout, not at
    the collective timeout."""
    from torchft.process_group import ProcessGroupGloo

    timeout = HEARTBEAT_MS / 1000
    with lighthouse(_job(minimal_manifest), tmp_path / "lighthouse.log") as address, \
            ThreadPoolExecutor(4) as pool, \
            groups(address, ["0", "1"]) as two:
        assert all(len(answer.result(timeout=10).participants) == 2
                   for answer in [group.ask(pool, step=5) for group in two])
        forming = forming_watched(ProcessGroupGloo, 0.5, SilentPeers(address, timeout))(
            timeout=timedelta(seconds=30))
        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=30))
        two[1].dies()  # group 1 never connects: its node is gone
        lost = time.monotonic()
        with pytest.raises(SilentReplicaGroups, match=f"{two[1].id} .*the forming of this "
                                                      "quorum's process group"):
            forming.configure(f"127.0.0.1:{store.port}/torchft/9/0", two[0].id, 0, 2)
        failed = time.monotonic() - lost
    # The lighthouse counts group 1 gone after the heartbeat timeout, and the forming hears
    # of it at its next look, a quarter of the timeout later at most: not the 30 s timeout.
    assert timeout < failed < 1.25 * timeout + 1.0, failed
