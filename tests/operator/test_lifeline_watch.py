"""Restarts in place made visible (issue 33 item 2), with one lifeline a pod (issue 53): each
pod's lifeline (kubetrain.trainer.lifeline: its agent's `PodLifeline`, its trainer processes'
`Lifeline`s, in real processes) followed by the operator's lifelines
(kubetrain.operator.lifeline_watch), alone and inside the real operator on the emulator.

A pod's agent is stood in for by a process that serves the real `PodLifeline`, as
kubetrain.trainer.launch does while torchrun runs; a trainer process by one that holds the
real `Lifeline` to it and ends as the trainer does: killed with SIGKILL (no word), or with
the `end` line `fit` writes. A trainer image from before issue 53 (one lifeline per process,
no `pod` line) is stood in for by its wire, written here.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).parent))
import harness
from harness import EmulatedCluster, Kube, eventually, job_manifest, running_operator

from kubetrain.local.launch import free_port
from kubetrain.operator.facts import WorkerPod
from kubetrain.operator.lifeline_watch import LifelineWatch, trainer_end
from kubetrain.protocol import AGENT_PID_ENV, end_line

# A pod's agent: serves the pod's lifeline on the port and host given until its stdin
# closes, then ends in order (bye), as the launcher does once torchrun returns.
AGENT = """
import os, sys
from kubetrain.protocol import lifeline_socket
from kubetrain.trainer.lifeline import PodLifeline
lifeline = PodLifeline(int(sys.argv[1]), lifeline_socket(os.getpid()), host=sys.argv[2])
assert lifeline.start()
print("serving", flush=True)
sys.stdin.read()
lifeline.close()
"""

# One of the pod's trainer processes: tells its agent it runs, says "started", then ends as
# told on stdin ("end CODE CLASS WORDS"), or is killed.
TRAINER = """
import sys
from kubetrain.trainer.lifeline import Lifeline
lifeline = Lifeline.for_this_process()
assert lifeline is not None and lifeline.start()
print("started", flush=True)
_, code, failure_class, *words = sys.stdin.readline().split()
lifeline.end(int(code), failure_class, " ".join(words))
"""


def pod_agent(port: int, host: str = "127.0.0.1") -> subprocess.Popen[str]:
    """A pod's agent serving its lifeline, in a process of its own."""
    process = subprocess.Popen([sys.executable, "-c", AGENT, str(port), host],
                               env={**os.environ, "KUBETRAIN_POD_NAME": "job-worker-1"},
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    assert process.stdout.readline().strip() == "serving", "the agent serves no lifeline"
    return process


def trainer_of(agent: subprocess.Popen[str], local_rank: int = 0) -> subprocess.Popen[str]:
    """A trainer process of the agent's pod, once it holds its line to the agent."""
    process = subprocess.Popen(
        [sys.executable, "-c", TRAINER],
        env={**os.environ, "KUBETRAIN_POD_NAME": "job-worker-1",
             AGENT_PID_ENV: str(agent.pid), "LOCAL_RANK": str(local_rank)},
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    assert process.stdout.readline().strip() == "started", "the trainer reached no agent"
    return process


@contextlib.contextmanager
def agent_serving(port: int, host: str = "127.0.0.1") -> Iterator[subprocess.Popen[str]]:
    process = pod_agent(port, host)
    try:
        yield process
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGCONT)
        process.kill()
        process.wait(10)


def ends_as(process: subprocess.Popen[str], line: str) -> None:
    assert process.stdin is not None
    process.stdin.write(line + "\n")
    process.stdin.close()
    process.wait(10)


KEY = ("default", "job")
POD = WorkerPod(name="job-worker-1", index=1, restart_attempt=0, phase="Running",
                ip="127.0.0.1")


@contextlib.asynccontextmanager
async def following(news: list[tuple[str, str]], port: int, processes: int = 1,
                    **thresholds: float) -> AsyncIterator[LifelineWatch]:
    """The operator's lifelines, started and following POD's lifeline at `port`."""
    lifelines = LifelineWatch(news.append, **thresholds)
    lifelines.start(asyncio.get_running_loop())
    lifelines.follow(KEY, [POD], port, processes)
    try:
        yield lifelines
    finally:
        await lifelines.close()


@contextlib.asynccontextmanager
async def agent_process(port: int) -> AsyncIterator[subprocess.Popen[str]]:
    """`pod_agent`, from a coroutine; killed at the end, even while stopped."""
    loop = asyncio.get_running_loop()
    process = await loop.run_in_executor(None, pod_agent, port)
    try:
        yield process
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGCONT)
        process.kill()
        await loop.run_in_executor(None, process.wait)


