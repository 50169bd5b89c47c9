"""The status endpoint: job pods POST their progress over HTTPS, as to Kubeflow Trainer's.

Own code (`spec.trainer`) reports progress the way Kubeflow Trainer v2.2 defined it:
each pod finds the endpoint through three environment variables, `KUBEFLOW_TRAINER_SERVER_URL`
(the whole URL, path included), `KUBEFLOW_TRAINER_SERVER_CA_CERT` and
`KUBEFLOW_TRAINER_SERVER_TOKEN` (paths of the CA certificate and of the bearer token), and
POSTs `{"trainerStatus": {...}}` with `Authorization: Bearer <token>`. transformers'
`KubeflowCallback` and the kubeflow SDK's `update_trainjob_status` speak it unchanged. The body
is Kubeflow's `UpdateTrainJobStatusRequest`: `progressPercentage` (0-100),
`estimatedRemainingSeconds`, `metrics` (at most 256 `{name, value}` string pairs of 1-64
characters) and `lastUpdatedTime` (RFC 3339, required); transformers puts the step in the
metrics `current_step` / `total_steps`, next to `loss` and `learning_rate`. The path mirrors
Kubeflow's `/apis/trainer.kubeflow.org/v1alpha1/namespaces/{namespace}/trainjobs/{name}/status`
in kubetrain's group: `status_path`.

What it produces is a `Report` per job, kept in memory (`StatusReports.latest`) for the
controller to read behind `observed`. This module touches nothing else: no API calls, no
files, no status writes.

Security. A pod of one job can never write another job's status. Each job's token is a
per-job secret: `job_token` is an HMAC-SHA256, under a key only the operator holds, of the
job's namespace, name and uid; the operator puts it in a Secret mounted into that job's pods
only, and the endpoint recomputes it and compares in constant time. Pods get no RBAC, so a
pod can read no token but its own. Chosen over Kubeflow's projected service-account token
with a per-job audience because that needs a TokenReview (an API request per new token) and
then a pod lookup, since any pod of the namespace may request a token for any audience;
the HMAC needs neither, costs microseconds per request, works without an API server
(`kubetrain run`, the emulator) and survives operator restarts as long as the key does; the
uid keeps the pods of a deleted job away from a new job of the same name. The endpoint only
serves jobs the controller admitted (`admit`), so an unknown job's URL gets 404 and holds no
memory. TLS uses a CA the pods are given (`status_certificates`).

Bad input gets a 4xx with the reason in a Kubernetes `Status` body, never an operator error:
no or a malformed `Authorization` 401; another job's token 403; more than `RateLimit`
allows per job 429 (with `Retry-After`; the check comes after the token, so one job's pods
cannot spend another's budget); a body over `MAX_BODY_BYTES` 413; a body that is not a JSON
object 400; one that breaks the schema 422, naming the field.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import logging
import math
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime

from aiohttp import web

from kubetrain.protocol import (
    LAST_UPDATED_REQUIRED,
    MAX_REPORT_BYTES,
    TOKEN_ENV,
    Refused,
    Report,
    parse_report,
)

DEFAULT_PORT = 8443
# An idle connection is closed after this long, and a peer that does not answer the TLS
# close within SHUTDOWN_SECONDS is cut off. asyncio gives each TLS connection a 256 KiB
# buffer: 500 jobs' kept-alive connections held 142 MiB more of the operator's memory
# (bench/status_endpoint.py), and so did connections closed while idle, which asyncio keeps
# 30 s by default waiting for a pooled client's close_notify that never comes. Reporters
# post every 5 s or less often, so each report opens a connection (as transformers' urllib
# does anyway) and connections live milliseconds.
IDLE_SECONDS = 0.5
SHUTDOWN_SECONDS = 0.25
HANDSHAKE_SECONDS = 10.0
# Kubeflow's own bound on the body (its reporters send well under 4 KiB).
MAX_BODY_BYTES = MAX_REPORT_BYTES

log = logging.getLogger(__name__)


def status_path(namespace: str, name: str) -> str:
    """The URL path a job's pods POST to (`KUBEFLOW_TRAINER_SERVER_URL` is host + this)."""
    return f"/apis/kubetrain.io/v1alpha1/namespaces/{namespace}/trainingjobs/{name}/status"


