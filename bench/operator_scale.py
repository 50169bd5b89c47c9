"""Operator at scale: N TrainingJobs of 4 workers created at once against kmock's emulator.

Prints, from one run on this machine:
- time until every worker pod exists, as a ratio to creating the same objects (job,
  service, config map, pods) directly with the Kubernetes client (goal <= 1.5);
- the operator's API writes per job against the objects it had to create plus its
  status writes (goal: nothing beyond those);
- the operator process's peak memory (VmHWM).

    python bench/operator_scale.py --jobs 500
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "tests" / "operator"))
import harness
from kubetrain.operator import children

from kubetrain.api.manifest import parse_job

WORKERS = 4
THREADS = 16


def _pods(cluster: harness.EmulatedCluster) -> int:
    return sum(1 for (resource, _, _), obj in list(cluster.emulator.objects.items())
               if resource.plural == "pods" and not obj.deleted)


def baseline(directory: Path, jobs: int) -> float:
    """Seconds for the client to create every object the operator would create."""
    with harness.EmulatedCluster(directory) as cluster:
        kube = harness.Kube(cluster)

        def create_all(index: int) -> None:
            manifest = harness.job_manifest(f"job-{index}", replicas=WORKERS)
            kube.create_job(manifest)
            job = parse_job({**manifest, "metadata": {**manifest["metadata"], "uid": "u"}})
            kube.core.create_namespaced_service(harness.NAMESPACE, children.service(job))
            kube.core.create_namespaced_config_map(harness.NAMESPACE, children.config_map(job))
            for worker in range(WORKERS):
                kube.core.create_namespaced_pod(harness.NAMESPACE,
                                                children.worker_pod(job, worker, 0))

        start = time.perf_counter()
        with ThreadPoolExecutor(THREADS) as pool:
            list(pool.map(create_all, range(jobs)))
        return time.perf_counter() - start


def with_operator(directory: Path, jobs: int) -> tuple[float, Counter[str], int, int]:
    """Seconds until all pods exist, the operator's writes by kind, status writes, peak KiB."""
    with harness.EmulatedCluster(directory) as cluster:
        kube = harness.Kube(cluster)
        env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig)}
        operator = subprocess.Popen(
            [sys.executable, "-m", "kubetrain", "operator", "--standalone",
             "--resync-seconds", "300", "--metrics-port", str(harness.free_port()),
             "--health-port", str(harness.free_port())],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            harness.eventually(lambda: any(True for _ in cluster.emulator), timeout=60)
            time.sleep(2.0)  # kopf has listed and started watching
            start = time.perf_counter()
            with ThreadPoolExecutor(THREADS) as pool:
                list(pool.map(lambda i: kube.create_job(
                    harness.job_manifest(f"job-{i}", replicas=WORKERS)), range(jobs)))
            harness.eventually(lambda: _pods(cluster) == jobs * WORKERS, timeout=1800)
            elapsed = time.perf_counter() - start
            time.sleep(3.0)  # let the status writes of the last transitions land
            peak = _peak_kib(operator.pid)
        finally:
            operator.terminate()
            operator.wait(timeout=60)
        writes: Counter[str] = Counter()
        status_writes = 0
        for request in list(cluster.emulator):
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
        return elapsed, writes, status_writes, peak


def _peak_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=500)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        (Path(directory) / "a").mkdir()
        (Path(directory) / "b").mkdir()
        direct = baseline(Path(directory) / "a", args.jobs)
        elapsed, writes, status_writes, peak = with_operator(Path(directory) / "b", args.jobs)
    objects = 2 + WORKERS  # service, config map, pods
    total = sum(writes.values())
    print(f"jobs: {args.jobs} x {WORKERS} workers")
    print(f"direct client creation: {direct:.2f}s; operator until all pods exist: "
          f"{elapsed:.2f}s; ratio {elapsed / direct:.2f} (goal <= 1.5)")
    print(f"operator writes per job: {total / args.jobs:.2f} = objects {objects} + status "
          f"{status_writes / args.jobs:.2f} + other "
          f"{(total - status_writes) / args.jobs - objects:.2f}")
    for kind, count in sorted(writes.items()):
        print(f"  {kind}: {count / args.jobs:.2f}/job")
    print(f"operator peak memory (VmHWM): {peak / 1024:.1f} MiB")


if __name__ == "__main__":
    main()
