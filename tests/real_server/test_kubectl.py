"""kubectl as users use it, against the real control plane and the operator in namespaced mode.

The operator runs as the chart renders it with `rbac.mode: namespaced` for the
namespace `team-a`: a Role there, no cluster-wide rights beyond reading Nodes. Every
step is a real `kubectl` command: apply, get, explain, scale, patch, describe,
delete. No kubelet runs, so pods stay Pending; what is checked is what the API server,
the operator and the controller-manager do with the objects.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from operator_process import OperatorProcess, install_operator_identity

from kubetrain.api.trainingjob import Workers

pytestmark = pytest.mark.real_server

REPO = Path(__file__).resolve().parents[2]
TEAM = "team-a"
T = TypeVar("T")


def eventually(check: Callable[[], T], what: str, timeout: float = 30) -> T:
    deadline = time.monotonic() + timeout
    while not (result := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.2)
    return result


@pytest.fixture(scope="module")
def operator_identity(control_plane: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The chart's ServiceAccount under namespaced RBAC for team-a: its kubeconfig."""
    control_plane.kubectl("create", "namespace", TEAM, check=False)
    return install_operator_identity(
        control_plane, {"rbac": {"mode": "namespaced", "namespaces": [TEAM]}},
        tmp_path_factory.mktemp("namespaced-operator"))


@pytest.fixture(scope="module")
def operator(operator_identity: Path) -> Iterator[OperatorProcess]:
    with OperatorProcess(operator_identity, operator_identity.parent / "operator.log",
                         namespaces=(TEAM,)) as process:
        yield process
    assert not process.denied_requests(), "\n".join(process.denied_requests())


def pods(plane: Any, job: str) -> set[str]:
    listed = plane.kubectl("get", "pods", "-n", TEAM, "-l", f"kubetrain.io/job-name={job}",
                           "-o", "jsonpath={.items[*].metadata.name}").stdout
    return set(listed.split())


def phase(plane: Any, job: str) -> str:
    return str(plane.kubectl("get", "tj", job, "-n", TEAM, "-o",
                             "jsonpath={.status.phase}").stdout)


def test_every_example_applies(control_plane: Any, operator: OperatorProcess) -> None:
    for example in sorted((REPO / "examples").glob("*.yaml")):
        applied = control_plane.kubectl("apply", "-n", TEAM, "-f", str(example))
        assert "created" in applied.stdout and "Warning" not in applied.stderr, example
    kustomized = control_plane.kubectl("apply", "-n", TEAM, "-k",
                                       str(REPO / "examples" / "gitops" / "trainingjobs"))
    assert "trainingjob.kubetrain.io/llama-125m-demo created" in kustomized.stdout
    # The operator takes each of them up: worker pods exist, phase is set.
    eventually(lambda: len(pods(control_plane, "quickstart")) == 2, "the quickstart's pods")
    eventually(lambda: phase(control_plane, "llama-1b") == "Pending", "llama-1b's phase")


def test_get_shows_phase_step_loss_workers_goodput_and_eta_from_status(
        control_plane: Any) -> None:
    # In `default`, which the namespaced operator does not watch, the status written
    # here stays as written: the columns show exactly what status holds.
    control_plane.kubectl("apply", "-f", str(REPO / "examples" / "quickstart.yaml"))
    status = {"phase": "Running", "progress": {"step": 1234, "loss": 2.875, "etaSeconds": 5400},
              "workers": {"desired": 2, "ready": 2},
              "goodput": {"ratio": 0.9312, "productiveSeconds": 930, "wallSeconds": 1000},
              "effective": {"microBatchSize": 4, "gradientAccumulationSteps": 4},
              "lastFailure": {"class": "OOMKilled", "pod": "quickstart-worker-1"}}
    control_plane.kubectl("patch", "tj", "quickstart", "--subresource=status",
                          "--type=merge", "-p", json.dumps({"status": status}))
    table = control_plane.kubectl("get", "tj", "quickstart").stdout.splitlines()
    assert table[0].split() == ["NAME", "PHASE", "STEP", "LOSS", "WORKERS", "GOODPUT", "ETA",
                                "AGE"]
    name, shown_phase, step, loss, workers, goodput, eta, age = table[1].split()
    assert (name, shown_phase, step, loss, workers, goodput, eta) == (
        "quickstart", "Running", "1234", "2.875", "2", "0.9312", "5400")
    assert age[-1] in "sm"
    # -o wide adds what an out-of-memory restart changed, and the last failure's class.
    wide = control_plane.kubectl("get", "tj", "quickstart", "-o", "wide").stdout.splitlines()
    assert wide[0].split()[-3:] == ["MICRO-BATCH", "LAST-FAILURE", "AGE"]
    assert wide[1].split()[-3:-1] == ["4", "OOMKilled"]


def test_explain_prints_the_field_descriptions(control_plane: Any) -> None:
    explained = control_plane.kubectl("explain", "trainingjob.spec.workers").stdout
    text = " ".join(explained.split())
    for name, field in Workers.model_fields.items():
        description = " ".join((field.description or "").split())
        assert description and description[:60] in text, (name, description)


