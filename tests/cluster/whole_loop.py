"""The whole loop for tests and benchmarks: TrainingJob → operator → pods → trainer → S3.

What it runs as a cluster runs it: on an API server (kmock's emulator, tests/cluster/
emulator.py, with the stand-in scheduler and node lifecycle controller of
tests/cluster/controllers.py, started by the caller), the operator's pod made from the
chart's Deployment and run from the operator image (tests/cluster/operator_process.py);
moto's S3 server over HTTP, bound on the pod network's gateway so the pods reach it, with
data prepared by `kubetrain prepare` into it; and the node agent (tests/cluster/
node_agent.py) with two worker nodes, node-a and node-b, and a tainted `system` node for
the operator (a node lost in a scenario never takes the operator with it). The agent runs
the pods as containers of the images the project builds (images/offline) in Debian's
containerd and runc: torchrun as PID 1, the trainer as uid 1000, memory and CPU limits as
cgroup limits, each pod on a CNI bridge with its own IP, names from cluster DNS.

What a scenario does with it (`Cluster`): what a user does through the API (apply, patch,
scale, `kubectl get tj`'s columns, `kubetrain logs`, delete), waits with a deadline that
say what was awaited and show the cluster when they fail, rank 0's log lines, and faults
from outside the processes: kill -9 of a trainer or a whole container, SIGSTOP/SIGCONT of
a trainer, a CPU quota on a pod's cgroup (`throttle`), a lost node (`agent.lose_node`).

What it does not: start the API server or its controllers (the caller's, so a test session
can share one), pull images (they are built from this tree and imported), reach anything
beyond the machine. Needs root; `missing_host_support()` says why a machine cannot run it.
Everything it changes on the machine is undone when `whole_loop` exits.
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
import tempfile
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any
from unittest import mock

import yaml
from build_images import BuiltImage
from containerd import Runtime
from emulator import EmulatedCluster
from kubernetes import client
from node_agent import Node, NodeAgent
from operator_process import RELEASE_NAMESPACE, OperatorPod

from kubetrain.local.node import rank_processes

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
# Where each of a worker's logs (one per pod it was) ended: Cluster.worker_mark.
LogMark = dict[Path, int]


@dataclass
class Row:
    """One line of `kubectl get tj NAME`, when it was read."""

    at: float
    phase: str
    step: int | None
    loss: float | None
    workers: str


@cache
def printer_columns() -> dict[str, str]:
    """The CRD's printer columns, name → jsonPath: what `kubectl get tj` shows."""
    crd = yaml.safe_load((REPO / "crds" / "trainingjob.yaml").read_text())
    version = next(v for v in crd["spec"]["versions"] if v["name"] == VERSION)
    return {column["name"]: column["jsonPath"] for column in version["additionalPrinterColumns"]}


def cell(obj: dict[str, Any], json_path: str) -> Any:
    """A printer column's simple JSONPath (`.a.b.c`) read from an object, None if absent."""
    assert re.fullmatch(r"(\.[A-Za-z]+)+", json_path), f"not a simple path: {json_path}"
    value: Any = obj
    for key in json_path.split(".")[1:]:
        value = value.get(key) if isinstance(value, dict) else None
    return value


# ---- rank 0's log lines ---------------------------------------------------------------

def steps_printed(lines: list[str]) -> list[int]:
    """The steps rank 0 printed, in order (a step redone after a resume appears twice)."""
    return [int(m.group(1)) for line in lines if (m := re.match(r"step (\d+)/\d+ \|", line))]


def losses_printed(lines: list[str]) -> dict[int, float]:
    """Each step's training loss rank 0 printed, the last print of a step redone."""
    return {int(m[1]): float(m[2]) for line in lines
            if (m := re.match(r"step (\d+)/\d+ \| epoch [\d.]+ \| loss ([\d.]+) \|", line))}


