"""How `kubetrain run` tells an out-of-memory kill: the kernel's count of them in its cgroup.

On Kubernetes the runtime reports OOMKilled from the container cgroup's OOM events.
Locally the worker processes are in the runner's own memory cgroup (a limit set on
it, e.g. by systemd-run, a container, or a test, applies to all of them), so the
runner reads the same counter: `oom_kill` in memory.events (cgroup v2) or
memory.oom_control (v1). A count that rose during an attempt means the kernel killed
one of its processes for memory. Where no memory cgroup can be read (macOS, no
permission) the count is None and no failure is called an OOM kill.
"""

from __future__ import annotations

from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def memory_cgroup(proc_cgroup: str) -> Path | None:
    """The memory cgroup folder of a process, from its /proc/PID/cgroup text."""
    for line in proc_cgroup.splitlines():
        hierarchy, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):  # cgroup v1
            return CGROUP_ROOT / "memory" / path.lstrip("/")
        if hierarchy == "0" and controllers == "":  # cgroup v2's unified hierarchy
            unified = CGROUP_ROOT / path.lstrip("/")
            if (unified / "memory.events").exists():
                return unified
    return None


def oom_kills(cgroup: Path | None = None) -> int | None:
    """The kernel's OOM kills so far in `cgroup` (default: this process's memory cgroup)."""
    if cgroup is None:
        try:
            cgroup = memory_cgroup(Path("/proc/self/cgroup").read_text())
        except OSError:
            return None
    if cgroup is None:
        return None
    for name in ("memory.events", "memory.oom_control"):
        try:
            text = (cgroup / name).read_text()
        except OSError:
            continue
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
    return None
