"""Node avoidance (kubetrain.operator.avoidance) as tables, then as reconcile applies it:
status.avoidedNodes, the NodeAvoided event, the anti-affinity on new pods, the straggler's
Replace, a failed preflight, repeated failures on one node and too few nodes left."""

from __future__ import annotations

import sys
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kubetrain.api.trainingjob import AvoidedNode, NodeFailure, TrainingJob, TrainingJobStatus
from kubetrain.operator import avoidance
from kubetrain.operator.actions import CreateObject, RecordEvent
from kubetrain.operator.children import (
    AVOIDED_NODES_ANNOTATION,
    HOSTNAME_LABEL,
    avoiding_affinity,
)
from kubetrain.operator.children import worker_pod as render_pod
from kubetrain.operator.facts import metrics_sample, worker_pod
from kubetrain.operator.metrics import OperatorMetrics
from kubetrain.operator.reconcile_pass import HUNG_GROUP_GRACE_SECONDS
from kubetrain.protocol import trainer_failure

sys.path.insert(0, str(Path(__file__).parent))
from test_reconcile import NOW, Outcome, _failed_pod, make_job, pod, run, running_status
from test_stragglers import exposition

HOUR = timedelta(hours=1)


def wire_time(moment: datetime) -> str:
    return moment.isoformat().replace("+00:00", "Z")


def entry(node: str, reason: str = "Straggler", since: timedelta = timedelta(minutes=10),
          left: timedelta = timedelta(minutes=50)) -> dict[str, Any]:
    """A status.avoidedNodes entry begun `since` ago with `left` to go."""
    return {"node": node, "reason": reason, "message": "seen", "time": wire_time(NOW - since),
            "expires": wire_time(NOW + left)}


def running(**extra: Any) -> dict[str, Any]:
    """A running job's status whose step advanced just now (no hang to detect)."""
    return running_status(progress={"step": 0, "updatedAt": wire_time(NOW)}, **extra)


def avoided(out: Outcome) -> list[tuple[str, str]]:
    assert out.status is not None
    return [(e["node"], e["reason"]) for e in out.status.get("avoidedNodes", [])]


def messages(out: Outcome, reason: str) -> list[str]:
    return [a.message for a in out.actions if isinstance(a, RecordEvent) and a.reason == reason]


def created_pods(out: Outcome) -> dict[str, dict[str, Any]]:
    return {a.manifest["metadata"]["name"]: a.manifest for a in out.actions
            if isinstance(a, CreateObject) and a.manifest["kind"] == "Pod"}


def kept_off(manifest: dict[str, Any]) -> list[list[str]]:
    """Per nodeSelectorTerm, the hostnames the pod's required node affinity excludes."""
    required = (((manifest["spec"].get("affinity") or {}).get("nodeAffinity") or {})
                .get("requiredDuringSchedulingIgnoredDuringExecution") or {})
    return [[value for expression in term.get("matchExpressions", [])
             if expression["key"] == HOSTNAME_LABEL and expression["operator"] == "NotIn"
             for value in expression["values"]]
            for term in required.get("nodeSelectorTerms", [])]


# --- the rules as tables -------------------------------------------------------------------


def _avoided_node(node: str, expires: datetime) -> AvoidedNode:
    return AvoidedNode(node=node, reason="Straggler", time=NOW - HOUR, expires=expires)


@pytest.mark.parametrize(("expires", "live"), [
    (NOW + timedelta(seconds=1), True),
    (NOW, False),  # expiry is the first moment the node may be used again
    (NOW - timedelta(seconds=1), False),
])
def test_an_entry_expires_at_its_expiry(expires: datetime, live: bool) -> None:
    kept, expired = avoidance.expire([_avoided_node("node-a", expires)], NOW)
    assert (len(kept), len(expired)) == ((1, 0) if live else (0, 1))


