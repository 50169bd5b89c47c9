"""Operator at scale: N TrainingJobs of 4 workers at once, on a real control plane or the emulator.

On a real control plane (`--api real`, the default where `find_binaries` finds
kube-apiserver and etcd), each round starts a fresh control plane
(tests/cluster/control_plane.py: etcd and kube-apiserver, with an audit log; no scheduler
or controller-manager, whose work on thousands of unschedulable pods would load both sides
alike and tell nothing) three times:
- baseline: one client process creates every object the operator would create
  (job, Service, ConfigMap, 4 pods per job) directly with the Kubernetes client's
  generated methods, as a user's script would;
- raw baseline, stricter: the same, the children sent as the operator sends them
  (`ApiWriter`: the same client without its methods' per-call checks and model
  decoding), so the ratio shows the operator's overhead apart from how cheaply it
  sends a request;
- kubetrain: the jobs are created and `kubetrain operator` (its own process, the
  chart's ServiceAccount and RBAC) creates the rest; this process counts the pods on
  one watch.
It prints the median ratios of the times until every pod exists (goal <= 1.5 against
the client), the pods created per second, the operator's API writes per job from the
API server's own audit log (objects + one status write per transition + one event per
transition), and the operator's peak memory (VmHWM; goal <= 256 MiB at 500 jobs).

Without those binaries (`--api emulator`, the default then) the same rounds run on kmock's
emulator (tests/cluster/emulator.py) in this process: the baseline client and the operator
talk to it over HTTP as to an API server, the operator's writes are counted from the
requests the emulator served (by the operator's User-Agent) instead of an audit log, and
"server CPU" is this process's: the emulator plus the pod watch. The emulator keeps
everything in one Python thread and stores no etcd, so its times and ratios are not
comparable with the real server's; every figure it prints says "emulator". What does carry
over: the operator's writes per job, its CPU seconds and its peak memory, measured on every
machine.

    python bench/operator_scale.py --jobs 500 --rounds 3 [--api real|emulator]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parents[1] / "tests" / "cluster"))
sys.path.insert(0, str(Path(__file__).parents[1] / "tests" / "operator"))
import harness
from control_plane import REPO, ControlPlane, ControlPlaneUnavailable, find_binaries
from emulator import EmulatedCluster
from kubernetes import client
from kubernetes import config as kube_config
from operator_process import OperatorProcess, install_operator_identity

from kubetrain.api.manifest import parse_job
from kubetrain.operator import children
from kubetrain.operator.handlers import USER_AGENT
from kubetrain.operator.writer import ApiWriter

WORKERS = 4
THREADS = 16
AUDIT_POLICY = """apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
  - level: Metadata
    verbs: [create, update, patch, delete, deletecollection]
  - level: None
