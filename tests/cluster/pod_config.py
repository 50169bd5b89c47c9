"""What the node agent makes of a pod spec before it runs anything: the container's config.

What it resolves as the kubelet does (kuberuntime's generateContainerConfig, its
makeEnvironmentVariables and makeMounts), for the first container of a pod:
- the environment: the image's env first (`image_env`), then the pod's own entries in
  order: literal values with Kubernetes' `$(VAR)` expansion of the entries before them
  (`$$` escapes, an unknown name stays as written), secretKeyRef and configMapKeyRef
  (`optional` honoured), and fieldRef of the downward API (metadata.name, namespace, uid,
  labels['…'], annotations['…'], spec.nodeName, spec.serviceAccountName, status.hostIP);
  HOSTNAME is the pod's hostname unless the pod sets it;
- command and args with `$(VAR)` expanded from that environment;
- the mounted volumes: a configMap's or a secret's keys (all of them, or `items` at their
  paths) as files, an emptyDir (medium Memory: a tmpfs; owned by the pod's fsGroup), a
  hostPath folder of the node (type unset or Directory); a mount's readOnly kept;
- the user: the container's runAsUser/runAsGroup over the pod's (group 0 without
  runAsGroup), and a read-only root filesystem if asked;
- the memory and CPU limits as bytes and cores;
- the names the pod answers to: `<hostname>.<subdomain>.<namespace>.svc.cluster.local`,
  `<hostname>.<subdomain>`, then the bare hostname, and the /etc/hosts that lists them.
A pod the kubelet would refuse with CreateContainerConfigError (a missing object or key,
an env or volume source the agent does not support) raises `PodConfigError` with the
kubelet's kind of message.

What it does not: read the API or touch the machine. The caller reads the ConfigMaps and
Secrets that `references` names and passes their data in (secrets decoded); writing the
volumes' files, mounting, the network and starting the container are the node agent's.
status.podIP only where the caller knows the pod's address before start (`pod_ip`; the
node agent allocates it first), no resourceFieldRef, no envFrom, no PVC or projected
volumes (the service-account token volume is skipped: pods of the agent do not call the
API), no hostPath type other than Directory, no subPath.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kubernetes.utils import parse_quantity

log = logging.getLogger("node-agent")

CLUSTER_DOMAIN = "svc.cluster.local"
DEFAULT_TERMINATION_MESSAGE_PATH = "/dev/termination-log"

# An object a pod refers to: ("configmap" or "secret", its name in the pod's namespace).
Reference = tuple[str, str]


class PodConfigError(Exception):
    """The pod cannot start yet (CreateContainerConfigError): a missing key or object."""


@dataclass(frozen=True)
class Volume:
    """One volume mount of the container, as the node must make it before the start."""

    name: str
    mount_path: str
    files: Mapping[str, str] = field(default_factory=dict)  # relative path → text
    tmpfs: bool = False  # an emptyDir of medium Memory
    group: int | None = None  # an emptyDir's owning group (the pod's fsGroup)
    host_path: str | None = None  # a hostPath volume: the node's folder, mounted as it is
    read_only: bool = False  # the mount's readOnly


@dataclass(frozen=True)
class ContainerConfig:
    """What the node runs for a pod: everything the spec decides, nothing the node adds."""

    image: str  # as the pod names it; the node maps it to an image it has
    command: list[str]
    args: list[str]
    env: dict[str, str]
    working_dir: str | None
    user: tuple[int, int] | None  # (uid, gid); None: the image's USER
    read_only_rootfs: bool
    memory_limit: int | None  # bytes
    cpu_limit: float | None  # cores
    hostnames: list[str]  # most qualified first, the bare hostname last
    volumes: list[Volume]
    termination_message_path: str

    @property
    def hostname(self) -> str:
        """The container's hostname: the pod's spec.hostname, else its name."""
        return self.hostnames[-1]


def references(pod: Any) -> list[Reference]:
    """The ConfigMaps and Secrets the pod's first container reads, each once, in spec order."""
    container = pod.spec.containers[0]
    found: list[Reference] = []
    for entry in container.env or []:
        source = entry.value_from
        if source is not None and source.secret_key_ref is not None:
            found.append(("secret", source.secret_key_ref.name))
        elif source is not None and source.config_map_key_ref is not None:
            found.append(("configmap", source.config_map_key_ref.name))
    by_name = {volume.name: volume for volume in pod.spec.volumes or []}
    for mount in container.volume_mounts or []:
        volume = by_name.get(mount.name)
        if volume is not None and volume.config_map is not None:
            found.append(("configmap", volume.config_map.name))
        elif volume is not None and volume.secret is not None:
            found.append(("secret", volume.secret.secret_name))
    return list(dict.fromkeys(found))