@pytest.mark.parametrize(("case", "node", "seconds", "already", "added"), [
    ("a new node is avoided for avoidNodesFor", "node-a", 3600, [], True),
    ("avoidNodesFor 0s avoids nothing", "node-a", 0, [], False),
    ("a node already avoided keeps its entry", "node-a", 3600, ["node-a"], False),
    ("another node is avoided beside it", "node-b", 60, ["node-a"], True),
    ("an unknown node cannot be avoided", "", 3600, [], False),
])
def test_avoid(case: str, node: str, seconds: int, already: list[str], added: bool) -> None:
    existing = [_avoided_node(name, NOW + HOUR) for name in already]
    new = avoidance.avoid(existing, node, "Straggler", "slow", NOW, seconds)
    assert (new is not None) == added, case
    if new is not None:
        assert (new.node, new.time, new.expires) == (node, NOW, NOW + timedelta(seconds=seconds))


def test_an_avoided_nodes_message_is_cut_to_the_limit() -> None:
    said = "rank 1 failed its preflight: " + "x" * (2 * avoidance.MESSAGE_LIMIT)
    new = avoidance.avoid([], "node-a", "PreflightFailed", said, NOW, 60)
    assert new is not None
    assert new.message == said[:avoidance.MESSAGE_LIMIT] and len(new.message) < len(said)


def _record(node: str, failure_class: str = "Unknown",
            ago: timedelta = timedelta(0)) -> NodeFailure:
    return NodeFailure(node=node, class_=failure_class, pod="demo-worker-1", time=NOW - ago)


def _failure(node: str | None, failure_class: str, pod_name: str = "demo-worker-1"
             ) -> avoidance.Failure:
    return avoidance.Failure(pod_name, node, failure_class)


@pytest.mark.parametrize(("case", "before", "failures", "repeated", "kept"), [
    ("a first failure is remembered", [], [_failure("node-a", "Unknown")], [], ["node-a"]),
    ("a second one within the hour avoids the node",
     [_record("node-a", ago=timedelta(minutes=59))], [_failure("node-a", "CollectiveTimeout")],
     ["node-a"], []),
    ("exactly an hour apart still counts", [_record("node-a", ago=HOUR)],
     [_failure("node-a", "GPUError")], ["node-a"], []),
    ("after the hour the first is forgotten and the second is a first",
     [_record("node-a", ago=timedelta(minutes=61))], [_failure("node-a", "Unknown")], [],
     ["node-a"]),
    ("different nodes do not combine", [_record("node-a")], [_failure("node-b", "Unknown")],
     [], ["node-a", "node-b"]),
    ("two pods of one pass on one node are one incident", [],
     [_failure("node-a", "Unknown", "demo-worker-1"),
      _failure("node-a", "Unknown", "demo-worker-2")], [], ["node-a"]),
    ("beside a GPUError its peers' broken collectives do not count", [_record("node-b")],
     [_failure("node-a", "GPUError"), _failure("node-b", "CollectiveTimeout")], [],
     ["node-b", "node-a"]),
    ("a pod never scheduled has no node to blame", [], [_failure(None, "Unknown")], [], []),
    *[(f"{cls} does not count", [_record("node-a")], [_failure("node-a", cls)], [], ["node-a"])
      for cls in ("OOMKilled", "CUDAOutOfMemory", "Evicted", "Preempted", "NodeLost",
                  "UserError", "PreflightFailed")],
])
def test_repeated_failures_on_one_node_within_an_hour(
        case: str, before: list[NodeFailure], failures: list[avoidance.Failure],
        repeated: list[str], kept: list[str]) -> None:
    records, again = avoidance.count_failures(before, failures, NOW)
    assert [second.node for _, second in again] == repeated, case
    assert [record.node for record in records] == kept, case