def quorums(lines: list[str]) -> list[tuple[int, int]]:
    """(step, groups) of each `step N: G of M replica groups in the quorum` line."""
    return [(int(m.group(1)), int(m.group(2))) for line in lines
            if (m := re.match(r"step (\d+): (\d+) of \d+ replica groups in the quorum", line))]


def step_seconds(lines: list[str]) -> list[tuple[int, float]]:
    """(step, seconds) of each step line: the wall time since the step logged before it, by
    the trainer's own clock (its `ms/step` over a log interval of one step, a step that
    did not commit included). Not the harness's time of reading the line: the test's
    process, busy or starved on a loaded machine, can read a log seconds late."""
    return [(int(m.group(1)), int(m.group(2).replace(",", "")) / 1000) for line in lines
            if (m := re.match(r"step (\d+)/\d+ \|.* \| ([\d,]+) ms/step \|", line))]


@dataclass(frozen=True)
class GroupFault:
    """Replica groups broken on purpose (`break_groups`), as the others saw it."""

    # Each live group's last printed step when the fault came: their logs are read one after
    # the other, and a loaded machine's log pipes lag apart by a few steps.
    last_steps: dict[int, int]
    heals: dict[int, str]  # each broken group's `healed from a live replica group ...` line
    healed_after: float  # seconds from the fault until the last of those lines was read
    whole_at: int  # the first live group's first step with the quorum whole again
    # Each live group's (step, seconds) from the fault until 3 steps after `whole_at`.
    steps: dict[int, list[tuple[int, float]]]
    marks: list[LogMark]  # where each group's logs ended when the fault came

    @property
    def at_step(self) -> int:
        """The first live group's last printed step when the fault came."""
        return self.last_steps[min(self.last_steps)]


def break_groups(cluster: Cluster, name: str, groups: int, broken: Collection[int],
                 inject: Callable[[], None]) -> GroupFault:
    """`inject()` breaks the groups `broken` of a job of `groups` groups of one pod; then
    wait until each healed from a live group and the quorum was whole again, and every live
    group printed 3 steps past that."""
    live = [index for index in range(groups) if index not in broken]
    first = live[0]
    marks = [cluster.worker_mark(name, index) for index in range(groups)]
    last_steps = {index: max(steps_printed(cluster.worker_lines(name, index)), default=0)
                  for index in live}
    broken_at = time.monotonic()
    inject()

    def healed(group: int) -> str | None:
        return next((line for line in cluster.worker_lines(name, group, marks[group])
                     if line.startswith("healed from a live replica group")), None)

    heals = {}
    for group in sorted(broken):
        try:
            heals[group] = cluster.wait_for(f"{name}-worker-{group} to heal from a live group",
                                            lambda group=group: healed(group), 240, every=0.1)
        except AssertionError as error:
            def said(index: int, most: int) -> str:
                return "\n".join([line for line in cluster.worker_lines(name, index, marks[index])
                                  if not re.match(r"step \d+/", line)][-most:])

            logs = {str(log.parent.name): len(log.read_text(errors="replace").splitlines())
                    for log in cluster.worker_logs(name, group)}
            # What the live groups did meanwhile (a survivor that never asked for the quorum
            # leaves the returning groups to resume from the checkpoint).
            survivors = "".join(f"\n---- {name}-worker-{index} since the fault, but its "
                                f"steps:\n{said(index, 40)}" for index in live)
            raise AssertionError(f"{error}\n---- {name}-worker-{group}'s logs (lines): {logs}, "
                                 f"marked at {marks[group]}; since, but its steps:\n"
                                 f"{said(group, 80)}{survivors}") from None
    healed_after = time.monotonic() - broken_at

    def whole() -> int | None:
        """The first step the first live group printed after its quorum was whole again."""
        lines = cluster.worker_lines(name, first, marks[first])
        at = [i for i, line in enumerate(lines)
              if (found := quorums([line])) and found[0][1] == groups]
        after = steps_printed(lines[at[0]:]) if at else []
        return after[0] if after else None

    whole_at = cluster.wait_for("the quorum to be whole again", whole, 120, every=0.1)
    for index in live:
        cluster.wait_for(f"{name}-worker-{index} to print step {whole_at + 3}",
                         lambda index=index: max(steps_printed(cluster.worker_lines(
                             name, index)), default=0) >= whole_at + 3, 60, every=0.1)
    steps = {index: [(step, seconds) for step, seconds
                     in step_seconds(cluster.worker_lines(name, index, marks[index]))
                     if step <= whole_at + 3] for index in live}
    return GroupFault(last_steps, heals, healed_after, whole_at, steps, marks)


