"""The real operator against kmock's emulator (tests/cluster/emulator.py), for integration tests.

`running_operator` runs `kubetrain operator` itself (`kubetrain.operator.command.serve`)
in a thread against an `EmulatedCluster`; `Kube` is the test's own client; the
`scenario_*` functions are the operator's stories, run here and, in
tests/real_server, against a real kube-apiserver.

RBAC check for the chart: `run_operator_scenarios()` runs every integration
scenario of tests/operator against a fresh cluster serving every placement API (the
Workload API, Volcano, scheduler-plugins, Kueue), with leader election on, and returns
the set of (verb, resource) pairs the operator called, e.g. ("create", "pods"),
("patch", "kubetrain.io/trainingjobs/status"), ("watch", "nodes"),
("patch", "coordination.k8s.io/leases"). Verbs are RBAC verbs (get, list, watch, create,
update, patch, delete); resources are plurals, with "/subresource" where one was used,
prefixed with their API group outside the core group. The chart's Role must grant exactly
these.
"""

from __future__ import annotations

import contextlib
import copy
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol, TypeVar

from emulator import EmulatedCluster
from kubernetes import client
from scheduling_apis import EVERY_PLACEMENT_API

from kubetrain.local.launch import free_port
from kubetrain.operator.command import serve
from kubetrain.operator.config import OperatorConfig

T = TypeVar("T")

NAMESPACE = "default"
STATUS_SERVICE = "kubetrain-status"


@contextlib.contextmanager
def running_operator(cluster: EmulatedCluster, **options: Any) -> Iterator[OperatorConfig]:
    """`kubetrain operator --standalone` against the cluster, in a thread, until the block ends."""
    options.setdefault("standalone", True)
    options.setdefault("resync_seconds", 0.5)
    # The status endpoint on a free loopback port, where the tests post as job pods would.
    options.setdefault("status_port", 0)
    options.setdefault("status_host", "127.0.0.1")
    options.setdefault("status_namespace", NAMESPACE)
    options.setdefault("status_service", STATUS_SERVICE)
    options.setdefault("pod_ip", "127.0.0.1")
    config = OperatorConfig(metrics_port=free_port(), health_port=free_port(), **options)
    stop, ready = threading.Event(), threading.Event()
    with _kubeconfig_env(cluster.kubeconfig):
        thread = threading.Thread(target=serve, args=(config, stop, ready), daemon=True)
        thread.start()
        assert ready.wait(30), "the operator did not start"
        try:
            yield config
        finally:
            stop.set()
            thread.join(timeout=30)


@contextlib.contextmanager
def _kubeconfig_env(path: Path) -> Iterator[None]:
    import os

    previous = os.environ.get("KUBECONFIG")
    os.environ["KUBECONFIG"] = str(path)
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("KUBECONFIG", None)
        else:
            os.environ["KUBECONFIG"] = previous