async def until_ends(lifelines: LifelineWatch, count: int, timeout: float = 10) -> float:
    """Seconds until the job's lifelines saw `count` ends."""
    started = time.monotonic()
    while len(lifelines.ends(KEY)) < count:
        assert time.monotonic() - started < timeout, lifelines.ends(KEY)
        await asyncio.sleep(0.01)
    return time.monotonic() - started


def followers_of(port: int) -> int:
    """The established connections to the listener on `port` (the operator's side)."""
    listed = subprocess.run(["ss", "-Htn", "state", "established", f"( dport = :{port} )"],
                            capture_output=True, text=True, check=True).stdout.splitlines()
    return sum(1 for line in listed if line.strip())


NOW = datetime(2026, 1, 1, tzinfo=UTC)


@pytest.mark.parametrize(("line", "expected"), [
    (None, ("Unknown", None)),  # no word: killed, crashed, OOM-killed
    (end_line(88, "CollectiveTimeout", "gloo timed out"), ("CollectiveTimeout", 88)),
    (end_line(1, "Unknown", "RuntimeError: boom"), ("Unknown", 1)),
    (end_line(1, "SomethingNew"), ("Unknown", 1)),  # a class this operator does not know
    (end_line(0, "max_steps"), None),  # finished
    (end_line(143, "signalled"), None),  # stopped in order
    (end_line(75, "signalled"), None),  # another rank was signalled: the new membership
    (end_line(1, "PeerLost", "Connection closed by peer"), None),  # another rank's failure
    (end_line(87, "CUDAOutOfMemory"), None),  # ends the pod: the pod's status says it
    (end_line(89, "PreflightFailed"), None),
])
def test_how_a_lifeline_ends_says_whether_torchrun_restarts_a_failure_in_place(
        line: bytes | None, expected: tuple[str, int | None] | None) -> None:
    end = trainer_end("job-worker-1", line, NOW)
    assert (None if end is None else (end.failure_class, end.exit_code)) == expected


def test_the_lifelines_see_a_killed_trainer_at_once_and_its_successors_last_words() -> None:
    port, key = free_port(), KEY

    async def scenario() -> None:
        news: list[tuple[str, str]] = []
        loop = asyncio.get_running_loop()
        with agent_serving(port) as agent:
            async with following(news, port, settle_seconds=0.1,
                                 retry_seconds=0.1) as lifelines:
                killed = await loop.run_in_executor(None, trainer_of, agent)
                os.kill(killed.pid, signal.SIGKILL)
                seen = await until_ends(lifelines, 1)
                killed.wait(10)
                print(f"a killed trainer's end seen {seen * 1000:.0f} ms after SIGKILL")
                [end] = lifelines.ends(key)
                assert (end.pod, end.failure_class, end.exit_code) == (
                    "job-worker-1", "Unknown", None)
                # The pod's next trainer processes, over the same connection: an orderly end
                # is no news, nor a rank that failed only because a peer vanished; a
                # timeout is.
                for line in ("end 0 max_steps", "end 1 PeerLost Connection closed by peer",
                             "end 88 CollectiveTimeout gloo timed out after 30s"):
                    process = await loop.run_in_executor(None, trainer_of, agent)
                    await loop.run_in_executor(None, ends_as, process, line)
                await until_ends(lifelines, 2)
                await asyncio.sleep(0.3)  # nothing more comes
                assert [(e.failure_class, e.exit_code) for e in lifelines.ends(key)] == [
                    ("Unknown", None), ("CollectiveTimeout", 88)]
                assert "gloo timed out after 30s" in lifelines.ends(key)[1].message
                assert news == [key, key]  # a reconcile asked for each

    asyncio.run(scenario())


