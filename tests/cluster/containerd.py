"""A container runtime for tests: Debian's containerd 1.6 and runc, driven through `ctr`.

What it does as a node's container runtime does: a real containerd daemon and real runc
containers. Images are OCI archives imported into a containerd namespace (`k8s.io`, the
one kubelet's CRI uses) and unpacked by the overlayfs snapshotter; each container gets an
OCI runtime spec built here the way kubelet + containerd's CRI build one: the image's
ENTRYPOINT/CMD, Env, WorkingDir and USER, overridden by the container's command, args,
env, working dir and uid/gid as Kubernetes overrides them; a read-only root filesystem on
request; a memory limit enforced by the memory cgroup (the kernel OOM-kills the container:
exit status 137, and containerd's `/tasks/oom` event is reported as `oom_killed`); bind
mounts and tmpfs mounts, /dev/shm as a tmpfs of a given size; its own PID, mount, IPC and
UTS namespaces (the container's process is PID 1 and receives the signals sent to the
task, as kubelet's SIGTERM-then-SIGKILL does); a new empty network namespace, or an
existing one given by path (a pod's, made by whoever runs the pod network).

What it does not: no CRI (no pod sandbox, no pause container; a caller that wants pods
shares one network namespace between a pod's containers itself), no image pulls ever (an
image not imported is an error; containerd's proxy points at a closed port so a pull
could not reach anything), no CNI, no seccomp or AppArmor profiles, no CPU shares (a CPU
limit is a CFS quota, as the kubelet sets it), no user namespaces, no log rotation
(stdout and stderr go to two files per container, or one `log_path`), no restart policy
(a caller restarts containers itself). Supplementary groups come from the image's
/etc/group only when the user is given by name.

Everything lives under one folder of the caller's (containerd's root, state, sockets, the
runc root, ctr's FIFOs, the containers' root filesystems and logs), and the containers'
cgroups under one parent cgroup of its own, `/kt-<tag>`. `stop()` removes all of it,
whatever state the containers are in, and the containerd process; one thing outside the
folder is shared by every containerd 1.6 on the machine: the shims' socket folder
/run/containerd/s, removed when it was not there before and is empty. Needs root, and
the Debian packages containerd and runc (`make images` installs them).

    runtime = Runtime.start(tmp_path / "node")
    try:
        ref = runtime.import_image(archive)
        c = runtime.run(ContainerSpec(name="hello", image=ref, args=["echo", "hi"]))
        assert c.wait(timeout=30) == 0 and c.stdout == "hi\\n"
    finally:
        runtime.stop()
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

NAMESPACE = "k8s.io"
CPU_PERIOD_US = 100_000  # the CFS period the kubelet uses
SNAPSHOTTER = "overlayfs"
CGROUP_ROOT = Path("/sys/fs/cgroup")
SHIM_SOCKETS = Path("/run/containerd/s")  # fixed in containerd 1.6 (runtime/v2/shim)
# a closed loopback port: anything containerd tried to fetch would fail at once
NO_PROXY_URL = "http://127.0.0.1:9"
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
_EVENT = re.compile(r"^\S+ \S+ \S+ \S+ (?P<ns>\S+) (?P<topic>/\S+) (?P<body>\{.*\})\s*$")


class ContainerdError(RuntimeError):
    """containerd or a container could not do what was asked; the message says what."""


@dataclass(frozen=True)
class Mount:
    """A mount into a container: a host path (bind) or a fresh tmpfs."""

    target: str
    source: str = ""
    type: str = "bind"
    read_only: bool = False
    size: int | None = None  # bytes, tmpfs only

    @classmethod
    def bind(cls, source: str | Path, target: str, read_only: bool = False) -> Mount:
        return cls(target=target, source=str(source), type="bind", read_only=read_only)

    @classmethod
    def tmpfs(cls, target: str, size: int | None = None) -> Mount:
        return cls(target=target, source="tmpfs", type="tmpfs", size=size)

    def oci(self) -> dict[str, Any]:
        if self.type == "bind":
            options = ["rbind", "rprivate", "ro" if self.read_only else "rw"]
            return {"destination": self.target, "type": "bind", "source": self.source,
                    "options": options}
        if self.type == "tmpfs":
            options = ["nosuid", "nodev", "mode=1777"]
            if self.read_only:
                options.append("ro")
            if self.size is not None:
                options.append(f"size={self.size}")
            return {"destination": self.target, "type": "tmpfs", "source": "tmpfs",
                    "options": options}
        raise ValueError(f"mount {self.target}: type {self.type!r} is neither bind nor tmpfs")


@dataclass(frozen=True)
class ContainerSpec:
    """What to run, in a Kubernetes container's terms.

    `name` is the container's id in containerd (letters, digits, `_.-`; unique among the
    runtime's containers until removed). `command` replaces the image's ENTRYPOINT and
    `args` its CMD (a `command` without `args` drops CMD), as in a pod spec. `user` is
    (uid, gid); None runs the image's USER.
    `shm_size` sizes the /dev/shm tmpfs (runc's default: 64 MiB). `network_namespace`
    is the path of an existing network namespace to join (e.g. /run/netns/NAME); None
    gives the container a new one with only a loopback interface.
    """

    name: str
    image: str
    command: Sequence[str] | None = None
    args: Sequence[str] | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    working_dir: str | None = None
    user: tuple[int, int] | None = None
    read_only_rootfs: bool = False
    memory_limit: int | None = None  # bytes
    cpu_limit: float | None = None  # cores: a CFS quota over a 100 ms period
    shm_size: int | None = None  # bytes
    mounts: Sequence[Mount] = ()
    network_namespace: str | None = None
    hostname: str | None = None
    # Both streams interleaved into this file, as the kubelet's container log; None: the
    # files stdout and stderr in the container's folder.
    log_path: Path | None = None


@dataclass(frozen=True)
class ImageConfig:
    """The parts of an image's OCI config a container starts from."""

    ref: str
    chain_id: str  # the top layer's snapshot, the parent of each container's
    entrypoint: tuple[str, ...]
    cmd: tuple[str, ...]
    env: tuple[str, ...]
    working_dir: str
    user: str


class _Events:
    """`ctr events` read on a thread: per container, start, OOM and exit as they happen."""

    def __init__(self, ctr: list[str], log: Path) -> None:
        self._cond = threading.Condition()
        self.started: set[str] = set()
        self.oom: set[str] = set()
        self.exits: dict[str, int] = {}
        self._log = open(log, "a")  # noqa: SIM115 (closed in stop)
        self._proc = subprocess.Popen([*ctr, "events"], stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True)
        self._thread = threading.Thread(target=self._read, name="ctr-events", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            self._log.write(line)
            self._log.flush()
            m = _EVENT.match(line)
            if not m or m["ns"] != NAMESPACE:
                continue
            try:
                body = json.loads(m["body"])
            except ValueError:
                continue
            cid = body.get("container_id", "")
            with self._cond:
                if m["topic"] == "/tasks/start":
                    self.started.add(cid)
                elif m["topic"] == "/tasks/oom":
                    self.oom.add(cid)
                elif m["topic"] == "/tasks/exit" and body.get("id", cid) == cid:
                    self.exits[cid] = int(body.get("exit_status", 0))
                self._cond.notify_all()

    def wait_for(self, what: str, cid: str, timeout: float) -> bool:
        """Wait until container CID has a `start` or `exit` event; False on timeout."""
        seen = self.started if what == "start" else self.exits
        with self._cond:
            return self._cond.wait_for(lambda: cid in seen or self._proc.poll() is not None,
                                       timeout) and cid in seen

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._thread.join(timeout=5)
        self._log.close()


class Container:
    """One started container; `wait()` for its exit code, `signal()` it, read its output."""

    def __init__(self, runtime: Runtime, spec: ContainerSpec, folder: Path, rootfs: Path,
                 snapshot: str, proc: subprocess.Popen[bytes]) -> None:
        self.runtime, self.spec, self.folder = runtime, spec, folder
        self.rootfs, self.snapshot, self._proc = rootfs, snapshot, proc
        self.exit_code: int | None = None
        self.removed = False

    @property
    def id(self) -> str:
        return self.spec.name

    @property
    def stdout(self) -> str:
        """What the container wrote to stdout so far (both streams, with a `log_path`)."""
        return (self.spec.log_path or self.folder / "stdout").read_text(errors="replace")

    @property
    def stderr(self) -> str:
        """What the container wrote to stderr so far, and ctr's own errors."""
        return (self.spec.log_path or self.folder / "stderr").read_text(errors="replace")

    def pids(self) -> list[int]:
        """The host pids of the container's processes, its main process first."""
        found: list[int] = []
        below = Path(self.runtime.cgroup_parent, self.id, "cgroup.procs")
        # cgroup v1 (and hybrid): in each controller's hierarchy; v2: at the top
        for procs in [*sorted(CGROUP_ROOT.glob(f"*/{below}")), CGROUP_ROOT / below]:
            with contextlib.suppress(OSError):
                found = [int(pid) for pid in procs.read_text().split()]
            if found:
                break
        return sorted(found, key=_started_at)

    @property
    def running(self) -> bool:
        return self._proc.poll() is None

    @property
    def oom_killed(self) -> bool:
        """Whether the kernel's OOM killer hit the container (containerd's /tasks/oom)."""
        return self.id in self.runtime._events.oom

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the container to exit; return its exit status (128+N for signal N).

        Raises TimeoutError when it still runs after TIMEOUT seconds, and ContainerdError
        with ctr's message when it never started.
        """
        try:
            rc = self._proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"container {self.id} still runs after {timeout} s; "
                               f"its output so far:\n{self.stdout[-2000:]}{self.stderr[-2000:]}"
                               ) from None
        events = self.runtime._events
        if self.id not in events.started:
            raise ContainerdError(f"container {self.id} did not start (ctr exit {rc}):\n"
                                f"{self.stderr[-3000:]}\ncontainerd:\n{self.runtime.log_tail()}")
        # the exit event carries the status even when ctr's own exit code could be its own
        events.wait_for("exit", self.id, timeout=10)
        self.exit_code = events.exits.get(self.id, rc)
        return self.exit_code

    def wait_for_output(self, text: str, timeout: float = 30) -> None:
        """Wait until TEXT appears in stdout; fail saying what was awaited if it does not."""
        deadline = time.monotonic() + timeout
        while text not in self.stdout:
            if not self.running:
                raise ContainerdError(f"container {self.id} exited before printing {text!r}:\n"
                                    f"{self.stdout[-2000:]}{self.stderr[-2000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"container {self.id} did not print {text!r} in "
                                   f"{timeout} s:\n{self.stdout[-2000:]}{self.stderr[-2000:]}")
            time.sleep(0.05)

    def signal(self, sig: int | signal.Signals = signal.SIGTERM) -> None:
        """Send SIG to the container's main process (PID 1 in the container)."""
        name = signal.Signals(sig).name
        self.runtime._ctr("tasks", "kill", "--signal", name, self.id)

    def kill(self) -> None:
        """SIGKILL every process of the container; no-op when it has exited."""
        if self.running:
            self.runtime._ctr("tasks", "kill", "--all", "--signal", "SIGKILL", self.id,
                              check=False)

    def set_cpu_limit(self, cores: float | None) -> None:
        """Change the running container's CFS quota to `cores` CPUs (None: no limit), as
        `runc update --cpu-quota` does, written straight into its cgroup: `cpu.cfs_quota_us`
        in cgroup v1's cpu hierarchy (this hybrid machine), `cpu.max` in v2. No-op when
        the container has exited, or is exiting: its cgroup goes before `ctr` ends."""
        quota = None if cores is None else max(1000, round(cores * CPU_PERIOD_US))
        below = Path(self.runtime.cgroup_parent, self.id)
        v1 = [path for path in CGROUP_ROOT.glob(f"cpu*/{below}/cpu.cfs_quota_us")
              if path.exists()]
        if v1:
            for path in v1:
                (path.parent / "cpu.cfs_period_us").write_text(str(CPU_PERIOD_US))
                path.write_text(str(-1 if quota is None else quota))
            return
        cpu_max = CGROUP_ROOT / below / "cpu.max"
        if not cpu_max.exists():
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=5)
                return
            raise ContainerdError(f"container {self.id}: no CPU cgroup at {cpu_max} or in "
                                  f"{CGROUP_ROOT}/cpu*/{below}")
        cpu_max.write_text(f"{'max' if quota is None else quota} {CPU_PERIOD_US}")

    def remove(self) -> None:
        """Kill if running, then delete the task, the container, its rootfs and snapshot.
        Output files stay in the container's folder."""
        if self.removed:
            return
        self.kill()
        try:
            self._proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        rt = self.runtime
        rt._ctr("tasks", "delete", "--force", self.id, check=False)
        rt._ctr("containers", "delete", self.id, check=False)
        _unmount(self.rootfs)
        rt._ctr("snapshots", "--snapshotter", SNAPSHOTTER, "rm", self.snapshot, check=False)
        self.removed = True
        rt.containers.pop(self.id, None)


class Runtime:
    """A containerd daemon of its own under FOLDER; see the module's docstring."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder.resolve()
        self.tag = uuid.uuid4().hex[:8]
        self.cgroup_parent = f"kt-{self.tag}"
        # unix socket paths must stay under 108 bytes
        run = self.folder / "run"
        self.run_dir = run if len(str(run)) < 70 else Path(f"/tmp/kt-containerd-{self.tag}")
        self.socket = self.run_dir / "containerd.sock"
        self.log = self.folder / "containerd.log"
        self.containers: dict[str, Container] = {}
        self.images: dict[str, ImageConfig] = {}
        self._process: subprocess.Popen[bytes] | None = None
        self._events: _Events
        self._shim_sockets_existed = SHIM_SOCKETS.exists()
        self._run_containerd_existed = SHIM_SOCKETS.parent.exists()
        self._default_spec: dict[str, Any] | None = None
        self._stopped = False

    # -- lifecycle -------------------------------------------------------------------
    @classmethod
    def start(cls, folder: Path, timeout: float = 30) -> Runtime:
        """Start containerd with its root, state and socket under FOLDER; ready to run."""
        if os.geteuid() != 0:
            raise PermissionError("the containerd runtime needs root (mounts, cgroups, runc)")
        for binary in ("containerd", "ctr", "runc", "containerd-shim-runc-v2"):
            if shutil.which(binary) is None:
                raise FileNotFoundError(
                    f"{binary} not found: install Debian's containerd and runc "
                    "(`make images` does, or `apt-get install containerd runc`)")
        rt = cls(folder)
        try:
            rt._start(timeout)
        except BaseException:
            rt.stop()
            raise
        return rt

    def _start(self, timeout: float) -> None:
        for d in (self.folder, self.run_dir, self.folder / "containers", self.folder / "rootfs"):
            d.mkdir(parents=True, exist_ok=True)
        config = self.folder / "containerd.toml"
        config.write_text(_CONFIG.format(root=self.folder / "data", state=self.run_dir / "state",
                                         socket=self.socket, opt=self.folder / "data" / "opt"))
        env = {**os.environ, "HTTP_PROXY": NO_PROXY_URL, "HTTPS_PROXY": NO_PROXY_URL,
               "NO_PROXY": ""}
        with open(self.log, "ab") as log:
            self._process = subprocess.Popen(["containerd", "--config", str(config)],
                                             stdout=log, stderr=subprocess.STDOUT, env=env,
                                             start_new_session=True)
        deadline = time.monotonic() + timeout
        while True:
            if self._process.poll() is not None:
                raise ContainerdError(f"containerd exited with {self._process.returncode}:\n"
                                    f"{self.log_tail()}")
            if self.socket.exists() and self._ctr("version", check=False).returncode == 0:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"containerd did not answer on {self.socket} in {timeout} s:"
                                   f"\n{self.log_tail()}")
            time.sleep(0.05)
        self._events = _Events(self._ctr_base(), self.folder / "events.log")

    def stop(self) -> None:
        """Remove every container, stop containerd and its shims, and remove what it made
        (mounts, cgroups, state); the logs stay in FOLDER. Safe to call twice."""
        if self._stopped:
            return
        self._stopped = True
        errors: list[str] = []
        if self._process is not None and self._process.poll() is None:
            for c in list(self.containers.values()):
                try:
                    c.remove()
                except Exception as e:  # keep cleaning up; report at the end
                    errors.append(f"container {c.id}: {e}")
        if hasattr(self, "_events"):
            self._events.close()
        if self._process is not None:
            if self._process.poll() is None:
                self._process.terminate()
            try:
                self._process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._kill_shims()
        for c in self.containers.values():  # containerd died first: their rootfs mounts
            _unmount(c.rootfs)
        _unmount_under(self.folder)
        _unmount_under(self.run_dir)
        errors += self._remove_cgroups()
        shutil.rmtree(self.folder / "data", ignore_errors=True)
        shutil.rmtree(self.folder / "rootfs", ignore_errors=True)
        shutil.rmtree(self.run_dir, ignore_errors=True)
        if not self._shim_sockets_existed:
            _rmdir(SHIM_SOCKETS)
        if not self._run_containerd_existed:
            _rmdir(SHIM_SOCKETS.parent)
        if errors:
            raise ContainerdError("stopping the runtime: " + "; ".join(errors))

    @property
    def removes_shim_folders(self) -> bool:
        """Whether `stop()` removes /run/containerd and its shims' socket folder: neither
        was there when the runtime started, so its first shim made them."""
        return not self._shim_sockets_existed and not self._run_containerd_existed

    @property
    def running(self) -> bool:
        """Whether this runtime's containerd process runs."""
        return self._process is not None and self._process.poll() is None

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _kill_shims(self) -> None:
        """Shims of this containerd that outlived it (a task containerd could not delete)."""
        for pid in _pids_with_arg(str(self.socket)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def _remove_cgroups(self) -> list[str]:
        left = []
        # cgroup v1 (and hybrid): one per hierarchy; v2: one at the top
        parents = [*CGROUP_ROOT.glob(f"*/{self.cgroup_parent}"), CGROUP_ROOT / self.cgroup_parent]
        for parent in (p for p in parents if p.is_dir()):
            below = sorted((p for p in parent.rglob("*") if p.is_dir()),
                           key=lambda p: len(p.parts), reverse=True)
            for d in [*below, parent]:
                for _ in range(50):  # a killed process leaves its cgroup a moment later
                    try:
                        d.rmdir()
                        break
                    except FileNotFoundError:
                        break
                    except OSError:
                        time.sleep(0.1)
                else:
                    left.append(str(d))
        return [f"cgroups left: {left}"] if left else []

    # -- images ----------------------------------------------------------------------
    def import_image(self, archive: Path | str) -> str:
        """Import an OCI or docker archive into the namespace, unpacked; return its ref."""
        out = self._ctr("images", "import", str(archive), timeout=600).stdout
        refs = re.findall(r"unpacking (\S+) \((sha256:[0-9a-f]{64})\)", out)
        if not refs:
            raise ContainerdError(f"importing {archive}: no image named in ctr's output:\n{out}")
        for ref, digest in refs:
            self.images[ref] = self._image_config(ref, digest)
        return str(refs[0][0])

    def _content(self, digest: str) -> dict[str, Any]:
        return dict(json.loads(self._ctr("content", "get", digest).stdout))

    def _image_config(self, ref: str, digest: str) -> ImageConfig:
        manifest = self._content(digest)
        if "manifests" in manifest:  # an index: this machine's platform
            entries = [m for m in manifest["manifests"]
                       if m.get("platform", {}).get("architecture", "amd64") == "amd64"]
            manifest = self._content(entries[0]["digest"])
        config = self._content(manifest["config"]["digest"])
        chain = ""
        for diff_id in config["rootfs"]["diff_ids"]:
            chain = diff_id if not chain else "sha256:" + _sha256(f"{chain} {diff_id}")
        c = config.get("config", {})
        return ImageConfig(ref=ref, chain_id=chain,
                           entrypoint=tuple(c.get("Entrypoint") or ()),
                           cmd=tuple(c.get("Cmd") or ()), env=tuple(c.get("Env") or ()),
                           working_dir=c.get("WorkingDir") or "/", user=c.get("User") or "")

    # -- containers ------------------------------------------------------------------
    def run(self, spec: ContainerSpec) -> Container:
        """Create and start a container; returns once containerd reports it started."""
        if not _ID.match(spec.name):
            raise ValueError(f"container name {spec.name!r}: use letters, digits and _.- "
                             "(at most 63), starting with a letter or digit")
        if spec.name in self.containers:
            raise ValueError(f"a container named {spec.name} exists; remove it first")
        image = self.images.get(spec.image)
        if image is None:
            raise ContainerdError(f"image {spec.image} is not imported (this runtime never "
                                f"pulls); imported: {sorted(self.images)}")
        folder = self.folder / "containers" / spec.name  # a removed one's logs are replaced
        folder.mkdir(parents=True, exist_ok=True)
        rootfs = self.folder / "rootfs" / spec.name
        rootfs.mkdir(parents=True, exist_ok=True)
        snapshot = f"{spec.name}-rootfs"
        mounts = json.loads(self._ctr("snapshots", "--snapshotter", SNAPSHOTTER, "prepare",
                                      "--mounts", snapshot, image.chain_id).stdout)
        for m in mounts:
            _mount(m["Type"], m["Source"], rootfs, m["Options"])
        oci = self._oci_spec(spec, image, rootfs)
        (folder / "config.json").write_text(json.dumps(oci, indent=1))
        cmd = [*self._ctr_base(), "run", "--config", str(folder / "config.json"),
               "--fifo-dir", str(self.run_dir / "fifo"), "--runc-root", str(self.run_dir / "runc"),
               spec.name]
        if spec.log_path is not None:
            with open(spec.log_path, "ab") as log:
                proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log,
                                        stderr=subprocess.STDOUT)
        else:
            with open(folder / "stdout", "wb") as out, open(folder / "stderr", "wb") as err:
                proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=err)
        container = Container(self, spec, folder, rootfs, snapshot, proc)
        self.containers[spec.name] = container
        if not self._events.wait_for("start", spec.name, timeout=30):
            container.remove()
            raise ContainerdError(f"container {spec.name} did not start: "
                                f"{container.stderr[-3000:]}\ncontainerd:\n{self.log_tail()}")
        return container

    def _oci_spec(self, spec: ContainerSpec, image: ImageConfig, rootfs: Path) -> dict[str, Any]:
        if self._default_spec is None:
            self._default_spec = json.loads(self._ctr("oci", "spec").stdout)
        oci: dict[str, Any] = json.loads(json.dumps(self._default_spec))
        if spec.command is not None:
            argv = [*spec.command, *(spec.args or ())]
        else:
            argv = [*image.entrypoint, *(image.cmd if spec.args is None else spec.args)]
        if not argv:
            raise ValueError(f"container {spec.name}: no command, and the image has none")
        env = dict(e.split("=", 1) for e in image.env if "=" in e)
        env.update(spec.env)
        uid, gid, groups = self._user(spec, image, rootfs)
        process = oci["process"]
        process.update(args=argv, env=[f"{k}={v}" for k, v in env.items()], terminal=False,
                       cwd=spec.working_dir or image.working_dir,
                       user={"uid": uid, "gid": gid, "additionalGids": groups})
        oci["root"] = {"path": str(rootfs), "readonly": spec.read_only_rootfs}
        oci["hostname"] = spec.hostname or spec.name
        for m in oci["mounts"]:
            if m["destination"] == "/dev/shm" and spec.shm_size is not None:
                m["options"] = [o for o in m["options"] if not o.startswith("size=")]
                m["options"].append(f"size={spec.shm_size}")
        targets = {m.target for m in spec.mounts}
        oci["mounts"] = [m for m in oci["mounts"] if m["destination"] not in targets]
        oci["mounts"] += [m.oci() for m in spec.mounts]
        linux = oci["linux"]
        linux["cgroupsPath"] = f"/{self.cgroup_parent}/{spec.name}"
        if spec.memory_limit is not None:
            linux.setdefault("resources", {})["memory"] = {"limit": spec.memory_limit}
        if spec.cpu_limit is not None:  # as the kubelet turns limits.cpu into a CFS quota
            linux.setdefault("resources", {})["cpu"] = {
                "quota": max(1000, round(spec.cpu_limit * CPU_PERIOD_US)),
                "period": CPU_PERIOD_US}
        if spec.network_namespace is not None:
            for ns in linux["namespaces"]:
                if ns["type"] == "network":
                    ns["path"] = spec.network_namespace
        return oci

    @staticmethod
    def _user(spec: ContainerSpec, image: ImageConfig, rootfs: Path
              ) -> tuple[int, int, list[int]]:
        if spec.user is not None:
            return spec.user[0], spec.user[1], [spec.user[1]]
        name, _, group = image.user.partition(":")
        if not name:
            return 0, 0, [0]
        passwd = _colon_file(rootfs / "etc/passwd")
        groups = _colon_file(rootfs / "etc/group")
        if name.isdigit():
            uid = int(name)
            entry = next((p for p in passwd.values() if p[1] == name), None)
        else:
            entry = passwd.get(name)
            if entry is None:
                raise ContainerdError(f"image {image.ref}: USER {name} is not in /etc/passwd")
            uid = int(entry[1])
        if group:
            gid = int(group) if group.isdigit() else int(groups[group][1])
        else:
            gid = int(entry[2]) if entry else 0
        extra = [int(g[1]) for g_name, g in groups.items()
                 if entry is not None and name in g[2].split(",") and g_name != group]
        return uid, gid, [gid, *extra]

    # -- plumbing --------------------------------------------------------------------
    def _ctr_base(self) -> list[str]:
        return ["ctr", "--address", str(self.socket), "--namespace", NAMESPACE]

    def _ctr(self, *args: str, check: bool = True, timeout: float = 60
             ) -> subprocess.CompletedProcess[str]:
        r = subprocess.run([*self._ctr_base(), *args], capture_output=True, text=True,
                           timeout=timeout, check=False)
        if check and r.returncode != 0:
            raise ContainerdError(f"ctr {' '.join(args)}: {r.stderr.strip() or r.stdout.strip()}")
        return r

    def log_tail(self, lines: int = 30) -> str:
        """The last LINES of containerd's log, for failure messages."""
        try:
            return "".join(self.log.read_text(errors="replace").splitlines(True)[-lines:])
        except OSError:
            return "(no containerd log)"


