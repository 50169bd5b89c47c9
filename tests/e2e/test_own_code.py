"""Own code (spec.trainer) on the whole loop: a user's torchrun script under the operator.

The same cluster as tests/e2e/test_whole_loop.py (the session's `cluster` fixture: kmock's
emulator, the operator's pod from the chart, moto's S3, the node agent running the pods
as containers in containerd). The user's code is first tests/own_code/plain_torch.py:
FSDP2 on gloo, a torch DCP folder every `--save-every` steps that every rank marks
complete with kubetrain.sdk, progress through `sdk.report` to the operator's status
endpoint (TLS, the job's token from its `<job>-status` Secret), a save on SIGTERM; the
suspend scenario runs tests/own_code/ddp_from_the_docs.py, the DDP script a user writes from
docs/own-code.md alone (no barrier before its marks, processes that linger after the stop). Its
image is the trainer image built from this tree, which has torch and kubetrain's own-code
extra; the scripts reach the pods as a ConfigMap volume (spec.workers.template), so no
product image carries a test asset.

transformers' Trainer script (tests/own_code/hf_trainer.py) needs transformers and
accelerate, which no product image has. A test layer on the trainer image would re-import
its 1.3 GB archive into containerd whenever the tree changes (the trainer image's hash
follows every change under kubetrain/), minutes of the 2 cores the whole suite shares. So
the pods mount them instead, as a hostPath volume read-only on PYTHONPATH, the way a
kubelet mounts a node's folder: a folder the fixture fills from the test venv's installed
distributions, only those transformers and accelerate need beyond what the trainer image
installs (kubetrain's trainer and own-code extras: torch, tokenizers, safetensors,
huggingface-hub, ...). That works because the image and the venv are the same platform:
Debian 12's CPython 3.11 on glibc 2.36 (the venv's compiled wheels, regex and psutil, load
there, and its 3.11 bytecode is used as it is). Its one job shows the whole story in
sequence, to keep the suite short: a container kill, a suspend, then Succeeded, with the
progress that transformers' own KubeflowCallback posts in `kubectl get tj`.

Each scenario reads as a user's story: apply the job, watch `kubectl get tj`, break
something, watch it recover, and read what rank 0 printed (`own-code step N loss L` per
step, `own-code resumed from step N`) and what S3 holds.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import itertools
import math
import os
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from whole_loop import (
    NAMESPACE,
    OWN_CODE_SCRIPTS,
    OWN_CODE_SYNC_SECONDS,
    Cluster,
    add_own_code_scripts,
    own_code_job,
)
from whole_loop import own_code_commits as committed
from whole_loop import own_code_resumes as resumed
from whole_loop import own_code_steps as trained

from kubetrain.trainer.own_code import LINGER_SECONDS

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# Where the pods of the Trainer script find transformers and what it needs (PYTHONPATH).
PACKAGES_DIR = "/opt/own-code-packages"


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


def _distributions(roots: list[str], extras: tuple[str, ...] = ()) -> set[str]:
    """The installed distributions `roots` need, themselves included (normalised names),
    following requirements whose markers hold here, with `extras` of the roots."""
    from packaging.requirements import Requirement

    found: set[str] = set()
    todo = [(root, extras) for root in roots]
    while todo:
        name, wanted = todo.pop()
        name = re.sub(r"[-_.]+", "-", name).lower()
        if name in found:
            continue
        found.add(name)
        for text in importlib.metadata.distribution(name).requires or []:
            requirement = Requirement(text)
            marker = requirement.marker
            if marker is None or any(marker.evaluate({"extra": extra})
                                     for extra in ("", *wanted)):
                todo.append((requirement.name, tuple(requirement.extras)))
    return found


def transformers_packages(folder: Path) -> Path:
    """A folder with the distributions transformers' Trainer needs beyond what the trainer
    image installs (kubetrain's trainer and own-code extras), as this venv has them."""
    needed = (_distributions(["transformers", "accelerate"])
              - _distributions(["kubetrain"], ("trainer", "own-code")))
    folder.mkdir(mode=0o755)  # the pods' user reads it
    for name in sorted(needed):
        distribution = importlib.metadata.distribution(name)
        for file in distribution.files or []:
            source = Path(str(distribution.locate_file(file)))
            if file.parts[0] == ".." or not source.is_file():  # scripts under bin/: not needed
                continue
            target = folder / file
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)  # its mtime kept: the copied bytecode stays valid
    return folder


