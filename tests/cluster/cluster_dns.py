"""Cluster DNS for the node agent's pods: the names CoreDNS gives pods behind a headless Service.

What it does as CoreDNS's kubernetes plugin does, for the records kubetrain needs: an A
record for each running pod at `<hostname>.<subdomain>.<namespace>.svc.cluster.local`
(a pod with spec.hostname and spec.subdomain naming a headless Service), and a PTR
record for each pod IP back to that name (torch's c10d looks its peers up in reverse).
A short name is found through the search path the pods' resolv.conf gives
(`<namespace>.svc.cluster.local svc.cluster.local cluster.local`), as in a cluster.
Any other name: NXDOMAIN at once; nothing is forwarded, so nothing leaves the machine.

A Service's own name, `<service>.<namespace>.svc.cluster.local`, as kube-dns answers it
for a headless Service: one A record per endpoint address (`ServiceRecords`, read from the
API every few seconds). A Service with a selector gets the IPs of the pods it selects that
have one (the EndpointSlice controller is not emulated, and the operator's Services
publish not-ready addresses, so that is the same set); a Service without a selector (the
operator's status Service, whose EndpointSlice the operator keeps pointing at its leader)
gets the addresses of its EndpointSlices (label kubernetes.io/service-name).

What it does not: no Service ClusterIPs (kube-proxy is not emulated either, so every
Service answers as a headless one), no SRV records, no AAAA (IPv4 only).

It serves UDP on the pod network's gateway address, port 53, with dnslib (PyPI).
"""

from __future__ import annotations

import ipaddress
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from dnslib import PTR, QTYPE, RCODE, RR, A, DNSRecord
from dnslib.server import BaseResolver, DNSLogger, DNSServer

DOMAIN = "cluster.local"
TTL = 5


ServiceIPs = Mapping[str, Sequence[str]]


def service_records(services: Iterable[Mapping[str, Any]], slices: Iterable[Mapping[str, Any]],
                    pods: Iterable[Mapping[str, Any]]) -> dict[str, list[str]]:
    """Each Service's fully qualified name → its endpoint IPs (see the module docstring),
    from the API's Services, EndpointSlices and Pods as JSON-like objects."""
    sliced: dict[tuple[str, str], list[str]] = {}
    for endpoint_slice in slices:
        meta = endpoint_slice.get("metadata") or {}
        service = (meta.get("labels") or {}).get("kubernetes.io/service-name")
        if service is None:
            continue
        ips = sliced.setdefault((meta.get("namespace", "default"), service), [])
        for endpoint in endpoint_slice.get("endpoints") or []:
            ips += [ip for ip in endpoint.get("addresses") or [] if ip not in ips]
    pods = list(pods)
    records: dict[str, list[str]] = {}
    for service in services:
        meta = service.get("metadata") or {}
        namespace, name = meta.get("namespace", "default"), meta["name"]
        selector = (service.get("spec") or {}).get("selector")
        if selector:
            ips = [pod["status"]["podIP"] for pod in pods
                   if (pod.get("metadata") or {}).get("namespace", "default") == namespace
                   and (pod.get("status") or {}).get("podIP")
                   and not (pod.get("metadata") or {}).get("deletionTimestamp")
                   and selector.items() <= ((pod["metadata"].get("labels") or {}).items())]
        else:
            ips = sliced.get((namespace, name), [])
        if ips:
            records[f"{name}.{namespace}.svc.{DOMAIN}"] = sorted(set(ips))
    return records


class ServiceRecords:
    """`service_records` of the cluster behind `api` (a kubernetes ApiClient), read again
    once `ttl` seconds old: cluster DNS asks on every lookup."""

    def __init__(self, api: Any, ttl: float = 2.0) -> None:
        self.api, self.ttl = api, ttl
        self._lock = threading.Lock()
        self._read_at = -float("inf")
        self._records: dict[str, list[str]] = {}

    def __call__(self) -> dict[str, list[str]]:
        with self._lock:
            if time.monotonic() - self._read_at > self.ttl:
                self._records = self._read()
                self._read_at = time.monotonic()
            return self._records

    def _read(self) -> dict[str, list[str]]:
        from kubernetes import client

        core, discovery = client.CoreV1Api(self.api), client.DiscoveryV1Api(self.api)

        def listed(read: Callable[[], Any]) -> list[dict[str, Any]]:
            try:
                items = read().items or []
            except Exception:  # the API restarting: no Service names meanwhile
                return []
            return [self.api.sanitize_for_serialization(item) for item in items]

        return service_records(listed(core.list_service_for_all_namespaces),
                               listed(discovery.list_endpoint_slice_for_all_namespaces),
                               listed(core.list_pod_for_all_namespaces))


class _Resolver(BaseResolver):  # type: ignore[misc]
    def __init__(self, records: Callable[[], Mapping[str, str]],
                 services: Callable[[], ServiceIPs] | None = None) -> None:
        self.records = records
        self.services = services

    def resolve(self, request: DNSRecord, handler: Any) -> DNSRecord:
        reply = request.reply()
        question = request.q
        name = str(question.qname).rstrip(".").lower()
        current = {host.lower(): ip for host, ip in self.records().items()}
        # Asked only for a name no pod has: a Service read lists the API.
        services = ({host.lower(): ips for host, ips in self.services().items()}
                    if self.services is not None and question.qtype != QTYPE.PTR
                    and name not in current else {})
        if name in services:
            if question.qtype in (QTYPE.A, QTYPE.ANY):
                for ip in services[name]:
                    reply.add_answer(RR(question.qname, QTYPE.A, ttl=TTL, rdata=A(ip)))
            return reply
        if question.qtype == QTYPE.PTR:
            reverse = {ipaddress.ip_address(ip).reverse_pointer: host
                       for host, ip in current.items()}
            if name in reverse:
                reply.add_answer(RR(question.qname, QTYPE.PTR, ttl=TTL,
                                    rdata=PTR(reverse[name] + ".")))
                return reply
        elif name in current:
            if question.qtype in (QTYPE.A, QTYPE.ANY):
                reply.add_answer(RR(question.qname, QTYPE.A, ttl=TTL, rdata=A(current[name])))
            return reply  # a known name without an AAAA record: an empty answer, no error
        reply.header.rcode = RCODE.NXDOMAIN
        return reply


class ClusterDNS:
    """A DNS server on `address`:`port` answering from `records()` (a pod's fully qualified
    name → IP) and `services()` (a Service's fully qualified name → IPs, `ServiceRecords`)."""

    def __init__(self, address: str, records: Callable[[], Mapping[str, str]],
                 port: int = 53, services: Callable[[], ServiceIPs] | None = None) -> None:
        self.address, self.port = address, port
        self._server = DNSServer(_Resolver(records, services), address=address, port=port,
                                 logger=DNSLogger(log="-request,-reply,-truncated,-data",
                                                  prefix=False))

    def start(self) -> ClusterDNS:
        self._server.start_thread()
        return self

    def stop(self) -> None:
        self._server.stop()
        self._server.server.server_close()

    def resolv_conf(self, namespace: str) -> str:
        """The /etc/resolv.conf of a pod in `namespace`, as the kubelet writes it."""
        search = f"{namespace}.svc.{DOMAIN} svc.{DOMAIN} {DOMAIN}"
        return (f"search {search}\nnameserver {self.address}\n"
                "options ndots:5 timeout:1 attempts:2\n")
