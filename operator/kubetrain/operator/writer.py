"""The operator's writes to the Kubernetes API: creates, patches and deletes whose answers it drops.

The generated client's methods (`CoreV1Api.create_namespaced_pod` ...) check their
arguments with pydantic and turn a dict body into the client's model classes and
back before the request, and decode the answer into them after it: more CPU than
the request itself, and the operator's CPU is what limits how fast it starts many
jobs. `ApiWriter` sends the same requests (URL, content type, authentication,
connection pool and user agent of the same `ApiClient`) with the body as it is,
and reads no answer. Errors still raise `ApiException` with the answer's status.

Reads are not here: the operator observes through kopf's watches and indexes.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from kubetrain.api.trainingjob import GROUP, PLURAL, VERSION

# Built-in kinds take strategic merge patches; custom resources only JSON merge patches.
_STRATEGIC_MERGE = "application/strategic-merge-patch+json"
_MERGE = "application/merge-patch+json"
_JSON = "application/json"

# The collection of each kind of child, under /api/v1/namespaces/<namespace>/.
_COLLECTIONS = {"Pod": "pods", "Service": "services", "ConfigMap": "configmaps",
                "Event": "events"}


def _core(namespace: str, plural: str, name: str = "") -> str:
    path = f"/api/v1/namespaces/{quote(namespace, safe='')}/{plural}"
    return f"{path}/{quote(name, safe='')}" if name else path


def _job(namespace: str, name: str) -> str:
    return (f"/apis/{GROUP}/{VERSION}/namespaces/{quote(namespace, safe='')}/{PLURAL}/"
            f"{quote(name, safe='')}")


class ApiWriter:
    """The writes one operator makes, over one `ApiClient`."""

    def __init__(self, api: client.ApiClient) -> None:
        self.api = api

    def create(self, namespace: str, manifest: dict[str, Any]) -> None:
        """POST a Pod, Service, ConfigMap or Event into its namespace."""
        self._send("POST", _core(namespace, _COLLECTIONS[manifest["kind"]]), manifest)

    def patch_config_map(self, namespace: str, name: str, patch: dict[str, Any]) -> None:
        self._send("PATCH", _core(namespace, "configmaps", name), patch, _STRATEGIC_MERGE)

    def delete_pod(self, namespace: str, name: str, grace_period_seconds: int | None) -> None:
        query = [] if grace_period_seconds is None else [
            ("gracePeriodSeconds", grace_period_seconds)]
        self._send("DELETE", _core(namespace, "pods", name), query=query)

    def patch_job_status(self, namespace: str, name: str, patch: dict[str, Any]) -> None:
        """JSON merge patch of a TrainingJob's status subresource."""
        self._send("PATCH", _job(namespace, name) + "/status", {"status": patch}, _MERGE)

    def delete_job(self, namespace: str, name: str) -> None:
        """Delete a TrainingJob; the garbage collector removes its children after it."""
        self._send("DELETE", _job(namespace, name), query=[("propagationPolicy", "Background")])

    def _send(self, method: str, path: str, body: dict[str, Any] | None = None,
              content_type: str = _JSON, query: list[tuple[str, Any]] | None = None) -> None:
        # param_serialize adds the host, the query, the default headers (User-Agent) and
        # the credentials, exactly as the generated methods have it do.
        method, url, headers, payload, _ = self.api.param_serialize(
            method, path, query_params=query or None,
            header_params={"Content-Type": content_type, "Accept": _JSON},
            body=body, auth_settings=["BearerToken"])
        response = self.api.call_api(method, url, header_params=headers, body=payload)
        if not 200 <= response.status <= 299:
            response.read()
            raise ApiException.from_response(http_resp=response, body=None, data=None)
        response.response.drain_conn()
        response.response.release_conn()
