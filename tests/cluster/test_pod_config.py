"""The node agent's resolver from pod spec to container config (pod_config.py), without root.

Each pod is written as a manifest and read into the client's V1Pod the way the agent's
pod list reads it (ApiClient.deserialize), so the resolver sees what it sees in the loop.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from kubernetes import client
from pod_config import (
    ContainerConfig,
    PodConfigError,
    Volume,
    hosts_file,
    references,
    resolve,
)

HOST_IP = "10.244.7.1"


def pod(container: dict[str, Any] | None = None, **spec: Any) -> Any:
    """A V1Pod `default/worker-0` on node-a, its first container `container` over defaults."""
    manifest = {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "worker-0", "namespace": "default", "uid": "1234-abcd",
                     "labels": {"app": "train", "rank": "0"},
                     "annotations": {"kubetrain.io/attempt": "3"}},
        "spec": {"nodeName": "node-a", "restartPolicy": "Never",
                 "containers": [{"name": "trainer", "image": "trainer:1", **(container or {})}],
                 **spec},
    }
    return client.ApiClient().deserialize(json.dumps(manifest), "V1Pod", "application/json")


def config_of(pod: Any, objects: dict[tuple[str, str], dict[str, str]] | None = None,
              image_env: dict[str, str] | None = None) -> ContainerConfig:
    return resolve(pod, objects or {}, host_ip=HOST_IP, image_env=image_env or {})


def test_pod_env_comes_after_the_image_env_and_expands_earlier_entries_only() -> None:
    config = config_of(pod({"env": [
        {"name": "OMP_NUM_THREADS", "value": "4"},  # the pod's own wins over the image's
        {"name": "BASE", "value": "/data"},
        {"name": "SHARDS", "value": "$(BASE)/shards:$(LATER):$$(BASE):$(HOME)"},
        {"name": "LATER", "value": "x"},
    ]}), image_env={"OMP_NUM_THREADS": "1", "HOME": "/root"})

    assert config.env["OMP_NUM_THREADS"] == "4"
    # $(LATER) is not defined yet where SHARDS is; $$ escapes; the image's HOME expands.
    assert config.env["SHARDS"] == "/data/shards:$(LATER):$(BASE):/root"
    assert list(config.env)[:4] == ["OMP_NUM_THREADS", "HOME", "BASE", "SHARDS"]


def test_secret_and_config_map_keys_fill_the_env_and_optional_missing_ones_are_left_out() -> None:
    spec = pod({"env": [
        {"name": "AWS_ACCESS_KEY_ID", "valueFrom": {"secretKeyRef": {
            "name": "s3-credentials", "key": "AWS_ACCESS_KEY_ID"}}},
        {"name": "LEVEL", "valueFrom": {"configMapKeyRef": {"name": "settings", "key": "level"}}},
        {"name": "MAYBE", "valueFrom": {"configMapKeyRef": {
            "name": "absent", "key": "x", "optional": True}}},
        {"name": "NO_KEY", "valueFrom": {"secretKeyRef": {
            "name": "s3-credentials", "key": "missing", "optional": True}}},
    ]})
    objects = {("secret", "s3-credentials"): {"AWS_ACCESS_KEY_ID": "key-id"},
               ("configmap", "settings"): {"level": "debug"}}

    env = config_of(spec, objects).env

    assert env["AWS_ACCESS_KEY_ID"] == "key-id" and env["LEVEL"] == "debug"
    assert "MAYBE" not in env and "NO_KEY" not in env


@pytest.mark.parametrize(("ref", "objects", "message"), [
    ({"secretKeyRef": {"name": "creds", "key": "k"}}, {}, "secret default/creds not found"),
    ({"configMapKeyRef": {"name": "cfg", "key": "k"}}, {("configmap", "cfg"): {"j": "1"}},
     "configmap 'cfg' has no key 'k'"),
    ({"fieldRef": {"fieldPath": "status.podIP"}}, {}, "status.podIP is resolved after start"),
    ({"fieldRef": {"fieldPath": "spec.schedulerName"}}, {}, "fieldRef spec.schedulerName is "
     "not supported"),
    ({"resourceFieldRef": {"resource": "limits.cpu"}}, {}, "env X: only secretKeyRef"),
])
def test_an_env_source_the_kubelet_cannot_resolve_is_a_config_error(
        ref: dict[str, Any], objects: dict[tuple[str, str], dict[str, str]],
        message: str) -> None:
    with pytest.raises(PodConfigError, match=message.replace(".", r"\.")):
        config_of(pod({"env": [{"name": "X", "valueFrom": ref}]}), objects)


def test_field_refs_read_the_downward_api_and_the_node_address() -> None:
    paths = {"NAME": "metadata.name", "NAMESPACE": "metadata.namespace", "UID": "metadata.uid",
             "NODE": "spec.nodeName", "ACCOUNT": "spec.serviceAccountName",
             "HOST": "status.hostIP", "RANK": "metadata.labels['rank']",
             "ATTEMPT": "metadata.annotations['kubetrain.io/attempt']",
             "NO_LABEL": "metadata.labels['zone']"}

    env = config_of(pod({"env": [{"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}
                                 for name, path in paths.items()]})).env

    assert {name: env[name] for name in paths} == {
        "NAME": "worker-0", "NAMESPACE": "default", "UID": "1234-abcd", "NODE": "node-a",
        "ACCOUNT": "default", "HOST": HOST_IP, "RANK": "0", "ATTEMPT": "3", "NO_LABEL": ""}


def test_a_pod_behind_a_headless_service_answers_to_its_qualified_names() -> None:
    config = config_of(pod(hostname="w0", subdomain="demo"))

    assert config.hostnames == ["w0.demo.default.svc.cluster.local", "w0.demo", "w0"]
    assert config.hostname == "w0" and config.env["HOSTNAME"] == "w0"
    assert hosts_file("10.244.7.5", config.hostnames).splitlines()[-1] == (
        "10.244.7.5\tw0.demo.default.svc.cluster.local w0.demo w0")
    assert config_of(pod()).hostnames == ["worker-0"]  # no subdomain: the pod's name


def test_command_and_args_expand_from_the_final_env_including_hostname() -> None:
    config = config_of(pod({
        "command": ["torchrun", "--rdzv-endpoint=$(MASTER):29400"],
        "args": ["--node=$(HOSTNAME)", "$$(literal)", "$(UNSET)"],
        "env": [{"name": "MASTER", "value": "demo-worker-0.demo"},
                {"name": "EARLY", "value": "$(HOSTNAME)"}],
    }))

    assert config.command == ["torchrun", "--rdzv-endpoint=demo-worker-0.demo:29400"]
    assert config.args == ["--node=worker-0", "$(literal)", "$(UNSET)"]
    # HOSTNAME is set after the pod's entries, as the runtime adds it: env values do not see it.
    assert config.env["EARLY"] == "$(HOSTNAME)"
    assert config_of(pod({"env": [{"name": "HOSTNAME", "value": "own"}]})).env["HOSTNAME"] == "own"


def test_volumes_carry_their_files_or_their_kind_of_folder() -> None:
    spec = pod({"volumeMounts": [
        {"name": "config", "mountPath": "/etc/kubetrain"},
        {"name": "creds", "mountPath": "/var/run/creds"},
        {"name": "shm", "mountPath": "/dev/shm"},
        {"name": "scratch", "mountPath": "/scratch"},
        {"name": "token", "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount"},
    ]}, securityContext={"fsGroup": 2000}, volumes=[
        {"name": "config", "configMap": {"name": "demo-config"}},
        {"name": "creds", "secret": {"secretName": "s3", "items": [
            {"key": "id", "path": "aws/id"}]}},
        {"name": "shm", "emptyDir": {"medium": "Memory"}},
        {"name": "scratch", "emptyDir": {}},
        {"name": "token", "projected": {"sources": []}},
    ])
    objects = {("configmap", "demo-config"): {"job.yaml": "spec: {}\n", "extra": "1"},
               ("secret", "s3"): {"id": "key-id", "secret": "not mounted"}}

    volumes = config_of(spec, objects).volumes

    assert volumes == [
        Volume("config", "/etc/kubetrain", files={"job.yaml": "spec: {}\n", "extra": "1"}),
        Volume("creds", "/var/run/creds", files={"aws/id": "key-id"}),
        Volume("shm", "/dev/shm", tmpfs=True, group=2000),
        Volume("scratch", "/scratch", tmpfs=False, group=2000),
    ]  # the projected token volume is not mounted


def test_a_host_path_volume_is_the_nodes_folder_read_only_where_the_mount_says_so() -> None:
    spec = pod({"volumeMounts": [
        {"name": "packages", "mountPath": "/opt/packages", "readOnly": True},
        {"name": "data", "mountPath": "/data"},
        {"name": "scripts", "mountPath": "/opt/scripts", "readOnly": True},
    ]}, volumes=[
        {"name": "packages", "hostPath": {"path": "/srv/packages", "type": "Directory"}},
        {"name": "data", "hostPath": {"path": "/srv/data"}},
        {"name": "scripts", "configMap": {"name": "scripts"}},
    ])

    volumes = config_of(spec, {("configmap", "scripts"): {"train.py": "print(1)\n"}}).volumes

    assert volumes == [
        Volume("packages", "/opt/packages", host_path="/srv/packages", read_only=True),
        Volume("data", "/data", host_path="/srv/data", read_only=False),
        Volume("scripts", "/opt/scripts", files={"train.py": "print(1)\n"}, read_only=True),
    ]


def test_a_volume_the_node_cannot_make_is_a_config_error_unless_optional() -> None:
    def with_volume(volume: dict[str, Any]) -> Any:
        return pod({"volumeMounts": [{"name": "v", "mountPath": "/v"}]},
                   volumes=[{"name": "v", **volume}])

    with pytest.raises(PodConfigError, match="configmap default/cfg not found"):
        config_of(with_volume({"configMap": {"name": "cfg"}}))
    with pytest.raises(PodConfigError, match="only configMap, secret, emptyDir and hostPath"):
        config_of(with_volume({"persistentVolumeClaim": {"claimName": "data"}}))
    with pytest.raises(PodConfigError, match="hostPath type Socket is not supported"):
        config_of(with_volume({"hostPath": {"path": "/run/x.sock", "type": "Socket"}}))
    with pytest.raises(PodConfigError, match="secret 's' has no key 'b'"):
        config_of(with_volume({"secret": {"secretName": "s", "items": [
            {"key": "a", "path": "a"}, {"key": "b", "path": "b"}]}}), {("secret", "s"): {"a": "1"}})

    optional = config_of(with_volume({"secret": {"secretName": "s", "optional": True, "items": [
        {"key": "a", "path": "a"}, {"key": "b", "path": "b"}]}}), {("secret", "s"): {"a": "1"}})
    assert optional.volumes == [Volume("v", "/v", files={"a": "1"})]
    absent = config_of(with_volume({"configMap": {"name": "cfg", "optional": True}}))
    assert absent.volumes == [Volume("v", "/v", files={})]


def test_the_containers_security_context_overrides_the_pods() -> None:
    pod_context = {"runAsUser": 1000, "runAsGroup": 1000}

    assert config_of(pod({}, securityContext=pod_context)).user == (1000, 1000)
    own = config_of(pod({"securityContext": {"runAsUser": 65532, "readOnlyRootFilesystem": True}},
                        securityContext=pod_context))
    assert (own.user, own.read_only_rootfs) == ((65532, 1000), True)
    # Without runAsGroup anywhere the primary group is root's; without a user, the image's.
    assert config_of(pod({"securityContext": {"runAsUser": 7}})).user == (7, 0)
    assert config_of(pod()).user is None and not config_of(pod()).read_only_rootfs


def test_limits_become_bytes_and_cores_and_the_termination_log_path_is_kept() -> None:
    limited = config_of(pod({"resources": {"limits": {"memory": "1536Mi", "cpu": "250m"}},
                             "terminationMessagePath": "/tmp/why", "workingDir": "/work"}))

    assert (limited.memory_limit, limited.cpu_limit) == (1536 * 2**20, 0.25)
    assert (limited.termination_message_path, limited.working_dir) == ("/tmp/why", "/work")
    unlimited = config_of(pod({"resources": {"requests": {"cpu": "2"}}}))
    assert (unlimited.memory_limit, unlimited.cpu_limit) == (None, None)
    assert unlimited.termination_message_path == "/dev/termination-log"


def test_references_name_each_object_the_pod_reads_once_in_spec_order() -> None:
    spec = pod({"env": [
        {"name": "A", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "a"}}},
        {"name": "B", "valueFrom": {"configMapKeyRef": {"name": "settings", "key": "b"}}},
        {"name": "C", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "c"}}},
        {"name": "D", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
    ], "volumeMounts": [{"name": "config", "mountPath": "/etc/k"},
                        {"name": "tls", "mountPath": "/tls"}]},
        volumes=[{"name": "config", "configMap": {"name": "demo-config"}},
                 {"name": "tls", "secret": {"secretName": "creds"}},
                 {"name": "unmounted", "configMap": {"name": "never-read"}}])

    assert references(spec) == [("secret", "creds"), ("configmap", "settings"),
                                ("configmap", "demo-config")]
