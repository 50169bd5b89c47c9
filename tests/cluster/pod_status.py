"""The node agent's pod status writer: the status the kubelet's status manager writes.

What it writes as the kubelet does, for a pod of one container and restartPolicy Never:
Pending with a waiting container (ContainerCreating, or the reason the pod cannot start:
CreateContainerConfigError, CreateContainerError) → Running with podIP, hostIP,
conditions and a running container state → Succeeded or Failed with the container's
exit code (128 + signal when killed), its reason (Completed, Error, OOMKilled), and as
its message the termination log's first 4 KiB, else with FallbackToLogsOnError on
failure the output's last lines. startTime is written once, with the first status.
A pod already gone from the API (404) is not an error: it had nothing left to report.

What it does not: decide when a pod changes state (the node agent's pod loop does), no
restartCount above 0, no readiness probes (a running container is ready), no init or
ephemeral container statuses, no lastState.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kubernetes import client
from kubernetes.client.rest import ApiException

log = logging.getLogger("node-agent")

TERMINATION_MESSAGE_BYTES = 4096  # the kubelet's limit on one container's message
FALLBACK_LOG_LINES, FALLBACK_LOG_BYTES = 80, 2048  # FallbackToLogsOnError's tail


def api_now() -> str:
    """Now, as the API's timestamps are written (RFC 3339, seconds, UTC)."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def termination_message(folder: Path, exit_code: int, policy: str | None) -> str:
    """A finished container's message: its termination log, or on failure with
    FallbackToLogsOnError the last lines of its output (`folder`/termination-log, /log)."""
    message = _head(folder / "termination-log", TERMINATION_MESSAGE_BYTES)
    if not message and exit_code != 0 and policy == "FallbackToLogsOnError":
        lines = _head(folder / "log", None).splitlines()[-FALLBACK_LOG_LINES:]
        message = "\n".join(lines)[-FALLBACK_LOG_BYTES:]
    return message


@dataclass
class PodStatusWriter:
    """Writes the status of the pods of a node whose address is `host_ip`."""

    core: client.CoreV1Api
    host_ip: str

    def waiting(self, pod: Any, reason: str, message: str) -> None:
        """The pod cannot start: Pending, its container waiting for `reason`."""
        log.warning("pod %s/%s: %s: %s", pod.metadata.namespace, pod.metadata.name, reason,
                    message)
        self._write(pod, phase="Pending", ip=None, ready=False, container_state={
            "waiting": {"reason": reason, "message": message}})

    def creating(self, pod: Any, ip: str) -> None:
        """The pod has its network (`ip`) and its container is being created."""
        self._write(pod, phase="Pending", ip=ip, ready=False, container_state={
            "waiting": {"reason": "ContainerCreating"}})

    def running(self, pod: Any, ip: str, started_at: str) -> None:
        """The pod's container runs since `started_at`, and is ready."""
        self._write(pod, phase="Running", ip=ip, ready=True, container_state={
            "running": {"startedAt": started_at}})

    def terminated(self, pod: Any, *, ip: str, exit_code: int, oom_killed: bool,
                   started_at: str, finished_at: str | None, folder: Path) -> None:
        """The pod's container ended with `exit_code`: Succeeded on 0, else Failed."""
        reason = "Completed" if exit_code == 0 else "OOMKilled" if oom_killed else "Error"
        terminated = {"exitCode": exit_code, "reason": reason, "startedAt": started_at,
                      "finishedAt": finished_at or api_now()}
        message = termination_message(folder, exit_code,
                                      pod.spec.containers[0].termination_message_policy)
        if message:
            terminated["message"] = message
        self._write(pod, phase="Succeeded" if exit_code == 0 else "Failed", ip=ip,
                    ready=False, container_state={"terminated": terminated})
        log.info("pod %s/%s exited %d", pod.metadata.namespace, pod.metadata.name, exit_code)

    def _write(self, pod: Any, *, phase: str, ip: str | None, ready: bool,
               container_state: Mapping[str, Any]) -> None:
        now = api_now()
        ready_text = "True" if ready else "False"
        conditions = [
            {"type": "PodReadyToStartContainers", "status": "True" if ip else "False"},
            {"type": "Initialized", "status": "True"},
            {"type": "Ready", "status": ready_text},
            {"type": "ContainersReady", "status": ready_text},
            {"type": "PodScheduled", "status": "True"},
        ]
        for condition in conditions:
            condition["lastTransitionTime"] = now
        container = pod.spec.containers[0]
        status: dict[str, Any] = {
            "phase": phase, "hostIP": self.host_ip,
            "hostIPs": [{"ip": self.host_ip}], "conditions": conditions,
            "containerStatuses": [{
                "name": container.name, "image": container.image or "",
                "imageID": "", "ready": ready, "restartCount": 0,
                "started": "running" in container_state, "state": dict(container_state)}],
        }
        if pod.status.start_time is None:
            status["startTime"] = now
        if ip:
            status["podIP"], status["podIPs"] = ip, [{"ip": ip}]
        try:
            self.core.patch_namespaced_pod_status(pod.metadata.name, pod.metadata.namespace,
                                                  {"status": status})
        except ApiException as error:
            if error.status != 404:
                raise


def _head(path: Path, limit: int | None) -> str:
    """The first `limit` bytes of a file as text ('' when it is missing)."""
    try:
        with path.open("rb") as file:
            return file.read(limit if limit is not None else -1).decode(errors="replace")
    except OSError:
        return ""
