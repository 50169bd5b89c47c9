"""The in-memory checkpoint tier in a worker pod: its memory volume, sized by the tier's
budget, and that size added to the pod's memory request and limit; a tier over
maxWorkerMemory refused with the numbers. The S3 tier's staging buffer (checkpoint.async)
added to the pod's memory the same way."""

from __future__ import annotations

import copy
from typing import Any

import kubernetes_validate
import pytest

from kubetrain.api import parse_job
from kubetrain.api.manifest import InvalidManifest
from kubetrain.memory_budget import (
    FOLDER_ENV,
    VERSIONS,
    parse_quantity,
    staging_budget,
    tier_budget,
)
from kubetrain.operator.children import MEMORY_CHECKPOINTS_DIR, MEMORY_VOLUME, worker_pod


def _job(minimal_manifest: dict[str, Any], memory: dict[str, Any] | None,
         **workers: Any) -> Any:
    document = copy.deepcopy(minimal_manifest)
    document["spec"]["model"] = {"preset": "llama-125m"}
    document["spec"]["workers"] = {"replicas": 2, **workers}
    if memory is not None:
        document["spec"]["checkpoint"]["memory"] = memory
    return parse_job(document)


def _container(pod: dict[str, Any]) -> dict[str, Any]:
    container: dict[str, Any] = pod["spec"]["containers"][0]
    return container


def test_the_tier_adds_its_size_to_the_pods_memory_request_and_limit(
    minimal_manifest: dict[str, Any],
) -> None:
    resources = {"requests": {"memory": "8Gi", "cpu": 4}, "limits": {"memory": "16Gi"}}
    plain = worker_pod(_job(minimal_manifest, None, resources=resources), 0, 0)
    job = _job(minimal_manifest, {"everySteps": 2, "replicas": 1}, resources=resources,
               procsPerWorker=2)
    pod = worker_pod(job, 1, 0)
    kubernetes_validate.validate(pod, kubernetes_validate.latest_version(), strict=True)

    budget = tier_budget(job.spec)
    assert budget is not None and budget.world_size == 4 and budget.copies == 2
    assert budget.per_worker == budget.shard_bytes * VERSIONS * 2 * 2
    got, before = _container(pod)["resources"], _container(plain)["resources"]
    for kind in ("requests", "limits"):
        added = parse_quantity(got[kind]["memory"]) - parse_quantity(before[kind]["memory"])
        assert 0 <= added - budget.per_worker < 2**20, kind  # rounded up to whole Mi
    assert got["requests"]["cpu"] == 4
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == MEMORY_VOLUME]
    assert volume["emptyDir"]["medium"] == "Memory"
    assert 0 <= parse_quantity(volume["emptyDir"]["sizeLimit"]) - budget.per_worker < 2**20
    assert {"name": MEMORY_VOLUME, "mountPath": MEMORY_CHECKPOINTS_DIR} in \
        _container(pod)["volumeMounts"]
    assert {"name": FOLDER_ENV, "value": MEMORY_CHECKPOINTS_DIR} in _container(pod)["env"]


def test_without_a_limit_only_the_request_grows_and_without_the_tier_nothing_changes(
    minimal_manifest: dict[str, Any],
) -> None:
    pod = worker_pod(_job(minimal_manifest, {"everySteps": 5}), 0, 0)
    resources = _container(pod)["resources"]
    assert "memory" not in resources.get("limits", {})
    assert parse_quantity(resources["requests"]["memory"]) > 0
    plain = worker_pod(_job(minimal_manifest, None), 0, 0)
    assert all(v["name"] != MEMORY_VOLUME for v in plain["spec"]["volumes"])
    assert "memory" not in _container(plain)["resources"].get("requests", {})


def test_a_tier_bigger_than_max_worker_memory_is_refused_with_its_arithmetic(
    minimal_manifest: dict[str, Any],
) -> None:
    memory = {"everySteps": 2, "replicas": 2, "maxWorkerMemory": "1Gi"}
    with pytest.raises(InvalidManifest) as refused:
        _job(minimal_manifest, memory, replicas=2, procsPerWorker=1)
    message = str(refused.value)
    assert "spec.checkpoint.memory.maxWorkerMemory (1Gi) is less than the tier needs" in message
    assert "x 2 versions x 2 copies (1 + replicas)" in message  # 2 ranks: 1 partner at most
    # More workers shard the state further: the same tier then fits.
    fits = _job(minimal_manifest, {**memory, "maxWorkerMemory": "4Gi"}, replicas=8)
    budget = tier_budget(fits.spec)
    assert budget is not None and budget.per_worker <= 4 * 2**30


def test_pods_with_partner_copies_are_spread_over_nodes_softly_and_others_are_not(
    minimal_manifest: dict[str, Any],
) -> None:
    pod = worker_pod(_job(minimal_manifest, {"everySteps": 2, "replicas": 1}), 1, 0)
    kubernetes_validate.validate(pod, kubernetes_validate.latest_version(), strict=True)
    (spread,) = pod["spec"]["topologySpreadConstraints"]
    assert spread["topologyKey"] == "kubernetes.io/hostname"
    assert spread["whenUnsatisfiable"] == "ScheduleAnyway", "a job never waits for a node"
    assert spread["labelSelector"]["matchLabels"] == {
        "kubetrain.io/job-name": pod["metadata"]["labels"]["kubetrain.io/job-name"]}
    for memory in (None, {"everySteps": 2, "replicas": 0}):
        assert "topologySpreadConstraints" not in worker_pod(
            _job(minimal_manifest, memory), 1, 0)["spec"]


def test_async_saves_add_their_staging_buffer_to_the_pods_memory_beside_the_tiers(
    minimal_manifest: dict[str, Any],
) -> None:
    resources = {"requests": {"memory": "8Gi"}, "limits": {"memory": "16Gi"}}
    memory = {"everySteps": 2, "replicas": 1}
    tier_only = _job(minimal_manifest, memory, resources=resources, procsPerWorker=2)
    document = copy.deepcopy(minimal_manifest)
    document["spec"]["checkpoint"]["async"] = True
    both = _job(document, memory, resources=resources, procsPerWorker=2)
    budget = staging_budget(both.spec)
    assert staging_budget(tier_only.spec) is None
    assert budget is not None and budget.world_size == 4
    assert budget.per_worker == budget.shard_bytes * 2  # one state shard per process
    tier = tier_budget(both.spec)
    assert tier is not None and budget.shard_bytes == tier.shard_bytes
    got = _container(worker_pod(both, 0, 0))["resources"]
    before = _container(worker_pod(tier_only, 0, 0))["resources"]
    for kind in ("requests", "limits"):
        added = parse_quantity(got[kind]["memory"]) - parse_quantity(before[kind]["memory"])
        assert 0 <= added - budget.per_worker < 2**20, kind
    (volume,) = [v for v in worker_pod(both, 0, 0)["spec"]["volumes"]
                 if v["name"] == MEMORY_VOLUME]
    assert 0 <= parse_quantity(volume["emptyDir"]["sizeLimit"]) - tier.per_worker < 2**20, \
        "the staging buffer is the process's memory, not the tier's volume"
