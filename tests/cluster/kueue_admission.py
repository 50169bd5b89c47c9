"""A stand-in for Kueue's admission of Workloads, for tests on the emulator.

What it does as Kueue does: every Workload (kueue.x-k8s.io/v1beta1) that names a queue,
oldest first, is admitted when its pod set fits the one ClusterQueue's nominal quota next
to the Workloads already admitted: `status.admission` (the ClusterQueue, the pod set's
flavor for each resource, its count and resource usage) and the conditions QuotaReserved
and Admitted. A pod set with minCount may be admitted with fewer pods, down to minCount
(partial admission). A topologyRequest (required or preferred level) gets a topology
assignment over the Ready nodes labelled with the configured levels: the pods in one
domain of the level asked (required), or in as few as they fit (preferred), packed host by
host in the order of the domains' values, with the assignment's levels from the level asked
down to the lowest. A Workload marked Finished, deleted, or whose admission was cleared
gives its quota back. `evict` marks a Workload Evicted, as Kueue's preemption does.

What it does not: LocalQueues and cohorts (every queue name is the one ClusterQueue),
borrowing, priorities and preemption on its own, admission checks, waitForPodsReady, the
pod integration (plain pods' scheduling gates) and webhooks. Capacity for topology is each
node's allocatable `pods` less what it assigned to other admitted Workloads.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from controllers import HOSTNAME_LABEL, _items, _Loop, _quantity, requests_of, schedulable
from kubernetes import client
from kubernetes.client.rest import ApiException

log = logging.getLogger("kueue")

GROUP, VERSION, PLURAL = "kueue.x-k8s.io", "v1beta1", "workloads"
Manifest = dict[str, Any]


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _holds(workload: Manifest, kind: str) -> bool:
    return any(c.get("type") == kind and c.get("status") == "True"
               for c in (workload.get("status") or {}).get("conditions") or [])


@dataclass
class KueueAdmission(_Loop):
    """Admits Workloads within a quota (a stand-in for Kueue; see the module doc)."""

    api: client.ApiClient | None = None
    period: float = 0.2
    cluster_queue: str = "cluster-queue"
    flavor: str = "default-flavor"
    # Nominal quota by resource ("pods" counts pods), for the one flavor.
    quota: dict[str, float] = field(default_factory=lambda: {"pods": 4})
    # The Topology's levels, highest first (node labels); the lowest is usually the hostname.
    levels: tuple[str, ...] = ()

    def tick(self) -> None:
        custom = client.CustomObjectsApi(self.api)
        workloads = self._workloads(custom)
        admitted = [w for w in workloads if (w.get("status") or {}).get("admission")
                    and not _holds(w, "Finished")]
        used: Counter[str] = Counter()
        assigned: Counter[str] = Counter()  # node -> pods the admitted were given there
        for workload in admitted:
            assignment = workload["status"]["admission"]["podSetAssignments"][0]
            used.update({name: _quantity(name, value)
                         for name, value in (assignment.get("resourceUsage") or {}).items()})
            for domain in (assignment.get("topologyAssignment") or {}).get("domains") or []:
                assigned[domain["values"][-1]] += domain["count"]
        pending = [w for w in workloads if not (w.get("status") or {}).get("admission")
                   and not _holds(w, "Finished") and w["spec"].get("queueName")]
        for workload in sorted(pending, key=lambda w: (w["metadata"]["creationTimestamp"],
                                                       w["metadata"]["name"])):
            admission = self._admission(workload, used, assigned)
            if admission is None:
                continue  # BestEffortFIFO: one that does not fit lets the next one try
            self._admit(custom, workload, admission)
            assignment = admission["podSetAssignments"][0]
            used.update({name: _quantity(name, value)
                         for name, value in assignment["resourceUsage"].items()})
            for domain in (assignment.get("topologyAssignment") or {}).get("domains") or []:
                assigned[domain["values"][-1]] += domain["count"]

    def _workloads(self, custom: client.CustomObjectsApi) -> list[Manifest]:
        answer = custom.list_cluster_custom_object(GROUP, VERSION, PLURAL,
                                                   _preload_content=False)
        return list(json.loads(answer.data)["items"])

    def _admission(self, workload: Manifest, used: Counter[str],
                   assigned: Counter[str]) -> Manifest | None:
        """The admission of the workload's pod set at the largest count that fits, from its
        count down to its minCount; None when none does."""
        pod_set = workload["spec"]["podSets"][0]
        per_pod = requests_of({"spec": pod_set["template"].get("spec") or {}})
        lowest = pod_set.get("minCount", pod_set["count"])
        for count in range(pod_set["count"], lowest - 1, -1):
            usage = {name: amount * count for name, amount in per_pod.items()
                     if name in self.quota}
            if any(used[name] + amount > self.quota[name] for name, amount in usage.items()):
                continue
            assignment: Manifest = {
                "name": pod_set["name"], "count": count,
                "flavors": {name: self.flavor for name in usage},
                "resourceUsage": {name: str(int(amount)) if amount == int(amount)
                                  else str(amount) for name, amount in usage.items()}}
            request = pod_set.get("topologyRequest")
            if request:
                topology = self._topology(request, count, assigned)
                if topology is None:
                    continue
                assignment["topologyAssignment"] = topology
            return {"clusterQueue": self.cluster_queue, "podSetAssignments": [assignment]}
        return None

    def _topology(self, request: Manifest, count: int,
                  assigned: Counter[str]) -> Manifest | None:
        """Domains for `count` pods: within one domain of the level asked (required), or in
        as few domains as hold them (preferred); hosts packed in the order of the values."""
        level = request.get("required") or request.get("preferred")
        if level not in self.levels:
            return None
        levels = list(self.levels[self.levels.index(level):])
        core = client.CoreV1Api(self.api)
        nodes = [node for node in _items(core.list_node(_preload_content=False))
                 if schedulable(node)]
        free: dict[tuple[str, ...], int] = {}
        for node in nodes:
            labels = dict(node["metadata"].get("labels") or {})
            labels.setdefault(HOSTNAME_LABEL, node["metadata"]["name"])
            if not all(key in labels for key in levels):
                continue
            room = int(_quantity("pods", (node.get("status") or {}).get("allocatable", {})
                                 .get("pods", 0)))
            free[tuple(labels[key] for key in levels)] = room - assigned[labels[levels[-1]]]
        by_domain = {value: [hosts for hosts in sorted(free) if hosts[0] == value]
                     for value in sorted({hosts[0] for hosts in free})}
        fitting = [value for value, hosts in by_domain.items()
                   if sum(max(free[h], 0) for h in hosts) >= count]
        if fitting:
            order = by_domain[fitting[0]]
        elif request.get("preferred"):
            order = list(itertools.chain.from_iterable(
                by_domain[value] for value in sorted(
                    by_domain, key=lambda v: -sum(max(free[h], 0) for h in by_domain[v]))))
        else:
            return None
        domains, left = [], count
        for hosts in order:
            take = min(max(free[hosts], 0), left)
            if take:
                domains.append({"values": list(hosts), "count": take})
                left -= take
        return {"levels": levels, "domains": domains} if left == 0 else None

    def _admit(self, custom: client.CustomObjectsApi, workload: Manifest,
               admission: Manifest) -> None:
        meta = workload["metadata"]
        now = _now()
        conditions = [
            {"type": "QuotaReserved", "status": "True", "reason": "QuotaReserved",
             "message": f"Quota reserved in ClusterQueue {self.cluster_queue}",
             "lastTransitionTime": now},
            {"type": "Admitted", "status": "True", "reason": "Admitted",
             "message": "The workload is admitted", "lastTransitionTime": now}]
        kept = [c for c in (workload.get("status") or {}).get("conditions") or []
                if c.get("type") not in ("QuotaReserved", "Admitted", "Evicted")]
        log.info("admitting %s/%s: %s", meta["namespace"], meta["name"], admission)
        with contextlib.suppress(ApiException):  # deleted meanwhile
            custom.patch_namespaced_custom_object_status(
                GROUP, VERSION, meta["namespace"], PLURAL, meta["name"],
                {"status": {"admission": admission, "conditions": [*kept, *conditions]}})

    def evict(self, namespace: str, name: str, message: str) -> None:
        """Mark a Workload Evicted, as Kueue's preemption does (the job's integration stops
        its pods and then clears the admission)."""
        custom = client.CustomObjectsApi(self.api)
        workload = custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
        conditions = [c for c in (workload.get("status") or {}).get("conditions") or []
                      if c.get("type") != "Evicted"]
        conditions.append({"type": "Evicted", "status": "True", "reason": "Preempted",
                           "message": message, "lastTransitionTime": _now()})
        custom.patch_namespaced_custom_object_status(GROUP, VERSION, namespace, PLURAL, name,
                                                     {"status": {"conditions": conditions}})
