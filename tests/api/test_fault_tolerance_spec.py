"""spec.faultTolerance (replica groups, torchft): what the server (CEL) and the models
(`kubetrain validate`) accept, how each refusal names the field and the fix in the same
words, and what cannot change."""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kubetrain.api import parse_job
from kubetrain.api.trainingjob import FaultToleranceSpec
from kubetrain.validate import schema_problems

sys.path.insert(0, str(Path(__file__).parent))
from test_crd import (  # the server's CEL, evaluated; the models' refusal
    cel_violations,
    models_refusal,
    validate_command,
    with_sections,
)


def _own_code(document: dict[str, Any]) -> dict[str, Any]:
    for typed in ("image", "model", "data"):
        document["spec"].pop(typed)
    document["spec"]["trainer"] = {"image": "ghcr.io/me/train:1", "command": ["train"]}
    return document


TWO_GROUPS = {"replicaGroups": 2}

ACCEPTED: list[dict[str, dict[str, Any]]] = [
    {"faultTolerance": TWO_GROUPS, "workers": {"replicas": 2, "procsPerWorker": 2}},
    {"faultTolerance": {"replicaGroups": 2, "minReplicaGroups": 2, "quorumTimeoutSeconds": 30,
                        "heartbeatTimeoutMilliseconds": 500,
                        "collectiveTimeoutMilliseconds": 2000},
     "workers": {"replicas": 4}, "parallelism": {"strategy": "ddp"}},
    {"faultTolerance": {"replicaGroups": 3}, "workers": {"replicas": 6, "minReplicas": 6,
                                                         "maxReplicas": 6}},
    {"faultTolerance": {"replicaGroups": 2}, "workers": {"replicas": 4, "procsPerWorker": 4},
     "parallelism": {"strategy": "fsdp", "tensorParallel": 2}},
    # Without faultTolerance, nothing here applies: an elastic hsdp job of 3 pods.
    {"workers": {"replicas": 3, "minReplicas": 1, "maxReplicas": 4},
     "parallelism": {"strategy": "hsdp"}},
]


@pytest.mark.parametrize("sections", ACCEPTED)
def test_replica_groups_of_whole_pods_sharded_within_are_accepted_by_server_and_models(
        minimal_manifest: dict[str, Any], sections: dict[str, dict[str, Any]]) -> None:
    document = with_sections(minimal_manifest, **sections)
    assert cel_violations(document) == [] and list(schema_problems(document)) == []
    assert models_refusal(document) is None


def test_an_own_code_job_takes_replica_groups_as_written_and_as_stored(
        minimal_manifest: dict[str, Any]) -> None:
    """Own code leaves parallelism at its default (fsdp), which the groups accept."""
    document = _own_code(with_sections(minimal_manifest, faultTolerance=TWO_GROUPS,
                              workers={"replicas": 2}))
    stored = parse_job(document).model_dump(by_alias=True, exclude_none=True, mode="json")
    for version in (document, stored):
        assert cel_violations(version) == [] and list(schema_problems(version)) == []
    assert models_refusal(document) is None


# (sections, the refused field under spec, its value, words of the fix)
REFUSED: list[tuple[dict[str, dict[str, Any]], str, object, str]] = [
    ({"faultTolerance": TWO_GROUPS, "workers": {"replicas": 3}},
     "workers.replicas", 3, "must be a multiple of faultTolerance.replicaGroups"),
    ({"faultTolerance": TWO_GROUPS},  # workers.replicas defaults to 1
     "workers.replicas", 1, "set replicas to replicaGroups x the pods of one group"),
    ({"faultTolerance": {"replicaGroups": 2, "minReplicaGroups": 3}, "workers": {"replicas": 2}},
     "faultTolerance.minReplicaGroups", 3, "lower minReplicaGroups or raise replicaGroups"),
    ({"faultTolerance": TWO_GROUPS, "workers": {"replicas": 4},
      "parallelism": {"strategy": "hsdp"}},
     "parallelism.strategy", "hsdp", "use fsdp to shard within a group, or ddp"),
    ({"faultTolerance": TWO_GROUPS, "workers": {"replicas": 4},
      "parallelism": {"strategy": "auto"}},
     "parallelism.strategy", "auto", "must be fsdp or ddp with faultTolerance"),
    ({"faultTolerance": TWO_GROUPS, "workers": {"replicas": 4, "minReplicas": 2}},
     "workers.minReplicas", 2, "remove minReplicas or set it to replicas"),
    ({"faultTolerance": TWO_GROUPS, "workers": {"replicas": 4, "maxReplicas": 8}},
     "workers.maxReplicas", 8, "remove maxReplicas or set it to replicas"),
]


@pytest.mark.parametrize(("sections", "field", "value", "fix"), REFUSED)
def test_each_refusal_names_the_field_and_the_fix_alike_on_server_and_in_models(
        minimal_manifest: dict[str, Any], sections: dict[str, dict[str, Any]], field: str,
        value: object, fix: str) -> None:
    document = with_sections(minimal_manifest, **sections)
    (server,) = cel_violations(document)
    models = models_refusal(document)
    assert models is not None and models.startswith(f"spec.{field} ({value}) "), models
    assert fix in server and fix in models
    # The same words: the server names the field (as its rule's object sees it), the models
    # its whole path and value.
    named, _, why = server.partition(" ")
    assert field.endswith(named)
    assert models == f"spec.{field} ({value}) {why}"


