"""The operator and trainer images, built offline as `make images` builds them, run in a
real containerd (tests/cluster/containerd.py) the way a node runs a pod's containers: the
session's node runtime (tests/conftest.py), the one the whole loop's nodes run pods in.

The images come from images/offline/build_images.py: built on first use (a few minutes),
then from the content-hashed cache, so an unchanged tree builds nothing. Needs root (the
build's mmdebstrap and buildah, the runtime's mounts and cgroups); the build installs the
Debian packages it needs. Nothing here skips on a root machine: a missing tool or a
failing runtime fails with the reason.
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from build_images import BuiltImage, build_images
from containerd import ContainerSpec, Mount, Runtime
from machine_state import left_behind, snapshot
from pod_network import ensure_namespace_folder
from whole_loop import NodeRuntime

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0,
    reason="building images (mmdebstrap, buildah) and running containerd need root")

MiB = 1 << 20


@pytest.fixture(scope="module")
def images() -> dict[str, BuiltImage]:
    """The operator and trainer archives (and the stand-in bases), built if not cached."""
    return build_images(log=lambda line: print(line, flush=True))


@pytest.fixture(scope="module")
def runtime(node_runtime: NodeRuntime) -> Runtime:
    """The session's containerd with both images imported (tests/conftest.py), as the whole
    loop's nodes run them: imported once a session, not again for this module."""
    return node_runtime.runtime


@pytest.fixture(scope="module")
def operator_image(node_runtime: NodeRuntime) -> str:
    return node_runtime.operator


@pytest.fixture(scope="module")
def trainer_image(node_runtime: NodeRuntime) -> str:
    return node_runtime.trainer


# Every container name this module's tests made: each test's containers are removed after
# it (_containers_removed), not with the runtime, which is the session's.
_NAMED: set[str] = set()


def _name(prefix: str) -> str:
    name = f"{prefix}-{uuid.uuid4().hex[:6]}"
    _NAMED.add(name)
    return name


@pytest.fixture(autouse=True)
def _containers_removed(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each test on the session's runtime, its containers go (their tasks, mounts
    and snapshots), as the whole loop's node agent removes a pod's: the runtime outlives
    this module, and the whole loop's check at its end finds any left."""
    yield
    if "runtime" in request.fixturenames:
        runtime: Runtime = request.getfixturevalue("runtime")
        for name in sorted(_NAMED & runtime.containers.keys()):
            runtime.containers[name].remove()


def test_operator_image_runs_its_help_as_65532_on_a_read_only_root(
        runtime: Runtime, operator_image: str) -> None:
    # the chart's securityContext: runAsUser 65532, readOnlyRootFilesystem
    helped = runtime.run(ContainerSpec(name=_name("op-help"), image=operator_image,
                                       args=["--help"], user=(65532, 65532),
                                       read_only_rootfs=True))
    assert helped.wait(timeout=60) == 0, helped.stderr
    assert "usage:" in helped.stdout.lower() and "operator" in helped.stdout

    # the image's own USER, and a root filesystem nothing can write to, not even /tmp
    probe = ("import errno, os\n"
             "print('uid', os.getuid(), os.getgid())\n"
             "try:\n    open('/tmp/probe', 'w')\nexcept OSError as e:\n"
             "    print('write', errno.errorcode[e.errno])\n")
    probed = runtime.run(ContainerSpec(name=_name("op-probe"), image=operator_image,
                                       command=["python", "-c", probe], read_only_rootfs=True))
    assert probed.wait(timeout=60) == 0, probed.stderr
    assert "uid 65532 65532" in probed.stdout
    assert "write EROFS" in probed.stdout


def test_operator_image_has_no_torch(runtime: Runtime, operator_image: str) -> None:
    c = runtime.run(ContainerSpec(name=_name("op-torch"), image=operator_image,
                                  command=["python", "-c", "import torch"]))
    assert c.wait(timeout=60) == 1
    assert "No module named 'torch'" in c.stderr


