"""Following each running worker pod's trainer lifeline: restarts in place become visible.

torchrun restarts a failed trainer in place, inside the same pod and container: the API
shows nothing. Each trainer process of a pod serves a lifeline (`kubetrain.protocol`,
`kubetrain.trainer.lifeline`), and this follows it with one idle TCP connection per process
of each running pod, on the operator's event loop. When a connection ends, how it ended
says what happened:

- an `end` line with exit 0, 75 or 143: the trainer finished, or stopped in order (a signal,
  a new membership): nothing to report;
- an `end` line with a class that ends the pod (out of memory, a GPU error, a failed
  preflight), or `PeerLost` (a rank that failed only because another vanished under a
  collective): the pod's own status, or the other rank's lifeline, reports it;
- any other `end` line (a collective timeout, an unclassified error), or none at all (kill -9,
  a crash, the kernel's OOM killer: the kernel closes the connection at once): a failure
  torchrun restarts in place, reported as a `TrainerEnd` after `settle_seconds`, so that
  the pod's own status arrives first when the container ended too.

A connection that stays open with no beat for `silence_seconds`, to an address that then
does not answer a new connection within `probe_seconds` either, while still no beat comes
(a node or its network lost: no reset comes, no handshake), makes the pod *silent*
(`silent`) until a beat comes again; the reconcile replaces a silent pod as one of a lost
node (`kubetrain.operator.nodes`), long before the node is marked NotReady. A stopped or
stuck process whose node still completes the handshake is not silent: that is a hang, for
the progress deadline. Each probe it answers doubles the silence before the next one (up
to `MAX_SILENCE_SECONDS`): a probe waits in the stopped process's accept queue until it is
accepted, and a full queue (16) answers nothing, as a lost node. Beats come from a thread
of their own, so a long step does not stop them; the threshold is a few missed beats, not
a step time.

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
from collections.abc import AsyncIterator, Callable, Iterable
from datetime import UTC, datetime, timedelta
from typing import Any, cast

from kubetrain.operator.facts import IN_PLACE, TrainerEnd, WorkerPod
from kubetrain.protocol import (
    ENDS_THE_POD,
    EXIT_COMPLETE,
    EXIT_RESTART,
    EXIT_SIGNALLED,
    FAILURE_CLASSES,
    PEER_LOST,
    FailureClass,
    parse_end_line,
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
    """What a lifeline that closed after `last_line` (None: no `end` line) reports: a
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


class LifelineWatch:
    """One follower task per trainer process of each running pod with an IP; see the
    module docstring.

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
        self._tasks: dict[tuple[JobKey, str, int], tuple[tuple[str, int], asyncio.Task[None]]] = {}
        self._ends: dict[JobKey, list[TrainerEnd]] = {}
        self._silent: dict[JobKey, set[tuple[str, int]]] = {}  # (pod, port) without beats
        self._lock = threading.Lock()

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def follow(self, key: JobKey, pods: Iterable[WorkerPod], ports: Iterable[int]) -> None:
        """Follow the lifelines (on `ports`, one per trainer process) of the job's running
        pods, and stop following the others."""
        ports = tuple(ports)
        # A pod's replacement (the same name, a new restart attempt) is a new target.
        targets = {(pod.name, port): (pod.ip, pod.restart_attempt) for pod in pods
                   for port in ports
                   if pod.phase == "Running" and pod.ip and not pod.deleting}
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._sync, key, targets)

    def forget(self, key: JobKey) -> None:
        """Stop following the job's pods and drop what was seen (the job is gone)."""
        with self._lock:
            self._ends.pop(key, None)
            self._silent.pop(key, None)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._sync, key, {})

    def silent(self, key: JobKey) -> frozenset[str]:
        """The job's pods with a trainer whose lifeline has stopped beating."""
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
        tasks = [task for _, task in self._tasks.values()]
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _sync(self, key: JobKey, targets: dict[tuple[str, int], tuple[str, int]]) -> None:
        for (job, pod, port), (target, task) in list(self._tasks.items()):
            if job == key and targets.get((pod, port)) != target:
                task.cancel()
                del self._tasks[(job, pod, port)]
                self._beating(key, pod, port)
        for (pod, port), target in targets.items():
            if (key, pod, port) not in self._tasks:
                task = asyncio.ensure_future(self._follow(key, pod, target[0], port))
                self._tasks[(key, pod, port)] = (target, task)

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

    async def _follow(self, key: JobKey, pod: str, host: str, port: int) -> None:
        """Connect, read until the connection ends, report, and connect again (the next
        trainer process of the pod), until cancelled."""
        while True:
            try:
                reader, writer = await asyncio.open_connection(host, port)
            except OSError:
                await asyncio.sleep(self.retry_seconds)  # not started yet, or between processes
                continue
            last: bytes | None = None
            try:
                async for line in self._lines(key, pod, host, port, reader):
                    if line.startswith(b"end"):
                        last = line
            except OSError:
                pass  # reset: the same as closed
            finally:
                writer.close()
                with contextlib.suppress(OSError):
                    await writer.wait_closed()
            end = trainer_end(pod, last, datetime.now(UTC).replace(microsecond=0))
            if end is not None:
                log.info("%s/%s: %s: %s", key[0], pod, end.failure_class, end.message)
                with self._lock:
                    self._ends.setdefault(key, []).append(end)
                asyncio.get_running_loop().call_later(self.settle_seconds, self.on_news, key)
            await asyncio.sleep(self.retry_seconds)

    async def _lines(self, key: JobKey, pod: str, host: str, port: int,
                     reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
        """The lines of one connection until it ends, marking the pod silent or beating on
        the way (see the module docstring)."""
        silence = self.silence_seconds
        line = asyncio.ensure_future(reader.readline())
        try:
            while True:
                done, _ = await asyncio.wait({line}, timeout=silence)
                if not done:
                    probe = asyncio.ensure_future(self._answers(host, port))
                    either: set[asyncio.Future[Any]] = {line, probe}
                    try:  # a beat that comes while the probe is out settles it
                        first, _ = await asyncio.wait(either,
                                                      return_when=asyncio.FIRST_COMPLETED)
                    finally:
                        probe.cancel()
                    if line not in first:
                        if probe.result():
                            # Its node answers: the process is stopped or stuck, not lost
                            # (the progress deadline is for a hung group).
                            silence = min(2 * silence, MAX_SILENCE_SECONDS)
                            if self._beating(key, pod, port):
                                self.on_news(key)
                        elif self._beating(key, pod, port, beating=False):
                            log.warning("%s/%s: no beat from its trainer for %gs, and its "
                                        "node does not answer", key[0], pod, silence)
                            self.on_news(key)
                        continue
                got = line.result()
                if not got:
                    return
                silence = self.silence_seconds
                if self._beating(key, pod, port):
                    self.on_news(key)  # it beats again (a process resumed)
                line = asyncio.ensure_future(reader.readline())
                yield got
        finally:
            line.cancel()