def eventually(check: Callable[[], T], timeout: float = 20.0, what: str = "") -> T:
    """Poll `check` until it returns something truthy (and return it) or fail after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or check}")
        time.sleep(0.1)


def job_manifest(name: str, replicas: int = 2, **run_policy: Any) -> dict[str, Any]:
    """A valid TrainingJob with fast restarts for tests."""
    return {
        "apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "image": "ghcr.io/kubetrain/trainer:0.1.0",
            "model": {"preset": "tiny"},
            "data": {"train": "s3://datasets/corpus/train"},
            "checkpoint": {"uri": f"s3://checkpoints/{name}"},
            "storage": {"credentialsSecret": {"name": "s3-credentials"}},
            "workers": {"replicas": replicas, "minReplicas": 1, "maxReplicas": 4},
            "runPolicy": {"backoffSeconds": 0, **run_policy},
        },
    }


class Cluster(Protocol):
    """A cluster the tests talk to: the emulator, or a real control plane (tests/real_server)."""

    def api_client(self) -> client.ApiClient: ...


class Kube:
    """The test's own Kubernetes client calls (a different user agent from the operator's)."""

    def __init__(self, cluster: Cluster) -> None:
        api = self.api = cluster.api_client()
        self.core = client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.leases = client.CoordinationV1Api(api)

    def require(self, *placement: str) -> None:
        """Skip unless the cluster serves these placement APIs ("WorkloadAPI", "Volcano",
        "Coscheduling", "Kueue"): the real-server tier installs none of their CRDs or
        feature gates, the emulated one serves them all."""
        import pytest

        from kubetrain.operator.handlers import discover_placement_apis

        missing = set(placement) - discover_placement_apis(self.api)
        if missing:
            pytest.skip(f"the cluster does not serve {', '.join(sorted(missing))}")

    def placement(self, job: str, group: str, version: str,
                  plural: str) -> dict[str, dict[str, Any]]:
        """The job's objects of one placement kind (a PodGroup, a Workload), by name."""
        listed = self.custom.list_namespaced_custom_object(
            group, version, NAMESPACE, plural,
            label_selector=f"kubetrain.io/job-name={job}")
        return {item["metadata"]["name"]: item for item in listed["items"]}

    def lease_holder(self, namespace: str = NAMESPACE) -> str | None:
        """Who holds the operator's leader-election Lease, if anyone."""
        try:
            lease = self.leases.read_namespaced_lease("kubetrain-operator", namespace)
        except client.ApiException as error:
            if error.status == 404:
                return None
            raise
        return lease.spec.holder_identity or None

    def create_job(self, manifest: dict[str, Any]) -> None:
        self.custom.create_namespaced_custom_object(
            "kubetrain.io", "v1alpha1", NAMESPACE, "trainingjobs", copy.deepcopy(manifest))

    def job(self, name: str) -> dict[str, Any] | None:
        try:
            return dict(self.custom.get_namespaced_custom_object(
                "kubetrain.io", "v1alpha1", NAMESPACE, "trainingjobs", name))
        except client.ApiException as error:
            if error.status == 404:
                return None
            raise

    def patch_job(self, name: str, patch: dict[str, Any]) -> None:
        self.custom.patch_namespaced_custom_object(
            "kubetrain.io", "v1alpha1", NAMESPACE, "trainingjobs", name, patch)

    def scale_job(self, name: str, replicas: int) -> None:
        self.custom.patch_namespaced_custom_object_scale(
            "kubetrain.io", "v1alpha1", NAMESPACE, "trainingjobs", name,
            {"spec": {"replicas": replicas}})

    def delete_job(self, name: str) -> None:
        self.custom.delete_namespaced_custom_object(
            "kubetrain.io", "v1alpha1", NAMESPACE, "trainingjobs", name)

    def phase(self, name: str) -> str | None:
        job = self.job(name)
        return (job or {}).get("status", {}).get("phase")

    def pods(self, job: str) -> dict[str, dict[str, Any]]:
        items = self.core.list_namespaced_pod(NAMESPACE).items
        api = client.ApiClient()
        # A real API server's list items carry no apiVersion/kind; objects read singly do.
        pods = [{"apiVersion": "v1", "kind": "Pod", **api.sanitize_for_serialization(pod)}
                for pod in items]
        return {pod["metadata"]["name"]: pod for pod in pods
                if pod["metadata"].get("labels", {}).get("kubetrain.io/job-name") == job}

    def set_pod_status(self, name: str, phase: str, exit_code: int | None = None,
                       reason: str | None = None, pod_ip: str | None = None) -> None:
        status: dict[str, Any] = {"phase": phase}
        if exit_code is not None:
            terminated = {"exitCode": exit_code, "reason": reason or "Error"}
            status["containerStatuses"] = [{
                "name": "trainer", "ready": False, "restartCount": 0, "image": "trainer",
                "imageID": "", "state": {"terminated": terminated}}]
        if pod_ip:
            status["podIP"] = pod_ip
        self.core.patch_namespaced_pod_status(name, NAMESPACE, {"status": status})

    def run_all(self, job: str, pod_ip: str | None = None) -> None:
        for name in self.pods(job):
            self.set_pod_status(name, "Running", pod_ip=pod_ip)

    def event_reasons(self, job: str) -> list[str]:
        events = self.core.list_namespaced_event(NAMESPACE).items
        return [event.reason for event in events if event.involved_object.name == job]


# --- the scenarios: each integration test, and together the operator's RBAC footprint --------


def scenario_job_creates_valid_children(kube: Kube) -> None:
    import kubernetes_validate

    manifest = job_manifest("create")
    # Valid for the oldest Kubernetes: without the Workload API's pod field (1.36's), which
    # Auto would add where the cluster serves it (scenario_gang_groups_... below).
    manifest["spec"]["scheduling"] = {"gang": "None"}
    kube.create_job(manifest)
    pods = eventually(lambda: len(kube.pods("create")) == 2 and kube.pods("create"))
    uid = (kube.job("create") or {})["metadata"]["uid"]
    for pod in pods.values():
        # What the operator wrote must be valid for the oldest supported Kubernetes; the
        # status is the server's and the kubelet's (a newer server adds newer fields to it).
        created = {key: value for key, value in pod.items() if key != "status"}
        kubernetes_validate.validate(created, "1.30", strict=True)
        assert pod["metadata"]["ownerReferences"][0]["uid"] == uid
        env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
        assert env["PET_RDZV_ENDPOINT"]["value"] == "create-worker-0.create:29400"
        assert env["PET_RDZV_ID"]["value"] == uid
        assert "value" not in env["AWS_SECRET_ACCESS_KEY"]
    service = kube.core.read_namespaced_service("create", NAMESPACE)
    assert service.spec.cluster_ip == "None" and service.spec.publish_not_ready_addresses
    config = kube.core.read_namespaced_config_map("create-config", NAMESPACE)
    assert "name: create" in config.data["job.yaml"]