def test_trainer_image_imports_torch_and_the_trainer_as_1000(
        runtime: Runtime, trainer_image: str) -> None:
    code = ("import os, torch, kubetrain.trainer\n"
            "print('uid', os.getuid(), os.getgid(), 'cwd', os.getcwd())\n"
            "print('torch', torch.__version__, torch.ones(2).add(1).sum().item())\n")
    c = runtime.run(ContainerSpec(name=_name("trainer"), image=trainer_image,
                                  command=["python", "-c", code], user=(1000, 1000)))
    assert c.wait(timeout=120) == 0, c.stderr
    assert "uid 1000 1000 cwd /home/kubetrain" in c.stdout
    assert re.search(r"torch 2\.\d+\.\d+\S* 4\.0", c.stdout), c.stdout


def test_a_container_over_its_memory_limit_is_oom_killed(
        runtime: Runtime, operator_image: str) -> None:
    hog = "b = []\nwhile True:\n    b.append(bytearray(1 << 20))\n"
    c = runtime.run(ContainerSpec(name=_name("oom"), image=operator_image,
                                  command=["python", "-c", hog], memory_limit=64 * MiB))
    assert c.wait(timeout=60) == 137
    assert c.oom_killed


def test_a_cpu_limit_is_the_container_cgroup_cfs_quota(
        runtime: Runtime, operator_image: str) -> None:
    c = runtime.run(ContainerSpec(name=_name("cpu"), image=operator_image,
                                  args=["sleep", "30"], cpu_limit=0.5))
    try:
        quota = [*Path("/sys/fs/cgroup").glob(f"cpu*/{runtime.cgroup_parent}/{c.id}/"
                                               "cpu.cfs_quota_us"),
                 *Path("/sys/fs/cgroup").glob(f"{runtime.cgroup_parent}/{c.id}/cpu.max")]
        assert quota, "no CPU controller file for the container's cgroup"
        assert quota[0].read_text().split()[0] == "50000"
    finally:
        c.kill()
        c.wait(timeout=30)


def test_the_process_is_pid_1_and_exits_cleanly_on_sigterm(
        runtime: Runtime, operator_image: str) -> None:
    code = ("import os, signal, sys, time\n"
            "def stop(*_):\n    print('SIGTERM as pid', os.getpid(), flush=True)\n"
            "    sys.exit(0)\n"
            "signal.signal(signal.SIGTERM, stop)\n"
            "print('ready', flush=True)\n"
            "time.sleep(120)\nsys.exit(3)\n")
    c = runtime.run(ContainerSpec(name=_name("term"), image=operator_image,
                                  command=["python", "-c", code]))
    c.wait_for_output("ready", timeout=30)
    c.signal(signal.SIGTERM)
    assert c.wait(timeout=30) == 0, c.stderr
    assert "SIGTERM as pid 1" in c.stdout
    assert not c.oom_killed


def test_sigkill_ends_a_container_that_ignores_sigterm(
        runtime: Runtime, operator_image: str) -> None:
    code = ("import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "print('ready', flush=True)\ntime.sleep(120)\n")
    c = runtime.run(ContainerSpec(name=_name("stubborn"), image=operator_image,
                                  command=["python", "-c", code]))
    c.wait_for_output("ready", timeout=30)
    c.signal(signal.SIGTERM)
    with pytest.raises(TimeoutError):
        c.wait(timeout=1)
    c.signal(signal.SIGKILL)
    assert c.wait(timeout=30) == 137
    assert not c.oom_killed


def test_bind_and_tmpfs_mounts_env_working_dir_and_shm_size(
        runtime: Runtime, operator_image: str, tmp_path: Path) -> None:
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "job.yaml").write_text("steps: 3\n")
    (tmp_path / "out").mkdir()
    script = ("cat /etc/kubetrain/job.yaml; echo $JOB_NAME; pwd; "
              "df -k /dev/shm | tail -1; df -k /scratch | tail -1; echo done > /out/result; "
              "touch /etc/kubetrain/x 2>/dev/null || echo config read-only")
    c = runtime.run(ContainerSpec(
        name=_name("mounts"), image=operator_image, command=["sh", "-c", script],
        env={"JOB_NAME": "demo"}, working_dir="/out", user=(0, 0), shm_size=16 * MiB,
        mounts=[Mount.bind(tmp_path / "config", "/etc/kubetrain", read_only=True),
                Mount.bind(tmp_path / "out", "/out"), Mount.tmpfs("/scratch", 8 * MiB)]))
    assert c.wait(timeout=60) == 0, c.stderr
    lines = c.stdout.splitlines()
    assert lines[:3] == ["steps: 3", "demo", "/out"]
    assert lines[3].split()[1] == str(16 * 1024)  # /dev/shm's size in KiB
    assert lines[4].split()[:2] == ["tmpfs", str(8 * 1024)]
    assert lines[5] == "config read-only"
    assert (tmp_path / "out" / "result").read_text() == "done\n"


