"""A replica group lost without a word ends the live groups' all-reduce with it at once.

A group whose node is lost sends no FIN or reset: its peers, inside a step's cross-group
all-reduce with it, would wait for the process group's timeout
(faultTolerance.collectiveTimeoutMilliseconds, 10 s by default), all of it lost by every
healthy group. The lighthouse knows sooner: the lost group's heartbeats stop, and after
heartbeatTimeoutMilliseconds it counts the group as gone. `SilentPeers` asks it.

While a step's all-reduce has waited longer than a healthy one takes (half the heartbeat
timeout), it reads the lighthouse's status page every quarter of the heartbeat timeout. When
a member of the lighthouse's last quorum (the one the step runs in) has not heartbeated for
the heartbeat timeout, this rank stops waiting (gloo cannot abort a collective in flight: it
is left to end on a thread of its own), torchft's Manager is told the step failed, the step
does not commit (its batch is passed over and counted, as any failed step's), and the next
quorum is formed without the lost group. The live groups lose the heartbeat timeout and a
step, not the collective timeout.

The same watch bounds the forming of a quorum's process group (`SilentPeers.form`): gloo
connects to every member of the new quorum, and a quorum formed just as a node was lost can
name a group of that node (its request reached the lighthouse before its heartbeats
stopped). The forming fails as soon as the lighthouse counts that group silent, and with it
the step; the next quorum leaves the group out.

The status page is torchft's HTML (torchft_lighthouse's `/status`; the lighthouse has no
other way to say who is silent). A page this cannot read aborts nothing: the collective
timeout still bounds the wait, as without this. tests/trainer/test_quorum_rules.py reads
the page of the torchft installed, so a torchft that changes it fails there, not here.
"""

from __future__ import annotations

import re
import threading
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from kubetrain.trainer.bounded import Running

# How the trainer's line begins when it ends an all-reduce on the lighthouse's word.
SAID = "the lighthouse has not heard from"

# The page's parts: the members of the previous (the last formed) quorum, in bold, then the
# heartbeats, one "<replica id>: seen <seconds>s ago" a line.
_HEARTBEATS_HEADING = "<h2>Heartbeats</h2>"
_QUORUM_HEADING = "<h3>Previous Quorum</h3>"
_MEMBER = re.compile(r"<b>([^<]+)</b>")
_HEARTBEAT = re.compile(r"^\s*(\S+): seen ([0-9.eE+-]+)s ago\s*$", re.MULTILINE)

T = TypeVar("T")


class SilentReplicaGroups(RuntimeError):
    """Members of the step's quorum fell silent (their node lost) while this rank waited for
    them: in the step's all-reduce, or in forming the quorum's process group."""

    def __init__(self, silent: list[str], heartbeat_timeout_seconds: float,
                 what_ended: str) -> None:
        super().__init__(f"{SAID} {', '.join(silent)} for heartbeatTimeoutMilliseconds "
                         f"({heartbeat_timeout_seconds:g}s): {what_ended} with them ended "
                         "there, not at collectiveTimeoutMilliseconds")
        self.silent = silent


def silent_members(page: str, heartbeat_timeout_seconds: float) -> list[str]:
    """The members of the lighthouse's last quorum that have not heartbeated for
    `heartbeat_timeout_seconds` (or never), as its status page says; [] for a page
    without a quorum or of another form."""
    before, heading, heartbeats = page.partition(_HEARTBEATS_HEADING)
    if not heading or _QUORUM_HEADING not in before:
        return []
    members = _MEMBER.findall(before.partition(_QUORUM_HEADING)[2])
    seen = {replica: float(ago) for replica, ago in _HEARTBEAT.findall(heartbeats)}
    return [member for member in members
            if seen.get(member, float("inf")) > heartbeat_timeout_seconds]


@dataclass
class SilentPeers:
    """Waits for a step's cross-group all-reduce, asking the lighthouse while it lasts."""

    lighthouse: str  # the address the Manager is given, http://host:port
    heartbeat_timeout_seconds: float

    def wait(self, works: list[Any], holding: Any = None) -> list[str]:
        """Wait for `works` (torchft's, from `Manager.allreduce`) to end, done or failed
        (they report a failure to their Manager); [] then. Or the silent members of the
        quorum, as soon as the lighthouse names them: the works are left waiting in a thread
        of their own, holding `holding` (the process group they run in) until they end.
        gloo cannot abort a collective in flight, and the last reference to its process
        group, dropped when the next quorum replaces it, would wait in its destructor for
        the collective's timeout."""
        def wait_for_works(works: list[Any], holding: Any) -> None:
            try:
                for work in works:
                    work.wait()
            except Exception:  # (the caller's wait on torchft's works reports it)
                pass  # (`holding` is let go when this returns)

        # The process group's own works: torchft's wrappers report a failure to the
        # Manager, which an abandoned step's, failing later, must not do to a later step.
        own = [getattr(work, "_work", work) for work in works]
        waiting = Running(lambda: wait_for_works(own, holding), name="kubetrain-collective")
        silent = self._until_silent(waiting.ended)
        if silent:
            return silent
        for work in works:  # done: torchft's own wait finishes them (the average's division)
            work.wait()
        return []

    def form(self, create: Callable[[], T]) -> T:
        """What `create()` makes (a process group: gloo's forming connects to every member
        of the new quorum), or SilentReplicaGroups as soon as the lighthouse names a member
        of that quorum silent. The forming is then left to its thread, and what it makes or
        raises later is dropped."""
        forming = Running(create, name="kubetrain-forming")
        silent = self._until_silent(forming.ended)
        if silent:
            raise SilentReplicaGroups(silent, self.heartbeat_timeout_seconds,
                                      "the forming of this quorum's process group")
        return forming.outcome().value("")  # (ended: its result, or its error raised)

    def _until_silent(self, ended: threading.Event) -> list[str]:
        """[] once `ended` is set; or, when it is not set within half the heartbeat timeout
        (a healthy wait ends before the first look, so it makes no request at all), the
        silent members of the lighthouse's last quorum as soon as it names them."""
        if not ended.wait(self.heartbeat_timeout_seconds / 2):
            while not ended.is_set():
                silent = self._silent()
                if silent and not ended.is_set():
                    return silent
                ended.wait(self.heartbeat_timeout_seconds / 4)
        return []

    def _silent(self) -> list[str]:
        try:
            with urllib.request.urlopen(f"{self.lighthouse.rstrip('/')}/status",
                                        timeout=self.heartbeat_timeout_seconds) as answer:
                page = answer.read().decode("utf-8", "replace")
        except OSError:  # the lighthouse itself gone: the quorum's retries deal with that
            return []
        return silent_members(page, self.heartbeat_timeout_seconds)
