"""checkov's Kubernetes checks over the rendered chart and the pods the operator creates.

checkov has many pinned dependencies of its own, so it lives in its own virtual
environment (.venv-checkov, created on first use from PyPI) and runs as a
subprocess; it can never change the versions the project itself uses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from kubetrain.api.manifest import load_job
from kubetrain.operator.children import worker_pod

REPO = Path(__file__).resolve().parents[2]
CHECKOV_VENV = REPO / ".venv-checkov"
CHECKOV_REQUIREMENTS = Path(__file__).with_name("checkov-requirements.txt")
ALLOW_LIST = Path(__file__).with_name("checkov-allowlist.yaml")
Render = Callable[[dict[str, Any]], list[dict[str, Any]]]


@pytest.fixture(scope="session")
def checkov() -> Path:
    """The checkov executable, installed into .venv-checkov on first use (`make test` has
    installed it already, beside lint and the image build)."""
    executable = CHECKOV_VENV / "bin" / "checkov"
    if not executable.exists():
        subprocess.run([sys.executable, "-m", "venv", str(CHECKOV_VENV)], check=True)
        subprocess.run(
            [str(CHECKOV_VENV / "bin" / "pip"), "install", "--quiet", "-r",
             str(CHECKOV_REQUIREMENTS)],
            check=True, timeout=900,
        )
    return executable


def _findings(checkov: Path, folder: Path) -> list[dict[str, Any]]:
    """checkov's failed Kubernetes checks for every manifest under `folder`."""
    # Offline: no guideline downloads, no telemetry, no version check.
    env = {**os.environ, "BC_SKIP_MAPPING": "TRUE", "CHECKOV_RUN_SCA_PACKAGE_SCAN_V2": "false",
           "ANALYTICS_ENABLED": "false", "CHECKOV_SKIP_VERSION_CHECK": "true"}
    result = subprocess.run(
        [str(checkov), "--directory", str(folder), "--framework", "kubernetes",
         "--output", "json", "--quiet", "--compact", "--skip-download"],
        capture_output=True, text=True, env=env, timeout=300,
    )
    # checkov exits 1 when a check fails; anything else is a crash.
    assert result.returncode in (0, 1), result.stderr[-3000:]
    reports = json.loads(result.stdout) if result.stdout.strip() else []
    reports = reports if isinstance(reports, list) else [reports]
    return [failed for report in reports for failed in report["results"]["failed_checks"]]


def _unexplained(findings: list[dict[str, Any]], target: str) -> tuple[list[str], set[int]]:
    """Findings the allow-list does not explain, and the indexes of the entries that matched."""
    allowed = yaml.safe_load(ALLOW_LIST.read_text())
    used: set[int] = set()
    unexplained = []
    for finding in findings:
        kind = finding["resource"].split(".", 1)[0]
        matches = [i for i, entry in enumerate(allowed) if entry["check"] == finding["check_id"]
                   and entry["target"] == target and entry["kind"] == kind]
        used.update(matches)
        if not matches:
            unexplained.append(f"{finding['check_id']} {finding['resource']} "
                               f"({finding['file_path']}): {finding['check_name']}")
    return unexplained, used


def _stale(target: str, used: set[int]) -> list[str]:
    allowed = yaml.safe_load(ALLOW_LIST.read_text())
    return [f"{entry['check']} on {entry['kind']}" for i, entry in enumerate(allowed)
            if entry["target"] == target and i not in used]


def test_allow_list_gives_a_reason_for_every_entry() -> None:
    for entry in yaml.safe_load(ALLOW_LIST.read_text()):
        assert set(entry) == {"check", "target", "kind", "reason"}, entry
        assert entry["target"] in ("chart", "worker-pod"), entry
        assert len(entry["reason"]) > 40, f"{entry['check']}: say why it is accepted"


def test_rendered_chart_has_no_unexplained_checkov_finding(
    checkov: Path, render: Render, variants: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    for name, values in variants.items():
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump_all(render(values)))
    findings = _findings(checkov, tmp_path)
    unexplained, used = _unexplained(findings, "chart")
    assert not unexplained, "checkov findings not in checkov-allowlist.yaml:\n" + "\n".join(
        unexplained)
    assert not _stale("chart", used), (
        f"allow-list entries that match nothing: {_stale('chart', used)}")


def test_operator_worker_pods_have_no_unexplained_checkov_finding(
    checkov: Path, render: Render, tmp_path: Path
) -> None:
    jobs = [load_job(path) for path in sorted((REPO / "examples").glob("*.yaml"))
            if yaml.safe_load(path.read_text()).get("kind") == "TrainingJob"]
    assert jobs, "examples/ should hold TrainingJob manifests to build worker pods from"
    for job in jobs:
        job.metadata.namespace = job.metadata.namespace or "team-a"
        job.metadata.uid = job.metadata.uid or f"uid-{job.metadata.name}"
        pods = [worker_pod(job, index, 0) for index in range(job.spec.workers.replicas)]
        (tmp_path / f"{job.metadata.name}.yaml").write_text(yaml.safe_dump_all(pods))
    # The workers' NetworkPolicy from the chart goes along, as it would in the cluster.
    policies = [o for o in render({"networkPolicy": {"workerNamespaces": ["team-a"]}})
                if o["kind"] == "NetworkPolicy"]
    (tmp_path / "networkpolicy.yaml").write_text(yaml.safe_dump_all(policies))
    findings = _findings(checkov, tmp_path)
    unexplained, used = _unexplained(
        [f for f in findings if f["resource"].startswith("Pod.")], "worker-pod")
    assert not unexplained, "checkov findings not in checkov-allowlist.yaml:\n" + "\n".join(
        unexplained)
    assert not _stale("worker-pod", used), (
        f"allow-list entries that match nothing: {_stale('worker-pod', used)}")