def a_node_to_lose(cluster: Cluster, name: str, groups: int, broken: int
                   ) -> tuple[str, list[int]]:
    """A node of job `name` (`groups` groups of one pod) whose loss leaves its lighthouse and
    a group running: group `broken`'s if it does, else another. The node and the groups on it."""
    workers = [f"{name}-worker-{index}" for index in range(groups)]
    nodes = {pod["metadata"]["name"]: pod["spec"]["nodeName"] for pod in cluster.pods(name)}
    lighthouse = nodes[f"{name}-lighthouse"]
    node = next((node for node in (nodes[workers[broken]], *sorted(set(nodes.values())))
                 if node != lighthouse and {nodes[worker] for worker in workers} - {node}),
                None)
    assert node is not None, f"every node holds the lighthouse or every group: {nodes}"
    return node, [index for index, worker in enumerate(workers) if nodes[worker] == node]


def resumes(lines: list[str]) -> list[tuple[int, int]]:
    """For each resume in rank 0's lines: (the step it resumed from, steps redone)."""
    found = []
    for index, line in enumerate(lines):
        if line.startswith("resumed from "):
            step = int(re.search(r"at step (\d+)", line).group(1))  # type: ignore[union-attr]
            found.append((step, max(steps_printed(lines[:index]), default=step) - step))
    return found


def resume_and_redone(lines: list[str]) -> tuple[int, int]:
    """(the step training resumed from, steps redone): from rank 0's lines around the resume."""
    return resumes(lines)[0]


def advanced_after_resume(lines: list[str], resumes: int = 1) -> bool:
    """Whether rank 0 resumed `resumes` times and printed a step after the last of them."""
    resumed = [i for i, line in enumerate(lines) if line.startswith("resumed from ")]
    return len(resumed) >= resumes and bool(steps_printed(lines[resumed[-1]:]))


