"""The node agent's heartbeats: its Nodes registered and kept alive, as the kubelet keeps its own.

What it does as the kubelet does: registers each Node (labels kubernetes.io/hostname, os
and arch; the taints it registers with, as `--register-with-taints`), writes the node
status (capacity and allocatable cpu/memory/pods, the InternalIP and Hostname addresses,
the pressure conditions False and Ready True, nodeInfo) and renews the node's Lease in
`kube-node-lease` every 2 s (the status every 10 s), so the node lifecycle controller
sees the node alive, and marks it unreachable when the heartbeats stop. A lost node
(`lose`) goes silent: no Lease renewals, no status; `restore` is the node booting again.

What it does not: run pods (the node agent's pod loop), measure anything (capacity is
what the test says; no pressure is ever reported), no NotReady of its own (a silent
node is marked by tests/cluster/controllers.py, as by the node lifecycle controller), no
volumes or images in the status.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from kubernetes import client
from kubernetes.client.rest import ApiException
from pod_status import api_now

log = logging.getLogger("node-agent")

LEASE_NAMESPACE = "kube-node-lease"
LEASE_SECONDS = 40
HEARTBEAT_SECONDS = 2.0
STATUS_EVERY_BEATS = 5  # the kubelet posts node status every 10 s


@dataclass
class Node:
    """One node of the agent, as the test describes it."""

    name: str
    cpu: str = "16"
    memory: str = "64Gi"
    pods: str = "110"
    # Taints it registers with (as `kubelet --register-with-taints`), e.g. a system node's.
    taints: list[dict[str, str]] = field(default_factory=list)
    lost: bool = False


@dataclass
class NodeHeartbeats:
    """Registers `nodes`, reachable at `host_ip`, and heartbeats them in a thread of its own."""

    api: client.ApiClient
    nodes: list[Node]
    host_ip: str
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __post_init__(self) -> None:
        self.core = client.CoreV1Api(self.api)
        self.leases = client.CoordinationV1Api(self.api)

    def start(self) -> NodeHeartbeats:
        """Register every node, write its status and Lease, then heartbeat until `stop`."""
        for node in self.nodes:
            self._register(node)
        self._thread = threading.Thread(target=self._heartbeat_loop,
                                        name="node-agent-heartbeats", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the heartbeats (the Nodes stay registered)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def deregister(self) -> None:
        """Delete the Nodes (their Leases go with them: the Node owns each)."""
        for node in self.nodes:
            with contextlib.suppress(ApiException):
                self.core.delete_node(node.name)

    def live(self) -> set[str]:
        """The names of the nodes that are not lost."""
        return {node.name for node in self.nodes if not node.lost}

    def node(self, name: str) -> Node:
        """The node called `name` (StopIteration when the agent has none)."""
        return next(node for node in self.nodes if node.name == name)

    def lose(self, name: str) -> None:
        """The node powers off: its heartbeats and status stop."""
        self.node(name).lost = True

    def restore(self, name: str) -> None:
        """The node boots again: a Ready status and its Lease at once, heartbeats resume."""
        node = self.node(name)
        node.lost = False
        self._write_node_status(node)
        self._renew_lease(node)

    def _register(self, node: Node) -> None:
        body: Any = {
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": node.name, "labels": {
                "kubernetes.io/hostname": node.name, "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64"}},
            "spec": {"taints": node.taints} if node.taints else {},
        }
        try:
            self.core.create_node(body)
        except ApiException as error:
            if error.status != 409:
                raise
        self._write_node_status(node)
        self._renew_lease(node)

    def _write_node_status(self, node: Node) -> None:
        capacity = {"cpu": node.cpu, "memory": node.memory, "pods": node.pods}
        now = api_now()
        conditions = [
            {"type": kind, "status": "False", "reason": f"KubeletHas{reason}",
             "lastHeartbeatTime": now, "lastTransitionTime": now}
            for kind, reason in (("MemoryPressure", "SufficientMemory"),
                                 ("DiskPressure", "NoDiskPressure"),
                                 ("PIDPressure", "SufficientPID"))
        ]
        conditions.append({"type": "Ready", "status": "True", "reason": "KubeletReady",
                           "message": "node agent is posting ready status",
                           "lastHeartbeatTime": now, "lastTransitionTime": now})
        self.core.patch_node_status(node.name, {"status": {
            "capacity": capacity, "allocatable": capacity, "conditions": conditions,
            "addresses": [{"type": "InternalIP", "address": self.host_ip},
                          {"type": "Hostname", "address": node.name}],
            "nodeInfo": {"kubeletVersion": "v1.36.2-node-agent", "operatingSystem": "linux",
                         "architecture": "amd64", "containerRuntimeVersion": "containerd://1.6",
                         "kernelVersion": os.uname().release, "osImage": "node-agent",
                         "kubeProxyVersion": "", "machineID": "", "systemUUID": "",
                         "bootID": ""}}})

    def _renew_lease(self, node: Node) -> None:
        now = datetime.now(UTC)
        spec = {"holderIdentity": node.name, "leaseDurationSeconds": LEASE_SECONDS,
                "renewTime": now.strftime("%Y-%m-%dT%H:%M:%S.%fZ")}
        try:
            self.leases.patch_namespaced_lease(node.name, LEASE_NAMESPACE, {"spec": spec})
        except ApiException as error:
            if error.status != 404:
                raise
            owner: Any = self.core.read_node(node.name).metadata
            lease: Any = {
                "metadata": {"name": node.name, "ownerReferences": [{
                    "apiVersion": "v1", "kind": "Node", "name": node.name, "uid": owner.uid}]},
                "spec": spec}
            self.leases.create_namespaced_lease(LEASE_NAMESPACE, lease)

    def _heartbeat_loop(self) -> None:
        beats = 0
        while not self._stop.wait(HEARTBEAT_SECONDS):
            beats += 1
            for node in self.nodes:
                if node.lost:
                    continue
                try:
                    self._renew_lease(node)
                    if beats % STATUS_EVERY_BEATS == 0:
                        self._write_node_status(node)
                except Exception:
                    log.exception("heartbeat of %s failed", node.name)