def scenario_failures_restart_then_rank_zero_completes(kube: Kube) -> None:
    kube.create_job(job_manifest("lifecycle"))
    eventually(lambda: len(kube.pods("lifecycle")) == 2)
    kube.run_all("lifecycle")
    eventually(lambda: kube.phase("lifecycle") == "Running")
    # Killed from outside (an OOM kill would halve the micro-batch instead: scenario below).
    kube.set_pod_status("lifecycle-worker-1", "Failed", exit_code=137, reason="Error")
    replaced = eventually(lambda: (kube.pods("lifecycle").get("lifecycle-worker-1", {})
                                   .get("metadata", {}).get("labels", {})
                                   .get("kubetrain.io/restart-attempt") == "1"))
    assert replaced
    status = (kube.job("lifecycle") or {})["status"]
    assert status["restarts"] == 1 and status["lastFailure"]["pod"] == "lifecycle-worker-1"
    assert status["failures"] == {"Unknown": 1}
    kube.run_all("lifecycle")
    eventually(lambda: kube.phase("lifecycle") == "Running")
    kube.set_pod_status("lifecycle-worker-0", "Succeeded", exit_code=0)
    eventually(lambda: kube.phase("lifecycle") == "Succeeded")
    eventually(lambda: "lifecycle-worker-1" not in kube.pods("lifecycle"))
    reasons = eventually(lambda: "Completed" in kube.event_reasons("lifecycle")
                         and kube.event_reasons("lifecycle"))
    assert {"Created", "Running", "WorkerFailed", "Completed"} <= set(reasons)


def scenario_oom_killed_worker_restarts_the_group_with_half_the_micro_batch(kube: Kube) -> None:
    import yaml

    manifest = job_manifest("oom")
    manifest["spec"]["optimization"] = {"microBatchSize": 8, "gradientAccumulationSteps": 2}
    kube.create_job(manifest)
    eventually(lambda: len(kube.pods("oom")) == 2)
    kube.run_all("oom")
    eventually(lambda: kube.phase("oom") == "Running")
    kube.set_pod_status("oom-worker-1", "Failed", exit_code=137, reason="OOMKilled")
    eventually(lambda: {pod["metadata"]["labels"]["kubetrain.io/restart-attempt"]
                        for pod in kube.pods("oom").values()} == {"1"}
               and len(kube.pods("oom")) == 2, what="both workers replaced")
    status = (kube.job("oom") or {})["status"]
    assert status["lastFailure"]["class"] == "OOMKilled"
    assert status["failures"] == {"OOMKilled": 1} and status.get("restarts", 0) == 0
    assert (status["effective"]["microBatchSize"],
            status["effective"]["gradientAccumulationSteps"]) == (4, 4)
    # The spec is as applied; the trainer's snapshot carries the halved micro-batch.
    assert (kube.job("oom") or {})["spec"]["optimization"]["microBatchSize"] == 8
    config = kube.core.read_namespaced_config_map("oom-config", NAMESPACE)
    snapshot = yaml.safe_load(config.data["job.yaml"])
    assert snapshot["status"]["effective"]["microBatchSize"] == 4
    reasons = kube.event_reasons("oom")
    assert "WorkerFailure" in reasons and "MicroBatchHalved" in reasons, reasons
    kube.delete_job("oom")


def scenario_permanent_exit_code_fails_the_job(kube: Kube) -> None:
    kube.create_job(job_manifest("permanent"))
    eventually(lambda: len(kube.pods("permanent")) == 2)
    kube.set_pod_status("permanent-worker-1", "Failed", exit_code=2)
    eventually(lambda: kube.phase("permanent") == "Failed")
    conditions = (kube.job("permanent") or {})["status"]["conditions"]
    assert any(c["type"] == "Failed" and c["reason"] == "PermanentError" for c in conditions)


