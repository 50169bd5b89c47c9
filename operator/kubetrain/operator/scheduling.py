"""Placement: the steps of a reconcile pass that decide how a job's workers are placed.

- `choose`: status.scheduling: the gang mechanism (spec.scheduling.gang; Auto resolved from
  what the cluster serves, kept once chosen), why, and which of Kueue's paths the job takes;
  an event says both.
- `admit`: Kueue's Workload path. The job's Kueue Workload exists, and the job waits
  suspended (no pods, its group released) until Kueue admits it; admitted, it runs with as
  many workers as Kueue admitted (partial admission); evicted, its pods stop and, once gone,
  the quota reservation is given back. A change of the pod set (a rescale) is a new
  Workload: the job goes back to its queue, as a Kueue-managed Job does.
- `ensure_group`: the gang's objects exist before any pod, sized minReplicas (capped at the
  workers the job runs). Volcano's and scheduler-plugins' PodGroups take a new size in place;
  a v1alpha2 Workload's and PodGroup's are immutable, so the group keeps its size (new
  workers join a group already placed) until the next whole-group restart, which renews the
  runtime PodGroup (and the Workload, when the size changed): each scheduling of the whole
  group is a PodGroup of its own. A partial restart keeps the group; replacements join it.
- `shape_pod`: what each worker pod carries: its group, Kueue's marks or admission (node
  labels, tolerations, and the worker's topology domain, given in torch's rank order so
  that the ranks of one domain are adjacent), or pod affinity for the topology level.
- `release`: suspend, Kueue's queue and the job's end delete the gang objects (a Volcano
  PodGroup's minResources hold queue capacity even without pods); suspend deletes the Kueue
  Workload, the end marks it Finished.

The builders are `kubetrain.operator.gang` and `kubetrain.operator.kueue`; the facts
`kubetrain.operator.scheduling_facts`. Pure: no Kubernetes, no clock but the pass's `now`.
"""

from __future__ import annotations

import copy
from typing import Any, Final

from kubetrain import pod_conventions
from kubetrain.api.scheduling import KueueStatus, SchedulingStatus, kueue_path
from kubetrain.api.trainingjob import FINISHED, TrainingJob
from kubetrain.operator import children, gang, kueue
from kubetrain.operator.actions import CreateObject, DeleteObject, PatchObject
from kubetrain.operator.reconcile_pass import ReconcilePass
from kubetrain.operator.scheduling_facts import GroupObject

KUEUE_API: Final = (kueue.KUEUE_WORKLOAD.api_version, kueue.KUEUE_WORKLOAD.kind)
GANG_API_KINDS: Final = frozenset((api.api_version, api.kind) for api in gang.GANG_APIS)
# The condition a job holds while the operator cannot make what it needs to place it.
BLOCKED: Final = "PlacementBlocked"


def _as_run(decision: ReconcilePass) -> TrainingJob:
    return decision.job.model_copy(update={"status": decision.status})


def _state(decision: ReconcilePass) -> SchedulingStatus:
    scheduling = decision.status.scheduling
    assert scheduling is not None, "choose() runs first"
    return scheduling


def _mine(decision: ReconcilePass, api: frozenset[tuple[str, str]]) -> list[GroupObject]:
    return [obj for obj in decision.observed.groups if obj.api in api and not obj.deleting]


def _blocked(decision: ReconcilePass, reason: str, message: str) -> None:
    """Hold the PlacementBlocked condition, with a warning when it first says this."""
    previous = decision.condition_of(BLOCKED)
    if previous is None or previous.status != "True" or previous.message != message:
        decision.event(reason, message, warning=True)
    decision.condition(BLOCKED, True, reason, message)


def _unblocked(decision: ReconcilePass) -> None:
    if decision.condition_since(BLOCKED) is not None:
        decision.condition(BLOCKED, False, "Placed", "")


# --- the choice -----------------------------------------------------------------------------


