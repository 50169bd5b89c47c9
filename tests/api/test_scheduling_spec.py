"""spec.scheduling and spec.managedBy: what the server (CEL) and the models (`kubetrain
validate`) accept, how a refusal names the conflict and its fix, and what cannot change."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from kubetrain.api import parse_job

sys.path.insert(0, str(Path(__file__).parent))
from test_crd import (  # the server's CEL, evaluated; the models' refusal
    cel_violations,
    models_refusal,
)


def _job(minimal_manifest: dict[str, Any], scheduling: dict[str, Any] | None = None,
         **spec: Any) -> dict[str, Any]:
    document = copy.deepcopy(minimal_manifest)
    if scheduling is not None:
        document["spec"]["scheduling"] = scheduling
    document["spec"].update(spec)
    return document


VOLCANO_SCHEDULER = {"template": {"schedulerName": "volcano"}}
OTHER_SCHEDULER = {"template": {"schedulerName": "my-scheduler"}}

# (scheduling, workers, the words both refusals contain; None: accepted by both)
CASES: list[tuple[dict[str, Any], dict[str, Any] | None, str | None]] = [
    ({}, None, None),
    ({"gang": "WorkloadAPI", "queue": "team-a",
      "topology": {"level": "cloud.example.com/rack", "mode": "Required"}}, None, None),
    ({"gang": "Volcano", "volcanoQueue": "research"}, VOLCANO_SCHEDULER, None),
    ({"gang": "Volcano"}, None, None),
    ({"gang": "Coscheduling", "scheduleTimeoutSeconds": 120}, OTHER_SCHEDULER, None),
    ({"gang": "None", "topology": {"level": "kubernetes.io/hostname", "mode": "Preferred"}},
     None, None),
    ({"gang": "Auto", "volcanoQueue": "research"}, None, "set gang: Volcano"),
    ({"gang": "WorkloadAPI", "scheduleTimeoutSeconds": 60}, None, "set gang: Coscheduling"),
    ({"gang": "Volcano", "queue": "team-a"}, None, "both queue the job"),
    ({"gang": "Volcano"}, OTHER_SCHEDULER, "set it to volcano"),
]


@pytest.mark.parametrize(("scheduling", "workers", "refused"), CASES)
def test_scheduling_combinations_are_judged_alike_by_the_server_and_the_models(
        minimal_manifest: dict[str, Any], scheduling: dict[str, Any],
        workers: dict[str, Any] | None, refused: str | None) -> None:
    document = _job(minimal_manifest, scheduling)
    if workers is not None:
        document["spec"]["workers"] = workers
    violations = cel_violations(document)
    refusal = models_refusal(document)
    if refused is None:
        assert violations == [] and refusal is None, (violations, refusal)
    else:
        assert any(refused in message for message in violations), violations
        assert refusal is not None and refused in refusal, refusal
        assert "spec.scheduling." in refusal


@pytest.mark.parametrize("level", ["rack", "cloud.example.com/rack", "kubernetes.io/hostname"])
def test_a_topology_level_is_a_node_label_key(minimal_manifest: dict[str, Any],
                                              level: str) -> None:
    assert models_refusal(_job(minimal_manifest, {"topology": {"level": level}})) is None


@pytest.mark.parametrize("level", ["", "a rack", "/rack", "Rack.Example.com/x"])
def test_a_topology_level_that_is_no_label_key_is_refused(minimal_manifest: dict[str, Any],
                                                         level: str) -> None:
    refusal = models_refusal(_job(minimal_manifest, {"topology": {"level": level}}))
    assert refusal is not None and "spec.scheduling.topology.level" in refusal
    if level:  # the empty one says "must not be empty"; the others what a label key is
        assert f"({level}) is not a node label key" in refusal
        assert "kubernetes.io/hostname" in refusal


def test_a_queue_label_and_spec_queue_that_differ_are_refused_naming_both(
        minimal_manifest: dict[str, Any]) -> None:
    document = _job(minimal_manifest, {"queue": "team-a"})
    document["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": "team-b"}
    refusal = models_refusal(document)
    assert refusal is not None
    assert "spec.scheduling.queue (team-a)" in refusal and "(team-b)" in refusal
    assert "remove the label" in refusal
    document["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] = "team-a"
    assert models_refusal(document) is None


def _stored(manifest: dict[str, Any]) -> dict[str, Any]:
    """The object as the API server stores it: schema defaults applied."""
    return parse_job(manifest).model_dump(by_alias=True, exclude_none=True, mode="json")


@pytest.mark.parametrize(("before", "after", "refused"), [
    (None, "kueue.x-k8s.io/multikueue", True),
    ("kueue.x-k8s.io/multikueue", None, True),
    ("kueue.x-k8s.io/multikueue", "example.com/other", True),
    ("kueue.x-k8s.io/multikueue", "kueue.x-k8s.io/multikueue", False),
    (None, None, False),
])
def test_managed_by_is_immutable_as_jobs_is(minimal_manifest: dict[str, Any],
                                            before: str | None, after: str | None,
                                            refused: bool) -> None:
    old = _stored(_job(minimal_manifest, **({"managedBy": before} if before else {})))
    new = copy.deepcopy(old)
    new["spec"].pop("managedBy", None)
    if after is not None:
        new["spec"]["managedBy"] = after
    violations = cel_violations(new, old)
    assert any("managedBy is immutable" in message for message in violations) == refused


def test_the_gang_mechanism_cannot_change_but_the_queue_and_topology_can(
        minimal_manifest: dict[str, Any]) -> None:
    old = _stored(_job(minimal_manifest, {"gang": "WorkloadAPI"}))
    changed = copy.deepcopy(old)
    changed["spec"]["scheduling"]["gang"] = "None"
    assert any("gang cannot change" in message for message in cel_violations(changed, old))
    moved = copy.deepcopy(old)
    moved["spec"]["scheduling"].update(queue="team-b", topology={"level": "rack"})
    assert cel_violations(moved, old) == []


@pytest.mark.parametrize("value", ["kubetrain", "a" * 60 + "/operator", "Kueue.x-k8s.io/x",
                                   "example.com/a b"])
def test_managed_by_must_be_a_short_domain_prefixed_path(minimal_manifest: dict[str, Any],
                                                         value: str) -> None:
    refusal = models_refusal(_job(minimal_manifest, managedBy=value))
    assert refusal is not None and "spec.managedBy" in refusal
    if len(value) <= 63:  # not a path: the refusal shows one, not the regular expression
        assert f"spec.managedBy ({value}) is not a controller's name" in refusal
        assert "kueue.x-k8s.io/multikueue" in refusal and "remove managedBy" in refusal


def test_kubetrain_validate_names_the_conflict_and_the_fix(
        minimal_manifest: dict[str, Any], tmp_path: Path) -> None:
    document = _job(minimal_manifest, {"gang": "Volcano", "queue": "team-a"})
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(document))
    done = subprocess.run([sys.executable, "-m", "kubetrain", "validate", str(path)],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 1
    assert "spec.scheduling.queue" in done.stderr and "volcanoQueue" in done.stderr, done.stderr


def test_kubetrain_validate_says_how_a_valid_job_is_placed(
        minimal_manifest: dict[str, Any], tmp_path: Path) -> None:
    document = _job(minimal_manifest, {"queue": "team-a", "topology": {"level": "rack"}})
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(document))
    done = subprocess.run([sys.executable, "-m", "kubetrain", "validate", str(path)],
                          capture_output=True, text=True, check=True)
    assert "gang Auto" in done.stdout and "Kueue Workload" in done.stdout, done.stdout
    assert "rack" in done.stdout