def test_one_connection_follows_every_trainer_process_of_a_pod() -> None:
    # Issue 53: 8 trainer processes a pod are one connection from the operator, not 8.
    port, key = free_port(), KEY

    async def scenario() -> None:
        news: list[tuple[str, str]] = []
        loop = asyncio.get_running_loop()
        with agent_serving(port) as agent:
            async with following(news, port, processes=8, settle_seconds=0.1,
                                 retry_seconds=0.1) as lifelines:
                trainers = [await loop.run_in_executor(None, trainer_of, agent, rank)
                            for rank in range(8)]
                await asyncio.sleep(0.5)
                assert followers_of(port) == 1, "one connection for the pod's 8 processes"
                for rank in (1, 4, 6):
                    os.kill(trainers[rank].pid, signal.SIGKILL)
                # Words that end as a beat does are still words.
                await loop.run_in_executor(None, ends_as, trainers[2],
                                           "end 88 CollectiveTimeout its peer missed a heartbeat")
                for rank in (0, 3, 5, 7):
                    await loop.run_in_executor(None, ends_as, trainers[rank],
                                               "end 75 PeerLost a peer is gone")
                await until_ends(lifelines, 4)
                await asyncio.sleep(0.3)  # nothing more comes
                assert sorted(e.failure_class for e in lifelines.ends(key)) == [
                    "CollectiveTimeout", "Unknown", "Unknown", "Unknown"]
                assert followers_of(port) == 1, "the same connection throughout"
                for trainer in trainers:
                    trainer.wait(10)

    asyncio.run(scenario())


def test_beats_are_read_without_a_task_per_line() -> None:
    # Issue 53: 1,024 pods beat 2,000 times a second. A task (or a wait with its timer) made
    # for each line is what kept the operator's loop from keeping up with 8,192 lifelines.
    port = free_port()
    listener = socket.create_server(("127.0.0.1", port))

    def beat_fast() -> None:  # a pod's lifeline, 200 beats in a second
        follower, _ = listener.accept()
        follower.sendall(b"pod\n")
        for _ in range(200):
            follower.sendall(b"beat\n")
            time.sleep(0.005)
        follower.sendall(b"bye\n")
        follower.close()

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        made: list[object] = []
        default = loop.get_task_factory()

        def counting(loop: asyncio.AbstractEventLoop, coro: object,
                     **kwargs: object) -> asyncio.Task[object]:
            made.append(coro)
            if default is not None:
                return default(loop, coro, **kwargs)  # type: ignore[arg-type]
            return asyncio.Task(coro, loop=loop, **kwargs)  # type: ignore[arg-type]

        news: list[tuple[str, str]] = []
        async with following(news, port, retry_seconds=5.0) as lifelines:
            beating = loop.run_in_executor(None, beat_fast)
            await asyncio.sleep(0.2)  # connected
            loop.set_task_factory(counting)
            await beating
            await asyncio.sleep(0.1)
            loop.set_task_factory(default)
            assert lifelines.silent(KEY) == frozenset() and lifelines.ends(KEY) == ()
        print(f"tasks made while 200 beats were read: {len(made)}")
        assert len(made) <= 2, made  # beside the beats: its reconnection after the bye

    try:
        asyncio.run(scenario())
    finally:
        listener.close()


def test_an_agent_that_ends_in_order_says_so_and_a_killed_one_is_a_failure() -> None:
    # The agent's bye: torchrun returned, the pod's status says how. Without it the container
    # was killed whole, as a trainer killed without a word.
    port, key = free_port(), KEY

    async def scenario() -> None:
        news: list[tuple[str, str]] = []
        async with following(news, port, settle_seconds=0.1, retry_seconds=0.1) as lifelines:
            async with agent_process(port) as agent:
                await asyncio.sleep(0.5)
                assert followers_of(port) == 1
                assert agent.stdin is not None
                agent.stdin.close()  # the launcher's torchrun returned
                await asyncio.get_running_loop().run_in_executor(None, agent.wait)
            await asyncio.sleep(0.5)
            assert lifelines.ends(key) == () and news == []
            async with agent_process(port) as agent:
                await asyncio.sleep(0.5)
                os.kill(agent.pid, signal.SIGKILL)
                await until_ends(lifelines, 1)
            await asyncio.sleep(0.3)  # the reconcile is asked for after settle_seconds
            [end] = lifelines.ends(key)
            assert end.failure_class == "Unknown" and news == [key]

    asyncio.run(scenario())


