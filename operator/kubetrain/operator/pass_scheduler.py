"""When a TrainingJob's reconcile passes run: one at a time per job, triggers folded, wake-ups.

Triggers ask for a pass of a job from any thread: the job's and its pods' events, a
trainer's end on its lifeline, the operator-wide resync, a restart's backoff ending.
`PassScheduler.run` runs at most one pass of a job at a time, and a trigger that arrives
meanwhile does not wait for it (and hold a worker thread): it is folded into one more pass
right after it, which reads the job afresh. A wake-up (`wake_in`) is a trigger the event
loop fires at a set time, for the pass that creates a restart's replacements once its
backoff ends (a `ReconcileAt`), since no API event comes then.

Between passes this process remembers each job (`JobMemory`: what it wrote that the watches
may not show yet, and whether a pass runs), by `expectations.job_identity`. What a pass
does is the controller's (`kubetrain.operator.handlers`); this room holds no API client.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from kubetrain.operator.expectations import Expectations

JobKey = tuple[str, str]  # (namespace, name)


@dataclass
class JobMemory:
    """What this process keeps about one job between passes.

    What it did that the watches may not show yet (`expected`); whether a pass of the job
    is running (`running`), and whether triggers arrived meanwhile (`again`, `scrape`).
    """

    lock: threading.Lock = field(default_factory=threading.Lock)
    running: bool = False
    again: bool = False
    scrape: bool = False
    expected: Expectations = field(default_factory=Expectations)


class PassScheduler:
    """The passes of every job of one operator process: their memory, their serialisation and
    their wake-ups."""

    def __init__(self) -> None:
        self._memory: dict[str, JobMemory] = {}  # by expectations.job_identity
        self._lock = threading.Lock()
        self._wakes: dict[JobKey, asyncio.TimerHandle] = {}  # touched on the event loop only

    # --- memory ------------------------------------------------------------------------

    def memory(self, identity: str) -> JobMemory:
        """The job's memory, made empty the first time it is asked for."""
        with self._lock:
            return self._memory.setdefault(identity, JobMemory())

    def known(self, identity: str) -> JobMemory | None:
        """The job's memory if this process has one (an echo can only be of a known job)."""
        return self._memory.get(identity)

    def forget(self, identity: str) -> None:
        """Drop a deleted job's memory."""
        with self._lock:
            self._memory.pop(identity, None)

    def forget_all(self) -> None:
        """Drop every job's memory: another leader may have acted since it was written."""
        with self._lock:
            self._memory.clear()

    # --- one pass at a time ------------------------------------------------------------

    def run(self, memory: JobMemory, scrape: bool, one_pass: Callable[[bool], None]) -> None:
        """Run `one_pass(scrape)` for the job now, and again while triggers came meanwhile;
        or, when a pass of the job is running in another thread, leave it to run one more
        (asking for a scrape if this trigger did). Safe from any thread."""
        with memory.lock:
            memory.scrape |= scrape
            if memory.running:
                memory.again = True
                return
            memory.running = True
        while True:
            with memory.lock:
                scrape, memory.scrape, memory.again = memory.scrape, False, False
            try:
                one_pass(scrape)
            except BaseException:
                with memory.lock:  # the next trigger or resync tries again
                    memory.running = False
                raise
            with memory.lock:
                if not memory.again:
                    memory.running = False
                    return

    # --- wake-ups, on the event loop ----------------------------------------------------

    def wake_in(self, key: JobKey, delay: float, trigger: Callable[[JobKey], None]) -> None:
        """On the event loop: `trigger(key)` in `delay` seconds, replacing an earlier wake-up
        of the job."""
        self.cancel_wake(key)
        self._wakes[key] = asyncio.get_running_loop().call_later(delay, self._woken, key,
                                                                 trigger)

    def _woken(self, key: JobKey, trigger: Callable[[JobKey], None]) -> None:
        del self._wakes[key]
        trigger(key)

    def cancel_wake(self, key: JobKey) -> None:
        """On the event loop: the job's wake-up, if any, is not wanted any more."""
        if wake := self._wakes.pop(key, None):
            wake.cancel()

    def cancel_wakes(self) -> None:
        """On the event loop: no wake-up fires any more (the operator stops)."""
        for wake in self._wakes.values():
            wake.cancel()
        self._wakes.clear()
