"""The operator's side of the status endpoint: its keys, each job's Secret, admission, progress.

`kubetrain.operator.trainer_status_endpoint` serves reports and keeps them in memory; this module
wires it into the operator:

- at start, the endpoint's CA pair and HMAC key come from the Secret `ENDPOINT_SECRET` in
  the operator's namespace, created on first start (`load_or_create_keys`): a CA that
  outlives any one operator process, since reporters read the CA file once per process;
  the serving certificate is issued afresh from it for the host pods dial (`--status-host`);
- for each own-code job (spec.trainer) the controller admits the job and creates its
  Secret `<job>-status` (`job_secret`: the token, the CA and the URL), owned by the job
  and mounted into its pods only (`kubetrain.operator.own_code_container`); a finished or
  deleted job is forgotten;
- the job's latest report becomes its observed progress (`StatusReporting.sample`).

Several replicas: reports reach only the leader. The status Service has no selector:
the replica that acts (the leader, or the one standalone replica) creates it and writes
its EndpointSlice with its own pod IP when it starts acting (`advertise`), so the Service
always routes to the replica that reconciles, and a standby keeps no reports. A leader
that dies keeps the slice until the next one takes over (within the Lease's duration):
reports sent meanwhile fail, and reporters send the next one anyway.
"""

from __future__ import annotations

import base64
import ipaddress
import logging
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from kubetrain import pod_conventions
from kubetrain.api.trainingjob import TrainingJob
from kubetrain.operator import children
from kubetrain.operator.facts import MetricsSample, reported_sample
from kubetrain.operator.own_code_container import (
    STATUS_CA_KEY,
    STATUS_TOKEN_KEY,
    STATUS_URL_KEY,
    status_secret_name,
)
from kubetrain.operator.trainer_status_endpoint import (
    StatusEndpoint,
    StatusReports,
    job_token,
    status_path,
)
from kubetrain.operator.trainer_status_tls import CertificateAuthority

# The Secret, in the operator's namespace, holding the endpoint's CA pair and HMAC key.
ENDPOINT_SECRET = "kubetrain-status-endpoint"
CA_CERT_KEY = "ca.crt"
CA_KEY_KEY = "ca.key"
HMAC_KEY = "hmac.key"
KEY_BYTES = 32
# The EndpointSlice of the chart's selector-less status Service, kept by the acting replica.
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
MANAGED_BY_LABEL = "endpointslice.kubernetes.io/managed-by"
ENDPOINT_PORT_NAME = "status"

log = logging.getLogger(__name__)


def _encoded(data: Mapping[str, bytes]) -> dict[str, str]:
    return {key: base64.b64encode(value).decode() for key, value in data.items()}


def endpoint_keys(data: Mapping[str, str]) -> tuple[CertificateAuthority, bytes]:
    """The CA and HMAC key from the endpoint Secret's (base64) data."""
    try:
        raw = {key: base64.b64decode(data[key]) for key in (CA_CERT_KEY, CA_KEY_KEY, HMAC_KEY)}
    except KeyError as missing:
        raise ValueError(f"Secret {ENDPOINT_SECRET} lacks the key {missing}: delete it, and "
                         "the operator makes a new one (job pods then need new tokens)"
                         ) from None
    return CertificateAuthority(raw[CA_CERT_KEY], raw[CA_KEY_KEY]), raw[HMAC_KEY]


def load_or_create_keys(core: client.CoreV1Api, namespace: str
                        ) -> tuple[CertificateAuthority, bytes]:
    """The endpoint's CA and HMAC key from `namespace/ENDPOINT_SECRET`, created when missing
    (two replicas starting at once both read the winner's)."""
    for _ in range(2):
        try:
            secret = core.read_namespaced_secret(ENDPOINT_SECRET, namespace)
            return endpoint_keys({key: str(value) for key, value in (secret.data or {}).items()})
        except ApiException as error:
            if error.status != 404:
                raise
        authority = CertificateAuthority.generate()
        key = secrets.token_bytes(KEY_BYTES)
        body: Any = {  # the client takes a plain manifest as well as its model
            "apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": {"name": ENDPOINT_SECRET, "labels": dict(children.MANAGED_BY)},
            "data": _encoded({CA_CERT_KEY: authority.cert_pem, CA_KEY_KEY: authority.key_pem,
                              HMAC_KEY: key})}
        try:
            core.create_namespaced_secret(namespace, body)
            return authority, key
        except ApiException as error:
            if error.status != 409:  # another replica created it first: read theirs
                raise
    raise RuntimeError(f"Secret {namespace}/{ENDPOINT_SECRET} could be neither read nor created")


