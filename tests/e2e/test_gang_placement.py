"""All-or-nothing placement, end to end: the operator (in a thread) on the emulated API with
the stand-in scheduler, kubelet and Kueue (tests/cluster), on a cluster that fits one job.

The stories: two jobs applied together run one after the other with gangs, and hold half
the cluster each for ever without them (the deadlock gangs prevent, reproduced so that the
first story would fail without gangs); a job with a Kueue queue waits suspended until Kueue
admits it, behind another; a job that requires one rack is placed within it, its workers
in the rack's host order; a job managed by another controller is left untouched. No
container runs: the test ends a job's training by setting its worker 0 Succeeded, as the
trainer's exit would.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kmock
import pytest
from controllers import Kubelet, Scheduler
from emulator import EmulatedCluster
from kueue_admission import KueueAdmission
from scheduling_apis import EVERY_PLACEMENT_API

from kubetrain.operator.handlers import USER_AGENT

pytestmark = pytest.mark.e2e

sys.path.insert(0, str(Path(__file__).parents[1] / "operator"))
import harness  # noqa: E402


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[EmulatedCluster]:
    """A fresh API serving every placement API, a stand-in kubelet and the operator."""
    with EmulatedCluster(tmp_path, placement=EVERY_PLACEMENT_API) as running, \
            Kubelet(api=running.api_client(), period=0.1), \
            harness.running_operator(running):
        yield running


def add_node(kube: harness.Kube, name: str, taint: dict[str, str] | None = None,
             **labels: str) -> None:
    """A Ready node with room for one worker pod."""
    kube.core.create_node({"metadata": {"name": name, "labels": {
        "kubernetes.io/hostname": name, **labels}},
        "spec": {"taints": [taint]} if taint else {}})
    kube.core.patch_node_status(name, {"status": {
        "allocatable": {"pods": "1"},
        "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady"}]}})


def job(name: str, replicas: int = 2, **scheduling: Any) -> dict[str, Any]:
    """A job that runs only with all its workers (minReplicas = replicas)."""
    manifest = harness.job_manifest(name, replicas=replicas)
    manifest["spec"]["workers"] = {"replicas": replicas, "minReplicas": replicas,
                                   "maxReplicas": replicas}
    if scheduling:
        manifest["spec"]["scheduling"] = scheduling
    return manifest


def nodes_of(kube: harness.Kube, name: str) -> dict[str, str | None]:
    """The job's worker pods (not finished) and the node each is bound to."""
    return {pod: body["spec"].get("nodeName") for pod, body in kube.pods(name).items()
            if body.get("status", {}).get("phase") not in ("Succeeded", "Failed")}


def finish(kube: harness.Kube, name: str) -> None:
    """Training ends: worker 0's trainer exits 0, and the job succeeds."""
    kube.set_pod_status(f"{name}-worker-0", "Succeeded", exit_code=0)
    harness.eventually(lambda: kube.phase(name) == "Succeeded", what=f"{name} Succeeded")


def time_of(kube: harness.Kube, name: str, field: str) -> str:
    return str((kube.job(name) or {})["status"][field])


def test_with_gangs_two_jobs_that_fit_one_at_a_time_run_one_after_the_other(
        cluster: EmulatedCluster) -> None:
    kube = harness.Kube(cluster)
    for name in ("node-a", "node-b"):
        add_node(kube, name)
    kube.create_job(job("first"))  # gang Auto: the cluster serves the Workload API
    kube.create_job(job("second"))
    harness.eventually(lambda: len(kube.pods("first")) == len(kube.pods("second")) == 2,
                       what="both jobs' workers")
    with Scheduler(api=cluster.api_client(), period=0.1):
        running = harness.eventually(
            lambda: next((name for name in ("first", "second")
                          if kube.phase(name) == "Running"), None), what="one job running")
        waiting = "second" if running == "first" else "first"
        assert set(nodes_of(kube, running).values()) == {"node-a", "node-b"}
        assert set(nodes_of(kube, waiting).values()) == {None}  # all or none: none
        finish(kube, running)
        harness.eventually(lambda: kube.phase(waiting) == "Running", timeout=30,
                           what=f"{waiting} placed once {running} is done")
        assert set(nodes_of(kube, waiting).values()) == {"node-a", "node-b"}
        finish(kube, waiting)
    assert time_of(kube, waiting, "startTime") >= time_of(kube, running, "completionTime")
    status = (kube.job(waiting) or {})["status"]["scheduling"]
    assert (status["gang"], status["minCount"]) == ("WorkloadAPI", 2)


def test_without_gangs_the_same_two_jobs_deadlock(cluster: EmulatedCluster) -> None:
    kube = harness.Kube(cluster)
    for name in ("node-a", "node-b"):
        add_node(kube, name)
    kube.create_job(job("left", gang="None"))
    kube.create_job(job("right", gang="None"))
    harness.eventually(lambda: len(kube.pods("left")) == len(kube.pods("right")) == 2,
                       what="both jobs' workers")
    with Scheduler(api=cluster.api_client(), period=0.1):
        harness.eventually(lambda: all(sum(1 for node in nodes_of(kube, name).values() if node)
                                       == 1 for name in ("left", "right")),
                           what="each job holding one of the two nodes")
        time.sleep(3.0)  # resyncs and scheduling rounds: nothing moves
        for name in ("left", "right"):
            assert set(nodes_of(kube, name).values()) in (
                {"node-a", None}, {"node-b", None}), nodes_of(kube, name)
            assert kube.phase(name) == "Pending"  # 1 of minReplicas 2 runs: no training
    message = next(condition["message"] for condition in
                   kube.pods("left")["left-worker-1"]["status"]["conditions"]
                   if condition["type"] == "PodScheduled")
    assert "Insufficient pods" in message


