"""Operator at scale: N TrainingJobs of 4 workers created at once against kmock's emulator.

Prints, from one run on this machine (the timing as the median of several rounds):
- time until every worker pod exists, as a ratio to creating the same objects (job,
  service, config map, pods) directly with the Kubernetes client (goal <= 1.5); and,
  stricter, as a ratio to creating them with the operator's own write path (`ApiWriter`:
  the same client without its generated methods' per-call checks), which shows the
  operator's overhead apart from how cheaply it sends a request;
- the operator's API writes per job against the objects it had to create plus one
  status write and one event per transition (goal: nothing beyond those);
- the operator process's peak memory (VmHWM).

    python bench/operator_scale.py --jobs 500
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parents[1] / "tests" / "operator"))
import harness
from kubernetes import client
from kubernetes import config as kube_config

from kubetrain.api.manifest import parse_job
from kubetrain.operator import children
from kubetrain.operator.writer import ApiWriter

WORKERS = 4
THREADS = 16


def _pods(cluster: harness.EmulatedCluster) -> int:
    while True:
        try:
            return sum(1 for (resource, _, _), obj in list(cluster.emulator.objects.items())
                       if resource.plural == "pods" and not obj.deleted)
        except RuntimeError:  # the emulator's thread added an object meanwhile: count again
            continue


def baseline(directory: Path, jobs: int, raw: bool) -> float:
    """Seconds for a client to create every object the operator would create.

    `raw`: the children go through `ApiWriter`, as the operator sends them; else
    through the client's generated methods. The client runs in its own process, as
    the operator does, so neither shares the emulator's interpreter (and its GIL).
    """
    with harness.EmulatedCluster(directory) as cluster, ProcessPoolExecutor(
            1, mp_context=multiprocessing.get_context("spawn")) as process:
        return process.submit(_create_directly, str(cluster.kubeconfig), jobs, raw).result()


def _create_directly(kubeconfig: str, jobs: int, raw: bool) -> float:
    configuration = client.Configuration()
    kube_config.load_kube_config(kubeconfig, client_configuration=configuration)
    configuration.connection_pool_maxsize = THREADS
    api = client.ApiClient(configuration)
    core, custom, writer = client.CoreV1Api(api), client.CustomObjectsApi(api), ApiWriter(api)
    generated: dict[str, Callable[..., Any]] = {"Service": core.create_namespaced_service,
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

    start = time.perf_counter()
    with ThreadPoolExecutor(THREADS) as pool:
        list(pool.map(create_all, range(jobs)))
    return time.perf_counter() - start


def _create_jobs(kubeconfig: str, jobs: int) -> float:
    """Create the jobs as fast as THREADS clients can; return when it started (time.monotonic)."""
    configuration = client.Configuration()
    kube_config.load_kube_config(kubeconfig, client_configuration=configuration)
    configuration.connection_pool_maxsize = THREADS
    custom = client.CustomObjectsApi(client.ApiClient(configuration))

    def create(index: int) -> None:
        custom.create_namespaced_custom_object(
            "kubetrain.io", "v1alpha1", harness.NAMESPACE, "trainingjobs",
            harness.job_manifest(f"job-{index}", replicas=WORKERS))

    start = time.monotonic()  # one clock for every process on the machine
    with ThreadPoolExecutor(THREADS) as pool:
        list(pool.map(create, range(jobs)))
    return start


def with_operator(directory: Path, jobs: int) -> tuple[float, Counter[str], int, int, float]:
    """Seconds until all pods exist, the operator's writes by kind, status writes, peak KiB
    and the operator's CPU seconds until then."""
    with harness.EmulatedCluster(directory) as cluster:
        env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig)}
        operator = subprocess.Popen(
            [sys.executable, "-m", "kubetrain", "operator", "--standalone",
             "--resync-seconds", "300", "--metrics-port", str(harness.free_port()),
             "--health-port", str(harness.free_port())],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            harness.eventually(lambda: cluster.emulator.requests(), timeout=60)
            time.sleep(2.0)  # kopf has listed and started watching
            # The jobs come from another process, as the baseline's objects do: a client
            # in this one would take the emulator's GIL from it.
            with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as process:
                started = process.submit(_create_jobs, str(cluster.kubeconfig), jobs)
                harness.eventually(lambda: _pods(cluster) == jobs * WORKERS, timeout=1800)
                elapsed = time.monotonic() - started.result()
            cpu = _cpu_seconds(operator.pid)
            time.sleep(3.0)  # let the status writes of the last transitions land
            peak = _peak_kib(operator.pid)
        finally:
            operator.terminate()
            operator.wait(timeout=60)
        writes: Counter[str] = Counter()
        status_writes = 0
        for request in cluster.emulator.requests():
            agent = request.headers.get("User-Agent", "")
            if request.resource is None or not agent.startswith(("kopf", harness.USER_AGENT)):
                continue
            if request.action in (harness.kmock.action.LIST, harness.kmock.action.WATCH,
                                  harness.kmock.action.FETCH):
                continue
            kind = request.resource.plural + (f"/{request.subresource}"
                                              if request.subresource else "")
            writes[f"{request.method.value} {kind}"] += 1
            status_writes += request.subresource == "status"
        return elapsed, writes, status_writes, peak, cpu


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _peak_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=3,
                        help="baseline/operator pairs run in turn; the median ratio is the result "
                        "(a shared machine's load moves single timings)")
    args = parser.parse_args()
    ratios, raw_ratios = [], []
    for round_ in range(args.rounds):
        with tempfile.TemporaryDirectory() as directory:
            for part in ("a", "b", "c"):
                (Path(directory) / part).mkdir()
            direct = baseline(Path(directory) / "a", args.jobs, raw=False)
            direct_raw = baseline(Path(directory) / "b", args.jobs, raw=True)
            elapsed, writes, status_writes, peak, cpu = with_operator(Path(directory) / "c",
                                                                 args.jobs)
        ratios.append(elapsed / direct)
        raw_ratios.append(elapsed / direct_raw)
        print(f"round {round_ + 1}: direct creation {direct:.2f}s (client methods), "
              f"{direct_raw:.2f}s (ApiWriter); operator until all pods exist {elapsed:.2f}s "
              f"(operator CPU {cpu:.2f}s); ratios {elapsed / direct:.2f}, "
              f"{elapsed / direct_raw:.2f}", flush=True)
    objects = 2 + WORKERS  # service, config map, pods
    total = sum(writes.values())
    events = writes["POST events"]
    print(f"jobs: {args.jobs} x {WORKERS} workers")
    print(f"time until every pod exists, operator / direct: median ratio "
          f"{statistics.median(ratios):.2f} of {args.rounds} rounds (goal <= 1.5)")
    print(f"  against the same requests sent as the operator sends them (ApiWriter): median "
          f"ratio {statistics.median(raw_ratios):.2f}")
    print(f"operator writes per job: {total / args.jobs:.2f} = objects {objects} + status "
          f"{status_writes / args.jobs:.2f} + transition events {events / args.jobs:.2f} "
          f"+ other {(total - status_writes - events) / args.jobs - objects:.2f}")
    for kind, count in sorted(writes.items()):
        print(f"  {kind}: {count / args.jobs:.2f}/job")
    print(f"operator peak memory (VmHWM): {peak / 1024:.1f} MiB")


if __name__ == "__main__":
    main()
