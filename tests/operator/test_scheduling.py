"""Gang placement, Kueue and topology: the builders of each mechanism's objects and the
reconcile passes that make, resize, renew and release them (table-driven, pure)."""

from __future__ import annotations

import copy
from datetime import UTC, datetime, timedelta
from typing import Any

import kubernetes_validate
import pytest

from kubetrain.api.manifest import parse_job
from kubetrain.api.trainingjob import TrainingJob
from kubetrain.operator import gang, kueue
from kubetrain.operator.actions import (
    CreateObject,
    DeleteObject,
    DeletePod,
    PatchObject,
    RecordEvent,
    WriteStatus,
)
from kubetrain.operator.facts import Observed, WorkerPod
from kubetrain.operator.reconcile import reconcile
from kubetrain.operator.scheduling_facts import GroupObject, group_object

NOW = datetime(2025, 1, 1, 12, 0, 0, tzinfo=UTC)
EARLIER = NOW - timedelta(hours=1)
EVERYTHING = frozenset({"WorkloadAPI", "Volcano", "Coscheduling", "Kueue"})


def make_job(minimal_manifest: dict[str, Any], scheduling: dict[str, Any] | None = None,
             replicas: int = 2, min_replicas: int | None = None, status: dict | None = None,
             labels: dict[str, str] | None = None, template: dict[str, Any] | None = None,
             resources: dict[str, Any] | None = None, **spec: Any) -> TrainingJob:
    manifest = copy.deepcopy(minimal_manifest)
    manifest["metadata"].update(namespace="ml", uid="uid-1", generation=1,
                                labels=labels or {})
    workers: dict[str, Any] = {"replicas": replicas, "maxReplicas": max(8, replicas)}
    if min_replicas is not None:
        workers["minReplicas"] = min_replicas
    if template is not None:
        workers["template"] = template
    if resources is not None:
        workers["resources"] = resources
    manifest["spec"]["workers"] = workers
    manifest["spec"]["runPolicy"] = {"backoffSeconds": 0}
    if scheduling is not None:
        manifest["spec"]["scheduling"] = scheduling
    manifest["spec"].update(spec)
    if status is not None:
        manifest["status"] = status
    return parse_job(manifest)


def pod(index: int, phase: str = "Running", attempt: int = 0, **facts: Any) -> WorkerPod:
    facts.setdefault("created_at", EARLIER)
    return WorkerPod(name=f"demo-worker-{index}", index=index, restart_attempt=attempt,
                     phase=phase, ready=phase == "Running", **facts)


def run(job: TrainingJob, *pods: WorkerPod, groups: tuple[GroupObject, ...] = (),
        served: frozenset[str] = EVERYTHING,
        flavors: dict[str, kueue.Flavor] | None = None) -> list[Any]:
    observed = Observed(pods=pods, service=True, config_generation=1, groups=groups,
                        served=served, flavors=flavors or {})
    return reconcile(job, observed, NOW)


def status_of(actions: list[Any]) -> dict[str, Any]:
    return next(action.status for action in actions if isinstance(action, WriteStatus))


def created(actions: list[Any]) -> list[dict[str, Any]]:
    return [action.manifest for action in actions if isinstance(action, CreateObject)]


def kinds(actions: list[Any]) -> list[tuple[str, str]]:
    return [(m["kind"], m["metadata"]["name"]) for m in created(actions)]


def events(actions: list[Any]) -> dict[str, str]:
    return {action.reason: action.message for action in actions
            if isinstance(action, RecordEvent)}


def held(actions: list[Any]) -> tuple[GroupObject, ...]:
    """The placement objects these actions created, as the next pass observes them."""
    return tuple(group_object(m) for m in created(actions) if m["apiVersion"] != "v1")


# --- the choice ------------------------------------------------------------------------------


@pytest.mark.parametrize(("gang_field", "scheduler", "served", "chosen"), [
    ("Auto", None, EVERYTHING, "WorkloadAPI"),
    ("Auto", "volcano", EVERYTHING, "Volcano"),
    ("Auto", gang.COSCHEDULING_SCHEDULER, EVERYTHING, "Coscheduling"),
    ("Auto", "my-scheduler", EVERYTHING, "None"),
    ("Auto", None, frozenset({"Volcano", "Coscheduling"}), "None"),
    ("Auto", "volcano", frozenset({"WorkloadAPI"}), "None"),
    ("Auto", None, frozenset(), "None"),
    ("Coscheduling", None, frozenset(), "Coscheduling"),
    ("None", None, EVERYTHING, "None"),
])
def test_auto_picks_only_what_the_pods_scheduler_reads_from_what_the_cluster_serves(
        gang_field: str, scheduler: str | None, served: frozenset[str], chosen: str) -> None:
    mechanism, reason = gang.choose(gang_field, scheduler, served)
    assert mechanism == chosen
    assert reason.startswith("Auto" if gang_field == "Auto" else "spec.scheduling.gang")


def test_discovery_serves_a_mechanism_only_with_all_its_kinds() -> None:
    assert gang.served_mechanisms({"scheduling.k8s.io/v1", "scheduling.k8s.io/v1alpha2",
                                   "scheduling.volcano.sh/v1beta1"}) == {"WorkloadAPI",
                                                                         "Volcano"}
    assert gang.served_mechanisms({"scheduling.k8s.io/v1"}) == frozenset()


def test_the_choice_is_said_in_status_and_an_event_and_kept(minimal_manifest: dict) -> None:
    first = run(make_job(minimal_manifest))
    status = status_of(first)
    assert status["scheduling"]["gang"] == "WorkloadAPI"
    assert "scheduling.k8s.io/v1alpha2" in status["scheduling"]["reason"]
    assert "GangChosen" in events(first)
    # The cluster stops serving it (an operator restart saw other APIs): the job keeps it.
    again = run(make_job(minimal_manifest, status=status), groups=held(first),
                served=frozenset())
    assert all(not isinstance(a, WriteStatus) or a.status["scheduling"]["gang"] ==
               "WorkloadAPI" for a in again)
    assert "GangChosen" not in events(again)


def test_auto_finding_nothing_is_said_in_status_without_an_event(
        minimal_manifest: dict) -> None:
    actions = run(make_job(minimal_manifest), served=frozenset())
    assert status_of(actions)["scheduling"]["gang"] == "None"
    assert "GangChosen" not in events(actions)
    assert [kind for kind, _ in kinds(actions)] == ["Pod", "Pod"]


# --- the group's objects, before the pods --------------------------------------------------


@pytest.mark.parametrize(("mechanism", "objects", "mark"), [
    ("WorkloadAPI", [("Workload", "demo"), ("PodGroup", "demo-0")],
     lambda pod: pod["spec"]["schedulingGroup"] == {"podGroupName": "demo-0"}),
    ("Volcano", [("PodGroup", "demo")],
     lambda pod: pod["metadata"]["annotations"]["scheduling.k8s.io/group-name"] == "demo"
     and pod["spec"]["schedulerName"] == "volcano"),
    ("Coscheduling", [("PodGroup", "demo")],
     lambda pod: pod["metadata"]["labels"]["scheduling.x-k8s.io/pod-group"] == "demo"
     and pod["spec"]["schedulerName"] == gang.COSCHEDULING_SCHEDULER),
])
def test_each_mechanism_creates_its_group_owned_by_the_job_before_the_pods(
        minimal_manifest: dict, mechanism: str, objects: list, mark: Any) -> None:
    actions = run(make_job(minimal_manifest, {"gang": mechanism}, replicas=4, min_replicas=3))
    made = kinds(actions)
    pods = [m for m in created(actions) if m["kind"] == "Pod"]
    assert made[:len(objects)] == objects, made
    assert made[len(objects):] == [("Pod", f"demo-worker-{i}") for i in range(4)]
    for manifest in created(actions)[:len(objects)]:
        assert manifest["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
        assert manifest["metadata"]["labels"]["kubetrain.io/job-name"] == "demo"
    assert all(mark(p) for p in pods)
    scheduling = status_of(actions)["scheduling"]
    assert (scheduling["podGroup"], scheduling["minCount"]) == (objects[-1][1], 3)


def test_min_count_is_min_replicas_in_every_mechanism(minimal_manifest: dict) -> None:
    job = make_job(minimal_manifest, replicas=4, min_replicas=2)
    per_pod = {"nvidia.com/gpu": 8, "cpu": 16000, "memory": 64 * 2**30}
    workload, pod_group = gang.group_objects(job, "WorkloadAPI", "demo-0", 2, per_pod)
    assert workload["spec"]["podGroupTemplates"] == [
        {"name": "workers", "schedulingPolicy": {"gang": {"minCount": 2}}}]
    assert workload["spec"]["controllerRef"] == {"apiGroup": "kubetrain.io",
                                                 "kind": "TrainingJob", "name": "demo"}
    assert pod_group["spec"] == {
        "podGroupTemplateRef": {"workloadName": "demo", "podGroupTemplateName": "workers"},
        "schedulingPolicy": {"gang": {"minCount": 2}}}
    (volcano,) = gang.group_objects(
        make_job(minimal_manifest, {"gang": "Volcano", "volcanoQueue": "research"}),
        "Volcano", "demo", 2, per_pod)
    assert volcano["spec"] == {"minMember": 2, "queue": "research", "minResources": {
        "cpu": "32000m", "memory": "131072Mi", "nvidia.com/gpu": "16"}}
    (plugins,) = gang.group_objects(
        make_job(minimal_manifest, {"gang": "Coscheduling", "scheduleTimeoutSeconds": 90}),
        "Coscheduling", "demo", 2, {})
    assert plugins["spec"] == {"minMember": 2, "scheduleTimeoutSeconds": 90}


def test_min_resources_come_from_the_pod_as_built(minimal_manifest: dict) -> None:
    actions = run(make_job(minimal_manifest, {"gang": "Volcano"}, replicas=2, min_replicas=2,
                           resources={"requests": {"cpu": "500m", "memory": "1Gi"},
                                      "limits": {"nvidia.com/gpu": 1}}))
    (group,) = [m for m in created(actions) if m["kind"] == "PodGroup"]
    assert group["spec"]["minResources"] == {"cpu": "1000m", "memory": "2048Mi",
                                             "nvidia.com/gpu": "2"}


def test_pods_wait_for_a_group_the_cluster_cannot_serve(minimal_manifest: dict) -> None:
    actions = run(make_job(minimal_manifest, {"gang": "Volcano"}), served=frozenset())
    assert kinds(actions) == []
    said = events(actions)["GangNotServed"]
    assert "scheduling.volcano.sh/v1beta1 PodGroup" in said and "no pod is created" in said
    blocked = next(c for c in status_of(actions)["conditions"]
                   if c["type"] == "PlacementBlocked")
    assert blocked["status"] == "True"


def test_a_kept_group_is_not_created_again(minimal_manifest: dict) -> None:
    job = make_job(minimal_manifest, {"gang": "Coscheduling"})
    first = run(job)
    again = run(make_job(minimal_manifest, {"gang": "Coscheduling"},
                         status=status_of(first)), pod(0), pod(1), groups=held(first))
    assert not [a for a in again if isinstance(a, CreateObject | PatchObject | DeleteObject)]


@pytest.mark.parametrize("mechanism", ["Volcano", "Coscheduling"])
def test_elastic_scaling_resizes_a_mutable_group_in_place(minimal_manifest: dict,
                                                         mechanism: str) -> None:
    # No minReplicas: the group's minimum is replicas, and a rescale changes it.
    first = run(make_job(minimal_manifest, {"gang": mechanism}, replicas=2))
    scaled = make_job(minimal_manifest, {"gang": mechanism}, replicas=3,
                      status=status_of(first))
    actions = run(scaled, pod(0), pod(1), groups=held(first))
    (patch,) = [a for a in actions if isinstance(a, PatchObject)]
    assert (patch.kind, patch.name, patch.patch["spec"]["minMember"]) == ("PodGroup", "demo", 3)
    assert actions.index(patch) < [isinstance(a, CreateObject) for a in actions].index(True)
    assert "minMember 2 -> 3" in events(actions)["GangResized"]
    assert status_of(actions)["scheduling"]["minCount"] == 3


def test_the_workload_api_keeps_an_immutable_group_and_says_so(minimal_manifest: dict) -> None:
    first = run(make_job(minimal_manifest, replicas=2))
    scaled = make_job(minimal_manifest, replicas=3, status=status_of(first))
    actions = run(scaled, pod(0), pod(1), groups=held(first))
    assert not [a for a in actions if isinstance(a, PatchObject | DeleteObject)]
    assert kinds(actions) == [("Pod", "demo-worker-2")]
    new = next(m for m in created(actions) if m["kind"] == "Pod")
    assert new["spec"]["schedulingGroup"] == {"podGroupName": "demo-0"}
    assert "keeps minCount 2" in events(actions)["GangMinCountKept"]
    assert status_of(actions)["scheduling"]["minCount"] == 2


def test_a_whole_group_restart_renews_the_workload_apis_group(minimal_manifest: dict) -> None:
    first = run(make_job(minimal_manifest, replicas=2))
    running = status_of(first) | {"phase": "Running"}
    job = make_job(minimal_manifest, replicas=2, status=running)
    # Worker 0 (the rendezvous host) fails: the whole group is recreated.
    restart = run(job, pod(0, phase="Failed", exit_code=1), pod(1), groups=held(first))
    after = status_of(restart)
    assert after["restart"]["wholeGroup"] and after["restartAttempt"] == 1
    # The same pass renews the group (the old pods, going, were placed through the old one).
    assert kinds(restart) == [("PodGroup", "demo-1")]
    assert [(a.kind, a.name) for a in restart if isinstance(a, DeleteObject)] == [
        ("PodGroup", "demo-0")]
    assert "new PodGroup demo-1" in events(restart)["GangRenewed"]
    # The next pass (the old pods gone) makes the new pods in the new group.
    groups = (held(first)[0], *held(restart))
    renewed = run(make_job(minimal_manifest, replicas=2, status=after), groups=groups)
    assert kinds(renewed) == [("Pod", "demo-worker-0"), ("Pod", "demo-worker-1")]
    assert all(p["spec"]["schedulingGroup"]["podGroupName"] == "demo-1"
               for p in created(renewed))
    assert not [a for a in renewed if isinstance(a, DeleteObject)]


def test_a_partial_restart_keeps_the_group(minimal_manifest: dict) -> None:
    first = run(make_job(minimal_manifest, replicas=2))
    running = status_of(first) | {"phase": "Running"}
    restart = run(make_job(minimal_manifest, replicas=2, status=running),
                  pod(0), pod(1, phase="Failed", exit_code=1), groups=held(first))
    after = status_of(restart)
    assert not after["restart"]["wholeGroup"]
    replaced = run(make_job(minimal_manifest, replicas=2, status=after), pod(0),
                   groups=held(first))
    assert kinds(replaced) == [("Pod", "demo-worker-1")]
    assert not [a for a in replaced if isinstance(a, DeleteObject)]


@pytest.mark.parametrize("mechanism", ["WorkloadAPI", "Volcano", "Coscheduling"])
def test_suspend_releases_the_group_and_resume_makes_it_again(minimal_manifest: dict,
                                                               mechanism: str) -> None:
    first = run(make_job(minimal_manifest, {"gang": mechanism}))
    groups = held(first)
    job = make_job(minimal_manifest, {"gang": mechanism}, status=status_of(first),
                   runPolicy={"suspend": True})
    suspended = run(job, pod(0), pod(1), groups=groups)
    assert {(a.kind, a.name) for a in suspended if isinstance(a, DeleteObject)} == {
        (g.kind, g.name) for g in groups}
    assert {a.name for a in suspended if isinstance(a, DeletePod)} == {
        "demo-worker-0", "demo-worker-1"}
    resumed = run(make_job(minimal_manifest, {"gang": mechanism},
                           status=status_of(suspended)))
    assert [k for k, _ in kinds(resumed)][:len(groups)] == [g.kind for g in groups]


def test_a_finished_job_releases_its_group(minimal_manifest: dict) -> None:
    first = run(make_job(minimal_manifest, {"gang": "Volcano"}))
    done = run(make_job(minimal_manifest, {"gang": "Volcano"}, status=status_of(first)),
               pod(0, phase="Succeeded", exit_code=0), pod(1), groups=held(first))
    assert status_of(done)["phase"] == "Succeeded"
    assert [(a.kind, a.reason) for a in done if isinstance(a, DeleteObject)] == [
        ("PodGroup", "JobFinished")]


# --- topology without Kueue ---------------------------------------------------------------------


@pytest.mark.parametrize(("mode", "key"), [
    ("Required", "requiredDuringSchedulingIgnoredDuringExecution"),
    ("Preferred", "preferredDuringSchedulingIgnoredDuringExecution"),
])
def test_a_topology_level_becomes_pod_affinity_among_the_jobs_pods(
        minimal_manifest: dict, mode: str, key: str) -> None:
    actions = run(make_job(minimal_manifest, {"topology": {"level": "example.com/rack",
                                                           "mode": mode}}))
    for manifest in (m for m in created(actions) if m["kind"] == "Pod"):
        (term,) = manifest["spec"]["affinity"]["podAffinity"][key]
        term = term.get("podAffinityTerm", term)
        assert term == {"labelSelector": {
            "matchLabels": {"kubetrain.io/job-name": "demo"},
            # Not the job's lighthouse (a job with spec.faultTolerance has one): the workers.
            "matchExpressions": [{"key": "kubetrain.io/worker-index", "operator": "Exists"}]},
            "topologyKey": "example.com/rack"}


# --- Kueue: the Workload path -------------------------------------------------------------------


def kueue_job(minimal_manifest: dict, status: dict | None = None, replicas: int = 4,
              min_replicas: int | None = 2, **scheduling: Any) -> TrainingJob:
    return make_job(minimal_manifest, {"queue": "team-a", **scheduling}, replicas=replicas,
                    min_replicas=min_replicas, status=status)


def admitted(workload: GroupObject, count: int, flavor: str = "gpu", levels: tuple = (),
             domains: tuple = ()) -> GroupObject:
    """`workload` as Kueue's admission leaves it."""
    return GroupObject(workload.api_version, workload.kind, workload.name,
                       workload.min_count, spec=workload.spec,
                       conditions=({"type": "QuotaReserved", "status": "True"},
                                   {"type": "Admitted", "status": "True"}),
                       admission=kueue.Admission("cluster-queue", count, (flavor,), levels,
                                                 domains))


FLAVORS = {"gpu": kueue.Flavor("gpu", (("example.com/pool", "gpu"),),
                               ({"key": "example.com/gpu", "operator": "Exists",
                                 "effect": "NoSchedule"},))}


def test_a_job_with_a_queue_waits_suspended_for_kueue_with_no_pods(
        minimal_manifest: dict) -> None:
    actions = run(kueue_job(minimal_manifest))
    assert kinds(actions) == [("Workload", "trainingjob-demo-0")]
    (workload,) = [m for m in created(actions) if m["kind"] == "Workload"]
    assert workload["apiVersion"] == "kueue.x-k8s.io/v1beta1"
    (pod_set,) = workload["spec"]["podSets"]
    assert workload["spec"]["queueName"] == "team-a"
    assert (pod_set["name"], pod_set["count"], pod_set["minCount"]) == ("workers", 4, 2)
    assert pod_set["template"]["spec"]["containers"][0]["name"] == "trainer"
    status = status_of(actions)
    assert status["phase"] == "Suspended" and status["workers"]["desired"] == 0
    kueue_status = status["scheduling"]["kueue"]
    assert (kueue_status["path"], kueue_status["admitted"]) == ("Workload", False)
    assert "externalFrameworks" in events(actions)["KueuePath"]
    assert "Queued" in events(actions)
    # Nothing changed: it keeps waiting, without a second Workload or event.
    again = run(kueue_job(minimal_manifest, status=status), groups=held(actions))
    assert created(again) == [] and "Queued" not in events(again)


def test_an_admitted_job_runs_the_admitted_count_on_the_flavors_nodes(
        minimal_manifest: dict) -> None:
    first = run(kueue_job(minimal_manifest))
    (workload,) = held(first)
    actions = run(kueue_job(minimal_manifest, status=status_of(first)),
                  groups=(admitted(workload, 3),), flavors=FLAVORS)
    status = status_of(actions)
    assert status["phase"] == "Pending" and status["scheduling"]["kueue"]["admitted"]
    assert "cluster-queue: 3 workers" in events(actions)["Admitted"]
    # Partial admission: 3 of the 4 replicas, the gang sized to match before them.
    assert kinds(actions) == [("Workload", "demo"), ("PodGroup", "demo-0"),
                              *[("Pod", f"demo-worker-{i}") for i in range(3)]]
    for manifest in (m for m in created(actions) if m["kind"] == "Pod"):
        assert manifest["spec"]["nodeSelector"] == {"example.com/pool": "gpu"}
        assert {"key": "example.com/gpu", "operator": "Exists",
                "effect": "NoSchedule"} in manifest["spec"]["tolerations"]
        assert "kueue.x-k8s.io/queue-name" not in manifest["metadata"]["labels"]


def test_kueues_topology_assignment_puts_adjacent_workers_in_one_domain(
        minimal_manifest: dict) -> None:
    job = kueue_job(minimal_manifest, topology={"level": "example.com/rack"})
    first = run(job)
    (workload,) = [m for m in created(first) if m["kind"] == "Workload"]
    assert workload["spec"]["podSets"][0]["topologyRequest"] == {
        "required": "example.com/rack"}
    levels = ("example.com/rack", "kubernetes.io/hostname")
    domains = ((("rack-b", "node-3"), 1), (("rack-a", "node-2"), 2),
               (("rack-a", "node-1"), 1))
    actions = run(kueue_job(minimal_manifest, status=status_of(first),
                            topology={"level": "example.com/rack"}),
                  groups=(admitted(held(first)[0], 4, levels=levels, domains=domains),),
                  flavors=FLAVORS)
    placed = {m["metadata"]["name"]: m["spec"]["nodeSelector"] for m in created(actions)
              if m["kind"] == "Pod"}
    hosts = [placed[f"demo-worker-{i}"]["kubernetes.io/hostname"] for i in range(4)]
    racks = [placed[f"demo-worker-{i}"]["example.com/rack"] for i in range(4)]
    assert hosts == ["node-1", "node-2", "node-2", "node-3"]
    assert racks == ["rack-a", "rack-a", "rack-a", "rack-b"]
    assert all(selector["example.com/pool"] == "gpu" for selector in placed.values())
    # Kueue's assignment places them: no pod affinity on top.
    assert all("affinity" not in m["spec"] or "podAffinity" not in m["spec"]["affinity"]
               for m in created(actions) if m["kind"] == "Pod")


def test_topology_domains_follow_torchs_rank_order_past_ten_workers(
        minimal_manifest: dict) -> None:
    # torch ranks agents by host name as a string: worker 10 before worker 2.
    job = kueue_job(minimal_manifest, replicas=12, min_replicas=12,
                    topology={"level": "example.com/rack"})
    first = run(job)
    levels = ("example.com/rack",)
    domains = ((("rack-a",), 6), (("rack-b",), 6))
    actions = run(kueue_job(minimal_manifest, status=status_of(first), replicas=12,
                            min_replicas=12, topology={"level": "example.com/rack"}),
                  groups=(admitted(held(first)[0], 12, levels=levels, domains=domains),),
                  flavors=FLAVORS)
    rack = {m["metadata"]["name"]: m["spec"]["nodeSelector"]["example.com/rack"]
            for m in created(actions) if m["kind"] == "Pod"}
    by_rank = sorted(rack, key=lambda name: f"{name}.demo.ml.svc.cluster.local")
    assert [rack[name] for name in by_rank] == ["rack-a"] * 6 + ["rack-b"] * 6
    assert rack["demo-worker-10"] == rack["demo-worker-0"] == "rack-a"


def test_an_evicted_job_stops_its_pods_then_gives_back_its_quota(
        minimal_manifest: dict) -> None:
    first = run(kueue_job(minimal_manifest))
    running_workload = admitted(held(first)[0], 4)
    runs = run(kueue_job(minimal_manifest, status=status_of(first)),
               groups=(running_workload,), flavors=FLAVORS)
    status = status_of(runs) | {"phase": "Running"}
    evicted = GroupObject(
        running_workload.api_version, running_workload.kind, running_workload.name,
        running_workload.min_count, spec=running_workload.spec,
        conditions=(*running_workload.conditions,
                    {"type": "Evicted", "status": "True", "reason": "Preempted",
                     "message": "Preempted to accommodate a higher priority Workload"}),
        admission=running_workload.admission)
    pods = [pod(i) for i in range(4)]
    stopping = run(kueue_job(minimal_manifest, status=status), *pods,
                   groups=(evicted, *held(runs)[:2]), flavors=FLAVORS)
    assert {a.name for a in stopping if isinstance(a, DeletePod)} == {p.name for p in pods}
    assert "Preempted to accommodate" in events(stopping)["EvictedByKueue"]
    assert status_of(stopping)["phase"] == "Suspended"
    assert not [a for a in stopping if isinstance(a, PatchObject)]  # pods still there
    released = run(kueue_job(minimal_manifest, status=status_of(stopping)),
                   groups=(evicted,), flavors=FLAVORS)
    (patch,) = [a for a in released if isinstance(a, PatchObject)]
    assert patch.status and patch.patch["status"]["admission"] is None
    reserved = next(c for c in patch.patch["status"]["conditions"]
                    if c["type"] == "QuotaReserved")
    assert reserved["status"] == "False"


def test_a_finished_kueue_job_marks_its_workload_finished(minimal_manifest: dict) -> None:
    first = run(kueue_job(minimal_manifest))
    workload = admitted(held(first)[0], 4)
    runs = run(kueue_job(minimal_manifest, status=status_of(first)), groups=(workload,),
               flavors=FLAVORS)
    done = run(kueue_job(minimal_manifest, status=status_of(runs)),
               pod(0, phase="Succeeded", exit_code=0), groups=(workload, *held(runs)[:2]),
               flavors=FLAVORS)
    (patch,) = [a for a in done if isinstance(a, PatchObject)]
    finished = next(c for c in patch.patch["status"]["conditions"] if c["type"] == "Finished")
    assert (finished["status"], finished["reason"]) == ("True", "Succeeded")


def test_a_rescale_sends_a_kueue_job_back_to_its_queue(minimal_manifest: dict) -> None:
    first = run(kueue_job(minimal_manifest))
    workload = admitted(held(first)[0], 4)
    runs = run(kueue_job(minimal_manifest, status=status_of(first)), groups=(workload,),
               flavors=FLAVORS)
    scaled = run(kueue_job(minimal_manifest, status=status_of(runs), replicas=6),
                 *[pod(i) for i in range(4)], groups=(workload,), flavors=FLAVORS)
    assert next((a.kind, a.name) for a in scaled if isinstance(a, DeleteObject)) == (
        "Workload", "trainingjob-demo-0")
    assert kinds(scaled)[-1] == ("Workload", "trainingjob-demo-1")
    assert "goes back to queue team-a" in events(scaled)["Requeued"]
    assert status_of(scaled)["phase"] == "Suspended"


def test_kueue_not_served_blocks_the_job_and_says_how_to_fix_it(
        minimal_manifest: dict) -> None:
    actions = run(kueue_job(minimal_manifest), served=frozenset({"WorkloadAPI"}))
    assert created(actions) == []
    assert "install Kueue" in events(actions)["KueueNotServed"]


# --- Kueue: the PodGroup path -------------------------------------------------------------------


def test_the_queue_label_alone_takes_kueues_pod_group_path(minimal_manifest: dict) -> None:
    job = make_job(minimal_manifest, {"gang": "None",
                                      "topology": {"level": "example.com/rack"}},
                   replicas=3, labels={"kueue.x-k8s.io/queue-name": "team-a"})
    actions = run(job)
    pods = [m for m in created(actions) if m["kind"] == "Pod"]
    assert len(pods) == 3
    for manifest in pods:
        meta = manifest["metadata"]
        assert meta["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
        assert meta["labels"]["kueue.x-k8s.io/pod-group-name"] == "demo"
        assert meta["annotations"]["kueue.x-k8s.io/pod-group-total-count"] == "3"
        assert meta["annotations"]["kueue.x-k8s.io/podset-required-topology"] == \
            "example.com/rack"
        assert "affinity" not in manifest["spec"] or \
            "podAffinity" not in manifest["spec"]["affinity"]
    assert status_of(actions)["scheduling"]["kueue"]["path"] == "PodGroup"
    assert "no partial admission" in events(actions)["KueuePath"]


def test_a_pod_held_by_kueues_gate_is_not_stuck(minimal_manifest: dict) -> None:
    job = make_job(minimal_manifest, {"gang": "None"},
                   labels={"kueue.x-k8s.io/queue-name": "team-a"},
                   status={"phase": "Pending", "scheduling": {"gang": "None"}})
    long_ago = NOW - timedelta(hours=2)  # past pendingDeadlineSeconds (900 s)
    actions = run(job, pod(0, phase="Pending", created_at=long_ago, gated=True),
                  pod(1, phase="Pending", created_at=long_ago, gated=True))
    assert not [a for a in actions if isinstance(a, DeletePod)]


# --- managedBy ----------------------------------------------------------------------------------


def test_a_job_managed_by_another_controller_is_left_alone(minimal_manifest: dict) -> None:
    job = make_job(minimal_manifest, {"queue": "team-a"},
                   managedBy="kueue.x-k8s.io/multikueue")
    assert run(job) == []
    assert run(job, pod(0, phase="Failed", exit_code=1)) == []


def test_a_job_managed_by_kubetrain_by_name_runs(minimal_manifest: dict) -> None:
    job = make_job(minimal_manifest, managedBy="kubetrain.io/operator")
    assert [k for k, _ in kinds(run(job, served=frozenset()))] == ["Pod", "Pod"]


# --- the objects are valid ----------------------------------------------------------------------


def test_pods_on_the_pod_group_and_volcano_paths_are_valid_for_the_oldest_kubernetes(
        minimal_manifest: dict) -> None:
    for job in (make_job(minimal_manifest, {"gang": "Volcano",
                                            "topology": {"level": "example.com/rack"}}),
                make_job(minimal_manifest, {"gang": "Coscheduling"},
                         labels={"kueue.x-k8s.io/queue-name": "q"})):
        for manifest in (m for m in created(run(job)) if m["kind"] == "Pod"):
            kubernetes_validate.validate(manifest, "1.30", strict=True)
