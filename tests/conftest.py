"""Fixtures shared by every test area: real servers started by the tests themselves."""

from __future__ import annotations

import os
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:  # whole_loop imports the kubernetes client: only where a test needs it
    from whole_loop import NodeRuntime

REPO = Path(__file__).resolve().parents[1]
# The harnesses that stand in for parts of a cluster (tests/cluster/) and the offline image
# build (images/offline/) import as top-level modules, as tests/operator/harness.py does.
sys.path[:0] = [str(REPO / "tests" / "cluster"), str(REPO / "images" / "offline")]
sys.path.append(str(REPO / "tests"))  # the suite's own plugins (suite_budget)


def pytest_configure(config: pytest.Config) -> None:
    """Every run reports where its time went and, on CI, keeps to the suite's ceiling."""
    from suite_budget import SuiteBudget  # tests/suite_budget.py, beside this file

    config.pluginmanager.register(SuiteBudget(config), "suite-budget")

# Tests never reach real AWS: fake credentials, and no metadata-service lookups.
os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")


@pytest.fixture(scope="session", autouse=True)
def _torchrun_files_in_the_sessions_folder(
        tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """torchrun's own files (PET_LOG_DIR: its --log-dir) in the session's temporary folder,
    for every torchrun the tests start: by default each one leaves a /tmp/torchelastic_*
    folder behind. An explicit --log-dir (`kubetrain run`'s) still wins."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PET_LOG_DIR", str(tmp_path_factory.mktemp("torchrun")))
        yield


@pytest.fixture(scope="session")
def node_runtime(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeRuntime]:
    """A containerd with the trainer and operator images imported (whole_loop.NodeRuntime),
    once a session: the whole loop's nodes run their pods in it (tests/e2e/conftest.py:
    `cluster`), and tests/images runs the images in it directly. The images are built if
    not cached. Skipped without root and the runtime's tools (failed under CI). The
    modules that use it share one worker (NODE_RUNTIME_MODULES, below), or each
    worker would import the images again."""
    from build_images import build_images
    from machine_state import left_behind, snapshot
    from pod_network import ensure_namespace_folder
    from whole_loop import missing_host_support, node_runtime

    reason = missing_host_support()
    if reason is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI needs the whole loop: {reason}", pytrace=False)
        pytest.skip(reason)
    images = build_images(("operator", "trainer"), log=lambda line: print(line, flush=True))
    folder = tmp_path_factory.mktemp("node-runtime")
    ensure_namespace_folder()  # the session's, removed at its end (pytest_sessionfinish)
    before = snapshot()
    with node_runtime(folder, images) as node:
        mine = [str(folder), node.runtime.cgroup_parent, str(node.runtime.run_dir)]
        yield node
    left = left_behind(before, snapshot(), mine)
    assert not left, "the node runtime left this on the machine:\n" + "\n".join(left)


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """moto's S3 server over real HTTP on a random loopback port."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


@pytest.fixture(scope="module")
def new_bucket(s3_endpoint: str) -> Callable[[str], str]:
    """Creates an empty bucket of the given name on the module's S3 server; returns the name.
    For fixtures wider than one test (s3_bucket is one test's). Module-wide, not session-wide:
    a module may bring its own `s3_endpoint` (test_resume_rclone's is rclone's server)."""
    import boto3

    client = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")

    def create(name: str) -> str:
        client.create_bucket(Bucket=name)
        return name

    return create


@pytest.fixture
def s3_bucket(new_bucket: Callable[[str], str], request: pytest.FixtureRequest) -> str:
    """A fresh, empty bucket for one test; returns its name."""
    name = "t-" + request.node.name.lower().replace("_", "-")[:40].strip("-[]")
    return new_bucket("".join(c if c.isalnum() or c == "-" else "-" for c in name))


@pytest.fixture
def minimal_manifest() -> dict:
    """The smallest valid TrainingJob manifest: image, model preset, data, checkpoint uri."""
    return {
        "apiVersion": "kubetrain.io/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": "demo"},
        "spec": {
            "image": "ghcr.io/kubetrain/trainer:0.1.0",
            "model": {"preset": "tiny"},
            "data": {"train": "s3://datasets/corpus/train"},
            "checkpoint": {"uri": "s3://checkpoints/demo"},
        },
    }


