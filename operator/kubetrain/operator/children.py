"""The Kubernetes objects a TrainingJob owns, as pure functions of the job.

`worker_pod`, `service` and `config_map` build plain manifests (dicts) and touch no
API: the operator creates what they return, `kubetrain run --dry-run` prints it, and
tests validate it against the Kubernetes schema. Restart and scaling decisions live
in `kubetrain.operator.reconcile`, not here.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import yaml

from kubetrain.api.trainingjob import API_VERSION, KIND, TrainingJob
from kubetrain.memory_budget import (
    FOLDER_ENV,
    format_quantity,
    parse_quantity,
    tier_budget,
)
from kubetrain.protocol import RENDEZVOUS_BACKEND

JOB_LABEL = "kubetrain.io/job-name"
INDEX_LABEL = "kubetrain.io/worker-index"
ATTEMPT_LABEL = "kubetrain.io/restart-attempt"
# On a worker pod: the nodes its required anti-affinity keeps it off (status.avoidedNodes).
AVOIDED_NODES_ANNOTATION = "kubetrain.io/avoided-nodes"
HOSTNAME_LABEL = "kubernetes.io/hostname"
# On the ConfigMap: the job's metadata.generation its snapshot was taken from.
GENERATION_ANNOTATION = "kubetrain.io/job-generation"
# On the ConfigMap: the micro-batch its snapshot tells the trainer to use (status.effective).
MICRO_BATCH_ANNOTATION = "kubetrain.io/micro-batch-size"
MANAGED_BY = {"app.kubernetes.io/managed-by": "kubetrain"}

TRAINER_CONTAINER = "trainer"
RENDEZVOUS_PORT = 29400
CONFIG_DIR = "/etc/kubetrain"
CONFIG_KEY = "job.yaml"

# A SIGTERM makes every rank agree on a step, save one checkpoint together and exit;
# uploading a large sharded checkpoint can take minutes, so the kubelet must wait.
TERMINATION_GRACE_SECONDS = 300

# Kueue's plain-pod integration admits a group of pods as one workload.
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
KUEUE_GROUP_LABEL = "kueue.x-k8s.io/pod-group-name"
KUEUE_GROUP_COUNT = "kueue.x-k8s.io/pod-group-total-count"

# Keys of the Secret named by spec.storage.credentialsSecret; the session token is optional.
_CREDENTIAL_KEYS = (
    ("AWS_ACCESS_KEY_ID", False),
    ("AWS_SECRET_ACCESS_KEY", False),
    ("AWS_SESSION_TOKEN", True),
)

# The trainer image runs as this unprivileged user.
_TRAINER_UID = 1000


def pod_name(job_name: str, index: int) -> str:
    """`<job>-worker-<index>`: stable across restarts so the rendezvous host keeps its DNS name."""
    return f"{job_name}-worker-{index}"


def config_map_name(job_name: str) -> str:
    return f"{job_name}-config"


def worker_selector(job_name: str) -> str:
    """Label selector of the job's worker pods (status.workers.selector, for `kubectl scale`)."""
    return f"{JOB_LABEL}={job_name}"


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


def job_snapshot(job: TrainingJob) -> str:
    """The manifest the trainer reads at /etc/kubetrain/job.yaml: the spec, and of the status
    only `effective` (the micro-batch an out-of-memory restart chose), never the spec changed."""
    meta: dict[str, Any] = {"name": job.metadata.name}
    if job.metadata.namespace:
        meta["namespace"] = job.metadata.namespace
    document: dict[str, Any] = {"apiVersion": API_VERSION, "kind": KIND, "metadata": meta,
                                "spec": job.spec.wire()}
    if job.status is not None and job.status.effective is not None:
        document["status"] = {"effective": job.status.effective.wire()}
    # libyaml's emitter: the pure-Python one costs milliseconds per job at every create.
    return yaml.dump(document, Dumper=yaml.CSafeDumper, sort_keys=False)


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


