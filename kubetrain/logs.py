"""Print a TrainingJob's worker logs, across every restart attempt, from the Kubernetes API.

    kubetrain logs JOB                 the logs of every worker pod the job has now
    kubetrain logs JOB --worker 1      worker 1 only
    kubetrain logs JOB -f              follow: each worker's new lines as they come, and
                                       the replacement pods' after each restart, until
                                       the job has Succeeded or Failed (or Ctrl-C)
    kubetrain logs JOB --since 10m     only lines from the last 10 minutes (s, m, h)

Each line is marked with the pod it came from and the restart attempt that pod belongs
to: `[NAME-worker-1 attempt 2] step 40/100 | loss 3.12`. The operator replaces a failed
worker under the same pod name, so the attempt is what tells the runs apart. Logs are
read as kubectl reads them (`pods/{name}/log`, follow=true, the trainer container), with
your kubeconfig (or the pod's service account inside a cluster); the API keeps only the
pods that exist now, so the lines of pods replaced before you ran the command are gone
from it (your cluster's log collector has them).

This module owns the command and reading logs through the API; it never writes to the
cluster.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TextIO

from kubetrain.api.trainingjob import FINISHED, GROUP, PLURAL, VERSION
from kubetrain.pod_conventions import (
    ATTEMPT_LABEL,
    INDEX_LABEL,
    TRAINER_CONTAINER,
    worker_selector,
)

# How often --follow looks for new pods (a restart's replacements) and the job's phase.
POLL_SECONDS = 1.0
DURATION = re.compile(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?")
RFC3339 = re.compile(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d{1,9}))?(Z|[+-]\d\d:\d\d)")
# A line read with timestamps=true: the time the runtime read it, a space, the text.
TIMESTAMP = re.compile(r"(\S+) ")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", metavar="JOB", help="the TrainingJob's name")
    parser.add_argument("-n", "--namespace",
                        help="the job's namespace (default: the kubeconfig context's, or "
                        "'default')")
    parser.add_argument("--worker", type=int, metavar="N",
                        help="only worker N (its pods in every attempt)")
    parser.add_argument("-f", "--follow", action="store_true",
                        help="keep printing new lines, through restarts, until the job ends")
    parser.add_argument("--since", type=since_seconds, metavar="DURATION",
                        help="only lines newer than this, e.g. 30s, 10m, 1h30m")
    parser.add_argument("--kubeconfig", help="the kubeconfig to use (default: $KUBECONFIG "
                        "or ~/.kube/config; inside a pod, its service account)")


def since_seconds(text: str) -> int:
    """Seconds of a duration as kubectl's --since takes it: 30s, 10m, 1h30m."""
    match = DURATION.fullmatch(text.strip())
    if not text.strip() or match is None or not any(match.groups()):
        raise argparse.ArgumentTypeError(
            f"--since {text!r} is not a duration: write it as 30s, 10m or 1h30m")
    hours, minutes, seconds = (int(group or 0) for group in match.groups())
    total = hours * 3600 + minutes * 60 + seconds
    if total <= 0:
        raise argparse.ArgumentTypeError(f"--since {text!r} must be longer than 0s")
    return total


@dataclass(frozen=True)
class WorkerPod:
    """One incarnation of a worker pod, as the API lists it."""

    name: str
    uid: str
    index: int
    attempt: int
    started: bool  # its container has started: the API can serve its log
    ended: bool  # its container has ended (or the pod is being deleted and is done)

    @property
    def prefix(self) -> str:
        return f"[{self.name} attempt {self.attempt}] "

    @classmethod
    def of(cls, pod: dict[str, Any]) -> WorkerPod:
        meta, status = pod["metadata"], pod.get("status") or {}
        labels = meta.get("labels") or {}
        states = [container.get("state") or {}
                  for container in status.get("containerStatuses") or []
                  if container.get("name") == TRAINER_CONTAINER]
        state = states[0] if states else {}
        ended = "terminated" in state or status.get("phase") in FINISHED
        return cls(name=meta["name"], uid=meta["uid"],
                   index=int(labels.get(INDEX_LABEL, -1)),
                   attempt=int(labels.get(ATTEMPT_LABEL, 0)),
                   started=ended or "running" in state or status.get("phase") == "Running",
                   ended=ended)


