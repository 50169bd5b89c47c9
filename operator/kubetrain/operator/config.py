"""How one operator process runs: `OperatorConfig`, built by the command, read by the controller.

It has a module of its own so that the command (which builds it from the command line
and starts the controller) and the handlers (which read it) both import it, and neither
imports the other for it. It must stay free of kopf and the Kubernetes client.
"""

from __future__ import annotations

import socket
import uuid
from dataclasses import dataclass, field


def _identity() -> str:
    # The pod name (hostname) says who leads; the suffix keeps two processes on one host apart.
    return f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}"


@dataclass(frozen=True)
class OperatorConfig:
    """How one operator process runs."""

    namespaces: tuple[str, ...] = ()
    resync_seconds: float = 10.0
    scrape_timeout_seconds: float = 2.0
    standalone: bool = False
    identity: str = field(default_factory=_identity)
    lease_namespace: str = "default"
    lease_seconds: float = 15.0
    lease_retry_seconds: float = 2.0
    metrics_port: int = 9090
    health_port: int = 8080
    # The status endpoint for own-code jobs' reports (None: not served; 0: any free port),
    # the host their pods dial (default: <status_service>.<status_namespace>.svc), the
    # namespace of its key Secret, and the selector-less Service whose EndpointSlice the
    # acting replica points at its own pod IP (empty: none).
    status_port: int | None = None
    status_host: str = ""
    status_namespace: str = "default"
    status_service: str = ""
    pod_ip: str = ""

    def status_dial_host(self) -> str:
        """The host job pods reach the status endpoint at."""
        return self.status_host or f"{self.status_service}.{self.status_namespace}.svc"
