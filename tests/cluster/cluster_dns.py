"""Cluster DNS for the node agent's pods: the names CoreDNS gives pods behind a headless Service.

What it does as CoreDNS's kubernetes plugin does, for the records kubetrain needs: an A
record for each running pod at `<hostname>.<subdomain>.<namespace>.svc.cluster.local`
(a pod with spec.hostname and spec.subdomain naming a headless Service), and a PTR
record for each pod IP back to that name (torch's c10d looks its peers up in reverse).
A short name is found through the search path the pods' resolv.conf gives
(`<namespace>.svc.cluster.local svc.cluster.local cluster.local`), as in a cluster.
Any other name: NXDOMAIN at once; nothing is forwarded, so nothing leaves the machine.

What it does not: no Service ClusterIPs (kube-proxy is not emulated either), no SRV
records, no AAAA (IPv4 only), no records from EndpointSlices: the names come straight
from the pods the agent runs, which for headless Services with
publishNotReadyAddresses, as the operator creates, is the same set.

It serves UDP on the pod network's gateway address, port 53, with dnslib (PyPI).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Mapping
from typing import Any

from dnslib import PTR, QTYPE, RCODE, RR, A, DNSRecord
from dnslib.server import BaseResolver, DNSLogger, DNSServer

DOMAIN = "cluster.local"
TTL = 5


class _Resolver(BaseResolver):  # type: ignore[misc]
    def __init__(self, records: Callable[[], Mapping[str, str]]) -> None:
        self.records = records

    def resolve(self, request: DNSRecord, handler: Any) -> DNSRecord:
        reply = request.reply()
        question = request.q
        name = str(question.qname).rstrip(".").lower()
        current = {host.lower(): ip for host, ip in self.records().items()}
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
    """A DNS server on `address`:`port` answering from `records()` (fully qualified name → IP)."""

    def __init__(self, address: str, records: Callable[[], Mapping[str, str]],
                 port: int = 53) -> None:
        self.address, self.port = address, port
        self._server = DNSServer(_Resolver(records), address=address, port=port,
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