@dataclass
class Cluster:
    """The running whole loop, and what a scenario does with it."""

    api: EmulatedCluster
    agent: NodeAgent
    operator: OperatorPod
    s3: str
    folder: Path
    rows: dict[str, list[Row]] = field(default_factory=dict)
    # Each pod's log, with the pod's namespace/name (worker_logs): read once per pod.
    _pod_names: dict[Path, str] = field(default_factory=dict)

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

    @contextmanager
    def cordoned(self, node: str) -> Iterator[None]:
        """`kubectl cordon NODE` for the block, then `kubectl uncordon NODE`: no pod is placed
        there meanwhile (tests/cluster/controllers.py's Scheduler); its pods run on."""
        self.core.patch_node(node, {"spec": {"unschedulable": True}})
        try:
            yield
        finally:
            self.core.patch_node(node, {"spec": {"unschedulable": None}})

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
        job, columns = self.job(name), printer_columns()
        cells = {column: cell(job, path) for column, path in columns.items()}
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
        return self.worker_lines(name, 0)

    def worker_lines(self, name: str, index: int, since: LogMark | None = None) -> list[str]:
        """Every line worker `index` printed, over all its incarnations (oldest first), or
        only those after `since` (`worker_mark`): with spec.faultTolerance each group's
        first pod has its group's rank 0."""
        lines = []
        for log in self.worker_logs(name, index):
            lines += log.read_text(errors="replace").splitlines()[
                (since or {}).get(log, 0):]
        return lines

    def worker_mark(self, name: str, index: int) -> LogMark:
        """Where each of worker `index`'s logs ends now. A mark per log, not a count of the
        lines before: a lost node's pod may still write to its log after its replacement
        began its own, which then comes first by time of last change."""
        return {log: len(log.read_text(errors="replace").splitlines())
                for log in self.worker_logs(name, index)}

    def worker_logs(self, name: str, index: int) -> list[Path]:
        """The log of each pod worker `index` has been, by time of last change.

        Polled up to 20 times a second while every pod of the session's scenarios is in
        the agent's folder: each pod's name is read once, the first time its log is seen
        (the agent writes the name before the container whose log it is starts)."""
        for pod in os.scandir(self.agent.workdir / "pods"):
            log = Path(pod.path, "log")
            if log not in self._pod_names and log.exists():
                self._pod_names[log] = (log.parent / "name").read_text()
        wanted = f"{NAMESPACE}/{name}-worker-{index}"
        return sorted((log for log, pod in self._pod_names.items() if pod == wanted),
                      key=lambda path: path.stat().st_ctime)

    def trainer_pid(self, pod: str) -> int:
        """The pid of the trainer process (torchrun's worker) of a running pod."""
        running = self.agent.pod(pod, NAMESPACE)
        trainers = rank_processes(running.processes())
        if trainers:
            return next(iter(trainers))
        raise AssertionError(f"no trainer process in {pod}: {running.processes()}")

    def wait_for_printed_step(self, name: str, step: int, timeout: float = 180) -> None:
        """Until rank 0 has printed `step`: read from its log, faster than the operator's scrape."""

        def printed() -> bool:
            return max(steps_printed(self.trainer_lines(name)), default=-1) >= step

        self.wait_for(f"rank 0 of {name} to print step {step}", printed, timeout, every=0.05)

    # ---- faults, from outside the processes -------------------------------------------

    def kill_trainer(self, pod: str) -> None:
        """kill -9 of a pod's trainer process: torchrun restarts the group in place."""
        os.kill(self.trainer_pid(pod), signal.SIGKILL)

    def kill_container(self, pod: str) -> None:
        """kill -9 of every process of a pod's container (torchrun and the trainer), as an
        OOM kill or a crash of the runtime does: the pod fails."""
        for pid in self.agent.pod(pod, NAMESPACE).processes():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def stop_trainer(self, pod: str) -> int:
        """SIGSTOP of a pod's trainer process: it holds still until `continue_trainer`."""
        pid = self.trainer_pid(pod)
        os.kill(pid, signal.SIGSTOP)
        return pid

    def continue_trainer(self, pid: int) -> None:
        """SIGCONT of a trainer stopped by `stop_trainer` (nothing if it is gone)."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)

    def throttle(self, pod: str, cpu_fraction: float) -> None:
        """A CFS quota of `cpu_fraction` of one CPU on a running pod's container cgroup, as
        a slow or shared machine would leave it; `unthrottle` lifts it."""
        container = self.agent.pod(pod, NAMESPACE).container
        assert container is not None, f"{pod} has no container yet"
        container.set_cpu_limit(cpu_fraction)

    def unthrottle(self, pod: str) -> None:
        """Back to the pod's own CPU limit (none unless its spec sets one); nothing if the
        pod is gone."""
        with contextlib.suppress(KeyError):
            container = self.agent.pod(pod, NAMESPACE).container
            if container is not None and container.running:
                container.set_cpu_limit(container.spec.cpu_limit)

    def kubetrain_logs(self, *args: str, output: Path) -> subprocess.Popen[bytes]:
        """`kubetrain logs ARGS` against this cluster's API, as a user runs it, printing
        into `output` (its errors into `output`.err). The pods' logs come from the node
        agent, which the API server asks as it asks a kubelet."""
        with output.open("wb") as out, output.with_suffix(".err").open("wb") as err:
            return subprocess.Popen(
                [sys.executable, "-m", "kubetrain", "logs", *args, "-n", NAMESPACE,
                 "--kubeconfig", str(self.api.kubeconfig)], stdout=out, stderr=err)

    def jobs(self) -> set[str]:
        """The names of the TrainingJobs in the namespace."""
        listed = self.custom.list_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL)
        return {job["metadata"]["name"] for job in listed["items"]}

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
        # Links judged only where a rank is far slower than the median, as the trainer
        # tests' tiny jobs (tests/trainer/conftest.py): a 4-rank job's rank on CI's shared
        # cores can be starved through every exchange with no fault in the job.
        "runPolicy": {"backoffSeconds": 1, "preflight": {"minBandwidthFraction": 0.1}},
    }
    for key, value in overrides.items():
        spec[key] = {**spec[key], **value} if isinstance(value, dict) else value
    return {"apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob",
            "metadata": {"name": name, "namespace": NAMESPACE}, "spec": spec}


def replica_groups_job(name: str, s3: str, *, groups: int, steps: int, heartbeat_ms: int,
                       collective_ms: int, checkpoint_every: int = 20,
                       procs_per_worker: int = 1) -> dict[str, Any]:
    """`groups` workers of `procs_per_worker` processes, each its own replica group
    (spec.faultTolerance): one micro-batch of 4 sequences a process each step."""
    manifest = training_job(name, s3,
                            workers={"replicas": groups, "procsPerWorker": procs_per_worker},
                            optimization={"maxSteps": steps,
                                          "globalBatchTokens": 4 * 64 * groups * procs_per_worker},
                            checkpoint={"everySteps": checkpoint_every})
    manifest["spec"]["faultTolerance"] = {"replicaGroups": groups,
                                          "heartbeatTimeoutMilliseconds": heartbeat_ms,
                                          "collectiveTimeoutMilliseconds": collective_ms}
    return manifest


def out_of_memory_job(name: str, s3: str, micro_batch: int, max_steps: int) -> dict[str, Any]:
    """One worker with 1100 MiB that fits a micro-batch of 8 sequences, not 16.

    A narrow model with a 16k vocabulary over 256-token sequences: the loss's logits
    (tokens x vocabulary x 12 bytes, up to a 4096-token chunk) make memory grow ~200 MB
    per 4 sequences while compute stays small. Measured outside a container, the trainer
    alone peaks at ~0.7 GB of anonymous memory at 8 sequences and ~1.1 GB at 16;
    torchrun adds ~0.25 GB.
    """
    return training_job(
        name, s3,
        workers={"replicas": 1, "minReplicas": 1, "maxReplicas": 1,
                 "resources": {"limits": {"memory": "1100Mi"}}},
        model={"preset": "custom", "dim": 64, "nLayers": 2, "nHeads": 4, "ffnDim": 256,
               "vocabSize": 16384},
        data={"train": f"{CORPUS}/train", "seqLen": 256},
        optimization={"maxSteps": max_steps, "microBatchSize": micro_batch,
                      "globalBatchTokens": 4096, "warmupSteps": 1, "seed": 5},
        checkpoint={"uri": f"s3://checkpoints/{name}", "everySteps": 3, "keepLast": 2},
        runPolicy={"maxRestarts": 0, "backoffSeconds": 1})


# Own code (spec.trainer): tests/own_code/plain_torch.py, a user's FSDP2 + DCP script with
# kubetrain.sdk, reaches the pods as a ConfigMap volume, so no product image carries it; its
# image is the trainer image, which has torch and the own-code extra.
OWN_CODE_SCRIPTS = "own-code-scripts"
OWN_CODE_DIR = "/opt/own-code"
# Upload passes every second (KUBETRAIN_SYNC_SECONDS; 10 s by default): a folder marked but
# not yet uploaded dies with its pod, so a kill may redo one pass's steps beyond the
# checkpoint interval.
OWN_CODE_SYNC_SECONDS = 1.0


def add_own_code_scripts(cluster: Cluster) -> None:
    """The ConfigMap `own_code_job`'s pods mount the test scripts from."""
    scripts = [REPO / "tests" / "own_code" / name
               for name in ("plain_torch.py", "ddp_from_the_docs.py", "hf_trainer.py")]
    cluster.core.create_namespaced_config_map(NAMESPACE, {
        "metadata": {"name": OWN_CODE_SCRIPTS},
        "data": {script.name: script.read_text() for script in scripts}})


