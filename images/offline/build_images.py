#!/usr/bin/env python3
"""Build the operator and trainer images offline, from Debian packages and the machine's pip.

`make images` runs this; tests/images imports `build_images` from it, so the tests run the
very archives `make images` writes. What it does, in order:

1. installs the Debian packages it needs (mmdebstrap, buildah; containerd and runc to run
   the results) when one is missing: `apt-get update` and `apt-get install`, quietly;
2. makes stand-in base images with mmdebstrap from this machine's own apt sources
   (apt_sources.py) and writes them as OCI archives (rootfs2oci.py): Debian's python3 with
   a venv at /usr/local/venv first on PATH, standing in for python:3.11-slim-bookworm, and
   a static catatonit "pause" image for a pod sandbox;
3. builds images/operator.Dockerfile and images/trainer.Dockerfile unchanged with
   Debian's buildah (`--isolation chroot --network host --pull=never`), passing the stand-in
   bases as their PYTHON_IMAGE / PYTORCH_IMAGE build arguments; the trainer's base is the
   python stand-in plus CPU torch (pytorch-cpu.Containerfile). pip in RUN steps uses this
   machine's pip configuration, found when the build runs (pip_build_config.py), mounted
   read-only with the local paths it names;
4. writes each image as an OCI archive into the cache folder, named by a content hash of
   everything that goes into it: its Dockerfile, the files the Dockerfile copies (as git
   sees the working tree: tracked and untracked, not ignored), the pip configuration and
   the recipe of its base. An unchanged tree builds nothing and says so.

The cache folder is $KUBETRAIN_IMAGE_CACHE, else ${XDG_CACHE_HOME:-~/.cache}/kubetrain/images;
one archive per image is kept (older ones are removed when a new one is written). Remove
the folder to start again. buildah's storage lives in a temporary folder inside it, removed
(mounts included) when the build ends, failed or not; nothing is written to
/var/lib/containers or /run/containers.

usage: build_images.py [--print-paths] [IMAGE...]   (IMAGE: operator trainer; default both)
Needs root (mmdebstrap, buildah's chroot isolation).
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))

from apt_sources import source_lines  # noqa: E402
from pip_build_config import PipConfigError, write_pip_conf  # noqa: E402
from rootfs2oci import rootfs_to_oci  # noqa: E402

SUITE = "bookworm"  # Debian 12: python3 is 3.11, as in python:3.11-slim-bookworm
TORCH_VERSION = os.environ.get("TORCH_VERSION", "2.13.0")
# Extra pip arguments for the CPU torch base, e.g. --index-url of a CPU wheel index where
# the machine's pip set-up offers none (pip would pick the CUDA build).
TORCH_PIP_ARGS = os.environ.get("TORCH_PIP_ARGS", "")
PYTHON_BASE = "docker.io/kubetrain/python:3.11-bookworm"
PAUSE_IMAGE = "docker.io/kubetrain/pause:catatonit"
TORCH_BASE = f"docker.io/kubetrain/pytorch:{TORCH_VERSION}-cpu"
IMAGES = ("operator", "trainer")
# The archives' layers, as `buildah push --compression-format` writes them: containerd
# (1.5 and later) unpacks zstd with a fifth less CPU than gzip (the trainer image's import:
# 36-42 s of containerd's CPU against 47-52 s), and buildah writes it faster. The tests
# import the images into a containerd of their own twice a run.
LAYER_COMPRESSION = "zstd"
# build: mmdebstrap, buildah; run: containerd, runc (tests/cluster/containerd.py) and the
# CNI plugins of the tests' pod network (tests/cluster/pod_network.py)
APT_PACKAGES = ("mmdebstrap", "buildah", "containerd", "runc", "containernetworking-plugins")
# Every apt call of the project takes this lock (tests/install/debian-packages.sh too).
APT_LOCK = "/var/lock/kubetrain-apt.lock"
VENV_PATH = "PATH=/usr/local/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# apt's network settings passed on to mmdebstrap (proxy, CA, validity of snapshot mirrors)
APT_OPTION_PREFIXES = ("Acquire::Check-Valid-Until", "Acquire::Check-Date",
                       "Acquire::Max-ValidTime", "Acquire::http::Proxy",
                       "Acquire::https::Proxy", "Acquire::ftp::Proxy",
                       "Acquire::http::Verify", "Acquire::https::Verify", "Acquire::https::CaInfo",
                       "Acquire::https::CaPath", "Acquire::https::SslCert",
                       "Acquire::https::SslKey")

Log = Callable[[str], None]


class BuildError(RuntimeError):
    """A step of the build failed; the message says which and shows the end of its log."""


@dataclass(frozen=True)
class BuiltImage:
    """One image as an OCI archive: `ctr images import ARCHIVE` names it `ref`."""

    name: str
    ref: str
    archive: Path
    key: str
    size: str  # unpacked, as buildah reports it ("393 MB"); "" for the stand-in bases

    @property
    def archive_size(self) -> int:
        return self.archive.stat().st_size


def cache_dir() -> Path:
    """Where the archives are kept: $KUBETRAIN_IMAGE_CACHE or the user's cache folder."""
    if os.environ.get("KUBETRAIN_IMAGE_CACHE"):
        return Path(os.environ["KUBETRAIN_IMAGE_CACHE"])
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "kubetrain" / "images"


