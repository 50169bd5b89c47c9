"""Pods' logs as the emulator serves them from a kubelet (pod_logs.py, emulator.py), over HTTP.

Read with the Kubernetes client as kubectl reads them, without root or containers: the
test writes the container's output file as a runtime would, and registers the log as
the node agent does (`EmulatedCluster.emulator.kubelets`).
"""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from emulator import EmulatedCluster
from kubernetes import client
from pod_logs import ContainerLog, LogQuery, LogQueryError, format_time, parse_time, select


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[EmulatedCluster]:
    with EmulatedCluster(tmp_path) as running:
        yield running


class Node:
    """A stand-in for the node agent's side: one output file and log per pod incarnation."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.logs: dict[str, ContainerLog] = {}

    def start(self, pod: Any) -> Path:
        output = self.folder / pod.metadata.uid
        output.write_text("")
        self.logs[pod.metadata.uid] = ContainerLog(output)
        return output

    def __call__(self, namespace: str, name: str, uid: str) -> ContainerLog | None:
        return self.logs.get(uid)


def _pod(core: client.CoreV1Api, name: str = "worker-0") -> Any:
    return core.create_namespaced_pod("default", {"metadata": {"name": name}, "spec": {
        "restartPolicy": "Never", "containers": [{"name": "trainer", "image": "trainer:1"}]}})


def test_a_log_reads_back_what_the_container_wrote_with_the_apis_options(
        cluster: EmulatedCluster, tmp_path: Path) -> None:
    core = client.CoreV1Api(cluster.api_client())
    node = Node(tmp_path)
    cluster.emulator.kubelets.append(node)
    pod = _pod(core)
    with pytest.raises(client.ApiException) as waiting:
        core.read_namespaced_pod_log("worker-0", "default")
    assert waiting.value.status == 400 and "is waiting to start" in str(waiting.value.body)

    output = node.start(pod)
    output.write_text("step 1\nstep 2\n")
    node.logs[pod.metadata.uid].collect()
    time.sleep(0.05)
    with output.open("a") as file:
        file.write("step 3\nhalf a line")
    assert core.read_namespaced_pod_log("worker-0", "default") == "step 1\nstep 2\nstep 3\n"
    assert core.read_namespaced_pod_log("worker-0", "default", tail_lines=1) == "step 3\n"
    stamped = core.read_namespaced_pod_log("worker-0", "default", timestamps=True).splitlines()
    stamps = [parse_time(line.split(" ", 1)[0]) for line in stamped]
    assert [line.split(" ", 1)[1] for line in stamped] == ["step 1", "step 2", "step 3"]
    assert stamps == sorted(stamps) and len(set(stamps)) == 3
    # Since the third line's time: the lines read after the sleep only.
    # (sinceTime is the API's; the Python client has no argument for it.)
    url = (f"http://127.0.0.1:{cluster.server.port}/api/v1/namespaces/default/pods/worker-0/"
           f"log?sinceTime={format_time(stamps[2])}")
    with urllib.request.urlopen(url) as answer:
        assert answer.read() == b"step 3\n"

    with pytest.raises(client.ApiException) as other:
        core.read_namespaced_pod_log("worker-0", "default", container="sidecar")
    assert other.value.status == 400 and "not valid for pod worker-0" in str(other.value.body)
    with pytest.raises(client.ApiException) as previous:
        core.read_namespaced_pod_log("worker-0", "default", previous=True)
    assert previous.value.status == 400
    with pytest.raises(client.ApiException) as missing:
        core.read_namespaced_pod_log("worker-9", "default")
    assert missing.value.status == 404


def test_follow_carries_new_lines_until_the_container_ends(cluster: EmulatedCluster,
                                                           tmp_path: Path) -> None:
    core = client.CoreV1Api(cluster.api_client())
    node = Node(tmp_path)
    cluster.emulator.kubelets.append(node)
    pod = _pod(core)
    output = node.start(pod)
    output.write_text("before\n")
    received: list[tuple[float, str]] = []
    response = core.read_namespaced_pod_log("worker-0", "default", follow=True,
                                            _preload_content=False)

    def read() -> None:
        for chunk in response.stream(64):
            received.append((time.monotonic(), chunk.decode()))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    time.sleep(0.5)
    with output.open("a") as file:
        file.write("during\nthe last, unfinished")
    written = time.monotonic()
    time.sleep(0.5)
    assert reader.is_alive(), "the answer ended while the container still runs"
    node.logs[pod.metadata.uid].finish()
    reader.join(timeout=5)
    assert not reader.is_alive(), "the answer did not end with the container"
    assert "".join(text for _, text in received) == "before\nduring\nthe last, unfinished\n"
    during = next(at for at, text in received if "during" in text)
    assert during - written < 0.45, "a new line came no sooner than the container's end"


def test_follow_ends_when_the_pod_is_deleted(cluster: EmulatedCluster, tmp_path: Path) -> None:
    core = client.CoreV1Api(cluster.api_client())
    node = Node(tmp_path)
    cluster.emulator.kubelets.append(node)
    node.start(_pod(core)).write_text("only\n")
    response = core.read_namespaced_pod_log("worker-0", "default", follow=True,
                                            _preload_content=False)
    threading.Timer(0.3, lambda: core.delete_namespaced_pod("worker-0", "default")).start()
    started = time.monotonic()
    assert b"".join(response.stream(64)) == b"only\n"
    assert time.monotonic() - started < 5


@pytest.mark.parametrize(("params", "problem"), [
    ({"sinceSeconds": "0"}, "sinceSeconds: Invalid value: 0"),
    ({"sinceSeconds": "1", "sinceTime": "2024-01-01T00:00:00Z"}, "at most one of"),
    ({"sinceTime": "yesterday"}, "not an RFC 3339 time"),
    ({"tailLines": "-1"}, "tailLines: Invalid value: -1"),
    ({"limitBytes": "x"}, "not an integer"),
])
def test_options_the_api_server_refuses(params: dict[str, str], problem: str) -> None:
    with pytest.raises(LogQueryError, match=problem):
        LogQuery.parse(params)


def test_select_takes_since_then_the_tail() -> None:
    lines = [(10, "a"), (20, "b"), (30, "c"), (40, "d")]
    assert select(lines, LogQuery(since_ns=20, tail_lines=2)) == [(30, "c"), (40, "d")]
    assert select(lines, LogQuery(since_ns=35)) == [(40, "d")]
    assert select(lines, LogQuery(tail_lines=0)) == []
    assert parse_time(format_time(1_700_000_000_123_456_789)) == 1_700_000_000_123_456_789
    assert parse_time("2024-01-01T01:00:00.5+01:00") == parse_time("2024-01-01T00:00:00.5Z")
