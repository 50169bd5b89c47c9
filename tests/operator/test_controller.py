"""The controller's runtime pieces (kubetrain.operator.handlers and the modules it uses to
apply actions and track expectations), driven from several threads as kopf's executor does,
against kmock's emulator over HTTP."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import replace
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest
from kubernetes import client

sys.path.insert(0, str(Path(__file__).parent))
from harness import NAMESPACE, EmulatedCluster, Kube, job_manifest

from kubetrain.api.manifest import parse_job
from kubetrain.api.trainingjob import TrainingJob
from kubetrain.operator import children
from kubetrain.operator.actions import CreateObject, RecordEvent, WriteStatus
from kubetrain.operator.applier import ActionApplier
from kubetrain.operator.config import OperatorConfig
from kubetrain.operator.expectations import (
    EXPECTATION_TIMEOUT_SECONDS,
    Expectations,
    config_map_version,
    held_version,
)
from kubetrain.operator.facts import worker_pod
from kubetrain.operator.handlers import TrainingJobController
from kubetrain.operator.metrics import OperatorMetrics
from kubetrain.operator.writer import ApiWriter


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[EmulatedCluster]:
    with EmulatedCluster(tmp_path) as running:
        yield running


def test_jobs_by_phase_are_counted_while_other_threads_write_statuses_and_delete_jobs(
        cluster: EmulatedCluster) -> None:
    """Executor threads write statuses and see jobs deleted at once; counting the phases
    never reads the controller's table of phases while another thread changes it.

    The gauge's reader iterates the table it is given in Python, yielding between entries,
    as any reader may: were it given the live table, another thread adding or dropping a
    job meanwhile would raise "dictionary changed size during iteration".
    """
    controller = TrainingJobController(OperatorConfig(standalone=True), cluster.api_client())
    count = controller.metrics.count_phases

    def count_yielding(phases: Mapping[str, str]) -> None:
        for _ in phases.items():
            time.sleep(0)
        count(dict(phases))

    controller.metrics.count_phases = count_yielding  # type: ignore[method-assign]
    kube, threads, jobs_per_thread = Kube(cluster), 4, 12
    bodies = {}
    for index in range(threads * jobs_per_thread):
        kube.create_job(job_manifest(f"phases-{index}"))
        bodies[index] = {"metadata": {**(kube.job(f"phases-{index}") or {})["metadata"]}}
    errors: list[BaseException] = []

    def write_and_delete(first: int) -> None:
        try:
            for index in range(first, first + jobs_per_thread):
                body = bodies[index]
                status = {"phase": "Running"}
                controller.applier.apply(body, Expectations(), [WriteStatus(status, status)])
                meta = body["metadata"]
                asyncio.run(controller.on_job_event(
                    type="DELETED", uid=meta["uid"], namespace=NAMESPACE, name=meta["name"],
                    body=body))
        except BaseException as error:  # reported below, with the other threads'
            errors.append(error)

    workers = [threading.Thread(target=write_and_delete, args=(start * jobs_per_thread,))
               for start in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=60)
    assert not errors, errors
    # Every job was written Running and then deleted: none is counted any more.
    registry = controller.metrics.registry
    assert registry.get_sample_value("kubetrain_operator_jobs", {"phase": "Running"}) == 0


class _Clock:
    """Monotonic seconds that a test moves on."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _job(name: str, generation: int) -> TrainingJob:
    manifest = job_manifest(name)
    manifest["metadata"].update(uid=f"{name}-uid", generation=generation)
    return parse_job(manifest)


def test_the_config_map_index_and_the_version_written_agree_only_on_the_same_build() -> None:
    """The ConfigMap index's version of a built ConfigMap is the one the controller
    remembers writing, so a write is held only until the index shows that very build."""
    written = children.config_map(_job("cm", generation=3))
    labels, annotations = written["metadata"]["labels"], written["metadata"]["annotations"]
    indexed = asyncio.run(TrainingJobController.index_config_map(
        namespace=NAMESPACE, labels=labels, annotations=annotations))
    version = indexed[(NAMESPACE, "cm")]
    assert version == held_version(written) == (3, _job("cm", 3).micro_batch_size)
    older = children.config_map(_job("cm", generation=2))
    stale = config_map_version(older["metadata"]["annotations"])
    assert stale != version

    clock = _Clock()
    expected = Expectations(clock=clock)
    expected.wrote_child(written)
    expected.wrote_child(children.service(_job("cm", 3)))
    # The index still shows the older build and no Service: the writes are what is held.
    assert expected.held(service=False, config_map=stale) == (True, version)
    assert expected.held(service=True, config_map=version) == (True, version)
    assert not expected.children
    expected.wrote_child(written)
    clock.now += EXPECTATION_TIMEOUT_SECONDS
    assert expected.held(service=False, config_map=stale) == (False, stale)