class OlderImageProcess:
    """A trainer process of an image from before issue 53: a lifeline of its own on `port`
    that beats to its one follower from the start (no `pod` line), until it says its last
    line or dies."""

    def __init__(self, port: int) -> None:
        self.listener = socket.create_server(("127.0.0.1", port))
        self.follower: socket.socket | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        self.follower, _ = self.listener.accept()
        with contextlib.suppress(OSError):
            while not self._stop.is_set():
                self.follower.sendall(b"beat\n")
                self._stop.wait(0.5)

    def followed(self, timeout: float = 10) -> None:
        deadline = time.monotonic() + timeout
        while self.follower is None:
            assert time.monotonic() < deadline, "nobody followed the older lifeline"
            time.sleep(0.01)

    def end(self, line: bytes | None) -> None:
        """Its last line (None: it dies without one), then the connection closes."""
        self._stop.set()
        self._thread.join(5)
        assert self.follower is not None
        if line is not None:
            self.follower.sendall(line)
        self.follower.close()
        self.listener.close()


def test_a_pod_of_an_older_image_is_followed_one_process_at_a_time() -> None:
    # An operator upgraded while jobs run: their pods' trainers still serve one lifeline per
    # process, on the ports after the pod's, and say nothing first.
    port, key = free_port(), KEY
    while True:  # two free ports in a row
        try:
            socket.create_server(("127.0.0.1", port + 1)).close()
            break
        except OSError:
            port = free_port()

    async def scenario() -> None:
        news: list[tuple[str, str]] = []
        loop = asyncio.get_running_loop()
        rank_0, rank_1 = OlderImageProcess(port), OlderImageProcess(port + 1)
        async with following(news, port, processes=2, settle_seconds=0.1,
                             retry_seconds=0.1) as lifelines:
            await loop.run_in_executor(None, rank_0.followed)
            await loop.run_in_executor(None, rank_1.followed)  # followed as well
            rank_1.end(None)  # killed
            await until_ends(lifelines, 1)
            rank_0.end(end_line(88, "CollectiveTimeout", "gloo timed out"))
            await until_ends(lifelines, 2)
            await asyncio.sleep(0.3)  # the reconcile is asked for after settle_seconds
            assert [(e.failure_class, e.exit_code) for e in lifelines.ends(key)] == [
                ("Unknown", None), ("CollectiveTimeout", 88)]
            assert news == [key, key]

    asyncio.run(scenario())


def accept_queue(port: int) -> tuple[int, int]:
    """The listening socket on `port`, as the kernel counts it: the connections waiting to
    be accepted, and its backlog (ss shows them as a listener's Recv-Q and Send-Q)."""
    [line] = subprocess.run(["ss", "-Hltn", f"sport = :{port}"], capture_output=True,
                            text=True, check=True).stdout.splitlines()
    _, waiting, backlog, *_ = line.split()
    return int(waiting), int(backlog)


def sockets_of(port: int) -> str:
    """The TCP sockets to or from `port`, counted by state: what a failure report needs."""
    listed = subprocess.run(["ss", "-Htan", f"( sport = :{port} or dport = :{port} )"],
                            capture_output=True, text=True).stdout.splitlines()
    states = collections.Counter(line.split()[0] for line in listed if line.strip())
    return ", ".join(f"{count} {state}" for state, count in sorted(states.items()))


@contextlib.contextmanager
def answering_nothing(port: int) -> Iterator[None]:
    """Connections to a stopped process's listening socket until its accept queue is full
    as the kernel judges it (more waiting than the backlog): the kernel then drops new
    handshakes, and the address answers nothing, as a lost node's does. Read from the
    kernel, so a scenario never starts from a queue with room left (a probe would then be
    answered, as a stopped process's is), however late a loaded machine completes the
    handshakes."""
    queued: list[socket.socket] = []
    deadline = time.monotonic() + 10
    try:
        while (queue := accept_queue(port))[0] <= queue[1]:
            assert time.monotonic() < deadline, (
                f"port {port}'s accept queue {queue} not full after {len(queued)} connections")
            for _ in range(8):
                client = socket.socket()
                client.setblocking(False)
                client.connect_ex(("127.0.0.1", port))
                queued.append(client)
            time.sleep(0.01)
        yield
    finally:
        for client in queued:
            client.close()


async def until_silent(lifelines: LifelineWatch, since: float, port: int) -> float:
    """Seconds from `since` (time.monotonic) until the job has a silent pod."""
    while not lifelines.silent(KEY):
        assert time.monotonic() - since < 10, (
            f"never taken for silent; the accept queue {accept_queue(port)}, the port's "
            f"sockets: {sockets_of(port)}")
        await asyncio.sleep(0.01)
    return time.monotonic() - since


def test_a_pod_whose_node_stops_answering_is_silent_and_a_stopped_agent_is_not() -> None:
    port, key = free_port(), KEY

    async def scenario() -> None:
        news: list[tuple[str, str]] = []
        async with (following(news, port, retry_seconds=0.1, silence_seconds=1.0,
                              probe_seconds=0.5) as lifelines,
                    agent_process(port) as process):
            await asyncio.sleep(1.5)  # beating: not silent
            assert lifelines.silent(key) == frozenset() and news == []
            # Its agent stopped (SIGSTOP), as a hung process: its node still completes
            # handshakes.
            os.kill(process.pid, signal.SIGSTOP)
            await asyncio.sleep(3.5)
            assert lifelines.silent(key) == frozenset() and news == [], "a hang is not a loss"
            # Now its address answers nothing either: as a node that lost power or network.
            with answering_nothing(port):
                stopped = time.monotonic()
                noticed = await until_silent(lifelines, stopped, port)
                print(f"silent {noticed:.2f}s after its address stopped answering "
                      "(threshold 1s, probe 0.5s)")
                assert lifelines.silent(key) == {"job-worker-1"} and news == [key]
                os.kill(process.pid, signal.SIGCONT)
                while lifelines.silent(key):
                    assert time.monotonic() - stopped < 20, "never beat again"
                    await asyncio.sleep(0.01)
            assert news == [key, key] and lifelines.ends(key) == ()
            # Its replacement (a new restart attempt of the pod) starts with a clean slate.
            lifelines.follow(key, [WorkerPod(name="job-worker-1", index=1, restart_attempt=1,
                                             phase="Pending")], port)
            await asyncio.sleep(0.1)
            assert lifelines.silent(key) == frozenset()

    asyncio.run(scenario())


def test_a_silent_pod_whose_lifeline_comes_back_on_a_new_connection_beats_again() -> None:
    port, key = free_port(), KEY

    async def scenario() -> None:
        news: list[tuple[str, str]] = []
        async with following(news, port, retry_seconds=0.1, silence_seconds=0.5,
                             probe_seconds=0.5, settle_seconds=0.1) as lifelines:
            async with agent_process(port) as lost:
                await asyncio.sleep(0.5)
                os.kill(lost.pid, signal.SIGSTOP)
                with answering_nothing(port):
                    await until_silent(lifelines, time.monotonic(), port)
                    os.kill(lost.pid, signal.SIGKILL)  # its connection closes
            assert lifelines.silent(key) == {"job-worker-1"}
            async with agent_process(port):  # the pod's agent again, a new connection
                came = time.monotonic()
                while lifelines.silent(key):
                    assert time.monotonic() - came < 10, "still silent on a new connection"
                    await asyncio.sleep(0.01)

    asyncio.run(scenario())


def _never_silent(lifelines: LifelineWatch, key: tuple[str, str], seconds: float) -> bool:
    """Whether the job's pods stay out of `silent` for `seconds` (looked at every 10 ms)."""
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        if lifelines.silent(key):
            return False
        time.sleep(0.01)
    return True


def _beats_then_one_late(listener: socket.socket, late: float) -> None:
    """A lifeline whose new connections go unanswered (the accept queue full): beats to
    its one follower every 0.1 s for 0.5 s, then one more after `late` seconds, then
    ends in order."""
    follower, _ = listener.accept()
    with answering_nothing(listener.getsockname()[1]):
        try:
            for _ in range(5):
                follower.sendall(b"beat\n")
                time.sleep(0.1)
            time.sleep(late)
            follower.sendall(b"beat\n")
            time.sleep(0.3)
            follower.sendall(end_line(0, "max_steps"))
        finally:
            follower.close()