@pytest.fixture(scope="module")
def packages(scripts: Cluster) -> Path:
    """The node's folder that the Trainer script's pods mount read-only (hostPath)."""
    return transformers_packages(scripts.folder / "own-code-packages")


def trainer_script_job(name: str, s3: str, packages: Path, *, steps: int, save_every: int,
                       step_seconds: float) -> dict[str, Any]:
    """tests/own_code/hf_trainer.py as an own-code job, transformers mounted from `packages`."""
    manifest = own_code_job(name, s3, steps=steps, save_every=save_every,
                            step_seconds=step_seconds, script="hf_trainer.py")
    spec = manifest["spec"]
    spec["trainer"]["args"] = ["--steps", str(steps), "--save-every", str(save_every),
                               "--step-seconds", str(step_seconds)]
    spec["trainer"]["env"].append({"name": "PYTHONPATH", "value": PACKAGES_DIR})
    template = spec["workers"]["template"]
    template["volumes"].append({"name": "packages",
                                "hostPath": {"path": str(packages), "type": "Directory"}})
    template["volumeMounts"].append({"name": "packages", "mountPath": PACKAGES_DIR,
                                     "readOnly": True})
    return manifest


def wait_for_trained(cluster: Cluster, name: str, step: int, timeout: float = 240) -> None:
    """Until rank 0 printed a trained step ≥ `step` (faster than the operator's status)."""
    cluster.wait_for(f"rank 0 of {name} to train step {step}",
                     lambda: max(trained(cluster.trainer_lines(name)), default=0) >= step,
                     timeout, every=0.1)


def test_plain_torch_script_shows_its_progress_and_resumes_from_s3_after_worker_0s_kill(
        scripts: Cluster) -> None:
    """The plain script's story: its reported progress in `kubectl get tj`, then a kill of
    worker 0's container, from which the group resumes with the newest commit in S3, and
    Succeeded with every step trained and the last two commits kept."""
    # 30 steps: the kill comes after step 13, and the resumed group trains 17-20 more.
    cluster, steps_in_all, save_every, step_seconds = scripts, 30, 5, 0.4
    with running(cluster, own_code_job("own-killed", cluster.s3, steps=steps_in_all,
                                       save_every=save_every,
                                       step_seconds=step_seconds)) as name:
        # Each wait reads `kubectl get tj` too, as a user watching it (cluster.rows).
        cluster.wait_for(f"rank 0 of {name} to train step {2 * save_every + 3}", lambda: (
            cluster.get_tj(name) and max(trained(cluster.trainer_lines(name)), default=0)
            >= 2 * save_every + 3), 240, every=0.1)
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
        rows = cluster.rows[name]

    redone = len(steps) - len(set(steps))
    allowance = math.ceil(OWN_CODE_SYNC_SECONDS / step_seconds) + 1
    shown = [row.step for row in rows if row.step is not None]
    losses = [row.loss for row in rows if row.loss is not None]
    print(f"kubectl get tj STEP column over the run: {sorted(set(shown))}; "
          f"killed at step {at_kill} (S3 held {in_s3}); resumed from {resumes}; "
          f"{redone} steps redone (bound: {save_every} + {allowance} for one upload pass); "
          f"status.progress {job['status'].get('progress')}; "
          f"status.goodput {job['status'].get('goodput')}")
    # What sdk.report posted (at most every 5 s) is what `kubectl get tj` showed: several
    # steps, in order but for the one step back to where the resumed group started.
    assert len(set(shown)) >= 3, shown
    assert sum(later < earlier for earlier, later in itertools.pairwise(shown)) <= 1, shown
    assert len(set(losses)) >= 2, losses
    assert any(row.phase == "Running" and row.workers == "2" for row in rows), rows
    progress = job["status"]["progress"]
    assert progress["step"] == progress["maxSteps"] == steps_in_all, progress
    # keepLast 2 at the end.
    assert committed(cluster, name) == {"step-000025": 25, "step-000030": 30}

    assert in_s3, "no checkpoint was committed before the kill: kill later"
    assert len(resumes) == 1 and resumes[0] % save_every == 0, resumes
    # It resumed from what S3 held when the kill came (or a newer commit of a step trained
    # by then), and every step after it was trained again, once.
    assert max(in_s3.values()) <= resumes[0] <= at_kill, (in_s3, resumes, at_kill)
    restart = next(i for i in range(1, len(steps)) if steps[i] <= steps[i - 1])
    assert steps[restart] == resumes[0] + 1 and redone == steps[restart - 1] - resumes[0]
    assert sorted(set(steps)) == list(range(1, steps_in_all + 1)), steps
    assert 0 <= redone <= save_every + allowance, (redone, steps)
    # The new worker 0's entry said what it restored (the first pod had nothing to restore).
    assert any(line.startswith("kubetrain: restored ") for line in lines), lines
    assert not before & {pod["metadata"]["uid"] for pod in cluster.pods(name)}
    assert job["status"]["restarts"] >= 1, job["status"]


