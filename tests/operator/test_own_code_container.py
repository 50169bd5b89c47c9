"""The own-code worker container: the same elastic torchrun launch as kubetrain's trainer."""

from __future__ import annotations

import copy
from typing import Any

import kubernetes_validate
import pytest

from kubetrain.api import parse_job
from kubetrain.operator.children import torchrun_env, worker_pod
from kubetrain.operator.own_code_container import (
    LOCAL_CHECKPOINT_DIR,
    WORKER_SHUTDOWN_SECONDS,
    own_code_container,
)


def _job(minimal_manifest: dict[str, Any], command: list[str], args: list[str],
         workers: dict[str, Any]) -> Any:
    document = copy.deepcopy(minimal_manifest)
    for typed in ("image", "model", "data"):
        del document["spec"][typed]
    document["metadata"]["uid"] = "0c1d-uid"
    document["spec"]["workers"] = workers
    document["spec"]["trainer"] = {"image": "me/train:2", "command": command, "args": args,
                                   "env": [{"name": "MY_FLAG", "value": "1"}]}
    return parse_job(document)


@pytest.mark.parametrize(("command", "args", "workers", "after_torchrun", "nnodes"), [
    (["python", "train.py"], ["--lr", "3e-4"], {"replicas": 2},
     ["train.py", "--lr", "3e-4"], "2:2"),
    (["python3", "-m", "pkg.train"], [], {"replicas": 2, "minReplicas": 1, "maxReplicas": 4},
     ["-m", "pkg.train"], "1:4"),
    (["/opt/bin/train"], ["--steps=9"], {"replicas": 1, "procsPerWorker": 8},
     ["--no-python", "/opt/bin/train", "--steps=9"], "1:1"),
    (["torchrun", "--log-dir=/logs", "train.py"], [], {"replicas": 3},
     ["--log-dir=/logs", "train.py"], "3:3"),
])
def test_the_users_command_runs_under_the_jobs_elastic_torchrun(
        minimal_manifest: dict[str, Any], command: list[str], args: list[str],
        workers: dict[str, Any], after_torchrun: list[str], nnodes: str) -> None:
    job = _job(minimal_manifest, command, args, workers)
    launch = own_code_container(job)
    assert launch.image == "me/train:2"
    assert launch.command == ["python3", "-m", "kubetrain.trainer.own_code",
                              "/etc/kubetrain/job.yaml", "--", "torchrun", *after_torchrun]
    env = {var["name"]: var.get("value") for var in launch.env}
    for var in torchrun_env(job):  # exactly the launch kubetrain's trainer gets
        assert env[var["name"]] == var["value"]
    assert env["PET_NNODES"] == nnodes and env["PET_RDZV_ID"] == "0c1d-uid"
    assert env["PET_RDZV_ENDPOINT"] == "demo-worker-0.demo:29400"
    assert env["KUBETRAIN_CHECKPOINT_DIR"] == LOCAL_CHECKPOINT_DIR
    assert env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == str(WORKER_SHUTDOWN_SECONDS)
    assert [var["name"] for var in launch.env][-1] == "MY_FLAG"  # the user's come last
    assert launch.volume_mounts[0]["mountPath"] == LOCAL_CHECKPOINT_DIR


def test_out_of_memory_restarts_reach_the_users_code(minimal_manifest: dict[str, Any]) -> None:
    launch = own_code_container(_job(minimal_manifest, ["python", "t.py"], [], {}),
                             out_of_memory_restarts=2)
    assert {"name": "KUBETRAIN_OUT_OF_MEMORY_RESTARTS", "value": "2"} in launch.env


def test_the_launch_fits_a_kubernetes_pod(minimal_manifest: dict[str, Any]) -> None:
    """Swapped into worker_pod's container, the result is a valid Pod."""
    job = _job(minimal_manifest, ["python", "t.py"], [], {"replicas": 2})
    launch = own_code_container(job)
    pod = worker_pod(job, 0, 0)
    container = pod["spec"]["containers"][0]
    container.update(image=launch.image, command=launch.command, env=launch.env)
    container["volumeMounts"] += launch.volume_mounts
    pod["spec"]["volumes"] += launch.volumes
    kubernetes_validate.validate(pod, kubernetes_validate.latest_version(), strict=True)


def test_kubetrains_own_trainer_is_not_an_own_code_container(
        minimal_manifest: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=r"children\.worker_pod"):
        own_code_container(parse_job(minimal_manifest))
