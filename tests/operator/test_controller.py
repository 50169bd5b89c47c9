"""The controller's runtime pieces (kubetrain.operator.handlers and the modules it uses to
apply actions and track expectations), driven from several threads as kopf's executor does,
against kmock's emulator over HTTP."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from harness import NAMESPACE, EmulatedCluster, Kube, job_manifest

from kubetrain.operator.config import OperatorConfig
from kubetrain.operator.handlers import JobMemory, TrainingJobController
from kubetrain.operator.reconcile import WriteStatus


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
                controller.apply(body, JobMemory(), [WriteStatus(status, status)])
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