def scenario_scale_subresource_adds_and_removes_workers(kube: Kube) -> None:
    kube.create_job(job_manifest("scale"))
    eventually(lambda: len(kube.pods("scale")) == 2)
    kube.scale_job("scale", 3)
    eventually(lambda: set(kube.pods("scale")) == {f"scale-worker-{i}" for i in range(3)})
    kube.scale_job("scale", 1)
    eventually(lambda: set(kube.pods("scale")) == {"scale-worker-0"})
    assert (kube.job("scale") or {})["status"]["workers"]["desired"] == 1


def scenario_suspend_and_resume(kube: Kube) -> None:
    kube.create_job(job_manifest("pause"))
    eventually(lambda: len(kube.pods("pause")) == 2)
    kube.patch_job("pause", {"spec": {"runPolicy": {"suspend": True}}})
    eventually(lambda: kube.phase("pause") == "Suspended" and not kube.pods("pause"))
    kube.patch_job("pause", {"spec": {"runPolicy": {"suspend": False}}})
    eventually(lambda: len(kube.pods("pause")) == 2)
    assert {"Suspended", "Resumed"} <= set(kube.event_reasons("pause"))


def scenario_spec_change_updates_the_config_map_not_the_workers(kube: Kube) -> None:
    kube.create_job(job_manifest("config"))
    eventually(lambda: len(kube.pods("config")) == 2)
    kube.run_all("config")
    eventually(lambda: kube.phase("config") == "Running")
    uids = {name: pod["metadata"]["uid"] for name, pod in kube.pods("config").items()}

    def snapshot() -> str:
        return str(kube.core.read_namespaced_config_map("config-config", NAMESPACE)
                   .data["job.yaml"])

    kube.patch_job("config", {"spec": {"optimization": {"learningRate": 0.0005}}})
    eventually(lambda: "learningRate: 0.0005" in snapshot(), what="the new snapshot")
    # The operator posts the event after the ConfigMap's write, in the same pass (seen on a
    # clean clone: read between the two).
    eventually(lambda: "ConfigUpdated" in kube.event_reasons("config"),
               what="the ConfigUpdated event")
    # The same spec applied again (as GitOps tools do on every sync) changes nothing.
    def observed() -> tuple[str, int, dict[str, Any]]:
        job = kube.job("config") or {}
        return snapshot(), job["metadata"]["generation"], job["status"]

    before = observed()
    kube.patch_job("config", {"spec": {"optimization": {"learningRate": 0.0005}}})
    time.sleep(1.0)  # resyncs and the job's MODIFIED event have run
    assert observed() == before
    assert kube.event_reasons("config").count("ConfigUpdated") == 1
    assert {name: pod["metadata"]["uid"] for name, pod in kube.pods("config").items()} == uids
    assert kube.phase("config") == "Running"


def scenario_deleting_a_job_removes_its_children(kube: Kube) -> None:
    kube.create_job(job_manifest("gone"))
    eventually(lambda: len(kube.pods("gone")) == 2)
    kube.delete_job("gone")
    eventually(lambda: not kube.pods("gone") and kube.job("gone") is None)


def scenario_ttl_deletes_a_finished_job(kube: Kube) -> None:
    kube.create_job(job_manifest("ttl", replicas=1, ttlSecondsAfterFinished=1))
    eventually(lambda: len(kube.pods("ttl")) == 1)
    kube.set_pod_status("ttl-worker-0", "Succeeded", exit_code=0)
    eventually(lambda: kube.job("ttl") is None, timeout=30)


def scenario_invalid_spec_is_reported_not_crashed_on(kube: Kube) -> None:
    # A spec the models refuse. The emulator stores it and the operator must mark the job
    # Failed; a real API server refuses it through the CRD's CEL rules.
    manifest = job_manifest("invalid")
    manifest["spec"]["data"]["train"] = "gs://datasets/corpus/train"
    try:
        kube.create_job(manifest)
    except client.ApiException as refused:
        # A real API server's CEL rule refuses it at once, naming the field: even better.
        assert refused.status == 422 and "spec.data.train" in str(refused.body)
        assert kube.job("invalid") is None and not kube.pods("invalid")
        return
    eventually(lambda: kube.phase("invalid") == "Failed")
    failed = [c for c in (kube.job("invalid") or {})["status"]["conditions"]
              if c["type"] == "Failed"]
    assert failed[0]["reason"] == "InvalidSpec"
    assert "spec.data.train" in failed[0]["message"] and "gs://" in failed[0]["message"]
    assert not kube.pods("invalid")