@pytest.fixture(scope="session")
def prepared_corpus(tmp_path_factory: pytest.TempPathFactory) -> object:
    """A small real corpus prepared with `kubetrain prepare` into a temp folder.

    About 300 KB of the Python standard library's own `.py` sources, a byte-level
    BPE tokenizer of 2048 entries (the `tiny` preset's vocabulary), 16 Ki-token
    shards and a 1-in-10-documents validation split. Returns a
    `kubetrain.trainer.prepare.PreparedDataset`: use `.train_uri` for
    spec.data.train (validation is found beside it), `.validation_uri`,
    `.tokenizer_uri`, and `.train.vocab_size` / `.train.total_tokens`.
    """
    from kubetrain.local.workspace import copy_stdlib_sources
    from kubetrain.trainer.prepare import prepare

    corpus = copy_stdlib_sources(tmp_path_factory.mktemp("corpus-text"),
                                 max_bytes=300_000, max_file_bytes=20_000)
    return prepare([str(corpus)], str(tmp_path_factory.mktemp("corpus")), vocab_size=2048,
                   shard_tokens=16 * 1024, validation_fraction=0.1, progress=False)


_control_plane: Any = None  # the session's control plane, for failure reports
# The start of the skip reason of every real-server test without binaries: the run's
# summary counts them by it.
NO_REAL_SERVER = "needs a real kube-apiserver"


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A real Kubernetes control plane (tests/cluster/control_plane.py) with the CRD installed.

    The real-server tier (tests/real_server) uses it. Started once per session; its data
    and logs live under the session's temp dir, and the tail of every component's log is
    added to the report of a test that fails with it. Its binaries come from
    `$KUBEBUILDER_ASSETS` only (no registry reachable here ships them): without them the
    tests that need it skip, under CI=true too, saying how to get them, and the run's
    summary counts them.
    """
    global _control_plane
    from control_plane import ControlPlane, ControlPlaneUnavailable

    try:
        plane = ControlPlane(tmp_path_factory.mktemp("control-plane"))
    except ControlPlaneUnavailable as error:
        pytest.skip(f"{NO_REAL_SERVER}: {error}")

    def install_crd(plane: ControlPlane) -> None:
        applied = plane.kubectl("apply", "--server-side", "-f",
                                str(REPO / "crds" / "trainingjob.yaml"))
        assert "Warning" not in applied.stderr, applied.stderr
        plane.kubectl("wait", "--for=condition=Established", "--timeout=60s",
                      "crd/trainingjobs.kubetrain.io")

    plane.start(before_controllers=install_crd)
    try:
        _control_plane = plane
        yield plane
    finally:
        _control_plane = None
        plane.stop()


# Whether /run/netns was there before the session: the tests that compare the machine
# before and after make it first (pod_network.ensure_namespace_folder), as `ip netns add`
# leaves it; the session removes it at its end if it was not there before. Under xdist, the
# controller's session spans every worker's.
_netns_folder_was_there = True


def pytest_sessionstart(session: pytest.Session) -> None:
    global _netns_folder_was_there
    if not hasattr(session.config, "workerinput"):
        from pod_network import NETNS_DIR
        _netns_folder_was_there = os.path.exists(NETNS_DIR)


def pytest_sessionfinish(session: pytest.Session) -> None:
    if not hasattr(session.config, "workerinput") and not _netns_folder_was_there:
        from pod_network import remove_namespace_folder
        remove_namespace_folder()


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """The skipped tests, one line a reason: pytest's own list (`-rs`) repeats the
    real-server tier's long reason once per test, and its 30 lines pushed the suite's
    budget report out of the tail of CI's output that its record keeps."""
    skipped = terminalreporter.stats.get("skipped", [])
    if not skipped:
        return
    real_server: list[str] = []  # each one's reason: why the control plane is missing
    elsewhere: Counter[str] = Counter()
    for report in skipped:
        path, line, reason = report.longrepr if isinstance(report.longrepr, tuple) else (
            report.nodeid, None, str(report.longrepr))
        reason = reason.removeprefix("Skipped: ")
        if reason.startswith(NO_REAL_SERVER):
            real_server.append(reason.partition(": ")[2])
        else:
            path = os.path.relpath(path, terminalreporter.config.rootpath)
            elsewhere[f"{path}:{line}: {reason}" if line is not None else f"{path}: {reason}"] += 1
    terminalreporter.write_sep("-", "skipped", yellow=True)
    for place, count in sorted(elsewhere.items()):
        terminalreporter.write_line(f"{count:4d}  {place}")
    if real_server:
        terminalreporter.write_line(
            f"{len(real_server):4d}  the real-server tier: they need a real kube-apiserver "
            "(server-side CEL, RBAC, garbage collection, scheduler, node lifecycle, kubectl's "
            "printing). Set KUBEBUILDER_ASSETS to envtest assets to run them; "
            f"docs/contributing.md, 'The real-server tier', says how. Why here: {real_server[0]}")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    if report.failed and _control_plane is not None and \
            "control_plane" in getattr(item, "fixturenames", ()):
        report.sections.append(("control plane logs", _control_plane.log_tails(lines=15)))
    return report


