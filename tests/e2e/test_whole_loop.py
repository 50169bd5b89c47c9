"""The whole loop on one machine: a TrainingJob → operator → pods → torchrun → trainer → S3.

The API server is kmock's emulator (tests/cluster/emulator.py) with the stand-in
scheduler and node lifecycle controller (tests/cluster/controllers.py); everything
else is the real part: the operator's pod, made from the chart's Deployment and run from
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
it under the same name, and both workers resume again. f (node loss) and e (a hang
past progressDeadlineSeconds) show the other ways a pod is replaced.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml
from build_images import BuiltImage, build_images
from containerd import Runtime
from emulator import EmulatedCluster
from kubernetes import client
from machine_state import left_behind, snapshot
from node_agent import Node, NodeAgent
from operator_process import RELEASE_NAMESPACE, OperatorPod

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
NAMESPACE = "whole-loop"
MAX_STEPS = 24
EVERY = 4
CORPUS = "s3://datasets/corpus"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "whole-loop", "AWS_SECRET_ACCESS_KEY": "whole-loop-secret"}
GROUP, VERSION, PLURAL = "kubetrain.io", "v1alpha1", "trainingjobs"
# What the jobs name as their image: the node has the trainer image built from this tree
# under that name (it is never pulled).
TRAINER_IMAGE = "ghcr.io/kubetrain/trainer:dev"
SYSTEM_TAINT = {"key": "node-role.kubernetes.io/system", "value": "true", "effect": "NoSchedule"}


@dataclass
class Row:
    """One line of `kubectl get tj NAME`, when it was read."""

    at: float
    phase: str
    step: int | None
    loss: float | None
    workers: str


@cache
def _printer_columns() -> dict[str, str]:
    """The CRD's printer columns, name → jsonPath: what `kubectl get tj` shows."""
    crd = yaml.safe_load((REPO / "crds" / "trainingjob.yaml").read_text())
    version = next(v for v in crd["spec"]["versions"] if v["name"] == VERSION)
    return {column["name"]: column["jsonPath"] for column in version["additionalPrinterColumns"]}


def _cell(obj: dict[str, Any], json_path: str) -> Any:
    """A printer column's simple JSONPath (`.a.b.c`) read from an object, None if absent."""
    assert re.fullmatch(r"(\.[A-Za-z]+)+", json_path), f"not a simple path: {json_path}"
    value: Any = obj
    for key in json_path.split(".")[1:]:
        value = value.get(key) if isinstance(value, dict) else None
    return value