def choose(decision: ReconcilePass) -> None:
    """status.scheduling's mechanism (kept once chosen) and Kueue's path, each said once."""
    job, status = decision.job, decision.status
    if status.scheduling is None:
        chosen, reason = gang.choose(job.spec.scheduling.gang,
                                     job.spec.workers.template.scheduler_name,
                                     decision.observed.served)
        status.scheduling = SchedulingStatus(gang=chosen, reason=reason)
        if chosen != "None" or job.spec.scheduling.gang != "Auto":
            # Auto finding nothing is said in status.scheduling alone: most jobs, no news.
            decision.event("GangChosen", f"gang {chosen}: {reason}")
    path = kueue_path(job.spec.scheduling.queue, job.metadata.labels)
    scheduling = status.scheduling
    if path is None:
        scheduling.kueue = None
        return
    name, queue, why = path
    kept = scheduling.kueue
    if kept is None or kept.path != name or kept.queue != queue:
        scheduling.kueue = KueueStatus(path=name, queue=queue, message=why)
        decision.event("KueuePath", f"queue {queue}, Kueue's {name} path: {why}")


# --- Kueue's Workload path --------------------------------------------------------------------


def _template(decision: ReconcilePass) -> dict[str, Any]:
    """Worker 0 as it would be created now: the pod set's template, and what one pod asks."""
    pod = children.worker_pod(_as_run(decision), 0, decision.status.restart_attempt)
    _join_group(decision, pod)
    return pod


def admit(decision: ReconcilePass) -> bool:
    """Kueue's Workload path: keep the job's Workload; True once Kueue admits it (the pass
    then runs as many workers as admitted), False while the job waits suspended. Jobs
    without that path are always admitted."""
    scheduling = _state(decision)
    state = scheduling.kueue
    if state is None or state.path != "Workload":
        return True
    job, status = decision.job, decision.status
    if "Kueue" not in decision.observed.served:
        _wait(decision, "KueueNotServed", f"spec.scheduling.queue is {state.queue}, but the "
              "cluster serves no kueue.x-k8s.io/v1beta1 Workloads: install Kueue (and list "
              "TrainingJob.v1alpha1.kubetrain.io in its integrations.externalFrameworks), or "
              "remove spec.scheduling.queue")
        return False
    workers = job.spec.workers
    wanted = kueue.workload(job, kueue.workload_name(decision.name, state.workload),
                            workers.replicas, min(workers.min_workers, workers.replicas),
                            _template(decision))
    mine = sorted(_mine(decision, frozenset({KUEUE_API})),
                  key=lambda obj: (obj.name != state.workload, obj.name))
    current = next((obj for obj in mine if kueue.pod_set_shape({"spec": obj.spec})
                    == kueue.pod_set_shape(wanted)), None)
    for stale in mine:
        if stale is not current:
            decision.actions.append(DeleteObject(*KUEUE_API, stale.name, "Requeued"))
            if stale.name == state.workload and state.admitted:
                decision.event("Requeued", f"the pod set changed (workers {workers.replicas}, "
                               f"minReplicas {workers.min_workers}): Kueue's admitted pod "
                               "sets cannot change, so the job goes back to queue "
                               f"{state.queue} with a new Workload")
                state.admitted = False
    if current is None:
        decision.actions.append(CreateObject(wanted))
        state.workload = wanted["metadata"]["name"]
        state.admitted = False
        _wait(decision, "Queued", f"waiting for Kueue to admit Workload {state.workload} in "
              f"queue {state.queue}")
        return False
    state.workload = current.name
    _unblocked(decision)
    evicted = current.holds("Evicted")
    admitted = current.admission
    if admitted is not None and current.holds("Admitted") and not evicted:
        missing = kueue.missing_flavors(admitted, decision.observed.flavors)
        if missing:  # the ResourceFlavor index has not caught up: no pod without its labels
            return False
        decision.admitted = admitted.count
        if not state.admitted:
            state.admitted = True
            state.message = (f"admitted by ClusterQueue {admitted.cluster_queue}: "
                             f"{admitted.count} workers on flavor "
                             f"{', '.join(admitted.flavors) or 'none'}")
            decision.event("Admitted", f"Kueue admitted Workload {current.name}: "
                           f"{state.message}")
            if status.phase == "Suspended":
                status.phase = "Pending"
                decision.condition("Suspended", False, "Admitted", state.message)
        return True
    if evicted:
        why = current.message_of("Evicted") or "evicted"
        if state.admitted:
            decision.event("EvictedByKueue", f"Kueue evicted Workload {current.name}: {why}; "
                           "the workers checkpoint and stop, and the job waits in queue "
                           f"{state.queue}", warning=True)
        state.admitted = False
        _wait(decision, "EvictedByKueue", f"evicted by Kueue ({why}): waiting to be admitted "
              f"again in queue {state.queue}")
        if admitted is not None and not decision.observed.pods:
            decision.actions.append(PatchObject(*KUEUE_API, current.name, {
                "status": kueue.released_status(current.conditions, why, decision.now)},
                status=True))
        return False
    state.admitted = False
    _wait(decision, "Queued", f"waiting for Kueue to admit Workload {current.name} in queue "
          f"{state.queue}")
    return False