def test_a_container_joins_an_existing_network_namespace(
        runtime: Runtime, operator_image: str) -> None:
    # Judged by the namespaces themselves, not by what a short-lived container printed:
    # ctr once handed back no output at all from a `cat` that exited at once, under load.
    netns = f"ktimg-{uuid.uuid4().hex[:6]}"
    subprocess.run(["ip", "netns", "add", netns], check=True)
    try:
        joined = runtime.run(ContainerSpec(name=_name("netns"), image=operator_image,
                                           command=["sleep", "60"],
                                           network_namespace=f"/run/netns/{netns}"))
        alone = runtime.run(ContainerSpec(name=_name("own-netns"), image=operator_image,
                                          command=["sleep", "60"]))

        def namespace(pid: int | str) -> int:
            return os.stat(f"/proc/{pid}/ns/net").st_ino

        assert namespace(joined.pids()[0]) == os.stat(f"/run/netns/{netns}").st_ino
        assert namespace(alone.pids()[0]) not in (os.stat(f"/run/netns/{netns}").st_ino,
                                                  namespace("self"))
    finally:
        subprocess.run(["ip", "netns", "delete", netns], check=False)


def _shim_socket(runtime: Runtime, container: str) -> Path:
    """Where containerd 1.6 puts a task's shim socket (runtime/v2/shim.SocketAddress)."""
    key = os.path.join(str(runtime.socket), "k8s.io", container)
    return Path("/run/containerd/s", hashlib.sha256(key.encode()).hexdigest())


def test_the_runtime_leaves_the_machine_as_it_found_it(
        tmp_path: Path, images: dict[str, BuiltImage]) -> None:
    ensure_namespace_folder()  # the session's, made by whichever test needs it first
    before = snapshot()
    runtime = Runtime.start(tmp_path / "node")
    try:
        ref = runtime.import_image(images["python"].archive)
        running = runtime.run(ContainerSpec(name="left-running", image=ref,
                                            args=["sleep", "600"], memory_limit=64 * MiB))
        done = runtime.run(ContainerSpec(name="done", image=ref, args=["true"]))
        assert done.wait(timeout=30) == 0
        assert running.running and runtime.running
        shim = _shim_socket(runtime, "left-running")
        assert shim.exists(), f"no shim socket at {shim}: the check below would prove nothing"
        tag = runtime.cgroup_parent
    finally:
        runtime.stop()
    after = snapshot()

    mine = [str(tmp_path), str(runtime.run_dir), tag, shim.name]
    left = left_behind(before, after, mine)
    assert not left, "the runtime left this behind:\n" + "\n".join(left)
    # this runtime's own processes (the count lines above may change with other tests)
    assert not runtime.running, "containerd still runs"
    shims = subprocess.run(["pgrep", "-f", str(runtime.socket)], capture_output=True,
                           text=True).stdout.split()
    assert not shims, f"processes of this runtime still run: {shims}"
    assert not shim.exists(), f"its shim socket {shim} is left"
    cgroups = [*Path("/sys/fs/cgroup").glob(f"*/{tag}"), *Path("/sys/fs/cgroup").glob(tag)]
    assert not cgroups, f"its cgroups are left: {cgroups}"
