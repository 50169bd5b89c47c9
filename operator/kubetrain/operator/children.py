"""The Kubernetes objects a TrainingJob owns, as pure functions of the job.

`worker_pod`, `service` and `config_map` (and for a job with spec.faultTolerance
`lighthouse_pod` and `lighthouse_service`) build plain manifests (dicts) and touch no
API: the operator creates what they return, `kubetrain run --dry-run` prints it, and
tests validate it against the Kubernetes schema. A worker's names, labels, snapshot and
torchrun settings are the conventions both runners share (`kubetrain.pod_conventions`); the
environment every worker container gets is `kubetrain.operator.worker_env`'s, and the
container of own code `kubetrain.operator.own_code_container`'s. Restart and scaling
decisions live in `kubetrain.operator.reconcile`, not here.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from kubetrain.api.trainingjob import API_VERSION, KIND, TrainingJob
from kubetrain.memory_budget import (
    FOLDER_ENV,
    format_quantity,
    parse_quantity,
    staging_budget,
    tier_budget,
)
from kubetrain.operator.own_code_container import own_code_container
from kubetrain.operator.worker_env import (
    CONFIG_DIR,
    CONFIG_KEY,
    RENDEZVOUS_PORT,
    TERMINATION_GRACE_SECONDS,
    credentials_env,
    placement_env,
    torchrun_env,
)
from kubetrain.pod_conventions import (
    ATTEMPT_LABEL,
    COMPONENT_LABEL,
    INDEX_LABEL,
    JOB_LABEL,
    LIGHTHOUSE_COMPONENT,
    LIGHTHOUSE_PORT,
    TRAINER_CONTAINER,
    TRAINER_LAUNCH_MODULE,
    job_snapshot,
    lighthouse_command,
    lighthouse_name,
    pod_name,
    worker_label_selector,
)

# On a worker pod: the nodes its required anti-affinity keeps it off (status.avoidedNodes).
AVOIDED_NODES_ANNOTATION = "kubetrain.io/avoided-nodes"
HOSTNAME_LABEL = "kubernetes.io/hostname"
# On the ConfigMap: the job's metadata.generation its snapshot was taken from.
GENERATION_ANNOTATION = "kubetrain.io/job-generation"
# On the ConfigMap: the micro-batch its snapshot tells the trainer to use (status.effective).
MICRO_BATCH_ANNOTATION = "kubetrain.io/micro-batch-size"
MANAGED_BY = {"app.kubernetes.io/managed-by": "kubetrain"}

# The trainer image runs as this unprivileged user.
_TRAINER_UID = 1000
# Every pod of a job (its workers, its lighthouse) runs so hardened.
_POD_SECURITY: dict[str, Any] = {
    "runAsNonRoot": True,
    "runAsUser": _TRAINER_UID,
    "runAsGroup": _TRAINER_UID,
    "fsGroup": _TRAINER_UID,
    "seccompProfile": {"type": "RuntimeDefault"},
}
_CONTAINER_SECURITY: dict[str, Any] = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "runAsNonRoot": True,
}


def config_map_name(job_name: str) -> str:
    return f"{job_name}-config"


def owner_reference(job: TrainingJob) -> dict[str, Any]:
    """Makes a child garbage-collected with its job."""
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": job.metadata.name,
        "uid": job.metadata.uid or "",
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _metadata(job: TrainingJob, name: str, labels: dict[str, str]) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "labels": {**MANAGED_BY, JOB_LABEL: job.metadata.name, **labels},
        "ownerReferences": [owner_reference(job)],
    }
    if job.metadata.namespace:
        meta["namespace"] = job.metadata.namespace
    return meta


def service(job: TrainingJob) -> dict[str, Any]:
    """The headless Service that gives each worker the DNS name `<pod>.<job>`.

    Not-ready addresses are published because workers must find the rendezvous host
    before any of them is ready.
    """
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(job, job.metadata.name, {}),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {JOB_LABEL: job.metadata.name},
            "ports": [
                {"name": "rendezvous", "port": RENDEZVOUS_PORT, "targetPort": RENDEZVOUS_PORT},
                {"name": "metrics", "port": job.spec.metrics.port,
                 "targetPort": job.spec.metrics.port},
            ],
        },
    }


def config_map(job: TrainingJob) -> dict[str, Any]:
    """The ConfigMap `<job>-config` holding the trainer's config snapshot.

    Annotated with the spec generation and the micro-batch it holds, so the operator can
    tell a stale one (the spec changed, or an out-of-memory restart halved the micro-batch)
    without comparing snapshots.
    """
    metadata = _metadata(job, config_map_name(job.metadata.name), {})
    metadata["annotations"] = {GENERATION_ANNOTATION: str(job.metadata.generation or 0),
                               MICRO_BATCH_ANNOTATION: str(job.micro_batch_size)}
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata,
        "data": {CONFIG_KEY: job_snapshot(job)},
    }


# The taints the node lifecycle controller puts on a node that stops reporting, or reports
# not ready: pods that tolerate them are evicted after their tolerationSeconds.
NODE_LOSS_TAINTS = ("node.kubernetes.io/unreachable", "node.kubernetes.io/not-ready")


def node_loss_tolerations(tolerations: list[dict[str, Any]],
                          seconds: int | None) -> list[dict[str, Any]]:
    """The user's tolerations, and runPolicy.nodeLossTolerationSeconds' for each node-loss
    taint that they do not already tolerate (theirs win)."""
    if seconds is None:
        return list(tolerations)
    keys = {toleration.get("key") for toleration in tolerations}
    return [*tolerations, *({"key": taint, "operator": "Exists", "effect": "NoExecute",
                             "tolerationSeconds": seconds}
                            for taint in NODE_LOSS_TAINTS if taint not in keys)]


def avoiding_affinity(affinity: dict[str, Any] | None,
                      nodes: Sequence[str]) -> dict[str, Any] | None:
    """The user's pod affinity with the avoided nodes excluded: a required node affinity
    `kubernetes.io/hostname NotIn nodes`, ANDed into each of the user's nodeSelectorTerms
    (the terms are ORed, so the exclusion must hold in every one), or the only term."""
    if not nodes:
        return affinity
    merged = copy.deepcopy(affinity) if affinity else {}
    required = merged.setdefault("nodeAffinity", {}).setdefault(
        "requiredDuringSchedulingIgnoredDuringExecution", {})
    exclusion = {"key": HOSTNAME_LABEL, "operator": "NotIn", "values": list(nodes)}
    terms = required.get("nodeSelectorTerms") or [{}]
    for term in terms:
        term["matchExpressions"] = [*(term.get("matchExpressions") or []), exclusion]
    required["nodeSelectorTerms"] = terms
    return merged


_SHARED_MOUNTS = ({"name": "job-config", "mountPath": CONFIG_DIR, "readOnly": True},
                  {"name": "dshm", "mountPath": "/dev/shm"})


def _trainer_container(job: TrainingJob,
                       index: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """kubetrain's trainer under torchrun in worker pod `index`, and the volumes it needs
    besides the shared ones."""
    spec = job.spec
    container: dict[str, Any] = {
        "name": TRAINER_CONTAINER,
        "image": spec.image,
        # torchrun with its options from PET_*, whose restarts in place skip the imports.
        "command": ["python", "-m", TRAINER_LAUNCH_MODULE, f"{CONFIG_DIR}/{CONFIG_KEY}"],
        "env": [
            *torchrun_env(job, index),
            *placement_env(),
            *credentials_env(job),
            *(env.wire() for env in spec.workers.template.env),
        ],
        "ports": [
            {"name": "rendezvous", "containerPort": RENDEZVOUS_PORT},
            {"name": "metrics", "containerPort": spec.metrics.port},
        ],
        "resources": spec.workers.resources.wire(),
        "volumeMounts": [dict(mount) for mount in _SHARED_MOUNTS],
    }
    if spec.image_pull_policy:
        container["imagePullPolicy"] = spec.image_pull_policy
    checkpoint_staging(job, container)
    return container, memory_tier(job, container)


MEMORY_VOLUME = "memory-checkpoints"
MEMORY_CHECKPOINTS_DIR = "/var/run/kubetrain/memory-checkpoints"


def memory_tier(job: TrainingJob, container: dict[str, Any]) -> list[dict[str, Any]]:
    """spec.checkpoint.memory: the tier's own volume (an emptyDir of medium Memory, sized
    by `memory_budget`), mounted where the trainer looks for it; the volumes to add.

    tmpfs pages count against the container's memory cgroup, so the tier's size is added
    to the container's memory request and, when it has one, its limit: the trainer keeps
    the room it was given, and an OOMKilled pod is not the tier's doing. A model sized only
    by its config.json (model.init) gets the volume unsized and no memory added.
    """
    if job.spec.checkpoint.memory is None:
        return []
    container["env"].append({"name": FOLDER_ENV, "value": MEMORY_CHECKPOINTS_DIR})
    container["volumeMounts"].append({"name": MEMORY_VOLUME,
                                      "mountPath": MEMORY_CHECKPOINTS_DIR})
    volume: dict[str, Any] = {"name": MEMORY_VOLUME, "emptyDir": {"medium": "Memory"}}
    budget = tier_budget(job.spec)
    if budget is not None:
        volume["emptyDir"]["sizeLimit"] = format_quantity(budget.per_worker)
        _add_memory(container, budget.per_worker)
    return [volume]


def checkpoint_staging(job: TrainingJob, container: dict[str, Any]) -> None:
    """spec.checkpoint.async: the host buffer the S3 tier's asynchronous saves stage into,
    a state shard per process allocated at the first save and kept (`memory_budget.
    staging_budget`), added to the container's memory request and, when it has one, its
    limit, as the in-memory tier's size is. A model sized only by its config.json adds none."""
    budget = staging_budget(job.spec)
    if budget is not None:
        _add_memory(container, budget.per_worker)