def _wait(decision: ReconcilePass, reason: str, message: str) -> None:
    """The job waits for Kueue: suspended, no pods (each checkpoints on its SIGTERM), its
    gang released. KueueNotServed also holds PlacementBlocked."""
    status = decision.status
    status.workers.desired = 0
    for pod in decision.live_pods():
        decision.delete(pod, reason)
    _release_gang(decision, reason)
    if reason == "KueueNotServed":
        _blocked(decision, reason, message)
    state = _state(decision).kueue
    assert state is not None
    first = status.phase != "Suspended" or state.message != message
    state.message = message
    if first:
        status.phase = "Suspended"
        decision.condition("Suspended", True, reason, message)
        decision.condition("Running", False, reason)
        decision.condition("Restarting", False, reason)
        if reason != "KueueNotServed":
            decision.event(reason, message, warning=reason != "Queued")


# --- the gang -----------------------------------------------------------------------------------


def _attempt_of(group: str, job_name: str) -> int:
    suffix = group.removeprefix(f"{job_name}-")
    return int(suffix) if suffix.isdigit() else -1


def _group_name(decision: ReconcilePass, mechanism: str) -> str:
    """The group the pods join: the job's name; for the Workload API a runtime PodGroup per
    scheduling of the whole group, `<job>-<restart attempt>`, renewed by each whole-group
    restart."""
    name = decision.name
    if mechanism != "WorkloadAPI":
        return name
    status = decision.status
    current = _state(decision).pod_group or f"{name}-{status.restart_attempt}"
    restart = status.restart
    if (restart is not None and restart.whole_group
            and _attempt_of(current, name) < restart.attempt):
        return f"{name}-{restart.attempt}"
    return current


