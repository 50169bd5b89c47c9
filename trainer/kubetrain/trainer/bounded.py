"""Calls that may never return, run on a daemon thread of their own and waited for only as
long as the caller chooses: joining a group, forming a mesh's groups or a quorum's process
group, connecting to a store. Their own timeouts (minutes, and more) are longer than any
caller can wait, and none of them can be ended early, so the thread is left behind when the
caller stops waiting and the process ends without waiting for it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar, cast

T = TypeVar("T")


@dataclass(frozen=True)
class Bounded(Generic[T]):
    """How a call ended when its caller stopped waiting: `finished` with its result or its
    `error`, or not finished by then (its daemon thread left behind, still running)."""

    finished: bool
    result: T | None = None
    error: BaseException | None = None

    def value(self, late: str) -> T:
        """The call's result; its own error raised again, or TimeoutError(`late`) when it
        had not finished."""
        if not self.finished:
            raise TimeoutError(late)
        if self.error is not None:
            raise self.error
        return cast(T, self.result)


class Running(Generic[T]):
    """`call()` started on a daemon thread called `name`; `ended` is set once it returns or
    raises, and `outcome()` says how it has ended so far."""

    def __init__(self, call: Callable[[], T], *, name: str) -> None:
        self.ended = threading.Event()
        self._outcome: Bounded[T] = Bounded(False)
        self._call = call
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def _run(self) -> None:
        try:
            self._outcome = Bounded(True, result=self._call())
        except BaseException as error:  # raised again in the caller's thread, if it asks
            self._outcome = Bounded(True, error=error)
        finally:
            self.ended.set()

    def outcome(self) -> Bounded[T]:
        return self._outcome


def run_bounded(call: Callable[[], T], seconds: float, *, name: str) -> Bounded[T]:
    """`call()` on a daemon thread called `name`, waited for at most `seconds`."""
    running = Running(call, name=name)
    running.ended.wait(max(0.0, seconds))
    return running.outcome()