class JobLogs:
    """A job's worker logs through one Kubernetes API client (`kubernetes.client.ApiClient`)."""

    def __init__(self, api: Any, namespace: str, job: str, worker: int | None = None,
                 since: int | None = None, out: TextIO = sys.stdout) -> None:
        from kubernetes import client

        self.core = client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.namespace, self.job, self.worker, self.since = namespace, job, worker, since
        self.out = out
        self._write = threading.Lock()

    # ---- what the API says -----------------------------------------------------------

    def phase(self) -> str | None:
        """The job's phase; LookupError when there is no such job."""
        from kubernetes.client import ApiException

        try:
            job: Any = self.custom.get_namespaced_custom_object(GROUP, VERSION, self.namespace,
                                                           PLURAL, self.job)
        except ApiException as error:
            if error.status == 404:
                raise LookupError(f"TrainingJob {self.job!r} not found in namespace "
                                  f"{self.namespace!r}") from None
            raise
        return (job.get("status") or {}).get("phase")

    def pods(self) -> list[WorkerPod]:
        """The job's worker pods now (only --worker's), by worker index."""
        from kubernetes import client

        listed = self.core.list_namespaced_pod(self.namespace,
                                               label_selector=worker_selector(self.job))
        plain = client.ApiClient().sanitize_for_serialization
        pods = [WorkerPod.of(plain(pod)) for pod in listed.items]
        return sorted((pod for pod in pods if self.worker in (None, pod.index)),
                      key=lambda pod: (pod.index, pod.attempt))

    def lines(self, pod: WorkerPod, follow: bool,
              after: str | None = None) -> Iterator[tuple[str, str]]:
        """(timestamp, text) of a pod's trainer log: only lines stamped after `after`."""
        from kubernetes.client import ApiException

        options: dict[str, Any] = {"container": TRAINER_CONTAINER, "timestamps": True,
                                   "follow": follow, "_preload_content": False}
        if after is not None:
            # The client has no sinceTime: whole seconds back to the last line, and the
            # lines of that second already printed are skipped below.
            ago = datetime.now(UTC) - _instant(after)[0]
            options["since_seconds"] = max(1, math.ceil(ago.total_seconds()) + 1)
        elif self.since is not None:
            options["since_seconds"] = self.since
        try:
            response: Any = self.core.read_namespaced_pod_log(pod.name, self.namespace, **options)
        except ApiException as error:
            if error.status in (400, 404):  # not started yet, or replaced meanwhile
                return
            raise
        try:
            for line in _lines(response.stream(4096, decode_content=True)):
                stamp, text = split_timestamp(line)
                if after is None or stamp is None or _later(stamp, after):
                    yield stamp or "", text
        finally:
            response.release_conn()

    # ---- printing ----------------------------------------------------------------------

    def emit(self, pod: WorkerPod, text: str) -> None:
        with self._write:
            self.out.write(pod.prefix + text + "\n")
            self.out.flush()

    def print_once(self) -> int:
        """Print the logs every worker pod has now, worker by worker; 0, or 1 with none."""
        self.phase()
        pods = self.pods()
        if not pods:
            which = f"worker {self.worker}" if self.worker is not None else "worker pods"
            print(f"kubetrain logs: {self.job} has no {which} now", file=sys.stderr)
            return 1
        for pod in pods:
            if not pod.started:
                print(f"kubetrain logs: {pod.name} (attempt {pod.attempt}) has not started "
                      "yet", file=sys.stderr)
                continue
            for _, text in self.lines(pod, follow=False):
                self.emit(pod, text)
        return 0

    def follow(self, poll_seconds: float = POLL_SECONDS,
               stopped: Callable[[], bool] = lambda: False) -> int:
        """Follow every worker pod, and each replacement after a restart, until the job
        has ended and every followed pod's log has ended."""
        threads: dict[str, threading.Thread] = {}
        while not stopped():
            finished = self.phase() in FINISHED
            for pod in self.pods():
                if pod.started and pod.uid not in threads:
                    thread = threading.Thread(target=self._follow_pod, args=(pod,),
                                              name=f"logs-{pod.name}", daemon=True)
                    threads[pod.uid] = thread
                    thread.start()
            if finished and not any(thread.is_alive() for thread in threads.values()):
                return 0
            time.sleep(poll_seconds)
        return 0

    def _follow_pod(self, pod: WorkerPod) -> None:
        """One pod's log until its container has ended or the pod is gone; a connection
        lost before then is taken up again after the last line printed."""
        from urllib3.exceptions import HTTPError

        last: str | None = None
        while True:
            try:
                for stamp, text in self.lines(pod, follow=True, after=last):
                    last = stamp or last
                    self.emit(pod, text)
            except (HTTPError, OSError):
                pass  # the connection broke: ask again below, after the last line printed
            now = next((p for p in self.pods() if p.name == pod.name), None)
            if now is None or now.uid != pod.uid or now.ended:
                return
            time.sleep(POLL_SECONDS)


