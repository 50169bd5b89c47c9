"""Stand-ins for the control-plane controllers that kmock's emulator has no equivalent of.

Each one does the least a test on the emulator needs from that controller, in a thread
of the test process. They are stand-ins: no test here shows how the real controllers
behave. That is the real-server tier's job (tests/real_server, with `KUBEBUILDER_ASSETS`).

- `Scheduler` (kube-scheduler, and the gang schedulers' plug-ins): binds each pending pod
  without a node to a Ready node not cordoned (spec.unschedulable) whose labels match the
  pod's nodeSelector and required node affinity (In, NotIn, Exists, DoesNotExist on any
  label), whose NoSchedule/NoExecute taints the pod tolerates, that has room for the pod's
  requests (each resource the node lists in status.allocatable, `pods` included), and that
  keeps the pod within the domain of its required pod affinity (topologyKey, matchLabels),
  choosing the one in its preferred affinity's domain, then running the fewest pods, as
  least-allocated scoring spreads equal pods. It binds by patching `spec.nodeName`; a real
  API server takes only the `pods/binding` subresource. A pod no node fits gets the
  condition PodScheduled False, reason Unschedulable, with a message that counts the nodes
  by why they do not fit, as kube-scheduler's "0/3 nodes are available: ..." (its wording
  differs), and True once it binds it; the operator's too-few-nodes rule reads that
  condition. Pods held by a scheduling gate wait.

  Gangs: a pod that names a group (a Workload API PodGroup in spec.schedulingGroup, a
  Volcano PodGroup in the annotation scheduling.k8s.io/group-name, a scheduler-plugins
  PodGroup in the label scheduling.x-k8s.io/pod-group) waits until its PodGroup exists and
  minCount (minMember) of its group's pods exist, and is bound only with enough others of
  its group to reach minCount, all of them or none; once a group reached it, later members
  are placed one by one. A group is tried as one unit, in the order of its PodGroup's
  creation (coscheduling's QueueSort). Volcano's group is placed whole within a round or
  not at all; a Workload API or coscheduling group that fits only in part holds the nodes
  of the members it placed (their Permit wait) for the PodGroup's scheduleTimeoutSeconds
  (else 60 s, scheduler-plugins' default, taken for the Workload API's plug-in too), then
  lets them go, says why, and backs off for a second. A group whose pods require one
  topology domain is placed within the domain where most of it fits, as a topology-aware
  gang scheduler (Kueue's, Volcano's) would.

  Pods waiting at once are tried by worker index across their jobs, which interleaves two
  jobs started together on every run: without gangs, two jobs that fit the cluster only
  one at a time then each hold part of it, the deadlock gangs exist to prevent.

  No ports, priorities, preemption, schedulerName (one stand-in plays every scheduler),
  queue capacity (Volcano's queues) or pod anti-affinity.
- `NodeLifecycle` (kube-controller-manager's node lifecycle controller): a node whose
  Lease in `kube-node-lease` has not been renewed for `grace_seconds` gets its Ready
  condition set to Unknown (reason NodeStatusUnknown) and the
  `node.kubernetes.io/unreachable` NoExecute taint; when the Lease is renewed again
  the taint is removed. No eviction of the node's pods (the operator replaces the
  pods of a lost node itself) and no zone logic.

- `Kubelet`: marks pods bound to its nodes Running and removes gracefully deleted ones at
  once, for tests that run no node agent; no container runs.

The garbage collector that deletes a deleted job's children lives in the emulator itself
(`tests/cluster/emulator.py`), since it acts on every delete; Kueue's stand-in is
tests/cluster/kueue_admission.py.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
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


# The pod marks that name a gang (tests/cluster/scheduling_apis.py has the group kinds).
VOLCANO_GROUP_ANNOTATION = "scheduling.k8s.io/group-name"
COSCHEDULING_GROUP_LABEL = "scheduling.x-k8s.io/pod-group"
INDEX_LABEL = "kubetrain.io/worker-index"
# How long a coscheduling or Workload API group may hold the members it placed while it
# waits for the rest (their Permit wait) when its PodGroup says nothing: scheduler-plugins'
# permitWaitingTimeSeconds default. The Workload API's plug-in has a wait of its own; the
# stand-in takes the same for it.
PERMIT_WAIT_SECONDS = 60.0
# A group that timed out waits this long before it is tried again (its back-off).
GANG_BACKOFF_SECONDS = 1.0
# The group kinds, by mechanism: (group, version, plural) and how long a partial group may
# hold its members (None: never, the group is placed whole or not at all).
GANG_KINDS = {
    "WorkloadAPI": ("scheduling.k8s.io", "v1alpha2", "podgroups"),
    "Volcano": ("scheduling.volcano.sh", "v1beta1", "podgroups"),
    "Coscheduling": ("scheduling.x-k8s.io", "v1alpha1", "podgroups"),
}

Manifest = dict[str, Any]


@dataclass(frozen=True)
class Gang:
    """A group of pods placed together: its PodGroup's minimum and how it waits."""

    mechanism: str
    namespace: str
    name: str
    min_count: int
    created: str = ""
    # Seconds a partial group holds the members it placed (the Permit plug-ins); None:
    # placed whole or not at all within one round (Volcano's gang plug-in).
    permit_wait: float | None = None

    @property
    def key(self) -> tuple[str, str, str]:
        return self.mechanism, self.namespace, self.name