# `KUBETRAIN_SUSPEND_RUNS=10 pytest -k suspend tests/e2e/test_own_code.py` runs the suspend
# scenario ten times in a row (issue 51's proof); the suite runs it once.
SUSPEND_RUNS = int(os.environ.get("KUBETRAIN_SUSPEND_RUNS", "1"))


@pytest.mark.parametrize("run", range(SUSPEND_RUNS))
def test_suspend_lets_go_of_the_pods_at_once_commits_the_stop_step_and_redoes_none(
        scripts: Cluster, run: int) -> None:
    """The DDP script a user writes from docs/own-code.md alone (2 workers x 2 processes,
    each rank marking its sharded save as soon as its dcp.save returned, no barrier), whose
    processes take minutes to end after their stop checkpoint, as one whose teardown hangs:
    a suspend commits the stop step and lets go of the pods within the stop's save, its
    upload and LINGER_SECONDS, not after torchrun's 200 s shutdown timeout; the resume
    redoes no step."""
    # 36 steps of 0.3 s: the suspend is asked at step 8 and lands within a few steps.
    cluster, steps = scripts, 36
    manifest = own_code_job(f"own-suspended-{run}", cluster.s3, steps=steps, save_every=1000,
                            step_seconds=0.3, script="ddp_from_the_docs.py",
                            procs_per_worker=2)
    manifest["spec"]["trainer"]["args"] += ["--linger-after-stop", "600"]
    with running(cluster, manifest) as name:
        wait_for_trained(cluster, name, 8)
        asked = time.monotonic()
        cluster.patch_spec(name, {"runPolicy": {"suspend": True}})
        cluster.wait_for("the suspended job's pods to be gone", lambda: not cluster.pods(name),
                         300)
        released = time.monotonic() - asked
        cluster.wait_for_phase(name, "Suspended", timeout=60)
        before = cluster.trainer_lines(name)
        stopped = max(trained(before))
        in_s3 = committed(cluster, name)
        assert stopped < steps, "the job finished before it was suspended: lengthen it"
        cluster.patch_spec(name, {"runPolicy": {"suspend": False}})
        cluster.wait_for_phase(name, "Succeeded", timeout=300)
        lines = cluster.trainer_lines(name)
        job = cluster.job(name)

    print(f"suspended after step {stopped}, pods gone {released:.1f} s after the suspend "
          f"(S3: {in_s3}); resumed from {resumed(lines)}")
    assert f"own-code stopped at step {stopped} on SIGTERM" in before
    # Each process was ended once it had lingered LINGER_SECONDS after its stop mark;
    # the rest is a step, the save, the upload and the pod's teardown, with slack for a
    # loaded machine. Without that the pods stayed until torchrun's 200 s timeout.
    assert released < LINGER_SECONDS + 30, f"the pods were held {released:.0f} s"
    assert any("marked its stop checkpoint" in line for line in before), before
    # The only checkpoint is the one saved on SIGTERM (the interval is never reached).
    assert in_s3 == {f"step-{stopped:06d}": stopped}
    assert resumed(lines) == [stopped]
    assert trained(lines) == list(range(1, steps + 1)), "a step was trained twice or skipped"
    # A suspend is no failure: no restart counted, no condition says it stalled.
    assert job["status"].get("restarts", 0) == 0, job["status"]
    assert not [c for c in job["status"]["conditions"] if c["type"] == "Stalled"
                and c["status"] == "True"]


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