def resolve(pod: Any, objects: Mapping[Reference, Mapping[str, str]], *, host_ip: str,
            image_env: Mapping[str, str], pod_ip: str | None = None) -> ContainerConfig:
    """The config of the pod's first container.

    `objects` holds the data of the ConfigMaps and Secrets of `references(pod)` that exist
    (a missing one is absent); `host_ip` is the node's address (status.hostIP), `pod_ip`
    the pod's (status.podIP), when known;
    `image_env` is the image's own environment, under the pod's.
    """
    container = pod.spec.containers[0]
    hostnames = pod_hostnames(pod)
    env = _env(pod, container, objects, host_ip, image_env, pod_ip)
    volumes = _volumes(pod, container, objects)
    env.setdefault("HOSTNAME", hostnames[-1])
    user, read_only = _security(pod, container)
    limits = (container.resources.limits or {}) if container.resources else {}
    return ContainerConfig(
        image=container.image or "",
        command=[expand(arg, env) for arg in container.command or []],
        args=[expand(arg, env) for arg in container.args or []],
        env=env, working_dir=container.working_dir, user=user, read_only_rootfs=read_only,
        memory_limit=int(parse_quantity(limits["memory"])) if "memory" in limits else None,
        cpu_limit=float(parse_quantity(limits["cpu"])) if "cpu" in limits else None,
        hostnames=hostnames, volumes=volumes,
        termination_message_path=(container.termination_message_path
                                  or DEFAULT_TERMINATION_MESSAGE_PATH))


def pod_hostnames(pod: Any) -> list[str]:
    """The names cluster DNS gives this pod, most qualified first, bare hostname last."""
    hostname = pod.spec.hostname or pod.metadata.name
    names = []
    if pod.spec.subdomain:
        names += [f"{hostname}.{pod.spec.subdomain}.{pod.metadata.namespace}.{CLUSTER_DOMAIN}",
                  f"{hostname}.{pod.spec.subdomain}"]
    return [*names, hostname]


def hosts_file(ip: str, hostnames: list[str]) -> str:
    """The /etc/hosts the kubelet writes for a pod: localhost, then the pod's names at its IP."""
    return ("127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"
            f"{ip}\t{' '.join(hostnames)}\n")


def expand(text: str, env: Mapping[str, str]) -> str:
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


def _env(pod: Any, container: Any, objects: Mapping[Reference, Mapping[str, str]],
         host_ip: str, image_env: Mapping[str, str],
         pod_ip: str | None = None) -> dict[str, str]:
    """The container's environment: the image's, then the pod's own entries in order."""
    env = dict(image_env)  # the image's own env comes first, from the runtime
    for entry in container.env or []:
        if entry.value_from is None:
            env[entry.name] = expand(entry.value or "", env)
            continue
        source = entry.value_from
        if source.secret_key_ref is not None:
            value = _key(pod, objects, "secret", source.secret_key_ref)
        elif source.config_map_key_ref is not None:
            value = _key(pod, objects, "configmap", source.config_map_key_ref)
        elif source.field_ref is not None:
            value = _field(pod, source.field_ref.field_path, host_ip, pod_ip)
        else:
            raise PodConfigError(f"env {entry.name}: only secretKeyRef, configMapKeyRef "
                                 "and fieldRef are supported by the node agent")
        if value is not None:
            env[entry.name] = value
    return env


def _object_data(pod: Any, objects: Mapping[Reference, Mapping[str, str]], kind: str,
                 name: str, optional: bool | None) -> Mapping[str, str] | None:
    """A referenced object's data; None for a missing optional one, else missing is an error."""
    data = objects.get((kind, name))
    if data is None and not optional:
        raise PodConfigError(f"{kind} {pod.metadata.namespace}/{name} not found")
    return data


