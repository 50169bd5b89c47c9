"""What the e2e tests rely on from tests/cluster: the emulator's API-server behaviour and the
stand-in scheduler and node lifecycle controller (each shown here, never the real ones)."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import kmock
import pytest
from controllers import UNREACHABLE_TAINT, NodeLifecycle, Scheduler
from emulator import EmulatedCluster, unreached_lookups
from kubernetes import client, watch

sys.path.insert(0, str(Path(__file__).parent))
from harness import eventually


@pytest.fixture
def core(tmp_path: Path) -> Iterator[client.CoreV1Api]:
    with EmulatedCluster(tmp_path) as cluster:
        yield client.CoreV1Api(cluster.api_client())


def _pod(name: str, node: str | None = None, labels: dict[str, str] | None = None) -> dict:
    spec: dict = {"containers": [{"name": "c", "image": "i"}]}
    if node:
        spec["nodeName"] = node
    return {"metadata": {"name": name, "labels": labels or {}}, "spec": spec}


def test_a_new_pod_is_pending_in_the_namespace_of_its_url(core: client.CoreV1Api) -> None:
    created = core.create_namespaced_pod("team", {**_pod("p"), "status": {"phase": "Running"}})
    assert created.metadata.namespace == "team" and created.status.phase == "Pending"


def test_a_bound_pod_is_deleted_gracefully_and_only_its_own_uid_removes_it(
        core: client.CoreV1Api) -> None:
    uid = core.create_namespaced_pod("ns", _pod("bound", node="n")).metadata.uid
    marked = core.delete_namespaced_pod("bound", "ns", grace_period_seconds=7)
    assert marked.metadata.deletion_grace_period_seconds == 7
    assert core.read_namespaced_pod("bound", "ns").metadata.deletion_timestamp is not None
    with pytest.raises(client.ApiException) as refused:
        core.delete_namespaced_pod("bound", "ns", body=client.V1DeleteOptions(
            grace_period_seconds=0, preconditions=client.V1Preconditions(uid="another")))
    assert refused.value.status == 409
    core.delete_namespaced_pod("bound", "ns", body=client.V1DeleteOptions(
        grace_period_seconds=0, preconditions=client.V1Preconditions(uid=uid)))
    assert not core.list_namespaced_pod("ns").items


def test_an_unbound_pod_goes_at_once(core: client.CoreV1Api) -> None:
    core.create_namespaced_pod("ns", _pod("unbound"))
    core.delete_namespaced_pod("unbound", "ns")
    assert not core.list_namespaced_pod("ns").items


def test_lists_select_by_equality_labels(core: client.CoreV1Api) -> None:
    for name, labels in (("a", {"job": "x", "index": "0"}), ("b", {"job": "x"}),
                         ("c", {"job": "y"})):
        core.create_namespaced_pod("ns", _pod(name, labels=labels))

    def names(selector: str) -> list[str]:
        listed = core.list_namespaced_pod("ns", label_selector=selector).items
        return sorted(pod.metadata.name for pod in listed)

    assert names("job=x") == ["a", "b"] and names("job!=x") == ["c"]
    assert names("job=x,index") == ["a"] and names("!index") == ["b", "c"]
    with pytest.raises(client.ApiException) as refused:
        names("job in (x, y)")
    assert refused.value.status == 400


def test_kmock_reads_objects_through_the_emulators_faster_lookups(tmp_path: Path) -> None:
    """Fetch, list and watch each reach the emulator's replacements of kmock's private
    lookups, counted on the running emulator as kmock calls them."""
    with EmulatedCluster(tmp_path) as cluster:
        emulator, calls = cluster.emulator, {"__get_objs": 0, "__check": 0}
        for name in calls:
            replaced = getattr(emulator, f"_KubernetesEmulator{name}")

            def counted(*args: Any, _name: str = name, _replaced: Any = replaced,
                        **kwargs: Any) -> Any:
                calls[_name] += 1
                return _replaced(*args, **kwargs)

            setattr(emulator, f"_KubernetesEmulator{name}", counted)
        core = client.CoreV1Api(cluster.api_client())
        core.create_namespaced_pod("ns", _pod("first"))
        core.read_namespaced_pod("first", "ns")
        core.list_namespaced_pod("ns")
        assert calls["__get_objs"] >= 3, calls
        before, seen, stream = 0, [], watch.Watch()
        # The watch's first event is the pod already there; the second comes off kmock's
        # event bus, which it filters with `__check` alone (a create calls no `__check`).
        for event in stream.stream(core.list_namespaced_pod, "ns", _request_timeout=10):
            seen.append(event["object"].metadata.name)
            if seen == ["first"]:
                before = calls["__check"]
                core.create_namespaced_pod("ns", _pod("second"))
            if "second" in seen:
                stream.stop()
        assert seen == ["first", "second"] and calls["__check"] > before, calls


def test_start_up_check_names_each_kmock_lookup_call_gone() -> None:
    """The installed kmock still makes every call the emulator's replacements rely on; a
    kmock whose list found objects under another name is refused, naming the call."""
    assert unreached_lookups(kmock.KubernetesEmulator) == []

    class KubernetesEmulator(kmock.KubernetesEmulator):  # kmock's name: its names mangle alike
        async def _serve_list(self, request: kmock.Request) -> Any:
            return self.__find_objs(request)

        def __find_objs(self, request: kmock.Request) -> list[Any]:
            return []

    assert unreached_lookups(KubernetesEmulator) == [
        "KubernetesEmulator._serve_list no longer calls __get_objs"]


def _node(core: client.CoreV1Api, name: str, renewed: datetime) -> None:
    core.create_node({"metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}}})
    core.patch_node_status(name, {"status": {"conditions": [
        {"type": "Ready", "status": "True", "reason": "KubeletReady"}]}})
    client.CoordinationV1Api(core.api_client).create_namespaced_lease("kube-node-lease", {
        "metadata": {"name": name},
        "spec": {"holderIdentity": name, "renewTime": renewed.strftime("%Y-%m-%dT%H:%M:%S.%fZ")}})


def test_the_stand_in_scheduler_spreads_pods_and_honours_selectors_and_taints(
        core: client.CoreV1Api) -> None:
    now = datetime.now(UTC)
    for name in ("node-a", "node-b", "node-c"):
        _node(core, name, now)
    core.patch_node("node-c", {"spec": {"taints": [{"key": "k", "effect": "NoSchedule"}]}})
    for index in range(4):
        core.create_namespaced_pod("ns", _pod(f"w{index}"))
    system = _pod("system")
    system["spec"].update(nodeSelector={"kubernetes.io/hostname": "node-c"},
                          tolerations=[{"key": "k", "operator": "Exists"}])
    core.create_namespaced_pod("ns", system)
    with Scheduler(api=core.api_client, period=0.05):
        bound = eventually(lambda: all(p.spec.node_name for p in
                                       core.list_namespaced_pod("ns").items)
                           and core.list_namespaced_pod("ns").items, what="every pod bound")
    nodes = {pod.metadata.name: pod.spec.node_name for pod in bound}
    assert nodes.pop("system") == "node-c"
    assert sorted(nodes.values()) == ["node-a", "node-a", "node-b", "node-b"]


def test_the_stand_in_scheduler_marks_a_pod_no_node_fits_unschedulable(
        core: client.CoreV1Api) -> None:
    # As kube-scheduler does: the operator's too-few-nodes rule reads this condition.
    now = datetime.now(UTC)
    for name in ("node-a", "node-b"):
        _node(core, name, now)
    core.patch_node("node-b", {"spec": {"taints": [{"key": "k", "effect": "NoSchedule"}]}})
    avoiding = _pod("avoiding")
    avoiding["spec"]["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuring"
                                                     "Execution": {"nodeSelectorTerms": [{
        "matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "NotIn",
                              "values": ["node-a"]}]}]}}}
    core.create_namespaced_pod("ns", avoiding)
    with Scheduler(api=core.api_client, period=0.05):
        condition = eventually(lambda: next(
            (c for c in (core.read_namespaced_pod("avoiding", "ns").status.conditions or [])
             if c.type == "PodScheduled"), None), what="the PodScheduled condition")
        first = condition.last_transition_time
        time.sleep(0.3)  # several rounds: written once
        again = next(c for c in core.read_namespaced_pod("avoiding", "ns").status.conditions
                     if c.type == "PodScheduled")
    assert (condition.status, condition.reason) == ("False", "Unschedulable")
    assert condition.message == ("0/2 nodes are available: 1 node(s) didn't match Pod's node "
                                 "affinity, 1 node(s) had untolerated taint."), condition.message
    assert again.last_transition_time == first
    assert core.read_namespaced_pod("avoiding", "ns").spec.node_name is None
    # Room on node-b again: bound there, and scheduled.
    core.patch_node("node-b", {"spec": {"taints": None}})
    with Scheduler(api=core.api_client, period=0.05):
        bound = eventually(lambda: (p := core.read_namespaced_pod("avoiding", "ns")).spec.node_name
                           and p, what="the pod bound")
    assert bound.spec.node_name == "node-b"
    assert [(c.type, c.status) for c in bound.status.conditions] == [("PodScheduled", "True")]


def test_the_stand_in_scheduler_places_nothing_on_a_cordoned_node(core: client.CoreV1Api) -> None:
    now = datetime.now(UTC)
    for name in ("node-a", "node-b"):
        _node(core, name, now)
        core.patch_node(name, {"spec": {"unschedulable": True}})  # kubectl cordon
    core.create_namespaced_pod("ns", _pod("waiting"))
    with Scheduler(api=core.api_client, period=0.05):
        condition = eventually(lambda: next(
            (c for c in (core.read_namespaced_pod("waiting", "ns").status.conditions or [])
             if c.type == "PodScheduled"), None), what="the PodScheduled condition")
    assert condition.message == "0/2 nodes are available: 2 node(s) were unschedulable."
    core.patch_node("node-b", {"spec": {"unschedulable": None}})  # kubectl uncordon
    with Scheduler(api=core.api_client, period=0.05):
        bound = eventually(lambda: core.read_namespaced_pod("waiting", "ns").spec.node_name,
                           what="the pod bound")
    assert bound == "node-b"


def test_the_stand_in_node_lifecycle_taints_a_silent_node_and_untaints_it_when_it_beats(
        core: client.CoreV1Api) -> None:
    now = datetime.now(UTC)
    _node(core, "alive", now)
    _node(core, "silent", now - timedelta(seconds=60))
    leases = client.CoordinationV1Api(core.api_client)

    def taints(name: str) -> list[str]:
        spec = core.read_node(name).spec
        return [taint.key for taint in (spec.taints or [])] if spec else []

    with NodeLifecycle(api=core.api_client, period=0.05, grace_seconds=5):
        eventually(lambda: taints("silent") == [UNREACHABLE_TAINT], what="the taint")
        ready = {c.type: c.status for c in core.read_node("silent").status.conditions}
        assert ready["Ready"] == "Unknown" and taints("alive") == []
        renewed = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        leases.patch_namespaced_lease("silent", "kube-node-lease",
                                      {"spec": {"renewTime": renewed}})
        eventually(lambda: taints("silent") == [], what="the taint to go")
