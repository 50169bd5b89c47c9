"""The status endpoint over real HTTPS on loopback: Kubeflow's reporters (transformers'
KubeflowCallback, the kubeflow SDK's way of posting) reach it unchanged, the step, loss and
ETA come out as a `Report`, and every bad request gets its 4xx with the reason."""

from __future__ import annotations

import contextlib
import http.client
import importlib
import json
import logging
import os
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import requests
from host_tools import unavailable

from kubetrain.operator.trainer_status_endpoint import (
    MAX_BODY_BYTES,
    RateLimit,
    StatusEndpoint,
    StatusReports,
    job_token,
    status_path,
)
from kubetrain.operator.trainer_status_tls import CertificateAuthority
from kubetrain.protocol import CA_CERT_ENV, SERVER_URL_ENV, TOKEN_ENV

KEY = bytes(range(32))


@dataclass
class Endpoint:
    reports: StatusReports
    server: StatusEndpoint
    ca_file: Path

    def url(self, namespace: str, name: str) -> str:
        return f"https://127.0.0.1:{self.server.port}{status_path(namespace, name)}"

    def post(self, namespace: str, name: str, body: bytes | dict[str, Any],
             token: str | None, headers: dict[str, str] | None = None
             ) -> tuple[int, dict[str, Any], dict[str, str]]:
        """POST with urllib, as transformers does; the status, JSON body and headers."""
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        all_headers = {"Content-Type": "application/json", **(headers or {})}
        if token is not None:
            all_headers["Authorization"] = f"Bearer {token}"
        request = urllib.request.Request(self.url(namespace, name), data=data,
                                         headers=all_headers, method="POST")
        context = ssl.create_default_context(cafile=str(self.ca_file))
        try:
            with urllib.request.urlopen(request, timeout=10, context=context) as response:
                return response.status, json.loads(response.read()), dict(response.headers)
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read()), dict(error.headers)


def serve(tmp_path: Path, reports: StatusReports) -> Iterator[Endpoint]:
    authority = CertificateAuthority.generate()
    ca_file = tmp_path / "ca.crt"
    ca_file.write_bytes(authority.cert_pem)
    serving = authority.issue(["localhost"], ["127.0.0.1"])
    with StatusEndpoint(reports, serving.server_context(), host="127.0.0.1", port=0) as server:
        yield Endpoint(reports, server, ca_file)


@pytest.fixture
def endpoint(tmp_path: Path) -> Iterator[Endpoint]:
    yield from serve(tmp_path, StatusReports(KEY))


def trainer_status(**fields: Any) -> dict[str, Any]:
    status = {"lastUpdatedTime": datetime.now(UTC).isoformat(), **fields}
    return {"trainerStatus": status}


def metrics(**values: object) -> list[dict[str, str]]:
    return [{"name": name, "value": str(value)} for name, value in values.items()]