def test_a_kueue_job_waits_suspended_until_admitted_behind_another(
        cluster: EmulatedCluster) -> None:
    kube = harness.Kube(cluster)
    taint = {"key": "example.com/pool", "value": "a", "effect": "NoSchedule"}
    for name in ("node-a", "node-b"):
        add_node(kube, name, taint=taint, **{"example.com/pool": "a"})
    kube.custom.create_cluster_custom_object("kueue.x-k8s.io", "v1beta1", "resourceflavors", {
        "apiVersion": "kueue.x-k8s.io/v1beta1", "kind": "ResourceFlavor",
        "metadata": {"name": "pool-a"}, "spec": {
            "nodeLabels": {"example.com/pool": "a"}, "nodeTaints": [taint]}})
    with Scheduler(api=cluster.api_client(), period=0.1), \
            KueueAdmission(api=cluster.api_client(), period=0.1, flavor="pool-a",
                           quota={"pods": 2}):
        kube.create_job(job("early", queue="team-a"))
        harness.eventually(lambda: kube.phase("early") == "Running", what="early admitted")
        time.sleep(1.1)  # Kueue's queue is first in, first out, to the second
        kube.create_job(job("late", queue="team-a"))
        harness.eventually(lambda: kube.phase("late") == "Suspended", what="late queued")
        time.sleep(2.0)
        assert kube.phase("late") == "Suspended" and not kube.pods("late")
        queued = (kube.job("late") or {})["status"]["scheduling"]["kueue"]
        assert (queued["path"], queued["admitted"]) == ("Workload", False)
        # Kueue's flavor is honoured: the pods carry its node labels and its taint's toleration.
        for pod in kube.pods("early").values():
            assert pod["spec"]["nodeSelector"]["example.com/pool"] == "a"
            assert any(t.get("key") == "example.com/pool" for t in pod["spec"]["tolerations"])
        finish(kube, "early")  # its Workload is marked Finished: Kueue's quota is free
        harness.eventually(lambda: kube.phase("late") == "Running", timeout=30,
                           what="late admitted and running")
        finish(kube, "late")
    reasons = kube.event_reasons("late")
    assert reasons.index("Queued") < reasons.index("Admitted") < reasons.index("Running")


@pytest.mark.parametrize("queue", [None, "team-a"], ids=["gang-affinity", "kueue-topology"])
def test_a_job_requiring_one_rack_is_placed_within_it_in_host_order(
        cluster: EmulatedCluster, queue: str | None) -> None:
    kube = harness.Kube(cluster)
    for name, rack in (("node-a1", "rack-a"), ("node-a2", "rack-a"), ("node-b1", "rack-b"),
                       ("node-b2", "rack-b"), ("node-b3", "rack-b")):
        add_node(kube, name, **{"example.com/rack": rack})
    scheduling: dict[str, Any] = {"topology": {"level": "example.com/rack",
                                               "mode": "Required"}}
    if queue:
        scheduling["queue"] = queue
        kube.custom.create_cluster_custom_object(
            "kueue.x-k8s.io", "v1beta1", "resourceflavors", {
                "apiVersion": "kueue.x-k8s.io/v1beta1", "kind": "ResourceFlavor",
                "metadata": {"name": "default-flavor"}, "spec": {}})
    with Scheduler(api=cluster.api_client(), period=0.1), \
            KueueAdmission(api=cluster.api_client(), period=0.1, quota={"pods": 8},
                           levels=("example.com/rack", "kubernetes.io/hostname")):
        kube.create_job(job("racked", replicas=3, **scheduling))
        harness.eventually(lambda: kube.phase("racked") == "Running", timeout=30,
                           what="the job placed")
    placed = nodes_of(kube, "racked")
    assert set(placed.values()) == {"node-b1", "node-b2", "node-b3"}  # the rack it fits
    if queue:
        # Kueue's assignment told the operator the hosts before the pods: they go out in
        # torch's rank order (its agents sorted by host name), so rank follows the hosts.
        by_rank = sorted(placed, key=lambda pod: f"{pod}.racked.default.svc.cluster.local")
        assert [placed[pod] for pod in by_rank] == ["node-b1", "node-b2", "node-b3"]
        assert by_rank == [f"racked-worker-{index}" for index in range(3)]  # index too


def test_a_job_managed_by_another_controller_is_left_untouched(
        cluster: EmulatedCluster) -> None:
    kube = harness.Kube(cluster)
    add_node(kube, "node-a")
    manifest = job("mirrored", queue="team-a")
    manifest["spec"]["managedBy"] = "kueue.x-k8s.io/multikueue"
    kube.create_job(manifest)
    time.sleep(2.0)  # four resyncs of the operator
    assert "status" not in (kube.job("mirrored") or {})
    assert not kube.pods("mirrored") and kube.event_reasons("mirrored") == []
    assert not kube.custom.list_namespaced_custom_object(
        "kueue.x-k8s.io", "v1beta1", harness.NAMESPACE, "workloads")["items"]
    # The operator's writes: none is about the job (its watches saw it, nothing more).
    writes = [request for request in cluster.emulator.requests()
              if request.headers.get("User-Agent", "").startswith(USER_AGENT)
              and request.method != kmock.method.GET and "mirrored" in str(request.url)]
    assert writes == [], [f"{r.method} {r.url}" for r in writes]