def test_the_record_of_failures_is_bounded() -> None:
    failures = [_failure(f"node-{n}", "Unknown") for n in range(avoidance.NODE_FAILURES_LIMIT + 5)]
    records, _ = avoidance.count_failures([], failures, NOW)
    assert len(records) == avoidance.NODE_FAILURES_LIMIT
    assert records[-1].node == failures[-1].node, "the newest are kept"


@pytest.mark.parametrize(("deadline", "grace"), [
    (None, avoidance.SCHEDULING_GRACE_SECONDS),
    (10 * avoidance.SCHEDULING_GRACE_SECONDS, avoidance.SCHEDULING_GRACE_SECONDS),
    (avoidance.SCHEDULING_GRACE_SECONDS, avoidance.SCHEDULING_GRACE_SECONDS / 2),
])
def test_the_scheduling_grace_comes_before_the_pending_deadline(deadline: int | None,
                                                               grace: float) -> None:
    assert avoidance.scheduling_grace(deadline) == timedelta(seconds=grace)


GRACE = timedelta(seconds=avoidance.SCHEDULING_GRACE_SECONDS)


@pytest.mark.parametrize(("case", "facts", "held", "outdated"), [
    ("unschedulable for the grace while avoiding a live node",
     {"avoiding": ("node-a",), "unschedulable_since": NOW - GRACE}, True, False),
    ("not yet for the grace", {"avoiding": ("node-a",), "unschedulable_since": NOW - GRACE / 2},
     False, False),
    ("avoiding nothing: not avoidance's doing", {"unschedulable_since": NOW - GRACE}, False,
     False),
    ("pending but not found unschedulable (pulling, gated)", {"avoiding": ("node-a",)}, False,
     False),
    ("avoiding a node no longer avoided", {"avoiding": ("node-a", "node-gone"),
                                           "unschedulable_since": NOW}, False, True),
])
def test_which_pending_pods_avoidance_holds_back(case: str, facts: dict[str, Any], held: bool,
                                                 outdated: bool) -> None:
    waiting = pod(1, "Pending", **facts)
    assert (avoidance.held_back([waiting], NOW, GRACE) == [waiting]) == held, case
    assert avoidance.outdated(waiting, ["node-a"]) == outdated, case
    bound = pod(1, "Running", node="node-b", **facts)
    assert avoidance.held_back([bound], NOW, GRACE) == [] and not avoidance.outdated(
        bound, ["node-a"]), "a scheduled pod is never held back nor recreated"


# --- the anti-affinity ---------------------------------------------------------------------

