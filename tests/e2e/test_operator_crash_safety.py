"""kill -9 of the operator at random moments of a churn of jobs converges with nothing lost.

The operator runs in its own process, as the chart runs it, against kmock's emulator
(tests/cluster/emulator.py: optimistic concurrency, the scale subresource and the
stand-in garbage collector are what this test leans on). Twenty jobs are created,
scaled, suspended and resumed, have worker pods fail and are deleted, while the
operator is killed with SIGKILL twenty times at random moments and started again.
Afterwards every job's pods are exactly the ones its spec asks for, each pod failure
was counted as one restart and recorded once in status.failures (never zero, never
twice), no child outlives its job, and every status caught up with its spec.
"""

from __future__ import annotations

import random
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from emulator import EmulatedCluster
from kubernetes import client
from operator_process import OperatorProcess

pytestmark = pytest.mark.e2e

sys.path.insert(0, str(Path(__file__).parents[1] / "operator"))
import harness  # noqa: E402

JOBS, KILLS = 20, 20
ATTEMPT = "kubetrain.io/restart-attempt"


@pytest.fixture(scope="module")
def operator(emulated_cluster: EmulatedCluster, tmp_path_factory: pytest.TempPathFactory,
             ) -> Iterator[OperatorProcess]:
    folder = tmp_path_factory.mktemp("crash-safety")
    with OperatorProcess(emulated_cluster.kubeconfig, folder / "operator.log",
                         resync_seconds=0.5) as process:
        yield process


