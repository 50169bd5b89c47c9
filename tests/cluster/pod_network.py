"""The pod network of the node agent: a CNI bridge and one network namespace per pod.

What it does as a cluster's network does: every pod gets its own IP on one flat
private network (a /24 of 10.244.0.0/16, used only inside this machine), its own
loopback and its own ports, so every worker listens on the same rendezvous and
metrics ports; the host (the operator, the S3 server) and every pod reach every pod
at its IP, and pods reach the host at the bridge's address (the "gateway"). Each pod's
interface is made by Debian's CNI plugins (containernetworking-plugins: `bridge` with
`host-local` IPAM, and `loopback`), called as a container runtime calls them (ADD on
start, DEL on teardown, the network configuration on stdin).

The bridge has `isGateway: false` and the pods get no default route: the bridge and
its address are made here beforehand, so the plugin never switches on
net.ipv4.ip_forward, and a pod can reach nothing but the bridge's subnet: nothing in a
pod reaches beyond this machine. For the same reason the plugin never pins the bridge's MAC
address, so it is set here too (`bridge_mac`).

What it does not: no kube-proxy, no Service IPs, no NetworkPolicy, no NAT. All nodes
of one agent share the bridge: a flat pod network, as CNIs without overlay give.

Why namespaces on a bridge and not, say, one loopback address per pod: torchrun
binds its rendezvous store and each trainer its metrics port on all addresses, so
two pods in one network namespace would collide on the ports; a namespace and a
veth pair cost a few milliseconds and no CPU while idle, which suits 2 cores.
Needs root (CAP_NET_ADMIN), iproute2 and containernetworking-plugins.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

NETNS_DIR = "/run/netns"
CNI_PATH = "/usr/lib/cni"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def _mounted(path: str) -> bool:
    """Whether PATH is a mount point (os.path.ismount misses a bind mount within one
    file system, which iproute2's is)."""
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == path for line in f)


def ensure_namespace_folder() -> bool:
    """Make /run/netns as iproute2 makes it for a machine's first network namespace.

    `ip netns add` turns the folder into a shared bind mount of itself the first time, and
    never undoes that. A test that compares the machine before and after (machine_state)
    calls this before its first look, so the folder is there in both; the test session
    removes it at its end if the session made it (`remove_namespace_folder`, from
    tests/conftest.py). Returns whether it was made here.
    """
    if _mounted(NETNS_DIR):
        return False
    os.makedirs(NETNS_DIR, exist_ok=True)
    subprocess.run(["mount", "--bind", NETNS_DIR, NETNS_DIR], check=True, capture_output=True)
    subprocess.run(["mount", "--make-rshared", NETNS_DIR], check=True, capture_output=True)
    return True


def remove_namespace_folder() -> bool:
    """Unmount and remove /run/netns when no namespace is left in it; whether it did."""
    if not os.path.isdir(NETNS_DIR) or os.listdir(NETNS_DIR):
        return False
    if _mounted(NETNS_DIR):
        subprocess.run(["umount", NETNS_DIR], check=True, capture_output=True)
    os.rmdir(NETNS_DIR)
    return True


def _used_subnets() -> set[str]:
    """The 10.244.N.0/24 networks some interface of this host already has."""
    shown = _ip("-4", "-o", "addr", "show").stdout
    return {f"10.244.{m}.0/24" for m in re.findall(r"inet 10\.244\.(\d+)\.\d+/", shown)}