EXCLUDE = {"key": HOSTNAME_LABEL, "operator": "NotIn", "values": ["node-a", "node-b"]}
ZONE = {"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["z1"]}
BY_NAME = {"key": "metadata.name", "operator": "In", "values": ["gpu-1"]}
PREFERRED = [{"weight": 1, "preference": {"matchExpressions": [ZONE]}}]
POD_ANTI = {"requiredDuringSchedulingIgnoredDuringExecution": [
    {"labelSelector": {"matchLabels": {"app": "db"}}, "topologyKey": HOSTNAME_LABEL}]}


def _required(*terms: dict[str, Any], **rest: Any) -> dict[str, Any]:
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": list(terms)}, **rest}}


@pytest.mark.parametrize(("case", "users", "expected"), [
    ("no affinity of the user's: the exclusion is the only term", None,
     _required({"matchExpressions": [EXCLUDE]})),
    ("ANDed into each of the user's terms, which are ORed",
     _required({"matchExpressions": [ZONE]}, {"matchFields": [BY_NAME]}),
     _required({"matchExpressions": [ZONE, EXCLUDE]},
               {"matchFields": [BY_NAME], "matchExpressions": [EXCLUDE]})),
    ("the user's preferences and pod anti-affinity are kept",
     {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": PREFERRED},
      "podAntiAffinity": POD_ANTI},
     {**_required({"matchExpressions": [EXCLUDE]},
                  preferredDuringSchedulingIgnoredDuringExecution=PREFERRED),
      "podAntiAffinity": POD_ANTI}),
])
def test_the_exclusion_is_merged_with_the_users_affinity(case: str, users: dict | None,
                                                         expected: dict) -> None:
    before = repr(users)
    assert avoiding_affinity(users, ["node-a", "node-b"]) == expected, case
    assert repr(users) == before, "the spec's affinity is not changed"


def test_no_avoided_node_leaves_the_users_affinity_as_it_is() -> None:
    users = _required({"matchExpressions": [ZONE]})
    assert avoiding_affinity(users, []) is users
    assert avoiding_affinity(None, []) is None


def _job_avoiding(minimal_manifest: dict, nodes: list[str], affinity: dict | None) -> TrainingJob:
    job = make_job(minimal_manifest, status=running_status(
        avoidedNodes=[entry(node) for node in nodes]))
    job.spec.workers.template.affinity = affinity
    return job


def test_a_pod_avoiding_nodes_is_valid_for_kubernetes_and_says_what_it_avoids(
        minimal_manifest: dict) -> None:
    users = _required({"matchExpressions": [ZONE]}, {"matchFields": [BY_NAME]},
                      preferredDuringSchedulingIgnoredDuringExecution=PREFERRED)
    manifest = render_pod(_job_avoiding(minimal_manifest, ["node-a", "node-b"], users), 1, 0)
    kubernetes_validate.validate(manifest, "1.30", strict=True)
    assert kept_off(manifest) == [["node-a", "node-b"], ["node-a", "node-b"]]
    assert manifest["metadata"]["annotations"][AVOIDED_NODES_ANNOTATION] == "node-a,node-b"
    assert worker_pod(manifest).avoiding == ("node-a", "node-b")
    plain = render_pod(_job_avoiding(minimal_manifest, [], users), 1, 0)
    assert plain["spec"]["affinity"] == users
    assert AVOIDED_NODES_ANNOTATION not in plain["metadata"].get("annotations", {})


def test_an_unschedulable_pod_is_seen_with_the_schedulers_words(minimal_manifest: dict) -> None:
    manifest = render_pod(_job_avoiding(minimal_manifest, ["node-a"], None), 1, 0)
    since = NOW - timedelta(minutes=2)
    manifest["status"] = {"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
         "lastTransitionTime": wire_time(since),
         "message": "0/2 nodes are available: 1 node(s) didn't match Pod's node affinity"}]}
    seen = worker_pod(manifest)
    assert seen.unschedulable_since == since
    assert seen.unschedulable_message is not None and "node affinity" in seen.unschedulable_message
    manifest["status"]["conditions"][0].update(status="True", reason=None)
    assert worker_pod(manifest).unschedulable_since is None


# --- Replace: the straggler's pod recreated off its node --------------------------------


def scrape(minimal_manifest: dict, status: dict, step: int, computes: tuple[float, ...],
           *pods_: Any, action: str = "Replace", **run_policy: Any) -> Outcome:
    job = make_job(minimal_manifest, replicas=len(computes), status=status,
                   stragglers={"window": 2, "action": action}, **run_policy)
    pods_ = pods_ or tuple(pod(index, node=f"node-{index}") for index in range(len(computes)))
    return run(job, *pods_, metrics=metrics_sample(exposition(step, *computes)), now=NOW)


SLOW_2 = (0.1, 0.1, 0.25)  # rank 2 (demo-worker-2 on node-2) computes 2.5x the median


def become_straggler(minimal_manifest: dict, computes: tuple[float, ...] = SLOW_2,
                     **run_policy: Any) -> Outcome:
    first = scrape(minimal_manifest, running_status(), 10, computes, **run_policy)
    assert first.status is not None and first.deleted == []
    return scrape(minimal_manifest, first.status, 20, computes, **run_policy)


