"""The operator's scenarios on a real Kubernetes control plane, run as the chart runs it.

The same scenarios as tests/operator (tests/operator/harness.py), but against real
etcd, kube-apiserver, kube-controller-manager and kube-scheduler (the `control_plane`
fixture), with `kubetrain operator` in its own process authenticated as the chart's
ServiceAccount under the chart's RBAC. No kubelet runs here: the scenarios drive
pod phases through the pods' status subresource, as a kubelet would report them.
So what kmock's emulator fakes (garbage collection, the status and scale
subresources, conflicts, list/watch) is shown on the real server too.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from operator_process import OperatorProcess, install_operator_identity

pytestmark = pytest.mark.real_server

sys.path.insert(0, str(Path(__file__).parents[1] / "operator"))
import harness  # noqa: E402


@pytest.fixture(scope="module")
def operator(control_plane: Any, tmp_path_factory: pytest.TempPathFactory,
             ) -> Iterator[OperatorProcess]:
    """The operator with the default chart's ServiceAccount and cluster-wide RBAC."""
    folder = tmp_path_factory.mktemp("operator")
    kubeconfig = install_operator_identity(control_plane, {}, folder)
    with OperatorProcess(kubeconfig, folder / "operator.log") as process:
        yield process


@pytest.mark.parametrize("scenario", harness.SCENARIOS, ids=lambda s: s.__name__[9:])
def test_scenario_on_a_real_control_plane(scenario: Callable[[harness.Kube], None],
                                          control_plane: Any,
                                          operator: OperatorProcess) -> None:
    try:
        scenario(harness.Kube(control_plane))  # type: ignore[arg-type]
    except BaseException:
        print(f"---- operator log\n{operator.log_tail()}")
        raise
    assert not operator.denied_requests(), "\n".join(operator.denied_requests())
