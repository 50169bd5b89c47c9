"""The operator's half of where in-memory checkpoint copies live (issue 34): worker pods of
a job with spec.checkpoint.memory that share one node (or crowd more than half onto one)
get the MemoryCopiesShareNode condition and one Warning event saying the partner copies do
not survive that node's loss; pods on separate nodes get neither."""

from __future__ import annotations

import copy
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from test_reconcile import NOW, Outcome, make_job, pod, run, running_status

from kubetrain.api.trainingjob import TrainingJob
from kubetrain.operator.actions import RecordEvent


def _job(minimal_manifest: dict[str, Any], replicas: int, status: dict[str, Any],
         memory: dict[str, Any] | None = None) -> TrainingJob:
    manifest = copy.deepcopy(minimal_manifest)
    if memory is not None:
        manifest["spec"]["checkpoint"]["memory"] = memory
    return make_job(manifest, replicas=replicas, min_replicas=replicas, status=status)


def _status(replicas: int, conditions: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    status = running_status(progress={"step": 0, "updatedAt": _wire(NOW)})
    status["workers"]["desired"] = status["workers"]["ready"] = replicas
    status["conditions"] += conditions or []
    return status


def _wire(moment: datetime) -> str:
    return moment.isoformat().replace("+00:00", "Z")


def _warnings(out: Outcome) -> list[str]:
    return [a.message for a in out.actions
            if isinstance(a, RecordEvent) and a.reason == "MemoryCopiesShareNode"]


def test_pods_on_one_node_say_once_that_the_copies_do_not_survive_its_loss(
    minimal_manifest: dict[str, Any],
) -> None:
    memory = {"everySteps": 2, "replicas": 1}
    out = run(_job(minimal_manifest, 2, _status(2), memory),
              pod(0, node="node-a"), pod(1, node="node-a"))
    (message,) = _warnings(out)
    assert message.startswith("all 2 worker pods run on node node-a")
    assert "not the loss of node node-a" in message
    assert out.status is not None
    held = out.condition("MemoryCopiesShareNode")
    assert (held["status"], held["reason"], held["message"]) == ("True", "OneNode", message)
    # The next pass, with the condition recorded, posts no second event.
    again = run(_job(minimal_manifest, 2, out.status, memory),
                pod(0, node="node-a"), pod(1, node="node-a"))
    assert again.actions == [], "nothing changed: no event, no status write"
    # Once the pods run on two nodes the condition turns False, and no event.
    apart = run(_job(minimal_manifest, 2, out.status, memory),
                pod(0, node="node-a"), pod(1, node="node-b"))
    assert _warnings(apart) == []
    assert (apart.condition("MemoryCopiesShareNode")["status"],
            apart.condition("MemoryCopiesShareNode")["reason"]) == ("False", "OtherNodes")


def test_more_than_half_the_pods_on_one_node_is_said_and_half_is_not(
    minimal_manifest: dict[str, Any],
) -> None:
    memory = {"everySteps": 2, "replicas": 1}
    crowded = run(_job(minimal_manifest, 3, _status(3), memory),
                  pod(0, node="node-a"), pod(1, node="node-a"), pod(2, node="node-b"))
    (message,) = _warnings(crowded)
    assert message.startswith("2 of 3 worker pods run on node node-a, more than half")
    assert crowded.condition("MemoryCopiesShareNode")["reason"] == "CrowdedNode"
    half = run(_job(minimal_manifest, 4, _status(4), memory),
               *(pod(i, node=node) for i, node in enumerate(["a", "a", "b", "c"])))
    assert _warnings(half) == []
    assert half.condition("MemoryCopiesShareNode") is None, "a condition never held is absent"


def test_nothing_is_said_without_the_tier_without_partners_or_before_every_pod_is_placed(
    minimal_manifest: dict[str, Any],
) -> None:
    one_node = (pod(0, node="node-a"), pod(1, node="node-a"))
    for memory in (None, {"everySteps": 2, "replicas": 0}):
        out = run(_job(minimal_manifest, 2, _status(2), memory), *one_node)
        assert _warnings(out) == [] and out.condition("MemoryCopiesShareNode") is None
    # One pod placed, the other still Pending: not judged yet.
    pending = run(_job(minimal_manifest, 2, _status(2), {"everySteps": 2, "replicas": 1}),
                  pod(0, node="node-a"), pod(1, phase="Pending"))
    assert _warnings(pending) == []
