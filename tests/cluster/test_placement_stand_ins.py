"""What the placement tests rely on from tests/cluster: the placement APIs the emulator
serves (pinned schemas), the stand-in scheduler's gangs, resources, timeouts and topology,
and Kueue's stand-in admission (each shown here, never the real ones)."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from controllers import Scheduler
from emulator import EmulatedCluster
from kubernetes import client
from kueue_admission import KueueAdmission
from scheduling_apis import EVERY_PLACEMENT_API

from kubetrain.operator.handlers import discover_placement_apis

sys.path.insert(0, str(Path(__file__).parents[1] / "operator"))
from harness import eventually

NS = "ns"
VOLCANO = ("scheduling.volcano.sh", "v1beta1", "podgroups")
COSCHEDULING = ("scheduling.x-k8s.io", "v1alpha1", "podgroups")
WORKLOAD_API = ("scheduling.k8s.io", "v1alpha2", "podgroups")
KUEUE = ("kueue.x-k8s.io", "v1beta1", "workloads")


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[EmulatedCluster]:
    with EmulatedCluster(tmp_path, placement=EVERY_PLACEMENT_API) as running:
        yield running


@pytest.fixture
def core(cluster: EmulatedCluster) -> client.CoreV1Api:
    return client.CoreV1Api(cluster.api_client())


@pytest.fixture
def custom(cluster: EmulatedCluster) -> client.CustomObjectsApi:
    return client.CustomObjectsApi(cluster.api_client())


def node(core: client.CoreV1Api, name: str, pods: int = 1, **labels: str) -> None:
    core.create_node({"metadata": {"name": name, "labels": {
        "kubernetes.io/hostname": name, **labels}}})
    core.patch_node_status(name, {"status": {
        "allocatable": {"pods": str(pods)},
        "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady"}]}})


def pod(name: str, labels: dict[str, str] | None = None,
        annotations: dict[str, str] | None = None, **spec: Any) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": labels or {},
                         "annotations": annotations or {}},
            "spec": {"containers": [{"name": "c", "image": "i"}], **spec}}


def group(custom: client.CustomObjectsApi, kind: tuple[str, str, str], name: str,
          spec: dict[str, Any]) -> None:
    custom.create_namespaced_custom_object(*kind[:2], NS, kind[2], {
        "apiVersion": f"{kind[0]}/{kind[1]}", "kind": "PodGroup",
        "metadata": {"name": name}, "spec": spec})


def bound(core: client.CoreV1Api) -> dict[str, str | None]:
    return {p.metadata.name: p.spec.node_name for p in core.list_namespaced_pod(NS).items}


def scheduled_message(core: client.CoreV1Api, name: str) -> str:
    conditions = core.read_namespaced_pod(name, NS).status.conditions or []
    return next((c.message or "" for c in conditions if c.type == "PodScheduled"), "")


# --- the placement APIs --------------------------------------------------------------------


def test_the_operators_discovery_finds_every_placement_api_the_emulator_serves(
        cluster: EmulatedCluster) -> None:
    served = discover_placement_apis(cluster.api_client())
    assert served == {"WorkloadAPI", "Volcano", "Coscheduling", "Kueue"}
    assert {"scheduling.k8s.io/v1alpha2", "scheduling.volcano.sh/v1beta1",
            "scheduling.x-k8s.io/v1alpha1", "kueue.x-k8s.io/v1beta1"} == {
        f"{api.group}/{api.version}" for api in EVERY_PLACEMENT_API}
    for api in EVERY_PLACEMENT_API:
        assert api.source and any(char.isdigit() for char in api.source), api


def test_a_placement_object_its_schema_refuses_is_refused_naming_the_field(
        custom: client.CustomObjectsApi) -> None:
    with pytest.raises(client.ApiException) as refused:
        group(custom, VOLCANO, "bad", {"minMember": "two"})
    assert refused.value.status == 422 and "minMember" in str(refused.value.body)
    with pytest.raises(client.ApiException) as unknown:
        group(custom, COSCHEDULING, "typo", {"minMembers": 2})
    assert unknown.value.status == 422 and "minMembers" in str(unknown.value.body)
    group(custom, COSCHEDULING, "good", {"minMember": 2, "scheduleTimeoutSeconds": 5})


# --- gangs ---------------------------------------------------------------------------------------


def test_a_gang_is_bound_all_or_none_at_its_min_member(core: client.CoreV1Api,
                                                       custom: client.CustomObjectsApi) -> None:
    for name in ("node-a", "node-b"):
        node(core, name)
    group(custom, VOLCANO, "job", {"minMember": 3})
    for index in range(3):
        core.create_namespaced_pod(NS, pod(f"job-{index}", annotations={
            "scheduling.k8s.io/group-name": "job"}, schedulerName="volcano"))
    with Scheduler(api=core.api_client, period=0.05):
        eventually(lambda: "2 of minCount 3 fit" in scheduled_message(core, "job-0"),
                   what="the group to wait, saying why")
        assert set(bound(core).values()) == {None}
        node(core, "node-c")
        eventually(lambda: None not in bound(core).values(), what="the whole group bound")
    assert sorted(bound(core).values()) == ["node-a", "node-b", "node-c"]


def test_pods_wait_for_their_pod_group_and_for_min_count_of_them(
        core: client.CoreV1Api, custom: client.CustomObjectsApi) -> None:
    node(core, "node-a", pods=4)
    member = {"schedulingGroup": {"podGroupName": "late"}}
    core.create_namespaced_pod(NS, pod("late-0", **member))
    with Scheduler(api=core.api_client, period=0.05):
        eventually(lambda: "pod group late does not exist" in
                   scheduled_message(core, "late-0").lower(), what="waiting for its group")
        group(custom, WORKLOAD_API, "late", {"schedulingPolicy": {"gang": {"minCount": 2}}})
        eventually(lambda: "1 of minCount 2 pods exist" in scheduled_message(core, "late-0"),
                   what="waiting for the group's pods")
        core.create_namespaced_pod(NS, pod("late-1", **member))
        eventually(lambda: None not in bound(core).values(), what="both bound")


def test_a_partial_coscheduling_group_holds_its_nodes_until_its_timeout(
        core: client.CoreV1Api, custom: client.CustomObjectsApi) -> None:
    for name in ("node-a", "node-b"):
        node(core, name)
    group(custom, COSCHEDULING, "big", {"minMember": 3, "scheduleTimeoutSeconds": 2})
    for index in range(3):
        core.create_namespaced_pod(NS, pod(f"big-{index}", labels={
            "scheduling.x-k8s.io/pod-group": "big"}))
    time.sleep(1.1)  # the next pod is created a second later: it queues behind the group
    core.create_namespaced_pod(NS, pod("small"))
    with Scheduler(api=core.api_client, period=0.05):
        eventually(lambda: "waiting for the rest" in scheduled_message(core, "big-2").lower(),
                   what="the group holding two nodes")
        assert "Insufficient pods" in scheduled_message(core, "small")
        started = time.monotonic()
        eventually(lambda: bound(core)["small"], timeout=10, what="the timeout to free a node")
    assert time.monotonic() - started > 0.5
    assert "gave up after waiting 2s" in scheduled_message(core, "big-0")
    assert [bound(core)[f"big-{index}"] for index in range(3)] == [None, None, None]


def test_without_gangs_two_jobs_started_together_each_hold_part_of_the_cluster(
        core: client.CoreV1Api) -> None:
    for name in ("node-a", "node-b"):
        node(core, name)
    for job in ("a", "b"):
        for index in range(2):
            core.create_namespaced_pod(NS, pod(f"{job}-worker-{index}", labels={
                "kubetrain.io/worker-index": str(index)}))
    with Scheduler(api=core.api_client, period=0.05):
        eventually(lambda: sum(1 for n in bound(core).values() if n) == 2
                   and "Insufficient pods" in scheduled_message(core, "b-worker-1"),
                   what="the cluster full")
    placed = bound(core)
    assert placed["a-worker-0"] and placed["b-worker-0"]
    assert placed["a-worker-1"] is None and placed["b-worker-1"] is None


def test_a_group_requiring_one_domain_goes_where_it_fits_whole(
        core: client.CoreV1Api, custom: client.CustomObjectsApi) -> None:
    node(core, "node-1", rack="rack-a")
    node(core, "node-2", rack="rack-b")
    node(core, "node-3", rack="rack-b")
    group(custom, WORKLOAD_API, "pair", {"schedulingPolicy": {"gang": {"minCount": 2}}})
    affinity = {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [{
        "labelSelector": {"matchLabels": {"job": "pair"}}, "topologyKey": "rack"}]}}
    for index in range(2):
        core.create_namespaced_pod(NS, pod(f"pair-{index}", labels={"job": "pair"},
                                           affinity=affinity,
                                           schedulingGroup={"podGroupName": "pair"}))
    with Scheduler(api=core.api_client, period=0.05):
        eventually(lambda: None not in bound(core).values(), what="the pair bound")
    assert sorted(bound(core).values()) == ["node-2", "node-3"]


# --- Kueue ---------------------------------------------------------------------------------------


def workload(custom: client.CustomObjectsApi, name: str, count: int, min_count: int | None = None,
             topology: dict[str, str] | None = None) -> None:
    pod_set: dict[str, Any] = {"name": "workers", "count": count, "template": {"spec": {
        "containers": [{"name": "c", "image": "i"}]}}}
    if min_count is not None:
        pod_set["minCount"] = min_count
    if topology is not None:
        pod_set["topologyRequest"] = topology
    custom.create_namespaced_custom_object(*KUEUE[:2], NS, KUEUE[2], {
        "apiVersion": "kueue.x-k8s.io/v1beta1", "kind": "Workload",
        "metadata": {"name": name}, "spec": {"queueName": "team", "podSets": [pod_set]}})


def admission(custom: client.CustomObjectsApi, name: str) -> dict[str, Any] | None:
    body = custom.get_namespaced_custom_object(*KUEUE[:2], NS, KUEUE[2], name)
    return (body.get("status") or {}).get("admission")


def test_kueue_admits_within_quota_partially_and_in_order(
        core: client.CoreV1Api, custom: client.CustomObjectsApi) -> None:
    workload(custom, "first", 3)
    time.sleep(1.1)  # creation order, to the second
    workload(custom, "second", 4, min_count=2)
    with KueueAdmission(api=core.api_client, period=0.05, quota={"pods": 4}):
        eventually(lambda: admission(custom, "first"), what="the first admitted")
        time.sleep(0.3)
        assert admission(custom, "second") is None  # 4 asked, 1 left, minCount 2
        body = custom.get_namespaced_custom_object(*KUEUE[:2], NS, KUEUE[2], "first")
        conditions = [{**c, "lastTransitionTime": c["lastTransitionTime"]}
                      for c in body["status"]["conditions"]]
        conditions.append({"type": "Finished", "status": "True", "reason": "Succeeded",
                           "message": "done", "lastTransitionTime": "2026-01-01T00:00:00Z"})
        custom.patch_namespaced_custom_object_status(*KUEUE[:2], NS, KUEUE[2], "first",
                                                     {"status": {"conditions": conditions}})
        admitted = eventually(lambda: admission(custom, "second"), what="the second admitted")
    assignment = admitted["podSetAssignments"][0]
    assert (assignment["count"], assignment["flavors"]) == (4, {"pods": "default-flavor"})


def test_kueue_assigns_a_required_topology_within_one_domain(
        core: client.CoreV1Api, custom: client.CustomObjectsApi) -> None:
    node(core, "node-1", pods=1, rack="rack-a")
    node(core, "node-2", pods=2, rack="rack-b")
    node(core, "node-3", pods=1, rack="rack-b")
    workload(custom, "racked", 3, topology={"required": "rack"})
    with KueueAdmission(api=core.api_client, period=0.05, quota={"pods": 8},
                        levels=("rack", "kubernetes.io/hostname")):
        admitted = eventually(lambda: admission(custom, "racked"), what="admitted")
    topology = admitted["podSetAssignments"][0]["topologyAssignment"]
    assert topology == {"levels": ["rack", "kubernetes.io/hostname"], "domains": [
        {"values": ["rack-b", "node-2"], "count": 2},
        {"values": ["rack-b", "node-3"], "count": 1}]}
