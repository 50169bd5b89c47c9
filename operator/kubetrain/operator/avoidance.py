"""Which nodes a TrainingJob's pods keep off, and for how long (status.avoidedNodes).

A node is avoided, for runPolicy.avoidNodesFor, after:
- Straggler: a rank on it was a straggler and runPolicy.stragglers.action is Replace;
- PreflightFailed: the trainer's preflight check named it (its ranks failed the check);
- Unreachable: a trainer's lifeline on it went silent (`kubetrain.operator.lifeline_watch`):
  its pods are replaced at once, before the node is marked NotReady, and must not land
  there again;
- RepeatedFailures: two failures of class Unknown, CollectiveTimeout or GPUError on it
  within an hour. status.nodeFailures holds each node's first one, so the count survives
  an operator restart; the failures of one reconcile pass count once per node (pods of
  one incident), and when one of them is a GPUError the others are taken for its
  consequence (their collectives broke with it) and do not count.

Avoidance is per job: every pod created while an entry is live gets a required node
anti-affinity (`kubetrain.operator.children.avoiding_affinity`); the operator never
cordons or taints a node. An entry is dropped at its expiry.

Too few nodes: the operator does not see which nodes could take a pod (taints, free
resources), only the scheduler does, so it reads the scheduler's verdict instead: a pod
that avoids nodes and stays Unschedulable for `scheduling_grace` is held back by the
avoidance. If worker 0 and minReplicas workers still run, the job runs elastic on them
and the held-back pods wait, exempt from runPolicy.pendingDeadlineSeconds; otherwise
the job stops avoiding its oldest avoided node early and recreates the held-back pods,
one node per grace period until they schedule. Pods not yet scheduled that avoid a node
no longer avoided are recreated without it.

Pure: no Kubernetes, no clock; `kubetrain.operator.nodes` applies these rules in each
reconcile pass.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Literal

from kubetrain.api.trainingjob import AvoidedNode, NodeFailure
from kubetrain.operator.facts import WorkerPod

AvoidReason = Literal["Straggler", "PreflightFailed", "RepeatedFailures", "Unreachable"]
# Classes that may mean a bad node (as opposed to the job, the scheduler or memory).
REPEATED_FAILURE_CLASSES = frozenset({"Unknown", "CollectiveTimeout", "GPUError"})
REPEATED_FAILURE_WINDOW = timedelta(hours=1)
# status.nodeFailures holds one entry per node; a bound for clusters of thousands.
NODE_FAILURES_LIMIT = 64
# How long a pod that avoids nodes may stay Unschedulable before the job stops waiting.
SCHEDULING_GRACE_SECONDS = 60
# status.avoidedNodes[].message is cut here, as status.lastFailure.message is: it may
# quote a trainer's termination message (up to 4 KiB).
MESSAGE_LIMIT = 1024


@dataclass(frozen=True)
class Failure:
    """One failed pod of a reconcile pass, with its class and node."""

    pod: str
    node: str | None
    failure_class: str


def expire(avoided: Sequence[AvoidedNode],
           now: datetime) -> tuple[list[AvoidedNode], list[AvoidedNode]]:
    """The entries still live at `now`, and those that expired."""
    live = [entry for entry in avoided if now < entry.expires]
    return live, [entry for entry in avoided if now >= entry.expires]


def avoid(avoided: Sequence[AvoidedNode], node: str | None, reason: AvoidReason, message: str,
          now: datetime, seconds: int) -> AvoidedNode | None:
    """A new entry avoiding `node` for `seconds`, or None: no node, avoidNodesFor 0s, or
    the node already avoided (its entry keeps its reason and expiry)."""
    if not node or seconds <= 0 or any(entry.node == node for entry in avoided):
        return None
    return AvoidedNode(node=node, reason=reason, message=message[:MESSAGE_LIMIT], time=now,
                       expires=now + timedelta(seconds=seconds))


def count_failures(previous: Sequence[NodeFailure], failures: Iterable[Failure],
                   now: datetime) -> tuple[list[NodeFailure], list[tuple[NodeFailure, Failure]]]:
    """Record a pass's failures by node: the failures kept in status.nodeFailures, and for
    each node failing a second time within the hour its first failure and this one.

    A node that failed twice leaves the record (it is avoided now); records older than
    the window are dropped.
    """
    kept = [record for record in previous if now - record.time <= REPEATED_FAILURE_WINDOW]
    counting = [failure for failure in failures
                if failure.node and failure.failure_class in REPEATED_FAILURE_CLASSES]
    if any(failure.failure_class == "GPUError" for failure in counting):
        counting = [failure for failure in counting if failure.failure_class == "GPUError"]
    repeated: list[tuple[NodeFailure, Failure]] = []
    seen: set[str] = set()
    for failure in counting:
        assert failure.node is not None  # filtered above
        if failure.node in seen:
            continue
        seen.add(failure.node)
        first = next((record for record in kept if record.node == failure.node), None)
        if first is not None:
            kept.remove(first)
            repeated.append((first, failure))
        else:
            kept.append(NodeFailure(node=failure.node, class_=failure.failure_class,
                                    pod=failure.pod, time=now))
    return kept[-NODE_FAILURES_LIMIT:], repeated


def scheduling_grace(pending_deadline_seconds: int | None) -> timedelta:
    """How long a pod held back by avoidance waits before the job acts: under the pending
    deadline, so that the deadline (a counted restart) never comes first."""
    seconds = float(SCHEDULING_GRACE_SECONDS)
    if pending_deadline_seconds is not None:
        seconds = min(seconds, pending_deadline_seconds / 2)
    return timedelta(seconds=seconds)


def held_back(pods: Iterable[WorkerPod], now: datetime, grace: timedelta) -> list[WorkerPod]:
    """Pods that avoid nodes and that the scheduler could not place for `grace`."""
    return [pod for pod in pods
            if pod.phase == "Pending" and pod.node is None and pod.avoiding
            and pod.unschedulable_since is not None and now >= pod.unschedulable_since + grace]


def outdated(pod: WorkerPod, live: Collection[str]) -> bool:
    """An unschedulable pod that avoids a node no longer avoided: recreated without it."""
    return (pod.phase == "Pending" and pod.node is None and pod.unschedulable_since is not None
            and any(node not in live for node in pod.avoiding))


def oldest(avoided: Sequence[AvoidedNode]) -> AvoidedNode | None:
    """The entry to give up first when the job cannot run: the one avoided longest."""
    return min(avoided, key=lambda entry: entry.time, default=None)


def describe(avoided: Sequence[AvoidedNode]) -> str:
    """`node-a (Straggler, until 2025-01-01T13:00:00Z), ...`"""
    return ", ".join(f"{entry.node} ({entry.reason}, until {stamp(entry.expires)})"
                     for entry in avoided)


def stamp(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")
