"""The operator as the Helm chart runs it: its own process, its ServiceAccount, its RBAC.

`install_operator_identity` renders the chart with Helm's own engine
(helm-python-sdk), applies only the ServiceAccount and RBAC objects to the control
plane (the operator's Deployment cannot run without a kubelet; `OperatorProcess` plays
that pod), and returns a kubeconfig holding a token the API server issued for that
ServiceAccount (TokenRequest, as the kubelet projects it into the pod). So every call
the operator makes is authorised by the chart's rules, never by an admin.

`OperatorProcess` runs `python -m kubetrain operator` with the same arguments the
chart's Deployment passes, logs to a file, and can be killed with SIGKILL and
started again, as a node crash or an OOM kill would.
"""

from __future__ import annotations

import base64
import copy
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import IO, Any

import yaml
from control_plane import REPO, ControlPlane
from emulator import write_kubeconfig
from kubernetes import client
from kubernetes.client.rest import ApiException

from kubetrain.local.launch import free_port

RELEASE = "kubetrain"
RELEASE_NAMESPACE = "kubetrain-system"
RBAC_KINDS = {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"}


def render_chart(values: dict[str, Any]) -> list[dict[str, Any]]:
    """The chart's objects as `helm template` renders them with `values`."""
    import helm_python

    with helm_python.Chart.load(REPO / "charts" / "kubetrain") as chart:
        manifests = chart.render(values, name=RELEASE, namespace=RELEASE_NAMESPACE,
                                 is_install=True)
    return [doc for path, text in sorted(manifests.items()) if not path.endswith("NOTES.txt")
            for doc in yaml.safe_load_all(text) if doc]


def install_operator_identity(plane: ControlPlane, values: dict[str, Any],
                              directory: Path) -> Path:
    """Apply the chart's ServiceAccount and RBAC for `values`; a kubeconfig with its token."""
    objects = [o for o in render_chart(values) if o["kind"] in RBAC_KINDS]
    namespaces = {RELEASE_NAMESPACE} | {o["metadata"]["namespace"] for o in objects
                                        if o["metadata"].get("namespace")}
    for namespace in sorted(namespaces):
        plane.kubectl("create", "namespace", namespace, check=False)
    plane.kubectl("apply", "--server-side", "-f", "-",
                  input=yaml.safe_dump_all(objects))
    account = next(o["metadata"]["name"] for o in objects if o["kind"] == "ServiceAccount")
    token = plane.kubectl("create", "token", account, "-n", RELEASE_NAMESPACE,
                          "--duration=6h").stdout.strip()
    return plane.write_kubeconfig(directory / f"{account}.kubeconfig",
                                  f"system:serviceaccount:{RELEASE_NAMESPACE}:{account}", token,
                                  namespace=RELEASE_NAMESPACE)


class OperatorProcess:
    """`kubetrain operator` in a subprocess; start, kill -9, start again."""

    def __init__(self, kubeconfig: Path, log_path: Path, namespaces: tuple[str, ...] = (),
                 resync_seconds: float = 1.0, leader_election: bool = False) -> None:
        self.kubeconfig, self.log_path = kubeconfig, log_path
        self.namespaces, self.resync_seconds = namespaces, resync_seconds
        self.leader_election = leader_election
        self.metrics_port = self.health_port = self.status_port = 0
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self._log: IO[bytes] | None = None

    def __enter__(self) -> OperatorProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Start it (as the chart's single-replica Deployment does) and wait for /healthz."""
        self.metrics_port, self.health_port = free_port(), free_port()
        self.status_port = free_port()  # several operators run side by side here
        self._log = self.log_path.open("ab")
        self._log.write(f"---- start {self.starts + 1}\n".encode())
        self._log.flush()
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig), "PYTHONUNBUFFERED": "1"}
        # As the chart's Deployment: --standalone with one replica, else a Lease in the
        # release namespace.
        election = ([f"--lease-namespace={RELEASE_NAMESPACE}"] if self.leader_election
                    else ["--standalone"])
        args = [sys.executable, "-m", "kubetrain", "operator", *election,
                f"--metrics-port={self.metrics_port}", f"--health-port={self.health_port}",
                f"--status-port={self.status_port}", f"--resync-seconds={self.resync_seconds}",
                *(f"--namespace={n}" for n in self.namespaces)]
        self.process = subprocess.Popen(args, env=env, stdout=self._log,
                                        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.starts += 1
        self._wait_healthy()

    def _wait_healthy(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise AssertionError(f"the operator exited with {self.process.returncode}:\n"
                                     f"{self.log_tail()}")
            try:
                with urllib.request.urlopen(
                        f"http://127.0.0.1:{self.health_port}/healthz", timeout=2):
                    return
            except OSError:
                time.sleep(0.2)
        raise AssertionError(f"the operator's /healthz did not answer in {timeout:.0f}s:\n"
                             f"{self.log_tail()}")

    def kill(self) -> None:
        """SIGKILL: no shutdown handler runs, as when its node or the OOM killer ends it."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()
        self._close_log()

    def stop(self) -> None:
        """SIGTERM, as when its pod is deleted; SIGKILL after 20 s."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._close_log()

    def restart(self) -> None:
        self.kill()
        self.start()

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def log_tail(self, lines: int = 60) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def metric(self, name: str) -> float:
        """The value of one unlabelled sample on the operator's /metrics."""
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics",
                                    timeout=5) as reply:
            text = reply.read().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and not sample.labels:
                    return float(sample.value)
        raise KeyError(f"no sample {name} on the operator's /metrics")

    def leads(self) -> bool:
        """Whether this process has logged that it took the leader-election Lease."""
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        current = text.rsplit(f"---- start {self.starts}", 1)[-1]
        return "now leads" in current

    def denied_requests(self) -> list[str]:
        """Log lines where RBAC denied the operator a request (not admission's refusals)."""
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return [line for line in text.splitlines()
                if "forbidden: User" in line and "cannot" in line]


class OperatorPod:
    """The operator as the chart deploys it: a Pod of the chart's Deployment, run from its image.

    The node agent (with a container runtime) runs it from the operator image built by
    images/offline: the chart's args, resources (a real memory limit), securityContext
    (uid 65532, read-only root) and /tmp volume. The test plays the Deployment's
    ReplicaSet controller: `start()` creates a pod from the rendered template (a new
    name each time) and waits for its /healthz; `kill()` kills its container with
    SIGKILL, as an OOM kill or a crash would, and removes the failed pod, so the next
    `start()` is its replacement.

    The one departure from the chart's pod is how it reaches the API: the node agent
    projects no service-account token and the emulator serves no TLS, so a Secret with
    a kubeconfig for the emulator, as the pod network reaches it, is mounted and named
    by KUBECONFIG.
    """

    def __init__(self, api: Any, agent: Any, server_url: str, folder: Path,
                 values: dict[str, Any] | None = None) -> None:
        self.core = client.CoreV1Api(api)
        self.agent, self.server_url, self.folder = agent, server_url, folder
        deployment = next(o for o in render_chart(values or {}) if o["kind"] == "Deployment")
        self.template: dict[str, Any] = deployment["spec"]["template"]
        self.image: str = self.template["spec"]["containers"][0]["image"]
        self.starts = 0
        self.name = ""

    def __enter__(self) -> OperatorPod:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout: float = 90) -> None:
        """Create the operator's pod and wait until it runs and answers /healthz."""
        self.starts += 1
        self.name = f"{RELEASE}-operator-{self.starts}"
        if self.starts == 1:
            kubeconfig = write_kubeconfig(self.folder / "operator.kubeconfig", self.server_url)
            self.core.create_namespaced_secret(RELEASE_NAMESPACE, {
                "metadata": {"name": "operator-kubeconfig"},
                "data": {"kubeconfig": base64.b64encode(kubeconfig.read_bytes()).decode()}})
        spec = copy.deepcopy(self.template["spec"])
        container = spec["containers"][0]
        container.setdefault("env", []).append(
            {"name": "KUBECONFIG", "value": "/var/run/kubetrain/kubeconfig"})
        container.setdefault("volumeMounts", []).append(
            {"name": "kubeconfig", "mountPath": "/var/run/kubetrain", "readOnly": True})
        spec.setdefault("volumes", []).append(
            {"name": "kubeconfig", "secret": {"secretName": "operator-kubeconfig"}})
        self.core.create_namespaced_pod(RELEASE_NAMESPACE, {
            "metadata": {"name": self.name, "labels": self.template["metadata"]["labels"]},
            "spec": spec})
        self._wait_healthy(timeout)

    def _port(self, name: str) -> int:
        return int(next(port["containerPort"] for port
                        in self.template["spec"]["containers"][0]["ports"]
                        if port["name"] == name))

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Every sample on the operator pod's /metrics, as Prometheus would scrape it: by
        name and sorted labels."""
        from prometheus_client.parser import text_string_to_metric_families

        pod = self.core.read_namespaced_pod(self.name, RELEASE_NAMESPACE)
        with urllib.request.urlopen(
                f"http://{pod.status.pod_ip}:{self._port('metrics')}/metrics",
                timeout=5) as reply:
            text = reply.read().decode()
        return {(sample.name, tuple(sorted(sample.labels.items()))): float(sample.value)
                for family in text_string_to_metric_families(text)
                for sample in family.samples}

    def _wait_healthy(self, timeout: float) -> None:
        port = self._port("health")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pod = self.core.read_namespaced_pod(self.name, RELEASE_NAMESPACE)
            if pod.status and pod.status.phase in ("Succeeded", "Failed"):
                raise AssertionError(f"the operator's pod ended {pod.status.phase}:\n"
                                     f"{self.log_tail()}")
            if pod.status and pod.status.pod_ip:
                try:
                    with urllib.request.urlopen(
                            f"http://{pod.status.pod_ip}:{port}/healthz", timeout=2):
                        return
                except OSError:
                    pass
            time.sleep(0.3)
        raise AssertionError(f"the operator's pod did not answer /healthz in {timeout:.0f}s:\n"
                             f"{self.log_tail()}")

    def kill(self) -> None:
        """SIGKILL of the operator's container; the failed pod is removed (the ReplicaSet)."""
        running = self.agent.pod(self.name, RELEASE_NAMESPACE)
        running.container.kill()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            pod = self.core.read_namespaced_pod(self.name, RELEASE_NAMESPACE)
            if pod.status and pod.status.phase == "Failed":
                break
            time.sleep(0.2)
        else:
            raise AssertionError("the operator's killed pod was not reported Failed")
        self.core.delete_namespaced_pod(self.name, RELEASE_NAMESPACE, grace_period_seconds=0)

    def stop(self) -> None:
        """Delete the pod gracefully (SIGTERM, as a rollout or scale-down does)."""
        try:
            self.core.delete_namespaced_pod(self.name, RELEASE_NAMESPACE)
        except ApiException as error:
            if error.status != 404:
                raise

    def log_tail(self, lines: int = 60) -> str:
        """The last lines the current operator pod printed."""
        logs = [log for log in (self.agent.workdir / "pods").glob("*/log")
                if (log.parent / "name").read_text() == f"{RELEASE_NAMESPACE}/{self.name}"]
        text = logs[0].read_text(errors="replace") if logs else ""
        return "\n".join(text.splitlines()[-lines:])