def _version() -> str:
    with open(REPO / "pyproject.toml", "rb") as f:
        return str(tomllib.load(f)["project"]["version"])


def _sha(*parts: str | bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        b = p.encode() if isinstance(p, str) else p
        h.update(len(b).to_bytes(8, "big") + b)
    return h.hexdigest()


def _run(cmd: Sequence[str], log_file: Path, *, env: dict[str, str] | None = None,
         cwd: Path | None = None, echo: Log | None = None,
         echo_pattern: str = "") -> str:
    """Run CMD with its output appended to LOG_FILE; lines matching ECHO_PATTERN are
    passed to ECHO as progress. Raises BuildError with the log's end when it fails."""
    progress = re.compile(echo_pattern) if echo_pattern else None
    with open(log_file, "a") as log:
        log.write(f"\n$ {shlex.join(cmd)}\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=env, cwd=cwd, errors="replace")
        assert proc.stdout is not None
        out: list[str] = []
        for line in proc.stdout:
            log.write(line)
            out.append(line)
            if echo and progress and progress.match(line):
                echo(line.rstrip())
        rc = proc.wait()
    if rc != 0:
        tail = "".join(out[-25:])
        raise BuildError(f"{shlex.join(cmd[:6])} ... failed with exit status {rc} "
                         f"(whole log: {log_file}):\n{tail}")
    return "".join(out)


def ensure_packages(log: Log, packages: Sequence[str] = APT_PACKAGES) -> None:
    """Install the Debian packages that are missing (apt-get update + install, quiet)."""
    missing = []
    for p in packages:
        q = subprocess.run(["dpkg-query", "-W", "-f=${Status}", p],
                           capture_output=True, text=True, check=False)
        if q.stdout.strip() != "install ok installed":
            missing.append(p)
    if not missing:
        return
    cmd = "apt-get install -y --no-install-recommends " + " ".join(missing)
    if os.geteuid() != 0:
        raise BuildError(f"missing Debian packages {', '.join(missing)}: as root, run `{cmd}`")
    log(f"images: installing {' '.join(missing)} with apt-get (about 15 s)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    # The lock tests/install/debian-packages.sh takes too: two apt-get runs at once fail on
    # apt's own lock instead of waiting for each other.
    wait = os.environ.get("APT_LOCK_WAIT", "600")
    apt = ["flock", "--wait", wait, APT_LOCK, "apt-get", "-o", f"DPkg::Lock::Timeout={wait}"]
    for c in ([*apt, "update", "-qq"], [*apt, *cmd.split()[1:], "-qq"]):
        r = subprocess.run(c, capture_output=True, text=True, env=env, check=False)
        if r.returncode != 0:
            raise BuildError(f"`{shlex.join(c[4:])}` failed ({r.returncode}) installing "
                             f"{', '.join(missing)}:\n{r.stderr[-2000:]}")


def _apt_options() -> list[str]:
    dump = subprocess.run(["apt-config", "dump"], capture_output=True, text=True,
                          check=False).stdout
    opts = [line for line in dump.splitlines() if line.startswith(APT_OPTION_PREFIXES)]
    if os.path.getsize("/etc/apt/auth.conf") if os.path.exists("/etc/apt/auth.conf") else 0:
        opts.append('Dir::Etc::netrc "/etc/apt/auth.conf"')
    if os.path.isdir("/etc/apt/auth.conf.d") and os.listdir("/etc/apt/auth.conf.d"):
        opts.append('Dir::Etc::netrcparts "/etc/apt/auth.conf.d"')
    return opts


def _mmdebstrap_args(sources: list[str]) -> list[str]:
    """mmdebstrap's command for the python stand-in, writing a tar to stdout's place '{out}'."""
    return [
        "mmdebstrap", "--variant=minbase", "--format=tar",
        *(f"--aptopt={o}" for o in _apt_options()),
        "--dpkgopt=path-exclude=/usr/share/man/*", "--dpkgopt=path-exclude=/usr/share/doc/*",
        "--dpkgopt=path-include=/usr/share/doc/*/copyright",
        "--dpkgopt=path-exclude=/usr/share/locale/*", "--dpkgopt=path-exclude=/usr/share/info/*",
        # the machine's apt settings stay out of the image
        '--customize-hook=rm -f "$1"/etc/apt/apt.conf.d/99mmdebstrap "$1"/var/cache/apt/*.bin',
        '--customize-hook=rm -rf "$1"/var/lib/apt/lists/*',
        "--include=python3,python3-venv,ca-certificates",
        '--customize-hook=chroot "$1" python3 -m venv /usr/local/venv',
        SUITE, "{out}", *sources,
    ]


def _context_files(dockerfiles: Sequence[Path]) -> list[str]:
    """The repository files the Dockerfiles' COPY instructions take from the build context."""
    sources: set[str] = set()
    for df in dockerfiles:
        for line in df.read_text().splitlines():
            words = line.split()
            if words[:1] == ["COPY"] and not any(w.startswith("--from") for w in words):
                sources.update(w for w in words[1:-1] if not w.startswith("--"))
    roots = sorted(sources)
    try:
        listed = subprocess.run(
            ["git", "-C", str(REPO), "ls-files", "-z", "-c", "-o", "--exclude-standard", "--",
             *roots], capture_output=True, check=True).stdout.decode()
        files = sorted({f for f in listed.split("\0") if f and (REPO / f).is_file()})
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: skip byte code
        files = []
        for root in roots:
            p = REPO / root
            found = [p] if p.is_file() else [q for q in p.rglob("*") if q.is_file()]
            files += [str(q.relative_to(REPO)) for q in found
                      if "__pycache__" not in q.parts and q.suffix != ".pyc"]
        files.sort()
    return files


def _stage_context(files: list[str], dest: Path) -> str:
    """Copy FILES into DEST (a clean build context); return their content hash."""
    h = hashlib.sha256()
    for f in files:
        src = REPO / f
        data = src.read_bytes()
        executable = os.access(src, os.X_OK)
        h.update(f"{f}\0{int(executable)}\0{len(data)}\0".encode() + data)
        target = dest / f
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        target.chmod(0o755 if executable else 0o644)
    return h.hexdigest()


class _Buildah:
    """Debian's buildah with storage, state, temporary files and network config in WORK."""

    def __init__(self, work: Path, log_file: Path, mounts: list[str], log: Log) -> None:
        self.work, self.log_file, self.log = work, log_file, log
        (work / "cni").mkdir(parents=True)
        (work / "tmp").mkdir()
        conf = work / "containers.conf"
        conf.write_text(f'[network]\nnetwork_config_dir = "{work / "cni"}"\n')
        self.env = {**os.environ, "CONTAINERS_CONF": str(conf), "TMPDIR": str(work / "tmp")}
        self.base = ["buildah", "--root", str(work / "root"), "--runroot", str(work / "run"),
                     "--storage-driver", "overlay"]
        self.mounts = mounts

    def __call__(self, *args: str, echo: Log | None = None) -> str:
        return _run([*self.base, *args], self.log_file, env=self.env, echo=echo,
                    echo_pattern=r"(\[\d+/\d+\] )?STEP ")

    def build(self, name: str, dockerfile: Path, context: Path, tag: str,
              build_args: dict[str, str]) -> float:
        t = time.monotonic()
        self.log(f"images: building {name} ({dockerfile.name})")
        args = [a for k, v in build_args.items() for a in ("--build-arg", f"{k}={v}")]
        vols = [a for m in self.mounts for a in ("-v", m)]
        done = threading.Event()

        def heartbeat() -> None:  # pip steps run a minute without a line of progress
            while not done.wait(20):
                self.log(f"  {name}| ... {time.monotonic() - t:.0f} s")

        threading.Thread(target=heartbeat, daemon=True).start()
        try:
            self("bud", "--isolation", "chroot", "--network", "host", "--pull=never",
                 "--layers=false", *vols, *args, "-f", str(dockerfile), "-t", tag, str(context),
                 echo=lambda line: self.log(f"  {name}| {line[:110]}"))
        finally:
            done.set()
        took = time.monotonic() - t
        self.log(f"images: built {name} in {took:.0f} s")
        return took

    def image_size(self, tag: str) -> str:
        listed = json.loads(self("images", "--json", tag))
        return str(listed[0].get("size", "")) if listed else ""


def _unmount_under(path: Path) -> None:
    """Unmount whatever is still mounted under PATH (deepest first)."""
    prefix = str(path.resolve()) + "/"
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f]
    for p in sorted((p for p in points if p.startswith(prefix)), key=len, reverse=True):
        subprocess.run(["umount", "-l", p], check=False, capture_output=True)


@contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """One build at a time per cache folder (make images and a test may start together)."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@dataclass
class _Plan:
    version: str
    pip_conf: bytes
    pip_paths: list[str]
    sources: list[str]
    context_files: list[str]
    context_hash: str
    keys: dict[str, str]

    def path(self, cache: Path, name: str) -> Path:
        return cache / f"{name}-{self.keys[name][:16]}.oci.tar"


def _plan(work: Path) -> _Plan:
    dockerfiles = [REPO / "images" / f"{n}.Dockerfile" for n in IMAGES]
    try:
        pip_paths = write_pip_conf(str(work / "pip.conf"))
    except PipConfigError as error:
        raise BuildError(str(error)) from None
    # The files the configuration names count as part of it (a constraint file's content
    # changes what pip installs); folders (wheel stores, indexes) only by name.
    pip_conf = (work / "pip.conf").read_bytes() + b"".join(
        Path(p).read_bytes() for p in pip_paths if os.path.isfile(p))
    sources = source_lines(SUITE)
    if not sources:
        raise BuildError(f"no '{SUITE}' sources in /etc/apt/sources.list{{,.d}}: mmdebstrap "
                         "needs a Debian bookworm mirror that apt on this machine can reach")
    files = _context_files(dockerfiles)
    context_hash = _stage_context(files, work / "context")
    recipe = (HERE / "rootfs2oci.py").read_bytes()
    base = _sha("python", recipe, json.dumps(_mmdebstrap_args(sources)), VENV_PATH)
    pause = _sha("pause", recipe, json.dumps(sources))
    torch = _sha(base, (HERE / "pytorch-cpu.Containerfile").read_bytes(), TORCH_VERSION,
                 TORCH_PIP_ARGS, pip_conf)
    keys = {
        "python": base,
        "pause": pause,
        "operator": _sha(base, (REPO / "images/operator.Dockerfile").read_bytes(),
                         context_hash, pip_conf, LAYER_COMPRESSION),
        "trainer": _sha(torch, (REPO / "images/trainer.Dockerfile").read_bytes(),
                        context_hash, pip_conf, LAYER_COMPRESSION),
    }
    return _Plan(_version(), pip_conf, pip_paths, sources, files, context_hash, keys)


def _make_python_base(plan: _Plan, work: Path, out: Path, log_file: Path, log: Log) -> None:
    t = time.monotonic()
    log(f"images: making the python base with mmdebstrap ({len(plan.sources)} apt source "
        "line(s) from this machine, about 30 s)")
    rootfs = work / "python.rootfs.tar"
    cmd = [str(rootfs) if a == "{out}" else a for a in _mmdebstrap_args(plan.sources)]
    _run(["nice", "-n", "19", *cmd], log_file, echo=lambda line: log(f"  base| {line}"),
         echo_pattern="I: (downloading|installing|creating|success)")
    rootfs_to_oci(str(rootfs), str(out), PYTHON_BASE, env=[VENV_PATH, "LANG=C.UTF-8"],
                  cmd=["python3"])
    rootfs.unlink()
    log(f"images: python base in {time.monotonic() - t:.0f} s")


def _make_pause(work: Path, out: Path, log_file: Path) -> None:
    tmp = work / "pause"
    (tmp / "rootfs").mkdir(parents=True)
    _run(["apt-get", "download", "-o", "APT::Sandbox::User=root", "catatonit"], log_file, cwd=tmp)
    deb = next(tmp.glob("catatonit_*.deb"))
    _run(["dpkg-deb", "-x", str(deb), str(tmp / "x")], log_file)
    shutil.copy2(tmp / "x/usr/bin/catatonit", tmp / "rootfs/catatonit")
    shutil.copy2(tmp / "x/usr/share/doc/catatonit/copyright", tmp / "rootfs/catatonit.copyright")
    _run(["tar", "-C", str(tmp / "rootfs"), "--owner=0", "--group=0", "--numeric-owner", "-cf",
          str(tmp / "rootfs.tar"), "./catatonit", "./catatonit.copyright"], log_file)
    rootfs_to_oci(str(tmp / "rootfs.tar"), str(out), PAUSE_IMAGE,
                  entrypoint=["/catatonit", "-P"], cmd=None)


def _store(tmp: Path, final: Path, meta: dict[str, object]) -> None:
    """Move a finished archive into the cache and drop older archives of the same image."""
    name = final.name.rsplit("-", 1)[0]
    for old in final.parent.glob(f"{name}-*.oci.tar"):
        if old != final:
            old.unlink()
            old.with_suffix(".json").unlink(missing_ok=True)
    final.with_suffix(".json").write_text(json.dumps(meta))
    os.replace(tmp, final)


def _built(plan: _Plan, cache: Path, name: str) -> BuiltImage | None:
    path = plan.path(cache, name)
    if not path.is_file():
        return None
    meta_path = path.with_suffix(".json")
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    return BuiltImage(name, str(meta.get("ref", "")), path, plan.keys[name],
                      str(meta.get("size", "")))


def build_images(names: Sequence[str] = IMAGES, log: Log = print) -> dict[str, BuiltImage]:
    """Build NAMES (operator, trainer) unless cached; return them and the stand-in bases.

    The result maps "operator", "trainer", "python" (the stand-in python base) and "pause"
    to their archives. Raises BuildError with what failed and where its log is.
    """
    unknown = set(names) - set(IMAGES)
    if unknown:
        raise BuildError(f"unknown image(s) {sorted(unknown)}: choose from {list(IMAGES)}")
    start = time.monotonic()
    if os.geteuid() == 0:  # cached images are of no use without the runtime to run them
        ensure_packages(log)
    cache = cache_dir()
    # util-linux's mount (mmdebstrap's) makes /run/mount, libmount's utab folder
    had_run_mount = os.path.exists("/run/mount")
    with _locked(cache):
        work = Path(tempfile.mkdtemp(prefix="work-", dir=cache))
        try:
            plan = _plan(work)
            wanted = ["python", "pause", *names]
            missing = [n for n in wanted if _built(plan, cache, n) is None]
            if not missing:
                log(f"images: all up to date in {cache} (content hashes match; "
                    f"nothing built, {time.monotonic() - start:.1f} s)")
            else:
                if os.geteuid() != 0:
                    raise BuildError("building images needs root (mmdebstrap, buildah's "
                                     "chroot isolation); the cache has no archive for "
                                     + ", ".join(missing))
                _build_missing(plan, cache, work, missing, log)
            result = {n: b for n in wanted if (b := _built(plan, cache, n)) is not None}
        finally:
            _unmount_under(work)
            shutil.rmtree(work, ignore_errors=True)
            if not had_run_mount:
                with suppress(OSError):
                    os.rmdir("/run/mount")
    _report(result, time.monotonic() - start, log)
    return result


def _build_missing(plan: _Plan, cache: Path, work: Path, missing: list[str], log: Log) -> None:
    log_file = cache / "build.log"
    log_file.write_text(f"build_images.py: {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    log(f"images: building {', '.join(missing)} (log: {log_file})")
    python_base = plan.path(cache, "python")
    if "python" in missing:
        tmp = work / "python.oci.tar"
        _make_python_base(plan, work, tmp, log_file, log)
        _store(tmp, python_base, {"ref": PYTHON_BASE})
    if "pause" in missing:
        tmp = work / "pause.oci.tar"
        _make_pause(work, tmp, log_file)
        _store(tmp, plan.path(cache, "pause"), {"ref": PAUSE_IMAGE})
    images = [n for n in IMAGES if n in missing]
    if not images:
        return
    with _buildah_on_python_base(work, plan.pip_paths, python_base, log_file, log) as buildah:
        context = work / "context"
        tags = {n: f"ghcr.io/kubetrain/{n}:{plan.version}" for n in images}

        lock = threading.Lock()

        def push(name: str) -> None:
            t = time.monotonic()
            tmp = work / f"{name}.oci.tar"
            buildah("push", "-q", "--compression-format", LAYER_COMPRESSION, tags[name],
                    f"oci-archive:{tmp}:{tags[name]}")
            size = buildah.image_size(tags[name])
            with lock:
                _store(tmp, plan.path(cache, name), {"ref": tags[name], "size": size})
            log(f"images: wrote {name} archive in {time.monotonic() - t:.0f} s")

        def operator() -> None:
            buildah.build("operator", REPO / "images/operator.Dockerfile", context,
                          tags["operator"], {"PYTHON_IMAGE": PYTHON_BASE})
            push("operator")

        def trainer() -> None:
            buildah.build("pytorch-cpu base", HERE / "pytorch-cpu.Containerfile", HERE,
                          TORCH_BASE, {"PYTHON_IMAGE": PYTHON_BASE, "TORCH_VERSION": TORCH_VERSION,
                                       "TORCH_PIP_ARGS": TORCH_PIP_ARGS})
            buildah.build("trainer", REPO / "images/trainer.Dockerfile", context,
                          tags["trainer"], {"PYTORCH_IMAGE": TORCH_BASE})
            push("trainer")

        # The two chains are independent: side by side, each waits on pip as much as on CPU,
        # and each writes its archive as soon as its image is built (the operator's while
        # the trainer still builds: 18 s of a cold build's 344 s were that archive, after).
        jobs = {"operator": operator, "trainer": trainer}
        with ThreadPoolExecutor(max_workers=2) as pool:
            for future in [pool.submit(jobs[n]) for n in images]:
                future.result()


@contextmanager
def _buildah_on_python_base(work: Path, pip_paths: Sequence[str], python_base: Path,
                            log_file: Path, log: Log) -> Iterator[_Buildah]:
    """A buildah in WORK/buildah with the python base pulled, whose RUN steps see this
    machine's pip configuration (WORK/pip.conf as /etc/pip.conf, and every local path it
    names at the same path, read-only); everything it mounted or cached is undone after."""
    mounts = [f"{work / 'pip.conf'}:/etc/pip.conf:ro", *(f"{p}:{p}:ro" for p in pip_paths)]
    log(f"images: pip in the builds uses this machine's pip configuration "
        f"({len(pip_paths)} local path(s) mounted read-only)")
    # containers/image keeps a blob-info cache at a fixed path for root: removed afterwards
    # if it was not there before.
    had_var_lib = os.path.exists("/var/lib/containers")
    buildah = _Buildah(work / "buildah", log_file, mounts, log)
    try:
        buildah("pull", "-q", f"oci-archive:{python_base}")
        yield buildah
    finally:
        _unmount_under(work / "buildah")
        if not had_var_lib:
            Path("/var/lib/containers/cache/blob-info-cache-v1.boltdb").unlink(missing_ok=True)
            for d in ("/var/lib/containers/cache", "/var/lib/containers"):
                with suppress(OSError):
                    os.rmdir(d)
            if os.path.exists("/var/lib/containers"):
                log("images: /var/lib/containers is not empty; left as is")


def build_on_python_base(dockerfile: Path, python_base: Path, log: Log = print) -> None:
    """Build DOCKERFILE (its context: its folder) FROM the python stand-in base archive
    PYTHON_BASE (passed as the build argument PYTHON_IMAGE), with this machine's pip
    configuration exactly as the images get it; the result is discarded.

    For checks of the build set-up itself (tests/images). Raises BuildError when the
    configuration names a missing path or a step fails.
    """
    work = Path(tempfile.mkdtemp(prefix="work-", dir=cache_dir()))
    try:
        try:
            pip_paths = write_pip_conf(str(work / "pip.conf"))
        except PipConfigError as error:
            raise BuildError(str(error)) from None
        with _buildah_on_python_base(work, pip_paths, python_base, work / "build.log",
                                     log) as buildah:
            buildah.build(dockerfile.stem, dockerfile, dockerfile.parent, "localhost/check",
                          {"PYTHON_IMAGE": PYTHON_BASE})
    finally:
        _unmount_under(work)
        shutil.rmtree(work, ignore_errors=True)


def _human(n: float) -> str:
    for unit in ("B", "kB", "MB"):
        if n < 1000:
            return f"{n:.0f} {unit}"
        n /= 1000
    return f"{n:.2f} GB"


def _report(images: dict[str, BuiltImage], took: float, log: Log) -> None:
    log(f"images: done in {took:.0f} s")
    for b in images.values():
        size = f"{b.size} unpacked, " if b.size else ""
        log(f"  {b.name:9} {b.ref:42} {size}{_human(b.archive_size)} archive  {b.archive}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("images", nargs="*", default=list(IMAGES), help="operator, trainer")
    ap.add_argument("--print-paths", action="store_true",
                    help="only print NAME ARCHIVE lines (after building what is missing)")
    a = ap.parse_args()
    quiet: Log = lambda line: print(line, file=sys.stderr)  # noqa: E731
    try:
        built = build_images(a.images, log=quiet if a.print_paths else print)
    except BuildError as e:
        print(f"images: {e}", file=sys.stderr)
        return 1
    if a.print_paths:
        for b in built.values():
            print(b.name, b.archive)
    return 0


if __name__ == "__main__":
    sys.exit(main())
