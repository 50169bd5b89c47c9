"""Cluster DNS (cluster_dns.py) answers Service names from kmock's emulator over HTTP.

A headless Service with a selector resolves to its pods' IPs; a Service without one (the
operator's status Service) to its EndpointSlice's addresses, and follows the slice when it
moves (the leader changed). Asked over real UDP on loopback, as a pod's resolver asks.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cluster_dns import ClusterDNS, ServiceRecords
from dnslib import QTYPE, RCODE, DNSRecord
from emulator import EmulatedCluster
from kubernetes import client

NAMESPACE = "ns"


@pytest.fixture
def api(tmp_path: Path) -> Iterator[client.ApiClient]:
    with EmulatedCluster(tmp_path) as cluster:
        yield cluster.api_client()


def _free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _ask(dns: ClusterDNS, name: str) -> tuple[int, list[str]]:
    reply = DNSRecord.parse(DNSRecord.question(name, "A").send(dns.address, dns.port,
                                                                timeout=5))
    return reply.header.rcode, sorted(str(answer.rdata) for answer in reply.rr
                                      if answer.rtype == QTYPE.A)


def _pod(core: client.CoreV1Api, name: str, job: str, ip: str) -> None:
    manifest: Any = {"metadata": {"name": name, "labels": {"job": job}}, "spec": {
        "nodeName": "node-a", "containers": [{"name": "main", "image": "x:1"}]}}
    core.create_namespaced_pod(NAMESPACE, manifest)
    core.patch_namespaced_pod_status(name, NAMESPACE, {"status": {"podIP": ip}})


def _slice(ip: str) -> Any:
    return {"metadata": {"name": "status", "namespace": NAMESPACE,
                         "labels": {"kubernetes.io/service-name": "status"}},
            "addressType": "IPv4", "endpoints": [{"addresses": [ip]}],
            "ports": [{"name": "https", "port": 8443, "protocol": "TCP"}]}


def test_service_names_resolve_to_their_pods_or_their_endpoint_slice(
        api: client.ApiClient) -> None:
    core, discovery = client.CoreV1Api(api), client.DiscoveryV1Api(api)
    headless: Any = {"metadata": {"name": "train"}, "spec": {
        "clusterIP": "None", "selector": {"job": "train"}, "publishNotReadyAddresses": True,
        "ports": [{"port": 29400}]}}
    no_selector: Any = {"metadata": {"name": "status"}, "spec": {
        "clusterIP": "None", "ports": [{"port": 8443}]}}
    core.create_namespaced_service(NAMESPACE, headless)
    core.create_namespaced_service(NAMESPACE, no_selector)
    _pod(core, "train-worker-0", "train", "10.244.0.5")
    _pod(core, "train-worker-1", "train", "10.244.0.6")
    _pod(core, "other-worker-0", "other", "10.244.0.7")
    discovery.create_namespaced_endpoint_slice(NAMESPACE, _slice("10.244.0.9"))
    dns = ClusterDNS("127.0.0.1", dict, port=_free_udp_port(),
                     services=ServiceRecords(api, ttl=0.0)).start()
    try:
        assert _ask(dns, f"train.{NAMESPACE}.svc.cluster.local") == (
            RCODE.NOERROR, ["10.244.0.5", "10.244.0.6"])
        assert _ask(dns, f"status.{NAMESPACE}.svc.cluster.local") == (
            RCODE.NOERROR, ["10.244.0.9"])
        discovery.patch_namespaced_endpoint_slice("status", NAMESPACE, {
            "endpoints": [{"addresses": ["10.244.0.8"]}]})  # another replica leads
        deadline = time.monotonic() + 10
        while _ask(dns, f"status.{NAMESPACE}.svc.cluster.local")[1] != ["10.244.0.8"]:
            assert time.monotonic() < deadline, "the slice's new address was never served"
            time.sleep(0.1)
        assert _ask(dns, f"nothing.{NAMESPACE}.svc.cluster.local")[0] == RCODE.NXDOMAIN
    finally:
        dns.stop()