class Churn:
    """The user's side: jobs, their desired state and the failures injected into them."""

    def __init__(self, kube: harness.Kube, rng: random.Random) -> None:
        self.kube, self.rng = kube, rng
        self.replicas: dict[str, int] = {}
        self.suspended: dict[str, bool] = {}
        self.failures: Counter[str] = Counter()
        self.deleted: list[str] = []
        self.counts: Counter[str] = Counter()

    def live(self) -> list[str]:
        return sorted(self.replicas)

    def step(self) -> None:
        """One random user action."""
        created = len(self.replicas) + len(self.deleted)
        if created < JOBS and (created < 6 or self.rng.random() < 0.35):
            name = f"churn-{created}"
            self.replicas[name] = self.rng.randint(1, 3)
            self.suspended[name] = False
            self.kube.create_job(harness.job_manifest(name, replicas=self.replicas[name],
                                                      maxRestarts=1000))
            self.counts["created"] += 1
            return
        name = self.rng.choice(self.live())
        action = self.rng.choice(["scale", "scale", "suspend", "fail", "fail", "fail", "delete"])
        if action == "scale":
            self.replicas[name] = self.rng.randint(1, 3)
            self.kube.scale_job(name, self.replicas[name])
        elif action == "suspend":
            self.suspended[name] = not self.suspended[name]
            self.kube.patch_job(name, {"spec": {"runPolicy": {"suspend": self.suspended[name]}}})
        elif action == "fail":
            if not self.fail_a_pod(name):
                return
        elif len(self.deleted) >= 4:
            return
        else:
            self.kube.delete_job(name)
            self.deleted.append(name)
            del self.replicas[name], self.suspended[name]
        self.counts[action] += 1

    def fail_a_pod(self, name: str) -> bool:
        """Fail one current worker of a job with no restart under way (exit 137: retryable)."""
        job = self.kube.job(name) or {}
        status = job.get("status", {})
        if self.suspended[name] or status.get("restarts", 0) != self.failures[name] or \
                status.get("phase") not in ("Pending", "Running"):
            return False  # the last failure is not counted yet: one at a time per job
        attempt = str(status.get("restartAttempt", 0))
        current = [pod for pod, body in self.kube.pods(name).items()
                   if body["metadata"]["labels"].get(ATTEMPT) == attempt
                   and body["metadata"].get("deletionTimestamp") is None
                   and body.get("status", {}).get("phase") == "Pending"]
        if not current:
            return False
        # Killed from outside: an OOM kill would halve the micro-batch, a restart not counted.
        self.kube.set_pod_status(self.rng.choice(current), "Failed", exit_code=137,
                                 reason="Error")
        self.failures[name] += 1
        return True

    def problems(self) -> list[str]:
        """What still differs from the desired state; empty once converged."""
        found = []
        for name in self.live():
            job = self.kube.job(name) or {}
            status = job.get("status", {})
            pods = self.kube.pods(name)
            want = set() if self.suspended[name] else {
                f"{name}-worker-{i}" for i in range(self.replicas[name])}
            if set(pods) != want:
                found.append(f"{name}: pods {sorted(pods)} != {sorted(want)}")
            # A worker other than 0 is replaced alone, so older attempts may stay; none may
            # be newer than the restart status records, and none may still be failed.
            attempts = {int(body["metadata"]["labels"][ATTEMPT]) for body in pods.values()}
            if attempts and max(attempts) > status.get("restartAttempt", 0):
                found.append(f"{name}: a pod of restart attempt {max(attempts)}, status says "
                             f"{status.get('restartAttempt')}")
            failed = [pod for pod, body in pods.items()
                      if body.get("status", {}).get("phase") == "Failed"]
            if failed:
                found.append(f"{name}: failed pods not replaced: {failed}")
            if status.get("restarts", 0) != self.failures[name]:
                found.append(f"{name}: {status.get('restarts', 0)} restarts counted for "
                             f"{self.failures[name]} failures")
            # Each failure is recorded once by class too (the same status write).
            recorded = status.get("failures", {}).get("Unknown", 0)
            if recorded != self.failures[name]:
                found.append(f"{name}: {recorded} failures recorded for "
                             f"{self.failures[name]} failures")
            if status.get("observedGeneration") != job["metadata"]["generation"]:
                found.append(f"{name}: status observed generation "
                             f"{status.get('observedGeneration')} of "
                             f"{job['metadata']['generation']}")
            wanted_phase = "Suspended" if self.suspended[name] else None
            if wanted_phase and status.get("phase") != wanted_phase:
                found.append(f"{name}: phase {status.get('phase')}, want {wanted_phase}")
        for name in self.deleted:
            left = self.children_of(name)
            if left or self.kube.job(name) is not None:
                found.append(f"{name} was deleted but {left or 'the job'} remain")
        return found

    def children_of(self, name: str) -> list[str]:
        core = self.kube.core
        selector = f"kubetrain.io/job-name={name}"
        pods = core.list_namespaced_pod(harness.NAMESPACE, label_selector=selector).items
        names = [f"pod/{pod.metadata.name}" for pod in pods]
        for kind, listed in (("service", core.list_namespaced_service(harness.NAMESPACE)),
                             ("configmap", core.list_namespaced_config_map(harness.NAMESPACE))):
            names += [f"{kind}/{item.metadata.name}" for item in listed.items
                      if item.metadata.name in (name, f"{name}-config")]
        return names


def test_kill_9_at_random_moments_of_a_churn_converges(emulated_cluster: EmulatedCluster,
                                                       operator: OperatorProcess) -> None:
    rng = random.Random(20261123)
    kube = harness.Kube(emulated_cluster)
    churn = Churn(kube, rng)
    for _ in range(KILLS):
        for _ in range(rng.randint(2, 6)):
            try:
                churn.step()
            except client.ApiException as error:  # e.g. a scale racing a delete
                churn.counts[f"refused {error.status}"] += 1
            time.sleep(rng.uniform(0.0, 0.3))
        operator.kill()
        for _ in range(rng.randint(0, 2)):  # the user goes on while no operator runs
            churn.step()
        operator.start()
    deadline = time.monotonic() + 90
    while (problems := churn.problems()) and time.monotonic() < deadline:
        time.sleep(0.5)
    counted = sum((kube.job(name) or {}).get("status", {}).get("restarts", 0)
                  for name in churn.live())
    failed = sum(churn.failures[name] for name in churn.live())
    print(f"\noperator killed {KILLS} times ({operator.starts} starts); user actions: "
          f"{dict(churn.counts)}; on the {len(churn.live())} live jobs {failed} pod failures, "
          f"{counted} restarts counted; {len(churn.deleted)} jobs deleted; "
          f"problems left: {len(problems)}")
    assert not problems, "\n".join(problems) + "\n" + operator.log_tail()