def serving_names(host: str) -> tuple[list[str], list[str]]:
    """The DNS names and IP addresses the serving certificate is for, given the host pods
    dial: an IP as it is; a Service's `<name>.<namespace>.svc` also with `.cluster.local`."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        names = [host, f"{host}.cluster.local"] if host.endswith(".svc") else [host]
        return names, []
    return [], [host]


def base_url(host: str, port: int) -> str:
    """`https://host:port`, with an IPv6 address in brackets."""
    shown = f"[{host}]" if ":" in host else host
    return f"https://{shown}:{port}"


def job_secret(job: TrainingJob, key: bytes, ca_pem: bytes, url: str) -> dict[str, Any]:
    """The Secret `<job>-status` its pods mount: the job's token, the CA and the full URL."""
    meta = job.metadata
    namespace = meta.namespace or "default"
    metadata: dict[str, Any] = {
        "name": status_secret_name(meta.name),
        "labels": {**children.MANAGED_BY, pod_conventions.JOB_LABEL: meta.name},
        "ownerReferences": [children.owner_reference(job)],
    }
    if meta.namespace:
        metadata["namespace"] = meta.namespace
    token = job_token(key, namespace, meta.name, meta.uid or "")
    return {
        "apiVersion": "v1", "kind": "Secret", "type": "Opaque", "metadata": metadata,
        "data": _encoded({STATUS_TOKEN_KEY: token.encode(), STATUS_CA_KEY: ca_pem,
                          STATUS_URL_KEY: (url + status_path(namespace, meta.name)).encode()}),
    }


def status_service(name: str, port: int) -> dict[str, Any]:
    """The selector-less Service job pods dial (its EndpointSlice: `endpoint_slice`)."""
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "labels": dict(children.MANAGED_BY)},
        "spec": {"type": "ClusterIP", "ports": [
            {"name": ENDPOINT_PORT_NAME, "port": port, "targetPort": port, "protocol": "TCP"}]},
    }


def endpoint_slice(service: str, pod_ip: str, port: int) -> dict[str, Any]:
    """The EndpointSlice that routes the status Service `service` to this replica."""
    family = "IPv6" if ":" in pod_ip else "IPv4"
    return {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": service, "labels": {
            SERVICE_NAME_LABEL: service, MANAGED_BY_LABEL: "kubetrain-operator"}},
        "addressType": family,
        "endpoints": [{"addresses": [pod_ip], "conditions": {"ready": True}}],
        "ports": [{"name": ENDPOINT_PORT_NAME, "port": port, "protocol": "TCP"}],
    }


@dataclass
class StatusReporting:
    """One operator's status endpoint as the controller uses it."""

    reports: StatusReports
    endpoint: StatusEndpoint
    ca_pem: bytes
    url: str  # https://host:port, what pods dial

    def admit(self, job: TrainingJob) -> None:
        """Serve this job's reports (idempotent), from the step its status shows (an operator
        that restarts mid-job still tells a report that went back)."""
        meta = job.metadata
        self.reports.admit(meta.namespace or "default", meta.name, meta.uid or "",
                           job.status.progress.step if job.status is not None else None)

    def forget(self, namespace: str, name: str) -> None:
        """Stop serving a finished or deleted job and drop its report."""
        self.reports.forget(namespace, name)

    def secret(self, job: TrainingJob) -> dict[str, Any]:
        """The job's Secret `<job>-status`."""
        return job_secret(job, self.reports.key, self.ca_pem, self.url)

    def sample(self, namespace: str, name: str) -> MetricsSample | None:
        """The job's latest report as observed progress; None before its first report."""
        report = self.reports.latest(namespace, name)
        return reported_sample(report) if report is not None else None

    def stop(self) -> None:
        self.endpoint.stop()


def start_status_reporting(api: client.ApiClient, namespace: str, host: str,
                           port: int) -> StatusReporting:
    """Load (or create) the endpoint's keys in `namespace`, issue the serving certificate
    for `host` and start serving on `port` (0: any free port)."""
    authority, key = load_or_create_keys(client.CoreV1Api(api), namespace)
    dns_names, ip_addresses = serving_names(host)
    serving = authority.issue(dns_names, ip_addresses)
    reports = StatusReports(key)
    endpoint = StatusEndpoint(reports, serving.server_context(), port=port)
    endpoint.start()
    url = base_url(host, endpoint.port)
    log.info("status endpoint serving own-code jobs' reports at %s", url)
    return StatusReporting(reports, endpoint, authority.cert_pem, url)


def advertise(api: client.ApiClient, namespace: str, service: str, pod_ip: str,
              port: int) -> None:
    """Point the status Service at this replica: create the Service when missing, replace
    its EndpointSlice, or create it."""
    service_body: Any = status_service(service, port)
    try:
        client.CoreV1Api(api).create_namespaced_service(namespace, service_body)
    except ApiException as error:
        if error.status != 409:
            raise
    discovery = client.DiscoveryV1Api(api)
    manifest: Any = endpoint_slice(service, pod_ip, port)
    try:
        discovery.patch_namespaced_endpoint_slice(service, namespace, manifest)
    except ApiException as error:
        if error.status != 404:
            raise
        discovery.create_namespaced_endpoint_slice(namespace, manifest)
