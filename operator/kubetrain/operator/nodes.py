"""Nodes: the steps of a reconcile pass that act on slow, broken and lost nodes.

- a pod whose trainer's lifeline went silent is taken for one of a lost node, and its
  node avoided (Unreachable), before any node controller notices;
- pods already terminating on a lost node are force-deleted (no kubelet will confirm);
- runPolicy.stragglers.action Replace: a new straggler's node is avoided and its pod
  recreated off it (the rule that names stragglers is `kubetrain.operator.stragglers`);
- nodes are avoided (status.avoidedNodes) after a straggler, a failed preflight or
  repeated failures, until they expire; pods that avoidance leaves unschedulable wait or
  make the job avoid less; the NodesAvoided condition says which (the rules are
  `kubetrain.operator.avoidance`).
- spec.checkpoint.memory: the MemoryCopiesShareNode condition and event when worker
  pods share a node so that partner copies cannot all be elsewhere (one node, or more
  than half the pods on one).

Each step reads and writes the pass's `ReconcilePass` (`kubetrain.operator.reconcile_pass`),
through its primitives; no Kubernetes, no clock but the pass's `now`.
"""

from __future__ import annotations

import collections
from dataclasses import replace

from kubetrain.api.trainingjob import RankSlowness
from kubetrain.operator import avoidance, stragglers
from kubetrain.operator.facts import WorkerPod
from kubetrain.operator.reconcile_pass import ReconcilePass


def lose_silent_pods(decision: ReconcilePass) -> None:
    """A running pod whose trainer's lifeline stopped beating is one of a lost node: the
    failure steps replace it at once (no grace: nothing there answers), and its node is
    avoided, since the scheduler still takes it for Ready until the node lifecycle
    controller marks it (40 s and more on a real cluster)."""
    silent = decision.observed.silent_pods
    if not silent:
        return
    lost = []
    for pod in decision.observed.pods:
        if pod.name in silent and pod.phase == "Running" and pod.active and not pod.node_lost:
            lost.append(replace(pod, node_lost=True))
            avoid_node(decision, pod.node, "Unreachable",
                       f"the lifeline of {pod.name}'s trainer stopped beating")
    if lost:
        by_name = {pod.name: pod for pod in lost}
        decision.observed = replace(decision.observed, pods=tuple(
            by_name.get(pod.name, pod) for pod in decision.observed.pods))


def release_pods_of_lost_nodes(decision: ReconcilePass) -> None:
    """Force-delete pods already terminating on a lost node.

    No kubelet will ever confirm their deletion (the taint eviction controller only
    marks them), and each holds the name its replacement needs.
    """
    for pod in decision.observed.pods:
        if pod.deleting and pod.node_lost and pod.name not in decision.deleted:
            decision.delete(pod, "NodeLost")


def replace_stragglers(decision: ReconcilePass) -> None:
    """runPolicy.stragglers.action Replace: avoid each new straggler's node and recreate
    its pod off it, the whole group when it is worker 0's (the rendezvous host).

    Each pod gets the template's grace: the group checkpoints on its SIGTERM and
    resumes from that checkpoint. Not counted in maxRestarts and with no backoff, but
    limited to maxRestarts replacements (status.stragglerReplacements), so a job whose
    slowness follows it from node to node ends up reporting instead of replacing.
    """
    policy = decision.job.spec.run_policy
    status = decision.status
    if (policy.stragglers.action != "Replace" or not decision.new_stragglers
            or status.phase != "Running"):
        return
    chosen = _replaceable(decision)
    if not chosen:
        return
    tensor_parallel = decision.job.spec.parallelism.tensor_parallel  # a group is named as one
    said = [stragglers.describe(rank, policy.stragglers.window, tensor_parallel)
            for rank, _ in chosen]
    for (rank, _), what in zip(chosen, said, strict=True):
        avoid_node(decision, rank.node, "Straggler", what)
    status.straggler_replacements += len(chosen)
    broken = [pod for _, pod in chosen]
    decision.restart("StragglerReplaced", "; ".join(said) + " (runPolicy.stragglers.action: "
                     "Replace)", broken, whole_group=decision.takes_every_worker(broken),
                     counted=False)
    # The next interval is the new group's: no streak carries over from the old one.
    if status.ranks is not None:
        for rank in status.ranks.ranks:
            rank.slow_intervals = rank.normal_intervals = 0
            rank.straggler = False