def torchrun_env(job: TrainingJob) -> list[dict[str, Any]]:
    """torchrun's options as PET_* variables: elastic nnodes, c10d rendezvous at worker 0."""
    workers = job.spec.workers
    name = job.metadata.name
    return [
        {"name": "PET_NNODES", "value": f"{workers.min_workers}:{workers.max_workers}"},
        {"name": "PET_NPROC_PER_NODE", "value": str(workers.procs_per_worker)},
        # c10d, polling its state every 0.1 s: restarts rejoin sooner
        # (kubetrain.trainer.rendezvous).
        {"name": "PET_RDZV_BACKEND", "value": RENDEZVOUS_BACKEND},
        {"name": "PET_RDZV_ENDPOINT", "value": f"{pod_name(name, 0)}.{name}:{RENDEZVOUS_PORT}"},
        # The uid, not the name: a re-created job of the same name must not join stale rendezvous.
        {"name": "PET_RDZV_ID", "value": job.metadata.uid or name},
        {"name": "PET_MAX_RESTARTS", "value": str(job.spec.run_policy.max_restarts)},
        # A fresh store for the trainers at each rendezvous round: in torchrun's shared store
        # an earlier round's keys remain, and the agents count restarts differently (one
        # whose worker failed counts it, one that restarts for the new membership does not),
        # so no per-attempt prefix is the same on every rank (kubetrain.trainer.distributed).
        {"name": "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "value": "1"},
    ]


def placement_env() -> list[dict[str, Any]]:
    """The pod's and node's names (downward API): the trainer labels each rank's timing with
    them, and the operator names the straggler's pod and node from that."""
    return [
        {"name": "KUBETRAIN_POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "KUBETRAIN_NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
    ]


def credentials_env(job: TrainingJob) -> list[dict[str, Any]]:
    """S3 keys taken from the referenced Secret at run time; values never enter a manifest."""
    secret = job.spec.storage.credentials_secret
    if secret is None:
        return []
    return [
        {"name": key, "valueFrom": {"secretKeyRef": {
            "name": secret.name, "key": key, **({"optional": True} if optional else {})}}}
        for key, optional in _CREDENTIAL_KEYS
    ]


def _kueue_metadata(job: TrainingJob) -> tuple[dict[str, str], dict[str, str]]:
    queue = job.metadata.labels.get(KUEUE_QUEUE_LABEL)
    if not queue:
        return {}, {}
    labels = {KUEUE_QUEUE_LABEL: queue, KUEUE_GROUP_LABEL: job.metadata.name}
    annotations = {KUEUE_GROUP_COUNT: str(job.spec.workers.replicas)}
    return labels, annotations


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


def _trainer_container(job: TrainingJob) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """kubetrain's trainer under torchrun, and the volumes it needs besides the shared ones."""
    spec = job.spec
    container: dict[str, Any] = {
        "name": TRAINER_CONTAINER,
        "image": spec.image,
        # torchrun with its options from PET_*, whose restarts in place skip the imports.
        "command": ["python", "-m", "kubetrain.trainer.launch", f"{CONFIG_DIR}/{CONFIG_KEY}"],
        "env": [
            *torchrun_env(job),
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
        resources = container["resources"]
        for kind in ("requests", "limits"):
            current = resources.get(kind, {}).get("memory")
            if kind == "limits" and current is None:
                continue  # no limit is made where the user set none
            resources.setdefault(kind, {})["memory"] = format_quantity(
                parse_quantity(current or 0) + budget.per_worker)
    return [volume]


def memory_tier_spread(job: TrainingJob) -> list[dict[str, Any]] | None:
    """spec.checkpoint.memory: a soft spread of the job's worker pods over nodes, so that
    the trainer can put each rank's partner copy on another node (a copy on its owner's
    node does not survive that node's loss). ScheduleAnyway: a job never waits for a
    node; where the pods still share one, the operator says so (nodes.report_memory_copies)."""
    if job.spec.checkpoint.memory is None or job.spec.checkpoint.memory.replicas < 1:
        return None
    return [{"maxSkew": 1, "topologyKey": HOSTNAME_LABEL, "whenUnsatisfiable": "ScheduleAnyway",
             "labelSelector": {"matchLabels": {JOB_LABEL: job.metadata.name}}}]


def _own_code_container(job: TrainingJob) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The user's command under the same launch (`kubetrain.operator.own_code_launch`)."""
    # Imported here: own_code_launch builds on this module's launch (torchrun_env, ...).
    from kubetrain.operator.own_code_launch import own_code_launch

    effective = job.status.effective if job.status is not None else None
    launch = own_code_launch(job, effective.out_of_memory_restarts if effective else 0)
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
    the status it decided, expired entries already dropped. Its container runs kubetrain's
    trainer, or for a job with spec.trainer the user's own code (`_own_code_container`);
    the pod around it is the same.
    """
    spec = job.spec
    template = spec.workers.template
    name = job.metadata.name
    kueue_labels, kueue_annotations = _kueue_metadata(job)
    labels = {
        **template.labels,
        **kueue_labels,
        INDEX_LABEL: str(index),
        ATTEMPT_LABEL: str(restart_attempt),
    }
    metadata = _metadata(job, pod_name(name, index), labels)
    avoided = [entry.node for entry in job.status.avoided_nodes] if job.status else []
    annotations = {**template.annotations, **kueue_annotations}
    if avoided:
        annotations[AVOIDED_NODES_ANNOTATION] = ",".join(avoided)
    if annotations:
        metadata["annotations"] = annotations

    if spec.trainer is not None:
        container, volumes = _own_code_container(job)
    else:
        container, volumes = _trainer_container(job)
    container["volumeMounts"] += template.volume_mounts
    container["securityContext"] = {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "runAsNonRoot": True,
    }

    pod_spec: dict[str, Any] = {
        "hostname": pod_name(name, index),
        "subdomain": name,
        # The operator owns restarts: a failed pod is replaced, never restarted in place.
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": TERMINATION_GRACE_SECONDS,
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": _TRAINER_UID,
            "runAsGroup": _TRAINER_UID,
            "fsGroup": _TRAINER_UID,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
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
