"""The environment every worker container gets, whichever code it runs.

torchrun's settings as PET_* variables (`kubetrain.pod_conventions.torchrun_settings`:
elastic nnodes min:max, the `kubetrain` rendezvous at worker 0, the pod's budget of
restarts in place; with spec.faultTolerance the pod's replica group, its rendezvous at the
group's first pod, and the job's lighthouse), the pod's placement (downward API) and the S3
credentials from the job's Secret; where the job's manifest is mounted, and how long a pod
has to stop. The containers of kubetrain's trainer (`kubetrain.operator.children`) and of
own code (`kubetrain.operator.own_code_container`) are both built from these, so neither
imports the other for them. Pure; touches no API.
"""

from __future__ import annotations

from typing import Any

from kubetrain.api.trainingjob import TrainingJob
from kubetrain.pod_conventions import (
    LIGHTHOUSE_PORT,
    NODE_NAME_ENV,
    POD_NAME_ENV,
    group_leader,
    group_run_id,
    lighthouse_name,
    pet_variable,
    pod_name,
    replica_group_env,
    torchrun_settings,
)

RENDEZVOUS_PORT = 29400
# The ConfigMap holding the job's snapshot (`kubetrain.pod_conventions.job_snapshot`) is
# mounted here; the trainer reads CONFIG_DIR/CONFIG_KEY.
CONFIG_DIR = "/etc/kubetrain"
CONFIG_KEY = "job.yaml"

# A SIGTERM makes every rank agree on a step, save one checkpoint together and exit;
# uploading a large sharded checkpoint can take minutes, so the kubelet must wait.
TERMINATION_GRACE_SECONDS = 300

# Keys of the Secret named by spec.storage.credentialsSecret; the session token is optional.
_CREDENTIAL_KEYS = (
    ("AWS_ACCESS_KEY_ID", False),
    ("AWS_SECRET_ACCESS_KEY", False),
    ("AWS_SESSION_TOKEN", True),
)


def lighthouse_url(job: TrainingJob) -> str:
    """Where the job's workers reach its lighthouse: its Service, by its name in the job's
    namespace, as they reach each other's pods by `<pod>.<job>`."""
    return f"http://{lighthouse_name(job.metadata.name)}:{LIGHTHOUSE_PORT}"


def torchrun_env(job: TrainingJob, index: int = 0) -> list[dict[str, Any]]:
    """torchrun's options as PET_* variables for worker `index`: elastic nnodes, kubetrain's
    rendezvous on c10d's store at worker 0. With spec.faultTolerance, the pod's replica
    group is its torchrun group: it meets at the group's first pod under the group's run
    id, and is told its group and the lighthouse (`replica_group_env`); every pod of a job
    without it gets the same variables."""
    name = job.metadata.name
    leader = group_leader(job, index)
    settings = torchrun_settings(
        job, endpoint=f"{pod_name(name, leader)}.{name}:{RENDEZVOUS_PORT}",
        # The uid, not the name: a re-created job of the same name must not join stale rendezvous.
        run_id=group_run_id(job, index, job.metadata.uid or name),
        max_nodes=job.spec.workers.max_workers, max_restarts=job.spec.run_policy.max_restarts)
    groups = replica_group_env(job, index, lighthouse_url(job))
    return [
        *({"name": pet_variable(option), "value": value} for option, value in settings.items()),
        *({"name": variable, "value": value} for variable, value in groups.items()),
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
        {"name": POD_NAME_ENV, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": NODE_NAME_ENV, "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
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
