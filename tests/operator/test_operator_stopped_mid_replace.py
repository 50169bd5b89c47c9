"""An operator stopped in the middle of a straggler's Replace (issue 24's leftover, issue 33
item 4): it had recorded the Replace in status (the restart, the avoided node) and had not
yet deleted the straggler's pod. The next operator must still move that pod off the node.

The real operator against the emulator: one runs until the job's pods exist, then stops;
the job's status is then what the stopped one wrote last; a second operator takes over."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from harness import NAMESPACE, EmulatedCluster, Kube, eventually, job_manifest, running_operator


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmulatedCluster]:
    with EmulatedCluster(tmp_path_factory.mktemp("cluster")) as running:
        yield running


def _stamp(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def test_the_next_operator_moves_the_straggler_off_the_node_the_replace_avoided(
        cluster: EmulatedCluster) -> None:
    kube = Kube(cluster)
    for node in ("node-a", "node-b"):
        kube.core.create_node({"metadata": {"name": node,
                                            "labels": {"kubernetes.io/hostname": node}}})
        kube.core.patch_node_status(node, {"status": {"conditions": [
            {"type": "Ready", "status": "True", "reason": "KubeletReady"}]}})
    manifest = job_manifest("mid-replace", stragglers={"action": "Replace"})
    with running_operator(cluster):
        kube.create_job(manifest)
        pods = eventually(lambda: len(kube.pods("mid-replace")) == 2
                          and kube.pods("mid-replace"), what="both worker pods")
        for name, node in (("mid-replace-worker-0", "node-a"), ("mid-replace-worker-1",
                                                                "node-b")):
            kube.core.patch_namespaced_pod(name, NAMESPACE, {"spec": {"nodeName": node}})
        kube.run_all("mid-replace", pod_ip="127.0.0.9")
        eventually(lambda: kube.phase("mid-replace") == "Running", what="the job running")
    old_uid = pods["mid-replace-worker-1"]["metadata"]["uid"]

    # What the stopped operator wrote before it would have deleted worker 1's pod.
    status = dict((kube.job("mid-replace") or {})["status"])
    now = datetime.now(UTC).replace(microsecond=0)
    attempt = status.get("restartAttempt", 0) + 1
    status.update(
        phase="Restarting", restartAttempt=attempt, lastRestartTime=_stamp(now),
        stragglerReplacements=1,
        restart={"reason": "StragglerReplaced", "attempt": attempt, "time": _stamp(now),
                 "counted": False, "wholeGroup": False},
        avoidedNodes=[{"node": "node-b", "reason": "Straggler", "message": "rank 1 on node-b",
                       "time": _stamp(now), "expires": _stamp(now + timedelta(hours=1))}])
    kube.custom.patch_namespaced_custom_object_status(
        "kubetrain.io", "v1alpha1", NAMESPACE, "trainingjobs", "mid-replace",
        {"status": status})

    with running_operator(cluster):
        def deleting() -> bool:
            pod = kube.pods("mid-replace").get("mid-replace-worker-1") or {}
            return bool(pod.get("metadata", {}).get("deletionTimestamp"))

        # Deleted with the template's grace, for the group to checkpoint on its SIGTERM.
        eventually(deleting, timeout=30, what="worker 1's pod deleted")
        # Its trainer saved and exited: the kubelet confirms the deletion.
        kube.core.delete_namespaced_pod("mid-replace-worker-1", NAMESPACE,
                                        grace_period_seconds=0)

        def replaced() -> dict | None:
            pod = kube.pods("mid-replace").get("mid-replace-worker-1")
            return pod if pod is not None and pod["metadata"]["uid"] != old_uid else None

        replacement = eventually(replaced, timeout=30, what="worker 1 replaced")
    labels = replacement["metadata"]["labels"]
    assert labels["kubetrain.io/restart-attempt"] == str(attempt)
    terms = replacement["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert all({"key": "kubernetes.io/hostname", "operator": "NotIn", "values": ["node-b"]}
               in term["matchExpressions"] for term in terms), terms
    # Worker 0 was not on the avoided node: it stays.
    assert kube.pods("mid-replace")["mid-replace-worker-0"]["metadata"]["uid"] == \
        pods["mid-replace-worker-0"]["metadata"]["uid"]
    kube.delete_job("mid-replace")
