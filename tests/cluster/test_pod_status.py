"""The node agent's pod status writer (pod_status.py) against kmock's emulator over HTTP.

The statuses are read back from the API as a controller would read them, without root or
containers: the container's end is told to the writer as the pod loop tells it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from emulator import EmulatedCluster
from kubernetes import client
from pod_status import PodStatusWriter, termination_message

HOST_IP = "10.244.9.1"


@pytest.fixture
def core(tmp_path: Path) -> Iterator[client.CoreV1Api]:
    with EmulatedCluster(tmp_path) as cluster:
        yield client.CoreV1Api(cluster.api_client())


def bound_pod(core: client.CoreV1Api, policy: str = "File") -> Any:
    manifest: Any = {"metadata": {"name": "worker-0"}, "spec": {
        "nodeName": "node-a", "restartPolicy": "Never", "containers": [{
            "name": "trainer", "image": "trainer:1", "terminationMessagePolicy": policy}]}}
    return core.create_namespaced_pod("ns", manifest)


def read(core: client.CoreV1Api) -> Any:
    """The pod as the API has it now (typed loosely: every field of a read pod is set)."""
    return core.read_namespaced_pod("worker-0", "ns")


def test_a_pod_goes_from_creating_to_running_to_failed_with_its_reason_and_message(
        core: client.CoreV1Api, tmp_path: Path) -> None:
    writer = PodStatusWriter(core, HOST_IP)
    pod = bound_pod(core)

    writer.creating(pod, "10.244.9.5")
    creating = read(core)
    assert creating.status.phase == "Pending" and creating.status.pod_ip == "10.244.9.5"
    assert creating.status.container_statuses[0].state.waiting.reason == "ContainerCreating"
    started = creating.status.start_time
    assert started is not None and creating.status.host_ip == HOST_IP

    writer.running(creating, "10.244.9.5", "2026-01-02T03:04:05Z")
    running = read(core)
    conditions = {c.type: c.status for c in running.status.conditions}
    assert running.status.phase == "Running" and conditions["Ready"] == "True"
    assert running.status.container_statuses[0].ready
    assert running.status.start_time == started  # written with the first status only

    (tmp_path / "termination-log").write_text("CUDAOutOfMemory: tried to allocate 2 GiB")
    writer.terminated(running, ip="10.244.9.5", exit_code=137, oom_killed=True,
                      started_at="2026-01-02T03:04:05Z", finished_at="2026-01-02T03:05:00Z",
                      folder=tmp_path)
    failed = read(core)
    terminated = failed.status.container_statuses[0].state.terminated
    assert failed.status.phase == "Failed"
    assert (terminated.exit_code, terminated.reason) == (137, "OOMKilled")
    assert terminated.message == "CUDAOutOfMemory: tried to allocate 2 GiB"
    assert {c.type: c.status for c in failed.status.conditions}["Ready"] == "False"


def test_a_pod_that_cannot_start_waits_with_the_reason_and_a_finished_one_succeeds(
        core: client.CoreV1Api, tmp_path: Path) -> None:
    writer = PodStatusWriter(core, HOST_IP)
    pod = bound_pod(core)

    writer.waiting(pod, "CreateContainerConfigError", "secret ns/creds not found")
    waiting = read(core)
    state = waiting.status.container_statuses[0].state.waiting
    assert (state.reason, state.message) == ("CreateContainerConfigError",
                                             "secret ns/creds not found")
    assert waiting.status.phase == "Pending" and waiting.status.pod_ip is None

    writer.terminated(waiting, ip="10.244.9.6", exit_code=0, oom_killed=False,
                      started_at="2026-01-02T03:04:05Z", finished_at=None, folder=tmp_path)
    done = read(core).status
    terminated = done.container_statuses[0].state.terminated
    assert done.phase == "Succeeded" and terminated.reason == "Completed"
    assert terminated.message is None and terminated.finished_at is not None


def test_a_pod_already_deleted_is_no_error(core: client.CoreV1Api) -> None:
    pod = bound_pod(core)
    core.delete_namespaced_pod("worker-0", "ns", grace_period_seconds=0)
    PodStatusWriter(core, HOST_IP).running(pod, "10.244.9.5", "2026-01-02T03:04:05Z")


def test_the_message_falls_back_to_the_logs_last_lines_only_on_failure_when_asked(
        tmp_path: Path) -> None:
    (tmp_path / "log").write_text("".join(f"line {n}\n" for n in range(200)))

    fallback = termination_message(tmp_path, 1, "FallbackToLogsOnError")
    assert fallback.splitlines()[0] == "line 120" and fallback.endswith("line 199")
    assert termination_message(tmp_path, 0, "FallbackToLogsOnError") == ""
    assert termination_message(tmp_path, 1, "File") == ""

    (tmp_path / "termination-log").write_text("x" * 5000)
    assert termination_message(tmp_path, 1, "FallbackToLogsOnError") == "x" * 4096
