"""A node agent for tests: registers Nodes and runs the pods bound to them.

What it does as a kubelet does, in four rooms:
- node_heartbeats.py: registers each of its Nodes and heartbeats through a Lease in
  `kube-node-lease`, so the node lifecycle controller sees the node alive, and marks it
  unreachable when the heartbeats stop (`lose_node`);
- pod_config.py: turns a pod spec into its container's config (env with secretKeyRef,
  configMapKeyRef and fieldRef, `$(VAR)` expansion, volumes, user, limits, hostnames),
  pure, so it is unit-tested without root;
- pod_status.py: writes pod status as the kubelet does: Pending (ContainerCreating) →
  Running → Succeeded or Failed with exit code, reason (Completed, Error, OOMKilled) and
  the termination log's text;
- here, the pod loop: runs each pod bound to one of its nodes (spec.nodeName), with the
  node's runtime (tests/cluster/containerd.py: Debian's containerd and runc) from the
  project's own image, imported beforehand (`images`; never pulled): PID 1 of its own
  PID namespace, its ConfigMap, Secret, emptyDir and hostPath volumes at their mount
  paths, read-only where the mount says so (emptyDir medium Memory is a tmpfs; the pod's
  fsGroup owns the others; a hostPath is the machine's folder itself), its memory
  and CPU limits as cgroup limits, the kubelet's /etc/hosts, /etc/resolv.conf and
  termination log bind-mounted, its own network namespace and IP on a CNI bridge (see
  `pod_network`), its hostname, and names from cluster DNS (tests/cluster/cluster_dns.py)
  on the pod network's gateway; restartPolicy Never is the only policy it runs;
- pod_logs.py: each container's output kept as the kubelet keeps it, every line stamped
  when read (`container_log`), for the API server to serve `pods/{name}/log` from
  (tests/cluster/emulator.py's `kubelets`), following as kubectl does;
- on graceful deletion sends SIGTERM to the container's main process, SIGKILL to
  all its processes at deletionTimestamp (the grace period), writes the final
  status, then deletes the pod with grace 0 (uid precondition) to free its name.

What it does not: only the first container runs; no init containers, probes,
PVC volumes, no projected (service-account token) volume, no ConfigMap
updates after start, no `kubectl exec` (the raw output is also in
`<workdir>/pods/<uid>/log`), no kube-proxy, no CPU shares from requests.

Pods are found by listing every 0.5 s rather than by a watch: one small list per
tick costs little on 2 cores and needs no resume logic.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import os
import shlex
import signal
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from cluster_dns import ClusterDNS, ServiceRecords
from containerd import Container, ContainerdError, ContainerSpec, Mount, Runtime
from kubernetes import client
from kubernetes.client.rest import ApiException
from node_heartbeats import Node, NodeHeartbeats
from pod_config import (
    CLUSTER_DOMAIN,
    ContainerConfig,
    PodConfigError,
    Reference,
    Volume,
    hosts_file,
    references,
    resolve,
)
from pod_logs import ContainerLog
from pod_network import PodNetwork
from pod_status import PodStatusWriter, api_now

__all__ = ["Node", "NodeAgent", "PodConfigError", "RunningPod"]

log = logging.getLogger("node-agent")

POLL_SECONDS = 0.5
# A kubelet notices a container's exit at its next relist (PLEG, every second) and only
# then stops the pod's sandbox, so a pod's network outlives its processes by a second or
# more: a peer that sends to a killed process meanwhile gets a reset. Torn down at once,
# the address answered nothing, and a live replica group's send to the killed one waited
# out its collective's timeout, as for a lost node (issue 49).
SANDBOX_STOP_SECONDS = 1.0


@dataclass
class RunningPod:
    """One pod this agent started: its container, network namespace and folder."""

    uid: str
    namespace: str
    name: str
    node: str
    folder: Path
    netns: str
    ip: str
    hostnames: list[str]
    started_at: str
    container: Container | None = None  # None until the runtime started it
    log: ContainerLog | None = None  # the container's output as stamped lines, once started
    term_sent: bool = False
    exit_code: int | None = None
    finished_at: str | None = None
    status_written: bool = False
    ended_at: float | None = None  # time.monotonic() when the agent saw the container end
    network_removed: bool = False

    @property
    def pid(self) -> int:
        """The host pid of the container's main process."""
        return self.processes()[0]

    def processes(self) -> list[int]:
        """The host pids of the container's processes, its main process first."""
        return self.container.pids() if self.container is not None else []

    def poll(self) -> int | None:
        """The exit status (128 + N when killed by signal N) once the container has ended."""
        assert self.container is not None
        return None if self.container.running else self.container.wait(timeout=10)

    @property
    def oom_killed(self) -> bool:
        return self.container is not None and self.container.oom_killed


