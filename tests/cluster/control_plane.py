"""A real Kubernetes control plane for tests: etcd, kube-apiserver, controller-manager, scheduler.

What it does as a cluster does: the real binaries (Kubernetes v1.36 in CI), started
as processes on free 127.0.0.1 ports with their data and logs in one folder, so the
operator and kubectl meet a real API server: OpenAPI schema validation and CEL, RBAC,
server-side apply, status and scale subresources, optimistic concurrency, watch
semantics, the garbage collector and the node lifecycle controller of
kube-controller-manager, and kube-scheduler binding pods to nodes.

What it does not: no kubelet and no container runtime (tests/cluster/node_agent.py
stands in for nodes), no cluster DNS, no kube-proxy, no TLS client certificates (users
authenticate with static bearer tokens; ServiceAccounts with tokens the API server
issues through the TokenRequest API, as in a cluster). Node-lifecycle grace periods
are seconds instead of minutes, so a lost node is noticed within a test.

Binaries are looked up as controller-runtime's envtest does, in `$KUBEBUILDER_ASSETS`:
a folder with etcd and kube-apiserver, as `setup-envtest` makes it, plus
kube-controller-manager and kube-scheduler of the same release (the garbage collector,
node lifecycle and scheduling are part of what the tests show). No package registry
these machines reach ships them, so without that variable the real-server tier
(tests/real_server) skips; `find_binaries()` says why, and how to get them.
"""

from __future__ import annotations

import base64
import contextlib
import os
import secrets
import shutil
import signal
import ssl
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import yaml

from kubetrain.local.launch import free_port

REPO = Path(__file__).resolve().parents[2]
SERVER_BINARIES = ("etcd", "kube-apiserver")
CONTROLLER_BINARIES = ("kube-controller-manager", "kube-scheduler")
HOW_TO_GET_BINARIES = (
    "set KUBEBUILDER_ASSETS to a folder with etcd, kube-apiserver, kube-controller-manager and "
    "kube-scheduler of one Kubernetes release (`setup-envtest use -p path` from "
    "controller-runtime gives the first two; see docs/contributing.md, 'The real-server tier')")

# Node lifecycle in seconds rather than the defaults' minutes: a node that stops its
# heartbeats is NotReady after NODE_GRACE and its pods are evicted TOLERATION later.
NODE_MONITOR_GRACE_SECONDS = 8
NOT_READY_TOLERATION_SECONDS = 5


class ControlPlaneUnavailable(RuntimeError):
    """No binaries to start a control plane from; the message says how to get them."""


def find_binaries() -> Path:
    """The folder holding the control-plane binaries, or ControlPlaneUnavailable."""
    assets = os.environ.get("KUBEBUILDER_ASSETS")
    if assets:
        folder = Path(assets)
        missing = [b for b in (*SERVER_BINARIES, *CONTROLLER_BINARIES)
                   if not (folder / b).is_file()]
        if missing:
            raise ControlPlaneUnavailable(
                f"KUBEBUILDER_ASSETS={assets} has no {', '.join(missing)}; {HOW_TO_GET_BINARIES}")
        return folder
    raise ControlPlaneUnavailable(f"no Kubernetes control-plane binaries: {HOW_TO_GET_BINARIES}")


def find_kubectl(bin_dir: Path) -> Path:
    """kubectl beside the server binaries, else one on PATH of at least v1.30."""
    if (bin_dir / "kubectl").is_file():
        return bin_dir / "kubectl"
    found = shutil.which("kubectl")
    if found:
        version = subprocess.run([found, "version", "--client", "-o", "json"],
                                 capture_output=True, text=True, check=False).stdout
        minor = yaml.safe_load(version or "{}").get("clientVersion", {}).get("minor", "0")
        if int("".join(c for c in minor if c.isdigit()) or 0) >= 30:
            return Path(found)
    raise ControlPlaneUnavailable(f"no kubectl >= 1.30 in {bin_dir} or on PATH")


@dataclass
class _Component:
    name: str
    process: subprocess.Popen[bytes]
    log: IO[bytes]


@dataclass
class ControlPlane:
    """A running control plane; `start()` it, `stop()` it (or use it as a context manager)."""

    workdir: Path
    bin_dir: Path = field(default_factory=find_binaries)
    # Start kube-controller-manager and kube-scheduler (when their binaries are there).
    controllers: bool = True
    # Extra kube-apiserver flags, e.g. an audit log for counting requests.
    apiserver_args: tuple[str, ...] = ()
    url: str = ""
    admin_token: str = ""
    _components: list[_Component] = field(default_factory=list)

    @property
    def kubeconfig(self) -> Path:
        return self.workdir / "kubeconfig"

    @property
    def ca_file(self) -> Path:
        """The API server's self-signed serving certificate, which is also its CA bundle."""
        return self.workdir / "certs" / "apiserver.crt"

    @property
    def logs(self) -> Path:
        return self.workdir / "logs"

    @property
    def has_controllers(self) -> bool:
        """Whether kube-controller-manager and kube-scheduler run (garbage collection, binding)."""
        return any(c.name == "kube-controller-manager" for c in self._components)

    def __enter__(self) -> ControlPlane:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, before_controllers: Callable[[ControlPlane], None] | None = None) -> None:
        """Start every component and wait until each reports healthy.

        `before_controllers` runs once the API server is ready and before the
        controller-manager starts: CRDs installed there are known to the garbage collector
        from its first discovery (it re-reads discovery only every 30 s).
        """
        started = time.monotonic()
        for folder in ("logs", "pki", "certs", "etcd"):
            (self.workdir / folder).mkdir(parents=True, exist_ok=True)
        try:
            self._start_etcd()
            self._start_apiserver()
            if before_controllers is not None:
                before_controllers(self)
            if self.controllers and all((self.bin_dir / b).is_file()
                                        for b in CONTROLLER_BINARIES):
                self._start_controller_manager()
                self._start_scheduler()
        except BaseException:
            self.stop()
            raise
        (self.logs / "ready-seconds").write_text(f"{time.monotonic() - started:.1f}\n")

    def stop(self) -> None:
        """Stop exactly the processes this object started, newest first."""
        for component in reversed(self._components):
            with contextlib.suppress(ProcessLookupError):
                component.process.send_signal(signal.SIGTERM)
        for component in reversed(self._components):
            try:
                component.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                component.process.kill()
                component.process.wait()
            component.log.close()
        self._components.clear()

    # --- clients --------------------------------------------------------------------------

    def api_client(self, kubeconfig: Path | None = None) -> Any:
        """A kubernetes.client.ApiClient for the admin, or for the user of `kubeconfig`."""
        from kubernetes import client
        from kubernetes import config as kube_config

        configuration = client.Configuration()
        kube_config.load_kube_config(str(kubeconfig or self.kubeconfig),
                                     client_configuration=configuration)
        return client.ApiClient(configuration)

    def kubectl(self, *args: str, input: str | None = None, check: bool = True,
                kubeconfig: Path | None = None, timeout: float = 60,
                ) -> subprocess.CompletedProcess[str]:
        """Run kubectl against this control plane; raises with its stderr when `check` fails."""
        command = [str(find_kubectl(self.bin_dir)), "--kubeconfig",
                   str(kubeconfig or self.kubeconfig), *args]
        result = subprocess.run(command, input=input, capture_output=True, text=True,
                                check=False, timeout=timeout)
        if check and result.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} exited {result.returncode}:\n"
                                 f"{result.stdout}{result.stderr}")
        return result

    def write_kubeconfig(self, path: Path, user: str, token: str,
                         namespace: str = "default") -> Path:
        """A kubeconfig for `user` authenticating with bearer `token`."""
        ca = base64.b64encode(self.ca_file.read_bytes()).decode()
        path.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "kubetrain",
            "clusters": [{"name": "kubetrain", "cluster": {
                "server": self.url, "certificate-authority-data": ca}}],
            "users": [{"name": user, "user": {"token": token}}],
            "contexts": [{"name": "kubetrain", "context": {
                "cluster": "kubetrain", "user": user, "namespace": namespace}}],
        }))
        path.chmod(0o600)
        return path

    def pids(self, names: tuple[str, ...]) -> list[int]:
        """Process ids of the running components named, e.g. ("kube-apiserver", "etcd")."""
        return [c.process.pid for c in self._components if c.name in names]

    def log_tails(self, lines: int = 40) -> str:
        """The last lines of every component's log, for a failing test's report."""
        parts = []
        for log in sorted(self.logs.glob("*.log")):
            tail = log.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"---- {log.name} (last {len(tail)} lines)\n" + "\n".join(tail))
        return "\n".join(parts)

    # --- components -----------------------------------------------------------------------

    def _spawn(self, name: str, *args: str) -> None:
        log = (self.logs / f"{name}.log").open("ab")
        process = subprocess.Popen([str(self.bin_dir / name), *args], stdout=log,
                                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   start_new_session=True)
        self._components.append(_Component(name, process, log))

    def _wait_healthy(self, name: str, url: str, timeout: float, token: str = "",
                      context: ssl.SSLContext | None = None) -> None:
        component = next(c for c in self._components if c.name == name)
        deadline = time.monotonic() + timeout
        request = urllib.request.Request(url)
        if token:
            request.add_header("Authorization", f"Bearer {token}")
        last_error = ""
        while time.monotonic() < deadline:
            if component.process.poll() is not None:
                raise RuntimeError(f"{name} exited with {component.process.returncode}:\n"
                                   f"{self.log_tails()}")
            try:
                with urllib.request.urlopen(request, timeout=5, context=context) as response:
                    body = response.read().decode()
                if body == "ok" or '"health":"true"' in body:
                    return
                last_error = body
            except OSError as error:
                last_error = str(error)
            time.sleep(0.2)
        raise RuntimeError(f"{name} not healthy at {url} after {timeout:.0f}s ({last_error}):\n"
                           f"{self.log_tails()}")

    def _start_etcd(self) -> None:
        client_url = f"http://127.0.0.1:{free_port()}"
        peer_url = f"http://127.0.0.1:{free_port()}"
        self._spawn("etcd", "--name=kubetrain", f"--data-dir={self.workdir / 'etcd'}",
                    f"--listen-client-urls={client_url}", f"--advertise-client-urls={client_url}",
                    f"--listen-peer-urls={peer_url}", f"--initial-advertise-peer-urls={peer_url}",
                    f"--initial-cluster=kubetrain={peer_url}", "--unsafe-no-fsync=true")
        self._etcd_url = client_url
        self._wait_healthy("etcd", f"{client_url}/health", 60)

    def _start_apiserver(self) -> None:
        pki = self.workdir / "pki"
        _write_service_account_keys(pki)
        self.admin_token = secrets.token_hex(24)
        self._controller_token, self._scheduler_token = secrets.token_hex(24), secrets.token_hex(24)
        tokens = pki / "tokens.csv"
        tokens.write_text(
            f'{self.admin_token},admin,admin,"system:masters"\n'
            f'{self._controller_token},system:kube-controller-manager,kcm,"system:masters"\n'
            f"{self._scheduler_token},system:kube-scheduler,scheduler\n")
        tokens.chmod(0o600)
        port = free_port()
        self.url = f"https://127.0.0.1:{port}"
        self._spawn(
            "kube-apiserver", f"--etcd-servers={self._etcd_url}", "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1", f"--secure-port={port}",
            f"--cert-dir={self.workdir / 'certs'}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={pki / 'sa.pub'}",
            f"--service-account-signing-key-file={pki / 'sa.key'}",
            "--authorization-mode=RBAC", f"--token-auth-file={tokens}",
            "--service-cluster-ip-range=10.96.0.0/16", "--endpoint-reconciler-type=none",
            "--allow-privileged=true",
            f"--default-not-ready-toleration-seconds={NOT_READY_TOLERATION_SECONDS}",
            f"--default-unreachable-toleration-seconds={NOT_READY_TOLERATION_SECONDS}",
            *self.apiserver_args)
        insecure = ssl.create_default_context()
        insecure.check_hostname, insecure.verify_mode = False, ssl.CERT_NONE
        self._wait_healthy("kube-apiserver", f"{self.url}/readyz", 180, self.admin_token, insecure)
        self.write_kubeconfig(self.kubeconfig, "admin", self.admin_token)

    def _start_controller_manager(self) -> None:
        kubeconfig = self.write_kubeconfig(self.workdir / "pki" / "controller-manager.kubeconfig",
                                           "system:kube-controller-manager",
                                           self._controller_token)
        port = free_port()
        self._spawn(
            "kube-controller-manager", f"--kubeconfig={kubeconfig}",
            "--bind-address=127.0.0.1", f"--secure-port={port}",
            f"--cert-dir={self.workdir / 'certs' / 'controller-manager'}",
            "--controllers=*", "--use-service-account-credentials=false", "--leader-elect=false",
            f"--service-account-private-key-file={self.workdir / 'pki' / 'sa.key'}",
            f"--root-ca-file={self.ca_file}", "--service-cluster-ip-range=10.96.0.0/16",
            f"--node-monitor-grace-period={NODE_MONITOR_GRACE_SECONDS}s",
            "--node-monitor-period=1s")
        self._wait_healthy("kube-controller-manager", f"https://127.0.0.1:{port}/healthz", 120,
                           context=_unverified())

    def _start_scheduler(self) -> None:
        kubeconfig = self.write_kubeconfig(self.workdir / "pki" / "scheduler.kubeconfig",
                                           "system:kube-scheduler", self._scheduler_token)
        port = free_port()
        self._spawn("kube-scheduler", f"--kubeconfig={kubeconfig}", "--bind-address=127.0.0.1",
                    f"--secure-port={port}", f"--cert-dir={self.workdir / 'certs' / 'scheduler'}",
                    "--leader-elect=false")
        self._wait_healthy("kube-scheduler", f"https://127.0.0.1:{port}/healthz", 120,
                           context=_unverified())


def _unverified() -> ssl.SSLContext:
    """The controller-manager and scheduler serve health on self-signed certificates."""
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    return context


def _write_service_account_keys(pki: Path) -> None:
    """The key pair that signs and verifies ServiceAccount tokens."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    (pki / "sa.key").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL,
        serialization.NoEncryption()))
    (pki / "sa.pub").write_bytes(key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    (pki / "sa.key").chmod(0o600)


@contextlib.contextmanager
def running_control_plane(workdir: Path) -> Iterator[ControlPlane]:
    """A started control plane for the duration of the block."""
    with ControlPlane(workdir) as plane:
        yield plane