def _key(pod: Any, objects: Mapping[Reference, Mapping[str, str]], kind: str,
         ref: Any) -> str | None:
    data = _object_data(pod, objects, kind, ref.name, ref.optional)
    if data is None or ref.key not in data:
        if ref.optional:
            return None
        raise PodConfigError(f"{kind} {ref.name!r} has no key {ref.key!r}")
    return data[ref.key]


def _field(pod: Any, path: str, host_ip: str, pod_ip: str | None = None) -> str:
    meta = pod.metadata
    simple = {"metadata.name": meta.name, "metadata.namespace": meta.namespace,
              "metadata.uid": meta.uid, "spec.nodeName": pod.spec.node_name,
              "spec.serviceAccountName": pod.spec.service_account_name or "default",
              "status.hostIP": host_ip}
    if path in simple:
        return simple[path] or ""
    if path in ("status.podIP", "status.podIPs") and pod_ip is not None:
        return pod_ip
    if path in ("status.podIP", "status.podIPs"):
        raise PodConfigError("fieldRef status.podIP is resolved after start: unsupported")
    for prefix, values in (("metadata.labels['", meta.labels or {}),
                           ("metadata.annotations['", meta.annotations or {})):
        if path.startswith(prefix) and path.endswith("']"):
            return values.get(path[len(prefix):-2], "")
    raise PodConfigError(f"fieldRef {path} is not supported by the node agent")


def _volumes(pod: Any, container: Any,
             objects: Mapping[Reference, Mapping[str, str]]) -> list[Volume]:
    """The container's volume mounts, each with the files or the kind of folder it needs."""
    by_name = {volume.name: volume for volume in pod.spec.volumes or []}
    volumes = []
    for mount in container.volume_mounts or []:
        volume = by_name[mount.name]
        if volume.config_map is not None or volume.secret is not None:
            ref = volume.config_map or volume.secret
            kind = "configmap" if volume.config_map is not None else "secret"
            name = ref.name if kind == "configmap" else ref.secret_name
            data = _object_data(pod, objects, kind, name, ref.optional) or {}
            volumes.append(Volume(mount.name, mount.mount_path,
                                  files=_files(kind, name, data, ref),
                                  read_only=bool(mount.read_only)))
        elif volume.empty_dir is not None:
            context = pod.spec.security_context
            volumes.append(Volume(mount.name, mount.mount_path,
                                  tmpfs=volume.empty_dir.medium == "Memory",
                                  group=context.fs_group if context else None,
                                  read_only=bool(mount.read_only)))
        elif volume.host_path is not None:
            kind = volume.host_path.type or ""
            if kind not in ("", "Directory"):
                raise PodConfigError(f"volume {mount.name}: hostPath type {kind} is not "
                                     "supported by the node agent (only Directory)")
            volumes.append(Volume(mount.name, mount.mount_path, host_path=volume.host_path.path,
                                  read_only=bool(mount.read_only)))
        elif volume.projected is not None:
            log.info("pod %s: projected volume %s not mounted", pod.metadata.name, mount.name)
        else:
            raise PodConfigError(f"volume {mount.name}: only configMap, secret, emptyDir and "
                                 "hostPath are supported by the node agent")
    return volumes


def _files(kind: str, name: str, data: Mapping[str, str], ref: Any) -> dict[str, str]:
    """A configMap or secret volume's files: every key, or `items`' keys at their paths."""
    if not ref.items:
        return dict(data)
    files = {}
    for item in ref.items:
        if item.key in data:
            files[item.path] = data[item.key]
        elif not ref.optional:  # as the kubelet: an optional source skips a missing key
            raise PodConfigError(f"{kind} {name!r} has no key {item.key!r} (volume item)")
    return files


def _security(pod: Any, container: Any) -> tuple[tuple[int, int] | None, bool]:
    """The user (uid, gid) and read-only root of a container: its securityContext over the pod's."""
    pod_context, own = pod.spec.security_context, container.security_context
    uid = (own.run_as_user if own and own.run_as_user is not None
           else pod_context.run_as_user if pod_context else None)
    gid = (own.run_as_group if own and own.run_as_group is not None
           else pod_context.run_as_group if pod_context else None)
    read_only = bool(own and own.read_only_root_filesystem)
    # As Kubernetes: without runAsGroup the primary group is root's.
    return ((uid, gid if gid is not None else 0) if uid is not None else None), read_only
