"""What GitOps tools make of every TrainingJob status the real operator wrote: Argo CD's
health check (charts/kubetrain/argocd/trainingjob-health.lua) run by a real Lua 5.1
interpreter (lupa; Argo CD's gopher-lua is Lua 5.1), with the copies the docs carry, and
kstatus's rules (Flux), as test_kstatus.py writes them.

The statuses are not written by hand: the operator (kopf, in a thread) drives the
harness's scenarios against kmock's emulator, which keeps every version of every object;
each version of each TrainingJob is fed to the script as Argo CD feeds it (`obj`).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from lupa import lua51

sys.path.insert(0, str(Path(__file__).parent))
import harness
from harness import EmulatedCluster, Kube, running_operator
from test_kstatus import EXPECTED, kstatus_status

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "charts" / "kubetrain" / "argocd" / "trainingjob-health.lua"
ARGOCD_KEY = "resource.customizations.health.kubetrain.io_TrainingJob"
JOBS = "kubetrain.io/v1alpha1/trainingjobs"
# The mapping, phase by phase.
HEALTH = {"Pending": "Progressing", "Running": "Progressing", "Restarting": "Progressing",
          "Succeeded": "Healthy", "Failed": "Degraded", "Suspended": "Suspended"}
# Scenarios that together take jobs through every phase (and an invalid spec's Failed).
SCENARIOS = [
    harness.scenario_failures_restart_then_rank_zero_completes,
    harness.scenario_oom_killed_worker_restarts_the_group_with_half_the_micro_batch,
    harness.scenario_permanent_exit_code_fails_the_job,
    harness.scenario_suspend_and_resume,
    harness.scenario_invalid_spec_is_reported_not_crashed_on,
]


def health(job: dict[str, Any]) -> dict[str, str]:
    """What Argo CD would show for `job`: the script's {status, message}."""
    # Only the libraries Argo CD's Lua VM opens (base, table, string, math).
    runtime = lua51.LuaRuntime()
    for library in ("io", "os", "debug", "coroutine", "package", "require", "dofile",
                    "loadfile"):
        runtime.globals()[library] = None
    runtime.globals().obj = _to_lua(runtime, job)
    result = runtime.execute(SCRIPT.read_text())
    return {key: result[key] for key in ("status", "message") if result[key] is not None}


def _to_lua(runtime: Any, value: Any) -> Any:
    """JSON as Argo CD hands it to Lua: objects and arrays as tables, nulls absent."""
    if isinstance(value, dict):
        return runtime.table_from({key: _to_lua(runtime, item) for key, item in value.items()
                                   if item is not None})
    if isinstance(value, list):
        return runtime.table_from([_to_lua(runtime, item) for item in value])
    return value


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Every version of every TrainingJob while the operator ran the scenarios."""
    with EmulatedCluster(tmp_path_factory.mktemp("cluster")) as cluster, \
            running_operator(cluster):
        kube = Kube(cluster)
        for scenario in SCENARIOS:
            scenario(kube)
        return list(_versions(cluster))


def _versions(cluster: EmulatedCluster) -> Iterator[dict[str, Any]]:
    for obj in cluster.emulator.objects.values():
        if obj.history and any(v is not None and v.get("kind") == "TrainingJob"
                               for v in obj.history):
            for version in obj.history:
                if version is not None:
                    yield _plain(version)


def _plain(value: Any) -> Any:
    if hasattr(value, "items"):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    return value


def _current(job: dict[str, Any]) -> bool:
    """Whether the operator had seen the job's latest spec when this version was stored."""
    status = job.get("status") or {}
    return status.get("observedGeneration", 0) >= job["metadata"].get("generation", 1)


def _true(job: dict[str, Any], kind: str) -> dict[str, Any] | None:
    return next((c for c in job["status"].get("conditions", [])
                 if c["type"] == kind and c["status"] == "True"), None)


def test_every_phase_the_operator_wrote_maps_to_its_argocd_health(
        written: list[dict[str, Any]]) -> None:
    seen: dict[str, int] = {}
    for job in written:
        phase = (job.get("status") or {}).get("phase")
        shown = health(job)
        if phase is None or not _current(job):
            assert shown["status"] == "Progressing", (job, shown)
            continue
        seen[phase] = seen.get(phase, 0) + 1
        assert shown["status"] == HEALTH[phase], (job["status"], shown)
        assert shown["message"], (job["status"], shown)
        if phase == "Failed":
            failed = _true(job, "Failed")
            assert failed is not None and shown["message"] == failed["message"]
        if phase == "Restarting":
            restarting = _true(job, "Restarting")
            assert restarting is not None and shown["message"] == restarting["message"]
    assert set(seen) == set(HEALTH), f"phases the scenarios reached: {seen}"


def test_a_failed_job_is_degraded_with_what_failed_and_what_to_do(
        written: list[dict[str, Any]]) -> None:
    messages = {health(job)["message"] for job in written
                if (job.get("status") or {}).get("phase") == "Failed" and _current(job)}
    # Exit code 2 (permanent) and the spec the models refuse, in the operator's words.
    assert any("permanentExitCodes" in message for message in messages), messages
    assert any("spec.data.train" in message for message in messages), messages


def test_a_spec_the_operator_has_not_seen_yet_is_progressing(
        written: list[dict[str, Any]]) -> None:
    # Suspending and resuming changed the spec: Argo CD's sync is over before the operator
    # acts on it, and the job must not look Healthy (or Suspended) in between.
    behind = [job for job in written if job.get("status") and not _current(job)]
    assert behind, "no stored version had a spec newer than the operator's status"
    for job in behind:
        shown = health(job)
        assert shown["status"] == "Progressing"
        assert str(job["metadata"]["generation"]) in shown["message"]


def test_a_job_with_no_status_yet_is_progressing(written: list[dict[str, Any]]) -> None:
    created = [job for job in written if not job.get("status")]
    assert created
    assert {health(job)["status"] for job in created} == {"Progressing"}


@pytest.mark.parametrize("document", ["docs/gitops.md", "charts/kubetrain/README.md"])
def test_the_docs_argocd_cm_snippet_is_the_script(document: str) -> None:
    text = (REPO / document).read_text()
    blocks = [yaml.safe_load(block) for block in re.findall(r"```yaml\n(.*?)```", text, re.S)]
    snippets = [block for block in blocks
                if isinstance(block, dict) and block.get("kind") == "ConfigMap"
                and block["metadata"]["name"] == "argocd-cm"]
    assert len(snippets) == 1, f"{document} has {len(snippets)} argocd-cm snippets"
    assert snippets[0]["data"][ARGOCD_KEY] == SCRIPT.read_text()


def test_kstatus_reads_every_status_the_operator_wrote_as_its_phase_means(
        written: list[dict[str, Any]]) -> None:
    seen: dict[str, set[str]] = {}
    for job in written:
        if not job.get("status"):
            continue  # before the operator's first write: kstatus sees no conditions yet
        phase = job["status"].get("phase")
        status, message = kstatus_status(job)
        if not _current(job):
            assert status == "InProgress", job["status"]
            continue
        assert status == EXPECTED[phase], (phase, status, job["status"])
        seen.setdefault(phase, set()).add(status)
        if phase == "Failed":  # what `flux get` and the Kustomization's event say
            failed = _true(job, "Failed")
            assert failed is not None and message == failed["message"]
    assert set(seen) == set(HEALTH), seen