# `make test` shares the tests between three pytest-xdist workers. A module's tests stay
# together and in file order, so its module-scoped fixtures (a trained teacher, a running
# cluster) are built once and a test may print what an earlier one measured. The modules
# of tests/real_server share one control plane: they all go to one worker, and so do the
# modules on the session's node runtime (`node_runtime`: the e2e modules whose scenarios
# run on the whole loop, tests/e2e/conftest.py's `cluster`, and tests/images), which one
# worker starts once, and the trainer modules that read the same healthy runs. The e2e
# modules start first, being the longest part.
# (xdist's `--dist loadgroup` would say this with marks, but under pytest 9.2 it silently
# stops grouping: pytest-dev/pytest-xdist#1386.)

# The modules on the session's node runtime: a second worker would import the images into
# a containerd of its own again (40-50 s of containerd's CPU), and start a second whole loop.
NODE_RUNTIME_MODULES = ("tests/e2e/test_whole_loop.py", "tests/e2e/test_nodes.py",
                        "tests/e2e/test_own_code.py", "tests/e2e/test_hsdp.py",
                        "tests/e2e/test_fault_tolerance_e2e.py", "tests/images/test_images.py")
# Modules that read the same session-scoped runs (tests/trainer/conftest.py: healthy_runs).
HEALTHY_RUN_MODULES = ("tests/trainer/test_preflight.py", "tests/trainer/test_rank_timing.py")


def _scope(nodeid: str) -> str:
    module = nodeid.split("::", 1)[0]
    if module.startswith("tests/real_server/"):
        return "tests/real_server"
    if module in HEALTHY_RUN_MODULES:
        return "tests/trainer/healthy-runs"
    return "tests/node-runtime" if module in NODE_RUNTIME_MODULES else module


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getvalue("dist") != "load":  # `-n N` alone; an explicit --dist is obeyed
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByModule(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _scope(nodeid)

    config.option.loadscopereorder = False  # the workers' order: tests/e2e first
    return ByModule(config, log)


def _on_the_node_runtime(item: pytest.Item) -> bool:
    """Whether `item` uses the session's node runtime (`node_runtime`, itself or through
    the whole loop's `cluster`)."""
    return "node_runtime" in getattr(item, "fixturenames", ())


# The folders whose tests start real processes (torchrun launches, `kubetrain run`,
# containers, pip installs): minutes each, where the others' modules take seconds.
PROCESS_HEAVY = ("tests/trainer/", "tests/local/", "tests/storage/", "tests/images/",
                 "tests/install/", "tests/own_code/")
# Modules that start no process of their own but take tens of seconds, mostly waiting (on
# probes' timeouts, an operator's scenarios): handed out with the process-heavy ones. Last,
# in file order, test_lifeline_watch's 39 s held the end of a 921 s run (2026-12-01) with
# the other two workers done and the cores 0-20 % busy for its last 25 s.
LONG_WAITING = ("tests/operator/test_lifeline_watch.py",
                "tests/operator/test_operator_integration.py", "tests/chart/test_rbac.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under xdist, the order the modules are handed out in: the e2e modules first, then
    those that start real processes or wait long, then the rest, each module whole and in
    file order.
    The long modules go early so that the end of the run is short ones that keep both
    workers busy: with the trainer modules last (file order), one worker sat idle for the
    last 112 s of a 1,789 s run; with only the modules marked slow first, 115 s of 1,835 s
    (long modules with no slow mark, test_preflight's 144 s among them, still came last).

    A module on the session's node runtime that NODE_RUNTIME_MODULES does not name is an
    error: on another worker it would start a second one (a containerd, the images' import,
    for the whole loop an operator too), as test_fault_tolerance_e2e.py did until it was
    named."""
    strays = sorted({item.nodeid.split("::", 1)[0] for item in items
                     if _on_the_node_runtime(item)} - set(NODE_RUNTIME_MODULES))
    if strays:
        raise pytest.UsageError(f"{', '.join(strays)} run on the session's node runtime "
                                "(`node_runtime`, or the whole loop's `cluster`): add them to "
                                "NODE_RUNTIME_MODULES in tests/conftest.py")
    if not hasattr(config, "workerinput"):
        return

    def order(item: pytest.Item) -> tuple[bool, bool]:
        return (not item.nodeid.startswith("tests/e2e/"),
                not item.nodeid.startswith((*PROCESS_HEAVY, *LONG_WAITING)))

    items.sort(key=order)