def _replaceable(decision: ReconcilePass) -> list[tuple[RankSlowness, WorkerPod]]:
    """The new stragglers' live pods, each once, within the replacements left (an event
    for each one kept)."""
    policy = decision.job.spec.run_policy
    done = decision.status.straggler_replacements
    pods = {pod.name: pod for pod in decision.live_pods()}
    chosen: list[tuple[RankSlowness, WorkerPod]] = []
    for rank in decision.new_stragglers:
        pod = pods.get(rank.pod)
        if pod is None or any(pod is other for _, other in chosen):
            continue
        if done + len(chosen) >= policy.max_restarts:
            decision.event("StragglerKept",
                           f"{rank.pod} on node {rank.node} is not replaced: the job already "
                           f"replaced {done} stragglers, at most runPolicy.maxRestarts "
                           f"({policy.max_restarts}); raise it, or set "
                           "runPolicy.stragglers.action to Report", warning=True)
            continue
        chosen.append((rank, pod))
    return chosen


def avoid_node(decision: ReconcilePass, node: str | None, reason: avoidance.AvoidReason,
               message: str) -> None:
    """Add a node to status.avoidedNodes (once while it is avoided) with an event."""
    policy = decision.job.spec.run_policy
    entry = avoidance.avoid(decision.status.avoided_nodes, node, reason, message, decision.now,
                            policy.avoid_nodes_seconds)
    if entry is None:
        return
    decision.status.avoided_nodes.append(entry)
    decision.event("NodeAvoided",
                   f"avoiding node {entry.node} until {avoidance.stamp(entry.expires)} "
                   f"({reason}: {message}): worker pods of this job created until then get "
                   "a required node anti-affinity to it (runPolicy.avoidNodesFor: "
                   f"{policy.avoid_nodes_for})", warning=True)


def expire_avoidance(decision: ReconcilePass) -> None:
    """Drop the avoided nodes whose time is up."""
    live, expired = avoidance.expire(decision.status.avoided_nodes, decision.now)
    decision.status.avoided_nodes = live
    for entry in expired:
        decision.event("NodeAvoidanceExpired",
                       f"node {entry.node} is no longer avoided (avoided since "
                       f"{avoidance.stamp(entry.time)} for {entry.reason}): new worker pods "
                       "may run there again")


def count_node_failures(decision: ReconcilePass, failed: list[WorkerPod],
                        kinds: dict[str, str]) -> None:
    """Avoid a node on its second Unknown, CollectiveTimeout or GPUError within an hour."""
    records, repeated = avoidance.count_failures(
        decision.status.node_failures,
        [avoidance.Failure(pod.name, pod.node, kinds[pod.name]) for pod in failed],
        decision.now)
    decision.status.node_failures = records
    for first, second in repeated:
        avoid_node(decision, second.node, "RepeatedFailures",
                   f"{first.pod} failed there ({first.class_}) at "
                   f"{avoidance.stamp(first.time)}, and {second.pod} "
                   f"({second.failure_class}) at {avoidance.stamp(decision.now)}")


def keep_schedulable(decision: ReconcilePass) -> None:
    """Pods that avoidance leaves unschedulable: wait while the job runs elastic on
    minReplicas, or stop avoiding the oldest avoided node (see kubetrain.operator.avoidance).
    Pods not scheduled yet that avoid a node no longer avoided are recreated."""
    live = [entry.node for entry in decision.status.avoided_nodes]
    pods = [pod for pod in decision.live_pods() if pod.index < decision.replicas]
    for pod in pods:
        if avoidance.outdated(pod, live):
            decision.delete(pod, "AvoidanceChanged")
    pods = [pod for pod in pods if pod.name not in decision.deleted]
    grace = avoidance.scheduling_grace(decision.job.spec.run_policy.pending_deadline_seconds)
    held = avoidance.held_back(pods, decision.now, grace)
    if not held:
        return
    decision.too_few_nodes = True
    names = ", ".join(pod.name for pod in held)
    scheduler = held[0].unschedulable_message or "no node fits"
    what = (f"{names} cannot be scheduled while the job avoids "
            f"{avoidance.describe(decision.status.avoided_nodes)} (the scheduler: {scheduler})")
    running = [pod for pod in pods if pod.phase == "Running"]
    if (any(pod.index == 0 for pod in running)
            and len(running) >= decision.job.spec.workers.min_workers):
        _run_without(decision, held, len(running), what)
    else:
        _avoid_less(decision, held, len(running), what)