def test_scale_goes_through_the_scale_subresource_and_the_operator_follows(
        control_plane: Any, operator: OperatorProcess) -> None:
    control_plane.kubectl("apply", "-n", TEAM, "-f", str(REPO / "examples" / "quickstart.yaml"))
    eventually(lambda: len(pods(control_plane, "quickstart")) == 2, "two workers")
    control_plane.kubectl("scale", "tj/quickstart", "-n", TEAM, "--replicas=3")
    eventually(lambda: pods(control_plane, "quickstart") == {
        f"quickstart-worker-{i}" for i in range(3)}, "a third worker")
    scale = json.loads(control_plane.kubectl(
        "get", "--raw",
        f"/apis/kubetrain.io/v1alpha1/namespaces/{TEAM}/trainingjobs/quickstart/scale").stdout)
    assert scale["kind"] == "Scale" and scale["spec"]["replicas"] == 3
    control_plane.kubectl("scale", "tj/quickstart", "-n", TEAM, "--replicas=1")
    eventually(lambda: pods(control_plane, "quickstart") == {"quickstart-worker-0"},
               "one worker left")


def test_suspend_and_resume_with_patch_then_describe(
        control_plane: Any, operator: OperatorProcess) -> None:
    control_plane.kubectl("apply", "-n", TEAM, "-f",
                          str(REPO / "examples" / "gpu-single-node.yaml"))
    eventually(lambda: pods(control_plane, "llama-350m"), "llama-350m's worker")
    control_plane.kubectl("patch", "tj/llama-350m", "-n", TEAM, "--type=merge", "-p",
                          '{"spec":{"runPolicy":{"suspend":true}}}')
    eventually(lambda: phase(control_plane, "llama-350m") == "Suspended"
               and not pods(control_plane, "llama-350m"), "suspended with no pods")
    control_plane.kubectl("patch", "tj/llama-350m", "-n", TEAM, "--type=merge", "-p",
                          '{"spec":{"runPolicy":{"suspend":false}}}')
    eventually(lambda: pods(control_plane, "llama-350m"), "the worker back after resume")

    def described() -> str:
        text = str(control_plane.kubectl("describe", "tj", "llama-350m", "-n", TEAM).stdout)
        return text if "Resumed" in text else ""

    text = eventually(described, "the Resumed event in describe")
    assert "Conditions:" in text and "Suspended" in text and "Events:" in text


def test_pods_the_server_refuses_are_reported_on_the_job_then_created_once_fixed(
        control_plane: Any, operator: OperatorProcess) -> None:
    # fsdp-multi-node.yaml names a PriorityClass and a ServiceAccount this cluster lacks:
    # admission refuses its pods, and `kubectl describe` says why.
    control_plane.kubectl("apply", "-n", TEAM, "-f",
                          str(REPO / "examples" / "fsdp-multi-node.yaml"))

    def failed_create() -> str:
        events = control_plane.kubectl(
            "get", "events", "-n", TEAM, "--field-selector",
            "involvedObject.name=llama-1b,reason=FailedCreate", "-o",
            "jsonpath={.items[*].message}").stdout
        return str(events)

    message = eventually(failed_create, "a FailedCreate event on llama-1b")
    assert "training-high" in message or "trainer" in message, message
    assert not pods(control_plane, "llama-1b")
    control_plane.kubectl("create", "priorityclass", "training-high", "--value=1000")
    control_plane.kubectl("create", "serviceaccount", "trainer", "-n", TEAM)
    eventually(lambda: len(pods(control_plane, "llama-1b")) == 4, "llama-1b's four workers")


def test_delete_removes_every_child_through_the_garbage_collector(
        control_plane: Any, operator: OperatorProcess) -> None:
    eventually(lambda: len(pods(control_plane, "llama-1b")) >= 2, "llama-1b's workers")
    # The operator is stopped first, so only kube-controller-manager can remove them.
    operator.stop()
    try:
        control_plane.kubectl("delete", "tj", "llama-1b", "-n", TEAM, "--wait=false")

        def children() -> str:
            return str(control_plane.kubectl(
                "get", "pods,services,configmaps", "-n", TEAM, "-o", "name",
                "-l", "kubetrain.io/job-name=llama-1b").stdout.strip())

        eventually(lambda: not children(), "the garbage collector to delete the children",
                   timeout=60)
        eventually(lambda: "llama-1b" not in control_plane.kubectl(
            "get", "configmaps,services", "-n", TEAM, "-o", "name").stdout,
                   "the ConfigMap and Service to go")
    finally:
        operator.start()


def test_the_operator_is_denied_what_the_chart_does_not_grant(
        control_plane: Any, operator_identity: Path) -> None:
    def can(*args: str) -> bool:
        answer = control_plane.kubectl("auth", "can-i", *args, check=False,
                                       kubeconfig=operator_identity)
        return answer.stdout.strip() == "yes"

    assert can("create", "pods", "-n", TEAM)
    assert can("patch", "trainingjobs", "--subresource=status", "-n", TEAM)
    assert not can("create", "pods", "-n", "default")
    assert not can("get", "secrets", "-n", TEAM)
    assert not can("update", "trainingjobs", "-n", TEAM)  # the spec is the user's
    refused = control_plane.kubectl("get", "secrets", "-n", TEAM, check=False,
                                    kubeconfig=operator_identity)
    assert refused.returncode != 0 and "Forbidden" in refused.stderr
