"""The pod network (tests/cluster/pod_network.py): its bridge, and its one piece of
machine-wide state, the /run/netns folder.

The bridge keeps one MAC address while pods come and go, so a pod's open connection to
the host survives another pod's teardown.

`ip netns add` makes /run/netns a shared bind mount of itself the first time and never
undoes it, so the test session makes it before its first before-and-after look at the
machine and removes it at its end (tests/conftest.py). Checked in a mount namespace of its
own with an empty /run, as on a machine that has never had a network namespace.
"""

from __future__ import annotations

import http.server
import os
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest
from pod_network import CNI_PATH, PodNetwork

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


# In a pod: one kept-alive HTTP connection to the host; a request per line read, each
# answered with "ok" or the error (a 5 s timeout: a stall of the gateway's ARP entry lasts
# from seconds to over a minute).
CLIENT = """
import http.client, sys
connection = http.client.HTTPConnection(sys.argv[1], int(sys.argv[2]), timeout=5)
for _ in sys.stdin:
    try:
        connection.request("HEAD", "/")
        connection.getresponse().read()
        print("ok", flush=True)
    except OSError as error:
        print(repr(error), flush=True)
"""


def _host_port(network: PodNetwork, namespace: str) -> str:
    """The bridge port (host-side veth) of the pod in `namespace`."""
    peer = subprocess.run(["ip", "netns", "exec", namespace, "cat", "/sys/class/net/eth0/iflink"],
                          capture_output=True, text=True, check=True).stdout.strip()
    ports = Path("/sys/class/net", network.bridge, "brif")
    return next(port.name for port in ports.iterdir()
                if Path("/sys/class/net", port.name, "ifindex").read_text().strip() == peer)


def _mac(interface: str) -> str:
    return Path("/sys/class/net", interface, "address").read_text().strip()


@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")
def test_a_pods_connection_to_the_host_survives_the_teardown_of_the_pod_with_the_lowest_mac(
) -> None:
    """A bridge without a MAC of its own takes its lowest port's and changes it when that
    port leaves: the other pods' connections to the gateway then stall (seen as a 6.5 s
    status write by the operator after a node loss, and a 13.8 s container kill)."""
    if not os.access(os.path.join(CNI_PATH, "bridge"), os.X_OK) and os.environ.get("CI") != "true":
        pytest.skip("no CNI plugins: `make packages` installs containernetworking-plugins")
    network = PodNetwork(uuid.uuid4().hex[:4])
    network.create()
    server = http.server.ThreadingHTTPServer((network.gateway, 0), _Quiet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    client = None
    try:
        pods = [network.add_pod(key) for key in ("a", "b", "c")]
        by_mac = sorted(pods, key=lambda pod: _mac(_host_port(network, pod[0])))
        lowest, survivor = by_mac[0], by_mac[-1]
        client = subprocess.Popen(
            ["ip", "netns", "exec", survivor[0], sys.executable, "-c", CLIENT, network.gateway,
             str(server.server_address[1])],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert client.stdin is not None and client.stdout is not None

        def ask() -> str:
            client.stdin.write("\n")
            client.stdin.flush()
            return client.stdout.readline().strip()

        assert ask() == "ok"  # the pod's ARP entry for the gateway is now the bridge's MAC
        network.remove_pod(*lowest)
        assert _mac(network.bridge) == network.bridge_mac
        assert ask() == "ok"
    finally:
        if client is not None:
            client.kill()
            client.wait()
        server.shutdown()
        server.server_close()
        network.destroy()


class _Quiet(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: one connection for every request

    def do_HEAD(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass
