"""Following each running worker pod's lifeline: restarts in place become visible.

torchrun restarts a failed trainer in place, inside the same pod and container: the API
shows nothing. Each worker pod serves a lifeline (`kubetrain.protocol`,
`kubetrain.trainer.lifeline`): its agent beats, and says how each of its trainer processes
ends. This follows it with one idle TCP connection per running pod, on the operator's event
loop; each line says what happened:

- `rank N end` with exit 0, 75 or 143: the trainer finished, or stopped in order (a signal,
  a new membership): nothing to report;
- `rank N end` with a class that ends the pod (out of memory, a GPU error, a failed
  preflight), or `PeerLost` (a rank that failed only because another vanished under a
  collective): the pod's own status, or the other rank's line, reports it;
- any other `rank N end` (a collective timeout, an unclassified error), or `rank N gone`
  (kill -9, a crash, the kernel's OOM killer: the kernel closes the process's connection
  to its agent at once): a failure torchrun restarts in place, reported as a `TrainerEnd`
  after `settle_seconds`, so that the pod's own status arrives first when the container
  ended too.

The connection closes when the agent ends: after its `bye`, nothing to report (the pod's
status says how); without one (the container killed whole) as a process gone without a
word. A pod of a trainer image from before issue 53 serves one lifeline per trainer
process instead (its first line is no `pod`): then each process's port is followed as
well, and a connection's close is that process's end, with the `end` line it sent last, if
any.

A connection that stays open with no line for `silence_seconds`, to an address that then
does not answer a new connection within `probe_seconds` either, while still no line comes
(a node or its network lost: no reset comes, no handshake), makes the pod *silent*
(`silent`) until a line comes again; the reconcile replaces a silent pod as one of a lost
node (`kubetrain.operator.nodes`), long before the node is marked NotReady. A stopped or
stuck agent whose node still completes the handshake is not silent: that is a hang, for the
progress deadline. Each probe it answers doubles the silence before the next one (up to
`MAX_SILENCE_SECONDS`): a probe waits in the stopped process's accept queue until it is
accepted, and a full queue (16) answers nothing, as a lost node. Beats come from a thread
of their own, so a long step does not stop them; the threshold is a few missed beats, not
a step time.

What it costs (issue 53, bench/scale.py): each connection is an asyncio protocol that notes
when it last heard a line, and one timer a connection looks at that once per silence; no
task, future or timer is made per line, so 1,024 pods of 8 trainer processes cost the
operator 1,024 connections and about 2,000 beats a second, read as they come.

It keeps the ends it saw for a while (`ends`) and asks for a reconcile of the job
(`on_news`), at once when a pod goes silent; reconcile
(`kubetrain.operator.recovery.record_restarts_in_place`) decides whether an end is news,
and records it. It keeps no status and decides nothing itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable, Iterable
from datetime import UTC, datetime, timedelta
from typing import cast

from kubetrain.operator.facts import IN_PLACE, TrainerEnd, WorkerPod
from kubetrain.protocol import (
    BEAT,
    BYE,
    ENDS_THE_POD,
    EXIT_COMPLETE,
    EXIT_RESTART,
    EXIT_SIGNALLED,
    FAILURE_CLASSES,
    PEER_LOST,
    POD_LIFELINE,
    FailureClass,
    parse_end_line,
    parse_rank_line,
)

log = logging.getLogger(__name__)

JobKey = tuple[str, str]  # (namespace, name)
ORDERLY_EXITS = frozenset({EXIT_COMPLETE, EXIT_RESTART, EXIT_SIGNALLED})
# Beats come every LIFELINE_BEAT_SECONDS from a thread of their own: this long without one
# (three missed), the pod's address is probed.
SILENCE_SECONDS = 1.5
# A new connection to the same address, given this long (a lost node completes none; a
# live one in well under a millisecond on a cluster network, and its kernel answers even
# for a stopped process): unanswered, with still no beat, the node or its network is lost.
PROBE_SECONDS = 1.0
# The longest silence between two probes of a stopped or stuck process (see the module).
MAX_SILENCE_SECONDS = 60.0
NO_WORD = ("the trainer process ended without a word (kill -9, a crash or the kernel's OOM "
           "killer)")


def trainer_end(pod: str, last_line: bytes | None, now: datetime) -> TrainerEnd | None:
    """What a trainer process that ended after `last_line` (None: no `end` line) reports: a
    failure torchrun restarts in place, or None when there is nothing to report."""
    said = parse_end_line(last_line) if last_line is not None else None
    if said is None:
        return TrainerEnd(pod=pod, time=now, failure_class="Unknown",
                          message=f"{NO_WORD}; {IN_PLACE}")
    exit_code, said_class, words = said
    if exit_code in ORDERLY_EXITS or said_class in ENDS_THE_POD or said_class == PEER_LOST:
        return None
    failure_class = cast(FailureClass, said_class if said_class in FAILURE_CLASSES
                         else "Unknown")
    return TrainerEnd(pod=pod, time=now, failure_class=failure_class, exit_code=exit_code,
                      message=f"the trainer exited {exit_code}"
                              f"{': ' + words if words else ''}; {IN_PLACE}")


class _Connection(asyncio.Protocol):
    """One followed connection: hands its lines (beats aside) to its follower, and notes
    when it last heard one."""

    def __init__(self, follower: _Follower) -> None:
        self.follower = follower
        self.loop = follower.loop
        self.heard = self.loop.time()
        self.closed: asyncio.Future[None] = self.loop.create_future()
        self._rest = b""
        self._first = True  # until the first line, which says which wire this is

    def data_received(self, data: bytes) -> None:
        self.heard = self.loop.time()
        if self.follower.quiet:
            self.follower.heard_again()
        data = self._rest + data
        if not self._first and not data.replace(BEAT, b""):
            self._rest = b""  # beats only: the common case
            return
        *lines, self._rest = data.split(b"\n")
        for line in lines:
            if self._first:
                self._first = False
                self.follower.first_line(line + b"\n")
            if line + b"\n" != BEAT:
                self.follower.said(line + b"\n")

    @property
    def silent(self) -> bool:
        """No line yet (not even the first, which a serving agent sends at once)."""
        return self._first

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)


class _Follower:
    """Follows one lifeline (a pod's, or one trainer process's in an image from before
    issue 53), connecting again whenever it closes, until cancelled."""

    def __init__(self, lifelines: LifelineWatch, key: JobKey, pod: str, host: str, port: int,
                 processes: int, legacy_rank: int | None = None) -> None:
        self.lifelines, self.key, self.pod = lifelines, key, pod
        self.host, self.port, self.processes = host, port, processes
        self.legacy_rank = legacy_rank  # a per-process lifeline of an older image's
        self.loop = asyncio.get_running_loop()
        self.quiet = False  # probed or silent since the last line
        self.siblings: list[_Follower] = []  # the other processes' lifelines (older images)
        self._silence = lifelines.silence_seconds
        self._timer: asyncio.TimerHandle | None = None
        self._probe: asyncio.Task[None] | None = None
        self._connection: _Connection | None = None
        self._pod_wire: bool | None = None  # known from the first line
        self._last_end: bytes | None = None
        self._bye = False
        self.task = asyncio.ensure_future(self._run())

    def cancel(self) -> list[asyncio.Task[None]]:
        """Stop following (the siblings too); the tasks to wait for."""
        tasks = [self.task]
        self.task.cancel()
        for sibling in self.siblings:
            tasks += sibling.cancel()
        self.lifelines._beating(self.key, self.pod, self.port)
        return tasks

    async def _run(self) -> None:
        while True:
            try:
                transport, connection = await self.loop.create_connection(
                    lambda: _Connection(self), self.host, self.port)
            except OSError:
                # Not started yet, or between processes (an older image's).
                await asyncio.sleep(self.lifelines.retry_seconds)
                continue
            said_bye = self._bye
            self._connection, self._last_end, self._bye = connection, None, False
            # Its first line settles a silence an earlier connection left (heard_again).
            self._silence, self.quiet = self.lifelines.silence_seconds, True
            self._watch(connection.heard + self._silence)
            try:
                await connection.closed
            finally:
                transport.close()
                self._connection = None
                self._stop_watching()
            if connection.silent:
                # Closed before a line: after a bye, the agent that said it was still
                # exiting (its listener open a moment longer), not a new one killed.
                self._bye = said_bye
            if not self._bye:  # the agent (or an older image's process) ended
                self._report(self._last_end)
            await asyncio.sleep(self.lifelines.retry_seconds)

    def first_line(self, line: bytes) -> None:
        """A connection's first line: a pod's lifeline says POD_LIFELINE; an older image's
        process beats at once, and its pod's other processes have lifelines of their own."""
        if self._pod_wire is not None:
            return  # known from an earlier connection
        self._pod_wire = line == POD_LIFELINE
        if not self._pod_wire and self.legacy_rank is None and self.processes > 1:
            self.siblings = [_Follower(self.lifelines, self.key, self.pod, self.host,
                                       self.port + rank, 1, legacy_rank=rank)
                             for rank in range(1, self.processes)]

    def said(self, line: bytes) -> None:
        """A line other than a beat."""
        if line == POD_LIFELINE:
            return
        if line == BYE:
            self._bye = True
        elif (ended := parse_rank_line(line)) is not None:
            self._report(ended[1])
        elif line.startswith(b"end"):
            self._last_end = line  # an older image's process: reported when it closes

    def _report(self, last_line: bytes | None) -> None:
        end = trainer_end(self.pod, last_line, datetime.now(UTC).replace(microsecond=0))
        if end is None:
            return
        log.info("%s/%s: %s: %s", self.key[0], self.pod, end.failure_class, end.message)
        with self.lifelines._lock:
            self.lifelines._ends.setdefault(self.key, []).append(end)
        self.loop.call_later(self.lifelines.settle_seconds, self.lifelines.on_news, self.key)

    # --- silence -----------------------------------------------------------------------

    def _watch(self, at: float) -> None:
        self._timer = self.loop.call_at(at, self._look)

    def _stop_watching(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._probe is not None:
            self._probe.cancel()
        self._timer = self._probe = None

    def _look(self) -> None:
        """The silence may be over: probe the address if nothing came meanwhile."""
        connection = self._connection
        if connection is None:
            return
        due = connection.heard + self._silence
        if self.loop.time() < due:
            self._watch(due)
            return
        self.quiet = True
        self._timer = None
        self._probe = asyncio.ensure_future(self._probe_address())

    async def _probe_address(self) -> None:
        answers = await self.lifelines._answers(self.host, self.port)
        lifelines, key = self.lifelines, self.key
        if answers:
            # Its node answers: the agent is stopped or stuck, not lost (the progress
            # deadline is for a hung group).
            self._silence = min(2 * self._silence, MAX_SILENCE_SECONDS)
            if lifelines._beating(key, self.pod, self.port):
                lifelines.on_news(key)
        elif lifelines._beating(key, self.pod, self.port, beating=False):
            log.warning("%s/%s: no beat from its lifeline for %gs, and its node does not "
                        "answer", key[0], self.pod, self._silence)
            lifelines.on_news(key)
        self._probe = None
        self._watch(self.loop.time() + self._silence)

    def heard_again(self) -> None:
        """A line came after a silence: a probe still out is settled by it."""
        self.quiet = False
        if self._probe is not None:
            self._probe.cancel()
            self._probe = None
            self._watch(self.loop.time() + self.lifelines.silence_seconds)
        self._silence = self.lifelines.silence_seconds
        if self.lifelines._beating(self.key, self.pod, self.port):
            self.lifelines.on_news(self.key)  # it beats again (a process resumed)


class LifelineWatch:
    """One follower per running pod with an IP; see the module docstring.

    `follow`, `forget` and `ends` are safe to call from any thread; the followers run on
    the loop given to `start`.
    """

    def __init__(self, on_news: Callable[[JobKey], None], *, settle_seconds: float = 1.0,
                 keep_seconds: float = 300.0, retry_seconds: float = 0.5,
                 silence_seconds: float = SILENCE_SECONDS,
                 probe_seconds: float = PROBE_SECONDS) -> None:
        self.on_news = on_news
        self.settle_seconds = settle_seconds
        self.silence_seconds = silence_seconds
        self.probe_seconds = probe_seconds
        self.keep = timedelta(seconds=keep_seconds)
        self.retry_seconds = retry_seconds
        self._loop: asyncio.AbstractEventLoop | None = None
        self._followers: dict[tuple[JobKey, str], tuple[tuple[str, int, int], _Follower]] = {}
        self._ends: dict[JobKey, list[TrainerEnd]] = {}
        self._silent: dict[JobKey, set[tuple[str, int]]] = {}  # (pod, port) without beats
        self._lock = threading.Lock()

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def follow(self, key: JobKey, pods: Iterable[WorkerPod], port: int,
               processes: int = 1) -> None:
        """Follow the lifeline (on `port`) of each of the job's running pods, and stop
        following the others. `processes`: each pod's trainer processes, whose own ports
        follow `port` in images from before issue 53."""
        # A pod's replacement (the same name, a new restart attempt) is a new target.
        targets = {pod.name: (pod.ip, pod.restart_attempt, port) for pod in pods
                   if pod.phase == "Running" and pod.ip and not pod.deleting}
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._sync, key, targets, processes)

    def forget(self, key: JobKey) -> None:
        """Stop following the job's pods and drop what was seen (the job is gone)."""
        with self._lock:
            self._ends.pop(key, None)
            self._silent.pop(key, None)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._sync, key, {}, 1)

    def silent(self, key: JobKey) -> frozenset[str]:
        """The job's pods whose lifeline has stopped beating."""
        with self._lock:
            return frozenset(pod for pod, _ in self._silent.get(key, ()))

    def ends(self, key: JobKey, now: datetime | None = None) -> tuple[TrainerEnd, ...]:
        """The job's trainer ends seen in the last keep_seconds, oldest first."""
        since = (now or datetime.now(UTC)) - self.keep
        with self._lock:
            kept = [end for end in self._ends.get(key, []) if end.time >= since]
            if kept:
                self._ends[key] = kept
            else:
                self._ends.pop(key, None)
            return tuple(kept)

    async def close(self) -> None:
        tasks = [task for _, follower in self._followers.values() for task in follower.cancel()]
        self._followers.clear()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _sync(self, key: JobKey, targets: dict[str, tuple[str, int, int]],
              processes: int) -> None:
        for (job, pod), (target, follower) in list(self._followers.items()):
            if job == key and targets.get(pod) != target:
                follower.cancel()
                del self._followers[(job, pod)]
        for pod, target in targets.items():
            if (key, pod) not in self._followers:
                follower = _Follower(self, key, pod, target[0], target[2], processes)
                self._followers[(key, pod)] = (target, follower)

    async def _answers(self, host: str, port: int) -> bool:
        """Whether the pod's address answers a new connection (the kernel completes it even
        for a stopped process, or refuses it): a lost node or network answers nothing."""
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(host, port),
                                               self.probe_seconds)
        except ConnectionRefusedError:
            return True
        except (OSError, TimeoutError):
            return False
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        return True

    def _beating(self, key: JobKey, pod: str, port: int, beating: bool = True) -> bool:
        """Mark the lifeline beating or silent; whether that changed anything."""
        with self._lock:
            silent = self._silent.setdefault(key, set())
            was = (pod, port) in silent
            if beating:
                silent.discard((pod, port))
            else:
                silent.add((pod, port))
            if not silent:
                del self._silent[key]
            return was == beating
