"""Hold processes (SIGSTOP) the moment a metrics log has the step event of a given step.

    python hold_at_step.py LOG STEP PID...

A process of its own, so that the hold depends on nothing in the test's process: in a
suite's worker that process also runs earlier tests' threads (a whole-loop cluster's
servers and watchers) and carries their heap, and a clean clone's suite lost all three tries
of the elastic-restart finishing test there, though the test never lost one alone or beside
three spinning processes. Under the real-time scheduler where it may (root): it wakes ahead
of every ordinary process on a loaded machine. It reads only what the log gained since its
last look, and a line still being written is left for the next.

Exits 0 once every PID is held, 1 when one had ended first.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path

POLL_SECONDS = 0.001


def main() -> int:
    log, step, pids = Path(sys.argv[1]), int(sys.argv[2]), [int(pid) for pid in sys.argv[3:]]
    with contextlib.suppress(PermissionError):  # not root: as fast as the machine lets it
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
    read, pending = 0, b""
    while True:
        try:
            with log.open("rb") as found:
                found.seek(read)
                gained = found.read()
        except FileNotFoundError:
            gained = b""
        read += len(gained)
        *lines, pending = (pending + gained).split(b"\n")
        for line in filter(None, map(bytes.strip, lines)):
            event = json.loads(line)
            if event["event"] == "step" and event["step"] == step:
                try:
                    for pid in pids:
                        os.kill(pid, signal.SIGSTOP)
                except ProcessLookupError:
                    return 1
                return 0
        time.sleep(POLL_SECONDS)


if __name__ == "__main__":
    sys.exit(main())