def own_code_job(name: str, s3: str, *, steps: int, save_every: int, step_seconds: float,
                 script: str = "plain_torch.py", replicas: int = 2, procs_per_worker: int = 1,
                 run_policy: dict[str, Any] | None = None) -> dict[str, Any]:
    """An own-code job running `script` (from `add_own_code_scripts`) on `replicas` workers
    of `procs_per_worker` processes: `steps` steps, a DCP checkpoint every `save_every`,
    each step `step_seconds` longer."""
    return {
        "apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "trainer": {
                "image": TRAINER_IMAGE,
                "command": ["python", f"{OWN_CODE_DIR}/{script}"],
                "args": ["--steps", str(steps), "--save-every", str(save_every),
                         "--step-seconds", str(step_seconds), "--batch", "8"],
                "env": [{"name": "KUBETRAIN_SYNC_SECONDS",
                         "value": f"{OWN_CODE_SYNC_SECONDS:g}"}],
            },
            "workers": {"replicas": replicas, "procsPerWorker": procs_per_worker, "template": {
                "volumes": [{"name": "scripts", "configMap": {"name": OWN_CODE_SCRIPTS}}],
                "volumeMounts": [{"name": "scripts", "mountPath": OWN_CODE_DIR,
                                  "readOnly": True}]}},
            "checkpoint": {"uri": f"s3://checkpoints/{name}", "keepLast": 2},
            "storage": {"endpoint": s3, "region": "us-east-1",
                        "credentialsSecret": {"name": "s3-credentials"}},
            "runPolicy": {"backoffSeconds": 1, **(run_policy or {})},
        },
    }