def test_replace_avoids_the_stragglers_node_and_deletes_only_its_pod_with_the_normal_grace(
        minimal_manifest: dict) -> None:
    out = become_straggler(minimal_manifest)
    assert [(d.name, d.grace_period_seconds) for d in out.deleted] == [("demo-worker-2", None)]
    assert avoided(out) == [("node-2", "Straggler")]
    assert out.status is not None
    seconds = make_job(minimal_manifest).spec.run_policy.avoid_nodes_seconds
    assert out.status["avoidedNodes"][0]["expires"] == wire_time(NOW + timedelta(seconds=seconds))
    assert [r.reason for r in out.restarts] == ["StragglerReplaced"]
    assert out.status["restarts"] == 0, "a replacement is not a failure restart"
    assert out.status["stragglerReplacements"] == 1
    assert out.events == [("Warning", "Straggler"), ("Warning", "NodeAvoided"),
                          ("Warning", "StragglerReplaced")]
    assert "node-2" in messages(out, "NodeAvoided")[0]
    assert [r["slowIntervals"] for r in out.status["ranks"]["ranks"]] == [0, 0, 0]
    assert out.condition("NodesAvoided")["reason"] == "Avoiding"

    # The same interval scraped again, the pod still terminating: no second replacement.
    again = scrape(minimal_manifest, out.status, 20, SLOW_2, pod(0, node="node-0"),
                   pod(1, node="node-1"), pod(2, node="node-2", deleting=True))
    assert again.deleted == [] and again.restarts == []
    assert ("Warning", "StragglerReplaced") not in again.events

    # Once it is gone: recreated at once (no backoff) with the anti-affinity to node-2.
    gone = scrape(minimal_manifest, out.status, 20, SLOW_2, pod(0, node="node-0"),
                  pod(1, node="node-1"))
    recreated = created_pods(gone)
    assert list(recreated) == ["demo-worker-2"]
    assert kept_off(recreated["demo-worker-2"]) == [["node-2"]]
    kubernetes_validate.validate(recreated["demo-worker-2"], "1.30", strict=True)


def test_an_operator_stopped_mid_replace_still_moves_the_straggler_off_its_node(
        minimal_manifest: dict) -> None:
    # The Replace was recorded (status first: the restart, the avoided node), then the
    # operator stopped before deleting the pod. The next operator sees the straggler's pod
    # still running, of the older attempt, on the node the restart avoids; its ranks status
    # no longer says "newly" a straggler, so only the restart in progress can move it.
    out = become_straggler(minimal_manifest)
    assert out.status is not None and out.status["restart"]["reason"] == "StragglerReplaced"
    restarted = scrape(minimal_manifest, out.status, 21, (0.1, 0.1, 0.1),
                       pod(0, node="node-0"), pod(1, node="node-1"), pod(2, node="node-2"))
    assert [(d.name, d.grace_period_seconds) for d in restarted.deleted] == [
        ("demo-worker-2", None)], "its replacement would be lost"
    assert restarted.restarts == [], "the same restart, not a new one"
    # Once it is gone, the replacement is created off node-2, as without the stop.
    gone = scrape(minimal_manifest, out.status, 21, (0.1, 0.1, 0.1), pod(0, node="node-0"),
                  pod(1, node="node-1"))
    assert kept_off(created_pods(gone)["demo-worker-2"]) == [["node-2"]]
    # The other pods of the older attempt, on nodes not avoided, stay where they are.
    assert {d.name for d in gone.deleted} == set()


def test_replacing_worker_0_recreates_the_whole_group(minimal_manifest: dict) -> None:
    out = become_straggler(minimal_manifest, (0.25, 0.1, 0.1))
    assert out.deleted_names == ["demo-worker-0", "demo-worker-1", "demo-worker-2"]
    assert {d.grace_period_seconds for d in out.deleted} == {None}, "all checkpoint together"
    assert avoided(out) == [("node-0", "Straggler")]
    assert "the whole group" in out.condition("Restarting")["message"]