def test_a_beat_that_comes_while_the_probe_is_out_keeps_the_pod_and_a_lost_one_is_quick(
        ) -> None:
    port, key = free_port(), KEY

    async def scenario() -> None:
        news: list[tuple[str, str]] = []
        loop = asyncio.get_running_loop()
        # Silent 0.5 s after the last beat, then a probe that nothing answers, given 1.5 s:
        # the late beat comes 1 s after the last, while it is out.
        listener = socket.create_server(("127.0.0.1", port), backlog=0)
        try:
            async with following(news, port, retry_seconds=0.1, silence_seconds=0.5,
                                 probe_seconds=1.5) as lifelines:
                node = loop.run_in_executor(None, _beats_then_one_late, listener, 1.0)
                kept = await loop.run_in_executor(None, _never_silent, lifelines, key, 3.0)
                await node
                assert kept and news == [], "a beat came before the probe gave up: not lost"
        finally:
            listener.close()

        # With the operator's own thresholds, a lost node (no beat, no handshake) is silent
        # within 1.5 s of silence and 1 s of probe.
        async with following(news, port, retry_seconds=0.1) as lifelines, \
                agent_process(port) as process:
            await asyncio.sleep(0.6)
            os.kill(process.pid, signal.SIGSTOP)
            with answering_nothing(port):
                noticed = await until_silent(lifelines, time.monotonic(), port)
            print(f"silent {noticed:.2f}s after its node stopped answering")
            assert noticed < 2.8, noticed  # it was 3 s of silence and 1 s of probe

    asyncio.run(scenario())


def test_a_stopped_agent_probed_again_and_again_is_never_taken_for_a_lost_node() -> None:
    # Each probe waits in the stopped process's accept queue (16) until it is accepted: probed
    # at every silence, the queue would fill in under 2 s here and answer nothing.
    port, key = free_port(), KEY

    async def scenario() -> None:
        news: list[tuple[str, str]] = []
        loop = asyncio.get_running_loop()
        async with (following(news, port, retry_seconds=0.1, silence_seconds=0.1,
                              probe_seconds=0.5) as lifelines,
                    agent_process(port) as process):
            os.kill(process.pid, signal.SIGSTOP)
            kept = await loop.run_in_executor(None, _never_silent, lifelines, key, 3.0)
            assert kept and news == [], "a hang is not a loss, however long"
            os.kill(process.pid, signal.SIGCONT)
            await asyncio.sleep(0.6)
            assert lifelines.silent(key) == frozenset() and lifelines.ends(key) == ()

    asyncio.run(scenario())


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmulatedCluster]:
    with EmulatedCluster(tmp_path_factory.mktemp("cluster")) as running:
        yield running


@pytest.fixture(scope="module")
def operator(cluster: EmulatedCluster) -> Iterator[harness.OperatorConfig]:
    # The resync (and its scrape) far away: only the lifeline can make the failure visible.
    with running_operator(cluster, resync_seconds=60) as config:
        yield config