"""


def start_control_plane(directory: Path) -> ControlPlane:
    (directory / "audit-policy.yaml").write_text(AUDIT_POLICY)
    plane = ControlPlane(directory, controllers=False, apiserver_args=(
        f"--audit-policy-file={directory / 'audit-policy.yaml'}",
        f"--audit-log-path={directory / 'audit.log'}", "--audit-log-maxsize=0"))
    plane.start(before_controllers=lambda p: p.kubectl(
        "apply", "--server-side", "-f", str(REPO / "crds" / "trainingjob.yaml")))
    try:
        # Until the API server serves TrainingJobs: it answers 429 "storage is
        # (re)initializing" for a moment after the CRD is Established, and an operator
        # started then retries its first list a second later, inside the timed window,
        # which in a cluster (operator running long before the jobs) never happens.
        deadline = time.monotonic() + 60
        while plane.kubectl("get", "trainingjobs", "-A", check=False).returncode != 0:
            if time.monotonic() > deadline:
                raise RuntimeError("the API server did not serve TrainingJobs within 60 s")
            time.sleep(0.2)
        # What the controller-manager would have made: the namespace's default ServiceAccount.
        plane.kubectl("create", "serviceaccount", "default", "-n", harness.NAMESPACE)
    except BaseException:
        plane.stop()
        raise
    return plane


def _client(kubeconfig: str) -> client.ApiClient:
    configuration = client.Configuration()
    kube_config.load_kube_config(kubeconfig, client_configuration=configuration)
    configuration.connection_pool_maxsize = THREADS
    return client.ApiClient(configuration)


def _create_everything(kubeconfig: str, jobs: int, raw: bool) -> tuple[float, float]:
    """The baseline: every object, created directly; the seconds it took and the CPU
    seconds this client used. `raw`: the children through `ApiWriter`."""
    api = _client(kubeconfig)
    core, custom, writer = client.CoreV1Api(api), client.CustomObjectsApi(api), ApiWriter(api)
    generated = {"Service": core.create_namespaced_service,
                 "ConfigMap": core.create_namespaced_config_map,
                 "Pod": core.create_namespaced_pod}

    def create(manifest: dict[str, Any]) -> None:
        if raw:
            writer.create(harness.NAMESPACE, manifest)
        else:
            generated[manifest["kind"]](harness.NAMESPACE, manifest)

    def create_all(index: int) -> None:
        manifest = harness.job_manifest(f"job-{index}", replicas=WORKERS)
        custom.create_namespaced_custom_object(
            "kubetrain.io", "v1alpha1", harness.NAMESPACE, "trainingjobs", manifest)
        job = parse_job({**manifest, "metadata": {**manifest["metadata"], "uid": "u"}})
        create(children.service(job))
        create(children.config_map(job))
        for worker in range(WORKERS):
            create(children.worker_pod(job, worker, 0))

    start, cpu = time.perf_counter(), time.process_time()
    with ThreadPoolExecutor(THREADS) as pool:
        list(pool.map(create_all, range(jobs)))
    return time.perf_counter() - start, time.process_time() - cpu


def _create_jobs(kubeconfig: str, jobs: int) -> float:
    """Create the jobs as fast as THREADS clients can; return when it started (monotonic)."""
    custom = client.CustomObjectsApi(_client(kubeconfig))

    def create(index: int) -> None:
        custom.create_namespaced_custom_object(
            "kubetrain.io", "v1alpha1", harness.NAMESPACE, "trainingjobs",
            harness.job_manifest(f"job-{index}", replicas=WORKERS))

    start = time.monotonic()  # one clock for every process on the machine
    with ThreadPoolExecutor(THREADS) as pool:
        list(pool.map(create, range(jobs)))
    return start


def _in_another_process(function: Any, *args: Any) -> Any:
    # The client runs in its own process, as the operator does: neither shares this
    # interpreter's GIL with the pod counting.
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as process:
        return process.submit(function, *args).result()


def _server_cpu(plane: ControlPlane) -> float:
    """CPU seconds kube-apiserver and etcd have used so far."""
    return sum(_cpu_seconds(pid) for pid in plane.pids(("kube-apiserver", "etcd")))


def baseline(directory: Path, jobs: int, raw: bool) -> tuple[float, float, float]:
    """Seconds to create everything directly, the client's CPU seconds, and the server's
    CPU seconds meanwhile."""
    plane = start_control_plane(directory)
    try:
        before = _server_cpu(plane)
        elapsed, cpu = _in_another_process(_create_everything, str(plane.kubeconfig), jobs, raw)
        return elapsed, cpu, _server_cpu(plane) - before
    finally:
        plane.stop()


def with_operator(directory: Path, jobs: int,
                  ) -> tuple[float, Counter[str], int, float, float]:
    """Seconds until all pods exist, the operator's writes by verb and resource, its peak
    KiB, the CPU seconds it used from the first job until then and the server's CPU
    seconds meanwhile."""
    plane = start_control_plane(directory)
    try:
        kubeconfig = install_operator_identity(plane, {}, directory)
        elapsed, peak, cpu, server = _operator_round(
            client.CoreV1Api(plane.api_client()), kubeconfig, plane.kubeconfig, directory,
            jobs, lambda: _server_cpu(plane))
        account = "system:serviceaccount:kubetrain-system:kubetrain"
        return elapsed, _writes_of(directory / "audit.log", account), peak, cpu, server
    finally:
        plane.stop()


def baseline_emulated(directory: Path, jobs: int, raw: bool) -> tuple[float, float, float]:
    """`baseline` on a fresh emulator: the server's CPU is this process's meanwhile."""
    with EmulatedCluster(directory) as api:
        before = time.process_time()
        elapsed, cpu = _in_another_process(_create_everything, str(api.kubeconfig), jobs, raw)
        return elapsed, cpu, time.process_time() - before


def with_operator_emulated(directory: Path, jobs: int,
                           ) -> tuple[float, Counter[str], int, float, float]:
    """`with_operator` on a fresh emulator: writes counted from the requests it served."""
    with EmulatedCluster(directory) as api:
        elapsed, peak, cpu, server = _operator_round(
            client.CoreV1Api(api.api_client()), api.kubeconfig, api.kubeconfig, directory,
            jobs, time.process_time)
        return elapsed, _emulated_writes(api), peak, cpu, server


def _operator_round(core: client.CoreV1Api, operator_kubeconfig: Path, admin_kubeconfig: Path,
                    directory: Path, jobs: int, server_cpu: Callable[[], float],
                    ) -> tuple[float, int, float, float]:
    """One measured round with the operator running: seconds until all pods exist, the
    operator's peak KiB, its CPU seconds from the first job until then, and the server's
    (`server_cpu`, read before and after) meanwhile."""
    with OperatorProcess(operator_kubeconfig, directory / "operator.log",
                         resync_seconds=300) as operator, ProcessPoolExecutor(
            1, mp_context=multiprocessing.get_context("spawn")) as process:
        server_before = server_cpu()
        # From here: its start-up (imports, first lists) is not the jobs' cost.
        cpu_before = _cpu_seconds(operator.process.pid) if operator.process else 0.0
        pods = _pod_additions(core)
        started = process.submit(_create_jobs, str(admin_kubeconfig), jobs)
        _wait_for_pods(pods, jobs * WORKERS)
        elapsed = time.monotonic() - started.result()
        pods.close()
        cpu = (_cpu_seconds(operator.process.pid) if operator.process else 0.0) - cpu_before
        server = server_cpu() - server_before
        time.sleep(3.0)  # the status writes and events of the last transitions land
        peak = _peak_kib(operator.process.pid) if operator.process else 0
    return elapsed, peak, cpu, server


# The emulator's request actions that write, as the audit log's verbs.
_WRITE_VERBS = {"CREATE": "create", "DELETE": "delete"}


def _emulated_writes(api: EmulatedCluster) -> Counter[str]:
    """The operator's write requests the emulator served, by 'verb resource' as the audit
    log names them (a PATCH is `patch`, a PUT `update`)."""
    writes: Counter[str] = Counter()
    for request in api.emulator.requests():
        if request.resource is None or not request.resource.plural:
            continue
        if not request.headers.get("User-Agent", "").startswith(("kopf", USER_AGENT)):
            continue
        action, method = request.action.name, request.method.name
        if action == "UPDATE":
            verb = "patch" if method == "PATCH" else "update"
        elif action in _WRITE_VERBS:
            verb = _WRITE_VERBS[action]
        else:
            continue
        resource = request.resource.plural + (f"/{request.subresource}"
                                              if request.subresource else "")
        writes[f"{verb} {resource}"] += 1
    return writes


def _pod_additions(core: client.CoreV1Api) -> Any:
    """A watch on the namespace's pods from now on, as the raw HTTP response.

    One watch, read as JSON lines: polling a list of every pod instead (and decoding
    it into the client's models) cost this process about as much CPU as the operator
    used, on the same 2 cores, growing with the square of the job count; the baseline
    has no such cost, so that was the benchmark's own load counted against the operator.
    """
    listed = core.list_namespaced_pod(harness.NAMESPACE, limit=1, _preload_content=False)
    version = json.loads(listed.data)["metadata"]["resourceVersion"]
    return core.list_namespaced_pod(harness.NAMESPACE, watch=True, resource_version=version,
                                    timeout_seconds=600, _preload_content=False)


def _wait_for_pods(watch: Any, count: int) -> None:
    """Read the watch until `count` distinct pods were added."""
    names: set[str] = set()
    for line in watch:
        if not line.strip():
            continue
        event = json.loads(line)
        if event["type"] == "ADDED":
            names.add(event["object"]["metadata"]["name"])
            if len(names) >= count:
                return
        elif event["type"] == "ERROR":
            raise RuntimeError(f"the pod watch failed: {event['object']}")
    raise RuntimeError(f"the pod watch ended after {len(names)} of {count} pods")


def _writes_of(audit_log: Path, user: str) -> Counter[str]:
    """The user's write requests in the API server's audit log, by 'verb resource'."""
    writes: Counter[str] = Counter()
    for line in audit_log.read_text().splitlines():
        event = json.loads(line)
        if event.get("stage") != "ResponseComplete" or event["user"]["username"] != user:
            continue
        ref = event.get("objectRef", {})
        resource = ref.get("resource", "?") + (f"/{ref['subresource']}"
                                               if ref.get("subresource") else "")
        writes[f"{event['verb']} {resource}"] += 1
    return writes


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _peak_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--jobs", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=3,
                        help="baseline/operator pairs run in turn; the median ratio is the "
                        "result (a shared machine's load moves single timings)")
    parser.add_argument("--api", choices=("real", "emulator"), default=None,
                        help="a real kube-apiserver (the default where its binaries are "
                        "found) or kmock's emulator (the default elsewhere)")
    args = parser.parse_args()
    api = args.api
    try:
        find_binaries()
    except ControlPlaneUnavailable as error:
        if api == "real":
            print(f"skipped: --api real needs a kube-apiserver. {error}")
            return
        api = "emulator"
    api = api or "real"
    if api == "emulator":
        print("API: kmock's emulator in this process (tests/cluster/emulator.py). EMULATOR "
              "FIGURES: not comparable with a real kube-apiserver's.", flush=True)
        run_baseline, run_operator, server_name = (baseline_emulated, with_operator_emulated,
                                                   "emulator+watch")
    else:
        run_baseline, run_operator, server_name = baseline, with_operator, "apiserver+etcd"
    label = "emulator" if api == "emulator" else "real control plane"
    ratios, raw_ratios, rates, peaks, cpus = [], [], [], [], []
    writes: Counter[str] = Counter()
    for round_ in range(args.rounds):
        with tempfile.TemporaryDirectory() as directory:
            for part in ("baseline", "raw", "operator"):
                (Path(directory) / part).mkdir()
            direct, direct_cpu, direct_server = run_baseline(Path(directory) / "baseline",
                                                             args.jobs, raw=False)
            raw, raw_cpu, raw_server = run_baseline(Path(directory) / "raw", args.jobs,
                                                    raw=True)
            elapsed, writes, peak, cpu, server = run_operator(Path(directory) / "operator",
                                                              args.jobs)
        ratios.append(elapsed / direct)
        raw_ratios.append(elapsed / raw)
        rates.append(args.jobs * WORKERS / elapsed)
        peaks.append(peak)
        cpus.append(cpu)
        print(f"{label} round {round_ + 1}: direct creation {direct:.2f}s (client CPU "
              f"{direct_cpu:.1f}s, {server_name} {direct_server:.1f}s); raw {raw:.2f}s (client "
              f"CPU {raw_cpu:.1f}s, {server_name} {raw_server:.1f}s); operator until all pods "
              f"exist {elapsed:.2f}s (operator CPU {cpu:.1f}s, {server_name} {server:.1f}s); "
              f"ratio {elapsed / direct:.2f}, to raw {elapsed / raw:.2f}; "
              f"{args.jobs * WORKERS / elapsed:.0f} pods/s; peak {peak / 1024:.0f} MiB",
              flush=True)
    objects = 2 + WORKERS  # Service, ConfigMap, pods
    total = sum(writes.values())
    status = writes["patch trainingjobs/status"]
    events = writes["create events"]
    source = "requests the emulator served" if api == "emulator" else "audit log"
    print(f"{label}, {args.jobs} jobs x {WORKERS} workers, {args.rounds} rounds")
    print(f"time until every pod exists, operator / direct creation: median ratio "
          f"{statistics.median(ratios):.2f}"
          + (" (goal <= 1.5)" if api == "real" else " (emulator: no goal)"))
    print(f"  operator / the same requests sent raw (stricter): median ratio "
          f"{statistics.median(raw_ratios):.2f}")
    print(f"pods created per second by the operator: median {statistics.median(rates):.0f}")
    print(f"operator CPU per job until every pod exists: median "
          f"{1000 * statistics.median(cpus) / args.jobs:.1f} ms")
    print(f"operator API writes per job ({source}): {total / args.jobs:.2f} = objects "
          f"{objects} + status {status / args.jobs:.2f} + events {events / args.jobs:.2f} "
          f"+ other {(total - status - events) / args.jobs - objects:.2f}")
    for kind, count in sorted(writes.items()):
        print(f"  {kind}: {count / args.jobs:.2f}/job")
    print(f"operator peak memory (VmHWM): {max(peaks) / 1024:.0f} MiB"
          + (" (goal <= 256 MiB)" if api == "real" else " (emulator)"))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