def test_replacements_stop_at_their_limit_and_the_straggler_is_only_reported(
        minimal_manifest: dict) -> None:
    limit = make_job(minimal_manifest).spec.run_policy.max_restarts
    first = scrape(minimal_manifest, running_status(stragglerReplacements=limit), 10, SLOW_2)
    assert first.status is not None
    out = scrape(minimal_manifest, first.status, 20, SLOW_2)
    assert out.deleted == [] and avoided(out) == []
    assert ("Warning", "Straggler") in out.events
    assert f"runPolicy.maxRestarts ({limit})" in messages(out, "StragglerKept")[0]


def test_report_neither_avoids_nor_replaces(minimal_manifest: dict) -> None:
    out = become_straggler(minimal_manifest, action="Report")
    assert ("Warning", "Straggler") in out.events
    assert out.deleted == [] and avoided(out) == []


def test_replace_with_avoid_nodes_for_0s_recreates_the_pod_without_avoiding(
        minimal_manifest: dict) -> None:
    out = become_straggler(minimal_manifest, avoidNodesFor="0s")
    assert out.deleted_names == ["demo-worker-2"]
    assert avoided(out) == [] and messages(out, "NodeAvoided") == []


# --- PreflightFailed: the nodes it names -----------------------------------------------

PREFLIGHT = ('kubetrain_worker_failure_info{class="PreflightFailed",message="rank 2: '
             'all-reduce at 0.2 of the median bandwidth",micro_batch_size="8",'
             'nodes="node-a, node-b"} 1.0\n')


def test_the_trainer_names_the_nodes_that_failed_its_preflight() -> None:
    said = trainer_failure(PREFLIGHT)
    assert said is not None and said.failure_class == "PreflightFailed"
    assert said.nodes == ("node-a", "node-b")
    other = trainer_failure(PREFLIGHT.replace("PreflightFailed", "GPUError").replace(
        ',nodes="node-a, node-b"', ""))
    assert other is not None and other.nodes == ()


def test_a_failed_preflight_avoids_the_named_nodes_and_restarts_the_group(
        minimal_manifest: dict) -> None:
    failed = worker_pod(_failed_pod({"exitCode": 1, "reason": "Error", "message": PREFLIGHT},
                                    node="node-a"), nodes={"node-a"})
    job = make_job(minimal_manifest, status=running())
    out = run(job, pod(0, node="node-c"), failed)
    assert sorted(avoided(out)) == [("node-a", "PreflightFailed"), ("node-b", "PreflightFailed")]
    assert out.deleted_names == ["demo-worker-0", "demo-worker-1"]
    # Nothing trained since the checkpoint: no long grace to save one (a stalled rank
    # would hold its name for all of it).
    assert {d.grace_period_seconds for d in out.deleted} == {HUNG_GROUP_GRACE_SECONDS}
    assert out.status is not None and out.status["restarts"] == 1
    assert out.status["lastFailure"]["class"] == "PreflightFailed"
    assert out.condition("Restarting")["reason"] == "PreflightFailed"
    assert len(messages(out, "NodeAvoided")) == 2

    later = make_job(minimal_manifest, status=out.status)
    backoff = timedelta(seconds=later.spec.run_policy.backoff_seconds)
    recreated = created_pods(run(later, now=NOW + backoff))
    assert sorted(recreated) == ["demo-worker-0", "demo-worker-1"]
    assert all(kept_off(p) == [["node-a", "node-b"]] for p in recreated.values())