def test_transformers_trainer_resumes_after_a_kill_and_a_suspend_and_shows_kubeflow_progress(
        scripts: Cluster, packages: Path) -> None:
    # A save every 10 steps of 0.5 s or more: the upload of one (2-3 s here) is in S3
    # well before the next.
    cluster, steps, save_every, step_seconds = scripts, 40, 10, 0.5
    started = time.monotonic()
    with running(cluster, trainer_script_job("own-hf", cluster.s3, packages, steps=steps,
                                             save_every=save_every,
                                             step_seconds=step_seconds)) as name:
        # 1. kill -9 of worker 0's container mid-run, once the save of step 20 is in S3:
        # the group comes back from it.
        # Each wait also reads `kubectl get tj`, as a user watching it (cluster.rows).
        in_s3_at_kill = cluster.wait_for(
            f"the checkpoint of step {2 * save_every} in S3", lambda: (
                cluster.get_tj(name) and (found := committed(cluster, name))
                and max(found.values()) >= 2 * save_every and found), 300, every=0.2)
        at_kill = max(trained(cluster.trainer_lines(name)))
        cluster.kill_container(f"{name}-worker-0")
        cluster.wait_for(f"{name} to resume and train past step {at_kill + 2}", lambda: (
            cluster.get_tj(name) and resumed(lines := cluster.trainer_lines(name))
            and max(trained(lines)[-1:], default=0) > at_kill + 2), 300, every=0.2)
        # 2. suspend: every rank saves on SIGTERM at the same step, the pods go.
        cluster.patch_spec(name, {"runPolicy": {"suspend": True}})
        cluster.wait_for_phase(name, "Suspended", timeout=180)
        cluster.wait_for("the suspended job's pods to be gone", lambda: not cluster.pods(name),
                         180)
        stopped = trained(cluster.trainer_lines(name))[-1]
        in_s3_suspended = committed(cluster, name)
        assert stopped < steps, "the job finished before it was suspended: lengthen it"
        # 3. resume, to the end.
        cluster.patch_spec(name, {"runPolicy": {"suspend": False}})
        cluster.wait_for_phase(name, "Succeeded", timeout=300)
        lines = cluster.trainer_lines(name)
        job = cluster.job(name)
        rows = cluster.rows[name]
    took = time.monotonic() - started

    done, resumes = trained(lines), resumed(lines)
    restart = next(i for i in range(1, len(done)) if done[i] <= done[i - 1])
    redone = done[restart - 1] - (resumes or [0])[0]
    shown = sorted({row.step for row in rows if row.step is not None})
    losses = {row.loss for row in rows if row.loss is not None}
    print(f"Trainer script: killed at step {at_kill} (S3 {in_s3_at_kill}), suspended at step "
          f"{stopped} (S3 {in_s3_suspended}); resumed from {resumes}, {redone} steps redone "
          f"after the kill; STEP column {shown}; "
          f"status.progress {job['status'].get('progress')}; {took:.0f} s from apply to "
          "Succeeded")
    # Progress came through transformers' own KubeflowCallback: the steps it posted (at
    # most one per 5 s) are what `kubectl get tj` showed, with the logged loss, through
    # the resumed run, and its end-of-training post (progress 100 %, no `current_step`)
    # finished STEP at maxSteps and set the ETA to 0.
    assert len(shown) >= 2 and len(losses) >= 2, (shown, losses)
    assert min(shown) <= at_kill, shown  # before the kill too
    progress = job["status"]["progress"]
    assert progress["maxSteps"] == steps and progress["etaSeconds"] == 0, progress
    assert progress["step"] == steps, (progress, stopped)
    assert sorted(set(done)) == list(range(1, steps + 1)), done
    # The kill: resumed from the newest commit S3 held (or one newer, trained by then), and
    # redid at most the checkpoint interval.
    assert in_s3_at_kill, "no checkpoint was committed before the kill: kill later"
    assert len(resumes) == 2 and resumes[0] % save_every == 0, resumes
    assert max(in_s3_at_kill.values()) <= resumes[0] <= at_kill, (in_s3_at_kill, resumes)
    assert done[restart] == resumes[0] + 1 and 0 <= redone <= save_every, (redone, done)
    # The suspend: the checkpoint saved on SIGTERM is the step rank 0 last trained, the
    # resumed run starts right after it, and no step is trained twice after the kill's.
    assert max(in_s3_suspended.values()) == stopped, (in_s3_suspended, stopped)
    assert in_s3_suspended.get(f"checkpoint-{stopped}") == stopped, in_s3_suspended
    assert resumes[1] == stopped, (resumes, stopped)
    assert done[restart:] == list(range(resumes[0] + 1, steps + 1)), done
    assert job["status"]["restarts"] >= 1, job["status"]
