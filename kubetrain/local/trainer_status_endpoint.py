"""The status endpoint of a local own-code run: progress reports become metrics-log events.

On Kubernetes the operator serves Kubeflow Trainer's status endpoint
(kubetrain.operator.trainer_status_endpoint) and own code's rank 0 POSTs `{"trainerStatus": {...}}`
to it: kubetrain.sdk.report and transformers' KubeflowCallback, unchanged. `kubetrain run`
serves the same URL contract on loopback for the run's own processes: the three
KUBEFLOW_TRAINER_SERVER_* variables (`reporter_env`), a bearer token in a file only this
user can read, and each report with a step appended to the run's metrics log as a `step`
event (`current_step`, `total_steps`, `loss`, `learning_rate`, `current_epoch`,
`tokens_per_second`), so the progress bar, hang detection and the summary read own code as
they read kubetrain's trainer. Plain HTTP: nothing leaves this machine, and the reporters
verify TLS only for an https URL. Bad input gets a 4xx with the reason, as the operator's:
a report is read by the one parser both endpoints call (`kubetrain.protocol.parse_report`),
so one the operator refuses is refused here too; only lastUpdatedTime may be left out here
(the operator requires it, as Kubeflow's schema does).
"""

from __future__ import annotations

import hmac
import json
import math
import secrets
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from kubetrain.local.launch import RENDEZVOUS_HOST
from kubetrain.local.metrics_log import Event
from kubetrain.protocol import (
    MAX_REPORT_BYTES,
    REPORT_EPOCH,
    REPORT_LEARNING_RATE,
    REPORT_LOSS,
    REPORT_TOKENS_PER_SECOND,
    SERVER_URL_ENV,
    TOKEN_ENV,
    Refused,
    metric_number,
    parse_report,
)

MAX_BODY_BYTES = MAX_REPORT_BYTES
STATUS_PATH = "/status"
# The metrics a report's step event carries, by the metrics log's names (the first found).
_METRICS = {REPORT_LOSS: "loss", REPORT_LEARNING_RATE: "lr", REPORT_EPOCH: "epoch",
            "epoch": "epoch", REPORT_TOKENS_PER_SECOND: "tokens_per_second"}


def token_file(root: Path, group: int | None = None) -> Path:
    """Where a run's status endpoint keeps its token: one for the run, or one a replica
    group's (each group's rank 0 reports to an endpoint of its own)."""
    return root / ("status-token" if group is None else f"status-token-group-{group}")


def _whole(text: object) -> int | None:
    try:
        value = int(str(text))
    except ValueError:
        return None
    return value if value >= 0 else None


def step_event(body: bytes, received_at: float) -> Event | None:
    """The metrics-log `step` event a report body says; None for a report without a step
    (transformers' first and last reports carry none). Raises `Refused` with the status and
    reason for a body that is not Kubeflow's `{"trainerStatus": {...}}`."""
    report = parse_report(body, datetime.fromtimestamp(received_at, UTC))
    if report is None or report.step is None:
        return None
    event: Event = {"event": "step", "step": report.step, "time": received_at}
    if report.total_steps:
        event["max_steps"] = report.total_steps
    for name, field in _METRICS.items():
        try:
            value = metric_number(report.metrics, name)
        except Refused:
            continue  # a metric beyond the schema's (the parser checked those): left out
        if value is not None and math.isfinite(value):
            event.setdefault(field, value)
    if report.remaining_seconds is not None:
        event["remaining_seconds"] = report.remaining_seconds
    return event


class LocalStatusEndpoint:
    """An HTTP server on loopback taking one run's reports; a context manager."""

    def __init__(self, token_file: Path, on_event: Callable[[Event], None]) -> None:
        self.token = secrets.token_urlsafe(32)
        token_file.parent.mkdir(parents=True, exist_ok=True)
        token_file.touch(mode=0o600)
        token_file.chmod(0o600)
        token_file.write_text(self.token)
        self.token_file = token_file
        self.on_event = on_event
        self.accepted = 0
        self.refused = 0
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # http.server calls it by this name
                status, reason = endpoint.handle(self.path, self.headers.get("Authorization"),
                                                 self.headers.get("Content-Length"), self.rfile)
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                payload = json.dumps({"status": "Success" if status == 200 else "Failure",
                                      "message": reason}).encode()
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, format: str, *args: Any) -> None:
                return  # the progress bar owns the terminal

        self.server = ThreadingHTTPServer((RENDEZVOUS_HOST, 0), Handler)
        self.server.daemon_threads = True
        self._thread = threading.Thread(target=self.server.serve_forever,
                                        name="status-endpoint", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{RENDEZVOUS_HOST}:{self.server.server_address[1]}{STATUS_PATH}"

    def reporter_env(self) -> dict[str, str]:
        """The variables the reporters read (no CA: the URL is plain HTTP on loopback)."""
        return {SERVER_URL_ENV: self.url, TOKEN_ENV: str(self.token_file.resolve())}

    def handle(self, path: str, authorization: str | None, length: str | None,
               body: Any) -> tuple[int, str]:
        """One request: its HTTP status and the reason."""
        if path != STATUS_PATH:
            return self._refuse(404, f"no status endpoint at {path}: POST to {STATUS_PATH}")
        scheme, _, token = (authorization or "").partition(" ")
        if scheme != "Bearer" or not token:
            return self._refuse(401, "an Authorization: Bearer <token> header is required")
        if not hmac.compare_digest(token.strip().encode(), self.token.encode()):
            return self._refuse(403, "this token is not this run's")
        size = _whole(length) if length is not None else None
        if size is None:
            return self._refuse(411, "a Content-Length is required")
        if size > MAX_BODY_BYTES:
            return self._refuse(413, f"the body has {size} bytes, at most {MAX_BODY_BYTES} "
                                "are allowed")
        try:
            event = step_event(body.read(size), time.time())
        except Refused as refused:
            return self._refuse(refused.status, refused.reason)
        if event is not None:
            self.on_event(event)
        self.accepted += 1
        return 200, "accepted"

    def _refuse(self, status: int, reason: str) -> tuple[int, str]:
        self.refused += 1
        return status, reason

    def __enter__(self) -> LocalStatusEndpoint:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join()
