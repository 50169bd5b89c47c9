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
