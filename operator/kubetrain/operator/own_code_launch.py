"""The worker container of an own-code job (spec.trainer): its command, environment and volume.

A pure function of the job, beside `children.worker_pod`, which builds the container of
kubetrain's own trainer: the same elastic torchrun launch (`torchrun_env`: PET_* with
nnodes min:max, c10d rendezvous at worker 0, the job's restart attempts), but torchrun
runs the user's command (`TrainerSpec.torchrun_arguments`: a script, a module or
--no-python), wrapped by `python3 -m kubetrain.trainer.own_code`, which restores the newest
checkpoint into KUBETRAIN_CHECKPOINT_DIR first, uploads marked folders while it runs and
passes SIGTERM through. Not wired into worker_pod yet (issue 32: reconcile and handlers
first); this module touches no API.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kubetrain.api.trainingjob import TrainingJob
from kubetrain.operator.children import (
    CONFIG_DIR,
    CONFIG_KEY,
    TERMINATION_GRACE_SECONDS,
    credentials_env,
    placement_env,
    torchrun_env,
)
from kubetrain.sdk.batch import OUT_OF_MEMORY_RESTARTS_ENV
from kubetrain.sdk.checkpoints import CHECKPOINT_DIR_ENV

# A pod-local folder: the user's code writes checkpoints there, kubetrain syncs it with S3.
LOCAL_CHECKPOINT_DIR = "/var/lib/kubetrain/checkpoints"
CHECKPOINT_VOLUME = "checkpoints"
ENTRY_MODULE = "kubetrain.trainer.own_code"
# Of the pod's grace period, what torchrun gives its workers to save after SIGTERM before
# it kills them (its default is 30 s): the rest is for uploading that last checkpoint.
WORKER_SHUTDOWN_SECONDS = TERMINATION_GRACE_SECONDS * 2 // 3
FINAL_SYNC_SECONDS_ENV = "KUBETRAIN_FINAL_SYNC_SECONDS"


@dataclass(frozen=True)
class OwnCodeLaunch:
    """What the worker container of an own-code job runs, and the volume it needs."""

    image: str
    command: list[str]
    env: list[dict[str, Any]]
    volumes: list[dict[str, Any]]
    volume_mounts: list[dict[str, Any]]


def own_code_launch(job: TrainingJob, out_of_memory_restarts: int = 0) -> OwnCodeLaunch:
    """The container of every worker pod of `job`, which must have spec.trainer.

    `out_of_memory_restarts` (status.effective's) reaches the user's code as
    KUBETRAIN_OUT_OF_MEMORY_RESTARTS, which kubetrain.sdk.micro_batch_size halves by.
    """
    trainer = job.spec.trainer
    if trainer is None:
        raise ValueError(f"{job.metadata.name} runs kubetrain's trainer, not its own code: "
                         "build its container with children.worker_pod")
    command = ["python3", "-m", ENTRY_MODULE, f"{CONFIG_DIR}/{CONFIG_KEY}", "--",
               "torchrun", *trainer.torchrun_arguments()]
    env = [
        *torchrun_env(job),
        {"name": "TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "value": str(WORKER_SHUTDOWN_SECONDS)},
        *placement_env(),
        *credentials_env(job),
        {"name": CHECKPOINT_DIR_ENV, "value": LOCAL_CHECKPOINT_DIR},
        {"name": OUT_OF_MEMORY_RESTARTS_ENV, "value": str(out_of_memory_restarts)},
        {"name": FINAL_SYNC_SECONDS_ENV,
         "value": str(TERMINATION_GRACE_SECONDS - WORKER_SHUTDOWN_SECONDS - 10)},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
        # The user's own last, so that they win over ours (as in a pod, the last one counts).
        *(var.wire() for var in job.spec.workers.template.env),
        *(var.wire() for var in trainer.env),
    ]
    return OwnCodeLaunch(
        image=trainer.image,
        command=command,
        env=env,
        volumes=[{"name": CHECKPOINT_VOLUME, "emptyDir": {}}],
        volume_mounts=[{"name": CHECKPOINT_VOLUME, "mountPath": LOCAL_CHECKPOINT_DIR}],
    )
