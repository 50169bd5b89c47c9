"""Two operator processes on the emulated API, as the chart runs them with replicas: 2.

Only the holder of the Lease acts; when it stops (SIGTERM) it hands the Lease back
and the standby takes over at once; when it is killed (SIGKILL) the standby takes
over once the Lease expires. Each step is checked by what each replica's own
metrics say it created.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from emulator import EmulatedCluster
from operator_process import OperatorProcess

pytestmark = pytest.mark.e2e

sys.path.insert(0, str(Path(__file__).parents[1] / "operator"))
import harness  # noqa: E402

CREATED = "kubetrain_operator_pods_created_total"



@pytest.fixture
def replicas(emulated_cluster: EmulatedCluster, tmp_path: Path,
             ) -> Iterator[list[OperatorProcess]]:
    processes = [OperatorProcess(emulated_cluster.kubeconfig, tmp_path / f"operator-{i}.log",
                                 resync_seconds=0.5, leader_election=True) for i in range(2)]
    for process in processes:
        process.start()
    try:
        yield processes
    finally:
        for process in processes:
            process.stop()


def _attempt(kube: harness.Kube, job: str, pod: str) -> str | None:
    labels = kube.pods(job).get(pod, {}).get("metadata", {}).get("labels", {})
    return labels.get("kubetrain.io/restart-attempt")


def test_only_the_leader_acts_and_a_standby_takes_over(
        emulated_cluster: EmulatedCluster, replicas: list[OperatorProcess]) -> None:
    kube = harness.Kube(emulated_cluster)
    leader = harness.eventually(lambda: next((p for p in replicas if p.leads()), None),
                                what="a leader", timeout=30)
    standby = next(p for p in replicas if p is not leader)
    kube.create_job(harness.job_manifest("ha-real", replicas=2, maxRestarts=10))
    harness.eventually(lambda: len(kube.pods("ha-real")) == 2, what="two workers")
    time.sleep(2.0)  # the standby resyncs several times meanwhile and must not act
    # The session's other jobs are the leader's too (it watches every namespace): at least
    # this job's two pods are its, and none is the standby's.
    assert leader.metric(CREATED) >= 2 and standby.metric(CREATED) == 0

    # A graceful stop hands the Lease back: the standby leads and replaces a failed pod.
    leader.stop()
    harness.eventually(standby.leads, what="the standby to lead after a handover")
    created_before = standby.metric(CREATED)
    # Killed from outside (137, Error): a counted restart. An OOMKilled one would now halve
    # the micro-batch instead, outside status.restarts.
    kube.set_pod_status("ha-real-worker-1", "Failed", exit_code=137, reason="Error")
    harness.eventually(lambda: _attempt(kube, "ha-real", "ha-real-worker-1") == "1",
                       what="the new leader to replace worker 1")
    assert standby.metric(CREATED) >= created_before + 1

    # kill -9 hands nothing back: the restarted replica waits for the Lease to expire.
    leader.start()
    time.sleep(1.0)
    assert not leader.leads()
    standby.kill()
    harness.eventually(leader.leads, what="the other replica to take the expired Lease",
                       timeout=45)
    kube.set_pod_status("ha-real-worker-1", "Failed", exit_code=137, reason="Error")
    harness.eventually(lambda: _attempt(kube, "ha-real", "ha-real-worker-1") == "2",
                       what="the new leader to replace worker 1 again")
    status = (kube.job("ha-real") or {})["status"]
    assert status["restarts"] == 2 and set(kube.pods("ha-real")) == {
        "ha-real-worker-0", "ha-real-worker-1"}