def _run_without(decision: ReconcilePass, held: list[WorkerPod], running: int, what: str) -> None:
    """The job runs elastic on its running workers; the held-back pods wait."""
    needed = decision.job.spec.workers.min_workers
    previous = decision.condition_of("NodesAvoided")
    decision.held_back = {pod.name for pod in held}
    message = (f"{what}: the job runs elastic on its {running} running workers "
               f"(spec.workers.minReplicas: {needed}); the others join once the "
               "nodes' avoidance expires (runPolicy.avoidNodesFor)")
    if previous is None or previous.reason != "TooFewNodes":
        decision.event("TooFewNodes", message, warning=True)
    decision.condition("NodesAvoided", True, "TooFewNodes", message)


def _avoid_less(decision: ReconcilePass, held: list[WorkerPod], running: int, what: str) -> None:
    """Too few workers run: stop avoiding the node avoided longest and recreate the
    held-back pods (one node per grace period, until they schedule)."""
    # A held-back pod avoids only live entries (one avoiding any other is outdated).
    given_up = avoidance.oldest(decision.status.avoided_nodes)
    assert given_up is not None
    decision.status.avoided_nodes.remove(given_up)
    message = (f"{what}, and only {running} of the {decision.job.spec.workers.min_workers} "
               "workers spec.workers.minReplicas needs run: the job stops avoiding node "
               f"{given_up.node} ({given_up.reason}) early, the node avoided longest, "
               "and recreates them")
    decision.event("TooFewNodes", message, warning=True)
    decision.condition("NodesAvoided", True, "TooFewNodes", message)
    for pod in held:
        decision.delete(pod, "TooFewNodes")


def report_avoidance(decision: ReconcilePass) -> None:
    """The NodesAvoided condition: which nodes the job avoids, unless too few are left."""
    reported = decision.condition_of("NodesAvoided")
    too_few = (reported is not None and reported.status == "True"
               and reported.reason == "TooFewNodes")
    waiting = [pod for pod in decision.live_pods() if pod.avoiding and pod.phase == "Pending"]
    if decision.too_few_nodes or (too_few and waiting):
        return  # until the pods it was about run (or are recreated and scheduled)
    avoided = decision.status.avoided_nodes
    if avoided:
        decision.condition("NodesAvoided", True, "Avoiding", "worker pods of this job keep "
                           f"off {avoidance.describe(avoided)} (status.avoidedNodes)")
    else:
        decision.condition("NodesAvoided", False, "NoneAvoided", "no node is avoided")


MEMORY_COPIES = "MemoryCopiesShareNode"


def report_memory_copies(decision: ReconcilePass) -> None:
    """spec.checkpoint.memory: say when partner copies cannot all be on another node.

    The trainer places each rank's partner copy on another node wherever it can
    (memory_checkpoint.partners); it cannot where every worker pod runs on one node, nor
    for some ranks of a node that holds more than half the pods. Those copies survive a
    trainer or pod restart but not the loss of that node. Judged once every desired pod
    runs on a known node; the MemoryCopiesShareNode condition holds while it lasts, with
    a Warning event when it begins.
    """
    memory = decision.job.spec.checkpoint.memory
    desired = decision.status.workers.desired or 0
    if memory is None or memory.replicas < 1 or decision.status.phase != "Running":
        return
    placed = [pod for pod in decision.live_pods() if pod.phase == "Running" and pod.node]
    ranks = desired * decision.job.spec.workers.procs_per_worker
    if len(placed) != desired or ranks < 2:
        return
    by_node = collections.Counter(pod.node for pod in placed)
    node, crowd = by_node.most_common(1)[0]
    if crowd * 2 <= desired and len(by_node) > 1:
        decision.condition(MEMORY_COPIES, False, "OtherNodes", "every rank's in-memory "
                           "checkpoint has its partner copy on another node")
        return
    if len(by_node) == 1:
        reason = "OneNode"
        what = (f"all {desired} worker pods run on node {node}: the in-memory checkpoints' "
                "partner copies are kept on that node too")
    else:
        reason = "CrowdedNode"
        what = (f"{crowd} of {desired} worker pods run on node {node}, more than half: some "
                "of their ranks' in-memory partner copies stay on that node")
    message = (f"{what}, so they survive a trainer or pod restart but not the loss of node "
               f"{node}; such a loss resumes from S3 (checkpoint.uri)")
    reported = decision.condition_of(MEMORY_COPIES)
    if reported is None or reported.status != "True" or reported.message != message:
        decision.event(MEMORY_COPIES, message, warning=True)
    decision.condition(MEMORY_COPIES, True, reason, message)
