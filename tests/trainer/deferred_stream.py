"""A stand-in for the CUDA side stream that checkpoint staging copies on (staging.py's
`CopyStream`), for tests on the CPU, which has no streams.

What it does as a stream does: copies enqueued run later than the call that enqueued them,
in order, and no sooner than the training thread must have them: when it holds for them
(`hold`, the loop's wait before the optimizer step) or waits for them on the host itself
(`synchronize` on the training thread). Another thread's `synchronize` (a tier's
background thread before it commits) waits until then, as a host thread waiting on a CUDA
event waits for the device to get there. So a test sees the latest moment a copy could
run on a GPU, and a wait that is missing or misplaced shows as a snapshot holding a later
step's state, or as a commit that never comes.

What it does not: run anything beside the training thread (it shows order, not overlap's
speed), model the device-side first phase's memory, or register host memory. `events` is
the order of what happened, for tests of that order.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Marker:
    """The end of one enqueued copy."""

    number: int
    done: threading.Event = field(default_factory=threading.Event)


class DeferredStream:
    """See the module docstring. Made on the training thread, which alone runs copies."""

    def __init__(self, events: list[str] | None = None) -> None:
        self.owner = threading.get_ident()
        self.events = events if events is not None else []
        self._queue: list[tuple[Marker, Callable[[], None]]] = []
        self._count = 0
        self._lock = threading.Lock()

    def enqueue(self, copies: Callable[[], None]) -> Marker:
        with self._lock:
            self._count += 1
            marker = Marker(self._count)
            self._queue.append((marker, copies))
        self.events.append("copy enqueued")
        return marker

    def hold(self, marker: Marker) -> None:
        self.events.append("hold")
        self._run_through(marker)

    def synchronize(self, marker: Marker) -> None:
        if threading.get_ident() == self.owner:
            self._run_through(marker)
        else:
            marker.done.wait()

    @property
    def pending(self) -> int:
        """Copies enqueued and not yet run."""
        with self._lock:
            return len(self._queue)

    def _run_through(self, marker: Marker) -> None:
        assert threading.get_ident() == self.owner, "only the training thread runs copies"
        while not marker.done.is_set():
            with self._lock:
                first, copies = self._queue.pop(0)
            copies()
            self.events.append("copy ran")
            first.done.set()