_CONFIG = """\
# containerd 1.6 for tests (tests/cluster/containerd.py): its own root, state and sockets,
# so it never touches a system containerd (/var/lib/containerd, /run/containerd).
version = 2
root = "{root}"
state = "{state}"
oom_score = 0
# no CRI: containers are made with ctr, from specs built by the harness
disabled_plugins = ["io.containerd.grpc.v1.cri"]

[grpc]
  address = "{socket}"

[ttrpc]
  address = "{socket}.ttrpc"

[debug]
  address = ""
  level = "info"

[plugins]
  [plugins."io.containerd.internal.v1.opt"]
    path = "{opt}"
"""


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _colon_file(path: Path) -> dict[str, list[str]]:
    """/etc/passwd or /etc/group as {name: fields}."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return {}
    return {f[0]: f for f in (line.split(":") for line in lines) if len(f) >= 3}


def _mount_points() -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return [line.split()[4] for line in f]


# mount(2) and umount2(2) themselves: util-linux's mount would create /run/mount (libmount's
# utab folder) on a machine that has none, and leave it behind.
_libc = ctypes.CDLL(None, use_errno=True)
_MNT_DETACH = 2


def _mount(fstype: str, source: str, target: Path, options: Sequence[str]) -> None:
    data = ",".join(options).encode()
    if _libc.mount(source.encode(), str(target).encode(), fstype.encode(), 0, data) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount -t {fstype} {source} {target}: {os.strerror(err)}")


def _umount(path: str, detach: bool = False) -> bool:
    return int(_libc.umount2(path.encode(), _MNT_DETACH if detach else 0)) == 0


def _unmount(path: Path) -> None:
    while str(path) in _mount_points():
        if not _umount(str(path)) and not _umount(str(path), detach=True):
            break


def _unmount_under(folder: Path) -> None:
    prefix = str(folder) + "/"
    for p in sorted((p for p in _mount_points() if p.startswith(prefix)), key=len, reverse=True):
        _umount(p, detach=True)


def _rmdir(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.rmdir()


def _pids_with_arg(arg: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if arg.encode() in argv:
            pids.append(int(entry.name))
    return pids


def _started_at(pid: int) -> int:
    """A process's start time in clock ticks since boot (field 22 of /proc/PID/stat)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 1 << 62
    return int(stat.rsplit(")", 1)[1].split()[19])