def test_transformers_kubeflow_callback_reports_step_loss_and_eta_unchanged(
        endpoint: Endpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.integrations.integration_utils import KubeflowCallback
    from transformers.trainer_callback import TrainerControl, TrainerState

    token = endpoint.reports.admit("team-a", "llama", "uid-1")
    token_file = tmp_path / "token"
    token_file.write_text(token + "\n")
    # What the operator gives every pod of the job, exactly as Kubeflow names it.
    monkeypatch.setenv(SERVER_URL_ENV, endpoint.url("team-a", "llama"))
    monkeypatch.setenv(CA_CERT_ENV, str(endpoint.ca_file))
    monkeypatch.setenv(TOKEN_ENV, str(token_file))

    callback = KubeflowCallback()
    state = TrainerState(max_steps=40, is_world_process_zero=True)
    control = TrainerControl()
    callback.on_train_begin(None, state, control)
    begun = endpoint.reports.latest("team-a", "llama")
    assert begun is not None, f"transformers {transformers.__version__}: nothing reported"
    assert (begun.step, begun.total_steps, begun.progress_percent) == (None, 40, 0)

    # The callback posts at most every 5 s (its own throttle, left as it is).
    time.sleep(5.2)
    state.global_step, state.epoch = 10, 0.25
    callback.on_log(None, state, control, logs={"loss": 2.5, "learning_rate": 3e-4,
                                                "grad_norm": 1.25})
    callback.on_step_end(None, state, control)
    report = endpoint.reports.latest("team-a", "llama")
    assert report is not None and report is not begun
    assert (report.step, report.total_steps) == (10, 40)
    assert (report.loss, report.learning_rate, report.epoch) == (2.5, 3e-4, 0.25)
    assert report.progress_percent == 25
    # 10 steps took the 5.2 s slept: 30 more take about 15.6 s.
    assert report.remaining_seconds is not None and 15 <= report.remaining_seconds <= 20
    assert report.metrics["grad_norm"] == "1.25"
    assert abs((report.received_at - report.reported_at).total_seconds()) < 5

    callback.on_train_end(None, state, control)
    done = endpoint.reports.latest("team-a", "llama")
    assert done is not None and (done.progress_percent, done.remaining_seconds) == (100, 0)


def test_a_requests_session_post_as_the_kubeflow_sdk_makes_it_is_accepted(
        endpoint: Endpoint) -> None:
    token = endpoint.reports.admit("team-a", "plain", "uid-2")
    body = trainer_status(progressPercentage=50, estimatedRemainingSeconds=120,
                          metrics=metrics(current_step=500, total_steps=1000, loss=1.75))
    with requests.Session() as session:
        response = session.post(endpoint.url("team-a", "plain"), json=body,
                                headers={"Authorization": f"Bearer {token}"},
                                verify=str(endpoint.ca_file), timeout=5)
        assert response.status_code == 200, response.text
        assert response.json() == body  # Kubeflow answers with what it accepted
        # The same kept-alive connection reports again.
        body["trainerStatus"]["metrics"] = metrics(current_step=510, total_steps=1000)
        assert session.post(endpoint.url("team-a", "plain"), json=body,
                            headers={"Authorization": f"Bearer {token}"},
                            verify=str(endpoint.ca_file), timeout=5).status_code == 200
    report = endpoint.reports.latest("team-a", "plain")
    assert report is not None and (report.step, report.loss) == (510, None)


def test_kubeflow_sdk_update_trainjob_status_where_the_sdk_is_installed(
        endpoint: Endpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # PyPI's kubeflow 0.5 pins kubernetes < 36, which the operator's own >= 37 excludes, so
    # it is not in the dev extra: `make test` installs it with --no-deps beside the venv.
    sdk = Path(__file__).resolve().parents[2] / ".venv" / "kubeflow-sdk"
    if not (sdk / ".installed").exists():
        unavailable(f"kubeflow's SDK is not in {sdk}: `make test` puts it there")
    monkeypatch.syspath_prepend(str(sdk))
    utils = importlib.import_module("kubeflow.trainer.backends.kubernetes.utils")
    token_file = tmp_path / "token"
    token_file.write_text(endpoint.reports.admit("team-a", "sdk", "uid-3"))
    monkeypatch.setenv(SERVER_URL_ENV, endpoint.url("team-a", "sdk"))
    monkeypatch.setenv(CA_CERT_ENV, str(endpoint.ca_file))
    monkeypatch.setenv(TOKEN_ENV, str(token_file))
    assert utils.update_trainjob_status(progress_percent=30, estimated_remaining_seconds=70,
                                        metrics={"current_step": 3, "total_steps": 10,
                                                 "loss": 0.5})
    report = endpoint.reports.latest("team-a", "sdk")
    assert report is not None
    assert (report.step, report.total_steps, report.loss, report.remaining_seconds) == (
        3, 10, 0.5, 70)


def test_idle_connections_are_closed_and_a_kept_session_reconnects(tmp_path: Path) -> None:
    reports = StatusReports(KEY)
    authority = CertificateAuthority.generate()
    ca_file = tmp_path / "ca.crt"
    ca_file.write_bytes(authority.cert_pem)
    tls = authority.issue(["localhost"], ["127.0.0.1"]).server_context()
    with StatusEndpoint(reports, tls, host="127.0.0.1", port=0, idle_seconds=0.3) as server:
        token = reports.admit("team-a", "idle", "uid")
        url = f"https://127.0.0.1:{server.port}{status_path('team-a', 'idle')}"
        with requests.Session() as session:
            ports = []
            for step in (1, 2):
                response = session.post(url, json=trainer_status(metrics=metrics(
                    current_step=step)), headers={"Authorization": f"Bearer {token}"},
                    verify=str(ca_file), timeout=5, stream=True)
                assert response.status_code == 200
                ports.append(response.raw.connection.sock.getsockname()[1])
                response.close()
                time.sleep(0.8)
        assert ports[0] != ports[1], "the idle connection was not closed by the endpoint"
        report = reports.latest("team-a", "idle")
        assert report is not None and report.step == 2


def test_a_pod_of_one_job_cannot_write_another_jobs_status(endpoint: Endpoint) -> None:
    mine = endpoint.reports.admit("team-a", "mine", "uid-mine")
    endpoint.reports.admit("team-a", "theirs", "uid-theirs")
    endpoint.reports.admit("team-b", "mine", "uid-b")
    body = trainer_status(metrics=metrics(current_step=99))
    for namespace, name in (("team-a", "theirs"), ("team-b", "mine")):
        status, answer, _ = endpoint.post(namespace, name, body, mine)
        assert status == 403, answer
        assert answer["reason"] == "Forbidden" and f"{namespace}/{name}" in answer["message"]
        assert endpoint.reports.latest(namespace, name) is None
    assert endpoint.reports.latest("team-a", "mine") is None

    status, answer, headers = endpoint.post("team-a", "theirs", body, token=None)
    assert (status, headers.get("WWW-Authenticate")) == (401, "Bearer"), answer
    status, _, _ = endpoint.post("team-a", "theirs", body, token=None,
                                 headers={"Authorization": mine})  # no "Bearer "
    assert status == 401

    # A job deleted and created again under the same name: the old pods' token is void.
    endpoint.reports.admit("team-a", "mine", "uid-mine-2")
    assert endpoint.post("team-a", "mine", body, mine)[0] == 403
    assert endpoint.post("team-a", "mine", body,
                         job_token(KEY, "team-a", "mine", "uid-mine-2"))[0] == 200


def test_only_admitted_jobs_are_served(endpoint: Endpoint) -> None:
    body = trainer_status()
    token = job_token(KEY, "team-a", "never", "uid")
    status, answer, _ = endpoint.post("team-a", "never", body, token)
    assert status == 404 and "team-a/never" in answer["message"]

    token = endpoint.reports.admit("team-a", "gone", "uid")
    assert endpoint.post("team-a", "gone", body, token)[0] == 200
    endpoint.reports.forget("team-a", "gone")
    assert endpoint.post("team-a", "gone", body, token)[0] == 404
    assert endpoint.reports.latest("team-a", "gone") is None
    assert endpoint.reports.admitted() == set()


def test_an_oversized_body_is_refused_with_413_sent_whole_or_chunked(
        endpoint: Endpoint) -> None:
    token = endpoint.reports.admit("team-a", "big", "uid")
    padding = "x" * MAX_BODY_BYTES
    big = json.dumps(trainer_status(padding=padding)).encode()
    status, answer, _ = endpoint.post("team-a", "big", big, token)
    assert status == 413 and str(MAX_BODY_BYTES) in answer["message"], answer

    # Chunked: no Content-Length to check first; the endpoint stops reading at the bound.
    context = ssl.create_default_context(cafile=str(endpoint.ca_file))
    connection = http.client.HTTPSConnection("127.0.0.1", endpoint.server.port,
                                             context=context, timeout=10)
    chunks = (big[i:i + 8192] for i in range(0, len(big), 8192))
    connection.request("POST", status_path("team-a", "big"), body=chunks,
                       headers={"Authorization": f"Bearer {token}"}, encode_chunked=True)
    response = connection.getresponse()
    assert response.status == 413, response.read()
    connection.close()
    assert endpoint.reports.latest("team-a", "big") is None


@pytest.mark.parametrize(("case", "body", "status", "reason"), [
    ("not JSON", b"progress: 50%", 400, "not JSON"),
    ("not UTF-8", b"\xff\xfe{}", 400, "not JSON"),
    ("nested deeper than the parser goes", b"[" * 60_000, 400, "not JSON"),
    ("an array", b"[1, 2]", 400, "JSON object"),
    ("trainerStatus not an object", {"trainerStatus": 5}, 422, "trainerStatus must be"),
    ("no lastUpdatedTime", {"trainerStatus": {"progressPercentage": 5}}, 422,
     "lastUpdatedTime is required"),
    ("a time without a zone", {"trainerStatus": {"lastUpdatedTime": "2026-01-23T10:30:45"}},
     422, "time zone"),
    ("a time that is not one", {"trainerStatus": {"lastUpdatedTime": "yesterday"}}, 422,
     "RFC 3339"),
    ("progress over 100", trainer_status(progressPercentage=150), 422,
     "progressPercentage must be an integer from 0 to 100, got 150"),
    ("progress as a fraction", trainer_status(progressPercentage=12.5), 422,
     "progressPercentage"),
    ("a negative ETA", trainer_status(estimatedRemainingSeconds=-1), 422,
     "estimatedRemainingSeconds"),
    ("metrics not a list", trainer_status(metrics={"loss": "1"}), 422, "must be a list"),
    ("too many metrics", trainer_status(metrics=metrics(**{f"m{i}": i for i in range(257)})),
     422, "257 entries"),
    ("a metric value too long", trainer_status(metrics=metrics(note="n" * 65)), 422,
     "metrics[0].value must be a string of 1 to 64"),
    ("a metric value as a number", trainer_status(metrics=[{"name": "loss", "value": 1.5}]),
     422, "metrics[0].value"),
    ("a step that is not a number", trainer_status(metrics=metrics(current_step="ten")), 422,
     "current_step must be a whole number"),
    ("a loss that is not a number", trainer_status(metrics=metrics(loss="low")), 422,
     "loss must be a number"),
])
def test_a_bad_body_gets_a_4xx_naming_what_is_wrong_and_the_endpoint_serves_on(
        endpoint: Endpoint, case: str, body: bytes | dict[str, Any], status: int,
        reason: str) -> None:
    token = endpoint.reports.admit("team-a", "bad", "uid")
    got, answer, _ = endpoint.post("team-a", "bad", body, token)
    assert (got, answer["code"]) == (status, status), (case, answer)
    assert reason in answer["message"], (case, answer)
    assert endpoint.reports.latest("team-a", "bad") is None
    good = trainer_status(metrics=metrics(current_step=7, loss="nan"))
    assert endpoint.post("team-a", "bad", good, token)[0] == 200, case
    report = endpoint.reports.latest("team-a", "bad")
    assert report is not None and report.step == 7  # a diverged loss still reports its step


def test_a_body_without_trainer_status_is_accepted_and_changes_nothing(
        endpoint: Endpoint) -> None:
    token = endpoint.reports.admit("team-a", "empty", "uid")
    assert endpoint.post("team-a", "empty", trainer_status(), token)[0] == 200
    kept = endpoint.reports.latest("team-a", "empty")
    assert endpoint.post("team-a", "empty", {"somethingElse": 1}, token)[0] == 200
    assert endpoint.reports.latest("team-a", "empty") is kept


def test_other_paths_and_methods_are_refused(endpoint: Endpoint) -> None:
    context = ssl.create_default_context(cafile=str(endpoint.ca_file))
    for method, path, status in (("GET", status_path("team-a", "x"), 405),
                                 ("POST", "/apis/trainer.kubeflow.org/v1alpha1/namespaces/a/"
                                  "trainjobs/x/status", 404), ("GET", "/", 404)):
        connection = http.client.HTTPSConnection("127.0.0.1", endpoint.server.port,
                                                 context=context, timeout=10)
        connection.request(method, path)
        response = connection.getresponse()
        answer = json.loads(response.read())
        assert (response.status, answer["code"]) == (status, status), (method, path, answer)
        connection.close()


def test_each_job_is_rate_limited_on_its_own_and_recovers(tmp_path: Path) -> None:
    now = [100.0]
    reports = StatusReports(KEY, RateLimit(per_second=0.5, burst=2), clock=lambda: now[0])
    for endpoint in serve(tmp_path, reports):
        busy = reports.admit("team-a", "busy", "uid-1")
        calm = reports.admit("team-a", "calm", "uid-2")
        body = trainer_status(metrics=metrics(current_step=1))
        assert [endpoint.post("team-a", "busy", body, busy)[0] for _ in range(2)] == [200, 200]
        status, answer, headers = endpoint.post("team-a", "busy", body, busy)
        assert status == 429 and headers["Retry-After"] == "2", answer
        assert "0.5 times a second" in answer["message"]
        # Another job's budget is its own, and refused tokens spend none of it.
        assert endpoint.post("team-a", "calm", body, busy)[0] == 403
        assert endpoint.post("team-a", "calm", body, calm)[0] == 200
        now[0] += 2.0  # one request's worth refilled
        assert endpoint.post("team-a", "busy", body, busy)[0] == 200
        assert endpoint.post("team-a", "busy", body, busy)[0] == 429


def test_the_endpoint_is_tls_with_the_given_ca_and_strict_verification(
        endpoint: Endpoint, tmp_path: Path) -> None:
    token = endpoint.reports.admit("team-a", "tls", "uid")
    url = endpoint.url("team-a", "tls")
    # Python 3.13's default (strict X.509) accepts the chain; a client with another CA
    # refuses the server.
    strict = ssl.create_default_context(cafile=str(endpoint.ca_file))
    strict.verify_flags |= ssl.VERIFY_X509_STRICT
    request = urllib.request.Request(url, data=json.dumps(trainer_status()).encode(),
                                     headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=10, context=strict) as response:
        assert response.status == 200
    other_ca = tmp_path / "other.crt"
    other_ca.write_bytes(CertificateAuthority.generate().cert_pem)
    stranger = ssl.create_default_context(cafile=str(other_ca))
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
        urllib.request.urlopen(request, timeout=10, context=stranger)


def test_a_serving_certificate_needs_a_name_and_the_key_is_long_enough() -> None:
    with pytest.raises(ValueError, match="at least one DNS name"):
        CertificateAuthority.generate().issue([])
    with pytest.raises(ValueError, match="at least 32 bytes"):
        StatusReports(b"short")
    assert job_token(KEY, "a", "b", "c") != job_token(os.urandom(32), "a", "b", "c")
    assert job_token(KEY, "a", "b", "c") != job_token(KEY, "a", "b", "d")


def test_a_failure_after_start_up_is_reported_and_stop_still_returns(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The serving loop dying once the endpoint runs (here: its event loop stopped under
    it) is logged as an error and kept in `failure`, not left unread; stopping the dead
    endpoint afterwards returns."""
    caplog.set_level(logging.ERROR, logger="kubetrain.operator.trainer_status_endpoint")
    served = serve(tmp_path, StatusReports(KEY))
    endpoint = next(served)
    loop = endpoint.server._loop
    assert loop is not None
    loop.call_soon_threadsafe(loop.stop)

    def reported() -> bool:
        return any("stopped serving" in record.getMessage() and record.exc_info
                   for record in caplog.records)

    deadline = time.monotonic() + 10
    while not reported() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert reported(), caplog.records
    assert isinstance(endpoint.server.failure, RuntimeError), endpoint.server.failure
    with contextlib.suppress(StopIteration):
        next(served)  # leaves the `with`: stop() on the dead endpoint
