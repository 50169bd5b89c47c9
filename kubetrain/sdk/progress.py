"""Progress to the job's status, in Kubeflow Trainer's status format.

`report(step, total_steps=..., loss=..., tokens=...)` POSTs `{"trainerStatus": {...}}` to
KUBEFLOW_TRAINER_SERVER_URL, the status endpoint the operator gives each pod, with the
bearer token read from the file KUBEFLOW_TRAINER_SERVER_TOKEN names and TLS verified
against the CA file KUBEFLOW_TRAINER_SERVER_CA_CERT. The body is what transformers'
KubeflowCallback sends, so the operator reads both the same way: `progressPercentage`,
`estimatedRemainingSeconds`, `lastUpdatedTime` and `metrics` as `{name, value}` strings,
with the step in `current_step` / `total_steps`, beside `loss`, `tokens` and
`tokens_per_second`.

Only rank 0 reports (RANK), at most once per `MIN_INTERVAL_SECONDS` except the first and
the last step; without the URL, or on any network error, `report` returns False and
training goes on: progress is never worth a failed step. A report that failed is not
counted as sent: the next call posts again, so the report after a failure (which may be the
last before a crash) arrives. Only when that retry fails too does the interval apply again,
so an endpoint that is down costs at most one post per interval, not one per step.
"""

from __future__ import annotations

import json
import math
import os
import ssl
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from datetime import UTC, datetime

from kubetrain.protocol import (
    CA_CERT_ENV,
    REPORT_LOSS,
    REPORT_STEP,
    REPORT_TOKENS,
    REPORT_TOKENS_PER_SECOND,
    REPORT_TOTAL_STEPS,
    SERVER_URL_ENV,
    TOKEN_ENV,
)

# As transformers' KubeflowCallback: the endpoint's rate limit allows one per 5 s per rank.
MIN_INTERVAL_SECONDS = 5.0
TIMEOUT_SECONDS = 5.0


@dataclass
class Reporter:
    """Throttling and rates between reports of one process."""

    min_interval: float = MIN_INTERVAL_SECONDS
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _last_sent: float | None = None  # when the last post was made that counts against the interval
    _failures: int = 0  # posts failed in a row
    _first: tuple[float, int] | None = None  # (monotonic time, step) of the first report
    _tokens: tuple[float, int] | None = None  # (monotonic time, tokens) at the last send

    def body(self, step: int, total_steps: int | None, loss: float | None,
             tokens: int | None, now: float) -> dict[str, object]:
        """The request body for this report (and the rates it updates)."""
        metrics: dict[str, object] = {REPORT_STEP: step}
        status: dict[str, object] = {"lastUpdatedTime": datetime.now(UTC).isoformat()}
        if self._first is None:
            self._first = (now, step)
        if total_steps:
            metrics[REPORT_TOTAL_STEPS] = total_steps
            done = step >= total_steps
            status["progressPercentage"] = 100 if done else min(99, step * 100 // total_steps)
            started, first_step = self._first
            if step > first_step:
                per_step = (now - started) / (step - first_step)
                status["estimatedRemainingSeconds"] = max(0, int(per_step * (total_steps - step)))
        if loss is not None and math.isfinite(loss):
            metrics[REPORT_LOSS] = f"{loss:.6g}"
        if tokens is not None:
            metrics[REPORT_TOKENS] = tokens
            if self._tokens is not None and now > self._tokens[0]:
                rate = (tokens - self._tokens[1]) / (now - self._tokens[0])
                metrics[REPORT_TOKENS_PER_SECOND] = f"{max(rate, 0.0):.6g}"
            self._tokens = (now, tokens)
        status["metrics"] = [{"name": name, "value": str(value)}
                             for name, value in metrics.items()]
        return {"trainerStatus": status}

    def due(self, step: int, total_steps: int | None, now: float) -> bool:
        last = step == total_steps
        retry = self._failures == 1  # the first failure is retried at once, a second is not
        return (self._last_sent is None or last or retry
                or now - self._last_sent >= self.min_interval)

    def report(self, step: int, total_steps: int | None = None, loss: float | None = None,
               tokens: int | None = None) -> bool:
        url = os.environ.get(SERVER_URL_ENV)
        if not url or int(os.environ.get("RANK", "0") or 0) != 0:
            return False
        with self._lock:
            now = time.monotonic()
            if not self.due(step, total_steps, now):
                return False
            self._last_sent = now
            body = self.body(step, total_steps, loss, tokens, now)
        sent = post_status(url, body)
        with self._lock:
            self._failures = 0 if sent else self._failures + 1
        return sent


def post_status(url: str, body: dict[str, object]) -> bool:
    """POST `body` to the status endpoint at `url` with the pod's token and CA: whether it
    was taken (False on any refusal or network error, never an exception)."""
    headers = {"Content-Type": "application/json"}
    token_path = os.environ.get(TOKEN_ENV)
    try:
        if token_path:
            with open(token_path) as token:
                headers["Authorization"] = f"Bearer {token.read().strip()}"
        ca = os.environ.get(CA_CERT_ENV)
        context = ssl.create_default_context(cafile=ca) if url.startswith("https:") else None
        request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers,
                                         method="POST")
        with urllib.request.urlopen(request, timeout=TIMEOUT_SECONDS, context=context) as reply:
            return 200 <= reply.status < 300
    except (OSError, ValueError, ssl.SSLError):  # URLError and HTTPError are OSErrors
        return False


_reporter = Reporter()


def report(step: int, total_steps: int | None = None, loss: float | None = None,
           tokens: int | None = None) -> bool:
    """Report training progress to the job's status: `step` (optimizer steps done),
    `total_steps` (for the progress and the ETA), `loss` and `tokens` (trained so far, for
    the throughput). Rank 0 only, throttled; True when a report was accepted."""
    if step < 0:
        raise ValueError(f"step must be 0 or more, got {step}")
    return _reporter.report(step, total_steps, loss, tokens)
