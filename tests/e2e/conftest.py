"""The cluster the e2e scenarios run on: kmock's emulator with the control-plane stand-ins.

The API is tests/cluster/emulator.py over HTTP; the stand-in scheduler and node
lifecycle controller (tests/cluster/controllers.py) run beside it, so pods bound to the
node agent's nodes run, and a node whose heartbeats stop is marked unreachable.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from controllers import NodeLifecycle, Scheduler
from emulator import EmulatedCluster


@pytest.fixture(scope="module")
def emulated_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmulatedCluster]:
    """A fresh emulated API server for the module, with the stand-in controllers running."""
    with EmulatedCluster(tmp_path_factory.mktemp("emulated-cluster")) as cluster:
        api = cluster.api_client()
        with Scheduler(api=api), NodeLifecycle(api=api):
            yield cluster