def test_a_rank_that_never_reported_is_placed_by_elimination_from_the_nodes_that_did(
        minimal_manifest: dict) -> None:
    # Worker 1's rank was stopped before it ran its check: rank 0 cannot say where it runs,
    # only that the ranks on node-a reported. The group's other node is the failing one.
    unknown = PREFLIGHT.replace('nodes="node-a, node-b"', 'reported_nodes="node-a"')
    said = trainer_failure(unknown)
    assert said is not None and said.nodes == () and said.reported_nodes == ("node-a",)
    failed = worker_pod(_failed_pod({"exitCode": 1, "reason": "Error", "message": unknown},
                                    node="node-a"), nodes={"node-a"})
    out = run(make_job(minimal_manifest, status=running()), failed, pod(1, node="node-b"))
    assert avoided(out) == [("node-b", "PreflightFailed")]
    # Both pods on the node that reported: nothing to eliminate, no node avoided.
    out = run(make_job(minimal_manifest, status=running()), failed, pod(1, node="node-a"))
    assert avoided(out) == []
    assert out.condition("Restarting")["reason"] == "PreflightFailed"


# --- repeated failures on one node -----------------------------------------------------


def _unknown_failure(node: str, attempt: int) -> Any:
    return pod(1, "Failed", attempt=attempt, exit_code=1, reason="Error", node=node)


@pytest.mark.parametrize(("apart", "avoids"), [
    (timedelta(minutes=30), True),
    (timedelta(minutes=61), False),
])
def test_a_second_failure_on_a_node_within_the_hour_avoids_it(
        minimal_manifest: dict, apart: timedelta, avoids: bool) -> None:
    first = run(make_job(minimal_manifest, status=running()), pod(0, node="node-x"),
                _unknown_failure("node-y", 0))
    assert first.status is not None and avoided(first) == []
    assert [f["node"] for f in first.status["nodeFailures"]] == ["node-y"]

    status = {**first.status, "phase": "Running"}
    second = run(make_job(minimal_manifest, status=status), pod(0, node="node-x"),
                 _unknown_failure("node-y", 1), now=NOW + apart)
    assert avoided(second) == ([("node-y", "RepeatedFailures")] if avoids else [])
    assert second.deleted_names == ["demo-worker-1"], "the failed pod is replaced as before"
    assert second.status is not None
    assert [f["node"] for f in second.status.get("nodeFailures", [])] == (
        [] if avoids else ["node-y"])


# --- expiry and too few nodes ----------------------------------------------------------


def test_an_expired_entry_is_dropped_and_new_pods_may_use_the_node(
        minimal_manifest: dict) -> None:
    status = running(phase="Pending", avoidedNodes=[
        entry("node-a", left=timedelta(0)), entry("node-b")])
    out = run(make_job(minimal_manifest, status=status), pod(0, node="node-c"))
    assert avoided(out) == [("node-b", "Straggler")]
    assert "node-a" in messages(out, "NodeAvoidanceExpired")[0]
    assert kept_off(created_pods(out)["demo-worker-1"]) == [["node-b"]]


def test_a_pod_waiting_to_avoid_a_node_no_longer_avoided_is_recreated(
        minimal_manifest: dict) -> None:
    status = running(avoidedNodes=[entry("node-a", left=-timedelta(seconds=1))])
    waiting = pod(1, "Pending", avoiding=("node-a",), unschedulable_since=NOW - timedelta(
        seconds=5))
    out = run(make_job(minimal_manifest, status=status), pod(0, node="node-c"), waiting)
    assert [(d.name, d.reason) for d in out.deleted] == [("demo-worker-1", "AvoidanceChanged")]
    after = run(make_job(minimal_manifest, status=out.status), pod(0, node="node-c"))
    assert kept_off(created_pods(after)["demo-worker-1"]) == []


def _held(since: timedelta, avoiding: tuple[str, ...] = ("node-b",)) -> Any:
    return pod(1, "Pending", avoiding=avoiding, unschedulable_since=NOW - since,
               unschedulable_message="0/2 nodes are available: 1 node(s) didn't match Pod's "
               "node affinity/selector, 1 Insufficient cpu", created_at=NOW - 20 * since)