@contextmanager
def s3_credentials() -> Iterator[None]:
    """The keys the pods get from s3-credentials, in this process's environment only inside
    the block (boto3 reads them as it makes its client): the tests that run in this process
    after this one keep its own keys (tests/conftest.py)."""
    with mock.patch.dict(os.environ, CREDENTIALS):
        yield


def cluster_storage(cluster: Cluster, uri: str) -> Any:
    """The cluster's S3 at `uri`, opened with the pods' keys."""
    from kubetrain.api.trainingjob import StorageSpec
    from kubetrain.trainer.storage import open_storage

    with s3_credentials():
        return open_storage(uri, StorageSpec(endpoint=cluster.s3, region="us-east-1"))


def own_code_commits(cluster: Cluster, name: str) -> dict[str, int]:
    """The folders an own-code job has committed under its checkpoint.uri, with their steps:
    what a new pod's entry could restore now."""
    from kubetrain.trainer.checkpoint_sync import commits

    store = cluster_storage(cluster, f"s3://checkpoints/{name}")
    return {commit.folder: commit.step for commit in commits(store)}


def own_code_steps(lines: list[str]) -> list[int]:
    """The steps the own-code script's rank 0 trained, in order (a redone step twice)."""
    return [int(m.group(1)) for line in lines if (m := re.match(r"own-code step (\d+) ", line))]


def own_code_resumes(lines: list[str]) -> list[int]:
    """The steps the own-code script's rank 0 resumed from, one per attempt that loaded one."""
    return [int(m.group(1)) for line in lines
            if (m := re.fullmatch(r"own-code resumed from step (\d+)", line))]


