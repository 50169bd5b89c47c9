"""What a test leaves on the machine: tests/cluster/machine_state.sh, read and compared.

`snapshot()` lists everything a container set-up can leave (links, addresses, routes,
mounts, cgroups, network namespaces, fixed folders, processes) as "SECTION: LINE";
`left_behind(before, after, mine)` is what changed between two snapshots, less what
other tests running at the same time explain, unless it names one of `mine`.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

MACHINE_STATE = Path(__file__).resolve().parent / "machine_state.sh"

# Lines of machine_state.sh that other tests running at the same time change (`make test`
# runs two pytest workers, and the e2e tests run pods in runtimes of their own), by
# section: network namespaces and the pod networks' bridges and veths (ktbr*, kv*, veth*,
# cni*) with their addresses and routes; mounts of other tests' temporary folders and of
# a concurrent image build; other runtimes' cgroup parents (kt-<tag>) and shim sockets
# (/run/containerd/s/<hash>), and /run/containerd itself while another runtime has one
# there; buildah's blob cache; the process counts of other containerds. This runtime's
# own lines are never ignored (its folder, its cgroup parent, its shims' sockets), and its
# processes are checked directly; every other line must be the same before and after.
OTHERS = {
    "netns": r"",
    "links": r"^(ktbr|kv|veth|cni)",
    "addresses": r"^(ktbr|kv|veth|cni)",
    "routes": r" dev (ktbr|kv|veth|cni)\S* ",
    "mounts": r"^/run/netns/|^/tmp/|/kubetrain/images/work-",
    "cgroups": r"/kt-[0-9a-f]{8}$",
    "fixed folders": r"^/run/netns|^/var/lib/containers|^/run/containerd/s/[0-9a-f]{64}$",
    "/run": r"^netns$",
    "processes": r"^\s*\d+ (containerd|containerd-shim\S*|runc)$",
}
SHARED_RUN = {"fixed folders: /run/containerd", "fixed folders: /run/containerd/s",
              "/run: containerd"}


def snapshot() -> list[str]:
    """machine_state.sh's lines, each as "SECTION: LINE"."""
    # (its exit status is grep's last count: 1 when no DNS helper runs)
    out = subprocess.run(["bash", str(MACHINE_STATE)], capture_output=True, text=True,
                         check=False).stdout
    assert "## processes" in out, f"{MACHINE_STATE} did not run to its end:\n{out[-2000:]}"
    section, lines = "", []
    for line in out.splitlines():
        if line.startswith("## "):
            section = line[3:].split(" (")[0]
        else:
            lines.append(f"{section}: {line}")
    return lines


def left_behind(before: list[str], after: list[str], mine: list[str],
                shims_outlive: bool = False) -> list[str]:
    """The lines that changed, less those other tests explain (OTHERS), unless they name
    something in MINE. `shims_outlive`: /run/containerd and its shims' folder belong to a
    runtime that outlives the check (it made them for its first shim and removes them)."""
    changed = [f"- {line}" for line in before if line not in after]
    changed += [f"+ {line}" for line in after if line not in before]
    other_shims = any(line.startswith("fixed folders: /run/containerd/s/")
                      and not any(m in line for m in mine) for line in before + after)

    def explained(line: str) -> bool:
        if any(m in line for m in mine):
            return False
        if line in SHARED_RUN:
            return other_shims or shims_outlive
        section, _, rest = line.partition(": ")
        return section in OTHERS and re.search(OTHERS[section], rest) is not None

    return [line for line in changed if not explained(line[2:])]