def test_with_min_replicas_running_the_job_runs_elastic_while_a_pod_waits_for_a_node(
        minimal_manifest: dict) -> None:
    grace = avoidance.scheduling_grace(600)
    job = make_job(minimal_manifest, status=running(avoidedNodes=[entry("node-b")]),
                   pendingDeadlineSeconds=600)
    early = run(job, pod(0, node="node-a"), _held(grace / 2))
    assert early.status is not None and early.condition("NodesAvoided")["reason"] == "Avoiding"
    assert messages(early, "TooFewNodes") == []

    out = run(job, pod(0, node="node-a"), _held(grace))  # and created past the pending deadline
    assert out.deleted == [] and out.restarts == [], "no PendingTimeout restart"
    assert out.condition("NodesAvoided")["reason"] == "TooFewNodes"
    assert "runs elastic" in messages(out, "TooFewNodes")[0]
    assert out.status is not None and out.status["phase"] == "Running"
    again = run(make_job(minimal_manifest, status=out.status, pendingDeadlineSeconds=600),
                pod(0, node="node-a"), _held(2 * grace))
    assert messages(again, "TooFewNodes") == [], "said once"

    # The same pod with nothing avoided is an ordinary pending timeout: a counted restart.
    plain = run(make_job(minimal_manifest, status=running(), pendingDeadlineSeconds=600),
                pod(0, node="node-a"), _held(grace, avoiding=()))
    assert [r.reason for r in plain.restarts] == ["PendingTimeout"]


def test_below_min_replicas_the_job_stops_avoiding_its_oldest_node(
        minimal_manifest: dict) -> None:
    grace = avoidance.scheduling_grace(600)
    status = running(phase="Pending", avoidedNodes=[
        entry("node-b", since=timedelta(minutes=5)), entry("node-a", since=timedelta(minutes=30))])
    job = make_job(minimal_manifest, status=status, min_replicas=2, pendingDeadlineSeconds=600)
    out = run(job, pod(0, node="node-c"), _held(grace, avoiding=("node-b", "node-a")))
    assert avoided(out) == [("node-b", "Straggler")], "node-a was avoided longest"
    assert [(d.name, d.reason) for d in out.deleted] == [("demo-worker-1", "TooFewNodes")]
    assert out.restarts == []
    assert "stops avoiding node node-a" in messages(out, "TooFewNodes")[0]
    assert out.condition("NodesAvoided")["reason"] == "TooFewNodes"
    after = run(make_job(minimal_manifest, status=out.status, min_replicas=2),
                pod(0, node="node-c"))
    assert kept_off(created_pods(after)["demo-worker-1"]) == [["node-b"]]


def test_status_keeps_what_avoidance_needs_across_an_operator_restart(
        minimal_manifest: dict) -> None:
    first = run(make_job(minimal_manifest, status=running()), pod(0, node="node-x"),
                _unknown_failure("node-y", 0))
    assert first.status is not None
    # A new operator knows only the status it reads back.
    status = TrainingJobStatus.model_validate(first.status)
    assert [(f.node, f.class_) for f in status.node_failures] == [("node-y", "Unknown")]


def test_the_avoided_nodes_gauge_follows_status_and_goes_when_the_job_finishes() -> None:
    metrics = OperatorMetrics()

    def gauge() -> dict[tuple[str, str], float]:
        text = generate_latest(metrics.registry).decode()
        return {(s.labels["namespace"], s.labels["job"]): s.value
                for family in text_string_to_metric_families(text)
                if family.name == "kubetrain_avoided_nodes" for s in family.samples}

    status = {"phase": "Running", "avoidedNodes": [entry("node-a"), entry("node-b")]}
    metrics.show_job_status("ml", "demo", status)
    assert gauge() == {("ml", "demo"): len(status["avoidedNodes"])}
    metrics.show_job_status("ml", "demo", {**status, "avoidedNodes": []})
    assert gauge() == {}
    metrics.show_job_status("ml", "demo", status)
    metrics.show_job_status("ml", "demo", {**status, "phase": "Failed"})
    assert gauge() == {}