@dataclass
class PodNetwork:
    """One bridge with a /24 of its own; builds pod namespaces and their CNI interfaces.

    `tag` (a few characters) makes the bridge and namespace names unique, so several
    agents on one machine (other test sessions) do not collide. `state` is the folder
    of the IPAM plugin's leases.
    """

    tag: str
    state: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="kt-cni-")))
    bridge: str = ""
    subnet: ipaddress.IPv4Network = field(
        default_factory=lambda: ipaddress.IPv4Network("10.244.0.0/24"))
    _namespaces: set[str] = field(default_factory=set)

    @property
    def gateway(self) -> str:
        """The host's address on the pod network: pods reach host services here."""
        return str(self.subnet.network_address + 1)

    @property
    def bridge_mac(self) -> str:
        """The bridge's MAC address, fixed for its life and derived from the gateway's IP.

        A Linux bridge without an address of its own takes the lowest MAC of its ports,
        and takes another when that port leaves: then every pod's ARP entry for the gateway
        names a MAC nothing answers, and each connection to the host (the API server, S3,
        cluster DNS) stalls until the neighbour entry is probed again, from seconds to over
        a minute. A pod torn down after a container kill or a node loss did that to its
        peers and to the operator at random (containernetworking/cni#285). So the bridge
        gets its address at creation, which the kernel then keeps, as the CNI bridge plugin
        does where it sets up the gateway itself: locally administered, 0a:58 and the IP.
        """
        return "0a:58:" + ":".join(f"{byte:02x}" for byte in
                                   ipaddress.IPv4Address(self.gateway).packed)

    def create(self) -> None:
        """Create the bridge with the gateway address; pick a /24 no interface uses."""
        missing = [plugin for plugin in ("bridge", "host-local", "loopback")
                   if not os.access(os.path.join(CNI_PATH, plugin), os.X_OK)]
        if missing:
            raise RuntimeError(f"no CNI plugin {', '.join(missing)} in {CNI_PATH}: "
                               "apt-get install containernetworking-plugins")
        used = _used_subnets()
        number = next(n for n in range(10, 250) if f"10.244.{n}.0/24" not in used)
        self.subnet = ipaddress.IPv4Network(f"10.244.{number}.0/24")
        self.bridge = f"ktbr{self.tag}"[:15]
        _ip("link", "add", self.bridge, "address", self.bridge_mac, "type", "bridge")
        _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")

    def _config(self) -> dict[str, Any]:
        return {
            "cniVersion": "0.4.0", "name": f"kt-{self.tag}", "type": "bridge",
            "bridge": self.bridge, "isGateway": False, "ipMasq": False, "hairpinMode": True,
            "ipam": {"type": "host-local", "dataDir": str(self.state / "ipam"),
                     "ranges": [[{"subnet": str(self.subnet), "gateway": self.gateway}]],
                     "routes": []},
        }

    def _cni(self, plugin: str, command: str, namespace: str, config: dict[str, Any],
             interface: str) -> dict[str, Any]:
        env = {"CNI_COMMAND": command, "CNI_CONTAINERID": namespace,
               "CNI_NETNS": self.namespace_path(namespace), "CNI_IFNAME": interface,
               "CNI_PATH": CNI_PATH, "PATH": os.environ.get("PATH", "/usr/bin:/bin")}
        result = subprocess.run([os.path.join(CNI_PATH, plugin)], input=json.dumps(config),
                                env=env, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"CNI {plugin} {command} for {namespace} failed: "
                               f"{result.stdout}{result.stderr}")
        return json.loads(result.stdout) if result.stdout.strip() else {}

    def add_pod(self, key: str) -> tuple[str, str]:
        """A namespace `kt<tag>-<key>` with eth0 on the bridge; returns (namespace, IP)."""
        namespace = f"kt{self.tag}-{key}"
        _ip("netns", "add", namespace)
        self._namespaces.add(namespace)
        self._cni("loopback", "ADD", namespace,
                  {"cniVersion": "0.4.0", "name": "lo", "type": "loopback"}, "lo")
        added = self._cni("bridge", "ADD", namespace, self._config(), "eth0")
        address = added["ips"][0]["address"].split("/")[0]
        return namespace, address

    def disconnect(self, namespace: str) -> None:
        """Take the pod's interface down: nothing leaves it or reaches it any more.

        A pod whose network is already gone (its container ended and was cleaned up) or
        not yet attached has no interface to take down.
        """
        if namespace in self._namespaces:
            _ip("-n", namespace, "link", "set", "eth0", "down", check=False)

    def remove_pod(self, namespace: str, address: str = "") -> None:
        """CNI DEL (the IP goes back to the pool), then delete the namespace."""
        if namespace in self._namespaces:
            with contextlib.suppress(RuntimeError):
                self._cni("bridge", "DEL", namespace, self._config(), "eth0")
            _ip("netns", "delete", namespace, check=False)
            self._namespaces.discard(namespace)

    def destroy(self) -> None:
        """Remove every pod this network made, then the bridge and the IPAM state."""
        for namespace in list(self._namespaces):
            self.remove_pod(namespace)
        if self.bridge:
            _ip("link", "delete", self.bridge, check=False)
        shutil.rmtree(self.state, ignore_errors=True)

    @staticmethod
    def namespace_path(namespace: str) -> str:
        return os.path.join(NETNS_DIR, namespace)
