"""One simulated node of a local run: a torchrun agent process and the training processes it starts.

A node is started in its own session so the terminal's Ctrl-C reaches only the
runner, which forwards it. torchrun starts each training process in a session of
its own too, so "the node" is found by walking the agent's descendants in
/proc: `lose()` kills all of them at once with SIGKILL, the way a machine that
loses power takes its processes with it. Linux only, like torch's elastic agent.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import IO

from kubetrain.local.launch import AgentLaunch
from kubetrain.protocol import RANK_PROCESS_PREFIX

_PR_SET_PDEATHSIG = 1


def _die_with_runner() -> None:
    # Runs in the child before exec: a new session (no terminal signals), and SIGTERM
    # when the runner itself dies, so a crashed runner never leaves training running.
    os.setsid()
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def descendants(pid: int) -> list[int]:
    """Every living process below `pid` (children first), read from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # Field 4 of /proc/PID/stat is the parent; the command name before it may hold spaces.
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(parent, []).append(int(entry.name))
    found, frontier = [], [pid]
    while frontier:
        below = children.get(frontier.pop(), [])
        found.extend(below)
        frontier.extend(below)
    return found


def rank_processes(pids: Iterable[int]) -> dict[int, int]:
    """The training processes among `pids`, pid → rank, by the name each gives itself
    (`kt-rank-N`); processes gone meanwhile are left out."""
    found = {}
    for pid in pids:
        with contextlib.suppress(OSError, ValueError):
            name = Path(f"/proc/{pid}/comm").read_text().strip()
            if name.startswith(RANK_PROCESS_PREFIX):
                found[pid] = int(name.removeprefix(RANK_PROCESS_PREFIX))
    return found


class Node:
    """A running simulated node; see the module docstring."""

    def __init__(self, launch: AgentLaunch, cwd: Path, log: IO[bytes]) -> None:
        self.index = launch.index
        self.process = subprocess.Popen(
            launch.argv, cwd=cwd, env={**os.environ, **launch.env},
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            preexec_fn=_die_with_runner,
        )

    @property
    def pid(self) -> int:
        return self.process.pid

    def poll(self) -> int | None:
        """The agent's exit status (negative: killed by that signal), or None while it runs."""
        return self.process.poll()

    def signal(self, signum: int) -> None:
        """Send `signum` to the agent, which passes it on to its training processes."""
        with contextlib.suppress(ProcessLookupError):
            self.process.send_signal(signum)

    def lose(self) -> None:
        """Kill the agent and every process under it with SIGKILL at once, as a lost node."""
        if self.poll() is not None:
            return  # already gone, and its pid may belong to another process by now
        victims = [self.pid, *descendants(self.pid)]
        for pid in victims:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        self.process.wait()