def own_code_manifest(name: str, replicas: int = 2, **run_policy: Any) -> dict[str, Any]:
    """A TrainingJob running its own code (spec.trainer) instead of kubetrain's trainer."""
    manifest = job_manifest(name, replicas, **run_policy)
    for typed in ("image", "model", "data"):
        del manifest["spec"][typed]
    manifest["spec"]["trainer"] = {"image": "ghcr.io/me/train:1",
                                   "command": ["python", "train.py"], "args": ["--lr", "3e-4"]}
    return manifest


def status_secret(kube: Kube, job: str) -> dict[str, str]:
    """The job's Secret <job>-status, decoded."""
    import base64

    secret = kube.core.read_namespaced_secret(f"{job}-status", NAMESPACE)
    return {key: base64.b64decode(value).decode() for key, value in secret.data.items()}


def post_report(secret: dict[str, str], step: int, total_steps: int | None = None,
                loss: float | None = None, remaining: int | None = None,
                token: str | None = None, url: str | None = None) -> int:
    """POST a Kubeflow trainerStatus to the job's endpoint as its pods do; the HTTP status."""
    import json
    import ssl
    import urllib.error
    import urllib.request
    from datetime import UTC, datetime

    metrics = [{"name": "current_step", "value": str(step)}]
    if total_steps is not None:
        metrics.append({"name": "total_steps", "value": str(total_steps)})
    if loss is not None:
        metrics.append({"name": "loss", "value": str(loss)})
    status: dict[str, Any] = {"metrics": metrics, "lastUpdatedTime": datetime.now(UTC).isoformat()}
    if remaining is not None:
        status["estimatedRemainingSeconds"] = remaining
    context = ssl.create_default_context(cadata=secret["ca.crt"])
    request = urllib.request.Request(
        url or secret["url"], data=json.dumps({"trainerStatus": status}).encode(),
        method="POST", headers={"Authorization": f"Bearer {token or secret['token']}",
                                "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, context=context, timeout=10) as reply:
            return int(reply.status)
    except urllib.error.HTTPError as refused:
        return refused.code


def scenario_own_code_job_runs_and_reports_progress(kube: Kube) -> None:
    import kubernetes_validate

    manifest = own_code_manifest("own")
    manifest["spec"]["scheduling"] = {"gang": "None"}  # valid for 1.30: see the first one
    kube.create_job(manifest)
    pods = eventually(lambda: len(kube.pods("own")) == 2 and kube.pods("own"))
    uid = (kube.job("own") or {})["metadata"]["uid"]
    secret = status_secret(kube, "own")
    for pod in pods.values():
        created = {key: value for key, value in pod.items() if key != "status"}
        kubernetes_validate.validate(created, "1.30", strict=True)
        (container,) = pod["spec"]["containers"]
        assert container["image"] == "ghcr.io/me/train:1"
        assert container["command"][:3] == ["python3", "-m", "kubetrain.trainer.own_code"]
        assert container["command"][-4:] == ["torchrun", "train.py", "--lr", "3e-4"]
        env = {e["name"]: e for e in container["env"]}
        assert env["PET_RDZV_ID"]["value"] == uid
        assert env["KUBEFLOW_TRAINER_SERVER_URL"]["valueFrom"]["secretKeyRef"]["name"] == \
            "own-status"
        secrets = [v["secret"]["secretName"] for v in pod["spec"]["volumes"] if "secret" in v]
        assert secrets == ["own-status"]  # its own job's token only
    owner = kube.core.read_namespaced_secret("own-status", NAMESPACE).metadata.owner_references
    assert owner[0].uid == uid
    assert secret["url"].endswith("/namespaces/default/trainingjobs/own/status")
    kube.run_all("own")
    eventually(lambda: kube.phase("own") == "Running")
    assert post_report(secret, 40, total_steps=100, loss=2.5, remaining=120) == 200
    progress = eventually(lambda: ((kube.job("own") or {})["status"].get("progress", {})
                                   .get("step") == 40 and kube.job("own")),
                          what="the reported step in status.progress")["status"]["progress"]
    assert (progress["maxSteps"], progress["loss"], progress["etaSeconds"]) == (100, 2.5, 120)
    # Another own-code job's token cannot write this job's status.
    kube.create_job(own_code_manifest("other", replicas=1))
    eventually(lambda: kube.pods("other"))
    other = status_secret(kube, "other")
    assert other["token"] != secret["token"]
    assert post_report(secret, 99, token=other["token"]) == 403
    assert post_report(other, 7) == 200
    time.sleep(1.0)  # resyncs ran
    assert (kube.job("own") or {})["status"]["progress"]["step"] == 40
    eventually(lambda: (kube.job("other") or {}).get("status", {}).get("progress", {})
               .get("step") == 7, what="the other job's own report")
    kube.delete_job("other")


def scenario_own_code_restarts_suspends_and_scales(kube: Kube) -> None:
    kube.create_job(own_code_manifest("ownlife"))
    eventually(lambda: len(kube.pods("ownlife")) == 2)
    kube.run_all("ownlife")
    eventually(lambda: kube.phase("ownlife") == "Running")
    # A failed worker that is not worker 0 is replaced alone, with the own-code container.
    kube.set_pod_status("ownlife-worker-1", "Failed", exit_code=1)
    eventually(lambda: (kube.pods("ownlife").get("ownlife-worker-1", {}).get("metadata", {})
                        .get("labels", {}).get("kubetrain.io/restart-attempt") == "1"),
               what="worker 1 replaced")
    status = (kube.job("ownlife") or {})["status"]
    assert status["restarts"] == 1 and status["failures"] == {"Unknown": 1}
    pods = kube.pods("ownlife")
    assert pods["ownlife-worker-0"]["metadata"]["labels"]["kubetrain.io/restart-attempt"] == "0"
    assert "kubetrain.trainer.own_code" in pods["ownlife-worker-1"]["spec"]["containers"][0][
        "command"]
    # Worker 0 (the rendezvous host) failing restarts the whole group, once the group runs
    # again (a failure the operator sees before the replacement runs is another story).
    kube.run_all("ownlife")
    eventually(lambda: (kube.job("ownlife") or {}).get("status", {}).get("workers", {})
               .get("ready") == 2, what="both workers running again")
    kube.set_pod_status("ownlife-worker-0", "Failed", exit_code=1)
    eventually(lambda: {pod["metadata"]["labels"]["kubetrain.io/restart-attempt"]
                        for pod in kube.pods("ownlife").values()} == {"2"}
               and len(kube.pods("ownlife")) == 2, what="the whole group replaced")
    # Elastic scale through the scale subresource.
    kube.scale_job("ownlife", 3)
    eventually(lambda: set(kube.pods("ownlife")) == {f"ownlife-worker-{i}" for i in range(3)})
    # Suspend deletes every pod with its grace period (the SIGTERM save); resume recreates.
    kube.patch_job("ownlife", {"spec": {"runPolicy": {"suspend": True}}})
    eventually(lambda: kube.phase("ownlife") == "Suspended" and not kube.pods("ownlife"))
    kube.patch_job("ownlife", {"spec": {"runPolicy": {"suspend": False}}})
    eventually(lambda: len(kube.pods("ownlife")) == 3)
    # A command that cannot run (127) is a UserError that fails the job, never retried.
    kube.set_pod_status("ownlife-worker-2", "Failed", exit_code=127)
    eventually(lambda: kube.phase("ownlife") == "Failed")
    status = (kube.job("ownlife") or {})["status"]
    assert status["lastFailure"]["class"] == "UserError"
    kube.delete_job("ownlife")


def scenario_own_code_without_reported_progress_past_its_deadline_restarts(kube: Kube) -> None:
    kube.create_job(own_code_manifest("ownhang", replicas=1, progressDeadlineSeconds=3))
    eventually(lambda: len(kube.pods("ownhang")) == 1)
    kube.run_all("ownhang")
    eventually(lambda: kube.phase("ownhang") == "Running")
    secret = status_secret(kube, "ownhang")
    for step in (1, 2, 3):  # advancing: no hang
        assert post_report(secret, step, total_steps=10) == 200
        time.sleep(1.0)
    assert (kube.job("ownhang") or {})["status"].get("restarts", 0) == 0
    # The step stops advancing (the reporter still posts the same step): a hang.
    for _ in range(5):
        post_report(secret, 3, total_steps=10)
        time.sleep(0.5)
    status = eventually(lambda: ((kube.job("ownhang") or {})["status"].get("restarts") == 1
                                 and kube.job("ownhang")), timeout=15,
                        what="the hang restart")["status"]
    assert status["restart"]["reason"] == "ProgressDeadlineExceeded"
    assert status["progress"]["step"] == 3
    kube.delete_job("ownhang")


WORKLOAD_API = ("scheduling.k8s.io", "v1alpha2")


def _when(manifest: dict[str, Any]) -> Any:
    from datetime import datetime

    return datetime.fromisoformat(manifest["metadata"]["creationTimestamp"].replace("Z", "+00:00"))

KUEUE = ("kueue.x-k8s.io", "v1beta1")


def scenario_gang_groups_come_before_pods_and_go_with_suspend(kube: Kube) -> None:
    kube.require("WorkloadAPI")
    manifest = job_manifest("gang", replicas=2)
    manifest["spec"]["workers"]["minReplicas"] = 2
    kube.create_job(manifest)  # gang Auto: the cluster serves the Workload API
    pods = eventually(lambda: len(kube.pods("gang")) == 2 and kube.pods("gang"))
    workloads = kube.placement("gang", *WORKLOAD_API, "workloads")
    groups = kube.placement("gang", *WORKLOAD_API, "podgroups")
    assert list(workloads) == ["gang"] and list(groups) == ["gang-0"]
    uid = (kube.job("gang") or {})["metadata"]["uid"]
    for made in (*workloads.values(), *groups.values()):
        assert made["metadata"]["ownerReferences"][0]["uid"] == uid
        # Created before the pods (timestamps to the second, so: not after).
        assert _when(made) <= min(_when(pod) for pod in pods.values())
    assert groups["gang-0"]["spec"]["schedulingPolicy"]["gang"]["minCount"] == 2
    status = (kube.job("gang") or {})["status"]["scheduling"]
    assert (status["gang"], status["podGroup"]) == ("WorkloadAPI", "gang-0")
    assert "GangChosen" in kube.event_reasons("gang")
    # Suspend releases the group; resume makes it again before the new pods.
    kube.patch_job("gang", {"spec": {"runPolicy": {"suspend": True}}})
    eventually(lambda: not kube.pods("gang")
               and not kube.placement("gang", *WORKLOAD_API, "podgroups")
               and not kube.placement("gang", *WORKLOAD_API, "workloads"),
               what="the pods and the group released")
    kube.patch_job("gang", {"spec": {"runPolicy": {"suspend": False}}})
    eventually(lambda: len(kube.pods("gang")) == 2
               and kube.placement("gang", *WORKLOAD_API, "podgroups"), what="all back")
    kube.delete_job("gang")
    eventually(lambda: not kube.placement("gang", *WORKLOAD_API, "podgroups"),
               what="the group collected with its job")


def scenario_volcano_and_coscheduling_groups_follow_a_rescale(kube: Kube) -> None:
    kube.require("Volcano", "Coscheduling")
    for name, gang, api in (("volcano", "Volcano", ("scheduling.volcano.sh", "v1beta1")),
                            ("cosched", "Coscheduling", ("scheduling.x-k8s.io", "v1alpha1"))):
        manifest = job_manifest(name, replicas=2)
        del manifest["spec"]["workers"]["minReplicas"]  # the group's minimum is replicas
        manifest["spec"]["scheduling"] = {"gang": gang}
        kube.create_job(manifest)
        eventually(lambda name=name: len(kube.pods(name)) == 2)
        (group,) = kube.placement(name, *api, "podgroups").values()
        assert group["spec"]["minMember"] == 2
        kube.scale_job(name, 3)
        eventually(lambda name=name, api=api: kube.placement(name, *api, "podgroups")[name][
            "spec"]["minMember"] == 3, what=f"{gang}'s minMember follows the scale")
        eventually(lambda name=name: "GangResized" in kube.event_reasons(name),
                   what=f"{gang}'s GangResized event")
        kube.patch_job(name, {"spec": {"runPolicy": {"suspend": True}}})
        eventually(lambda name=name, api=api: not kube.placement(name, *api, "podgroups"),
                   what=f"suspend to release the {gang} group")
        kube.delete_job(name)


def scenario_kueue_admits_a_suspended_job_and_its_end_frees_the_quota(kube: Kube) -> None:
    kube.require("Kueue")
    kube.custom.create_cluster_custom_object(*KUEUE, "resourceflavors", {
        "apiVersion": "kueue.x-k8s.io/v1beta1", "kind": "ResourceFlavor",
        "metadata": {"name": "pool-a"}, "spec": {
            "nodeLabels": {"example.com/pool": "a"},
            "tolerations": [{"key": "example.com/pool", "operator": "Exists",
                             "effect": "NoSchedule"}]}})
    manifest = job_manifest("queued", replicas=2)
    manifest["spec"]["scheduling"] = {"queue": "team-a", "gang": "None"}
    kube.create_job(manifest)
    workload = eventually(lambda: next(iter(kube.placement(
        "queued", *KUEUE, "workloads").values()), None), what="the Kueue Workload")
    eventually(lambda: kube.phase("queued") == "Suspended", what="suspended until admitted")
    assert not kube.pods("queued")
    # Kueue admits it (the test writes what Kueue's scheduler would).
    kube.custom.patch_namespaced_custom_object_status(
        *KUEUE, NAMESPACE, "workloads", workload["metadata"]["name"], {"status": {
            "admission": {"clusterQueue": "cluster-queue", "podSetAssignments": [{
                "name": "workers", "count": 2, "flavors": {"cpu": "pool-a"}}]},
            "conditions": [{"type": "QuotaReserved", "status": "True", "reason": "Q",
                            "message": "", "lastTransitionTime": "2026-01-01T00:00:00Z"},
                           {"type": "Admitted", "status": "True", "reason": "A",
                            "message": "", "lastTransitionTime": "2026-01-01T00:00:00Z"}]}})
    pods = eventually(lambda: len(kube.pods("queued")) == 2 and kube.pods("queued"),
                      what="the admitted workers")
    for pod in pods.values():
        assert pod["spec"]["nodeSelector"]["example.com/pool"] == "a"
        assert any(t.get("key") == "example.com/pool" for t in pod["spec"]["tolerations"])
    assert "Admitted" in kube.event_reasons("queued")
    kube.set_pod_status("queued-worker-0", "Succeeded", exit_code=0)
    eventually(lambda: any(c["type"] == "Finished" and c["status"] == "True" for c in (
        kube.placement("queued", *KUEUE, "workloads")[workload["metadata"]["name"]]
        .get("status", {}).get("conditions", []))), what="the Workload marked Finished")
    # Another job with a queue, suspended by its user: its Workload goes.
    manifest = job_manifest("withdrawn", replicas=1)
    manifest["spec"]["scheduling"] = {"queue": "team-a", "gang": "None"}
    kube.create_job(manifest)
    eventually(lambda: kube.placement("withdrawn", *KUEUE, "workloads"))
    kube.patch_job("withdrawn", {"spec": {"runPolicy": {"suspend": True}}})
    eventually(lambda: not kube.placement("withdrawn", *KUEUE, "workloads"),
               what="the suspended job's Workload deleted")
    kube.delete_job("withdrawn")
    kube.delete_job("queued")


def scenario_a_job_managed_by_another_controller_is_left_alone(kube: Kube) -> None:
    manifest = job_manifest("elsewhere", replicas=2)
    manifest["spec"]["managedBy"] = "kueue.x-k8s.io/multikueue"
    kube.create_job(manifest)
    time.sleep(1.5)  # several resyncs
    job = kube.job("elsewhere") or {}
    assert not kube.pods("elsewhere") and "status" not in job, job.get("status")
    assert kube.event_reasons("elsewhere") == []
    kube.delete_job("elsewhere")


SCENARIOS = [
    scenario_job_creates_valid_children,
    scenario_failures_restart_then_rank_zero_completes,
    scenario_oom_killed_worker_restarts_the_group_with_half_the_micro_batch,
    scenario_permanent_exit_code_fails_the_job,
    scenario_scale_subresource_adds_and_removes_workers,
    scenario_suspend_and_resume,
    scenario_spec_change_updates_the_config_map_not_the_workers,
    scenario_deleting_a_job_removes_its_children,
    scenario_ttl_deletes_a_finished_job,
    scenario_invalid_spec_is_reported_not_crashed_on,
    scenario_own_code_job_runs_and_reports_progress,
    scenario_own_code_restarts_suspends_and_scales,
    scenario_own_code_without_reported_progress_past_its_deadline_restarts,
    scenario_gang_groups_come_before_pods_and_go_with_suspend,
    scenario_volcano_and_coscheduling_groups_follow_a_rescale,
    scenario_kueue_admits_a_suspended_job_and_its_end_frees_the_quota,
    scenario_a_job_managed_by_another_controller_is_left_alone,
]


def run_operator_scenarios() -> set[tuple[str, str]]:
    """Run every scenario on a fresh cluster; return the operator's (verb, resource) pairs."""
    import tempfile

    # With leader election, as several replicas run: its Lease calls are part of the footprint.
    with tempfile.TemporaryDirectory() as directory, \
            EmulatedCluster(Path(directory), placement=EVERY_PLACEMENT_API) as cluster, \
            running_operator(cluster, standalone=False, lease_seconds=2.0,
                             lease_retry_seconds=0.2) as config:
        kube = Kube(cluster)
        eventually(lambda: kube.lease_holder() == config.identity, what="the lease")
        for scenario in SCENARIOS:
            scenario(kube)
        return cluster.operator_calls()
