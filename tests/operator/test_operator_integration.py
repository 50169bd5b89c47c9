"""The real operator (kopf, in a thread) against kmock's Kubernetes emulator over HTTP."""

from __future__ import annotations

import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).parent))
import harness
import kmock
from harness import EmulatedCluster, Kube, eventually, job_manifest, running_operator
from scheduling_apis import EVERY_PLACEMENT_API


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmulatedCluster]:
    with EmulatedCluster(tmp_path_factory.mktemp("cluster"),
                         placement=EVERY_PLACEMENT_API) as running:
        yield running


@pytest.fixture(scope="module")
def operator(cluster: EmulatedCluster) -> Iterator[harness.OperatorConfig]:
    with running_operator(cluster) as config:
        yield config


@pytest.mark.parametrize("scenario", harness.SCENARIOS, ids=lambda s: s.__name__[9:])
def test_scenario(cluster: EmulatedCluster, operator: harness.OperatorConfig,
                  scenario: Callable[[Kube], None]) -> None:
    scenario(Kube(cluster))


def test_operator_serves_metrics_and_liveness(cluster: EmulatedCluster,
                                              operator: harness.OperatorConfig) -> None:
    with urllib.request.urlopen(f"http://127.0.0.1:{operator.health_port}/healthz") as reply:
        assert reply.status == 200
    with urllib.request.urlopen(f"http://127.0.0.1:{operator.metrics_port}/metrics") as reply:
        families = {f.name: f for f in text_string_to_metric_families(reply.read().decode())}
    created = families["kubetrain_operator_pods_created"].samples[0].value
    assert created >= harness.Kube(cluster).core.list_namespaced_pod("default").items.__len__()
    assert "kubetrain_operator_reconcile_duration_seconds" in families
    phases = {s.labels["phase"]: s.value for s in families["kubetrain_operator_jobs"].samples}
    # The scenarios before this test failed workers: each failure was counted by class.
    failures = {s.labels["class"]: s.value for s in families["kubetrain_worker_failures"].samples
                if s.name == "kubetrain_worker_failures_total"}
    assert failures.get("OOMKilled", 0) >= 1 and failures.get("Unknown", 0) >= 1, failures
    assert set(phases) == {"Pending", "Running", "Restarting", "Suspended", "Succeeded", "Failed"}


class _Trainer(BaseHTTPRequestHandler):
    """Rank 0's /metrics: a step that never advances."""

    exposition = b""

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.end_headers()
        self.wfile.write(self.exposition)

    def log_message(self, *args: object) -> None:
        pass


def test_hang_detection_restarts_a_group_whose_step_stopped(cluster: EmulatedCluster,
                                                             operator: harness.OperatorConfig
                                                             ) -> None:
    from prometheus_client import CollectorRegistry, Gauge, generate_latest

    registry = CollectorRegistry()
    stuck_since = time.time() - 3600
    for name, value in [("kubetrain_step", 42), ("kubetrain_max_steps", 1000),
                        ("kubetrain_loss", 3.25), ("kubetrain_tokens_per_second", 900.0),
                        ("kubetrain_last_step_timestamp_seconds", stuck_since),
                        ("kubetrain_latest_checkpoint_step", 40),
                        ("kubetrain_latest_checkpoint_timestamp_seconds", stuck_since)]:
        Gauge(name, name, registry=registry).set(value)
    _Trainer.exposition = generate_latest(registry)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Trainer)
    # Polled every 50 ms, so the shutdown at the end waits that long, not 0.5 s.
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                     daemon=True).start()
    try:
        kube = Kube(cluster)
        manifest = job_manifest("hang", replicas=1, progressDeadlineSeconds=1)
        manifest["spec"]["metrics"] = {"port": server.server_address[1]}
        kube.create_job(manifest)
        eventually(lambda: len(kube.pods("hang")) == 1)
        kube.run_all("hang", pod_ip="127.0.0.1")
        job = eventually(lambda: (kube.job("hang") or {}).get("status", {}).get("restarts")
                         and kube.job("hang"))
        status = job["status"]
        assert status["progress"]["step"] == 42 and status["progress"]["loss"] == 3.25
        assert status["latestCheckpoint"]["step"] == 40
        eventually(lambda: "ProgressDeadlineExceeded" in kube.event_reasons("hang"),
                   what="the ProgressDeadlineExceeded event")
    finally:
        server.shutdown()


def test_restarted_operator_neither_duplicates_nor_orphans_pods(tmp_path: Path) -> None:
    with EmulatedCluster(tmp_path) as cluster:
        kube = Kube(cluster)
        with running_operator(cluster):
            kube.create_job(job_manifest("again", replicas=3))
            eventually(lambda: len(kube.pods("again")) == 3)
        kube.set_pod_status("again-worker-2", "Failed", exit_code=137)
        with running_operator(cluster):
            eventually(lambda: kube.pods("again").get("again-worker-2", {}).get("metadata", {})
                       .get("labels", {}).get("kubetrain.io/restart-attempt") == "1")
            time.sleep(1.0)  # a few resyncs: nothing more may happen
        assert set(kube.pods("again")) == {f"again-worker-{i}" for i in range(3)}
        assert cluster.operator_requests("pods", kmock.action.CREATE) == 4
        assert (kube.job("again") or {})["status"]["restarts"] == 1


def test_replacements_are_created_when_the_backoff_ends_not_at_the_next_resync(
        tmp_path: Path) -> None:
    """The operator wakes the job when its restart's backoff ends: with a resync of a
    minute, a worker failed under a 2 s backoff is replaced within seconds, and not before
    the backoff (nothing else happens to the job meanwhile)."""
    with EmulatedCluster(tmp_path) as cluster, running_operator(cluster, resync_seconds=60):
        kube = Kube(cluster)
        kube.create_job(job_manifest("woken", backoffSeconds=2))
        eventually(lambda: len(kube.pods("woken")) == 2)
        kube.run_all("woken")
        eventually(lambda: kube.phase("woken") == "Running")
        failed = time.monotonic()
        kube.set_pod_status("woken-worker-1", "Failed", exit_code=137, reason="Error")

        def replaced() -> bool:
            labels = (kube.pods("woken").get("woken-worker-1", {}).get("metadata", {})
                      .get("labels", {}))
            return labels.get("kubetrain.io/restart-attempt") == "1"

        eventually(replaced, timeout=20, what="the replacement, before the next resync")
        waited = time.monotonic() - failed
        restart = (kube.job("woken") or {})["status"]["restart"]
    # The restart's time has whole seconds, so its 2 s end up 1 to 2 s after the failure.
    assert 1.0 <= waited < 20, waited
    assert restart["counted"] and restart["reason"] == "WorkerFailed"
