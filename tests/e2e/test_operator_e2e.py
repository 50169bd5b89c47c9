"""The operator scenarios against a real cluster (e.g. kind), when KUBECONFIG points at one.

Run: install the CRD (`kubectl apply -f crds/trainingjob.yaml`), then
`KUBECONFIG=~/.kube/config pytest tests/e2e -m e2e`. The operator runs in-process
(standalone) with the kubeconfig's credentials; pods are never scheduled onto real
trainer images, because each scenario drives pod phases through the status API
exactly as the emulator tests do.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not os.environ.get("KUBECONFIG"),
                       reason="e2e needs a real cluster: set KUBECONFIG (e.g. a kind cluster)"),
]

sys.path.insert(0, str(Path(__file__).parents[1] / "operator"))
import harness  # noqa: E402


class RealCluster:
    """The parts of harness.EmulatedCluster the scenarios use, backed by KUBECONFIG."""

    def __init__(self) -> None:
        self.kubeconfig = Path(os.environ["KUBECONFIG"])

    api_client = harness.EmulatedCluster.api_client


@pytest.mark.parametrize("scenario", harness.SCENARIOS, ids=lambda s: s.__name__[9:])
def test_scenario_on_a_real_cluster(scenario: Callable[[harness.Kube], None]) -> None:
    cluster = RealCluster()
    with harness.running_operator(cluster):  # type: ignore[arg-type]
        scenario(harness.Kube(cluster))  # type: ignore[arg-type]