@dataclass(frozen=True)
class NodeRuntime:
    """A containerd with the trainer and operator images imported: their refs in it."""

    runtime: Runtime
    trainer: str
    operator: str


@contextmanager
def node_runtime(folder: Path, images: Mapping[str, BuiltImage]) -> Iterator[NodeRuntime]:
    """A containerd under `folder` with `images`' trainer and operator imported (built by
    images/offline; the import is most of the whole loop's start: 40-50 s of containerd's
    CPU), stopped after the block."""
    runtime = Runtime.start(folder / "containerd")
    try:
        yield NodeRuntime(runtime, runtime.import_image(images["trainer"].archive),
                          runtime.import_image(images["operator"].archive))
    finally:
        runtime.stop()


@contextmanager
def whole_loop(api: EmulatedCluster, folder: Path, node: NodeRuntime) -> Iterator[Cluster]:
    """Nodes, S3 with the prepared corpus, the operator: everything a user's job needs.

    On `api`, a running emulated cluster with its stand-in controllers; the pods run as
    containers of `node`'s images in its containerd; files under `folder`.
    """
    import boto3
    from moto.server import ThreadedMotoServer

    # Two nodes for the workers, and a tainted system node for the operator: a node
    # lost in a scenario never takes the operator with it.
    agent = NodeAgent(api.api_client(), folder / "agent",
                      namespaces={NAMESPACE, RELEASE_NAMESPACE}, runtime=node.runtime,
                      nodes=[Node("node-a"), Node("node-b"),
                             Node("system", taints=[SYSTEM_TAINT])],
                      images={TRAINER_IMAGE: node.trainer},
                      # Several trainers share 2 cores: one thread each.
                      image_env={"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                                 "TOKENIZERS_PARALLELISM": "false"})
    with agent:
        # The API server reads pods' logs from their kubelet: here, the node agent.
        api.emulator.kubelets.append(agent.container_log)
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
            agent.images = {**agent.images, operator.image: node.operator}
            with operator:
                yield Cluster(api, agent, operator, s3, folder)
        finally:
            server.stop()
            api.emulator.kubelets.remove(agent.container_log)


@contextmanager
def standalone(prefix: str, log: Callable[[str], None]) -> Iterator[Cluster]:
    """The whole loop for a script outside pytest (the benches under bench/), as the test
    session starts it (tests/e2e/conftest.py): the images built or found, an emulated API
    with its stand-in controllers, /run/netns made first and removed last when this made it.
    Raises, after the loop stopped, naming what it left on the machine."""
    from build_images import build_images
    from controllers import NodeLifecycle, Scheduler
    from machine_state import left_behind, snapshot
    from pod_network import ensure_namespace_folder, remove_namespace_folder

    log("building or finding the images")
    images = build_images(("operator", "trainer"), log=lambda line: log(f"  {line}"))
    made_netns_folder = ensure_namespace_folder()
    before = snapshot()
    with tempfile.TemporaryDirectory(prefix=prefix) as folder, \
            node_runtime(Path(folder), images) as node, \
            EmulatedCluster(Path(folder)) as api, Scheduler(api=api.api_client()), \
            NodeLifecycle(api=api.api_client()), \
            whole_loop(api, Path(folder) / "loop", node) as cluster:
        mine = [folder, cluster.agent.network.bridge, f"kt{cluster.agent.network.tag}-",
                node.runtime.cgroup_parent]
        yield cluster
    left = left_behind(before, snapshot(), mine)
    if made_netns_folder:
        remove_namespace_folder()
    if left:
        raise RuntimeError("the run left this on the machine:\n" + "\n".join(left))


def missing_host_support() -> str | None:
    """Why this machine cannot run the node agent's pods, or None."""
    if os.geteuid() != 0:
        return "the node agent needs root (containers, network namespaces)"
    missing = [tool for tool in ("ip", "containerd", "runc") if not shutil.which(tool)]
    return (f"the node agent needs {', '.join(missing)}: `make images` installs them"
            if missing else None)


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
