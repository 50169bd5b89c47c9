"""A node agent for tests: registers Nodes and runs the pods bound to them.

What it does as a kubelet does:
- registers each of its Nodes (capacity and allocatable cpu/memory/pods, an
  InternalIP, the Ready condition) and heartbeats through a Lease in
  `kube-node-lease` every 2 s, so the node lifecycle controller sees the node alive,
  and marks it unreachable when the heartbeats stop;
- runs each pod bound to one of its nodes (spec.nodeName): the first container's
  command and args in its workingDir, with its env (literal values, secretKeyRef /
  configMapKeyRef read from the API, fieldRef of the downward API) and its ConfigMap,
  Secret and emptyDir volumes at their mount paths (emptyDir medium Memory is a tmpfs;
  the pod's fsGroup owns the others);
- runs the container with the node's runtime (tests/cluster/containerd.py: Debian's
  containerd and runc) from the project's own image, imported beforehand (`images`;
  never pulled): PID 1 of its own PID namespace, as the securityContext's
  runAsUser/runAsGroup, with a read-only root if asked, its memory and CPU limits as
  cgroup limits (an OOM kill is reported as reason OOMKilled), the kubelet's /etc/hosts,
  /etc/resolv.conf and termination log bind-mounted, and names from cluster DNS
  (tests/cluster/cluster_dns.py) on the pod network's gateway;
- gives each pod its own network namespace and IP on a CNI bridge (see `pod_network`)
  and its hostname;
- writes pod status as the kubelet does: Pending (ContainerCreating) → Running
  with podIP, hostIP, conditions and a running container state → Succeeded or
  Failed with the container's exit code (128 + signal when killed) and reason
  (Completed, Error, OOMKilled) and the termination log's text as its message;
  restartPolicy Never is the only policy it runs;
- on graceful deletion sends SIGTERM to the container's main process, SIGKILL to
  all its processes at deletionTimestamp (the grace period), writes the final
  status, then deletes the pod with grace 0 (uid precondition) to free its name.

What it does not: only the first container runs; no init containers, probes,
hostPath/PVC volumes, no projected (service-account token) volume, no ConfigMap
updates after start, no `kubectl logs`/`exec` (the output is in
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

from cluster_dns import ClusterDNS
from containerd import Container, ContainerdError, ContainerSpec, Mount, Runtime
from kubernetes import client
from kubernetes.client.rest import ApiException
from kubernetes.utils import parse_quantity
from pod_network import PodNetwork

log = logging.getLogger("node-agent")

LEASE_NAMESPACE = "kube-node-lease"
LEASE_SECONDS = 40
HEARTBEAT_SECONDS = 2.0
POLL_SECONDS = 0.5
CLUSTER_DOMAIN = "svc.cluster.local"



def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class PodConfigError(Exception):
    """The pod cannot start yet (CreateContainerConfigError): a missing key or object."""


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
    term_sent: bool = False
    exit_code: int | None = None
    finished_at: str | None = None
    status_written: bool = False

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
class Node:
    name: str
    cpu: str = "16"
    memory: str = "64Gi"
    pods: str = "110"
    # Taints it registers with (as `kubelet --register-with-taints`), e.g. a system node's.
    taints: list[dict[str, str]] = field(default_factory=list)
    lost: bool = False


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
        self.leases = client.CoordinationV1Api(self.api)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.network.create()
        self.dns = ClusterDNS(self.network.gateway, self._dns_records).start()
        for node in self.nodes:
            self._register(node)
        for target in (self._heartbeat_loop, self._pod_loop):
            thread = threading.Thread(target=target, name=f"node-agent-{target.__name__}",
                                      daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self) -> None:
        """Stop the loops, kill every pod's processes, delete namespaces, bridge and Nodes."""
        self._stop.set()
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
        for node in self.nodes:
            with contextlib.suppress(ApiException):
                self.core.delete_node(node.name)

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
            node = next(node for node in self.nodes if node.name == name)
            node.lost = True
            lost = [pod for pod in self.running.values() if pod.node == name]
            for pod in lost:
                self.network.disconnect(pod.netns)
            for pod in lost:
                self._kill(pod)
            return [pod.name for pod in lost]

    def restore_node(self, name: str) -> None:
        """The node boots again: heartbeats and a Ready status resume; it runs new pods only."""
        with self._lock:
            node = next(node for node in self.nodes if node.name == name)
            node.lost = False
        self._write_node_status(node)
        self._renew_lease(node)

    def pod(self, name: str, namespace: str = "default") -> RunningPod:
        """The running pod `namespace/name` (KeyError when it does not run here)."""
        with self._lock:
            for pod in self.running.values():
                if pod.name == name and pod.namespace == namespace and pod.exit_code is None:
                    return pod
        raise KeyError(f"pod {namespace}/{name} is not running on this agent")

    def logs(self, lines: int = 40) -> str:
        """The last lines of every pod's output, newest pods last (for failure messages)."""
        out = []
        for path in sorted((self.workdir / "pods").glob("*/log"), key=lambda p: p.stat().st_mtime):
            text = path.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {path.parent.name} ({(path.parent / 'name').read_text()})\n"
                       + "\n".join(text))
        return "\n".join(out)

    # ---- nodes -------------------------------------------------------------------------

    def _register(self, node: Node) -> None:
        body = {
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": node.name, "labels": {
                "kubernetes.io/hostname": node.name, "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64"}},
            "spec": {"taints": node.taints} if node.taints else {},
        }
        try:
            self.core.create_node(body)
        except ApiException as error:
            if error.status != 409:
                raise
        self._write_node_status(node)
        self._renew_lease(node)

    def _write_node_status(self, node: Node) -> None:
        capacity = {"cpu": node.cpu, "memory": node.memory, "pods": node.pods}
        now = _now()
        conditions = [
            {"type": kind, "status": "False", "reason": f"KubeletHas{reason}",
             "lastHeartbeatTime": now, "lastTransitionTime": now}
            for kind, reason in (("MemoryPressure", "SufficientMemory"),
                                 ("DiskPressure", "NoDiskPressure"),
                                 ("PIDPressure", "SufficientPID"))
        ]
        conditions.append({"type": "Ready", "status": "True", "reason": "KubeletReady",
                           "message": "node agent is posting ready status",
                           "lastHeartbeatTime": now, "lastTransitionTime": now})
        self.core.patch_node_status(node.name, {"status": {
            "capacity": capacity, "allocatable": capacity, "conditions": conditions,
            "addresses": [{"type": "InternalIP", "address": self.network.gateway},
                          {"type": "Hostname", "address": node.name}],
            "nodeInfo": {"kubeletVersion": "v1.36.2-node-agent", "operatingSystem": "linux",
                         "architecture": "amd64", "containerRuntimeVersion": "containerd://1.6",
                         "kernelVersion": os.uname().release, "osImage": "node-agent",
                         "kubeProxyVersion": "", "machineID": "", "systemUUID": "",
                         "bootID": ""}}})

    def _renew_lease(self, node: Node) -> None:
        now = datetime.now(UTC)
        spec = {"holderIdentity": node.name, "leaseDurationSeconds": LEASE_SECONDS,
                "renewTime": now.strftime("%Y-%m-%dT%H:%M:%S.%fZ")}
        try:
            self.leases.patch_namespaced_lease(node.name, LEASE_NAMESPACE, {"spec": spec})
        except ApiException as error:
            if error.status != 404:
                raise
            self.leases.create_namespaced_lease(LEASE_NAMESPACE, {
                "metadata": {"name": node.name, "ownerReferences": [{
                    "apiVersion": "v1", "kind": "Node", "name": node.name,
                    "uid": self.core.read_node(node.name).metadata.uid}]},
                "spec": spec})

    def _heartbeat_loop(self) -> None:
        beats = 0
        while not self._stop.wait(HEARTBEAT_SECONDS):
            beats += 1
            for node in self.nodes:
                if node.lost:
                    continue
                try:
                    self._renew_lease(node)
                    if beats % 5 == 0:  # the kubelet posts node status every 10 s
                        self._write_node_status(node)
                except Exception:
                    log.exception("heartbeat of %s failed", node.name)

    # ---- pods --------------------------------------------------------------------------

    def _live_nodes(self) -> set[str]:
        return {node.name for node in self.nodes if not node.lost}

    def _pod_loop(self) -> None:
        while not self._stop.wait(POLL_SECONDS):
            try:
                self._sync_pods()
            except Exception:
                log.exception("pod sync failed")

    def _sync_pods(self) -> None:
        listed = self.core.list_pod_for_all_namespaces().items
        mine = {pod.metadata.uid: pod for pod in listed if pod.spec.node_name in self._live_nodes()
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
            # Pods gone from the API (force-deleted) or whose node was lost: stop and forget.
            for uid, running in list(self.running.items()):
                if uid not in mine:
                    self._kill(running)
                    self._teardown(running)
                    del self.running[uid]

    def _check(self, running: RunningPod, pod: Any) -> None:
        """Advance one started pod: notice its exit, signal it when deleted, finish deletion."""
        code = running.poll()
        if code is not None and running.exit_code is None:
            running.exit_code = code
            running.finished_at = _now()
            self._kill(running)  # stray children die with the container
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
        if running.exit_code is not None and not running.status_written:
            self._write_terminated(running, pod)
            running.status_written = True
            self._teardown(running)
        if deleting is not None and running.exit_code is not None:
            if not running.status_written:
                self._write_terminated(running, pod)
                running.status_written = True
            self._teardown(running)
            self._delete_final(pod)
            del self.running[running.uid]

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
        container = spec.containers[0]
        folder = self.workdir / "pods" / meta.uid
        policy = spec.restart_policy or "Always"  # the API server's default
        if policy != "Never":
            log.warning("pod %s/%s: restartPolicy %s run as Never", meta.namespace, meta.name,
                        policy)
        try:
            env = self._env(pod, container)
            volumes = self._volumes(pod, folder)
        except PodConfigError as error:
            self._write_waiting(pod, "CreateContainerConfigError", str(error))
            return
        netns, ip = self.network.add_pod(meta.uid[:8])
        hostnames = self._hostnames(pod)
        running = RunningPod(uid=meta.uid, namespace=meta.namespace, name=meta.name,
                             node=spec.node_name, folder=folder, netns=netns, ip=ip,
                             hostnames=hostnames, started_at=_now())
        self._write_status(pod, phase="Pending", ip=ip, container_state={
            "waiting": {"reason": "ContainerCreating"}}, ready=False)
        env.setdefault("HOSTNAME", hostnames[-1])
        try:
            running.container = self._run_container(pod, container, running, env, volumes)
        except PodConfigError as error:
            self.network.remove_pod(netns, ip)
            self._write_waiting(pod, "CreateContainerError", str(error))
            return
        self.running[meta.uid] = running
        self._write_status(pod, phase="Running", ip=ip, container_state={
            "running": {"startedAt": running.started_at}}, ready=True)
        log.info("pod %s/%s started on %s at %s (container %s)", meta.namespace, meta.name,
                 spec.node_name, ip, running.container.id)

    def _hostnames(self, pod: Any) -> list[str]:
        """The names cluster DNS gives this pod, most qualified first, bare hostname last."""
        hostname = pod.spec.hostname or pod.metadata.name
        names = []
        if pod.spec.subdomain:
            names += [f"{hostname}.{pod.spec.subdomain}.{pod.metadata.namespace}.{CLUSTER_DOMAIN}",
                      f"{hostname}.{pod.spec.subdomain}"]
        return [*names, hostname]

    def _env(self, pod: Any, container: Any) -> dict[str, str]:
        """The container's environment: the image's, then the pod's own entries in order."""
        env = dict(self.image_env)  # the image's own env comes first, from the runtime
        for entry in container.env or []:
            if entry.value_from is None:
                env[entry.name] = _expand(entry.value or "", env)
                continue
            source = entry.value_from
            if source.secret_key_ref is not None:
                value = self._key(pod, "secret", source.secret_key_ref)
            elif source.config_map_key_ref is not None:
                value = self._key(pod, "configmap", source.config_map_key_ref)
            elif source.field_ref is not None:
                value = self._field(pod, source.field_ref.field_path)
            else:
                raise PodConfigError(f"env {entry.name}: only secretKeyRef, configMapKeyRef "
                                     "and fieldRef are supported by the node agent")
            if value is not None:
                env[entry.name] = value
        return env

    def _key(self, pod: Any, kind: str, ref: Any) -> str | None:
        data = self._object_data(pod.metadata.namespace, kind, ref.name, ref.optional)
        if data is None or ref.key not in data:
            if ref.optional:
                return None
            raise PodConfigError(f"{kind} {ref.name!r} has no key {ref.key!r}")
        return data[ref.key]

    def _object_data(self, namespace: str, kind: str, name: str,
                     optional: bool | None) -> dict[str, str] | None:
        try:
            if kind == "secret":
                secret = self.core.read_namespaced_secret(name, namespace)
                return {k: base64.b64decode(v).decode() for k, v in (secret.data or {}).items()}
            config = self.core.read_namespaced_config_map(name, namespace)
            return dict(config.data or {})
        except ApiException as error:
            if error.status == 404:
                if optional:
                    return None
                raise PodConfigError(f"{kind} {namespace}/{name} not found") from None
            raise

    def _field(self, pod: Any, path: str) -> str:
        meta = pod.metadata
        simple = {"metadata.name": meta.name, "metadata.namespace": meta.namespace,
                  "metadata.uid": meta.uid, "spec.nodeName": pod.spec.node_name,
                  "spec.serviceAccountName": pod.spec.service_account_name or "default",
                  "status.hostIP": self.network.gateway}
        if path in simple:
            return simple[path] or ""
        if path in ("status.podIP", "status.podIPs"):
            raise PodConfigError("fieldRef status.podIP is resolved after start: unsupported")
        for prefix, values in (("metadata.labels['", meta.labels or {}),
                               ("metadata.annotations['", meta.annotations or {})):
            if path.startswith(prefix) and path.endswith("']"):
                return values.get(path[len(prefix):-2], "")
        raise PodConfigError(f"fieldRef {path} is not supported by the node agent")

    def _volumes(self, pod: Any, folder: Path) -> list[tuple[str, str, bool]]:
        """Materialise the mounted volumes under `folder`; returns (source, mountPath, tmpfs)."""
        container = pod.spec.containers[0]
        by_name = {volume.name: volume for volume in pod.spec.volumes or []}
        mounts = []
        for mount in container.volume_mounts or []:
            volume = by_name[mount.name]
            source = folder / "volumes" / mount.name
            source.mkdir(parents=True, exist_ok=True)
            tmpfs = False
            if volume.config_map is not None or volume.secret is not None:
                ref = volume.config_map or volume.secret
                kind = "configmap" if volume.config_map is not None else "secret"
                name = ref.name if kind == "configmap" else ref.secret_name
                data = self._object_data(pod.metadata.namespace, kind, name, ref.optional) or {}
                items = ({item.key: item.path for item in ref.items} if ref.items
                         else {key: key for key in data})
                for key, path in items.items():
                    target = source / path
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_text(data[key])
            elif volume.empty_dir is not None:
                tmpfs = volume.empty_dir.medium == "Memory"
                group = pod.spec.security_context.fs_group if pod.spec.security_context else None
                if group is not None:  # as the kubelet: the pod's fsGroup owns and may write it
                    os.chown(source, 0, group)
                    source.chmod(0o2775)
            elif volume.projected is not None:
                # The service-account token volume: pods of this agent do not call the API.
                log.info("pod %s: projected volume %s not mounted", pod.metadata.name, mount.name)
                continue
            else:
                raise PodConfigError(f"volume {mount.name}: only configMap, secret and emptyDir "
                                     "are supported by the node agent")
            mounts.append((str(source), mount.mount_path, tmpfs))
        return mounts

    def _run_container(self, pod: Any, container: Any, running: RunningPod,
                       env: dict[str, str], volumes: list[tuple[str, str, bool]]) -> Container:
        """Start the pod's container with the runtime, from the image the pod names."""
        assert self.dns is not None  # started with the agent
        image = self.images.get(container.image or "")
        if image is None:
            raise PodConfigError(f"image {container.image!r} is not on this node and is never "
                                 f"pulled (ErrImageNeverPull); it has {sorted(self.images)}")
        folder = running.folder
        folder.mkdir(parents=True, exist_ok=True)
        # The files the kubelet writes for each pod: hosts, resolv.conf, the termination log.
        hostname = running.hostnames[-1]
        hosts = folder / "hosts"
        hosts.write_text("127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"
                         f"{running.ip}\t{' '.join(running.hostnames)}\n")
        resolv = folder / "resolv.conf"
        resolv.write_text(self.dns.resolv_conf(running.namespace))
        termination_log = folder / "termination-log"
        termination_log.touch()
        termination_log.chmod(0o666)  # the container's user writes it, whoever that is
        mounts = [Mount.bind(hosts, "/etc/hosts", read_only=True),
                  Mount.bind(resolv, "/etc/resolv.conf", read_only=True),
                  Mount.bind(termination_log, container.termination_message_path
                             or "/dev/termination-log")]
        for source, target, tmpfs in volumes:
            mounts.append(Mount.tmpfs(target) if tmpfs else Mount.bind(source, target))
        security = _security(pod, container)
        limits = (container.resources.limits or {}) if container.resources else {}
        (folder / "name").write_text(f"{pod.metadata.namespace}/{pod.metadata.name}")
        command = [_expand(arg, env) for arg in container.command or []]
        args = [_expand(arg, env) for arg in container.args or []]
        (folder / "command").write_text(shlex.join([*command, *args]) + "\n")
        spec = ContainerSpec(
            name=f"{pod.metadata.name}-{pod.metadata.uid[:8]}", image=image,
            command=command or None, args=args or None,
            env=env, working_dir=container.working_dir,
            user=security.get("user"), read_only_rootfs=security.get("read_only", False),
            memory_limit=int(parse_quantity(limits["memory"])) if "memory" in limits else None,
            cpu_limit=float(parse_quantity(limits["cpu"])) if "cpu" in limits else None,
            mounts=mounts, network_namespace=PodNetwork.namespace_path(running.netns),
            hostname=hostname, log_path=folder / "log")
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
            pod.finished_at = _now()

    def _teardown(self, pod: RunningPod) -> None:
        if pod.container is not None:
            pod.container.remove()
        self.network.remove_pod(pod.netns, pod.ip)

    # ---- status ------------------------------------------------------------------------

    def _write_waiting(self, pod: Any, reason: str, message: str) -> None:
        log.warning("pod %s/%s: %s: %s", pod.metadata.namespace, pod.metadata.name, reason,
                    message)
        self._write_status(pod, phase="Pending", ip=None, ready=False, container_state={
            "waiting": {"reason": reason, "message": message}})

    def _write_terminated(self, running: RunningPod, pod: Any) -> None:
        code = running.exit_code or 0
        reason = "Completed" if code == 0 else "OOMKilled" if running.oom_killed else "Error"
        terminated = {"exitCode": code, "reason": reason,
                      "startedAt": running.started_at,
                      "finishedAt": running.finished_at or _now()}
        # As the kubelet: the termination log's first 4 KiB, else (FallbackToLogsOnError,
        # on failure) the output's last lines.
        message = _head(running.folder / "termination-log", 4096)
        container = pod.spec.containers[0]
        if (not message and code != 0
                and container.termination_message_policy == "FallbackToLogsOnError"):
            message = "\n".join(_head(running.folder / "log", None).splitlines()[-80:])[-2048:]
        if message:
            terminated["message"] = message
        self._write_status(pod, phase="Succeeded" if code == 0 else "Failed", ip=running.ip,
                           ready=False, container_state={"terminated": terminated})
        log.info("pod %s/%s exited %d", running.namespace, running.name, code)

    def _write_status(self, pod: Any, *, phase: str, ip: str | None, ready: bool,
                      container_state: Mapping[str, Any]) -> None:
        now = _now()
        ready_text = "True" if ready else "False"
        conditions = [
            {"type": "PodReadyToStartContainers", "status": "True" if ip else "False"},
            {"type": "Initialized", "status": "True"},
            {"type": "Ready", "status": ready_text},
            {"type": "ContainersReady", "status": ready_text},
            {"type": "PodScheduled", "status": "True"},
        ]
        for condition in conditions:
            condition["lastTransitionTime"] = now
        container = pod.spec.containers[0]
        status: dict[str, Any] = {
            "phase": phase, "hostIP": self.network.gateway,
            "hostIPs": [{"ip": self.network.gateway}], "conditions": conditions,
            "startTime": now if pod.status.start_time is None else None,
            "containerStatuses": [{
                "name": container.name, "image": container.image or "",
                "imageID": "", "ready": ready, "restartCount": 0,
                "started": "running" in container_state, "state": dict(container_state)}],
        }
        if status["startTime"] is None:
            del status["startTime"]
        if ip:
            status["podIP"], status["podIPs"] = ip, [{"ip": ip}]
        try:
            self.core.patch_namespaced_pod_status(pod.metadata.name, pod.metadata.namespace,
                                                  {"status": status})
        except ApiException as error:
            if error.status != 404:
                raise


def _security(pod: Any, container: Any) -> dict[str, Any]:
    """The user (uid, gid) and read-only root of a container: its securityContext over the pod's."""
    pod_context, own = pod.spec.security_context, container.security_context
    uid = (own.run_as_user if own and own.run_as_user is not None
           else pod_context.run_as_user if pod_context else None)
    gid = (own.run_as_group if own and own.run_as_group is not None
           else pod_context.run_as_group if pod_context else None)
    found: dict[str, Any] = {"read_only": bool(own and own.read_only_root_filesystem)}
    if uid is not None:
        # As Kubernetes: without runAsGroup the primary group is root's.
        found["user"] = (uid, gid if gid is not None else 0)
    return found


def _head(path: Path, limit: int | None) -> str:
    """The first `limit` bytes of a file as text ('' when it is missing)."""
    try:
        with path.open("rb") as file:
            return file.read(limit if limit is not None else -1).decode(errors="replace")
    except OSError:
        return ""


def _expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in env values, command and args; $$ escapes."""
    out, index = [], 0
    while index < len(text):
        if text.startswith("$$", index):
            out.append("$")
            index += 2
        elif text.startswith("$(", index) and ")" in text[index:]:
            end = text.index(")", index)
            name = text[index + 2:end]
            out.append(env.get(name, text[index:end + 1]))
            index = end + 1
        else:
            out.append(text[index])
            index += 1
    return "".join(out)