@dataclass
class Cluster:
    """The running whole loop, and what a scenario does with it."""

    api: EmulatedCluster
    agent: NodeAgent
    operator: OperatorPod
    s3: str
    folder: Path
    rows: dict[str, list[Row]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        api = self.api.api_client()
        self.core = client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)

    # ---- what a user does, through the API -------------------------------------------

    def apply(self, manifest: dict[str, Any]) -> None:
        self.custom.create_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, manifest)

    def patch_spec(self, name: str, spec: dict[str, Any]) -> None:
        self.custom.patch_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, name,
                                                   {"spec": spec})

    def scale(self, name: str, replicas: int) -> None:
        """`kubectl scale tj/NAME --replicas=N`: through the scale subresource."""
        self.custom.patch_namespaced_custom_object_scale(GROUP, VERSION, NAMESPACE, PLURAL,
                                                         name, {"spec": {"replicas": replicas}})

    def job(self, name: str) -> dict[str, Any]:
        return dict(self.custom.get_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL,
                                                             name))

    def pods(self, name: str) -> list[dict[str, Any]]:
        listed = self.core.list_namespaced_pod(NAMESPACE,
                                               label_selector=f"kubetrain.io/job-name={name}")
        pods = [client.ApiClient().sanitize_for_serialization(pod) for pod in listed.items]
        return sorted(pods, key=lambda pod: pod["metadata"]["name"])

    def events(self, name: str) -> str:
        """The job's events as JSON text (reason, message), oldest first."""
        events = [event for event in self.core.list_namespaced_event(NAMESPACE).items
                  if event.involved_object.name == name]
        return json.dumps([{"reason": e.reason, "message": e.message} for e in events])

    def get_tj(self, name: str) -> Row:
        """`kubectl get tj NAME`'s Phase, Step, Loss and Workers columns."""
        job, columns = self.job(name), _printer_columns()
        cells = {column: _cell(job, path) for column, path in columns.items()}
        workers = cells["Workers"]
        row = Row(time.time(), cells["Phase"] or "", cells["Step"], cells["Loss"],
                  "" if workers is None else str(workers))
        self.rows.setdefault(name, []).append(row)
        return row

    # ---- waiting, with what was awaited and what the cluster showed -----------------------

    def wait_for(self, what: str, check: Callable[[], Any], timeout: float,
                 every: float = 1.0) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = check()
            if found:
                return found
            time.sleep(every)
        raise AssertionError(f"waited {timeout:.0f}s for {what}\n{self.report()}")

    def wait_for_step(self, name: str, at_least: int, timeout: float = 180) -> Row:
        """Until `kubectl get tj` shows step ≥ at_least (fails early if the job fails)."""

        def reached() -> Row | None:
            row = self.get_tj(name)
            assert row.phase != "Failed", f"{name} failed\n{self.report()}"
            return row if row.step is not None and row.step >= at_least else None

        return self.wait_for(f"{name} at step {at_least}", reached, timeout)

    def wait_for_phase(self, name: str, phase: str, timeout: float = 240) -> Row:
        def reached() -> Row | None:
            row = self.get_tj(name)
            if phase != "Failed":
                assert row.phase != "Failed", f"{name} failed\n{self.report()}"
            return row if row.phase == phase else None

        return self.wait_for(f"{name} in phase {phase}", reached, timeout)

    def report(self) -> str:
        jobs = self.custom.list_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL)
        shown = [f"tj/{job['metadata']['name']}: {job.get('status', {}).get('phase')} "
                 f"{job.get('status', {}).get('workers')}" for job in jobs["items"]]
        shown += [f"pod/{pod.metadata.name}: {pod.status.phase if pod.status else None} on "
                  f"{pod.spec.node_name} deleting={pod.metadata.deletion_timestamp}"
                  for pod in self.core.list_namespaced_pod(NAMESPACE).items]
        events = [f"{e.involved_object.name} {e.reason}: {e.message}"
                  for e in self.core.list_namespaced_event(NAMESPACE).items]
        return ("---- jobs and pods\n" + "\n".join(shown) + "\n---- events\n"
                + "\n".join(events[-40:]) + f"\n---- operator log\n{self.operator.log_tail(40)}"
                f"\n---- pod logs\n{self.agent.logs(15)}")

    # ---- what happened inside the pods ------------------------------------------------

    def trainer_lines(self, name: str) -> list[str]:
        """Every line rank 0 printed, over all incarnations of worker 0 (oldest first)."""
        lines = []
        for log in sorted((self.agent.workdir / "pods").glob("*/log"),
                          key=lambda path: path.stat().st_ctime):
            if (log.parent / "name").read_text() == f"{NAMESPACE}/{name}-worker-0":
                lines += log.read_text(errors="replace").splitlines()
        return lines

    def trainer_pid(self, pod: str) -> int:
        """The pid of the trainer process (torchrun's worker) of a running pod."""
        running = self.agent.pod(pod, NAMESPACE)
        for pid in running.processes():
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"kubetrain.trainer" in cmdline and b"torchrun" not in b" ".join(cmdline[:2]):
                return pid
        raise AssertionError(f"no trainer process in {pod}: {running.processes()}")

    def delete(self, name: str) -> None:
        """Delete the job and wait for its pods to go (garbage collection, then the agent)."""
        with contextlib.suppress(client.ApiException):
            self.custom.delete_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, name)
        self.wait_for(f"the pods of {name} to be deleted", lambda: not self.pods(name), 120)


def training_job(name: str, s3: str, **overrides: Any) -> dict[str, Any]:
    """A 2-worker `tiny` job on the prepared corpus: 24 steps, a checkpoint every 4."""
    spec: dict[str, Any] = {
        "image": TRAINER_IMAGE,
        "workers": {"replicas": 2},
        "model": {"preset": "tiny"},
        "data": {"train": f"{CORPUS}/train", "seqLen": 64},
        # A global batch of 1024 tokens: 2 micro-batches of 4 sequences on each of 2 ranks.
        "optimization": {"maxSteps": MAX_STEPS, "microBatchSize": 4, "globalBatchTokens": 1024,
                         "warmupSteps": 3, "seed": 5},
        "parallelism": {"strategy": "fsdp", "precision": "fp32"},
        "evaluation": {"everySteps": 0},
        "checkpoint": {"uri": f"s3://checkpoints/{name}", "everySteps": EVERY, "keepLast": 2},
        "storage": {"endpoint": s3, "region": "us-east-1",
                    "credentialsSecret": {"name": "s3-credentials"}},
        "metrics": {"logEverySteps": 1},
        "runPolicy": {"backoffSeconds": 1},
    }
    for key, value in overrides.items():
        spec[key] = {**spec[key], **value} if isinstance(value, dict) else value
    return {"apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob",
            "metadata": {"name": name, "namespace": NAMESPACE}, "spec": spec}