def gang_of(pod: Manifest) -> tuple[str, str, str] | None:
    """The (mechanism, namespace, group) a pod names, if any."""
    meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
    namespace = meta.get("namespace", "")
    group = (spec.get("schedulingGroup") or {}).get("podGroupName")
    if group:
        return "WorkloadAPI", namespace, group
    group = (meta.get("annotations") or {}).get(VOLCANO_GROUP_ANNOTATION)
    if group:
        return "Volcano", namespace, group
    group = (meta.get("labels") or {}).get(COSCHEDULING_GROUP_LABEL)
    if group:
        return "Coscheduling", namespace, group
    return None


def _quantity(resource: str, value: Any) -> float:
    """A quantity as a number: cpu in cores, memory in bytes, the rest as counts."""
    text = str(value)
    suffixes = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6,
                "G": 1e9, "T": 1e12, "m": 1e-3}
    for suffix, factor in suffixes.items():
        if text.endswith(suffix):
            return float(text[:-len(suffix)]) * factor
    return float(text)


def requests_of(pod: Manifest) -> Counter[str]:
    """What a pod asks of a node: its containers' requests (else limits) and one pod slot
    (amounts as numbers: cpu in cores, memory in bytes)."""
    total: Counter[str] = Counter({"pods": 1})
    for container in (pod.get("spec") or {}).get("containers") or []:
        resources = container.get("resources") or {}
        merged = {**(resources.get("limits") or {}), **(resources.get("requests") or {})}
        for name, value in merged.items():
            total[name] += _quantity(name, value)
    return total


@dataclass
class _Held:
    """The members a partial group placed and holds while it waits (their Permit wait)."""

    nodes: dict[str, str]  # pod uid -> node
    since: float