def test_a_created_pod_is_seen_until_the_index_shows_it_or_the_wait_times_out() -> None:
    clock, now = _Clock(), datetime(2026, 1, 1, tzinfo=UTC)
    expected = Expectations(clock=clock)
    pod = worker_pod(children.worker_pod(_job("pods", 1), 0, 0))
    expected.created_pod(pod)
    assert expected.pods({}, now) == (replace(pod, created_at=now),)
    assert expected.is_created_echo(pod.name, {"status": {"phase": "Pending"}})
    assert not expected.is_created_echo(pod.name, {"status": {"phase": "Running"}})
    indexed = replace(pod, phase="Running")
    assert expected.pods({pod.name: indexed}, now) == (indexed,)
    assert not expected.created  # the index caught up: nothing is held any more
    expected.created_pod(pod)
    clock.now += EXPECTATION_TIMEOUT_SECONDS
    assert expected.pods({}, now) == () and not expected.created


def test_a_deleted_pod_shows_deleting_until_the_index_does_or_the_wait_times_out() -> None:
    clock, now = _Clock(), datetime(2026, 1, 1, tzinfo=UTC)
    expected = Expectations(clock=clock)
    pod = replace(worker_pod(children.worker_pod(_job("gone", 1), 1, 0)), phase="Running")
    expected.deleted_pod(pod.name)
    assert expected.pods({pod.name: pod}, now) == (replace(pod, deleting=True),)
    marked = replace(pod, deleting=True)
    assert expected.pods({pod.name: marked}, now) == (marked,) and not expected.deleted
    expected.deleted_pod(pod.name)
    clock.now += EXPECTATION_TIMEOUT_SECONDS
    assert expected.pods({pod.name: pod}, now) == (pod,) and not expected.deleted


class _Refusing(BaseHTTPRequestHandler):
    """An API server whose admission refuses every pod with `message` (403), and that
    keeps the events posted to it."""

    message = ""
    events: ClassVar[list[dict[str, Any]]] = []

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path.endswith("/events"):
            type(self).events.append(body)
            self._answer(201, body)
        else:
            self._answer(403, {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                               "reason": "Forbidden", "code": 403,
                               "message": type(self).message})

    def _answer(self, code: int, body: dict[str, Any]) -> None:
        payload = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args: object) -> None:
        pass


def test_a_refused_pod_is_reported_once_per_message_and_stops_the_pass() -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Refusing)
    # Polled every 50 ms, so the shutdown at the end waits that long, not 0.5 s.
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                     daemon=True).start()
    try:
        configuration = client.Configuration(host=f"http://127.0.0.1:{server.server_address[1]}")
        metrics = OperatorMetrics()
        applier = ActionApplier(ApiWriter(client.ApiClient(configuration)), metrics,
                                "kubetrain-operator", "replica-a")
        job = _job("refused", 1)
        body = {"apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob",
                "metadata": {"name": "refused", "namespace": NAMESPACE, "uid": "refused-uid"}}
        pod = children.worker_pod(job, 0, 0)
        after = RecordEvent("Normal", "Created", "never recorded: the pass stopped before it")
        expected = Expectations()
        for message in ("exceeded quota: compute", "exceeded quota: compute",
                        "serviceaccount \"trainer\" not found"):
            _Refusing.message = message
            applier.apply(body, expected, [CreateObject(pod), after])
        reported = [(event["reason"], event["message"]) for event in _Refusing.events]
        assert reported == [
            ("FailedCreate", "Pod refused-worker-0: exceeded quota: compute"),
            ("FailedCreate", "Pod refused-worker-0: serviceaccount \"trainer\" not found")]
        event = _Refusing.events[0]
        assert event["involvedObject"]["uid"] == "refused-uid"
        assert event["reportingInstance"] == "replica-a" and event["type"] == "Warning"
        assert metrics.registry.get_sample_value("kubetrain_operator_api_errors_total") == 3
        assert not expected.created  # nothing was created: nothing is expected to show
    finally:
        server.shutdown()


def test_jobs_without_a_uid_keep_what_the_operator_did_to_each_apart(
        cluster: EmulatedCluster) -> None:
    """A job whose body has no uid (an API that sets none) is remembered by its namespace
    and name: one job's pods, just created and not yet in the index, are never taken for
    another's, so each job gets every one of its workers."""
    from kubetrain.operator.handlers import Indexes

    controller = TrainingJobController(OperatorConfig(standalone=True), cluster.api_client())
    kube = Kube(cluster)
    jobs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for name in ("first", "second"):
        kube.create_job(job_manifest(name, replicas=2))
        body = kube.job(name)
        assert body is not None
        body["metadata"].pop("uid", None)
        jobs[(NAMESPACE, name)] = [body]
    indexes = Indexes(jobs=jobs, pods={}, services={}, config_maps={}, nodes={})  # type: ignore[arg-type]
    for key in jobs:
        controller.reconcile(key, indexes)
    for name in ("first", "second"):
        assert sorted(kube.pods(name)) == [f"{name}-worker-0", f"{name}-worker-1"], name
        assert kube.phase(name) == "Pending", name
