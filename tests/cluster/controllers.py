"""Stand-ins for the control-plane controllers that kmock's emulator has no equivalent of.

Each one does the least a test on the emulator needs from that controller, in a thread
of the test process. They are stand-ins: no test here shows how the real controllers
behave. That is the real-server tier's job (tests/real_server, with `KUBEBUILDER_ASSETS`).

- `Scheduler` (kube-scheduler): binds each pending pod without a node to a Ready node
  whose labels match the pod's nodeSelector, whose NoSchedule/NoExecute taints the pod
  tolerates, and that the pod's required node affinity (`In`/`NotIn` on
  `kubernetes.io/hostname`) does not exclude, choosing the one running the fewest pods,
  as least-allocated scoring spreads equal pods. It binds by patching `spec.nodeName`;
  a real API server takes only the `pods/binding` subresource. A pod no node fits gets
  the condition PodScheduled False, reason Unschedulable, with a message that counts
  the nodes by why they do not fit, as kube-scheduler's "0/3 nodes are available: ..."
  (its wording differs), and True once it binds it; the operator's too-few-nodes rule
  reads that condition. No resources, ports, pod affinity, priorities or preemption.
- `NodeLifecycle` (kube-controller-manager's node lifecycle controller): a node whose
  Lease in `kube-node-lease` has not been renewed for `grace_seconds` gets its Ready
  condition set to Unknown (reason NodeStatusUnknown) and the
  `node.kubernetes.io/unreachable` NoExecute taint; when the Lease is renewed again
  the taint is removed. No eviction of the node's pods (the operator replaces the
  pods of a lost node itself) and no zone logic.

The third stand-in, the garbage collector that deletes a deleted job's children, lives
in the emulator itself (`tests/cluster/emulator.py`), since it acts on every delete.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from kubernetes import client
from kubernetes.client.rest import ApiException

log = logging.getLogger("controllers")

UNREACHABLE_TAINT = "node.kubernetes.io/unreachable"
HOSTNAME_LABEL = "kubernetes.io/hostname"
# Seconds, not kube-controller-manager's default 40 s, so a lost node is noticed within a test.
NODE_MONITOR_GRACE_SECONDS = 8.0


@dataclass
class _Loop:
    """A function called every `period` seconds in a daemon thread until `stop()`."""

    period: float
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def tick(self) -> None:
        raise NotImplementedError

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=type(self).__name__, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def __enter__(self) -> _Loop:
        self.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            try:
                self.tick()
            except Exception:
                log.exception("%s failed", type(self).__name__)


@dataclass
class Scheduler(_Loop):
    """Binds pending pods to nodes (a stand-in for kube-scheduler; see the module doc)."""

    api: client.ApiClient | None = None
    period: float = 0.2

    def tick(self) -> None:
        core = client.CoreV1Api(self.api)
        pods = core.list_pod_for_all_namespaces().items
        unbound = [pod for pod in pods if not pod.spec.node_name
                   and pod.metadata.deletion_timestamp is None
                   and (pod.status is None or pod.status.phase in (None, "Pending"))]
        if not unbound:
            return
        every_node = core.list_node().items
        nodes = [node for node in every_node if schedulable(node)]
        load = Counter(pod.spec.node_name for pod in pods if pod.spec.node_name
                       and (pod.status is None or pod.status.phase not in ("Succeeded", "Failed")))
        for pod in sorted(unbound, key=lambda pod: pod.metadata.creation_timestamp or ""):
            fits = [node.metadata.name for node in nodes if _allowed(pod, node)]
            if not fits:
                _mark_unschedulable(core, pod, every_node)  # stays Pending
                continue
            chosen = min(fits, key=lambda name: (load[name], name))
            with contextlib.suppress(ApiException):
                # Before the bind: the node agent writes the status of bound pods only.
                _mark_scheduled(core, pod)
                core.patch_namespaced_pod(pod.metadata.name, pod.metadata.namespace,
                                          {"spec": {"nodeName": chosen}})
                load[chosen] += 1


def _mark_unschedulable(core: client.CoreV1Api, pod: Any, nodes: list[Any]) -> None:
    """PodScheduled False, reason Unschedulable, saying why each node does not fit; written
    once, so that its lastTransitionTime says since when."""
    conditions = (pod.status.conditions or []) if pod.status else []
    if any(c.type == "PodScheduled" and c.status == "False" for c in conditions):
        return
    why = Counter("not Ready" if not schedulable(node) else _why_not(pod, node)
                  for node in nodes)
    message = f"0/{len(nodes)} nodes are available: " + ", ".join(
        f"{count} node(s) {reason}" for reason, count in sorted(why.items())) + "."
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    with contextlib.suppress(ApiException):  # gone meanwhile
        core.patch_namespaced_pod_status(pod.metadata.name, pod.metadata.namespace, {
            "status": {"conditions": [
                {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                 "message": message, "lastTransitionTime": now}]}})


def _mark_scheduled(core: client.CoreV1Api, pod: Any) -> None:
    """PodScheduled True for a pod about to be bound, as the API server's binding sets it,
    where it was marked Unschedulable before."""
    conditions = (pod.status.conditions or []) if pod.status else []
    if not any(c.type == "PodScheduled" and c.status == "False" for c in conditions):
        return
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    core.patch_namespaced_pod_status(pod.metadata.name, pod.metadata.namespace, {
        "status": {"conditions": [
            {"type": "PodScheduled", "status": "True", "lastTransitionTime": now}]}})


def schedulable(node: Any) -> bool:
    """Whether its kubelet reports it Ready."""
    conditions = {c.type: c.status for c in (node.status.conditions or [])} \
        if node.status else {}
    return conditions.get("Ready") == "True"


def _tolerates(pod: Any, taint: Any) -> bool:
    for toleration in pod.spec.tolerations or []:
        if toleration.effect not in (None, "", taint.effect):
            continue
        if toleration.operator == "Exists" and toleration.key in (None, "", taint.key):
            return True
        if toleration.key == taint.key and (toleration.value or "") == (taint.value or ""):
            return True
    return False


def _allowed(pod: Any, node: Any) -> bool:
    """Whether the pod's nodeSelector, tolerations and node affinity let it onto `node`."""
    return _why_not(pod, node) == ""


