"""The pod network of the node agent: a Linux bridge and one network namespace per pod.

What it does as a cluster's network does: every pod gets its own IP on one flat
private network (a /24 of 10.244.0.0/16, used only inside this machine), its own
loopback and its own ports, so every worker listens on the same rendezvous and
metrics ports; the host (the operator, the S3 server) and every pod reach every pod
at its IP, and pods reach the host at the bridge's address (the "gateway").

What it does not: no CNI plugin, no kube-proxy, no Service IPs, no DNS server (the
agent writes the pods' names into an /etc/hosts of its own, see node_agent), no
NetworkPolicy, no traffic leaving the machine (no NAT, no forwarding to other
interfaces). All nodes of one agent share the bridge: a flat pod network, as
CNIs without overlay give.

Why namespaces on a bridge and not, say, one loopback address per pod: torchrun
binds its rendezvous store and each trainer its metrics port on all addresses, so
two pods in one network namespace would collide on the ports; a namespace and a
veth pair cost a few milliseconds and no CPU while idle, which suits 2 cores.
Needs root (CAP_NET_ADMIN) and iproute2.
"""

from __future__ import annotations

import ipaddress
import os
import re
import subprocess
import threading
from dataclasses import dataclass, field

NETNS_DIR = "/run/netns"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def _used_subnets() -> set[str]:
    """The 10.244.N.0/24 networks some interface of this host already has."""
    shown = _ip("-4", "-o", "addr", "show").stdout
    return {f"10.244.{m}.0/24" for m in re.findall(r"inet 10\.244\.(\d+)\.\d+/", shown)}


@dataclass
class PodNetwork:
    """One bridge with a /24 of its own; hands out pod IPs and builds pod namespaces.

    `tag` (a few characters) makes the bridge, namespace and veth names unique, so
    several agents on one machine (other test sessions) do not collide.
    """

    tag: str
    bridge: str = ""
    subnet: ipaddress.IPv4Network = field(
        default_factory=lambda: ipaddress.IPv4Network("10.244.0.0/24"))
    _free: list[str] = field(default_factory=list)
    _namespaces: set[str] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def gateway(self) -> str:
        """The host's address on the pod network: pods reach host services here."""
        return str(self.subnet.network_address + 1)

    def create(self) -> None:
        """Create the bridge with the gateway address; pick a /24 no interface uses."""
        used = _used_subnets()
        number = next(n for n in range(10, 250) if f"10.244.{n}.0/24" not in used)
        self.subnet = ipaddress.IPv4Network(f"10.244.{number}.0/24")
        self.bridge = f"ktbr{self.tag}"[:15]
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        self._free = [str(host) for host in list(self.subnet.hosts())[1:]]

    def add_pod(self, key: str) -> tuple[str, str]:
        """A namespace `kt<tag>-<key>` with a veth on the bridge; returns (namespace, IP)."""
        with self._lock:
            address = self._free.pop(0)
        index = address.rsplit(".", 1)[1]
        namespace = f"kt{self.tag}-{key}"
        host_end, pod_end = f"kv{self.tag}{index}h"[:15], f"kv{self.tag}{index}p"[:15]
        _ip("netns", "add", namespace)
        self._namespaces.add(namespace)
        _ip("link", "add", host_end, "type", "veth", "peer", "name", pod_end)
        _ip("link", "set", host_end, "master", self.bridge)
        _ip("link", "set", host_end, "up")
        _ip("link", "set", pod_end, "netns", namespace)
        inside = ["-n", namespace]
        _ip(*inside, "link", "set", "lo", "up")
        _ip(*inside, "link", "set", pod_end, "name", "eth0")
        _ip(*inside, "addr", "add", f"{address}/24", "dev", "eth0")
        _ip(*inside, "link", "set", "eth0", "up")
        _ip(*inside, "route", "add", "default", "via", self.gateway)
        return namespace, address

    def remove_pod(self, namespace: str, address: str) -> None:
        """Delete the namespace (its veth pair goes with it) and free the IP."""
        if namespace in self._namespaces:
            _ip("netns", "delete", namespace, check=False)
            self._namespaces.discard(namespace)
            with self._lock:
                self._free.append(address)

    def destroy(self) -> None:
        """Delete every namespace this network made, then the bridge."""
        for namespace in list(self._namespaces):
            _ip("netns", "delete", namespace, check=False)
        self._namespaces.clear()
        if self.bridge:
            _ip("link", "delete", self.bridge, check=False)

    @staticmethod
    def namespace_path(namespace: str) -> str:
        return os.path.join(NETNS_DIR, namespace)