@dataclass
class Scheduler(_Loop):
    """Binds pending pods to nodes (a stand-in for kube-scheduler and the gang schedulers;
    see the module doc)."""

    api: client.ApiClient | None = None
    period: float = 0.2
    _held: dict[tuple[str, str, str], _Held] = field(default_factory=dict)
    _backoff: dict[tuple[str, str, str], float] = field(default_factory=dict)

    def tick(self) -> None:
        core = client.CoreV1Api(self.api)
        pods = _items(core.list_pod_for_all_namespaces(_preload_content=False))
        unbound = [pod for pod in pods if not pod["spec"].get("nodeName")
                   and not pod["metadata"].get("deletionTimestamp")
                   and (pod.get("status") or {}).get("phase", "Pending") == "Pending"
                   and not pod["spec"].get("schedulingGates")]
        waiting = {pod["metadata"]["uid"] for pod in unbound}
        for key, held in list(self._held.items()):  # members gone meanwhile: nothing held
            held.nodes = {uid: node for uid, node in held.nodes.items() if uid in waiting}
            if not held.nodes:
                del self._held[key]
        if not unbound:
            return
        every_node = _items(core.list_node(_preload_content=False))
        round_ = _Round(core, every_node, [n for n in every_node if schedulable(n)], pods,
                        self._held)
        gangs = self._gangs({gang_of(pod) for pod in unbound} - {None})
        for unit in _queue(unbound, gangs):
            if isinstance(unit, Gang):
                self._place_gang(round_, unit, [p for p in unbound if gang_of(p) == unit.key])
            elif (named := gang_of(unit)) is not None:
                round_.unschedulable(unit, f"its pod group {named[2]} does not exist")
            else:
                round_.place_one(unit)

    def _gangs(self, keys: set[Any]) -> dict[tuple[str, str, str], Gang]:
        """The groups the pending pods name, read from their PodGroups (absent: not there)."""
        custom = client.CustomObjectsApi(self.api)
        found = {}
        for mechanism, namespace, name in keys:
            group, version, plural = GANG_KINDS[mechanism]
            try:
                body = custom.get_namespaced_custom_object(group, version, namespace, plural,
                                                           name)
            except ApiException:
                continue
            spec = body.get("spec") or {}
            if mechanism == "WorkloadAPI":
                minimum = spec["schedulingPolicy"]["gang"]["minCount"]
                wait: float | None = PERMIT_WAIT_SECONDS
            elif mechanism == "Coscheduling":
                minimum = spec.get("minMember", 1)
                wait = float(spec.get("scheduleTimeoutSeconds", PERMIT_WAIT_SECONDS))
            else:
                minimum, wait = spec.get("minMember", 1), None
            found[mechanism, namespace, name] = Gang(
                mechanism, namespace, name, int(minimum),
                body["metadata"].get("creationTimestamp", ""), wait)
        return found

    def _place_gang(self, round_: _Round, gang: Gang, members: list[Manifest]) -> None:
        """All of a group's needed members or none; a Permit group holds a partial
        placement until its wait runs out, then lets go and backs off."""
        now = time.monotonic()
        if self._backoff.get(gang.key, 0.0) > now:
            return
        placed_before = sum(1 for pod in round_.active if gang_of(pod) == gang.key)
        if placed_before >= gang.min_count:  # the group was placed: the rest come one by one
            for pod in members:
                round_.place_one(pod)
            return
        if placed_before + len(members) < gang.min_count:
            for pod in members:
                round_.unschedulable(pod, f"pod group {gang.name}: {placed_before + len(members)}"
                                     f" of minCount {gang.min_count} pods exist")
            return
        held = self._held.pop(gang.key, None)
        placement = round_.place_group(members, held.nodes if held else {})
        needed = gang.min_count - placed_before
        if len(placement) >= needed:
            round_.bind_all(members, placement)
            return
        message = (f"pod group {gang.name}: {placed_before + len(placement)} of minCount "
                   f"{gang.min_count} fit")
        if gang.permit_wait is not None and placement:
            since = held.since if held else now
            if now - since < gang.permit_wait:
                self._held[gang.key] = _Held(placement, since)  # waiting at Permit
                round_.hold(members, placement)
                return
            message += f"; gave up after waiting {gang.permit_wait:g}s for the rest"
            self._backoff[gang.key] = now + GANG_BACKOFF_SECONDS
        for pod in members:
            round_.unschedulable(pod, message)


def _items(response: Any) -> list[Manifest]:
    """The items of a list answer read raw (the client's models drop fields they do not
    know, such as a pod's schedulingGroup)."""
    return list(json.loads(response.data)["items"])


def _queue(unbound: list[Manifest], gangs: dict[tuple[str, str, str], Gang]) -> list[Any]:
    """The order pods waiting at once are tried in: by worker index, then creation time (the
    first worker of every job before the second of any), a group as one unit at its
    PodGroup's creation time (as coscheduling's QueueSort keeps a group's members together).
    Two jobs started together are so interleaved on every run, as kube-scheduler's queue
    interleaves the pods of two controllers that create them at once."""
    units: dict[Any, tuple[Any, ...]] = {}
    for pod in unbound:
        key = gang_of(pod)
        if key is not None and key in gangs:
            gang = gangs[key]
            units[key] = (0, gang.created, gang.name, gang)
        else:
            meta = pod["metadata"]
            index = int((meta.get("labels") or {}).get(INDEX_LABEL, 0))
            units[meta["uid"]] = (index, meta.get("creationTimestamp", ""), meta["name"], pod)
    return [unit[-1] for unit in sorted(units.values(), key=lambda unit: unit[:3])]


