"""Several operator replicas on one API server: only the Lease holder acts; a standby takes over."""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import kmock
from harness import EmulatedCluster, Kube, eventually, job_manifest, running_operator

# Short leases so that a test takes seconds; the protocol is the same at 15 s.
FAST = {"standalone": False, "lease_seconds": 2.0, "lease_retry_seconds": 0.2}


def _attempt(kube: Kube, pod: str) -> str | None:
    labels = kube.pods("ha").get(pod, {}).get("metadata", {}).get("labels", {})
    return labels.get("kubetrain.io/restart-attempt")


def test_only_the_leader_acts_and_a_standby_takes_over_when_it_stops(tmp_path: Path) -> None:
    with EmulatedCluster(tmp_path) as cluster, contextlib.ExitStack() as standby:
        kube = Kube(cluster)
        with running_operator(cluster, **FAST) as first:
            eventually(lambda: kube.lease_holder() == first.identity, what="a first leader")
            second = standby.enter_context(running_operator(cluster, **FAST))
            kube.create_job(job_manifest("ha", replicas=2))
            eventually(lambda: len(kube.pods("ha")) == 2)
            kube.run_all("ha")
            eventually(lambda: kube.phase("ha") == "Running")
            time.sleep(1.0)  # both replicas resync several times: the standby must not act
            assert kube.lease_holder() == first.identity
            assert cluster.operator_requests("pods", kmock.action.CREATE, first.identity) == 2
            assert cluster.operator_requests("pods", kmock.action.CREATE, second.identity) == 0
            assert cluster.operator_requests("trainingjobs", kmock.action.UPDATE,
                                             second.identity) == 0

        # The first replica stopped and handed the Lease back.
        eventually(lambda: kube.lease_holder() == second.identity, what="the standby to lead")
        kube.set_pod_status("ha-worker-1", "Failed", exit_code=137, reason="Error")
        eventually(lambda: _attempt(kube, "ha-worker-1") == "1", what="the standby to replace")
        assert set(kube.pods("ha")) == {"ha-worker-0", "ha-worker-1"}
        assert cluster.operator_requests("pods", kmock.action.CREATE, second.identity) == 1
        assert (kube.job("ha") or {})["status"]["restarts"] == 1
