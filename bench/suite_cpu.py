"""Where a command's CPU goes, by kind of process: by default the suite's pytest run.

    python bench/suite_cpu.py [--every 0.5] [--top 12] [-- COMMAND ...]

Runs COMMAND (default: `.venv/bin/pytest -n 3 -p no:cacheprovider`, the suite as `make
test` runs it once the images exist) as this process's child, this process the subreaper
of everything below it, and every `--every` seconds reads each process's CPU time from
/proc. Prints the CPU seconds of each kind of process (`KINDS`: trainer ranks, the
launcher's torchrun agents and fork servers, pytest's workers, containers' runtime, ...)
with how many processes of that kind were seen, and the whole against the wall time times
the cores. A process that lives less than one interval may go unseen, and one that started
before COMMAND is not counted. (The kernel's count of reaped descendants,
RUSAGE_CHILDREN, is no whole: a process whose parent ignores SIGCHLD is reaped without
its times reaching anyone.) Issue 47: the suite's cut is chosen from where its CPU goes,
for on CI's 2 cores the suite is bound by it.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import os
import re
import subprocess
import sys
import time
from pathlib import Path

_PR_SET_CHILD_SUBREAPER = 36
TICK = os.sysconf("SC_CLK_TCK")
DEFAULT_COMMAND = [".venv/bin/pytest", "-n", "3", "-p", "no:cacheprovider"]

# (kind, pattern on "comm | command line"), the first match wins.
KINDS = [
    (RANKS := "trainer ranks (forked by the launcher)", r"^kt-rank-"),
    # (A rank forked from a fork server has its command line, and the fork server the
    # agent's: their names, set at their starts, tell them apart, and a process first seen
    # as a fork server is looked at again.)
    (FORK_SERVER := "the launcher's fork servers (the loop's imports)",
     r"^kt-fork-server|multiprocessing\.forkserver"),
    ("the launcher's torchrun agents", r"kubetrain\.trainer\.launch"),
    ("own-code entries (kubetrain.trainer.own_code)", r"kubetrain\.trainer\.own_code"),
    ("plain torchrun agents", r"torch\.distributed\.run|torchrun"),
    ("own-code scripts (tests/own_code)", r"own[-_]code/\w+\.py"),
    ("trainers started without the launcher", r"-m kubetrain\.trainer\b"),
    ("the tests' own worker scripts", r"tests/\S+_worker\.py"),
    ("operators", r"kubetrain\S* operator"),
    ("kubetrain run and other CLI calls", r"-m kubetrain |bin/kubetrain "),
    # (Its xdist workers are execnet's `python -c`; the tests' own processes name pytest's
    # temporary folders on their command lines, so nothing looser than this.)
    ("pytest (its workers and their in-process tests)", r"bin/pytest |exec\(eval\(sys\.stdin"),
    ("containerd, runc, ctr", r"^(containerd|runc|ctr|containerd-shim)"),
    ("image builds (buildah, pip in them)", r"buildah|storage-untar|pip install"),
    ("torchft's lighthouse", r"torchft_lighthouse"),
    ("chromium (the report's tests)", r"chromium"),
    ("compilers (inductor)", r"^(cc1plus|cc1|gcc|g\+\+|as|ld|collect2)\b"),
]


def kind_of(pid: int) -> str | None:
    """`pid`'s kind (KINDS, else "other: <comm>"); None when it is gone."""
    try:
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(
            errors="replace")
    except OSError:
        return None
    if not command:
        return None  # exiting (a zombie's is empty): seen again, or not at all
    text = f"{comm} | {command}"
    return next((kind for kind, pattern in KINDS if re.search(pattern, text)),
                f"other: {comm}")


def cpu_ticks(pid: int) -> tuple[int, int] | None:
    """`pid`'s (user + system CPU ticks, start time in ticks since boot); None when gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    return int(fields[11]) + int(fields[12]), int(fields[19])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--every", type=float, default=0.5, help="seconds between samples")
    parser.add_argument("--top", type=int, default=12, help="kinds printed, the largest first")
    parser.add_argument("command", nargs="*", help="the command (after --)")
    args = parser.parse_args()
    command = args.command or DEFAULT_COMMAND

    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1)
    boot = float(Path("/proc/uptime").read_text().split()[0]) * TICK
    seen: dict[tuple[int, int], list] = {}  # (pid, start) -> [ticks counted, kind]
    by_kind: collections.Counter[str] = collections.Counter()
    processes: collections.Counter[str] = collections.Counter()
    me = os.getpid()
    started = time.monotonic()
    child = subprocess.Popen(command)
    while child.poll() is None:
        for name in os.listdir("/proc"):
            if not name.isdigit() or int(name) == me:
                continue
            now = cpu_ticks(int(name))
            if now is None or now[1] < boot:
                continue  # gone, or older than the command
            key = (int(name), now[1])
            if key not in seen or seen[key][1] == FORK_SERVER:
                kind = kind_of(int(name))
                if kind is None:
                    continue
                counted, before = seen.get(key, [0, None])
                if before is None or kind == RANKS:  # new, or a rank forked: its CPU moves
                    processes[kind] += 1
                    by_kind[kind] += counted
                    if before is not None:
                        processes[before] -= 1
                        by_kind[before] -= counted
                seen[key] = [counted, kind]
            by_kind[seen[key][1]] += now[0] - seen[key][0]
            seen[key][0] = now[0]
        time.sleep(args.every)
    wall = time.monotonic() - started
    while True:  # the orphans left below this process (a subreaper's)
        try:
            os.wait()
        except ChildProcessError:
            break
    whole = sum(by_kind.values()) / TICK
    cores = os.cpu_count() or 1
    print(f"\n{Path(command[0]).name} exited {child.returncode}: {wall:.0f} s of wall time, "
          f"{whole:.0f} CPU seconds seen, {whole / (wall * cores):.0%} of {cores} cores; "
          "by kind:")
    for kind, ticks in by_kind.most_common(args.top):
        seconds = ticks / TICK
        print(f"  {seconds:7.0f} s  {seconds / whole:4.0%}  {processes[kind]:5d} processes  "
              f"{seconds / processes[kind]:5.2f} s each  {kind}")
    rest = sum(by_kind[kind] for kind, _ in by_kind.most_common()[args.top:]) / TICK
    print(f"  {rest:7.0f} s  {rest / whole:4.0%}  the other kinds")
    return child.returncode


if __name__ == "__main__":
    sys.exit(main())