@dataclass
class NodeAgent:
    """The kubelets of `nodes`, in one thread of the test process.

    `image_env` is added to every container's environment, under the pod's own
    env (the image's comes first), e.g. OMP_NUM_THREADS=1 so that several trainers share
    2 cores.
    """

    api: client.ApiClient
    workdir: Path
    runtime: Runtime  # the node's container runtime
    nodes: list[Node] = field(default_factory=lambda: [Node("node-a"), Node("node-b")])
    image_env: dict[str, str] = field(default_factory=dict)
    # Only pods of these namespaces run (None: all). The API server may be shared by the
    # whole test session, and other tests leave pods that no kubelet is meant to run.
    namespaces: set[str] | None = None
    network: PodNetwork = field(default_factory=lambda: PodNetwork(uuid.uuid4().hex[:4]))
    # The images the node has: a pod's image name → the runtime's imported reference
    # (nothing is ever pulled).
    images: Mapping[str, str] = field(default_factory=dict)
    dns: ClusterDNS | None = None
    running: dict[str, RunningPod] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.RLock = field(default_factory=threading.RLock)

    # ---- lifecycle ---------------------------------------------------------------------

    def start(self) -> NodeAgent:
        """Create the pod network, register the nodes and start heartbeats and the pod loop."""
        self.core = client.CoreV1Api(self.api)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.network.create()
        self.dns = ClusterDNS(self.network.gateway, self._dns_records,
                              services=ServiceRecords(self.api)).start()
        self.status = PodStatusWriter(self.core, self.network.gateway)
        self.heartbeats = NodeHeartbeats(self.api, self.nodes, self.network.gateway).start()
        thread = threading.Thread(target=self._pod_loop, name="node-agent-pods", daemon=True)
        thread.start()
        self._threads.append(thread)
        return self

    def stop(self) -> None:
        """Stop the loops, kill every pod's processes, delete namespaces, bridge and Nodes."""
        self._stop.set()
        self.heartbeats.stop()
        for thread in self._threads:
            thread.join(timeout=10)
        with self._lock:
            for pod in list(self.running.values()):
                self._kill(pod)
                self._teardown(pod)
            self.running.clear()
        if self.dns is not None:
            self.dns.stop()
        self.network.destroy()
        self.heartbeats.deregister()

    def __enter__(self) -> NodeAgent:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()

    # ---- what tests do to nodes and pods ---------------------------------------------------

    def lose_node(self, name: str) -> list[str]:
        """The node powers off: its network goes silent, its processes die, its heartbeats
        and status stop.

        The pods' interfaces go down before their processes are killed, so no peer gets
        a FIN or RST from them, as from a machine that lost power. Its pods stay in the
        API as the kubelet last wrote them, as when a real node dies; returns their names.
        """
        with self._lock:
            self.heartbeats.lose(name)
            lost = [pod for pod in self.running.values() if pod.node == name]
            for pod in lost:
                self.network.disconnect(pod.netns)
            for pod in lost:
                self._kill(pod)
            return [pod.name for pod in lost]

    def restore_node(self, name: str) -> None:
        """The node boots again: heartbeats and a Ready status resume; it runs new pods only."""
        self.heartbeats.restore(name)

    def pod(self, name: str, namespace: str = "default") -> RunningPod:
        """The running pod `namespace/name` (KeyError when it does not run here)."""
        with self._lock:
            for pod in self.running.values():
                if pod.name == name and pod.namespace == namespace and pod.exit_code is None:
                    return pod
        raise KeyError(f"pod {namespace}/{name} is not running on this agent")

    def container_log(self, namespace: str, name: str, uid: str) -> ContainerLog | None:
        """The log of pod `namespace/name`'s container in its incarnation `uid`, while this
        agent has the pod and its container started; else None. What the API server asks
        a kubelet for `pods/{name}/log` (tests/cluster/emulator.py).

        Without the agent's lock: the pod loop holds it while it calls the API, and the API
        server waiting here for it would never answer that call (a dict lookup needs none).
        """
        pod = self.running.get(uid)
        if pod is None or (pod.namespace, pod.name) != (namespace, name):
            return None
        return pod.log

    def logs(self, lines: int = 40) -> str:
        """The last lines of every pod's output, newest pods last (for failure messages)."""
        out = []
        for path in sorted((self.workdir / "pods").glob("*/log"), key=lambda p: p.stat().st_mtime):
            text = path.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {path.parent.name} ({(path.parent / 'name').read_text()})\n"
                       + "\n".join(text))
        return "\n".join(out)

    # ---- the pod loop ------------------------------------------------------------------

    def _pod_loop(self) -> None:
        while not self._stop.wait(POLL_SECONDS):
            try:
                self._sync_pods()
            except Exception:
                log.exception("pod sync failed")

    def _sync_pods(self) -> None:
        listed: list[Any] = self.core.list_pod_for_all_namespaces().items
        live = self.heartbeats.live()
        mine = {pod.metadata.uid: pod for pod in listed if pod.spec.node_name in live
                and (self.namespaces is None or pod.metadata.namespace in self.namespaces)}
        with self._lock:
            for uid, pod in mine.items():
                running = self.running.get(uid)
                if running is None:
                    if pod.metadata.deletion_timestamp is not None:
                        self._delete_final(pod)
                    elif pod.status.phase in (None, "Pending"):
                        self._start(pod)
                    continue
                self._check(running, pod)
                if running.log is not None:
                    running.log.collect()  # each line stamped when read, as a runtime does
            # Pods gone from the API (force-deleted) or whose node was lost: stop and forget.
            for uid, running in list(self.running.items()):
                if uid not in mine:
                    self._kill(running)
                    if running.log is not None:
                        running.log.finish()  # a follower's answer ends with the pod
                    self._teardown(running)
                    del self.running[uid]

    def _check(self, running: RunningPod, pod: Any) -> None:
        """Advance one started pod: notice its exit, signal it when deleted, finish deletion."""
        code = running.poll()
        if code is not None and running.exit_code is None:
            running.exit_code = code
            running.finished_at = api_now()
            self._kill(running)  # stray children die with the container
        if running.exit_code is not None and running.log is not None:
            running.log.finish()
        deleting = pod.metadata.deletion_timestamp
        if deleting is not None and running.exit_code is None:
            if not running.term_sent:
                log.info("pod %s/%s: SIGTERM (grace %ss)", running.namespace, running.name,
                         pod.metadata.deletion_grace_period_seconds)
                self._signal_main(running, signal.SIGTERM)
                running.term_sent = True
            elif datetime.now(UTC) >= deleting:
                log.info("pod %s/%s: grace period over, SIGKILL", running.namespace, running.name)
                self._kill(running)
            return
        if running.exit_code is None:
            return
        if not running.status_written:
            self._write_terminated(running, pod)
        self._stop_sandbox(running)
        if deleting is not None and running.network_removed:
            self._delete_final(pod)
            del self.running[running.uid]

    def _stop_sandbox(self, pod: RunningPod) -> None:
        """An ended pod's container goes at once, its network SANDBOX_STOP_SECONDS later."""
        if pod.container is not None:
            pod.container.remove()
        if pod.ended_at is None:
            pod.ended_at = time.monotonic()
        if time.monotonic() >= pod.ended_at + SANDBOX_STOP_SECONDS:
            self.network.remove_pod(pod.netns, pod.ip)
            pod.network_removed = True

    def _write_terminated(self, running: RunningPod, pod: Any) -> None:
        self.status.terminated(pod, ip=running.ip, exit_code=running.exit_code or 0,
                               oom_killed=running.oom_killed, started_at=running.started_at,
                               finished_at=running.finished_at, folder=running.folder)
        running.status_written = True

    def _delete_final(self, pod: Any) -> None:
        """The kubelet's last word on a pod: delete with grace 0, only that incarnation (uid)."""
        try:
            self.core.delete_namespaced_pod(
                pod.metadata.name, pod.metadata.namespace, grace_period_seconds=0,
                body=client.V1DeleteOptions(grace_period_seconds=0, preconditions=
                                            client.V1Preconditions(uid=pod.metadata.uid)))
        except ApiException as error:
            if error.status not in (404, 409):
                raise

    # ---- starting a pod ----------------------------------------------------------------

    def _start(self, pod: Any) -> None:
        meta, spec = pod.metadata, pod.spec
        folder = self.workdir / "pods" / meta.uid
        policy = spec.restart_policy or "Always"  # the API server's default
        if policy != "Never":
            log.warning("pod %s/%s: restartPolicy %s run as Never", meta.namespace, meta.name,
                        policy)
        referenced = self._referenced(pod)
        # The pod's address first: status.podIP fieldRefs in its env read it.
        netns, ip = self.network.add_pod(meta.uid[:8])
        try:
            config = resolve(pod, referenced, host_ip=self.network.gateway,
                             image_env=self.image_env, pod_ip=ip)
        except PodConfigError as error:
            self.network.remove_pod(netns, ip)
            self.status.waiting(pod, "CreateContainerConfigError", str(error))
            return
        try:
            volumes = _write_volumes(config.volumes, folder)
        except PodConfigError as error:
            self.network.remove_pod(netns, ip)
            self.status.waiting(pod, "CreateContainerConfigError", str(error))
            return
        running = RunningPod(uid=meta.uid, namespace=meta.namespace, name=meta.name,
                             node=spec.node_name, folder=folder, netns=netns, ip=ip,
                             hostnames=config.hostnames, started_at=api_now())
        self.status.creating(pod, ip)
        try:
            running.container = self._run_container(pod, config, running, volumes)
        except PodConfigError as error:
            self.network.remove_pod(netns, ip)
            self.status.waiting(pod, "CreateContainerError", str(error))
            return
        running.log = ContainerLog(folder / "log")
        self.running[meta.uid] = running
        self.status.running(pod, ip, running.started_at)
        log.info("pod %s/%s started on %s at %s (container %s)", meta.namespace, meta.name,
                 spec.node_name, ip, running.container.id)

    def _referenced(self, pod: Any) -> dict[Reference, dict[str, str]]:
        """The data of the ConfigMaps and Secrets the pod refers to that exist (secrets decoded)."""
        namespace, found = pod.metadata.namespace, {}
        for kind, name in references(pod):
            try:
                if kind == "secret":
                    secret = self.core.read_namespaced_secret(name, namespace)
                    found[kind, name] = {key: base64.b64decode(value).decode()
                                         for key, value in (secret.data or {}).items()}
                else:
                    config_map = self.core.read_namespaced_config_map(name, namespace)
                    found[kind, name] = dict(config_map.data or {})
            except ApiException as error:
                if error.status != 404:
                    raise
        return found

    def _run_container(self, pod: Any, config: ContainerConfig, running: RunningPod,
                       volumes: list[Mount]) -> Container:
        """Start the pod's container with the runtime, from the image the pod names."""
        assert self.dns is not None  # started with the agent
        image = self.images.get(config.image)
        if image is None:
            raise PodConfigError(f"image {config.image!r} is not on this node and is never "
                                 f"pulled (ErrImageNeverPull); it has {sorted(self.images)}")
        folder = running.folder
        folder.mkdir(parents=True, exist_ok=True)
        # The files the kubelet writes for each pod: hosts, resolv.conf, the termination log.
        hosts = folder / "hosts"
        hosts.write_text(hosts_file(running.ip, running.hostnames))
        resolv = folder / "resolv.conf"
        resolv.write_text(self.dns.resolv_conf(running.namespace))
        termination_log = folder / "termination-log"
        termination_log.touch()
        termination_log.chmod(0o666)  # the container's user writes it, whoever that is
        mounts = [Mount.bind(hosts, "/etc/hosts", read_only=True),
                  Mount.bind(resolv, "/etc/resolv.conf", read_only=True),
                  Mount.bind(termination_log, config.termination_message_path), *volumes]
        (folder / "name").write_text(f"{pod.metadata.namespace}/{pod.metadata.name}")
        (folder / "command").write_text(shlex.join([*config.command, *config.args]) + "\n")
        spec = ContainerSpec(
            name=f"{pod.metadata.name}-{pod.metadata.uid[:8]}", image=image,
            command=config.command or None, args=config.args or None,
            env=config.env, working_dir=config.working_dir, user=config.user,
            read_only_rootfs=config.read_only_rootfs, memory_limit=config.memory_limit,
            cpu_limit=config.cpu_limit, mounts=mounts,
            network_namespace=PodNetwork.namespace_path(running.netns),
            hostname=config.hostname, log_path=folder / "log")
        try:
            return self.runtime.run(spec)
        except ContainerdError as error:
            raise PodConfigError(str(error)) from error

    def _dns_records(self) -> dict[str, str]:
        """Cluster DNS's A records: each running pod's fully qualified name → its IP."""
        with self._lock:
            return {name: pod.ip for pod in self.running.values() if pod.exit_code is None
                    for name in pod.hostnames if name.endswith(CLUSTER_DOMAIN)}

    # ---- stopping a pod ----------------------------------------------------------------

    def _signal_main(self, pod: RunningPod, sig: signal.Signals) -> None:
        """As a runtime signals PID 1 of the container: the main process only."""
        if pod.container is not None:
            with contextlib.suppress(ContainerdError):
                pod.container.signal(sig)

    def _kill(self, pod: RunningPod) -> None:
        """SIGKILL every process of the container, as tearing down its cgroup."""
        if pod.container is None:
            return
        pod.container.kill()
        deadline = time.monotonic() + 10
        while (code := pod.poll()) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if pod.exit_code is None and code is not None:
            pod.exit_code = code
            pod.finished_at = api_now()

    def _teardown(self, pod: RunningPod) -> None:
        if pod.container is not None:
            pod.container.remove()
        self.network.remove_pod(pod.netns, pod.ip)


def _write_volumes(volumes: list[Volume], folder: Path) -> list[Mount]:
    """Make each volume under `folder`/volumes as the kubelet does; returns their mounts."""
    mounts = []
    for volume in volumes:
        if volume.host_path is not None:  # the node's own folder, as it is
            if not Path(volume.host_path).is_dir():
                raise PodConfigError(f"hostPath type check failed: {volume.host_path} is "
                                     "not a directory")
            mounts.append(Mount.bind(volume.host_path, volume.mount_path,
                                     read_only=volume.read_only))
            continue
        source = folder / "volumes" / volume.name
        source.mkdir(parents=True, exist_ok=True)
        for path, text in volume.files.items():
            target = source / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
        if volume.group is not None:  # as the kubelet: the pod's fsGroup owns and may write it
            os.chown(source, 0, volume.group)
            source.chmod(0o2775)
        mounts.append(Mount.tmpfs(volume.mount_path) if volume.tmpfs
                      else Mount.bind(source, volume.mount_path, read_only=volume.read_only))
    return mounts