def test_a_trainer_killed_and_restarted_in_place_shows_in_status_event_and_metric(
        cluster: EmulatedCluster, operator: harness.OperatorConfig) -> None:
    kube = Kube(cluster)
    metrics_port = free_port()
    manifest = job_manifest("inplace")
    manifest["spec"]["metrics"] = {"port": metrics_port}
    kube.create_job(manifest)
    eventually(lambda: len(kube.pods("inplace")) == 2, what="both worker pods")
    # Each pod its own loopback address; worker 1's trainer serves its lifeline there.
    kube.set_pod_status("inplace-worker-0", "Running", pod_ip="127.0.0.3")
    kube.set_pod_status("inplace-worker-1", "Running", pod_ip="127.0.0.2")
    eventually(lambda: kube.phase("inplace") == "Running", what="the job running")
    with agent_serving(metrics_port + 1, host="127.0.0.2") as agent:
        killed = trainer_of(agent)
        time.sleep(0.5)  # followed: the operator's connection is the pod's once it runs
        killed_at = time.monotonic()
        os.kill(killed.pid, signal.SIGKILL)
        killed.wait(10)
        status = eventually(lambda: ((kube.job("inplace") or {}).get("status") or {}) if (
            (kube.job("inplace") or {}).get("status") or {}).get("restarts") else None,
            timeout=10, what="status.restarts counting the restart in place")
        shown = time.monotonic() - killed_at
        print(f"status.restarts and status.lastFailure {shown:.2f}s after SIGKILL")
    failure = status["lastFailure"]
    assert failure["class"] == "Unknown" and failure["pod"] == "inplace-worker-1", failure
    assert "torchrun restarts the group in place" in failure["message"]
    assert status["failures"] == {"Unknown": 1}
    # Counted as `kubetrain run` counts it, in the same status write: no pod replaced.
    assert status["phase"] == "Running" and status["restarts"] == 1
    assert status.get("restartAttempt", 0) == 0
    # Issue 33: within 2 s of the kill (1 s of it is the lifelines' settle_seconds, which
    # lets a pod's own status come first); a loaded machine gets 1 s more.
    assert shown < 3.0, shown
    assert {"WorkerFailure", "RestartedInPlace"} <= eventually(
        lambda: set(kube.event_reasons("inplace")) >= {"WorkerFailure", "RestartedInPlace"}
        and set(kube.event_reasons("inplace")), what="the failure's and the restart's events")
    with urllib.request.urlopen(f"http://127.0.0.1:{operator.metrics_port}/metrics") as reply:
        families = {f.name: f for f in text_string_to_metric_families(reply.read().decode())}
    failures = {s.labels["class"]: s.value for s in families["kubetrain_worker_failures"].samples
                if s.name == "kubetrain_worker_failures_total"}
    assert failures.get("Unknown", 0) >= 1, failures
    restarts = {s.labels["reason"]: s.value
                for s in families["kubetrain_operator_group_restarts"].samples
                if s.name == "kubetrain_operator_group_restarts_total"}
    assert restarts.get("RestartedInPlace", 0) >= 1, restarts
    # The pods stay: torchrun restarted the trainer inside them.
    assert sorted(kube.pods("inplace")) == ["inplace-worker-0", "inplace-worker-1"]
    kube.delete_job("inplace")


def test_a_follower_that_connects_as_the_agent_ends_hears_bye_not_a_killed_pod() -> None:
    """A follower the kernel connected just before the agent ended, accepted or not yet by
    its serving thread, hears `bye` last: never a line closed without a word, which the
    operator takes for a killed pod (seen under load, when the agent ends right after the
    operator connects)."""
    from kubetrain.protocol import BYE, lifeline_socket
    from kubetrain.trainer.lifeline import PodLifeline

    for attempt in range(20):
        lifeline = PodLifeline(0, lifeline_socket(os.getpid()) + f"-{attempt}",
                               host="127.0.0.1")
        assert lifeline.start()
        follower = socket.create_connection(("127.0.0.1", lifeline.port), timeout=10)
        if attempt % 2:
            time.sleep(0.05)  # every other time, after the serving thread accepted it
        lifeline.close()
        heard = b""
        while chunk := follower.recv(4096):
            heard += chunk
        follower.close()
        assert heard.endswith(BYE), (attempt, heard)


def test_after_a_bye_a_connection_that_closes_before_a_line_is_the_same_agent_exiting() -> None:
    """After the agent's bye the operator connects again at once; an agent still exiting
    accepts that connection and closes it without a line. That is the end already said in
    order, not a killed pod; a connection closed without a line where no bye came before
    still is one."""

    async def ends_after(first: bytes) -> list[str]:
        port = free_port()
        listener = socket.create_server(("127.0.0.1", port))

        def serve() -> None:
            follower, _ = listener.accept()
            follower.sendall(first)
            follower.close()
            follower, _ = listener.accept()  # the operator's next connection: closed silent
            follower.close()

        news: list[tuple[str, str]] = []
        try:
            async with following(news, port, settle_seconds=0.1,
                                 retry_seconds=0.1) as lifelines:
                await asyncio.get_running_loop().run_in_executor(None, serve)
                await asyncio.sleep(0.5)
                return [end.failure_class for end in lifelines.ends(KEY)]
        finally:
            listener.close()

    assert asyncio.run(ends_after(b"pod\nbeat\nbye\n")) == []
    assert asyncio.run(ends_after(b"pod\nbeat\n")) == ["Unknown", "Unknown"]