def ensure_group(decision: ReconcilePass) -> bool:
    """The gang's objects as the job needs them now, before its pods; False when they cannot
    be made (the mechanism's API is not served), and then no pod is created."""
    scheduling = _state(decision)
    mechanism = scheduling.gang
    if mechanism == "None":
        return True
    if mechanism not in decision.observed.served:
        apis = ", ".join(sorted({f"{api.api_version} {api.kind}"
                                 for api in gang.MECHANISM_APIS[mechanism]}))
        _blocked(decision, "GangNotServed", f"gang {mechanism} needs {apis}, which the "
                 "cluster does not serve: install it (docs/scheduling.md) and restart the "
                 "operator, or set spec.scheduling.gang to Auto or None; no pod is created "
                 "without its group")
        return False
    _unblocked(decision)
    job = decision.job
    min_count = min(job.spec.workers.min_workers, decision.replicas)
    group = _group_name(decision, mechanism)
    renewed = scheduling.pod_group is not None and group != scheduling.pod_group
    per_pod: dict[str, int] = {}
    if mechanism in ("Volcano", "Coscheduling"):  # their minResources: what a worker asks
        per_pod = gang.pod_requests(children.worker_pod(_as_run(decision), 0,
                                                        decision.status.restart_attempt))
    wanted = gang.group_objects(job, mechanism, group, min_count, per_pod)
    have = {(obj.api_version, obj.kind, obj.name): obj
            for obj in _mine(decision, GANG_API_KINDS)}
    sized = min_count
    for manifest in wanted:
        key = (manifest["apiVersion"], manifest["kind"], manifest["metadata"]["name"])
        held = have.pop(key, None)
        if held is None:
            decision.actions.append(CreateObject(manifest))
            continue
        mutable = gang.mutable_spec(manifest)
        if held.min_count == min_count and (mutable is None or _same(held.spec, mutable)):
            continue  # an immutable one is judged by its size alone (the server adds fields)
        if mutable is not None:
            decision.actions.append(PatchObject(*key, {"spec": mutable}))
        elif renewed:  # a new runtime group: its Workload takes the new size too
            decision.actions.append(DeleteObject(*key, "GangRenewed"))
            decision.actions.append(CreateObject(manifest))
        else:
            sized = held.min_count or sized
    for stale in have.values():  # an earlier runtime PodGroup: its pods are gone or going
        decision.actions.append(DeleteObject(stale.api_version, stale.kind, stale.name,
                                             "GangRenewed"))
    _say_size(decision, mechanism, group, renewed, sized, min_count)
    scheduling.pod_group, scheduling.min_count = group, sized
    scheduling.wanted_min_count = min_count
    return True


def _same(held: Any, wanted: Any) -> bool:
    """Whether the stored spec has every value the built one sets (the server may add more)."""
    if isinstance(wanted, dict):
        return isinstance(held, dict) and all(_same(held.get(key), value)
                                              for key, value in wanted.items())
    return bool(held == wanted)


def _say_size(decision: ReconcilePass, mechanism: str, group: str, renewed: bool, sized: int,
              wanted: int) -> None:
    """An event when the group was renewed or changed size, or had to keep its size."""
    scheduling = _state(decision)
    before = scheduling.min_count
    if renewed:
        decision.event("GangRenewed", f"the whole group restarts: its pods join a new "
                       f"PodGroup {group} (minCount {sized})")
    elif before is not None and sized != before:
        decision.event("GangResized", f"{mechanism} group {group}: minMember {before} -> "
                       f"{sized}")
    elif sized != wanted and scheduling.wanted_min_count != wanted:
        decision.event("GangMinCountKept", f"group {group} keeps minCount {sized} (the job "
                       f"now needs {wanted}): a v1alpha2 PodGroup's minCount cannot change, so "
                       "new workers join the group already placed, and the next whole-group "
                       "restart renews it with the new size")


# --- the pods -----------------------------------------------------------------------------------


def _join_group(decision: ReconcilePass, pod: dict[str, Any]) -> None:
    """The pod's membership of the job's gang, when it has one."""
    scheduling = _state(decision)
    if scheduling.gang == "None" or scheduling.pod_group is None:
        return
    membership = gang.membership(decision.job, scheduling.gang, scheduling.pod_group)
    meta = pod["metadata"]
    if membership.labels:
        meta["labels"] = {**meta.get("labels", {}), **membership.labels}
    if membership.annotations:
        meta["annotations"] = {**meta.get("annotations", {}), **membership.annotations}
    pod["spec"].update(copy.deepcopy(membership.spec))


