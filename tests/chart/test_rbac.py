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

REPO = Path(__file__).resolve().parents[2]
HARNESS = REPO / "tests" / "operator" / "harness.py"
# Leader election: only granted, and only used, with more than one operator replica.
PEERING = {"clusterkopfpeerings", "kopfpeerings"}
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


def _operator_grants(objects: list[dict[str, Any]]) -> Calls:
    """(verb, resource) granted by the operator's Roles and ClusterRoles (not the user roles)."""
    grants: Calls = set()
    for role in objects:
        if role["kind"] in ("Role", "ClusterRole") and role["metadata"]["name"].endswith(
                "-operator"):
            for rule in role["rules"]:
                assert "*" not in rule["verbs"] and "*" not in rule["resources"], rule
                grants.update((verb, resource) for verb in rule["verbs"]
                              for resource in rule["resources"])
    return grants


def test_operator_role_grants_exactly_the_calls_the_operator_makes(
    render: Render, recorded_calls: Calls
) -> None:
    needed = {call for call in recorded_calls if call[1] not in PEERING}
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
def test_several_replicas_add_only_their_peering_grants(
    render: Render, recorded_calls: Calls, mode: str
) -> None:
    values: dict[str, Any] = {"rbac": {"mode": mode, "namespaces": ["team-a"]}}
    single = _operator_grants(render(values))
    several = _operator_grants(render({**values, "replicas": 2}))
    added = several - single
    assert added, "several replicas need kopf peering"
    assert {resource for _, resource in added} <= PEERING
    peering_calls = {verb for verb, resource in recorded_calls if resource in PEERING}
    if peering_calls:  # scenarios with peering ran: grant exactly what they used
        assert {verb for verb, _ in added} == peering_calls