def _why_not(pod: Any, node: Any) -> str:
    """Why the pod's nodeSelector, tolerations or node affinity keep it off `node`; empty
    when they do not."""
    labels = node.metadata.labels or {}
    if any(labels.get(key) != value for key, value in (pod.spec.node_selector or {}).items()):
        return "didn't match Pod's node selector"
    taints = (node.spec.taints or []) if node.spec else []
    if any(taint.effect in ("NoSchedule", "NoExecute") and not _tolerates(pod, taint)
           for taint in taints):
        return "had untolerated taint"
    affinity = pod.spec.affinity.node_affinity if pod.spec.affinity else None
    required = affinity.required_during_scheduling_ignored_during_execution if affinity else None
    if required is None:
        return ""
    hostname = (node.metadata.labels or {}).get(HOSTNAME_LABEL, node.metadata.name)
    for term in required.node_selector_terms or []:
        if all(_matches(expression, hostname) for expression in term.match_expressions or []):
            return ""
    return "didn't match Pod's node affinity"


def _matches(expression: Any, hostname: str) -> bool:
    if expression.key != HOSTNAME_LABEL:
        raise NotImplementedError(f"the stand-in scheduler knows only {HOSTNAME_LABEL} terms, "
                                  f"not {expression.key}")
    if expression.operator == "In":
        return hostname in expression.values
    if expression.operator == "NotIn":
        return hostname not in expression.values
    raise NotImplementedError(f"the stand-in scheduler has no operator {expression.operator}")


@dataclass
class NodeLifecycle(_Loop):
    """Marks nodes whose heartbeats stopped unreachable (a stand-in; see the module doc)."""

    api: client.ApiClient | None = None
    period: float = 1.0
    grace_seconds: float = NODE_MONITOR_GRACE_SECONDS

    def tick(self) -> None:
        core = client.CoreV1Api(self.api)
        leases = client.CoordinationV1Api(self.api)
        renewed = {}
        for lease in leases.list_namespaced_lease("kube-node-lease").items:
            if lease.spec and lease.spec.renew_time is not None:
                renewed[lease.metadata.name] = lease.spec.renew_time
        now = datetime.now(UTC)
        for node in core.list_node().items:
            name = node.metadata.name
            if name not in renewed:
                continue
            silent = (now - renewed[name]).total_seconds() > self.grace_seconds
            taints = list(node.spec.taints or []) if node.spec else []
            tainted = any(taint.key == UNREACHABLE_TAINT for taint in taints)
            if silent and not tainted:
                log.info("node %s: no heartbeat for %.0fs, unreachable", name, self.grace_seconds)
                self._mark_unreachable(core, node, taints)
            elif not silent and tainted:
                log.info("node %s: heartbeats again, reachable", name)
                kept = [client.ApiClient().sanitize_for_serialization(taint)
                        for taint in taints if taint.key != UNREACHABLE_TAINT]
                core.patch_node(name, {"spec": {"taints": kept or None}})

    def _mark_unreachable(self, core: client.CoreV1Api, node: Any, taints: list[Any]) -> None:
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        serial = client.ApiClient().sanitize_for_serialization
        conditions = [serial(c) for c in (node.status.conditions or [])]
        for condition in conditions:
            if condition["type"] == "Ready":
                condition.update({"status": "Unknown", "reason": "NodeStatusUnknown",
                                  "message": "Kubelet stopped posting node status.",
                                  "lastTransitionTime": now})
        core.patch_node_status(node.metadata.name, {"status": {"conditions": conditions}})
        taint = {"key": UNREACHABLE_TAINT, "effect": "NoExecute", "timeAdded": now}
        core.patch_node(node.metadata.name,
                        {"spec": {"taints": [*(serial(t) for t in taints), taint]}})
