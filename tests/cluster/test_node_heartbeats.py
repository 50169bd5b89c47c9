"""The node agent's heartbeats (node_heartbeats.py) against kmock's emulator over HTTP:
the Nodes and Leases a node lifecycle controller reads, without root or containers."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from emulator import EmulatedCluster
from kubernetes import client
from node_heartbeats import HEARTBEAT_SECONDS, LEASE_NAMESPACE, Node, NodeHeartbeats

HOST_IP = "10.244.9.1"
SYSTEM_TAINT = {"key": "node-role.kubernetes.io/system", "value": "true",
                "effect": "NoSchedule"}


@pytest.fixture
def api(tmp_path: Path) -> Iterator[client.ApiClient]:
    with EmulatedCluster(tmp_path) as cluster:
        yield cluster.api_client()


def renewed(api: client.ApiClient, name: str) -> object:
    lease: Any = client.CoordinationV1Api(api).read_namespaced_lease(name, LEASE_NAMESPACE)
    return lease.spec.renew_time


def test_nodes_register_ready_with_their_taints_and_a_lease_they_own(
        api: client.ApiClient) -> None:
    nodes = [Node("node-a", cpu="4"), Node("system", taints=[SYSTEM_TAINT])]
    heartbeats = NodeHeartbeats(api, nodes, HOST_IP).start()
    try:
        core = client.CoreV1Api(api)
        node: Any = core.read_node("node-a")
        assert {c.type: c.status for c in node.status.conditions}["Ready"] == "True"
        assert node.status.allocatable["cpu"] == "4"
        assert node.metadata.labels["kubernetes.io/hostname"] == "node-a"
        addresses = {a.type: a.address for a in node.status.addresses}
        assert addresses == {"InternalIP": HOST_IP, "Hostname": "node-a"}
        system: Any = core.read_node("system")
        assert [t.key for t in system.spec.taints] == [SYSTEM_TAINT["key"]]
        lease: Any = client.CoordinationV1Api(api).read_namespaced_lease("node-a",
                                                                         LEASE_NAMESPACE)
        assert lease.spec.holder_identity == "node-a"
        assert lease.metadata.owner_references[0].uid == node.metadata.uid
    finally:
        heartbeats.stop()
    heartbeats.deregister()
    assert not client.CoreV1Api(api).list_node().items


def test_a_lost_node_goes_silent_until_it_is_restored(api: client.ApiClient) -> None:
    heartbeats = NodeHeartbeats(api, [Node("node-a"), Node("node-b")], HOST_IP).start()
    try:
        heartbeats.lose("node-a")
        assert heartbeats.live() == {"node-b"}
        lost_at, other_at = renewed(api, "node-a"), renewed(api, "node-b")
        time.sleep(HEARTBEAT_SECONDS * 1.5)
        assert renewed(api, "node-a") == lost_at  # no heartbeat from a lost node
        assert renewed(api, "node-b") != other_at  # while the others keep beating

        heartbeats.restore("node-a")
        assert heartbeats.live() == {"node-a", "node-b"}
        assert renewed(api, "node-a") != lost_at  # at once, not at the next beat
    finally:
        heartbeats.stop()
