"""Fixtures for the Helm chart tests: the chart loaded by Helm's own engine, rendered per variant.

The variants are the ones docs/install.md documents; every test that checks
rendered objects runs over all of them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART_DIR = REPO / "charts" / "kubetrain"
RELEASE = "kubetrain"
RELEASE_NAMESPACE = "kubetrain-system"

MONITORING_ON = {
    "serviceMonitor": {"enabled": True},
    "podMonitor": {"enabled": True},
    "prometheusRule": {"enabled": True},
    "dashboard": {"enabled": True},
}

# name -> values, as documented in docs/install.md.
VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    "namespaced": {"rbac": {"mode": "namespaced", "namespaces": ["team-a", "team-b"]}},
    "monitoring": {
        "monitoring": MONITORING_ON,
        "networkPolicy": {"metricsFrom": [{"namespaceSelector": {"matchLabels": {
            "kubernetes.io/metadata.name": "monitoring"}}}]},
    },
    "custom-images": {
        "image": {"repository": "registry.example.com/ml/kubetrain-operator",
                  "digest": "sha256:" + "0123456789abcdef" * 4, "pullPolicy": "IfNotPresent"},
        "trainerImage": {"repository": "registry.example.com/ml/kubetrain-trainer",
                         "tag": "0.1.0-cu124"},
        "imagePullSecrets": [{"name": "registry-credentials"}],
    },
    "high-availability": {"replicas": 2},
}

Render = Callable[[dict[str, Any]], list[dict[str, Any]]]


@pytest.fixture(scope="session")
def variants() -> dict[str, dict[str, Any]]:
    """The documented variants: name -> values."""
    return VARIANTS


@pytest.fixture(scope="session")
def chart() -> Iterator[Any]:
    """The chart as Helm loads it (helm-python-sdk, no helm binary)."""
    import helm_python

    with helm_python.Chart.load(CHART_DIR) as loaded:
        yield loaded


@pytest.fixture(scope="session")
def render(chart: Any) -> Render:
    """Renders the chart's templates with `values` as `helm template` would; returns the objects."""

    def _render(values: dict[str, Any]) -> list[dict[str, Any]]:
        manifests = chart.render(values, name=RELEASE, namespace=RELEASE_NAMESPACE,
                                 is_install=True)
        objects = []
        for path, text in sorted(manifests.items()):
            if path.endswith("NOTES.txt"):
                continue
            objects.extend(doc for doc in yaml.safe_load_all(text) if doc)
        return objects

    return _render


@pytest.fixture(params=sorted(VARIANTS), scope="session")
def variant(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="session")
def rendered(render: Render, variant: str) -> list[dict[str, Any]]:
    """The objects of one documented variant."""
    return render(VARIANTS[variant])

