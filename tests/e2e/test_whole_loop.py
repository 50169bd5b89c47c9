"""The whole loop on one machine: a TrainingJob → operator → pods → torchrun → trainer → S3.

The harness is tests/cluster/whole_loop.py; the `cluster` fixture (tests/e2e/conftest.py)
starts it once per session. The API server is kmock's emulator (tests/cluster/emulator.py)
with the stand-in scheduler and node lifecycle controller (tests/cluster/controllers.py);
everything else is the real part: the operator's pod, made from the chart's Deployment and run from
the operator image (tests/cluster/operator_process.py: OperatorPod);
moto's S3 server over HTTP, bound on the pod network's gateway so the pods reach it;
data prepared with `kubetrain prepare` into it; and the node agent
(tests/cluster/node_agent.py), which runs the pods bound to its two nodes as containers
of the images the project builds (images/offline), in Debian's containerd and runc:
torchrun as PID 1, the trainer as uid 1000, memory limits as cgroup limits, each pod on
a CNI bridge with its own IP, names from cluster DNS.

Each scenario reads as a user's story: apply a TrainingJob, watch its `kubectl get tj`
columns (computed from the CRD's printer columns, as the API server prints them),
break something, watch it recover, check the outcome in S3. The training is tiny (the
`tiny` preset, 64-token sequences, tens of steps, one process per worker and one CPU
thread each) so that the scenarios fit CI's 2 cores. The node agent needs root
(containers, network namespaces).

Scenario b kills worker 1 twice in one run. First its trainer alone (kill -9): the
design's first line of recovery, torchrun (PET_MAX_RESTARTS) restarts both pods'
trainers in place and no pod fails. Then the whole container (trainer and torchrun,
as an OOM kill or a crash of the runtime does): the pod fails, the operator replaces
it under the same name, and both workers resume again. A hang past
progressDeadlineSeconds and then a lost node, in one job, show the other ways a group
is recreated.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from whole_loop import (
    EVERY,
    MAX_STEPS,
    NAMESPACE,
    Cluster,
    Row,
    cluster_storage,
    out_of_memory_job,
    s3_credentials,
    training_job,
)

# The harness's readers of rank 0's log under the names the scenarios use.
from whole_loop import advanced_after_resume as _advanced_after_resume
from whole_loop import cell as _cell
from whole_loop import printer_columns as _printer_columns
from whole_loop import resumes as _resumes
from whole_loop import steps_printed as _steps_printed

_wait_for_printed_step = Cluster.wait_for_printed_step

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _export(cluster: Cluster, name: str) -> Path:
    """Download `<checkpoint uri>/export` into a local folder."""
    store = cluster_storage(cluster, f"s3://checkpoints/{name}/export")
    target = cluster.folder / "exports" / name
    target.mkdir(parents=True, exist_ok=True)
    for found in store.list(""):
        store.download_file(found.key, target / found.key)
    return target


@dataclass
class Run:
    """What one job showed: `kubectl get tj` rows, its final object, rank 0's log lines."""

    name: str
    rows: list[Row]
    job: dict[str, Any]
    lines: list[str]
    export: Path


@pytest.fixture(scope="module")
def uninterrupted(cluster: Cluster) -> Run:
    """Scenario a's run, also the reference the recovering runs must end equal to."""
    name = "uninterrupted"
    cluster.apply(training_job(name, cluster.s3))
    cluster.wait_for_phase(name, "Succeeded", timeout=300)
    run = Run(name, cluster.rows[name], cluster.job(name), cluster.trainer_lines(name),
              _export(cluster, name))
    return run