class _Round:
    """One pass over the pending pods: the nodes, what each has left, the pods on them."""

    def __init__(self, core: client.CoreV1Api, every_node: list[Manifest],
                 nodes: list[Manifest], pods: list[Manifest],
                 held: dict[tuple[str, str, str], _Held]) -> None:
        self.core = core
        self.every_node = every_node
        self.nodes = {node["metadata"]["name"]: node for node in nodes}
        # Pods holding a node: bound and not finished, deleting ones too until they are gone.
        self.active = [pod for pod in pods if pod["spec"].get("nodeName")
                       and (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed")]
        self.used: dict[str, Counter[str]] = {name: Counter() for name in self.nodes}
        self.where: dict[str, list[Manifest]] = {}  # node -> pods placed there (for affinity)
        for pod in self.active:
            self._take(pod, pod["spec"]["nodeName"])
        by_uid = {pod["metadata"]["uid"]: pod for pod in pods}
        for group in held.values():
            for uid, node in group.nodes.items():
                if uid in by_uid:
                    self._take(by_uid[uid], node)

    def _take(self, pod: Manifest, node: str) -> None:
        self.used.setdefault(node, Counter()).update(requests_of(pod))
        self.where.setdefault(node, []).append(pod)

    def _give_back(self, pod: Manifest, node: str) -> None:
        self.used[node].subtract(requests_of(pod))
        self.where[node].remove(pod)

    def why_not(self, pod: Manifest, node: Manifest) -> str:
        """Why `pod` cannot go to `node` now; empty when it can."""
        static = _why_not(pod, node)
        if static:
            return static
        allocatable = (node.get("status") or {}).get("allocatable") or {}
        used = self.used.get(node["metadata"]["name"], Counter())
        for resource, amount in requests_of(pod).items():
            if resource in allocatable and \
                    used[resource] + amount > _quantity(resource, allocatable[resource]):
                return f"Insufficient {resource}"
        for term in _pod_affinity(pod, required=True):
            domains = self._domains(pod, term)
            value = (node["metadata"].get("labels") or {}).get(term["topologyKey"])
            if value is None or (domains and value not in domains):
                return "didn't match pod affinity rules"
        return ""

    def _domains(self, pod: Manifest, term: Manifest) -> set[str]:
        """The values of `term`'s topology key on the nodes of the pods it selects."""
        wanted = (term.get("labelSelector") or {}).get("matchLabels") or {}
        values = set()
        for node, placed in self.where.items():
            if any(other is not pod and all(
                    (other["metadata"].get("labels") or {}).get(k) == v
                    for k, v in wanted.items()) for other in placed):
                labels = (self.nodes.get(node, {}).get("metadata", {}).get("labels") or {})
                if term["topologyKey"] in labels:
                    values.add(labels[term["topologyKey"]])
        return values

    def choose(self, pod: Manifest, candidates: list[str] | None = None) -> str | None:
        """The node `pod` goes to: one it fits, preferring its preferred affinity's domains,
        then the node running the fewest pods (least-allocated spreading)."""
        fits = [name for name in (sorted(self.nodes) if candidates is None else candidates)
                if not self.why_not(pod, self.nodes[name])]
        if not fits:
            return None

        def score(name: str) -> tuple[float, int, str]:
            labels = self.nodes[name]["metadata"].get("labels") or {}
            preferred = sum(term.get("weight", 1) for term in _pod_affinity(pod, required=False)
                            if labels.get(term["podAffinityTerm"]["topologyKey"])
                            in self._domains(pod, term["podAffinityTerm"]))
            return -preferred, self.used[name]["pods"], name

        return min(fits, key=score)

    def place_one(self, pod: Manifest) -> None:
        chosen = self.choose(pod)
        if chosen is None:
            self.unschedulable(pod)
            return
        self.bind(pod, chosen)

    def place_group(self, members: list[Manifest], held: dict[str, str]) -> dict[str, str]:
        """Where as many of `members` as fit go together (uid -> node), keeping the nodes
        held members already hold. With a required topology, within the one domain where
        most fit (a topology-aware gang scheduler's choice: kube-scheduler's pod-by-pod
        affinity may pick a domain for the first pod where the rest do not fit)."""
        for pod in members:  # held members count as placed; try afresh around them
            if pod["metadata"]["uid"] in held:
                self._give_back(pod, held[pod["metadata"]["uid"]])
        terms = _pod_affinity(members[0], required=True)
        options: list[list[str] | None] = [None]
        if terms and not self._domains(members[0], terms[0]):
            key = terms[0]["topologyKey"]
            values = sorted({(n["metadata"].get("labels") or {}).get(key)
                             for n in self.nodes.values()} - {None})
            options = [[name for name, n in sorted(self.nodes.items())
                        if (n["metadata"].get("labels") or {}).get(key) == value]
                       for value in values]
        best: dict[str, str] = {}
        for candidates in options:
            placement: dict[str, str] = {}
            for pod in members:
                node = held.get(pod["metadata"]["uid"])
                if node is None or self.why_not(pod, self.nodes[node]):
                    node = self.choose(pod, candidates)
                if node is not None:
                    placement[pod["metadata"]["uid"]] = node
                    self._take(pod, node)
            for pod in members:  # tried, not taken: the caller binds or holds the best
                if pod["metadata"]["uid"] in placement:
                    self._give_back(pod, placement[pod["metadata"]["uid"]])
            if len(placement) > len(best):
                best = placement
        return best

    def hold(self, members: list[Manifest], placement: dict[str, str]) -> None:
        for pod in members:
            node = placement.get(pod["metadata"]["uid"])
            if node is not None:
                self._take(pod, node)
            else:
                self.unschedulable(pod, "waiting for the rest of its pod group")

    def bind_all(self, members: list[Manifest], placement: dict[str, str]) -> None:
        for pod in members:
            node = placement.get(pod["metadata"]["uid"])
            if node is not None:
                self.bind(pod, node)

    def bind(self, pod: Manifest, node: str) -> None:
        meta = pod["metadata"]
        with contextlib.suppress(ApiException):
            # Before the bind: the node agent writes the status of bound pods only.
            _mark_scheduled(self.core, pod)
            self.core.patch_namespaced_pod(meta["name"], meta["namespace"],
                                           {"spec": {"nodeName": node}})
            self._take(pod, node)

    def unschedulable(self, pod: Manifest, extra: str = "") -> None:
        _mark_unschedulable(self.core, pod, self.every_node, self, extra)


def _pod_affinity(pod: Manifest, required: bool) -> list[Manifest]:
    affinity = ((pod.get("spec") or {}).get("affinity") or {}).get("podAffinity") or {}
    key = ("requiredDuringSchedulingIgnoredDuringExecution" if required
           else "preferredDuringSchedulingIgnoredDuringExecution")
    return list(affinity.get(key) or [])


def _conditions(pod: Manifest) -> list[Manifest]:
    return list((pod.get("status") or {}).get("conditions") or [])


def _mark_unschedulable(core: client.CoreV1Api, pod: Manifest, nodes: list[Manifest],
                        round_: _Round, extra: str = "") -> None:
    """PodScheduled False, reason Unschedulable, saying why each node does not fit (and why
    its group waits); written when the words change, so that lastTransitionTime says since
    when it has not been scheduled."""
    why = Counter("not Ready" if not ready(node) else "were unschedulable" if cordoned(node)
                  else round_.why_not(pod, node) for node in nodes)
    why.pop("", None)  # nodes it would fit alone: its group is what keeps it waiting
    reasons = ", ".join(f"{count} node(s) {reason}" for reason, count in sorted(why.items()))
    message = f"0/{len(nodes)} nodes are available" + (f": {reasons}." if reasons else ".")
    if extra:
        message += f" {extra[0].upper()}{extra[1:]}."
    previous = next((c for c in _conditions(pod) if c.get("type") == "PodScheduled"), {})
    if previous.get("status") == "False" and previous.get("message") == message:
        return
    since = previous.get("lastTransitionTime") if previous.get("status") == "False" else None
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    meta = pod["metadata"]
    with contextlib.suppress(ApiException):  # gone meanwhile
        core.patch_namespaced_pod_status(meta["name"], meta["namespace"], {
            "status": {"conditions": [
                {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                 "message": message, "lastTransitionTime": since or now}]}})


def _mark_scheduled(core: client.CoreV1Api, pod: Manifest) -> None:
    """PodScheduled True for a pod about to be bound, as the API server's binding sets it,
    where it was marked Unschedulable before."""
    if not any(c.get("type") == "PodScheduled" and c.get("status") == "False"
               for c in _conditions(pod)):
        return
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    meta = pod["metadata"]
    core.patch_namespaced_pod_status(meta["name"], meta["namespace"], {
        "status": {"conditions": [
            {"type": "PodScheduled", "status": "True", "lastTransitionTime": now}]}})


def schedulable(node: Manifest) -> bool:
    """Whether its kubelet reports it Ready and it is not cordoned."""
    return ready(node) and not cordoned(node)


def ready(node: Manifest) -> bool:
    """Whether its kubelet reports it Ready."""
    conditions = {c.get("type"): c.get("status")
                  for c in (node.get("status") or {}).get("conditions") or []}
    return conditions.get("Ready") == "True"


def cordoned(node: Manifest) -> bool:
    """Whether it is cordoned (`kubectl cordon`: spec.unschedulable), which keeps new pods
    off it, as kube-scheduler's NodeUnschedulable plug-in does; its pods run on."""
    return bool((node.get("spec") or {}).get("unschedulable"))


def _tolerates(pod: Manifest, taint: Manifest) -> bool:
    for toleration in (pod.get("spec") or {}).get("tolerations") or []:
        if toleration.get("effect") not in (None, "", taint.get("effect")):
            continue
        if toleration.get("operator") == "Exists" and \
                toleration.get("key") in (None, "", taint.get("key")):
            return True
        if toleration.get("key") == taint.get("key") and \
                (toleration.get("value") or "") == (taint.get("value") or ""):
            return True
    return False


def _why_not(pod: Manifest, node: Manifest) -> str:
    """Why the pod's nodeSelector, tolerations or node affinity keep it off `node`; empty
    when they do not."""
    labels = dict(node["metadata"].get("labels") or {})
    labels.setdefault(HOSTNAME_LABEL, node["metadata"]["name"])
    spec = pod.get("spec") or {}
    if any(labels.get(key) != value for key, value in (spec.get("nodeSelector") or {}).items()):
        return "didn't match Pod's node selector"
    taints = (node.get("spec") or {}).get("taints") or []
    if any(taint.get("effect") in ("NoSchedule", "NoExecute") and not _tolerates(pod, taint)
           for taint in taints):
        return "had untolerated taint"
    node_affinity = (spec.get("affinity") or {}).get("nodeAffinity") or {}
    required = node_affinity.get("requiredDuringSchedulingIgnoredDuringExecution")
    if not required:
        return ""
    for term in required.get("nodeSelectorTerms") or []:
        if all(_matches(expression, labels) for expression in term.get("matchExpressions") or []):
            return ""
    return "didn't match Pod's node affinity"


def _matches(expression: Manifest, labels: dict[str, str]) -> bool:
    value = labels.get(expression["key"])
    operator = expression["operator"]
    if operator == "In":
        return value in (expression.get("values") or [])
    if operator == "NotIn":
        return value not in (expression.get("values") or [])
    if operator == "Exists":
        return value is not None
    if operator == "DoesNotExist":
        return value is None
    raise NotImplementedError(f"the stand-in scheduler has no operator {operator}")


@dataclass
class Kubelet(_Loop):
    """What a kubelet does to pods that a test on the emulator needs, and nothing else (a
    stand-in; no container runs, see tests/cluster/node_agent.py for one that does): a pod
    bound to one of `nodes` (any node when None) is marked Running and Ready, and a pod
    deleted gracefully is removed at once, as a kubelet whose containers stopped. A test
    ends a pod's training by setting its phase itself."""

    api: client.ApiClient | None = None
    period: float = 0.2
    nodes: frozenset[str] | None = None

    def tick(self) -> None:
        core = client.CoreV1Api(self.api)
        for pod in _items(core.list_pod_for_all_namespaces(_preload_content=False)):
            meta, spec = pod["metadata"], pod["spec"]
            node = spec.get("nodeName")
            if not node or (self.nodes is not None and node not in self.nodes):
                continue
            with contextlib.suppress(ApiException):  # gone meanwhile
                if meta.get("deletionTimestamp"):
                    core.delete_namespaced_pod(meta["name"], meta["namespace"],
                                               grace_period_seconds=0)
                elif (pod.get("status") or {}).get("phase", "Pending") == "Pending":
                    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
                    core.patch_namespaced_pod_status(meta["name"], meta["namespace"], {
                        "status": {"phase": "Running", "startTime": now, "conditions": [
                            {"type": "PodScheduled", "status": "True"},
                            {"type": "Ready", "status": "True", "lastTransitionTime": now}]}})


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
