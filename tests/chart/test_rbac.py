"""Least privilege, measured: the chart grants the operator exactly the API calls it makes.

The calls come from the operator's own integration scenarios run against the
emulated API server (`run_operator_scenarios` in tests/operator/harness.py), which
records every (verb, resource) the operator sends.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kubetrain.operator.leader import LEASE_NAME

REPO = Path(__file__).resolve().parents[2]
HARNESS = REPO / "tests" / "operator" / "harness.py"
# Leader election: only granted, and only used, with more than one operator replica
# (the scenarios run with it on, as several replicas do). Resources are named as the
# recorded calls name them: prefixed with their API group outside the core group.
LEADER_ELECTION = {"coordination.k8s.io/leases"}
Render = Callable[[dict[str, Any]], list[dict[str, Any]]]
Calls = set[tuple[str, str]]


@pytest.fixture(scope="module")
def recorded_calls() -> Calls:
    """(verb, resource) of every request the operator made in its integration scenarios."""
    spec = importlib.util.spec_from_file_location("operator_harness", HARNESS)
    assert spec is not None and spec.loader is not None, f"cannot load {HARNESS}"
    harness = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(harness)
    calls: Calls = set(harness.run_operator_scenarios())
    assert calls, "the operator scenarios recorded no API calls"
    return calls


def _operator_roles(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The Roles and ClusterRoles bound to the operator's ServiceAccount (not the user roles)."""
    account = _operator_deployment(objects)["spec"]["template"]["spec"]["serviceAccountName"]
    bound: set[tuple[str, str | None, str]] = set()  # (kind, namespace, name) of a role
    for binding in objects:
        if binding["kind"] in ("RoleBinding", "ClusterRoleBinding") and any(
                subject["kind"] == "ServiceAccount" and subject["name"] == account
                for subject in binding["subjects"]):
            ref = binding["roleRef"]
            namespace = binding["metadata"]["namespace"] if ref["kind"] == "Role" else None
            bound.add((ref["kind"], namespace, ref["name"]))
    roles = [role for role in objects if role["kind"] in ("Role", "ClusterRole")
             and (role["kind"], role["metadata"].get("namespace"), role["metadata"]["name"])
             in bound]
    assert len(roles) == len(bound), "a binding names a role the chart does not render"
    return roles


def _operator_deployment(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (deployment,) = [o for o in objects if o["kind"] == "Deployment"]
    return deployment


def _operator_args(objects: list[dict[str, Any]]) -> list[str]:
    return list(_operator_deployment(objects)["spec"]["template"]["spec"]["containers"][0][
        "args"])


def _operator_grants(objects: list[dict[str, Any]]) -> Calls:
    """(verb, group/resource) granted to the operator's ServiceAccount (the core group's
    resources without a prefix), as `cluster.operator_calls()` names them."""
    grants: Calls = set()
    for role in _operator_roles(objects):
        for rule in role["rules"]:
            assert "*" not in rule["verbs"] and "*" not in rule["resources"], rule
            assert "*" not in rule["apiGroups"], rule
            grants.update((verb, f"{group}/{resource}" if group else resource)
                          for verb in rule["verbs"] for group in rule["apiGroups"]
                          for resource in rule["resources"])
    return grants


def test_operator_role_grants_exactly_the_calls_the_operator_makes(
    render: Render, recorded_calls: Calls
) -> None:
    needed = {call for call in recorded_calls if call[1] not in LEADER_ELECTION}
    granted = _operator_grants(render({}))
    assert needed - granted == set(), f"the operator calls these but is not granted them: " \
        f"{sorted(needed - granted)}"
    assert granted - needed == set(), f"granted but never used (least privilege): " \
        f"{sorted(granted - needed)}"


def test_namespaced_mode_grants_the_same_calls(
    render: Render, variants: dict[str, dict[str, Any]]
) -> None:
    assert _operator_grants(render(variants["namespaced"])) == _operator_grants(render({}))


@pytest.mark.parametrize("mode", ["cluster", "namespaced"])
def test_several_replicas_add_exactly_the_lease_calls_in_the_release_namespace(
    render: Render, recorded_calls: Calls, mode: str
) -> None:
    values: dict[str, Any] = {"rbac": {"mode": mode, "namespaces": ["team-a"]}}
    single = _operator_grants(render(values))
    objects = render({**values, "replicas": 2})
    added = _operator_grants(objects) - single
    lease_calls = {call for call in recorded_calls if call[1] in LEADER_ELECTION}
    assert lease_calls, "the scenarios ran with leader election but recorded no Lease call"
    assert added == lease_calls
    # Only a Role in the release namespace grants them, and reads and renewals only
    # on the operator's own Lease (the one --lease-namespace points at).
    release_namespace = _operator_deployment(objects)["metadata"]["namespace"]
    lease_roles = [role for role in _operator_roles(objects)
                   if any("leases" in rule["resources"] for rule in role["rules"])]
    assert [(role["kind"], role["metadata"]["namespace"]) for role in lease_roles] == [
        ("Role", release_namespace)]
    for rule in lease_roles[0]["rules"]:
        if set(rule["verbs"]) - {"create"}:  # a Lease not created yet has no name to check
            assert rule["resourceNames"] == [LEASE_NAME]
    args = _operator_args(objects)
    assert f"--lease-namespace={release_namespace}" in args
    assert "--standalone" not in args


def test_a_single_replica_runs_standalone_without_lease_grants(render: Render) -> None:
    objects = render({})
    args = _operator_args(objects)
    assert "--standalone" in args
    assert not [a for a in args if a.startswith("--lease-namespace")]
    assert not {resource for _, resource in _operator_grants(objects)} & LEADER_ELECTION