def test_two_workers_train_to_succeeded_with_progress_checkpoint_and_export(
        cluster: Cluster, uninterrupted: Run) -> None:
    import torch
    import transformers

    from kubetrain.api.trainingjob import StorageSpec
    from kubetrain.trainer.checkpoint import committed_checkpoints

    rows = uninterrupted.rows
    steps = [row.step for row in rows if row.step is not None]
    losses = [row.loss for row in rows if row.loss is not None]
    assert len(set(steps)) >= 3 and steps == sorted(steps), \
        f"kubectl get tj did not show the step advancing: {steps}"
    assert len(set(losses)) >= 3, f"kubectl get tj did not show the loss changing: {losses}"
    assert any(row.phase == "Running" and row.workers == "2" for row in rows), rows

    assert f"finished at step {MAX_STEPS}: max_steps" in uninterrupted.lines
    # The last step and checkpoint come after the last scrape: the status has them from
    # rank 0's termination message.
    status = uninterrupted.job["status"]
    assert status["phase"] == "Succeeded"
    assert status["progress"]["step"] == status["progress"]["maxSteps"] == MAX_STEPS
    latest = status["latestCheckpoint"]
    with s3_credentials():
        committed = committed_checkpoints(f"s3://checkpoints/{uninterrupted.name}",
                                          StorageSpec(endpoint=cluster.s3, region="us-east-1"))
    assert latest["uri"] == f"s3://checkpoints/{uninterrupted.name}"
    assert latest["step"] == committed[0].step == MAX_STEPS, (latest, committed)
    # No fault, no alarm, over the whole run: a condition that never held is absent, and
    # no rank was ever reported slow nor any node avoided.
    assert not [c for c in status["conditions"] if c["type"] in ("Straggler", "NodesAvoided")]
    assert not status.get("avoidedNodes"), status
    events = json.loads(cluster.events(uninterrupted.name))
    assert not [e for e in events if e["reason"] in ("Straggler", "NodeAvoided")], events

    model = transformers.AutoModelForCausalLM.from_pretrained(uninterrupted.export,
                                                              dtype=torch.float32)
    tokens = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
    with torch.no_grad():
        logits = model(tokens).logits
    assert logits.shape[-1] == model.config.vocab_size and torch.isfinite(logits).all()
    cluster.delete(uninterrupted.name)