def _add_memory(container: dict[str, Any], size: int) -> None:
    """Add `size` bytes to the container's memory request, and to its limit where it has one
    (no limit is made where the user set none)."""
    resources = container["resources"]
    for kind in ("requests", "limits"):
        current = resources.get(kind, {}).get("memory")
        if kind == "limits" and current is None:
            continue
        resources.setdefault(kind, {})["memory"] = format_quantity(
            parse_quantity(current or 0) + size)


def memory_tier_spread(job: TrainingJob) -> list[dict[str, Any]] | None:
    """spec.checkpoint.memory: a soft spread of the job's worker pods over nodes, so that
    the trainer can put each rank's partner copy on another node (a copy on its owner's
    node does not survive that node's loss). ScheduleAnyway: a job never waits for a
    node; where the pods still share one, the operator says so (nodes.report_memory_copies)."""
    if job.spec.checkpoint.memory is None or job.spec.checkpoint.memory.replicas < 1:
        return None
    return [{"maxSkew": 1, "topologyKey": HOSTNAME_LABEL, "whenUnsatisfiable": "ScheduleAnyway",
             "labelSelector": worker_label_selector(job.metadata.name)}]


def _own_code_container(job: TrainingJob,
                        index: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The user's command under the same launch (`kubetrain.operator.own_code_container`)."""
    effective = job.status.effective if job.status is not None else None
    launch = own_code_container(job, effective.out_of_memory_restarts if effective else 0,
                                index)
    container: dict[str, Any] = {
        "name": TRAINER_CONTAINER,
        "image": launch.image,
        "command": launch.command,
        "env": launch.env,
        # No metrics port: progress comes through the status endpoint.
        "ports": [{"name": "rendezvous", "containerPort": RENDEZVOUS_PORT}],
        "resources": job.spec.workers.resources.wire(),
        "volumeMounts": [*(dict(mount) for mount in _SHARED_MOUNTS), *launch.volume_mounts],
    }
    if job.spec.image_pull_policy:
        container["imagePullPolicy"] = job.spec.image_pull_policy
    return container, launch.volumes


def worker_pod(job: TrainingJob, index: int, restart_attempt: int) -> dict[str, Any]:
    """Worker pod `index` of the group, in its `restart_attempt`-th incarnation.

    Kept off the nodes in the job's status.avoidedNodes: reconcile passes the job with
    the status it decided, expired entries already dropped. Its placement (gang, Kueue,
    topology) is added by `kubetrain.operator.scheduling.shape_pod`. Its container runs kubetrain's
    trainer, or for a job with spec.trainer the user's own code (`_own_code_container`);
    the pod around it is the same.
    """
    spec = job.spec
    template = spec.workers.template
    name = job.metadata.name
    labels = {
        **template.labels,
        INDEX_LABEL: str(index),
        ATTEMPT_LABEL: str(restart_attempt),
    }
    metadata = _metadata(job, pod_name(name, index), labels)
    avoided = [entry.node for entry in job.status.avoided_nodes] if job.status else []
    annotations = dict(template.annotations)
    if avoided:
        annotations[AVOIDED_NODES_ANNOTATION] = ",".join(avoided)
    if annotations:
        metadata["annotations"] = annotations

    if spec.trainer is not None:
        container, volumes = _own_code_container(job, index)
    else:
        container, volumes = _trainer_container(job, index)
    container["volumeMounts"] += template.volume_mounts
    container["securityContext"] = dict(_CONTAINER_SECURITY)

    pod_spec: dict[str, Any] = {
        "hostname": pod_name(name, index),
        "subdomain": name,
        # The operator owns restarts: a failed pod is replaced, never restarted in place.
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": TERMINATION_GRACE_SECONDS,
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,
        "securityContext": dict(_POD_SECURITY),
        "containers": [container],
        "volumes": [
            {"name": "job-config", "configMap": {"name": config_map_name(name)}},
            # NCCL and DataLoader workers share tensors through /dev/shm; the default is 64 MiB.
            {"name": "dshm", "emptyDir": {"medium": "Memory"}},
            *volumes,
            *template.volumes,
        ],
    }
    optional = {
        "nodeSelector": template.node_selector or None,
        "tolerations": node_loss_tolerations(
            template.tolerations, spec.run_policy.node_loss_toleration_seconds) or None,
        "affinity": avoiding_affinity(template.affinity, avoided),
        "topologySpreadConstraints": memory_tier_spread(job),
        "schedulerName": template.scheduler_name,
        "priorityClassName": template.priority_class_name,
        "serviceAccountName": template.service_account_name,
    }
    pod_spec.update({key: value for key, value in optional.items() if value is not None})
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": pod_spec}


# --- the lighthouse of a job with spec.faultTolerance ------------------------------------

LIGHTHOUSE_CONTAINER = "lighthouse"
# torchft's lighthouse keeps only the groups' heartbeats and the quorum in memory: little.
_LIGHTHOUSE_RESOURCES = {"requests": {"cpu": "100m", "memory": "64Mi"},
                         "limits": {"memory": "256Mi"}}
_LIGHTHOUSE_GRACE_SECONDS = 5  # nothing to save: it is stateless


def _lighthouse_labels() -> dict[str, str]:
    return {COMPONENT_LABEL: LIGHTHOUSE_COMPONENT}


def lighthouse_pod(job: TrainingJob) -> dict[str, Any]:
    """The Pod `<job>-lighthouse` that keeps the quorum of a job's replica groups
    (`kubetrain.pod_conventions.lighthouse_command`), in the image the workers run (torchft,
    whose wheel holds the lighthouse, is in it).

    Stateless, so the kubelet restarts it in place when it exits (restartPolicy Always;
    the groups wait out the gap on their quorum timeout), and the operator creates it again
    when it is gone or its node lost it. Labelled with the job, so the operator's watch
    sees it, but with no worker index, so no worker selector (status.workers.selector, the
    spreads' and affinities') counts it. The headless Service `<job>`, which selects by the
    job's label alone (a Service selects by equality only), lists it too, harmlessly: it has
    no hostname there, and workers meet by theirs. Hardened as the workers are.
    """
    spec = job.spec
    image = spec.trainer.image if spec.trainer is not None else spec.image
    container: dict[str, Any] = {
        "name": LIGHTHOUSE_CONTAINER,
        "image": image,
        "command": lighthouse_command(job),
        # torchft's lighthouse logs every quorum request at info, lines per group per step;
        # the trainers say when the quorum changes (their `quorum` events).
        "env": [{"name": "RUST_LOG", "value": "warn"}],
        "ports": [{"name": "lighthouse", "containerPort": LIGHTHOUSE_PORT}],
        "readinessProbe": {"tcpSocket": {"port": LIGHTHOUSE_PORT}, "periodSeconds": 5},
        "resources": copy.deepcopy(_LIGHTHOUSE_RESOURCES),
        "securityContext": dict(_CONTAINER_SECURITY),
    }
    if spec.image_pull_policy:
        container["imagePullPolicy"] = spec.image_pull_policy
    template = spec.workers.template
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Always",
        "terminationGracePeriodSeconds": _LIGHTHOUSE_GRACE_SECONDS,
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,
        "securityContext": dict(_POD_SECURITY),
        "containers": [container],
    }
    # The workers' account (its image pull secrets) and priority: the lighthouse is as
    # needed as they are.
    optional = {"priorityClassName": template.priority_class_name,
                "serviceAccountName": template.service_account_name}
    pod_spec.update({key: value for key, value in optional.items() if value is not None})
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": _metadata(job, lighthouse_name(job.metadata.name),
                                  _lighthouse_labels()),
            "spec": pod_spec}


def lighthouse_service(job: TrainingJob) -> dict[str, Any]:
    """The ClusterIP Service `<job>-lighthouse` the workers reach the lighthouse by
    (`kubetrain.operator.worker_env.lighthouse_url`)."""
    name = job.metadata.name
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(job, lighthouse_name(name), _lighthouse_labels()),
        "spec": {
            "type": "ClusterIP",
            "selector": {JOB_LABEL: name, **_lighthouse_labels()},
            "ports": [{"name": "lighthouse", "port": LIGHTHOUSE_PORT,
                       "targetPort": LIGHTHOUSE_PORT}],
        },
    }