@contextmanager
def whole_loop(api: EmulatedCluster, folder: Path,
               images: Mapping[str, BuiltImage]) -> Iterator[Cluster]:
    """Nodes, S3 with the prepared corpus, the operator: everything a user's job needs.

    On `api`, a running emulated cluster with its stand-in controllers; the pods run as
    containers of `images` (built by images/offline) in a containerd of their own; files
    under `folder`.
    """
    import boto3
    from moto.server import ThreadedMotoServer

    runtime = Runtime.start(folder / "containerd")
    try:
        trainer = runtime.import_image(images["trainer"].archive)
        operator_image = runtime.import_image(images["operator"].archive)
        # Two nodes for the workers, and a tainted system node for the operator: a node
        # lost in a scenario never takes the operator with it.
        agent = NodeAgent(api.api_client(), folder / "agent",
                          namespaces={NAMESPACE, RELEASE_NAMESPACE}, runtime=runtime,
                          nodes=[Node("node-a"), Node("node-b"),
                                 Node("system", taints=[SYSTEM_TAINT])],
                          images={TRAINER_IMAGE: trainer},
                          # Several trainers share 2 cores: one thread each.
                          image_env={"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                                     "TOKENIZERS_PARALLELISM": "false"})
        with agent:
            # Bound on the pod network's gateway: the pods reach it there, and so does the host.
            server = ThreadedMotoServer(ip_address=agent.network.gateway, port=0, verbose=False)
            server.start()
            try:
                host, port = server.get_host_and_port()
                s3 = f"http://{host}:{port}"
                _prepare_corpus(s3, folder, boto3)
                core = client.CoreV1Api(api.api_client())
                core.create_namespaced_secret(NAMESPACE, {
                    "metadata": {"name": "s3-credentials"}, "type": "Opaque",
                    "data": {key: base64.b64encode(value.encode()).decode()
                             for key, value in CREDENTIALS.items()}})
                # The operator's pod reaches the API on the pod network's gateway.
                url = api.serve_on(agent.network.gateway)
                operator = OperatorPod(api.api_client(), agent, url, folder, values={
                    "resyncSeconds": 1, "nodeSelector": {"kubernetes.io/hostname": "system"},
                    "tolerations": [{**SYSTEM_TAINT, "operator": "Equal"}]})
                agent.images = {**agent.images, operator.image: operator_image}
                with operator:
                    yield Cluster(api, agent, operator, s3, folder)
            finally:
                server.stop()
    finally:
        runtime.stop()


def _missing_host_support() -> str | None:
    """Why this machine cannot run the node agent's pods, or None."""
    if os.geteuid() != 0:
        return "the node agent needs root (containers, network namespaces)"
    missing = [tool for tool in ("ip", "containerd", "runc") if not shutil.which(tool)]
    return (f"the node agent needs {', '.join(missing)}: `make images` installs them"
            if missing else None)


@pytest.fixture(scope="module")
def cluster(emulated_cluster: EmulatedCluster,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """The whole loop for this module's scenarios; skipped (failed under CI) without root."""
    reason = _missing_host_support()
    if reason is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI needs the whole loop: {reason}", pytrace=False)
        pytest.skip(reason)
    images = build_images(("operator", "trainer"), log=lambda line: print(line, flush=True))
    folder = tmp_path_factory.mktemp("whole-loop")
    before = snapshot()
    with whole_loop(emulated_cluster, folder, images) as running:
        mine = [str(folder), running.agent.network.bridge, f"kt{running.agent.network.tag}-",
                running.agent.runtime.cgroup_parent if running.agent.runtime else folder.name]
        yield running
    # Everything the node agent, its containers and the pod network changed is undone,
    # whatever the scenarios did (this runs after a failed one too).
    left = left_behind(before, snapshot(), mine)
    assert not left, "the whole loop left this on the machine:\n" + "\n".join(left)


def _prepare_corpus(s3: str, folder: Path, boto3: Any) -> None:
    """`kubetrain prepare` of ~300 KB of the standard library's sources into S3."""
    from kubetrain.local.workspace import copy_stdlib_sources

    client = boto3.client("s3", endpoint_url=s3, region_name="us-east-1", **{
        key.lower(): value for key, value in CREDENTIALS.items()})
    for bucket in ("datasets", "checkpoints"):
        client.create_bucket(Bucket=bucket)
    text = copy_stdlib_sources(folder / "corpus-text", max_bytes=300_000,
                               max_file_bytes=20_000)
    env = {**os.environ, **CREDENTIALS}
    subprocess.run([sys.executable, "-m", "kubetrain", "prepare", str(text), "-o", CORPUS,
                    "--endpoint", s3, "--region", "us-east-1", "--vocab-size", "2048",
                    "--shard-tokens", str(16 * 1024), "--validation-fraction", "0.1", "--quiet"],
                   env=env, check=True, capture_output=True, timeout=120)


def _storage(cluster: Cluster) -> Any:
    from kubetrain.api.trainingjob import StorageSpec

    os.environ.update(CREDENTIALS)
    return StorageSpec(endpoint=cluster.s3, region="us-east-1")


def _export(cluster: Cluster, name: str) -> Path:
    """Download `<checkpoint uri>/export` into a local folder."""
    from kubetrain.trainer.storage import open_storage

    store = open_storage(f"s3://checkpoints/{name}/export", _storage(cluster))
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


def _steps_printed(lines: list[str]) -> list[int]:
    return [int(m.group(1)) for line in lines if (m := re.match(r"step (\d+)/\d+ \|", line))]


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
    committed = committed_checkpoints(f"s3://checkpoints/{uninterrupted.name}",
                                      _storage(cluster))
    assert latest["uri"] == f"s3://checkpoints/{uninterrupted.name}"
    assert latest["step"] == committed[0].step == MAX_STEPS, (latest, committed)

    model = transformers.AutoModelForCausalLM.from_pretrained(uninterrupted.export,
                                                              dtype=torch.float32)
    tokens = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
    with torch.no_grad():
        logits = model(tokens).logits
    assert logits.shape[-1] == model.config.vocab_size and torch.isfinite(logits).all()
    cluster.delete(uninterrupted.name)


def _wait_for_printed_step(cluster: Cluster, name: str, step: int, timeout: float = 180) -> None:
    """Until rank 0 has printed `step`: read from its log, faster than the operator's scrape."""

    def printed() -> bool:
        return max(_steps_printed(cluster.trainer_lines(name)), default=-1) >= step

    cluster.wait_for(f"rank 0 of {name} to print step {step}", printed, timeout, every=0.05)


def _resumes(lines: list[str]) -> list[tuple[int, int]]:
    """For each resume in rank 0's lines: (the step it resumed from, steps redone)."""
    found = []
    for index, line in enumerate(lines):
        if line.startswith("resumed from "):
            step = int(re.search(r"at step (\d+)", line).group(1))  # type: ignore[union-attr]
            found.append((step, max(_steps_printed(lines[:index])) - step))
    return found


def _resume_and_redone(lines: list[str]) -> tuple[int, int]:
    """(the step training resumed from, steps redone): from rank 0's lines around the resume."""
    return _resumes(lines)[0]


def _advanced_after_resume(lines: list[str], resumes: int = 1) -> bool:
    """Whether rank 0 resumed `resumes` times and printed a step after the last of them."""
    resumed = [i for i, line in enumerate(lines) if line.startswith("resumed from ")]
    return len(resumed) >= resumes and bool(_steps_printed(lines[resumed[-1]:]))


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


def test_operator_killed_and_restarted_mid_run_recreates_no_pod_and_status_converges(
        cluster: Cluster) -> None:
    name = "operator-restart"
    steps = 120
    cluster.apply(training_job(name, cluster.s3, optimization={"maxSteps": steps},
                               checkpoint={"everySteps": 40}))
    cluster.wait_for_step(name, 1)
    pods = {pod["metadata"]["name"]: pod["metadata"]["uid"] for pod in cluster.pods(name)}
    cluster.operator.kill()
    killed_at_step = max(_steps_printed(cluster.trainer_lines(name)))
    cluster.operator.start()
    after = cluster.wait_for_step(name, killed_at_step + 1, timeout=120)
    print(f"operator killed at step {killed_at_step}; the new one reported step {after.step}")
    assert {pod["metadata"]["name"]: pod["metadata"]["uid"] for pod in cluster.pods(name)} == pods
    cluster.wait_for_phase(name, "Succeeded", timeout=300)

    job = cluster.job(name)
    # Once worker 0 is done the job's other pods are stopped; none was ever replaced.
    assert {pod["metadata"]["uid"] for pod in cluster.pods(name)} <= set(pods.values())
    assert job["status"].get("restarts", 0) == 0
    assert not any(line.startswith("resumed from ") for line in cluster.trainer_lines(name))
    assert f"finished at step {steps}: max_steps" in cluster.trainer_lines(name)
    cluster.delete(name)


def test_suspend_checkpoints_and_removes_the_pods_and_resume_continues_from_that_step(
        cluster: Cluster) -> None:
    name = "suspended"
    steps = 120
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
    cluster.wait_for_phase(name, "Succeeded", timeout=300)
    lines = cluster.trainer_lines(name)[len(before):]
    resumed = next(line for line in lines if line.startswith("resumed from "))
    print(f"suspended after step {last}; {resumed}")
    assert f"at step {last} " in resumed + " ", (last, resumed)
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


def test_a_hung_rank_makes_the_progress_deadline_restart_the_group(cluster: Cluster) -> None:
    name = "hung"
    cluster.apply(training_job(name, cluster.s3, optimization={"maxSteps": 60},
                               runPolicy={"progressDeadlineSeconds": 10}))
    _wait_for_printed_step(cluster, name, EVERY + 2)
    before = {pod["metadata"]["uid"] for pod in cluster.pods(name)}
    hung = cluster.trainer_pid(f"{name}-worker-1")
    os.kill(hung, signal.SIGSTOP)
    stopped = time.monotonic()
    cluster.wait_for("training to advance again in new pods",
                     lambda: _advanced_after_resume(cluster.trainer_lines(name)), 240, every=0.5)
    print(f"SIGSTOP of rank 1: training advanced again after {time.monotonic() - stopped:.0f}s")
    cluster.wait_for_phase(name, "Succeeded", timeout=300)

    job = cluster.job(name)
    reasons = cluster.events(name)
    assert "ProgressDeadlineExceeded" in reasons
    assert job["status"]["restarts"] >= 1
    assert not before & {pod["metadata"]["uid"] for pod in cluster.pods(name)}
    assert not Path(f"/proc/{hung}").exists(), "the stopped trainer outlived its pod"
    cluster.delete(name)


def test_node_loss_replaces_its_pods_on_the_other_node_and_the_job_succeeds(
        cluster: Cluster) -> None:
    name = "node-loss"
    cluster.apply(training_job(name, cluster.s3, optimization={"maxSteps": 60}))
    _wait_for_printed_step(cluster, name, EVERY + 2)
    # Worker 0's node: the pod that hosts the rendezvous, so the group cannot re-form
    # around it and the operator recreates the whole group on the node left.
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
                         lambda: _advanced_after_resume(cluster.trainer_lines(name)), 240,
                         every=0.5)
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
    step, redone = _resume_and_redone(cluster.trainer_lines(name))
    assert 0 <= redone <= EVERY, (step, redone)
    cluster.delete(name)


def test_a_worker_over_its_memory_limit_is_oom_killed_healed_with_half_the_micro_batch_and_succeeds(
        cluster: Cluster) -> None:
    name = "oom-heal"
    # A narrow model with a 16k vocabulary over 256-token sequences: the loss's logits
    # (tokens x vocabulary x 12 bytes, up to a 4096-token chunk) make memory grow ~200 MB
    # per 4 sequences while compute stays small. Measured outside a container, the trainer
    # alone peaks at ~0.7 GB of anonymous memory at 8 sequences and ~1.1 GB at 16;
    # torchrun adds ~0.25 GB. The container's 1100 MiB fits 8 sequences, not 16.
    manifest = training_job(
        name, cluster.s3,
        workers={"replicas": 1, "minReplicas": 1, "maxReplicas": 1,
                 "resources": {"limits": {"memory": "1100Mi"}}},
        model={"preset": "custom", "dim": 64, "nLayers": 2, "nHeads": 4, "ffnDim": 256,
               "vocabSize": 16384},
        data={"train": f"{CORPUS}/train", "seqLen": 256},
        optimization={"maxSteps": 6, "microBatchSize": 16, "globalBatchTokens": 4096,
                      "warmupSteps": 1, "seed": 5},
        checkpoint={"uri": f"s3://checkpoints/{name}", "everySteps": 3, "keepLast": 2},
        runPolicy={"maxRestarts": 0, "backoffSeconds": 1})
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
# 30 s for it and then raises.
BIG_BATCHES = """
import torch
from torch.utils.data import DataLoader, Dataset

class Big(Dataset):
    def __len__(self):
        return 4
    def __getitem__(self, index):
        return torch.full((24 << 20,), float(index))

for batch in DataLoader(Big(), batch_size=None, num_workers=2, timeout=30):
    assert batch.numel() == 24 << 20
print("all batches arrived")
"""


def test_dataloader_workers_share_more_than_64_mib_through_our_dev_shm_and_fail_without_it(
        cluster: Cluster) -> None:
    name = "shm"
    cluster.apply(training_job(name, cluster.s3))
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
