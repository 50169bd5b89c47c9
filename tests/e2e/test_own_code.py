"""Own code (spec.trainer) on the whole loop: a user's torchrun script under the operator.

The same cluster as tests/e2e/test_whole_loop.py (the session's `cluster` fixture: kmock's
emulator, the operator's pod from the chart, moto's S3, the node agent running the pods
as containers in containerd). The user's code is tests/own_code/plain_torch.py: FSDP2 on
gloo, a torch DCP folder every `--save-every` steps that every rank marks complete with
kubetrain.sdk, progress through `sdk.report` to the operator's status endpoint (TLS, the
job's token from its `<job>-status` Secret), a save on SIGTERM. Its image is the trainer
image built from this tree, which has torch and kubetrain's own-code extra; the script
reaches the pods as a ConfigMap volume (spec.workers.template), so no product image
carries a test asset.

Only the plain script runs here. transformers' Trainer script (tests/own_code/hf_trainer.py)
needs transformers and accelerate, which no product image has: a test layer on the trainer
image would re-pull and re-push its 1.3 GB archive whenever the tree changes (the
trainer image's hash follows every change under kubetrain/), minutes of the 2 cores the
whole suite shares, and adds nothing the pod would show beyond what this script shows: the
entry, the restore, the sync and the endpoint are the same code. Under `kubetrain run`
tests/local/test_own_code.py shows the Trainer script with transformers' own
KubeflowCallback reporting, and its resume.

Each scenario reads as a user's story: apply the job, watch `kubectl get tj`, break
something, watch it recover, and read what rank 0 printed (`own-code step N loss L` per
step, `own-code resumed from step N`) and what S3 holds.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator
from typing import Any

import pytest
from whole_loop import (
    CREDENTIALS,
    NAMESPACE,
    OWN_CODE_SCRIPTS,
    OWN_CODE_SYNC_SECONDS,
    Cluster,
    add_own_code_scripts,
    own_code_job,
)
from whole_loop import own_code_resumes as resumed
from whole_loop import own_code_steps as trained

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def scripts(cluster: Cluster) -> Iterator[Cluster]:
    """The cluster, with the test script in the ConfigMap the jobs mount."""
    add_own_code_scripts(cluster)
    try:
        yield cluster
    finally:
        cluster.core.delete_namespaced_config_map(OWN_CODE_SCRIPTS, NAMESPACE)


@contextlib.contextmanager
def running(cluster: Cluster, manifest: dict[str, Any]) -> Iterator[str]:
    """Apply the job; delete it afterwards, even when a check failed (a leftover job's pods
    would crowd the next scenario's)."""
    name = manifest["metadata"]["name"]
    cluster.apply(manifest)
    try:
        yield name
    finally:
        cluster.delete(name)


def committed(cluster: Cluster, name: str) -> dict[str, int]:
    """The folders committed under the job's checkpoint.uri, with their steps."""
    from kubetrain.api.trainingjob import StorageSpec
    from kubetrain.trainer.checkpoint_sync import commits
    from kubetrain.trainer.storage import open_storage

    os.environ.update(CREDENTIALS)  # as the pods get them from s3-credentials
    store = open_storage(f"s3://checkpoints/{name}",
                         StorageSpec(endpoint=cluster.s3, region="us-east-1"))
    return {commit.folder: commit.step for commit in commits(store)}


def wait_for_trained(cluster: Cluster, name: str, step: int, timeout: float = 240) -> None:
    """Until rank 0 printed a trained step ≥ `step` (faster than the operator's status)."""
    cluster.wait_for(f"rank 0 of {name} to train step {step}",
                     lambda: max(trained(cluster.trainer_lines(name)), default=0) >= step,
                     timeout, every=0.1)


def test_plain_torch_script_succeeds_with_its_reported_progress_in_kubectl_get_tj(
        scripts: Cluster) -> None:
    cluster, steps, save_every = scripts, 40, 10
    with running(cluster, own_code_job("own-plain", cluster.s3, steps=steps,
                                       save_every=save_every, step_seconds=0.5)) as name:
        cluster.wait_for_phase(name, "Succeeded", timeout=300)
        rows = cluster.rows[name]
        job = cluster.job(name)
        lines = cluster.trainer_lines(name)
        shown = [row.step for row in rows if row.step is not None]
        losses = [row.loss for row in rows if row.loss is not None]
        print(f"kubectl get tj STEP column over the run: {sorted(set(shown))}; "
              f"status.progress {job['status'].get('progress')}")
        # sdk.report posts at most every 5 s: a 20 s run shows several steps.
        assert len(set(shown)) >= 3 and shown == sorted(shown), shown
        assert len(set(losses)) >= 2, losses
        assert any(row.phase == "Running" and row.workers == "2" for row in rows), rows
        # What the status shows is what the script trained and reported.
        progress = job["status"]["progress"]
        assert progress["step"] == progress["maxSteps"] == steps, progress
        assert trained(lines) == list(range(1, steps + 1))
        assert committed(cluster, name) == {"step-000030": 30, "step-000040": 40}  # keepLast 2
        assert job["status"].get("restarts", 0) == 0
        assert not [c for c in job["status"]["conditions"] if c["type"] == "Stalled"
                    and c["status"] == "True"]


def test_a_killed_worker_0_container_resumes_the_group_from_the_s3_checkpoint_it_wrote(
        scripts: Cluster) -> None:
    cluster, save_every, step_seconds = scripts, 5, 0.4
    with running(cluster, own_code_job("own-killed", cluster.s3, steps=50,
                                       save_every=save_every,
                                       step_seconds=step_seconds)) as name:
        wait_for_trained(cluster, name, 2 * save_every + 3)
        before = {pod["metadata"]["uid"] for pod in cluster.pods(name)}
        in_s3 = committed(cluster, name)
        at_kill = max(trained(cluster.trainer_lines(name)))
        # kill -9 of worker 0's container (torchrun and the code): the rendezvous host is
        # gone, so the operator recreates the whole group, and every new pod's entry
        # restores the newest commit from S3 before the script starts.
        cluster.kill_container(f"{name}-worker-0")
        cluster.wait_for_phase(name, "Succeeded", timeout=300)
        lines = cluster.trainer_lines(name)
        steps, resumes = trained(lines), resumed(lines)
        job = cluster.job(name)

    redone = len(steps) - len(set(steps))
    allowance = math.ceil(OWN_CODE_SYNC_SECONDS / step_seconds) + 1
    print(f"killed at step {at_kill} (S3 held {in_s3}); resumed from {resumes}; "
          f"{redone} steps redone (bound: {save_every} + {allowance} for one upload pass); "
          f"status.goodput {job['status'].get('goodput')}")
    assert in_s3, "no checkpoint was committed before the kill: kill later"
    assert len(resumes) == 1 and resumes[0] % save_every == 0, resumes
    # It resumed from what S3 held when the kill came (or a newer commit of a step trained
    # by then), and every step after it was trained again, once.
    assert max(in_s3.values()) <= resumes[0] <= at_kill, (in_s3, resumes, at_kill)
    restart = next(i for i in range(1, len(steps)) if steps[i] <= steps[i - 1])
    assert steps[restart] == resumes[0] + 1 and redone == steps[restart - 1] - resumes[0]
    assert sorted(set(steps)) == list(range(1, 51)), steps
    assert 0 <= redone <= save_every + allowance, (redone, steps)
    # The new worker 0's entry said what it restored (the first pod had nothing to restore).
    assert any(line.startswith("kubetrain: restored ") for line in lines), lines
    assert not before & {pod["metadata"]["uid"] for pod in cluster.pods(name)}
    assert job["status"]["restarts"] >= 1, job["status"]


def test_suspend_saves_on_sigterm_and_resume_redoes_no_step(scripts: Cluster) -> None:
    cluster, steps = scripts, 60
    with running(cluster, own_code_job("own-suspended", cluster.s3, steps=steps,
                                       save_every=1000, step_seconds=0.3)) as name:
        wait_for_trained(cluster, name, 8)
        cluster.patch_spec(name, {"runPolicy": {"suspend": True}})
        cluster.wait_for_phase(name, "Suspended", timeout=180)
        cluster.wait_for("the suspended job's pods to be gone", lambda: not cluster.pods(name),
                         180)
        before = cluster.trainer_lines(name)
        stopped = max(trained(before))
        in_s3 = committed(cluster, name)
        assert stopped < steps, "the job finished before it was suspended: lengthen it"
        cluster.patch_spec(name, {"runPolicy": {"suspend": False}})
        cluster.wait_for_phase(name, "Succeeded", timeout=300)
        lines = cluster.trainer_lines(name)

    print(f"suspended after step {stopped} (S3: {in_s3}); resumed from {resumed(lines)}")
    assert f"own-code stopped at step {stopped} on SIGTERM" in before
    # The only checkpoint is the one saved on SIGTERM (the interval is never reached).
    assert in_s3 == {f"step-{stopped:06d}": stopped}
    assert resumed(lines) == [stopped]
    assert trained(lines) == list(range(1, steps + 1)), "a step was trained twice or skipped"


def test_a_command_that_does_not_exist_fails_as_a_user_error_and_is_not_retried(
        scripts: Cluster) -> None:
    cluster = scripts
    manifest = own_code_job("own-missing", cluster.s3, steps=5, save_every=5, step_seconds=0,
                            script="no-such-train.py", replicas=1,
                            run_policy={"maxRestarts": 3})
    with running(cluster, manifest) as name:
        cluster.wait_for_phase(name, "Failed", timeout=240)
        job = cluster.job(name)
        pods = cluster.pods(name)
        log = cluster.trainer_lines(name)

    status = job["status"]
    failed = next(c for c in status["conditions"] if c["type"] == "Failed")
    print(f"status.lastFailure {status.get('lastFailure')}; Failed: {failed['message']}")
    assert status["lastFailure"]["class"] == "UserError", status["lastFailure"]
    assert status["lastFailure"]["exitCode"] == 127
    assert status.get("restarts", 0) == 0 and status["failures"] == {"UserError": 1}, status
    assert len(pods) <= 1, [pod["metadata"]["name"] for pod in pods]
    assert any("no-such-train.py: no such file or program" in line for line in log), log

