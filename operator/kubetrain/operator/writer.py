"""The operator's writes to the Kubernetes API: creates, patches and deletes whose answers it drops.

The generated client's methods (`CoreV1Api.create_namespaced_pod` ...) check their
arguments with pydantic and turn a dict body into the client's model classes and
back before the request, and decode the answer into them after it: more CPU than
the request itself, and the operator's CPU is what limits how fast it starts many
jobs. `ApiWriter` sends the same requests (URL, content type, authentication,
connection pool and user agent of the same `ApiClient`) with the body as it is,
and reads no answer. Errors still raise `ApiException` with the answer's status.

Even the client's own request path costs more than the request: each one walks the
body to sanitise it (already plain JSON here), and asks the configuration for its
credentials, which makes a kubeconfig-loaded client reload the kubeconfig and scan
the whole environment for proxies, every time. So the credentials, host and default
headers are read once per `CREDENTIALS_SECONDS` (short beside any token's lifetime:
an exec plugin's or a projected ServiceAccount token's refresh is still followed)
and the body is encoded once, straight onto the client's connection pool.

Reads are not here: the operator observes through kopf's watches and indexes.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any
from urllib.parse import quote, urlencode

from kubernetes import client
from kubernetes.client import rest
from kubernetes.client.exceptions import ApiException

from kubetrain.api.trainingjob import GROUP, PLURAL, VERSION
from kubetrain.operator.gang import GANG_APIS
from kubetrain.operator.kueue import KUEUE_WORKLOAD

# Built-in kinds take strategic merge patches; custom resources only JSON merge patches.
_STRATEGIC_MERGE = "application/strategic-merge-patch+json"
_MERGE = "application/merge-patch+json"
_JSON = "application/json"
# How long the credentials, host and default headers read from the ApiClient are reused.
CREDENTIALS_SECONDS = 10.0

# The collection of each kind of child, under /api/v1/namespaces/<namespace>/.
_COLLECTIONS = {"Pod": "pods", "Service": "services", "ConfigMap": "configmaps",
                "Event": "events", "Secret": "secrets"}
# The collection of each placement kind, by (apiVersion, kind), under /apis/<apiVersion>/.
_PLACEMENT = {(api.api_version, api.kind): api.plural for api in (*GANG_APIS, KUEUE_WORKLOAD)}


def _core(namespace: str, plural: str, name: str = "") -> str:
    path = f"/api/v1/namespaces/{quote(namespace, safe='')}/{plural}"
    return f"{path}/{quote(name, safe='')}" if name else path


def _placement(namespace: str, api_version: str, kind: str, name: str = "") -> str:
    path = (f"/apis/{api_version}/namespaces/{quote(namespace, safe='')}/"
            f"{_PLACEMENT[api_version, kind]}")
    return f"{path}/{quote(name, safe='')}" if name else path


def _job(namespace: str, name: str) -> str:
    return (f"/apis/{GROUP}/{VERSION}/namespaces/{quote(namespace, safe='')}/{PLURAL}/"
            f"{quote(name, safe='')}")


class ApiWriter:
    """The writes one operator makes, over one `ApiClient`."""

    def __init__(self, api: client.ApiClient) -> None:
        self.api = api
        self._lock = threading.Lock()
        self._host = ""
        self._headers: dict[str, str] = {}
        self._read_at = -CREDENTIALS_SECONDS

    def create(self, namespace: str, manifest: dict[str, Any]) -> None:
        """POST a Pod, Service, ConfigMap, Event or Secret, or a placement object (a gang's
        Workload or PodGroup, a Kueue Workload), into its namespace."""
        if manifest["apiVersion"] == "v1":
            self._send("POST", _core(namespace, _COLLECTIONS[manifest["kind"]]), manifest)
        else:
            self._send("POST", _placement(namespace, manifest["apiVersion"],
                                          manifest["kind"]), manifest)

    def patch_object(self, namespace: str, api_version: str, kind: str, name: str,
                     patch: dict[str, Any], status: bool = False) -> None:
        """JSON merge patch of a placement object (custom resources take no strategic
        merge), or with `status` of its status subresource."""
        path = _placement(namespace, api_version, kind, name) + ("/status" if status else "")
        self._send("PATCH", path, patch, _MERGE)

    def delete_object(self, namespace: str, api_version: str, kind: str, name: str) -> None:
        """Delete a placement object (background propagation: it owns nothing)."""
        self._send("DELETE", _placement(namespace, api_version, kind, name))

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
        host, headers = self._credentials()
        url = host + path + (f"?{urlencode(query)}" if query else "")
        payload = None if body is None else json.dumps(body, separators=(",", ":")).encode()
        response = self.api.rest_client.pool_manager.request(
            method, url, body=payload, headers={**headers, "Content-Type": content_type},
            preload_content=False)
        if not 200 <= response.status <= 299:
            if response.status == 401:  # the token expired early: read it afresh next time
                with self._lock:
                    self._read_at = -CREDENTIALS_SECONDS
            answer = rest.RESTResponse(response)
            answer.read()  # the server's Status, for the error's body
            raise ApiException.from_response(http_resp=answer, body=None, data=None)
        response.drain_conn()
        response.release_conn()

    def _credentials(self) -> tuple[str, dict[str, str]]:
        """The API server's URL and the headers every request carries (Authorization,
        User-Agent), as the ApiClient gives them, re-read every CREDENTIALS_SECONDS."""
        with self._lock:
            if time.monotonic() - self._read_at >= CREDENTIALS_SECONDS:
                headers: dict[str, str] = {"Accept": _JSON, **self.api.default_headers}
                # The client's own step: fills in Authorization (refreshing the token).
                self.api.update_params_for_auth(headers, [], ["BearerToken"], "", "", None)
                self._host, self._headers = self.api.configuration.host, headers
                self._read_at = time.monotonic()
            return self._host, self._headers
