"""`kubetrain logs` (kubetrain/logs.py) run as a user runs it, against the real operator on
kmock's emulator, following a job's workers through a restart.

No containers here (tests/e2e/test_whole_loop.py follows a real one through a container
kill): the test plays the node, as harness.py's scenarios do, setting the pods' status
and writing each started pod's output file, which the emulator serves as `pods/{name}/log`
through the stand-in kubelet registered in `kubelets` (tests/cluster/pod_logs.py).
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from harness import EmulatedCluster, Kube, eventually, job_manifest, running_operator
from pod_logs import ContainerLog

from kubetrain.logs import since_seconds


class Node:
    """The test's node: starts a pod (Running, an empty output file) and writes its output.

    Its log lines are stamped `behind` seconds before now when they are collected: lines
    written long ago, without a test waiting that long.
    """

    def __init__(self, kube: Kube, folder: Path) -> None:
        self.kube, self.folder = kube, folder
        self.logs: dict[str, ContainerLog] = {}
        self.outputs: dict[str, Path] = {}
        self.behind = 0.0

    def clock(self) -> int:
        return time.time_ns() - int(self.behind * 1e9)

    def __call__(self, namespace: str, name: str, uid: str) -> ContainerLog | None:
        return self.logs.get(uid)

    def start(self, pod: str) -> str:
        uid = self.kube.pods(pod.rsplit("-worker-", 1)[0])[pod]["metadata"]["uid"]
        self.outputs[pod] = self.folder / uid
        self.outputs[pod].write_text("")
        self.logs[uid] = ContainerLog(self.outputs[pod], clock=self.clock)
        self.kube.set_pod_status(pod, "Running")
        return uid

    def write(self, pod: str, *lines: str) -> None:
        with self.outputs[pod].open("a") as output:
            output.write("".join(line + "\n" for line in lines))

    def end(self, pod: str, uid: str, exit_code: int) -> None:
        self.logs[uid].finish()
        self.kube.set_pod_status(pod, "Succeeded" if exit_code == 0 else "Failed",
                                 exit_code=exit_code)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmulatedCluster]:
    with EmulatedCluster(tmp_path_factory.mktemp("cluster")) as running, \
            running_operator(running):
        yield running


@pytest.fixture
def node(cluster: EmulatedCluster, tmp_path: Path) -> Iterator[Node]:
    stand_in = Node(Kube(cluster), tmp_path)
    cluster.emulator.kubelets.append(stand_in)
    yield stand_in
    cluster.emulator.kubelets.remove(stand_in)


def kubetrain_logs(cluster: EmulatedCluster, *args: str,
                   output: Path | None = None) -> subprocess.Popen[str]:
    """`kubetrain logs ARGS` as a user runs it; printing into `output` when given."""
    command = [sys.executable, "-m", "kubetrain", "logs", *args, "--kubeconfig",
               str(cluster.kubeconfig)]
    if output is None:
        return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
    with output.open("w") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.PIPE, text=True)


def finished(command: subprocess.Popen[str], timeout: float = 30) -> tuple[int, str, str]:
    out, err = command.communicate(timeout=timeout)
    return command.returncode, out, err


def test_follow_prints_every_attempt_of_each_worker_marked_until_the_job_ends(
        cluster: EmulatedCluster, node: Node, tmp_path: Path) -> None:
    kube, name = Kube(cluster), "follow"
    kube.create_job(job_manifest(name))
    eventually(lambda: len(kube.pods(name)) == 2, what="two worker pods")
    first = {pod: node.start(pod) for pod in (f"{name}-worker-0", f"{name}-worker-1")}
    node.write(f"{name}-worker-0", "rank 0: step 1")
    node.write(f"{name}-worker-1", "rank 1: step 1")
    eventually(lambda: kube.phase(name) == "Running", what="Running")

    printed = tmp_path / "printed"
    follower = kubetrain_logs(cluster, name, "--follow", output=printed)
    eventually(lambda: printed.read_text().count("step 1") == 2, timeout=60,
               what="the follower to print both workers' first lines")
    node.write(f"{name}-worker-1", "rank 1: killed")
    node.end(f"{name}-worker-1", first[f"{name}-worker-1"], exit_code=137)
    eventually(lambda: kube.pods(name).get(f"{name}-worker-1", {}).get("metadata", {})
               .get("labels", {}).get("kubetrain.io/restart-attempt") == "1",
               what="worker 1 replaced in attempt 1")
    second = node.start(f"{name}-worker-1")
    node.write(f"{name}-worker-1", "rank 1: resumed from step 1")
    node.write(f"{name}-worker-0", "rank 0: step 2")
    time.sleep(2)
    assert follower.poll() is None, "the follower stopped while the job runs"
    node.write(f"{name}-worker-0", "rank 0: done")
    # Worker 1 first: rank 0's success ends the job, and the operator may then delete the
    # other pod before its status is written (a 404 in the lowest-bounds run of a CI).
    node.end(f"{name}-worker-1", second, exit_code=0)
    node.end(f"{name}-worker-0", first[f"{name}-worker-0"], exit_code=0)
    eventually(lambda: kube.phase(name) == "Succeeded", what="Succeeded")

    code, _, err = finished(follower)
    assert code == 0, err
    out = printed.read_text()
    lines = out.splitlines()
    by_pod: dict[str, list[str]] = {}
    for line in lines:
        prefix, text = line.split("] ", 1)
        by_pod.setdefault(prefix + "]", []).append(text)
    assert by_pod == {
        f"[{name}-worker-0 attempt 0]": ["rank 0: step 1", "rank 0: step 2", "rank 0: done"],
        f"[{name}-worker-1 attempt 0]": ["rank 1: step 1", "rank 1: killed"],
        f"[{name}-worker-1 attempt 1]": ["rank 1: resumed from step 1"],
    }, out


def test_one_worker_now_and_only_recent_lines(cluster: EmulatedCluster, node: Node) -> None:
    kube, name = Kube(cluster), "once"
    kube.create_job(job_manifest(name))
    eventually(lambda: len(kube.pods(name)) == 2, what="two worker pods")
    node.start(f"{name}-worker-0")
    node.write(f"{name}-worker-0", "rank 0: old")
    assert finished(kubetrain_logs(cluster, name, "--worker", "1"))[2].endswith(
        "has not started yet\n")
    node.start(f"{name}-worker-1")
    node.write(f"{name}-worker-1", "rank 1: old")
    node.behind = 600  # the old lines were written 10 minutes ago
    for log in node.logs.values():
        log.collect()  # stamped, as the node agent's next tick does
    node.behind = 0
    node.write(f"{name}-worker-1", "rank 1: new")
    for log in node.logs.values():
        log.collect()

    # 5 minutes: the new line is inside it however slowly the command starts on a busy
    # machine (8 s was not, in CI), the old ones 5 minutes outside it.
    code, out, _ = finished(kubetrain_logs(cluster, name, "--since", "5m"))
    assert (code, out) == (0, f"[{name}-worker-1 attempt 0] rank 1: new\n")
    code, out, _ = finished(kubetrain_logs(cluster, name, "--worker", "1"))
    assert (code, out) == (0, f"[{name}-worker-1 attempt 0] rank 1: old\n"
                              f"[{name}-worker-1 attempt 0] rank 1: new\n")
    kube.delete_job(name)


def test_a_job_that_does_not_exist_is_named(cluster: EmulatedCluster) -> None:
    code, out, err = finished(kubetrain_logs(cluster, "nothing", "-n", "team-a"))
    assert (code, out) == (1, "")
    assert "TrainingJob 'nothing' not found in namespace 'team-a'" in err


@pytest.mark.parametrize(("text", "seconds"), [("30s", 30), ("10m", 600), ("1h30m", 5400),
                                               ("2h", 7200)])
def test_since_reads_durations_as_kubectl_does(text: str, seconds: int) -> None:
    assert since_seconds(text) == seconds


@pytest.mark.parametrize("text", ["", "10", "5 minutes", "0s", "1d"])
def test_since_refuses_what_is_not_a_duration(text: str) -> None:
    import argparse

    with pytest.raises(argparse.ArgumentTypeError):
        since_seconds(text)
