"""The in-memory checkpoint tier against out-of-memory healing (issue 34 item 4): the tier's
tmpfs pages count against the worker container's memory cgroup, so the operator adds the
tier to the container's limit, and when a worker is still OOMKilled the failure and the
MicroBatchHalved event say how much of that limit is the tier's, since halving the
micro-batch shrinks only the trainer's own use. The healing itself is unchanged: half the
micro-batch, then OutOfMemory at the smallest."""

from __future__ import annotations

import copy
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from test_reconcile import (
    FAILURE_SHAPES,
    Outcome,
    _failed_pod,
    make_job,
    pod,
    run,
    running_status,
)

from kubetrain.api.trainingjob import TrainingJob, TrainingJobSpec
from kubetrain.memory_budget import out_of_memory_note, parse_quantity, tier_budget
from kubetrain.operator.actions import CreateObject, RecordEvent
from kubetrain.operator.facts import worker_pod

GIB = 2**30


def _job(minimal_manifest: dict[str, Any], limit: str, status: dict[str, Any] | None = None,
         micro: int = 8, **model: Any) -> TrainingJob:
    manifest = copy.deepcopy(minimal_manifest)
    spec = manifest["spec"]
    spec["model"] = model or {"preset": "llama-125m"}
    spec["checkpoint"]["memory"] = {"everySteps": 2}
    spec["optimization"] = {"microBatchSize": micro, "gradientAccumulationSteps": 2}
    job = make_job(manifest, status=status, min_replicas=2)
    wire = job.wire()
    wire["spec"]["workers"]["resources"] = {"requests": {"memory": limit},
                                            "limits": {"memory": limit}}
    return TrainingJob.model_validate(wire)


def _trainer(out: Outcome, index: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Worker `index`'s trainer container and its memory volume, as the operator built them."""
    manifest = next(action.manifest for action in out.actions
                    if isinstance(action, CreateObject)
                    and action.manifest["metadata"]["name"] == f"demo-worker-{index}")
    volume = next(v for v in manifest["spec"]["volumes"] if v["name"] == "memory-checkpoints")
    return manifest["spec"]["containers"][0], volume


def _oom(job: TrainingJob, shape: int = 0) -> Outcome:
    killed = replace(worker_pod(FAILURE_SHAPES[shape][1], nodes={"node-a"}), restart_attempt=1)
    return run(job, pod(0, attempt=1), killed)


def _event(out: Outcome, reason: str) -> str:
    return next(a.message for a in out.actions if isinstance(a, RecordEvent) and a.reason == reason)


def _gib(size: int) -> str:
    return f"{size / GIB:.2f} GiB"


def test_an_oom_kill_says_how_much_of_the_limit_is_the_memory_tier_and_still_halves(
        minimal_manifest: dict[str, Any]) -> None:
    # The pods as created: the tier's volume size is added to the container's 4Gi.
    created = run(_job(minimal_manifest, "4Gi"), service=False)
    container, volume = _trainer(created, 1)
    tier = parse_quantity(volume["emptyDir"]["sizeLimit"])
    limit = parse_quantity(container["resources"]["limits"]["memory"])
    assert volume["emptyDir"]["medium"] == "Memory" and limit == 4 * GIB + tier
    assert tier > GIB, "a 125M-parameter model's tier is a large part of 4Gi"

    status = running_status(restarts=1, restartAttempt=1)
    out = _oom(_job(minimal_manifest, "4Gi", status))
    assert out.status is not None
    # The healing the docs describe: the whole group again, at half the micro-batch.
    assert out.status["phase"] == "Restarting"
    assert out.status["effective"]["microBatchSize"] == 4
    assert out.deleted_names == ["demo-worker-0", "demo-worker-1"]
    # ... and both the event and the condition say what the halving cannot shrink.
    said = _event(out, "MicroBatchHalved")
    restarting = out.condition("Restarting")
    assert restarting is not None and restarting["reason"] == "OutOfMemory"
    for message in (said, restarting["message"]):
        assert "spec.checkpoint.memory" in message
        assert f"{_gib(tier)} of the container's {_gib(limit)} memory limit" in message
        assert f"({tier / limit:.0%})" in message
        assert "a smaller micro-batch shrinks only the trainer's own 4.00 GiB" in message
        assert "2 versions x 2 copies (1 + replicas)" in message

    # Where the tier is a small part of the limit, or the memory was the GPU's, the
    # failure is the trainer's own as before and says nothing of the tier.
    roomy = _oom(_job(minimal_manifest, "64Gi", status))
    assert "checkpoint" not in _event(roomy, "MicroBatchHalved")
    cuda = _oom(_job(minimal_manifest, "4Gi", status), shape=2)  # CUDAOutOfMemory
    assert "checkpoint" not in _event(cuda, "MicroBatchHalved")


def test_an_oom_kill_at_the_smallest_micro_batch_fails_naming_the_memory_tier(
        minimal_manifest: dict[str, Any]) -> None:
    effective = {"microBatchSize": 1, "gradientAccumulationSteps": 16, "outOfMemoryRestarts": 3}
    job = _job(minimal_manifest, "4Gi", running_status(effective=effective))
    failed = worker_pod(_failed_pod({"exitCode": 137, "reason": "OOMKilled"}), nodes={"node-a"})
    out = run(job, pod(0), failed)
    assert out.status is not None and out.status["phase"] == "Failed"
    failure = out.condition("Failed")
    assert failure is not None and failure["reason"] == "OutOfMemory"
    assert "in-memory checkpoint tier's (spec.checkpoint.memory" in failure["message"]
    assert "lower spec.checkpoint.memory.replicas" in failure["message"]


def test_a_tier_given_no_memory_of_its_own_is_named_with_the_limit_it_eats_into(
        minimal_manifest: dict[str, Any]) -> None:
    """A model sized by its config.json gets no memory added for the tier (children.py), so
    the tier's pages share the user's limit: the note says so, with that limit."""
    spec = _job(minimal_manifest, "6Gi", init="s3://models/mine").spec
    assert tier_budget(spec) is None
    note = out_of_memory_note(spec)
    assert "given no memory of their own" in note and "(6.00 GiB)" in note
    unlimited = TrainingJobSpec.model_validate(spec.wire() | {"workers": {"replicas": 2}})
    assert out_of_memory_note(unlimited) == "", "no limit: no cgroup kill to explain"