@pytest.mark.parametrize(("field", "value"), [
    ("replicaGroups", 1), ("replicaGroups", 65), ("minReplicaGroups", 0),
    ("quorumTimeoutSeconds", 0), ("quorumTimeoutSeconds", 3601),
    ("heartbeatTimeoutMilliseconds", 99), ("heartbeatTimeoutMilliseconds", 60001),
    ("collectiveTimeoutMilliseconds", 999), ("collectiveTimeoutMilliseconds", 600001),
])
def test_values_out_of_range_are_refused_by_the_schema_and_the_models(
        minimal_manifest: dict[str, Any], field: str, value: int) -> None:
    groups = {"replicaGroups": 2, field: value}
    document = with_sections(minimal_manifest, faultTolerance=groups, workers={"replicas": 2})
    assert [p.path for p in schema_problems(document)] == [f"spec.faultTolerance.{field}"]
    refusal = models_refusal(document)
    assert refusal is not None and f"spec.faultTolerance.{field}" in refusal


def test_replica_groups_are_required_in_the_section(minimal_manifest: dict[str, Any]) -> None:
    document = with_sections(minimal_manifest, faultTolerance={"minReplicaGroups": 1})
    refusal = models_refusal(document)
    assert refusal is not None and "spec.faultTolerance.replicaGroups" in refusal
    assert any(p.path.startswith("spec.faultTolerance") for p in schema_problems(document))


counts = st.one_of(st.none(), st.integers(min_value=1, max_value=12))


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # copied, never mutated
@given(groups=st.integers(min_value=2, max_value=4),
       min_groups=st.integers(min_value=1, max_value=5),
       replicas=st.integers(min_value=1, max_value=12), low=counts, high=counts,
       strategy=st.sampled_from(["fsdp", "ddp", "hsdp", "auto"]))
def test_cel_fault_tolerance_rules_agree_with_the_models(
        minimal_manifest: dict[str, Any], groups: int, min_groups: int, replicas: int,
        low: int | None, high: int | None, strategy: str) -> None:
    workers = {"replicas": replicas, "minReplicas": low, "maxReplicas": high}
    document = with_sections(minimal_manifest, parallelism={"strategy": strategy},
                    faultTolerance={"replicaGroups": groups, "minReplicaGroups": min_groups},
                    workers={k: v for k, v in workers.items() if v is not None})
    assert (not cel_violations(document)) == (models_refusal(document) is None)


def _stored(manifest: dict[str, Any]) -> dict[str, Any]:
    """The object as the API server stores it: schema defaults applied."""
    return parse_job(manifest).model_dump(by_alias=True, exclude_none=True, mode="json")


def test_replica_groups_cannot_change_but_the_timeouts_and_min_groups_can(
        minimal_manifest: dict[str, Any]) -> None:
    old = _stored(with_sections(minimal_manifest, faultTolerance=TWO_GROUPS,
                                workers={"replicas": 4}))
    regrouped = copy.deepcopy(old)
    regrouped["spec"]["faultTolerance"]["replicaGroups"] = 4
    (refused,) = cel_violations(regrouped, old)
    assert refused.startswith("replicaGroups cannot change after creation")
    assert "checkpoint.resumeFrom" in refused
    tuned = copy.deepcopy(old)
    tuned["spec"]["faultTolerance"].update(minReplicaGroups=2, quorumTimeoutSeconds=120,
                                           heartbeatTimeoutMilliseconds=5000,
                                           collectiveTimeoutMilliseconds=30000)
    assert cel_violations(tuned, old) == []


def test_fault_tolerance_cannot_be_added_or_removed_after_creation(
        minimal_manifest: dict[str, Any]) -> None:
    plain = _stored(with_sections(minimal_manifest, workers={"replicas": 4}))
    grouped = _stored(with_sections(minimal_manifest, faultTolerance=TWO_GROUPS,
                                    workers={"replicas": 4}))
    for old, new in ((plain, grouped), (grouped, plain)):
        (refused,) = cel_violations(new, old)
        assert refused.startswith("faultTolerance cannot be added or removed after creation")
        assert "checkpoint.resumeFrom" in refused
    assert cel_violations(grouped, grouped) == []


def test_pods_per_group_divides_the_workers_among_the_groups() -> None:
    groups = FaultToleranceSpec(replica_groups=2)
    assert (groups.min_replica_groups, groups.quorum_timeout_seconds,
            groups.heartbeat_timeout_milliseconds) == (1, 60, 1000)
    assert [groups.pods_per_group(replicas) for replicas in (2, 4, 8)] == [1, 2, 4]


def test_kubetrain_validate_prints_the_field_and_the_fix(
        minimal_manifest: dict[str, Any], tmp_path: Path) -> None:
    done = validate_command(with_sections(minimal_manifest, faultTolerance=TWO_GROUPS,
                                          workers={"replicas": 3}), tmp_path)
    assert done.returncode == 1
    assert ("spec.workers.replicas (3) must be a multiple of faultTolerance.replicaGroups"
            in done.stderr), done.stderr
    assert "set replicas to replicaGroups x the pods of one group" in done.stderr