def shape_pod(decision: ReconcilePass, pod: dict[str, Any], index: int) -> None:
    """Make worker pod `index` (a `children.worker_pod` manifest) placed as the job asks: its
    group, Kueue's marks or admission, and its topology."""
    _join_group(decision, pod)
    job = decision.job
    state = _state(decision).kueue
    meta, spec = pod["metadata"], pod["spec"]
    topology = job.spec.scheduling.topology
    if state is not None and state.path == "PodGroup":
        labels, annotations = kueue.pod_group_marks(job, decision.replicas)
        meta["labels"] = {**meta.get("labels", {}), **labels}
        meta["annotations"] = {**meta.get("annotations", {}), **annotations}
        return  # Kueue places the group within the topology level itself
    if state is not None and state.path == "Workload":
        admitted = _admission(decision)
        if admitted is not None:
            placed = kueue.placement(admitted, decision.observed.flavors)
            selector = {**spec.get("nodeSelector", {}), **placed.node_selector}
            position = rank_position(job.metadata.name, index, len(placed.per_worker))
            if position is not None:
                selector.update(placed.per_worker[position])
            if selector:
                spec["nodeSelector"] = selector
            tolerations = list(spec.get("tolerations", []))
            tolerations += [t for t in placed.tolerations if t not in tolerations]
            if tolerations:
                spec["tolerations"] = tolerations
            if admitted.levels:
                return  # Kueue's topology assignment places each worker
    if topology is not None:
        spec["affinity"] = topology_affinity(spec.get("affinity"), job.metadata.name,
                                             topology.level, topology.mode)


def rank_position(job_name: str, index: int, count: int) -> int | None:
    """Where worker `index` of `count` stands in torch's rank order; None past `count`.

    torch's c10d rendezvous numbers the agents of a round in the order of their sorted node
    descriptors, whose first field is the host's name (socket.getfqdn(): `<job>-worker-<i>.
    <job>.<namespace>.svc...` in a pod): sorted as strings, so worker 10 comes before worker
    2. Giving the k-th domain slot to the worker torch ranks k-th keeps the ranks of one
    domain adjacent at any size, not only below ten workers.
    """
    if index >= count:
        return None
    order = sorted(range(count), key=lambda i: f"{pod_conventions.pod_name(job_name, i)}.")
    return order.index(index)


def _admission(decision: ReconcilePass) -> kueue.Admission | None:
    state = _state(decision).kueue
    if state is None:
        return None
    return next((obj.admission for obj in _mine(decision, frozenset({KUEUE_API}))
                 if obj.name == state.workload), None)


def topology_affinity(affinity: dict[str, Any] | None, job_name: str, level: str,
                      mode: str) -> dict[str, Any]:
    """The pod's affinity with the job's pods kept within one domain of `level`: a required
    pod affinity (Required) or a preferred one of the greatest weight (Preferred), which
    kube-scheduler's InterPodAffinity, Volcano and the gang plug-ins all honour."""
    merged = copy.deepcopy(affinity) if affinity else {}
    term = {"labelSelector": pod_conventions.worker_label_selector(job_name),
            "topologyKey": level}
    pods = merged.setdefault("podAffinity", {})
    if mode == "Required":
        key = "requiredDuringSchedulingIgnoredDuringExecution"
        pods[key] = [*pods.get(key, []), term]
    else:
        key = "preferredDuringSchedulingIgnoredDuringExecution"
        pods[key] = [*pods.get(key, []), {"weight": 100, "podAffinityTerm": term}]
    return merged


# --- release ------------------------------------------------------------------------------------


def _release_gang(decision: ReconcilePass, reason: str) -> None:
    for obj in _mine(decision, GANG_API_KINDS):
        decision.actions.append(DeleteObject(obj.api_version, obj.kind, obj.name, reason))


def release(decision: ReconcilePass) -> None:
    """Give back what the job holds: the gang's objects, and its Kueue Workload (deleted when
    suspended, marked Finished when the job finished)."""
    status = decision.status
    finished = status.phase in FINISHED
    _release_gang(decision, "JobFinished" if finished else "Suspended")
    scheduling = status.scheduling
    for obj in _mine(decision, frozenset({KUEUE_API})):
        if not finished:
            decision.actions.append(DeleteObject(*KUEUE_API, obj.name, "Suspended"))
        elif not obj.holds("Finished"):
            condition = decision.condition_of(status.phase or "")
            message = (condition.message if condition is not None else None) or "finished"
            decision.actions.append(PatchObject(*KUEUE_API, obj.name, {
                "status": kueue.finished_status(obj.conditions, status.phase == "Succeeded",
                                                message, decision.now)}, status=True))
    if scheduling is not None and scheduling.kueue is not None:
        scheduling.kueue.admitted = False
