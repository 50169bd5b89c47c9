"""The pod network's one piece of machine-wide state: the /run/netns folder.

`ip netns add` makes /run/netns a shared bind mount of itself the first time and never
undoes it, so the test session makes it before its first before-and-after look at the
machine and removes it at its end (tests/conftest.py). Checked in a mount namespace of its
own with an empty /run, as on a machine that has never had a network namespace.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

CLUSTER = Path(__file__).resolve().parents[1] / "cluster"

SCRIPT = f"""
import os, subprocess, sys
sys.path.insert(0, {str(CLUSTER)!r})
# this machine's own /run/netns, if any, out of this private view (a mount hidden under the
# tmpfs below would still be listed in mountinfo)
subprocess.run(["umount", "--recursive", "--lazy", "/run/netns"], capture_output=True)
subprocess.run(["mount", "-t", "tmpfs", "tmpfs", "/run"], check=True)
from pod_network import NETNS_DIR, _mounted, ensure_namespace_folder, remove_namespace_folder
assert not os.path.exists(NETNS_DIR)
assert ensure_namespace_folder() and _mounted(NETNS_DIR)
assert not ensure_namespace_folder()  # made once
subprocess.run(["ip", "netns", "add", "kt-probe"], check=True)
assert not remove_namespace_folder() and _mounted(NETNS_DIR)  # a namespace is still in it
subprocess.run(["ip", "netns", "delete", "kt-probe"], check=True)
assert remove_namespace_folder()
assert not os.path.exists(NETNS_DIR) and not _mounted(NETNS_DIR)
print("ok")
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="mount namespaces and netns need root")
def test_the_namespace_folder_is_made_as_iproute2_makes_it_and_removed_when_empty() -> None:
    done = subprocess.run(["unshare", "--mount", "--propagation", "private",
                           sys.executable, "-c", SCRIPT],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr
