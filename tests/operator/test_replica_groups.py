"""spec.faultTolerance in the operator: each replica group is its own torchrun group (its
rendezvous at its first pod, its own run id), every worker is told its group and the
lighthouse, the job's lighthouse Pod and Service are kept, and a broken pod restarts its
replica group only."""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
from kubernetes import client
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kubetrain.api.manifest import parse_job
from kubetrain.api.trainingjob import TrainingJob
from kubetrain.operator.actions import CountQuorumChange
from kubetrain.operator.applier import ActionApplier
from kubetrain.operator.children import lighthouse_pod, lighthouse_service, worker_pod
from kubetrain.operator.expectations import Expectations
from kubetrain.operator.facts import Observed, WorkerPod
from kubetrain.operator.metrics import OperatorMetrics
from kubetrain.operator.own_code_container import own_code_container
from kubetrain.operator.reconcile import reconcile
from kubetrain.operator.worker_env import torchrun_env
from kubetrain.operator.writer import ApiWriter
from kubetrain.pod_conventions import (
    INDEX_LABEL,
    JOB_LABEL,
    LIGHTHOUSE_ENV,
    LIGHTHOUSE_PORT,
    REPLICA_GROUP_ENV,
    group_leader,
    lighthouse_command,
    replica_group_of,
    torchrun_settings,
    worker_selector,
)

sys.path.insert(0, str(Path(__file__).parent))
from test_reconcile import NOW, WORKER_SELECTOR, Outcome, pod, running_status

sys.path.insert(0, str(Path(__file__).parents[1] / "cluster"))
from emulator import label_selector


def _running() -> dict[str, Any]:
    """A job of 4 workers training: its step advanced just now (no hang)."""
    return running_status(workers={"desired": 4, "ready": 4, "selector": WORKER_SELECTOR},
                          progress={"step": 5, "updatedAt": NOW.isoformat()})


def _job(minimal_manifest: dict[str, Any], *, groups: int | None = 2, replicas: int = 4,
         status: dict[str, Any] | None = None, trainer: bool = False) -> TrainingJob:
    manifest = copy.deepcopy(minimal_manifest)
    manifest["metadata"].update(namespace="ml", uid="uid-1", generation=1)
    spec = manifest["spec"]
    spec["workers"] = {"replicas": replicas}
    spec["parallelism"] = {"strategy": "fsdp"}
    spec["runPolicy"] = {"backoffSeconds": 10, "maxRestarts": 3}
    if groups is not None:
        spec["faultTolerance"] = {"replicaGroups": groups}
    if trainer:
        del spec["model"], spec["data"], spec["image"]
        spec["trainer"] = {"image": "example.com/own:1", "command": ["python", "train.py"]}
    if status is not None:
        manifest["status"] = status
    return parse_job(manifest)


def _env(container: dict[str, Any] | list[dict[str, Any]]) -> dict[str, str]:
    entries = container["env"] if isinstance(container, dict) else container
    return {entry["name"]: entry["value"] for entry in entries if "value" in entry}


def _validate(manifest: dict[str, Any]) -> None:
    kubernetes_validate.validate(manifest, kubernetes_validate.latest_version(), strict=True)


# --- the shared conventions ---------------------------------------------------------------


def test_pods_split_into_consecutive_groups_each_led_by_its_first_pod(
        minimal_manifest: dict) -> None:
    job = _job(minimal_manifest, groups=2, replicas=4)
    assert [replica_group_of(job, index) for index in range(4)] == [0, 0, 1, 1]
    assert [group_leader(job, index) for index in range(4)] == [0, 0, 2, 2]
    plain = _job(minimal_manifest, groups=None)
    assert replica_group_of(plain, 3) is None and group_leader(plain, 3) == 0


def test_torchrun_spans_one_group_of_fixed_size_with_fault_tolerance(
        minimal_manifest: dict) -> None:
    settings = torchrun_settings(_job(minimal_manifest, groups=2, replicas=4), endpoint="h:1",
                                 run_id="r", max_nodes=8, max_restarts=3)
    assert settings["nnodes"] == "2:2", "one replica group, not the job's elastic range"
    plain = torchrun_settings(_job(minimal_manifest, groups=None), endpoint="h:1", run_id="r",
                              max_nodes=8, max_restarts=3)
    assert plain["nnodes"] == "4:8"


# --- the worker environment ---------------------------------------------------------------


def test_each_replica_group_meets_at_its_first_pod_under_its_own_run_id(
        minimal_manifest: dict) -> None:
    job = _job(minimal_manifest)
    seen = []
    for index in range(4):
        manifest = worker_pod(job, index, 0)
        _validate(manifest)
        env = _env(manifest["spec"]["containers"][0])
        seen.append((env["PET_RDZV_ENDPOINT"], env["PET_RDZV_ID"], env["PET_NNODES"],
                     env[REPLICA_GROUP_ENV], env[LIGHTHOUSE_ENV]))
    lighthouse = f"http://demo-lighthouse:{LIGHTHOUSE_PORT}"
    assert seen == [
        ("demo-worker-0.demo:29400", "uid-1-group-0", "2:2", "0", lighthouse),
        ("demo-worker-0.demo:29400", "uid-1-group-0", "2:2", "0", lighthouse),
        ("demo-worker-2.demo:29400", "uid-1-group-1", "2:2", "1", lighthouse),
        ("demo-worker-2.demo:29400", "uid-1-group-1", "2:2", "1", lighthouse),
    ]


def test_without_fault_tolerance_every_pod_gets_the_jobs_one_torchrun_env(
        minimal_manifest: dict) -> None:
    job = _job(minimal_manifest, groups=None)
    envs = [worker_pod(job, index, 0)["spec"]["containers"][0]["env"][:7] for index in range(4)]
    assert all(env == torchrun_env(job) for env in envs)
    names = {entry["name"] for entry in worker_pod(job, 3, 0)["spec"]["containers"][0]["env"]}
    assert REPLICA_GROUP_ENV not in names and LIGHTHOUSE_ENV not in names
    assert _env(torchrun_env(job))["PET_RDZV_ENDPOINT"] == "demo-worker-0.demo:29400"
    assert _env(torchrun_env(job))["PET_RDZV_ID"] == "uid-1"


def test_own_code_is_told_its_replica_group_and_the_lighthouse_too(
        minimal_manifest: dict) -> None:
    job = _job(minimal_manifest, trainer=True)
    env = _env(own_code_container(job, 0, index=3).env)
    assert env[REPLICA_GROUP_ENV] == "1"
    assert env[LIGHTHOUSE_ENV] == f"http://demo-lighthouse:{LIGHTHOUSE_PORT}"
    assert env["PET_RDZV_ENDPOINT"] == "demo-worker-2.demo:29400"
    _validate(worker_pod(job, 3, 0))


# --- the lighthouse -----------------------------------------------------------------------


def test_the_lighthouse_runs_torchfts_command_owned_by_the_job_and_counted_as_no_worker(
        minimal_manifest: dict) -> None:
    job = _job(minimal_manifest)
    pod_manifest, service = lighthouse_pod(job), lighthouse_service(job)
    _validate(pod_manifest)
    _validate(service)
    (container,) = pod_manifest["spec"]["containers"]
    assert container["command"] == lighthouse_command(job)
    assert container["image"] == job.spec.image
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert pod_manifest["spec"]["securityContext"]["runAsNonRoot"] is True
    assert pod_manifest["spec"]["restartPolicy"] == "Always", "stateless: restarted in place"
    assert container["readinessProbe"]["tcpSocket"]["port"] == LIGHTHOUSE_PORT
    for manifest in (pod_manifest, service):
        assert manifest["metadata"]["name"] == "demo-lighthouse"
        (owner,) = manifest["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["name"], owner["uid"]) == ("TrainingJob", "demo", "uid-1")
    labels = pod_manifest["metadata"]["labels"]
    assert labels[JOB_LABEL] == "demo", "the operator's watch selects the job's label"
    assert INDEX_LABEL not in labels
    assert not label_selector(worker_selector("demo"))(pod_manifest)
    assert label_selector(worker_selector("demo"))(worker_pod(job, 0, 0))
    assert service["spec"]["type"] == "ClusterIP"
    assert service["spec"]["selector"].items() <= labels.items()
    assert [port["port"] for port in service["spec"]["ports"]] == [LIGHTHOUSE_PORT]
    assert lighthouse_pod(_job(minimal_manifest, trainer=True))["spec"]["containers"][0][
        "image"] == "example.com/own:1", "own code's image holds the job's torchft"


def _lighthouse(phase: str = "Running", **facts: Any) -> WorkerPod:
    return WorkerPod(name="demo-lighthouse", index=-1, restart_attempt=0, phase=phase, **facts)


def _run(job: TrainingJob, *pods: WorkerPod, lighthouse: WorkerPod | None = None,
         lighthouse_service: bool = True) -> Outcome:
    observed = Observed(pods=pods, service=True, config_generation=1, lighthouse=lighthouse,
                        lighthouse_service=lighthouse_service)
    return Outcome.of(reconcile(job, observed, NOW))


def test_a_new_job_gets_its_lighthouse_before_its_workers(minimal_manifest: dict) -> None:
    out = _run(_job(minimal_manifest), lighthouse_service=False)
    assert [(kind, name) for kind, name, _ in out.created] == [
        ("Service", "demo-lighthouse"), ("Pod", "demo-lighthouse"),
        *(("Pod", f"demo-worker-{index}") for index in range(4))]
    assert out.status is not None and out.status["workers"]["ready"] == 0
    plain = _run(_job(minimal_manifest, groups=None), lighthouse_service=False)
    assert all("lighthouse" not in name for _, name, _ in plain.created)


def test_a_running_lighthouse_is_kept_and_a_lost_one_made_again(minimal_manifest: dict) -> None:
    job = _job(minimal_manifest, status=_running())
    workers = [pod(index) for index in range(4)]
    assert not _run(job, *workers, lighthouse=_lighthouse()).created
    # Evicted, or its node gone: deleted now, and created again once it is gone.
    for lost in (_lighthouse("Failed", reason="Evicted"), _lighthouse(node_lost=True)):
        out = _run(job, *workers, lighthouse=lost)
        assert [action.name for action in out.deleted] == ["demo-lighthouse"]
        assert ("Warning", "LighthouseLost") in out.events
        assert not out.created
    assert not _run(job, *workers, lighthouse=_lighthouse("Failed", deleting=True)).created
    out = _run(job, *workers, lighthouse=None)
    assert [(kind, name) for kind, name, _ in out.created] == [("Pod", "demo-lighthouse")]
    assert not out.deleted, "the workers train on"


def test_a_suspended_job_stops_its_lighthouse(minimal_manifest: dict) -> None:
    manifest = copy.deepcopy(minimal_manifest)
    job = _job(manifest, status=_running())
    job.spec.run_policy.suspend = True
    out = _run(job, *(pod(index) for index in range(4)), lighthouse=_lighthouse())
    assert "demo-lighthouse" in [action.name for action in out.deleted]


def test_the_controller_observes_the_lighthouse_apart_from_the_workers(
        minimal_manifest: dict) -> None:
    from kubetrain.operator.config import OperatorConfig
    from kubetrain.operator.handlers import Indexes, TrainingJobController

    job = _job(minimal_manifest)
    raw = [worker_pod(job, index, 0) for index in range(4)] + [lighthouse_pod(job)]
    key = ("ml", "demo")
    indexes = Indexes(jobs={}, pods={key: raw}, services={key: ["demo", "demo-lighthouse"]},  # type: ignore[arg-type]
                      config_maps={}, nodes={})  # type: ignore[arg-type]
    controller = TrainingJobController(OperatorConfig(standalone=True), None)  # type: ignore[arg-type]
    observed = controller.observe(key, Expectations(), indexes, NOW)
    assert sorted(found.name for found in observed.pods) == [
        f"demo-worker-{index}" for index in range(4)]
    assert observed.lighthouse is not None and observed.lighthouse.name == "demo-lighthouse"
    assert observed.service and observed.lighthouse_service
    only_workers = Indexes(jobs={}, pods={key: raw[:4]}, services={key: ["demo-lighthouse"]},  # type: ignore[arg-type]
                           config_maps={}, nodes={})  # type: ignore[arg-type]
    observed = controller.observe(key, Expectations(), only_workers, NOW)
    assert observed.lighthouse is None and not observed.service and observed.lighthouse_service


# --- recovery by replica group --------------------------------------------------------------


@pytest.mark.parametrize("failing", [3, 2, 0])
def test_a_failed_pod_restarts_its_replica_group_only(minimal_manifest: dict,
                                                       failing: int) -> None:
    job = _job(minimal_manifest, status=_running())
    pods = [pod(index, "Failed", exit_code=1) if index == failing else pod(index)
            for index in range(4)]
    out = _run(job, *pods, lighthouse=_lighthouse())
    group = failing // 2
    assert sorted(action.name for action in out.deleted) == [
        f"demo-worker-{index}" for index in (2 * group, 2 * group + 1)]
    assert out.status is not None
    assert out.status["restart"]["wholeGroup"] is False
    assert f"replica group {group}" in out.condition("Restarting")["message"]
    # Counted for that group alone, and in the job's restarts.
    assert out.status["replicaGroups"]["restarts"] == [1 - group, group]
    assert out.status["restarts"] == 1

    # The next pass, after the backoff: the group's pods are made again, under the next
    # attempt; the other group's (of the older attempt) are left alone.
    survivors = [one for one in pods if one.index // 2 != group]
    restarting = _job(minimal_manifest, status=out.status)
    later = Outcome.of(reconcile(restarting, Observed(
        pods=tuple(survivors), service=True, config_generation=1,
        lighthouse=_lighthouse(), lighthouse_service=True), NOW.replace(hour=NOW.hour + 1)))
    assert not later.deleted
    assert sorted(name for _, name, _ in later.created) == [
        f"demo-worker-{index}" for index in (2 * group, 2 * group + 1)]
    assert {attempt for _, _, attempt in later.created} == {"1"}


def test_a_trainer_restarted_in_place_counts_for_its_replica_group(
        minimal_manifest: dict) -> None:
    """torchrun restarts one group's trainers inside its pods: that group's count goes up;
    a whole-job restart (every group re-formed) counts in no group's."""
    from datetime import timedelta

    from kubetrain.operator.facts import TrainerEnd

    killed = TrainerEnd(pod="demo-worker-3", time=NOW - timedelta(seconds=1),
                        failure_class="Unknown", message="the trainer ended without a word; "
                        "torchrun restarts the group in place")
    out = Outcome.of(reconcile(_job(minimal_manifest, status=_running()), Observed(
        pods=tuple(pod(index) for index in range(4)), service=True, config_generation=1,
        lighthouse=_lighthouse(), lighthouse_service=True, trainer_ends=(killed,)), NOW))
    assert out.deleted == [] and out.status is not None
    assert out.status["replicaGroups"]["restarts"] == [0, 1]
    assert out.status["restarts"] == 1

    # Had its container been killed whole, the pod's failure follows: one restart of the
    # group (its pods replaced), not two.
    whole = Outcome.of(reconcile(_job(minimal_manifest, status=out.status), Observed(
        pods=(*(pod(index) for index in range(3)), pod(3, "Failed", exit_code=137)),
        service=True, config_generation=1, lighthouse=_lighthouse(), lighthouse_service=True,
        trainer_ends=(killed,)), NOW))
    assert whole.status is not None
    assert sorted(action.name for action in whole.deleted) == ["demo-worker-2", "demo-worker-3"]
    assert whole.status["replicaGroups"]["restarts"] == [0, 1]
    assert whole.status["restarts"] == 1

    # The step then stalls past progressDeadlineSeconds: the whole job restarts.
    stalled = copy.deepcopy(out.status)
    stalled["progress"]["updatedAt"] = (NOW - timedelta(hours=2)).isoformat()
    stalled["lastRestartTime"] = (NOW - timedelta(hours=2)).isoformat()
    job = _job(minimal_manifest, status=stalled)
    job.spec.run_policy.progress_deadline_seconds = 60
    hung = _run(job, *(pod(index) for index in range(4)), lighthouse=_lighthouse())
    assert hung.status is not None and hung.status["restart"]["wholeGroup"] is True
    assert hung.status["replicaGroups"]["restarts"] == [0, 1]
    assert hung.status["restarts"] == 2


def test_a_pod_breaking_during_a_group_restart_takes_its_own_group_only(
        minimal_manifest: dict) -> None:
    first = _run(_job(minimal_manifest, status=_running()),
                 *(pod(index, "Failed", exit_code=1) if index == 3 else pod(index)
                   for index in range(4)), lighthouse=_lighthouse())
    assert first.status is not None
    job = _job(minimal_manifest, status=first.status)
    # Group 1 re-forms (attempt 1); worker 0 of group 0 (attempt 0) fails meanwhile.
    pods = [pod(0, "Failed", exit_code=1), pod(1), pod(2, "Pending", attempt=1, created_at=NOW),
            pod(3, "Pending", attempt=1, created_at=NOW)]
    out = _run(job, *pods, lighthouse=_lighthouse())
    assert sorted(action.name for action in out.deleted) == ["demo-worker-0", "demo-worker-1"]
    assert {action.reason for action in out.deleted} == {"WorkerFailed"}, "the same restart"


def test_a_node_avoided_for_a_groups_repeated_failures_keeps_the_live_groups_pods_on_it(
        minimal_manifest: dict) -> None:
    """Group 1's worker fails a second time on node-b, where group 0's pods train too: the
    node is avoided and group 1 restarts off it; group 0 is live and trains on where it is
    (it moves off the node only if it fails there). Its pods were once taken for the
    restart's to move off the node, and a healthy group stopped and restarted."""
    from datetime import timedelta

    status = _running()
    status["nodeFailures"] = [{"node": "node-b", "class": "Unknown", "pod": "demo-worker-3",
                               "time": (NOW - timedelta(minutes=5)).isoformat()}]
    job = _job(minimal_manifest, status=status)
    pods = [pod(index, "Failed", exit_code=137, node="node-b") if index == 3
            else pod(index, node="node-b" if index < 2 else "node-a") for index in range(4)]
    out = _run(job, *pods, lighthouse=_lighthouse())
    assert ("Warning", "NodeAvoided") in out.events, out.events
    assert out.status is not None and [entry["node"] for entry in
                                       out.status["avoidedNodes"]] == ["node-b"]
    assert sorted(action.name for action in out.deleted) == ["demo-worker-2", "demo-worker-3"]

    # The passes while group 1 restarts: group 0's pods (of the older attempt, on the node
    # now avoided) are left alone.
    restarting = _job(minimal_manifest, status=out.status)
    for now in (NOW, NOW + timedelta(hours=1)):
        later = Outcome.of(reconcile(restarting, Observed(
            pods=tuple(pods[:2]), service=True, config_generation=1,
            lighthouse=_lighthouse(), lighthouse_service=True), now))
        assert not later.deleted, later.deleted


def test_a_group_that_lost_its_quorum_restarts_alone_and_says_why(
        minimal_manifest: dict) -> None:
    """A trainer that found no quorum (too few groups, no lighthouse) past torchrun's
    restarts in place ends its pod as QuorumLost: its group restarts, not the live ones,
    which may well have a quorum (every group restarts only when every group lost it)."""
    from kubetrain.operator.facts import TrainerFailure

    said = TrainerFailure("QuorumLost", "no quorum of faultTolerance.minReplicaGroups (2)")
    pods = [pod(0), pod(1), pod(2, "Failed", exit_code=1, trainer_failure=said), pod(3)]
    out = _run(_job(minimal_manifest, status=_running()), *pods, lighthouse=_lighthouse())
    assert sorted(action.name for action in out.deleted) == ["demo-worker-2", "demo-worker-3"]
    assert out.status is not None and out.status["restart"]["wholeGroup"] is False
    assert out.status["lastFailure"]["class"] == "QuorumLost"


def test_the_status_shows_the_ready_groups_and_the_quorum_and_an_event_when_it_shrinks(
        minimal_manifest: dict) -> None:
    """Worker 0's trainer reports the quorum; the operator counts the groups whose pods are
    all ready, and says when the quorum changed (a warning when it shrank)."""
    from kubetrain.operator.facts import metrics_sample
    from kubetrain.protocol import METRIC_REPLICA_GROUPS, METRIC_SKIPPED_SAMPLES

    def sample(groups: int, skipped: int) -> Any:
        return metrics_sample(f"{METRIC_REPLICA_GROUPS} {groups}\n"
                              f"{METRIC_SKIPPED_SAMPLES} {skipped}\n")

    assert (sample(2, 0).replica_groups, sample(1, 48).skipped_samples) == (2, 48)
    workers = tuple(pod(index) for index in range(4))  # Running: ready

    def run(job: TrainingJob, *pods: WorkerPod, metrics: Any) -> Outcome:
        return Outcome.of(reconcile(job, Observed(
            pods=pods, service=True, config_generation=1, lighthouse=_lighthouse(),
            lighthouse_service=True, metrics=metrics), NOW))

    both = run(_job(minimal_manifest, status=_running()), *workers, metrics=sample(2, 0))
    assert both.status is not None
    assert both.status["replicaGroups"] == {"groups": 2, "ready": 2, "inQuorum": 2,
                                            "skippedSamples": 0, "restarts": [0, 0]}
    assert not [reason for _, reason in both.events if reason == "QuorumChanged"]

    # Group 1's worker 3 is away (its pod re-made, not ready yet): group 0 steps alone.
    alone = run(_job(minimal_manifest, status=both.status), *workers[:3],
                pod(3, "Pending", attempt=1, created_at=NOW), metrics=sample(1, 48))
    assert alone.status is not None
    assert alone.status["replicaGroups"] == {"groups": 2, "ready": 1, "inQuorum": 1,
                                             "skippedSamples": 48, "restarts": [0, 0]}
    assert ("Warning", "QuorumChanged") in alone.events
    # No sample this pass (worker 0 not answering): the last quorum stands, no event.
    quiet = run(_job(minimal_manifest, status=alone.status), *workers, metrics=None)
    assert quiet.status is not None and quiet.status["replicaGroups"]["inQuorum"] == 1
    assert not [reason for _, reason in quiet.events if reason == "QuorumChanged"]
    back = run(_job(minimal_manifest, status=alone.status), *workers, metrics=sample(2, 48))
    assert ("Normal", "QuorumChanged") in back.events
    # Each change is counted for kubetrain_quorum_changes_total, in its direction.
    assert [[a for a in out.actions if isinstance(a, CountQuorumChange)]
            for out in (both, alone, quiet, back)] == [
        [], [CountQuorumChange(shrank=True)], [], [CountQuorumChange(shrank=False)]]


def test_the_quorum_shows_in_the_operators_metrics_until_the_job_finishes() -> None:
    """kubetrain_replica_groups{state} follows status.replicaGroups; the quorum's changes are
    counted by direction, however short each was."""
    metrics = OperatorMetrics()

    def scraped() -> dict[tuple[str, str], float]:
        text = generate_latest(metrics.registry).decode()
        return {(sample.name, sample.labels.get("state") or sample.labels["direction"]):
                sample.value for family in text_string_to_metric_families(text)
                if family.name in ("kubetrain_replica_groups", "kubetrain_quorum_changes")
                for sample in family.samples if not sample.name.endswith("_created")}

    groups = {"groups": 3, "ready": 3, "inQuorum": 3, "skippedSamples": 0, "restarts": [0] * 3}
    metrics.show_job_status("ml", "demo", {"phase": "Running", "replicaGroups": groups})
    assert scraped() == {("kubetrain_replica_groups", "total"): 3,
                         ("kubetrain_replica_groups", "ready"): 3,
                         ("kubetrain_replica_groups", "in_quorum"): 3}
    # A count makes no API call: the writer's client never connects.
    applier = ActionApplier(ApiWriter(client.ApiClient()), metrics, "kubetrain-operator",
                            "pod-1")
    applier.apply({"metadata": {"namespace": "ml", "name": "demo"}}, Expectations(), [
        CountQuorumChange(shrank=True), CountQuorumChange(shrank=False),
        CountQuorumChange(shrank=True)])
    metrics.show_job_status("ml", "demo", {"phase": "Running", "replicaGroups": {
        **groups, "ready": 2, "inQuorum": 2}})
    assert scraped() == {("kubetrain_replica_groups", "total"): 3,
                         ("kubetrain_replica_groups", "ready"): 2,
                         ("kubetrain_replica_groups", "in_quorum"): 2,
                         ("kubetrain_quorum_changes_total", "shrank"): 2,
                         ("kubetrain_quorum_changes_total", "grew"): 1}
    metrics.show_job_status("ml", "demo", {"phase": "Succeeded", "replicaGroups": groups})
    assert not [key for key in scraped() if key[0] == "kubetrain_replica_groups"]
