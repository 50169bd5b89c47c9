"""The clusters the e2e scenarios run on: kmock's emulator with the control-plane stand-ins.

The API is tests/cluster/emulator.py over HTTP; the stand-in scheduler and node
lifecycle controller (tests/cluster/controllers.py) run beside it, so pods bound to the
node agent's nodes run, and a node whose heartbeats stop is marked unreachable.

`emulated_cluster` is a fresh API for each module that asks for it (leader election and
the crash-safety churn want one of their own). `cluster` is the whole loop
(tests/cluster/whole_loop.py) on an API of its own, started once per session and shared
by every module whose scenarios run jobs on it: each job has its own name.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from controllers import NodeLifecycle, Scheduler
from emulator import EmulatedCluster
from machine_state import left_behind, snapshot
from whole_loop import Cluster, NodeRuntime, whole_loop


@contextmanager
def _emulated(folder: Path) -> Iterator[EmulatedCluster]:
    """An emulated API server with the stand-in controllers running."""
    with EmulatedCluster(folder) as cluster:
        api = cluster.api_client()
        with Scheduler(api=api), NodeLifecycle(api=api):
            yield cluster


@pytest.fixture(scope="module")
def emulated_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmulatedCluster]:
    """A fresh emulated API server for the module, with the stand-in controllers running."""
    with _emulated(tmp_path_factory.mktemp("emulated-cluster")) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory, node_runtime: NodeRuntime,
            ) -> Iterator[Cluster]:
    """The whole loop for the session's scenarios, its pods in the session's node runtime
    (tests/conftest.py); skipped (failed under CI) without root."""
    folder = tmp_path_factory.mktemp("whole-loop")
    before = snapshot()
    with _emulated(tmp_path_factory.mktemp("whole-loop-api")) as api, \
            whole_loop(api, folder, node_runtime) as running:
        # Its own folder, bridge and namespaces, and its pods' containers in the node
        # runtime's folder (their root filesystems' mounts); the runtime itself, its
        # cgroups among them, outlives the loop.
        mine = [str(folder), running.agent.network.bridge, f"kt{running.agent.network.tag}-",
                str(node_runtime.runtime.folder)]
        yield running
    # Everything the node agent, its containers and the pod network changed is undone,
    # whatever the scenarios did (this runs after a failed one too).
    # (The runtime's first shim may have been the loop's: the runtime, not the loop, made
    # and removes the shims' folders then.)
    left = left_behind(before, snapshot(), mine,
                       shims_outlive=node_runtime.runtime.removes_shim_folders)
    assert not left, "the whole loop left this on the machine:\n" + "\n".join(left)


@pytest.fixture(autouse=True)
def _jobs_deleted_after_each_scenario(request: pytest.FixtureRequest) -> Iterator[None]:
    """A scenario on the shared whole loop that fails before deleting its job leaves no
    pod running for the next one (a node lost in a later scenario would take it along):
    the jobs it created are deleted after it, passed or failed. Jobs of a module's
    fixtures, created before the scenario, stay for the module's next scenarios."""
    cluster = request.getfixturevalue("cluster") if "cluster" in request.fixturenames else None
    if not isinstance(cluster, Cluster):  # (test_gang_placement's `cluster` is its own API)
        yield
        return
    before = cluster.jobs()
    yield
    for name in sorted(cluster.jobs() - before):
        cluster.delete(name)