def split_timestamp(line: str) -> tuple[str | None, str]:
    """A log line read with timestamps=true as (its RFC 3339 time, its text)."""
    match = TIMESTAMP.match(line)
    if match is None or RFC3339.fullmatch(match.group(1)) is None:
        return None, line
    return match.group(1), line[match.end():]


def _later(stamp: str, than: str) -> bool:
    return _instant(stamp) > _instant(than)


def _instant(stamp: str) -> tuple[datetime, int]:
    """An RFC 3339 time as (the second, nanoseconds), comparable with nanosecond precision."""
    match = RFC3339.fullmatch(stamp)
    if match is None:
        raise ValueError(f"not an RFC 3339 time: {stamp!r}")
    whole, fraction, zone = match.groups()
    moment = datetime.fromisoformat(whole + ("+00:00" if zone == "Z" else zone))
    return moment, int((fraction or "0").ljust(9, "0"))


def _lines(chunks: Iterator[bytes]) -> Iterator[str]:
    """The lines of a streamed answer, as they complete."""
    partial = b""
    for chunk in chunks:
        *complete, partial = (partial + chunk).split(b"\n")
        for line in complete:
            yield line.decode(errors="replace")
    if partial:
        yield partial.decode(errors="replace")


def _api(kubeconfig: str | None) -> tuple[Any, str]:
    """An API client from the kubeconfig (or the pod's service account) and its namespace."""
    from kubernetes import client, config

    configuration = client.Configuration()
    try:
        config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
        _, context = config.list_kube_config_contexts(config_file=kubeconfig)
        namespace = (context or {}).get("context", {}).get("namespace") or "default"
    except config.ConfigException:
        if kubeconfig:
            raise
        config.load_incluster_config(client_configuration=configuration)
        with open("/var/run/secrets/kubernetes.io/serviceaccount/namespace") as file:
            namespace = file.read().strip()
    return client.ApiClient(configuration), namespace


def run(args: argparse.Namespace) -> int:
    from kubernetes import config

    try:
        api, namespace = _api(args.kubeconfig)
    except (config.ConfigException, OSError) as error:
        print(f"kubetrain logs: no cluster to read from: {error}", file=sys.stderr)
        return 1
    logs = JobLogs(api, args.namespace or namespace, args.job, worker=args.worker,
                   since=args.since)
    try:
        return logs.follow() if args.follow else logs.print_once()
    except LookupError as error:
        print(f"kubetrain logs: {error.args[0]}", file=sys.stderr)
        return 1