def _weights(export: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(export / "model.safetensors")


def test_killed_worker_resumes_from_latest_checkpoint_and_ends_as_uninterrupted_run(
        cluster: Cluster, uninterrupted: Run) -> None:
    import torch

    name = "killed"
    worker = f"{name}-worker-1"
    cluster.apply(training_job(name, cluster.s3))
    _wait_for_printed_step(cluster, name, EVERY + 2)
    pods = {pod["metadata"]["name"]: pod["metadata"]["uid"] for pod in cluster.pods(name)}

    # 1. kill -9 of worker 1's trainer: torchrun restarts both trainers in place.
    os.kill(cluster.trainer_pid(worker), signal.SIGKILL)
    in_place = time.monotonic()
    cluster.wait_for("training to advance again after the trainer's kill",
                     lambda: _advanced_after_resume(cluster.trainer_lines(name)), 120, every=0.2)
    in_place = time.monotonic() - in_place
    assert {pod["metadata"]["name"]: pod["metadata"]["uid"] for pod in cluster.pods(name)} == pods

    # 2. kill -9 of worker 1's whole container (trainer and torchrun): the pod fails and
    # the operator replaces it; worker 0's torchrun waits in the rendezvous for it.
    resumed_at = _resumes(cluster.trainer_lines(name))[0][0]
    _wait_for_printed_step(cluster, name, resumed_at + EVERY + 2)
    for pid in cluster.agent.pod(worker, NAMESPACE).processes():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    replaced = time.monotonic()
    cluster.wait_for("the failed pod to be replaced and training to advance again",
                     lambda: _advanced_after_resume(cluster.trainer_lines(name), resumes=2),
                     180, every=0.2)
    replaced = time.monotonic() - replaced
    now = {pod["metadata"]["name"]: pod["metadata"]["uid"] for pod in cluster.pods(name)}
    assert now[worker] != pods[worker], "the failed pod was not replaced"
    assert now[f"{name}-worker-0"] == pods[f"{name}-worker-0"], "only the failed pod is replaced"
    failed = cluster.events(name)
    cluster.wait_for_phase(name, "Succeeded", timeout=300)

    resumes = _resumes(cluster.trainer_lines(name))
    print(f"kill -9 of rank 1's trainer: training advanced again after {in_place:.1f}s "
          f"(restarted in place); kill -9 of its container: pod replaced and training "
          f"advanced again after {replaced:.1f}s; (resumed from, redone): {resumes}")
    assert len(resumes) == 2
    for step, redone in resumes:
        assert step % EVERY == 0 and step > 0
        assert 0 <= redone <= EVERY
    job = cluster.job(name)
    assert job["status"]["restarts"] >= 1, job["status"]
    assert "WorkerFailed" in failed and "137" in failed, failed
    # What the kills cost shows in status: time between the attempts, and goodput below 1.
    goodput = job["status"]["goodput"]
    print(f"status.goodput: {goodput}")
    assert goodput["badputSeconds"]["downtime"] > 0 and 0 < goodput["ratio"] < 1

    ours, reference = _weights(_export(cluster, name)), _weights(uninterrupted.export)
    assert ours.keys() == reference.keys()
    differences = {key: (ours[key] - reference[key]).abs().max().item() for key in ours}
    print(f"largest weight difference from the uninterrupted run: {max(differences.values())}")
    for key in ours:
        torch.testing.assert_close(ours[key], reference[key], rtol=0, atol=1e-6)
    cluster.delete(name)


def test_kubetrain_logs_follows_worker_0_through_a_container_kill_to_the_end(
        cluster: Cluster) -> None:
    name = "logs"
    worker = f"{name}-worker-0"
    cluster.apply(training_job(name, cluster.s3, optimization={"maxSteps": 40}))
    # The follower starts as soon as worker 0 trains, its start beside the steps up to the
    # checkpoint the kill needs: on loaded cores its start took as long as the job's
    # remaining steps, and the job had ended before the kill.
    _wait_for_printed_step(cluster, name, 1)
    output = cluster.folder / f"{name}.log"
    follower = cluster.kubetrain_logs(name, "--worker", "0", "--follow", output=output)
    cluster.wait_for("kubetrain logs to print worker 0's first lines",
                     lambda: output.read_text().count("\n") >= 3, 60, every=0.2)
    _wait_for_printed_step(cluster, name, EVERY + 2)
    # kill -9 of worker 0's container (torchrun and the trainer): the rendezvous host is
    # gone, so the operator recreates the whole group in a new restart attempt.
    cluster.kill_container(worker)
    cluster.wait_for_phase(name, "Succeeded", timeout=300)
    try:
        follower.wait(timeout=60)
    except subprocess.TimeoutExpired:
        follower.kill()
        raise AssertionError(f"kubetrain logs --follow did not end with the job\n"
                             f"{output.with_suffix('.err').read_text()}\n{cluster.report()}"
                             ) from None
    out, err = output.read_text(), output.with_suffix(".err").read_text()
    assert follower.returncode == 0, err
    marked = [re.fullmatch(rf"\[{worker} attempt (\d+)\] (.*)", line)
              for line in out.splitlines()]
    assert all(marked), out
    attempts = [int(match.group(1)) for match in marked if match]
    texts = [match.group(2) for match in marked if match]
    print(f"kubetrain logs --follow: {len(texts)} lines of attempts {sorted(set(attempts))}")
    # Every line worker 0 wrote, in both of its pods, once each and in order, marked with
    # the attempt of the pod it came from.
    assert texts == cluster.trainer_lines(name)
    assert attempts == sorted(attempts) and attempts[0] == 0 and attempts[-1] >= 1
    after = [text for attempt, text in zip(attempts, texts, strict=True) if attempt >= 1]
    assert any(text.startswith("resumed from ") for text in after), after
    assert "finished at step 40: max_steps" in after
    cluster.delete(name)


def test_suspend_checkpoints_and_resumes_from_that_step_and_an_operator_restart_recreates_no_pod(
        cluster: Cluster) -> None:
    """One job for two stories that both need a running one: a suspend (the pods stop with a
    checkpoint of their last step, and the resume continues from it), then the operator
    killed and started again mid-run (it adopts the running pods: none recreated, no
    restart, status converges)."""
    name = "suspended"
    steps = 160  # the operator's restart comes after the resume, with ~140 steps to go
    cluster.apply(training_job(name, cluster.s3, optimization={"maxSteps": steps},
                               checkpoint={"everySteps": 1000}))
    _wait_for_printed_step(cluster, name, 10)
    cluster.patch_spec(name, {"runPolicy": {"suspend": True}})
    cluster.wait_for_phase(name, "Suspended", timeout=120)
    cluster.wait_for("the suspended job's pods to be gone", lambda: not cluster.pods(name), 120)
    before = cluster.trainer_lines(name)
    last = max(_steps_printed(before))
    assert last < steps, "the job finished before it was suspended: lengthen it"

    cluster.patch_spec(name, {"runPolicy": {"suspend": False}})
    cluster.wait_for_step(name, last + 1)
    lines = cluster.trainer_lines(name)[len(before):]
    resumed = next(line for line in lines if line.startswith("resumed from "))
    print(f"suspended after step {last}; {resumed}")
    assert f"at step {last} " in resumed + " ", (last, resumed)

    # The operator killed and started again while the resumed pods train.
    pods = {pod["metadata"]["name"]: pod["metadata"]["uid"] for pod in cluster.pods(name)}
    cluster.operator.kill()
    killed_at_step = max(_steps_printed(cluster.trainer_lines(name)))
    cluster.operator.start()
    after = cluster.wait_for_step(name, killed_at_step + 1, timeout=120)
    print(f"operator killed at step {killed_at_step}; the new one reported step {after.step}")
    assert {pod["metadata"]["name"]: pod["metadata"]["uid"] for pod in cluster.pods(name)} == pods
    cluster.wait_for_phase(name, "Succeeded", timeout=300)

    job = cluster.job(name)
    # Once worker 0 is done the job's other pods are stopped; none was ever replaced, and
    # neither the suspend nor the operator's restart counts as a restart.
    assert {pod["metadata"]["uid"] for pod in cluster.pods(name)} <= set(pods.values())
    assert job["status"].get("restarts", 0) == 0, job["status"]
    lines = cluster.trainer_lines(name)[len(before):]
    assert [line for line in lines if line.startswith("resumed from ")] == [resumed]
    assert f"finished at step {steps}: max_steps" in lines
    cluster.delete(name)


def _wait_for_workers(cluster: Cluster, name: str, count: int, after: int) -> None:
    """Until rank 0 printed "resumed ... with `count` processes" and a step after it."""

    def resumed() -> bool:
        lines = cluster.trainer_lines(name)[after:]
        marks = [i for i, line in enumerate(lines)
                 if line.startswith("resumed from ") and line.endswith(f"with {count} processes")]
        return bool(marks) and bool(_steps_printed(lines[marks[-1]:]))

    cluster.wait_for(f"{name} to train on {count} workers", resumed, 180, every=0.2)


def test_scale_down_and_up_checkpoint_on_sigterm_and_redo_no_step(cluster: Cluster) -> None:
    name = "scaled"
    steps = 200
    # Below maxReplicas, torchrun's rendezvous waits its last call (30 s) for more nodes
    # before it closes each round; the documented knob (docs/troubleshooting.md) makes
    # that 2 s here.
    last_call = {"name": "PET_RDZV_CONF", "value": "last_call_timeout=2"}
    cluster.apply(training_job(name, cluster.s3, optimization={"maxSteps": steps},
                               workers={"replicas": 2, "minReplicas": 1, "maxReplicas": 2,
                                        "template": {"env": [last_call]}},
                               checkpoint={"everySteps": 1000}))
    _wait_for_printed_step(cluster, name, 10)
    cluster.scale(name, 1)
    _wait_for_workers(cluster, name, 1, after=0)
    cluster.wait_for("one worker pod", lambda: len(cluster.pods(name)) == 1, 60)
    mark = len(cluster.trainer_lines(name))
    cluster.scale(name, 2)
    _wait_for_workers(cluster, name, 2, after=mark)
    cluster.wait_for_phase(name, "Succeeded", timeout=300)

    lines = cluster.trainer_lines(name)
    resumes = [line for line in lines if line.startswith("resumed from ")]
    printed = _steps_printed(lines)
    print("\n".join(resumes))
    assert len(resumes) == 2, resumes
    # Every step done once: each change resumed from the step just finished.
    assert printed == list(range(1, steps + 1)), printed
    cluster.delete(name)


def test_a_hung_rank_then_a_lost_node_each_get_the_group_recreated_and_the_job_succeeds(
        cluster: Cluster) -> None:
    """Two ways a group is recreated in new pods, one after the other in one job: a rank
    that hangs past progressDeadlineSeconds, then the loss of worker 0's node."""
    name = "hung-then-node-loss"
    # A short progress deadline, and a start of its own: a healthy group's start on a loaded
    # 2-core machine outlasted a 10 s deadline that counted it (a CI run of 2026-11-26, two
    # xdist workers: before the first step, then after every restart, until maxRestarts).
    cluster.apply(training_job(name, cluster.s3, optimization={"maxSteps": 60},
                               runPolicy={"progressDeadlineSeconds": 12,
                                          "startupDeadlineSeconds": 120}))
    _wait_for_printed_step(cluster, name, EVERY + 2)

    # 1. SIGSTOP of rank 1's trainer: no step advances, and at the deadline the operator
    # recreates the group.
    before = {pod["metadata"]["uid"] for pod in cluster.pods(name)}
    hung = cluster.trainer_pid(f"{name}-worker-1")
    os.kill(hung, signal.SIGSTOP)
    stopped = time.monotonic()
    cluster.wait_for("training to advance again in new pods",
                     lambda: _advanced_after_resume(cluster.trainer_lines(name)), 240, every=0.5)
    print(f"SIGSTOP of rank 1: training advanced again after {time.monotonic() - stopped:.0f}s")
    assert "ProgressDeadlineExceeded" in cluster.events(name)
    assert cluster.job(name)["status"]["restarts"] >= 1
    assert not before & {pod["metadata"]["uid"] for pod in cluster.pods(name)}
    assert not Path(f"/proc/{hung}").exists(), "the stopped trainer outlived its pod"

    # 2. Worker 0's node is lost: the pod that hosts the rendezvous, so the group cannot
    # re-form around it and the operator recreates the whole group on the node left.
    resumed_at = _resumes(cluster.trainer_lines(name))[0][0]
    _wait_for_printed_step(cluster, name, resumed_at + EVERY + 2)
    worker = next(pod for pod in cluster.pods(name) if pod["metadata"]["name"].endswith("-0"))
    node = worker["spec"]["nodeName"]
    before = {pod["metadata"]["uid"] for pod in cluster.pods(name)}
    try:
        assert cluster.agent.lose_node(node) == [worker["metadata"]["name"]]
        lost = time.monotonic()
        cluster.wait_for(
            f"{node} to be marked not ready",
            lambda: (cluster.core.read_node(node).spec or client.V1NodeSpec()).taints, 60)
        cluster.wait_for("training to advance again",
                         lambda: _advanced_after_resume(cluster.trainer_lines(name), resumes=2),
                         240, every=0.5)
        print(f"node {node} lost: training advanced again after {time.monotonic() - lost:.0f}s")
        replaced = cluster.pods(name)
        cluster.wait_for_phase(name, "Succeeded", timeout=300)
    finally:
        cluster.agent.restore_node(node)

    # The whole group was recreated, on the node left.
    assert len(replaced) == 2 and not before & {pod["metadata"]["uid"] for pod in replaced}
    assert all(pod["spec"]["nodeName"] != node for pod in replaced)
    events = cluster.events(name)
    assert "NodeLost" in events, events
    step, redone = _resumes(cluster.trainer_lines(name))[-1]  # the node loss's
    assert 0 <= redone <= EVERY, (step, redone)
    cluster.delete(name)


def test_a_worker_over_its_memory_limit_is_oom_killed_healed_with_half_the_micro_batch_and_succeeds(
        cluster: Cluster) -> None:
    name = "oom-heal"
    # The container's 1100 MiB fits 8 sequences, not 16 (out_of_memory_job says why).
    manifest = out_of_memory_job(name, cluster.s3, micro_batch=16, max_steps=6)
    cluster.apply(manifest)
    oom_at = cluster.wait_for(
        "the first worker failure", lambda: (cluster.job(name).get("status") or {}).get(
            "lastFailure") and time.monotonic(), 240)
    cluster.wait_for("training again", lambda: _trained_after_oom(cluster.trainer_lines(name)),
                     240, every=0.5)
    print(f"training again {time.monotonic() - oom_at:.1f}s after the OOM kill was seen")
    cluster.wait_for_phase(name, "Succeeded", timeout=300)

    job = cluster.job(name)
    status = job["status"]
    events = cluster.events(name)
    # Each halving's event names its new size; the sizes only ever shrink.
    halvings = {int(size) for size in re.findall(r"restarts with micro-batch (\d+)", events)}
    history = [16, *sorted(halvings, reverse=True)]
    print(f"micro-batch history {history}; status.effective {status['effective']}; "
          f"status.failures {status['failures']}")
    assert status["lastFailure"]["class"] == "OOMKilled", status["lastFailure"]
    assert status["lastFailure"]["pod"] == f"{name}-worker-0"
    assert status["failures"]["OOMKilled"] == len(history) - 1 >= 1
    assert status["effective"]["microBatchSize"] == history[-1] < 16
    # The global batch is the spec's: 4096 tokens = micro-batch x 256 tokens x accumulation.
    assert history[-1] * 256 * status["effective"]["gradientAccumulationSteps"] == 4096
    assert status.get("restarts", 0) == 0, "out-of-memory restarts spend no maxRestarts"
    assert job["spec"]["optimization"]["microBatchSize"] == 16, "the spec is never written"
    wide = {column: _cell(job, path) for column, path in _printer_columns().items()}
    assert (wide["Micro-batch"], wide["Last-failure"]) == (history[-1], "OOMKilled")
    assert "WorkerFailure" in events and "MicroBatchHalved" in events, events
    cluster.delete(name)


def _trained_after_oom(lines: list[str]) -> bool:
    """Whether worker 0 logged a training step in an attempt after its first one."""
    starts = [i for i, line in enumerate(lines) if line.startswith("training from step")]
    return len(starts) > 1 and any(re.match(r"step \d+/", line) for line in lines[starts[-1]:])


def test_a_worker_that_fits_no_micro_batch_fails_the_job_with_reason_out_of_memory(
        cluster: Cluster) -> None:
    name = "oom"
    # 160 MiB: less than torchrun needs once it has imported torch, so the kernel's OOM
    # killer ends the container's main process at any micro-batch: 4, 2, 1, then the job
    # fails, saying so and what to do.
    cluster.apply(training_job(name, cluster.s3,
                               workers={"replicas": 1, "minReplicas": 1, "maxReplicas": 1,
                                        "resources": {"limits": {"memory": "160Mi"}}},
                               runPolicy={"maxRestarts": 0}))
    cluster.wait_for_phase(name, "Failed", timeout=240)

    job = cluster.job(name)
    events = cluster.events(name)
    failed = next(c for c in job["status"]["conditions"] if c["type"] == "Failed")
    print(f"status.lastFailure: {job['status'].get('lastFailure')}; {failed['message']}")
    assert failed["reason"] == "OutOfMemory"
    assert "oom-worker-0 exited with code 137 (OOMKilled)" in failed["message"]
    assert "kubetrain estimate" in failed["message"]
    assert job["status"]["lastFailure"]["class"] == "OOMKilled"
    assert job["status"]["failures"] == {"OOMKilled": 3}  # at micro-batch 4, 2 and 1
    assert "OutOfMemory" in events and "MicroBatchHalved" in events, events
    cluster.delete(name)


# A DataLoader whose two workers each hand over 96 MiB tensors: they pass through shared
# memory, more than the 64 MiB a container's /dev/shm has by default. A worker that
# cannot write its batch there fails in a background thread, so the loader waits at most
# 10 s for it (a batch takes well under a second, even on a loaded machine) and then raises.
BIG_BATCHES = """
import torch
from torch.utils.data import DataLoader, Dataset

class Big(Dataset):
    def __len__(self):
        return 4
    def __getitem__(self, index):
        return torch.full((24 << 20,), float(index))

for batch in DataLoader(Big(), batch_size=None, num_workers=2, timeout=10):
    assert batch.numel() == 24 << 20
print("all batches arrived")
"""


def test_dataloader_workers_share_more_than_64_mib_through_our_dev_shm_and_fail_without_it(
        cluster: Cluster) -> None:
    name = "shm"
    # A job only for the pod the operator makes (one worker is enough), which runs while
    # the two pods below use its ConfigMap.
    cluster.apply(training_job(name, cluster.s3,
                               workers={"replicas": 1, "minReplicas": 1, "maxReplicas": 1}))
    pods = cluster.wait_for("the operator's worker pods", lambda: cluster.pods(name), 60)
    # The operator's worker pod, as it made it, running the loader instead of torchrun;
    # and the same without the operator's /dev/shm volume, as a hand-written pod has it.
    spec = pods[0]["spec"]
    for key in ("nodeName", "hostname", "subdomain"):
        spec.pop(key, None)
    container = spec["containers"][0]
    container["command"], container["args"] = ["python", "-c", BIG_BATCHES], []
    without = json.loads(json.dumps(spec))
    without["containers"][0]["volumeMounts"] = [
        mount for mount in container["volumeMounts"] if mount["mountPath"] != "/dev/shm"]
    for pod, pod_spec in ((f"{name}-ours", spec), (f"{name}-default", without)):
        cluster.core.create_namespaced_pod(NAMESPACE, {"metadata": {"name": pod},
                                                       "spec": pod_spec})

    def finished(pod: str) -> dict[str, Any] | None:
        status = cluster.core.read_namespaced_pod(pod, NAMESPACE).status
        if status is None or status.phase not in ("Succeeded", "Failed"):
            return None
        return dict(client.ApiClient().sanitize_for_serialization(status))

    ours = cluster.wait_for("the pod with our /dev/shm to end",
                            lambda: finished(f"{name}-ours"), 180)
    default = cluster.wait_for("the pod with the runtime's /dev/shm to end",
                               lambda: finished(f"{name}-default"), 180)
    log = cluster.agent.logs(30)
    for pod in (f"{name}-ours", f"{name}-default"):
        cluster.core.delete_namespaced_pod(pod, NAMESPACE)
    cluster.delete(name)  # its ConfigMap, mounted by both pods, stays until then
    print(f"with the operator's /dev/shm: {ours['phase']}; with the runtime's 64 MiB: "
          f"{default['phase']}")
    assert ours["phase"] == "Succeeded", ours
    assert default["phase"] == "Failed", default
    assert "all batches arrived" in log
    assert "unable to allocate shared memory" in log, log