def job_token(key: bytes, namespace: str, name: str, uid: str) -> str:
    """The bearer token of one job: HMAC-SHA256 of its namespace, name and uid under `key`."""
    digest = hmac.new(key, f"{namespace}/{name}/{uid}".encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


@dataclass(frozen=True)
class RateLimit:
    """Requests each job may make: `per_second` on average, `burst` at once.

    transformers reports at most every 5 s from rank 0; the kubeflow SDK throttles each
    process to one update per 5 s, so a job whose every rank reports sends one request per
    5 s per rank: the defaults let 10 ranks do that without a refusal.
    """

    per_second: float = 2.0
    burst: int = 20


@dataclass
class _Job:
    uid: str
    token: bytes
    tokens_left: float
    refilled_at: float
    latest: Report | None = None
    last_step: int | None = None  # of the latest report that named one
    redone_until: int | None = None  # the furthest step before a report's step went back
    resumed_step: int | None = None  # the checkpoint the current attempt resumed from
    first_step: int | None = None  # the current attempt's first reported step


@dataclass
class StatusReports:
    """The jobs the endpoint serves and each one's latest `Report`; safe across threads.

    The controller `admit`s a job when it runs own code and `forget`s it when the job is
    gone; it reads `latest`. The endpoint calls `admission` and `record`.
    """

    key: bytes
    rate: RateLimit = field(default_factory=RateLimit)
    clock: Callable[[], float] = time.monotonic
    _jobs: dict[tuple[str, str], _Job] = field(default_factory=dict, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def __post_init__(self) -> None:
        if len(self.key) < 32:
            raise ValueError("the status endpoint's key must be at least 32 bytes")

    def admit(self, namespace: str, name: str, uid: str, step: int | None = None) -> str:
        """Serve this job from now on (idempotent); returns the token its pods must send.

        `step` is the job's status.progress.step when it is first admitted (an operator that
        restarted mid-job): a report below it went back, as one below a reported step does.
        A new uid under the same name (the job was deleted and created again) starts afresh.
        """
        token = job_token(self.key, namespace, name, uid)
        with self._lock:
            job = self._jobs.get((namespace, name))
            if job is None or job.uid != uid:
                self._jobs[namespace, name] = _Job(uid, token.encode(), float(self.rate.burst),
                                                   self.clock(), last_step=step)
        return token

    def forget(self, namespace: str, name: str) -> None:
        """Stop serving this job and drop its report."""
        with self._lock:
            self._jobs.pop((namespace, name), None)

    def admitted(self) -> set[tuple[str, str]]:
        """The (namespace, name) of every job served now."""
        with self._lock:
            return set(self._jobs)

    def latest(self, namespace: str, name: str) -> Report | None:
        """The job's latest accepted report, or None (none yet, or not admitted)."""
        with self._lock:
            job = self._jobs.get((namespace, name))
            return job.latest if job is not None else None

    def admission(self, namespace: str, name: str, authorization: str | None) -> _Job:
        """The job a request may write to, after its token and the job's rate limit.

        Raises `Refused`: 404 unknown job, 401 no bearer token, 403 another job's token,
        429 over the job's rate.
        """
        with self._lock:
            job = self._jobs.get((namespace, name))
        if job is None:
            raise Refused(404, f"no TrainingJob {namespace}/{name} reports to this operator "
                          "(it does not exist, runs kubetrain's own trainer, or is finished)")
        scheme, _, token = (authorization or "").partition(" ")
        if scheme != "Bearer" or not token.strip():
            raise Refused(401, "send the job's token as 'Authorization: Bearer <token>' (the "
                          f"file that {TOKEN_ENV} names)", {"WWW-Authenticate": "Bearer"})
        if not hmac.compare_digest(token.strip().encode(), job.token):
            raise Refused(403, f"this token is not TrainingJob {namespace}/{name}'s: a pod may "
                          "report only its own job's status")
        with self._lock:
            now = self.clock()
            job.tokens_left = min(float(self.rate.burst),
                                  job.tokens_left + (now - job.refilled_at) * self.rate.per_second)
            job.refilled_at = now
            if job.tokens_left < 1.0:
                wait = math.ceil((1.0 - job.tokens_left) / self.rate.per_second)
                raise Refused(429, f"TrainingJob {namespace}/{name} reports more often than "
                              f"{self.rate.per_second:g} times a second (burst "
                              f"{self.rate.burst}); retry in {wait} s",
                              {"Retry-After": str(wait)})
            job.tokens_left -= 1.0
        return job

    def record(self, job: _Job, report: Report) -> None:
        """Keep `report` as the job's latest (a job forgotten meanwhile keeps nothing), with
        the furthest step reported before the step last went back (`Report.redone_until`):
        within an attempt the step only grows, so a step below the last one is a new
        attempt, resumed from an earlier checkpoint, redoing the steps up to there.

        The report kubetrain's entry posts once it restored a checkpoint says so exactly
        (`Report.resumed_step`): a new attempt from that step. It is no progress and leaves
        the latest report as it was; the attempt's later reports carry its resumed step and
        its first reported step, from which the steps it redid are counted."""
        with self._lock:
            if report.resumed_step is not None:
                if job.last_step is not None:
                    job.redone_until = max(job.redone_until or 0, job.last_step)
                job.resumed_step, job.first_step = report.resumed_step, None
                return
            if report.step is not None:
                if job.last_step is not None and report.step < job.last_step:
                    job.redone_until = max(job.redone_until or 0, job.last_step)
                job.last_step = report.step
                if job.resumed_step is not None and job.first_step is None:
                    job.first_step = report.step
            job.latest = replace(report, redone_until=job.redone_until,
                                 resumed_step=job.resumed_step, first_step=job.first_step)


# Every status the endpoint answers a refusal with, and its Kubernetes `Status` reason.
REFUSAL_REASONS = {400: "BadRequest", 401: "Unauthorized", 403: "Forbidden",
                   404: "NotFound", 405: "MethodNotAllowed", 413: "RequestEntityTooLarge",
                   422: "Invalid", 429: "TooManyRequests"}


def _status_response(refused: Refused) -> web.Response:
    """A Kubernetes `Status` body, as Kubeflow's endpoint answers a refusal."""
    body = {"kind": "Status", "apiVersion": "v1", "status": "Failure",
            "message": refused.reason, "reason": REFUSAL_REASONS.get(refused.status, "Unknown"),
            "code": refused.status}
    return web.json_response(body, status=refused.status, headers=refused.headers)


class StatusEndpoint:
    """The HTTPS server in front of `StatusReports`, on a thread and event loop of its own.

    Its own loop keeps a burst of reports off kopf's; one thread serves every connection.
    Connections idle for `idle_seconds` are closed (`IDLE_SECONDS` says why).
    """

    def __init__(self, reports: StatusReports, tls: ssl.SSLContext, *,
                 host: str = "0.0.0.0", port: int = DEFAULT_PORT,
                 idle_seconds: float = IDLE_SECONDS,
                 wall_clock: Callable[[], datetime] = lambda: datetime.now(UTC)) -> None:
        self.reports = reports
        self.tls = tls
        self.host = host
        self.port = port
        self.idle_seconds = idle_seconds
        self.wall_clock = wall_clock
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._started = threading.Event()
        self._failure: BaseException | None = None

    def start(self, timeout: float = 30.0) -> None:
        """Start serving; returns once the port is bound (`port` is then the bound port)."""
        self._thread = threading.Thread(target=self._run, name="status-endpoint", daemon=True)
        self._thread.start()
        if not self._started.wait(timeout):
            raise TimeoutError(f"the status endpoint did not start within {timeout} s")
        if self._failure is not None:
            raise RuntimeError(f"the status endpoint could not start on "
                               f"{self.host}:{self.port}") from self._failure

    @property
    def failure(self) -> BaseException | None:
        """Why the endpoint stopped serving on its own (logged when it happened); None while
        it serves, or after an orderly stop."""
        return self._failure

    def stop(self) -> None:
        """Stop serving and wait for the thread to end (at once when it has ended already)."""
        if self._loop is not None and self._stopping is not None and not self._loop.is_closed():
            # Its loop may close between the check and the call, when the endpoint fails.
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._stopping.set)
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def __enter__(self) -> StatusEndpoint:
        self.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()

    def _run(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as error:
            self._failure = error
            if self._started.is_set():  # serving already: nobody waits for it, say it here
                log.error("the status endpoint stopped serving on %s:%s; own code's progress "
                          "reports are refused until the operator restarts", self.host,
                          self.port, exc_info=error)
            self._started.set()  # before start-up: start() raises it

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        # aiohttp refuses a body over client_max_size as it reads it (a chunked one has no
        # Content-Length to check first).
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.router.add_route("*", status_path("{namespace}", "{name}"), self._handle)
        app.router.add_route("*", "/{tail:.*}", self._unknown_path)
        runner = web.AppRunner(app, access_log=None, handle_signals=False,
                               keepalive_timeout=self.idle_seconds)
        await runner.setup()
        try:
            # Bound here, so that port 0 (any free port) can say which one it got.
            family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
            sock = socket.create_server((self.host, self.port), family=family)
            self.port = sock.getsockname()[1]
            assert runner.server is not None
            # Served directly rather than through aiohttp's SockSite, which cannot set
            # asyncio's TLS shutdown timeout.
            server = await self._loop.create_server(
                runner.server, sock=sock, ssl=self.tls,
                ssl_handshake_timeout=HANDSHAKE_SECONDS, ssl_shutdown_timeout=SHUTDOWN_SECONDS)
            self._started.set()
            await self._stopping.wait()
            server.close()
        finally:
            await runner.cleanup()

    async def _unknown_path(self, request: web.Request) -> web.Response:
        return _status_response(Refused(404, f"no such path: {request.path[:200]}; reports go "
                                        f"to {status_path('NAMESPACE', 'NAME')}"))

    async def _handle(self, request: web.Request) -> web.Response:
        namespace, name = request.match_info["namespace"], request.match_info["name"]
        try:
            if request.method != "POST":
                raise Refused(405, "only POST is served here", {"Allow": "POST"})
            job = self.reports.admission(namespace, name, request.headers.get("Authorization"))
            if (request.content_length or 0) > MAX_BODY_BYTES:
                raise Refused(413, f"the body has {request.content_length} bytes, at most "
                              f"{MAX_BODY_BYTES} are accepted")
            try:
                body = await request.read()
            except web.HTTPRequestEntityTooLarge:
                raise Refused(413, f"the body is over {MAX_BODY_BYTES} bytes") from None
            report = parse_report(body, self.wall_clock())
            if report is not None and report.reported_at is None:
                raise Refused(422, LAST_UPDATED_REQUIRED)  # Kubeflow's schema requires it
        except Refused as refused:
            return _status_response(refused)
        if report is not None:
            self.reports.record(job, report)
        # Kubeflow answers with the request it accepted.
        return web.Response(body=body, status=200, content_type="application/json")
