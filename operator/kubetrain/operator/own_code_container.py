"""The worker container of an own-code job (spec.trainer): its command, environment and volume.

A pure function of the job (`own_code_container`), beside `children.worker_pod`, which
builds the container of kubetrain's own trainer: the same elastic torchrun launch
(`worker_env.torchrun_env`: PET_* with
nnodes min:max, c10d rendezvous at worker 0, the job's restart attempts), but torchrun
runs the user's command (`TrainerSpec.torchrun_arguments`: a script, a module or
--no-python), wrapped by `python3 -m kubetrain.trainer.own_code`, which restores the newest
checkpoint into KUBETRAIN_CHECKPOINT_DIR first, uploads marked folders while it runs and
passes SIGTERM through. `children.worker_pod` builds the pod around this container for
every job with spec.trainer.

The status endpoint (`kubetrain.operator.trainer_status_endpoint`) reaches the container through
the job's Secret `<job>-status` (`status_secret_name`), which the operator creates before
the job's pods: its `url`, `token` and `ca.crt` become Kubeflow Trainer's three
KUBEFLOW_TRAINER_SERVER_* variables (the URL as a value, the other two as file paths).
The Secret is optional in the pod: an operator run without the endpoint creates none,
and the pods then run without reporting. This module touches no API.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kubetrain.api.trainingjob import TrainingJob
from kubetrain.operator.worker_env import (
    CONFIG_DIR,
    CONFIG_KEY,
    TERMINATION_GRACE_SECONDS,
    credentials_env,
    placement_env,
    torchrun_env,
)
from kubetrain.pod_conventions import (
    FINAL_SYNC_SECONDS_ENV,
    OWN_CODE_ENTRY_MODULE,
    SHUTDOWN_TIMEOUT_ENV,
)
from kubetrain.protocol import CA_CERT_ENV, SERVER_URL_ENV, TOKEN_ENV
from kubetrain.sdk.batch import OUT_OF_MEMORY_RESTARTS_ENV
from kubetrain.sdk.checkpoints import CHECKPOINT_DIR_ENV

# A pod-local folder: the user's code writes checkpoints there, kubetrain syncs it with S3.
LOCAL_CHECKPOINT_DIR = "/var/lib/kubetrain/checkpoints"
CHECKPOINT_VOLUME = "checkpoints"
# Of the pod's grace period, what torchrun gives its workers to save after SIGTERM before
# it kills them (its default is 30 s): the rest is for uploading that last checkpoint.
WORKER_SHUTDOWN_SECONDS = TERMINATION_GRACE_SECONDS * 2 // 3
# The job's Secret for the status endpoint, its keys, and where the pod mounts it.
STATUS_VOLUME = "status-endpoint"
STATUS_DIR = "/var/run/kubetrain/status"
STATUS_URL_KEY = "url"
STATUS_TOKEN_KEY = "token"
STATUS_CA_KEY = "ca.crt"


def status_secret_name(job_name: str) -> str:
    """`<job>-status`: the job's token, the endpoint's CA and URL (mounted into its pods only)."""
    return f"{job_name}-status"


def status_env(job: TrainingJob) -> list[dict[str, Any]]:
    """Kubeflow Trainer's three variables, from the job's status Secret (absent: unset)."""
    secret = status_secret_name(job.metadata.name)
    return [
        {"name": SERVER_URL_ENV, "valueFrom": {"secretKeyRef": {
            "name": secret, "key": STATUS_URL_KEY, "optional": True}}},
        {"name": CA_CERT_ENV, "value": f"{STATUS_DIR}/{STATUS_CA_KEY}"},
        {"name": TOKEN_ENV, "value": f"{STATUS_DIR}/{STATUS_TOKEN_KEY}"},
    ]


@dataclass(frozen=True)
class OwnCodeContainer:
    """What the worker container of an own-code job runs, and the volume it needs."""

    image: str
    command: list[str]
    env: list[dict[str, Any]]
    volumes: list[dict[str, Any]]
    volume_mounts: list[dict[str, Any]]


def own_code_container(job: TrainingJob, out_of_memory_restarts: int = 0,
                       index: int = 0) -> OwnCodeContainer:
    """The container of worker pod `index` of `job`, which must have spec.trainer (the same
    for every pod but with spec.faultTolerance, whose pods differ by replica group: a
    script that runs torchft, such as torchtitan's with --fault_tolerance.enable, finds
    its group and the lighthouse as kubetrain's trainer does).

    `out_of_memory_restarts` (status.effective's) reaches the user's code as
    KUBETRAIN_OUT_OF_MEMORY_RESTARTS, which kubetrain.sdk.micro_batch_size halves by.
    """
    trainer = job.spec.trainer
    if trainer is None:
        raise ValueError(f"{job.metadata.name} runs kubetrain's trainer, not its own code: "
                         "build its container with children.worker_pod")
    command = ["python3", "-m", OWN_CODE_ENTRY_MODULE, f"{CONFIG_DIR}/{CONFIG_KEY}", "--",
               "torchrun", *trainer.torchrun_arguments()]
    env = [
        *torchrun_env(job, index),
        {"name": SHUTDOWN_TIMEOUT_ENV, "value": str(WORKER_SHUTDOWN_SECONDS)},
        *placement_env(),
        *credentials_env(job),
        {"name": CHECKPOINT_DIR_ENV, "value": LOCAL_CHECKPOINT_DIR},
        {"name": OUT_OF_MEMORY_RESTARTS_ENV, "value": str(out_of_memory_restarts)},
        {"name": FINAL_SYNC_SECONDS_ENV,
         "value": str(TERMINATION_GRACE_SECONDS - WORKER_SHUTDOWN_SECONDS - 10)},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
        *status_env(job),
        # The user's own last, so that they win over ours (as in a pod, the last one counts).
        *(var.wire() for var in job.spec.workers.template.env),
        *(var.wire() for var in trainer.env),
    ]
    return OwnCodeContainer(
        image=trainer.image,
        command=command,
        env=env,
        volumes=[
            {"name": CHECKPOINT_VOLUME, "emptyDir": {}},
            {"name": STATUS_VOLUME, "secret": {
                "secretName": status_secret_name(job.metadata.name), "optional": True,
                "items": [{"key": STATUS_TOKEN_KEY, "path": STATUS_TOKEN_KEY},
                          {"key": STATUS_CA_KEY, "path": STATUS_CA_KEY}]}},
        ],
        volume_mounts=[
            {"name": CHECKPOINT_VOLUME, "mountPath": LOCAL_CHECKPOINT_DIR},
            {"name": STATUS_VOLUME, "mountPath": STATUS_DIR, "readOnly": True},
        ],
    )
