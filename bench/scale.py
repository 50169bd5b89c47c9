"""At the scale of 1,000 nodes x 8 GPUs, in simulation: what the operator, the lifelines, the
rendezvous and the status endpoint cost against their size (issue 53).

    .venv/bin/python -u bench/scale.py [--parts job,lifelines,rendezvous,status] [--quick]
        [--workers 4,100,250,500,1000] [--processes 32,1024,2048,4096,8192]
        [--procs-per-pod 8] [--agents 64,128,256,512,1024] [--pods 125,250,500,1000]

The real components, against lightweight stand-ins for what is large, all on this machine:
- job: `kubetrain operator` (its own process, tests/cluster/operator_process.py) on kmock's
  emulator (tests/cluster/emulator.py, in this process). One TrainingJob of N workers: the
  seconds until every pod exists, then every pod reported Running as N kubelets would (a
  burst from 8 threads) until status.workers.ready says N; the operator's API writes over
  both, per pod, counted from the requests the emulator served, and its CPU.
- lifelines: the same operator, one job of P pods of `--procs-per-pod` trainer processes,
  each pod Running at its own loopback address (127.10.x.y). One stand-in process plays
  every pod: it serves kubetrain's lifeline wire (`kubetrain.protocol`) on each pod's
  address and beats as the pod's agent does (`--wire pod`), or as each trainer process of
  an image from before issue 53 did (`--wire per-process`). Over `--window` seconds once every
  lifeline is followed: the operator's CPU (cores), memory (VmRSS, VmHWM) and event-loop
  lag (how late its /healthz answers, served on kopf's loop beside the lifelines). Then
  `--losses` pods lose their node one after another (their beats stop and their addresses
  answer nothing: the listeners' accept queues are full, so the kernel drops every new
  handshake, as a lost node's network does): seconds from the last beat until the
  operator deletes the pod, against the threshold (`kubetrain.operator.lifeline_watch`).
- rendezvous: kubetrain's rendezvous backend (`kubetrain.trainer.rendezvous.create_handler`,
  torchrun's handler) in N threads spread over a few processes, each thread one pod's
  torchrun agent: it joins, then asks `num_nodes_waiting` every 0.1 s (torchrun's monitor
  interval) and joins the next round when it is asked to; the store is a TCPStore in a
  process of its own (worker 0's). Every agent is PID 1 of its own pod (its descriptor:
  the pod's hostname, pid 1), so a replacement pod's agent is its predecessor's name
  again. The seconds until all N agents formed the first round; then one agent killed
  (no word, its keep-alives stop) and its replacement started: the seconds until all N
  are in the new round; the store's and the agents' CPU. Here every agent's own work
  (reading and writing the round's shared state) shares this machine's cores, which in
  a cluster each agent does on its own node: the round times are an upper bound where
  that work is large, and the agents' CPU says how large.
- status: the operator's status endpoint (`StatusEndpoint`, default rate limit) in a
  process of its own; own-code pods in jobs of `--pods-per-job` each POST a report every
  5 s (the kubeflow SDK's throttle), a connection each (transformers' urllib), spread
  evenly, from a few client processes; each job stays within its rate limit, and a 429
  is counted. The endpoint's CPU and the reports' latency.

Every figure comes from one machine whose cores the stand-ins share with the measured
process: each part says what it counts and what it does not. Goals are printed beside
each curve, and under each curve its ratios: every size's figures against the curve's
first size (its small job, the baseline), measured in the same run on the same machine,
so a busy machine moves both sides alike.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import math
import multiprocessing
import os
import queue
import resource
import selectors
import signal
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "cluster"))
sys.path.insert(0, str(REPO / "tests" / "operator"))

NAMESPACE = "default"
METRICS_PORT = 19400  # the jobs' spec.metrics.port: lifelines on the ports after it
HEALTH_PROBE_SECONDS = 0.1
LOSS_TIMEOUT = 60.0  # seconds a lost pod's deletion is awaited

# The goals of issue 53, on this 2-core machine.
GOAL_LIFELINE_PROCESSES = 8192
GOAL_LIFELINE_CORES = 0.5
GOAL_LIFELINE_MIB = 512
GOAL_SILENT_MARGIN = 1.0  # seconds beyond the threshold
GOAL_AGENTS = 1024
GOAL_ROUND_SECONDS = 10.0
GOAL_WORKERS = 1000
GOAL_JOB_SECONDS = 30.0


# --- shared -------------------------------------------------------------------------------


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _memory_kib(pid: int) -> dict[str, int]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0])
    return fields


def _raise_file_limit() -> None:
    """Every connection is a file: the stand-ins and the operator (which inherit this
    process's limits) hold one per lifeline."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _percentile(values: Sequence[float], fraction: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def _sizes(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def _print_ratios(unit: str, sizes: Sequence[int],
                  columns: dict[str, Sequence[float | None]]) -> None:
    """Each size's figures against the first size's, measured in this run: the curve's
    baseline. A figure that is missing or a baseline of zero shows '-'."""
    print(f"   ratio to the baseline: the same figures at {sizes[0]} {unit}, this run", flush=True)
    print(f"{unit:>10}" + "".join(f"{name:>{max(12, len(name) + 2)}}" for name in columns),
          flush=True)
    for row, size in enumerate(sizes):
        cells = []
        for name, values in columns.items():
            value, base = values[row], values[0]
            shown = ("-" if value is None or base is None or not base
                     or math.isnan(value) or math.isnan(base) else f"{value / base:.2f}x")
            cells.append(f"{shown:>{max(12, len(name) + 2)}}")
        print(f"{size:>10}" + "".join(cells), flush=True)


class PodWatch:
    """The namespace's pods as the API reports them, from one watch read in a thread."""

    def __init__(self, core: Any, port: int) -> None:
        listed = core.list_namespaced_pod(NAMESPACE, limit=1, _preload_content=False)
        version = json.loads(listed.data)["metadata"]["resourceVersion"]
        # A plain connection, which `close` can shut under the reading thread.
        self._connection = http.client.HTTPConnection("127.0.0.1", port)
        self._connection.request("GET", f"/api/v1/namespaces/{NAMESPACE}/pods?watch=true"
                                 f"&resourceVersion={version}")
        self._response = self._connection.getresponse()
        self.added: set[str] = set()
        self.deleted: dict[str, float] = {}  # name -> time.time() the deletion was seen
        self._changed = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        with contextlib.suppress(OSError, ValueError):  # shut by `close`
            for line in self._response:
                if not line.strip():
                    continue
                event = json.loads(line)
                name = event["object"]["metadata"]["name"]
                with self._changed:
                    if event["type"] == "ADDED":
                        self.added.add(name)
                    elif event["type"] == "DELETED" or (
                            event["object"]["metadata"].get("deletionTimestamp")):
                        self.deleted.setdefault(name, time.time())
                    self._changed.notify_all()

    def close(self) -> None:
        assert self._connection.sock is not None
        with contextlib.suppress(OSError):
            self._connection.sock.shutdown(socket.SHUT_RDWR)

    def wait(self, done: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        with self._changed:
            while not done():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"waited {timeout:.0f} s for {what}")
                self._changed.wait(min(left, 0.5))


def _job_manifest(name: str, workers: int, procs_per_worker: int = 1) -> dict[str, Any]:
    import harness

    manifest = harness.job_manifest(name, replicas=workers)
    manifest["spec"]["workers"].update(minReplicas=workers, maxReplicas=workers,
                                       procsPerWorker=procs_per_worker)
    manifest["spec"]["metrics"] = {"port": METRICS_PORT}
    return manifest


def _operator_writes(requests: Sequence[Any]) -> Counter[str]:
    """The operator's write requests among `requests` (the emulator's), by 'verb resource'."""
    from kubetrain.operator.handlers import USER_AGENT

    writes: Counter[str] = Counter()
    for request in requests:
        if request.resource is None or not request.resource.plural:
            continue
        if not request.headers.get("User-Agent", "").startswith(("kopf", USER_AGENT)):
            continue
        action = request.action.name
        if action == "UPDATE":
            verb = "patch" if request.method.name == "PATCH" else "update"
        elif action in ("CREATE", "DELETE"):
            verb = action.lower()
        else:
            continue
        resource_name = request.resource.plural + (f"/{request.subresource}"
                                                   if request.subresource else "")
        writes[f"{verb} {resource_name}"] += 1
    return writes


@contextlib.contextmanager
def _cluster_and_operator(folder: Path, resync_seconds: float = 10.0) -> Iterator[Any]:
    """A fresh emulator (this process) and `kubetrain operator` (its own process) on it."""
    from emulator import EmulatedCluster
    from kubernetes import client
    from operator_process import OperatorProcess

    folder.mkdir(parents=True, exist_ok=True)
    with EmulatedCluster(folder) as api, OperatorProcess(
            api.kubeconfig, folder / "operator.log", resync_seconds=resync_seconds) as operator:
        core = client.CoreV1Api(api.api_client())
        yield api, operator, core


def _run_pods(core: Any, names: Sequence[str], ips: Sequence[str | None]) -> None:
    """Report each pod Running (at its IP), as its kubelet would, from 8 threads."""
    def run(pair: tuple[str, str | None]) -> None:
        status: dict[str, Any] = {"phase": "Running"}
        if pair[1]:
            status["podIP"] = pair[1]
        core.patch_namespaced_pod_status(pair[0], NAMESPACE, {"status": status})

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(run, zip(names, ips, strict=True)))


def _job_status(custom: Any, name: str) -> dict[str, Any]:
    job = custom.get_namespaced_custom_object("kubetrain.io", "v1alpha1", NAMESPACE,
                                              "trainingjobs", name)
    return dict(job.get("status") or {})


def _create_job(api: Any, manifest: dict[str, Any]) -> Any:
    from kubernetes import client

    custom = client.CustomObjectsApi(api.api_client())
    custom.create_namespaced_custom_object("kubetrain.io", "v1alpha1", NAMESPACE,
                                           "trainingjobs", manifest)
    return custom


# --- job: one job of N workers ------------------------------------------------------------


def measure_job(workers: int, folder: Path) -> dict[str, Any]:
    """One job of `workers` pods on a fresh emulator: seconds until every pod exists, until
    every pod is Running and counted ready, the operator's writes and CPU."""
    with _cluster_and_operator(folder) as (api, operator, core):
        watch = PodWatch(core, api.server.port)
        try:
            return _grow_job(api, operator.process.pid, core, watch, workers)
        finally:
            watch.close()


def _grow_job(api: Any, pid: int, core: Any, watch: PodWatch, workers: int) -> dict[str, Any]:
    name = "big"
    served_before = len(api.emulator.requests())
    cpu_before = _cpu_seconds(pid)
    started = time.monotonic()
    custom = _create_job(api, _job_manifest(name, workers))
    watch.wait(lambda: len(watch.added) >= workers, 300, f"{workers} pods")
    created = time.monotonic() - started
    names = sorted(watch.added)
    running_at = time.monotonic()
    _run_pods(core, names, [None] * len(names))
    deadline = time.monotonic() + 300
    while (_job_status(custom, name).get("workers") or {}).get("ready") != workers:
        if time.monotonic() > deadline:
            raise TimeoutError(f"status.workers.ready never reached {workers}")
        time.sleep(0.1)
    ready = time.monotonic() - running_at
    time.sleep(2.0)  # the last transitions' writes land
    writes = _operator_writes(api.emulator.requests()[served_before:])
    return {"workers": workers, "created_s": created, "ready_s": ready, "writes": writes,
            "cpu_s": _cpu_seconds(pid) - cpu_before,
            "peak_mib": _memory_kib(pid)["VmHWM"] / 1024}


def job_part(sizes: Sequence[int], folder: Path) -> list[str]:
    print(f"\n== one job of N workers: `kubetrain operator` on kmock's emulator (EMULATOR: "
          f"its times are not a real API server's; writes, CPU and memory are the operator's)"
          f"\n   goal at {GOAL_WORKERS}: every pod created <= {GOAL_JOB_SECONDS:g} s; writes "
          f"per pod no higher than at {min(sizes)}", flush=True)
    print(f"{'workers':>8}{'pods exist s':>14}{'pods/s':>8}{'ready s':>9}{'writes':>8}"
          f"{'per pod':>9}{'status':>8}{'events':>8}{'CPU s':>8}{'ms/pod':>8}{'peak MiB':>10}",
          flush=True)
    rows = []
    for workers in sizes:
        row = measure_job(workers, folder / f"job-{workers}")
        writes = row["writes"]
        total = sum(writes.values())
        rows.append((workers, row, total / workers))
        print(f"{workers:>8}{row['created_s']:>14.2f}{workers / row['created_s']:>8.0f}"
              f"{row['ready_s']:>9.2f}{total:>8}{total / workers:>9.3f}"
              f"{writes['patch trainingjobs/status']:>8}{writes['create events']:>8}"
              f"{row['cpu_s']:>8.1f}{1000 * row['cpu_s'] / workers:>8.2f}"
              f"{row['peak_mib']:>10.0f}", flush=True)
        others = {kind: count for kind, count in writes.items()
                  if kind not in ("patch trainingjobs/status", "create events")}
        print(f"{'':>8}  writes: {', '.join(f'{k} {v}' for k, v in sorted(others.items()))}",
              flush=True)
    _print_ratios("workers", [workers for workers, _, _ in rows], {
        "s per pod": [row["created_s"] / workers for workers, row, _ in rows],
        "writes per pod": [per_pod for _, _, per_pod in rows],
        "CPU per pod": [row["cpu_s"] / workers for workers, row, _ in rows],
        "peak MiB": [row["peak_mib"] for _, row, _ in rows]})
    small = rows[0][2]
    verdicts = []
    for workers, row, per_pod in rows:
        if workers >= GOAL_WORKERS:
            met = row["created_s"] <= GOAL_JOB_SECONDS and per_pod <= small
            verdicts.append(f"job of {workers} workers: pods exist in {row['created_s']:.1f} s "
                            f"(goal <= {GOAL_JOB_SECONDS:g}), {per_pod:.3f} writes per pod "
                            f"against {small:.3f} at {rows[0][0]}: "
                            f"{'met' if met else 'NOT met'}")
    return verdicts


# --- lifelines ----------------------------------------------------------------------------


def _pod_address(index: int) -> str:
    """Pod `index`'s own loopback address (127.0.0.0/8 is all the loopback interface's)."""
    return f"127.10.{index // 250}.{index % 250 + 1}"


class TrainerStandIns:
    """The stand-in process that plays every pod's trainer processes (`serve_lifelines`)."""

    def __init__(self, pods: Sequence[tuple[str, str]], processes_per_pod: int,
                 wire: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, __file__, "--serve-lifelines"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True)
        self._ask({"pods": [list(pod) for pod in pods], "processes": processes_per_pod,
                   "wire": wire})

    def _ask(self, command: dict[str, Any]) -> dict[str, Any]:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        answer = self.process.stdout.readline()
        if not answer:
            raise RuntimeError("the trainer stand-ins exited")
        return dict(json.loads(answer))

    def followers(self) -> int:
        """Connections the operator holds to the stand-ins now."""
        return int(self._ask({"ask": "followers"})["followers"])

    def lose(self, ip: str) -> float:
        """The pod at `ip` loses its node: no beat and no handshake from now on; returns
        when (time.time()) the last beat was sent on the first of its lifelines to fall
        silent."""
        return float(self._ask({"ask": "lose", "ip": ip})["last_beat"])

    def cpu_seconds(self) -> float:
        return _cpu_seconds(self.process.pid)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            assert self.process.stdin is not None
            self.process.stdin.close()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def serve_lifelines() -> None:
    """The stand-in process: every pod's lifelines, on one selector.

    wire "pod": as each pod's agent (`kubetrain.trainer.lifeline.PodLifeline`) serves it, one
    lifeline a pod on its address at `lifeline_port(metrics port)`, POD_LIFELINE first.
    wire "per-process": as trainer images from before issue 53 do, one lifeline per trainer
    process at `lifeline_port(metrics port, local rank)`. Either beats to each follower
    every LIFELINE_BEAT_SECONDS; here one thread does it for all, spread evenly over the
    period (pods are not in step). Commands come as JSON lines on stdin.
    """
    from kubetrain.protocol import BEAT, LIFELINE_BEAT_SECONDS, POD_LIFELINE, lifeline_port

    beat = BEAT
    config = json.loads(sys.stdin.readline())
    per_process = config["wire"] == "per-process"
    welcome = BEAT if per_process else POD_LIFELINE + BEAT
    selector = selectors.DefaultSelector()
    listeners: dict[socket.socket, str] = {}
    for _name, ip in config["pods"]:
        for rank in range(config["processes"] if per_process else 1):
            listener = socket.socket()
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            _bind(listener, (ip, lifeline_port(METRICS_PORT, rank)))
            listener.listen(16)  # as the trainer's
            listener.setblocking(False)
            selector.register(listener, selectors.EVENT_READ, "listener")
            listeners[listener] = ip
    followers: dict[socket.socket, str] = {}
    lost: set[str] = set()
    last_beat: dict[socket.socket, float] = {}
    fillers: list[socket.socket] = []
    lock = threading.Lock()
    print(json.dumps({"listening": len(listeners)}), flush=True)

    def beats() -> None:
        slices = 10
        period = LIFELINE_BEAT_SECONDS / slices
        turn = 0
        next_at = time.monotonic()
        while True:
            next_at += period
            time.sleep(max(0.0, next_at - time.monotonic()))
            with lock:
                chosen = [(s, ip) for s, ip in followers.items()
                          if ip not in lost and hash(s) % slices == turn]
            now = time.time()
            for follower, _ip in chosen:
                with contextlib.suppress(OSError):  # a full buffer or a closed follower
                    follower.send(beat)
                last_beat[follower] = now
            turn = (turn + 1) % slices

    threading.Thread(target=beats, daemon=True).start()
    selector.register(sys.stdin, selectors.EVENT_READ, "command")
    while True:
        for key, _ in selector.select():
            if key.data == "listener":
                listener = key.fileobj
                assert isinstance(listener, socket.socket)
                with contextlib.suppress(BlockingIOError):
                    follower, _ = listener.accept()
                    follower.setblocking(False)
                    follower.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    with lock:
                        followers[follower] = listeners[listener]
                    selector.register(follower, selectors.EVENT_READ, "follower")
                    with contextlib.suppress(OSError):
                        follower.send(welcome)
            elif key.data == "follower":
                follower = key.fileobj
                assert isinstance(follower, socket.socket)
                try:
                    gone = not follower.recv(4096)
                except BlockingIOError:
                    gone = False
                except OSError:
                    gone = True
                if gone:  # the operator stopped following
                    selector.unregister(follower)
                    with lock:
                        followers.pop(follower, None)
                    follower.close()
            else:
                line = sys.stdin.readline()
                if not line:
                    return
                command = json.loads(line)
                if command["ask"] == "followers":
                    with lock:
                        count = sum(1 for ip in followers.values() if ip not in lost)
                    print(json.dumps({"followers": count}), flush=True)
                elif command["ask"] == "lose":
                    ip = command["ip"]
                    with lock:
                        lost.add(ip)
                        # The pod falls silent with its first lifeline to miss a beat.
                        last = min((last_beat[s] for s, address in followers.items()
                                    if address == ip and s in last_beat), default=time.time())
                    for listener, address in listeners.items():
                        if address == ip:
                            selector.unregister(listener)
                            fillers.extend(_fill_accept_queue(listener))
                    print(json.dumps({"last_beat": last}), flush=True)


def _bind(listener: socket.socket, address: tuple[str, int], seconds: float = 30.0) -> None:
    """Bind, waiting while the previous size's stand-ins still hold the address."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            listener.bind(address)
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def _fill_accept_queue(listener: socket.socket) -> list[socket.socket]:
    """Connections to a listener nobody accepts from, until the kernel's accept queue is
    full: then it drops every new handshake, and the address answers nothing."""
    address = listener.getsockname()
    queued = []
    for _ in range(24):  # backlog 16: full at 17; the rest wait in SYN_SENT
        client = socket.socket()
        client.setblocking(False)
        client.connect_ex(address)
        queued.append(client)
    time.sleep(0.05)
    return queued


class HealthProbe:
    """How late the operator's /healthz answers (kopf serves it on its event loop), asked
    every HEALTH_PROBE_SECONDS from a thread."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.seconds: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(HEALTH_PROBE_SECONDS):
            connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
            began = time.perf_counter()
            try:
                connection.request("GET", "/healthz")
                connection.getresponse().read()
            except OSError:
                continue
            finally:
                connection.close()
            self.seconds.append(time.perf_counter() - began)

    def stop(self) -> list[float]:
        self._stop.set()
        self._thread.join()
        return self.seconds


def measure_lifelines(processes: int, per_pod: int, wire: str, window: float, losses: int,
                      folder: Path) -> dict[str, Any]:
    """The operator following `processes` trainer processes' lifelines in pods of
    `per_pod`: its CPU, memory and loop lag over `window` s, and `losses` silent pods."""
    pods = max(1, processes // per_pod)
    name = "wide"
    with _cluster_and_operator(folder) as (api, operator, core):
        pid = operator.process.pid
        watch = PodWatch(core, api.server.port)
        stand_ins = None
        try:
            custom = _create_job(api, _job_manifest(name, pods, per_pod))
            watch.wait(lambda: len(watch.added) >= pods, 300, f"{pods} pods")
            names = [f"{name}-worker-{index}" for index in range(pods)]
            ips = [_pod_address(index) for index in range(pods)]
            stand_ins = TrainerStandIns(list(zip(names, ips, strict=True)), per_pod, wire)
            _run_pods(core, names, ips)
            expected = pods * per_pod if wire == "per-process" else pods
            followed, grew_at, deadline = 0, time.monotonic(), time.monotonic() + 300
            while followed < expected:
                now = time.monotonic()
                if now > deadline or now - grew_at > 30:
                    print(f"  ({processes} processes: the operator holds {followed} of "
                          f"{expected} lifelines and stopped gaining: measured as it is)",
                          flush=True)
                    break
                time.sleep(1.0)
                if (count := stand_ins.followers()) > followed:
                    followed, grew_at = count, time.monotonic()
            connections = followed
            time.sleep(2.0)  # settled
            probe = HealthProbe(operator.health_port)
            cpu_before, stand_in_before = _cpu_seconds(pid), stand_ins.cpu_seconds()
            time.sleep(window)
            cpu = (_cpu_seconds(pid) - cpu_before) / window
            stand_in_cpu = (stand_ins.cpu_seconds() - stand_in_before) / window
            lags = probe.stop()
            memory = _memory_kib(pid)
            silent = []
            for index in range(losses):
                pod = names[1 + index * max(1, (pods - 1) // max(1, losses))]  # never worker 0
                last = stand_ins.lose(ips[names.index(pod)])
                try:
                    watch.wait(lambda p=pod: p in watch.deleted, LOSS_TIMEOUT,
                               f"{pod} deleted as lost")
                except TimeoutError:
                    silent.append(None)
                    continue
                silent.append(watch.deleted[pod] - last)
                time.sleep(1.0)
            phase = _job_status(custom, name).get("phase")
        finally:
            if stand_ins is not None:
                stand_ins.close()
            watch.close()
    return {"processes": pods * per_pod, "pods": pods, "connections": connections,
            "cores": cpu, "stand_in_cores": stand_in_cpu, "rss_mib": memory["VmRSS"] / 1024,
            "peak_mib": memory["VmHWM"] / 1024, "lag_p50_ms": 1000 * _percentile(lags, 0.5),
            "lag_p99_ms": 1000 * _percentile(lags, 0.99), "lag_max_ms": 1000 * max(lags),
            "silent_s": silent, "phase": phase}


def lifeline_threshold() -> float:
    """Seconds from a pod's last beat until the operator takes it for lost: the silence it
    waits, then the probe it gives up on."""
    from kubetrain.operator.lifeline_watch import PROBE_SECONDS, SILENCE_SECONDS

    return SILENCE_SECONDS + PROBE_SECONDS


def lifelines_part(sizes: Sequence[int], per_pod: int, wire: str, window: float, losses: int,
                   folder: Path) -> list[str]:
    threshold = lifeline_threshold()
    served = ("one lifeline a pod (its agent's)" if wire == "pod" else
              "one lifeline per trainer process (images from before issue 53)")
    print(f"\n== lifelines: `kubetrain operator` following the trainers of one job's Running "
          f"pods ({per_pod} processes a pod, {served}), a stand-in process beating for them"
          f"\n   goal at {GOAL_LIFELINE_PROCESSES} processes: <= {GOAL_LIFELINE_CORES:g} core, "
          f"<= {GOAL_LIFELINE_MIB} MiB, a silent pod deleted <= {threshold:g} s threshold + "
          f"{GOAL_SILENT_MARGIN:g} s after its last beat; the first row is the small job",
          flush=True)
    print(f"{'processes':>10}{'pods':>6}{'conns':>7}{'cores':>7}{'RSS MiB':>9}{'HWM MiB':>9}"
          f"{'lag p50 ms':>11}{'p99':>7}{'max':>7}{'silent after s (each loss)':>30}"
          f"{'stand-in cores':>16}", flush=True)
    rows = []
    for processes in sizes:
        row = measure_lifelines(processes, per_pod, wire, window, losses,
                                folder / f"lifelines-{processes}")
        rows.append(row)
        silent = " ".join(f"> {LOSS_TIMEOUT:g}" if s is None else f"{s:.2f}"
                          for s in row["silent_s"])
        print(f"{row['processes']:>10}{row['pods']:>6}{row['connections']:>7}"
              f"{row['cores']:>7.2f}{row['rss_mib']:>9.0f}{row['peak_mib']:>9.0f}"
              f"{row['lag_p50_ms']:>11.1f}{row['lag_p99_ms']:>7.0f}{row['lag_max_ms']:>7.0f}"
              f"{silent:>30}{row['stand_in_cores']:>16.2f}", flush=True)

    def silent_median(row: dict[str, Any]) -> float | None:
        seen = [s for s in row["silent_s"] if s is not None]
        return statistics.median(seen) if seen and len(seen) == len(row["silent_s"]) else None

    _print_ratios("processes", [row["processes"] for row in rows], {
        "cores": [row["cores"] for row in rows],
        "HWM MiB": [row["peak_mib"] for row in rows],
        "lag p50": [row["lag_p50_ms"] for row in rows],
        "lag p99": [row["lag_p99_ms"] for row in rows],
        "silent after (median)": [silent_median(row) for row in rows]})
    verdicts = []
    small = statistics.median([s if s is not None else LOSS_TIMEOUT
                               for s in rows[0]["silent_s"]] or [float("nan")])
    for row in rows:
        if row["processes"] >= GOAL_LIFELINE_PROCESSES:
            worst = max((s if s is not None else float("inf") for s in row["silent_s"]),
                        default=float("nan"))
            met = (row["cores"] <= GOAL_LIFELINE_CORES and row["peak_mib"] <= GOAL_LIFELINE_MIB
                   and worst <= threshold + GOAL_SILENT_MARGIN)
            verdicts.append(
                f"lifelines of {row['processes']} processes: {row['cores']:.2f} core (goal <= "
                f"{GOAL_LIFELINE_CORES:g}), peak {row['peak_mib']:.0f} MiB (goal <= "
                f"{GOAL_LIFELINE_MIB}), silent pod deleted after {worst:.2f} s at worst (goal "
                f"<= {threshold + GOAL_SILENT_MARGIN:g}; small job {small:.2f}): "
                f"{'met' if met else 'NOT met'}")
    return verdicts


# --- rendezvous ---------------------------------------------------------------------------


def _store_process(ports: Any, stop: Any) -> None:
    """Worker 0's rendezvous store (a TCPStore server), until `stop`."""
    os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"  # c10d's warnings per connection
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, multi_tenant=True,
                     wait_for_workers=False)
    ports.put((store.port, os.getpid()))
    stop.wait()
    del store


def _agents_process(indexes: list[int], agents: int, port: int, events: Any,
                    commands: Any) -> None:
    """Some of the agents, one thread each: what torchrun's agent does with its handler."""
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # as in the pods
    os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"  # c10d's warnings per connection
    import logging

    logging.disable(logging.WARNING)
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from kubetrain.trainer.rendezvous import create_handler

    def handler(index: int) -> Any:
        address = f"job-worker-{index}.job"
        created = create_handler(RendezvousParameters(
            backend="kubetrain", endpoint=f"127.0.0.1:{port}", run_id="bench",
            min_nodes=agents, max_nodes=agents, local_addr=address, is_host=False,
            join_timeout=900))
        # Each agent is PID 1 of its own pod, the only handler of its process.
        created.descriptor = f"{address} 1 0"
        return created

    with ThreadPoolExecutor(32) as pool:  # each connects to the store: together
        handlers = dict(zip(indexes, pool.map(handler, indexes), strict=True))
    stopped = {index: threading.Event() for index in indexes}

    def agent(index: int, rendezvous: Any, stop: threading.Event) -> None:
        try:
            info = rendezvous.next_rendezvous()
            events.put(("joined", index, info.rank, info.world_size, time.time()))
            while not stop.wait(0.1):  # torchrun's monitor interval
                if rendezvous.num_nodes_waiting() > 0 and not stop.is_set():
                    info = rendezvous.next_rendezvous()
                    events.put(("joined", index, info.rank, info.world_size, time.time()))
        except Exception as error:  # reported, never hidden
            if not stop.is_set():
                events.put(("failed", index, repr(error), 0, time.time()))

    events.put(("ready", len(indexes), 0, 0, time.time()))
    commands.get()  # go
    for index in indexes:
        threading.Thread(target=agent, args=(index, handlers[index], stopped[index]),
                         daemon=True).start()
    while True:
        command, index = commands.get()
        if command == "kill":  # as kill -9 of its pod: no word, nothing more from it
            stopped[index].set()
        elif command == "replace":
            handlers[index], stopped[index] = handler(index), threading.Event()
            threading.Thread(target=agent, args=(index, handlers[index], stopped[index]),
                             daemon=True).start()
        elif command == "cpu":
            usage = resource.getrusage(resource.RUSAGE_SELF)
            events.put(("cpu", 0, usage.ru_utime + usage.ru_stime, 0, time.time()))
        elif command == "exit":
            os._exit(0)


def measure_rendezvous(agents: int, timeout: float) -> dict[str, Any]:
    """`agents` simulated agents: the first round, then one agent replaced."""
    context = multiprocessing.get_context("spawn")
    ports, stop, events = context.Queue(), context.Event(), context.Queue()
    store = context.Process(target=_store_process, args=(ports, stop), daemon=True)
    store.start()
    port, store_pid = ports.get(timeout=120)
    count = min(4, max(1, agents // 64))
    commands = [context.Queue() for _ in range(count)]
    workers = [context.Process(target=_agents_process, daemon=True, args=(
        list(range(p, agents, count)), agents, port, events, commands[p]))
        for p in range(count)]
    for worker in workers:
        worker.start()
    result: dict[str, Any] = {"agents": agents, "first_s": None, "replaced_s": None}
    try:
        for _ in workers:
            _expect(events, "ready", 300)
        cpu_before = _cpu_seconds(store_pid)
        began = time.time()
        for command in commands:
            command.put("go")
        result["first_s"] = _round(events, agents, began, timeout)
        if result["first_s"] is None:
            return result
        time.sleep(3.0)  # running: every agent's monitor loop asks num_nodes_waiting
        steady = _cpu_seconds(store_pid)
        time.sleep(2.0)
        result["store_steady_cores"] = (_cpu_seconds(store_pid) - steady) / 2.0
        replaced = agents // 2
        commands[replaced % count].put(("kill", replaced))
        began = time.time()
        commands[replaced % count].put(("replace", replaced))
        result["replaced_s"] = _round(events, agents, began, timeout)
        result["store_cpu_s"] = _cpu_seconds(store_pid) - cpu_before
        for command in commands:
            command.put(("cpu", 0))
        result["agents_cpu_s"] = sum(_expect(events, "cpu", 30)[2] for _ in commands)
    finally:
        for command in commands:
            command.put(("exit", 0))
        for worker in workers:
            worker.join(5)
            if worker.is_alive():
                worker.kill()
        stop.set()
        store.join(5)
        if store.is_alive():
            store.kill()
    return result


def _expect(events: Any, kind: str, timeout: float) -> tuple[Any, ...]:
    while True:
        event = events.get(timeout=timeout)
        if event[0] == "failed":
            raise RuntimeError(f"agent {event[1]} failed: {event[2]}")
        if event[0] == kind:
            return tuple(event)


def _round(events: Any, agents: int, began: float, timeout: float) -> float | None:
    """Seconds from `began` until `agents` agents joined a round of that size; None past
    `timeout`."""
    joined: dict[int, float] = {}
    deadline = time.monotonic() + timeout
    while len(joined) < agents:
        try:
            event = events.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            return None
        if event[0] == "failed":
            raise RuntimeError(f"agent {event[1]} failed: {event[2]}")
        if event[0] == "joined" and event[3] == agents:
            joined[event[1]] = event[4]
        if time.monotonic() > deadline:
            return None
    return max(joined.values()) - began


def rendezvous_part(sizes: Sequence[int], timeout: float) -> list[str]:
    from kubetrain.trainer.rendezvous import poll_seconds

    print(f"\n== rendezvous: N simulated torchrun agents (threads in a few processes) on "
          f"kubetrain's rendezvous backend, the store in a process of its own"
          f"\n   goal at {GOAL_AGENTS} agents: the round after one agent's replacement "
          f"forms <= {GOAL_ROUND_SECONDS:g} s; a round past {timeout:g} s is given up",
          flush=True)
    print(f"{'agents':>7}{'poll s':>8}{'first round s':>15}{'after replace s':>17}"
          f"{'store cores (running)':>23}{'store CPU s':>13}{'agents CPU s':>14}", flush=True)
    verdicts = []
    rows = []
    for agents in sizes:
        row = measure_rendezvous(agents, timeout)
        rows.append(row)

        def shown(seconds: float | None) -> str:
            return f"> {timeout:g}" if seconds is None else f"{seconds:.2f}"

        print(f"{agents:>7}{poll_seconds(agents):>8.2f}{shown(row['first_s']):>15}"
              f"{shown(row['replaced_s']):>17}"
              f"{row.get('store_steady_cores', float('nan')):>23.3f}"
              f"{row.get('store_cpu_s', float('nan')):>13.1f}"
              f"{row.get('agents_cpu_s', float('nan')):>14.1f}", flush=True)
        if agents >= GOAL_AGENTS:
            seconds = row["replaced_s"]
            met = seconds is not None and seconds <= GOAL_ROUND_SECONDS
            verdicts.append(f"rendezvous of {agents} agents after a replacement: "
                            f"{shown(seconds)} s (goal <= {GOAL_ROUND_SECONDS:g}): "
                            f"{'met' if met else 'NOT met'}")
    _print_ratios("agents", sizes, {
        "first round": [row["first_s"] for row in rows],
        "after replace": [row["replaced_s"] for row in rows],
        "store cores (running)": [row.get("store_steady_cores") for row in rows],
        "agents CPU per agent": [row["agents_cpu_s"] / row["agents"]
                                 if "agents_cpu_s" in row else None for row in rows]})
    return verdicts


# --- status endpoint ----------------------------------------------------------------------

STATUS_KEY = bytes(range(32))
REPORT_SECONDS = 5.0


def _status_job(index: int) -> tuple[str, str]:
    return f"job-{index:04d}", f"uid-{index:04d}"


def serve_status(folder: Path, jobs: int) -> None:
    """The measured process: the endpoint with its default rate limit, every job admitted;
    serves until stdin closes."""
    from kubetrain.operator.trainer_status_endpoint import StatusEndpoint, StatusReports
    from kubetrain.operator.trainer_status_tls import ServingCertificate

    serving = ServingCertificate((folder / "tls.crt").read_bytes(),
                                 (folder / "tls.key").read_bytes())
    reports = StatusReports(STATUS_KEY)
    for index in range(jobs):
        reports.admit(NAMESPACE, *_status_job(index))
    endpoint = StatusEndpoint(reports, serving.server_context(), host="127.0.0.1", port=0)
    endpoint.start()
    print(json.dumps({"port": endpoint.port}), flush=True)
    for _ in sys.stdin:
        pass
    endpoint.stop()


def _report_body(step: int) -> bytes:
    """What transformers' KubeflowCallback posts at a step's end."""
    metrics = {"loss": 2.3456, "grad_norm": 1.2345, "learning_rate": 2.9e-4, "epoch": 0.5,
               "current_step": step, "total_steps": 10_000, "current_epoch": 0.5}
    status = {"lastUpdatedTime": datetime.now(UTC).isoformat(), "progressPercentage": 5,
              "estimatedRemainingSeconds": 3600,
              "metrics": [{"name": k, "value": str(v)} for k, v in metrics.items()]}
    return json.dumps({"trainerStatus": status}).encode()


def _report_clients(pods: list[tuple[int, int]], port: int, ca: str, seconds: float,
                    offset: float, ready: Any, start: Any, results: Any) -> None:
    """Some of the pods (job index, pod index): from the start time the benchmark sends,
    each posts every REPORT_SECONDS for `seconds`, starting at its own offset in the
    period; a connection per report."""
    from kubetrain.operator.trainer_status_endpoint import job_token, status_path

    context = ssl.create_default_context(cafile=ca)
    latencies: list[float] = []
    refused = failed = 0
    lock = threading.Lock()

    def post(job: int) -> None:
        nonlocal refused, failed
        name, uid = _status_job(job)
        token = job_token(STATUS_KEY, NAMESPACE, name, uid)
        started = time.perf_counter()
        connection = http.client.HTTPSConnection("127.0.0.1", port, context=context,
                                                 timeout=30)
        try:
            connection.request("POST", status_path(NAMESPACE, name), body=_report_body(1),
                               headers={"Authorization": f"Bearer {token}",
                                        "Content-Type": "application/json"})
            response = connection.getresponse()
            response.read()
            status = response.status
        except OSError:
            status = 0
        finally:
            connection.close()
        with lock:
            if status == 200:
                latencies.append(time.perf_counter() - started)
            elif status == 429:
                refused += 1
            else:
                failed += 1

    ready.put(os.getpid())
    began = start.get() - time.time() + time.monotonic() + offset
    schedule = sorted((began + REPORT_SECONDS * (i / len(pods) + k), job)
                      for i, (job, _) in enumerate(pods)
                      for k in range(int(seconds / REPORT_SECONDS)))
    with ThreadPoolExecutor(16) as pool:
        for at, job in schedule:
            time.sleep(max(0.0, at - time.monotonic()))
            pool.submit(post, job)
    results.put((latencies, refused, failed))


def measure_status(pods: int, per_job: int, seconds: float, folder: Path) -> dict[str, Any]:
    """The endpoint under `pods` pods' reports for `seconds`: its CPU from the first report
    until the last was answered, and each report's latency."""
    jobs = (pods + per_job - 1) // per_job
    server = subprocess.Popen([sys.executable, __file__, "--serve-status", str(folder),
                               str(jobs)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert server.stdout is not None
        port = json.loads(server.stdout.readline())["port"]
        everyone = [(index // per_job, index % per_job) for index in range(pods)]
        count = 4
        context = multiprocessing.get_context("spawn")
        ready, results = context.Queue(), context.Queue()
        starts = [context.Queue() for _ in range(count)]
        clients = [context.Process(target=_report_clients, daemon=True, args=(
            everyone[c::count], port, str(folder / "ca.crt"), seconds,
            REPORT_SECONDS * c / pods, ready, starts[c], results)) for c in range(count)]
        for client in clients:
            client.start()
        for _ in clients:
            ready.get(timeout=120)  # imported
        began = time.time() + 0.5
        for start in starts:
            start.put(began)
        time.sleep(0.5)
        before = _cpu_seconds(server.pid)
        latencies: list[float] = []
        refused = failed = 0
        for _ in clients:
            got, r, f = results.get(timeout=seconds + 120)
            latencies += got
            refused += r
            failed += f
        elapsed = time.time() - began
        cpu = _cpu_seconds(server.pid) - before
        for client in clients:
            client.join(10)
        memory = _memory_kib(server.pid)
    finally:
        assert server.stdin is not None
        server.stdin.close()
        server.wait(30)
    return {"pods": pods, "jobs": jobs, "cores": cpu / elapsed,
            "ms_per_report": 1000 * cpu / max(1, len(latencies) + refused),
            "p50_ms": 1000 * _percentile(latencies, 0.5),
            "p99_ms": 1000 * _percentile(latencies, 0.99), "accepted": len(latencies),
            "refused": refused, "failed": failed, "peak_mib": memory["VmHWM"] / 1024}


def status_part(sizes: Sequence[int], per_job: int, seconds: float, folder: Path) -> list[str]:
    from status_endpoint import write_tls_folder

    from kubetrain.operator.trainer_status_endpoint import RateLimit

    folder.mkdir(parents=True, exist_ok=True)
    write_tls_folder(folder)
    limit = RateLimit()
    print(f"\n== status endpoint: own-code pods in jobs of {per_job}, each posting a report "
          f"every {REPORT_SECONDS:g} s over a new TLS connection ({per_job / REPORT_SECONDS:g} "
          f"a second per job, within the rate limit of {limit.per_second:g}, burst "
          f"{limit.burst}); the endpoint in a process of its own"
          f"\n   no goal in issue 53; the operator's leader serves it beside everything else",
          flush=True)
    print(f"{'pods':>6}{'jobs':>6}{'reports/s':>11}{'cores':>7}{'ms/report':>11}{'p50 ms':>8}"
          f"{'p99 ms':>8}{'accepted':>10}{'429':>6}{'failed':>8}{'peak MiB':>10}", flush=True)
    rows = []
    for pods in sizes:
        row = measure_status(pods, per_job, seconds, folder)
        rows.append(row)
        print(f"{pods:>6}{row['jobs']:>6}{pods / REPORT_SECONDS:>11.0f}{row['cores']:>7.2f}"
              f"{row['ms_per_report']:>11.2f}{row['p50_ms']:>8.1f}{row['p99_ms']:>8.1f}{row['accepted']:>10}"
              f"{row['refused']:>6}{row['failed']:>8}{row['peak_mib']:>10.0f}", flush=True)
    _print_ratios("pods", sizes, {
        "cores": [row["cores"] for row in rows],
        "ms per report": [row["ms_per_report"] for row in rows],
        "p50 ms": [row["p50_ms"] for row in rows],
        "p99 ms": [row["p99_ms"] for row in rows],
        "peak MiB": [row["peak_mib"] for row in rows]})
    return []


# --- main ---------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--parts", default="job,lifelines,rendezvous,status",
                        help="which curves to measure, comma-separated")
    parser.add_argument("--quick", action="store_true",
                        help="small sizes only: a smoke run of every part in about 2.5 minutes")
    parser.add_argument("--workers", help="job: workers of the one job (default "
                        "4,100,250,500,1000)")
    parser.add_argument("--processes", help="lifelines: trainer processes followed "
                        "(default 32,1024,2048,4096,8192; the first is the small job)")
    parser.add_argument("--procs-per-pod", type=int, default=8,
                        help="lifelines: trainer processes per pod (default 8: 8 GPUs a node)")
    parser.add_argument("--wire", choices=("pod", "per-process"), default="pod",
                        help="lifelines: one a pod, served by its agent (default), or one per "
                        "trainer process, as trainer images from before issue 53 serve them")
    parser.add_argument("--window", type=float, default=10.0,
                        help="lifelines: seconds over which CPU and loop lag are measured")
    parser.add_argument("--losses", type=int, default=3,
                        help="lifelines: pods that lose their node, one after another")
    parser.add_argument("--agents", help="rendezvous: agents (default 64,128,256,512,1024)")
    parser.add_argument("--round-timeout", type=float, default=120.0,
                        help="rendezvous: seconds after which a round is given up")
    parser.add_argument("--pods", help="status: reporting pods (default 125,250,500,1000)")
    parser.add_argument("--pods-per-job", type=int, default=8,
                        help="status: pods per own-code job (default 8)")
    parser.add_argument("--status-seconds", type=float, default=15.0,
                        help="status: seconds of reports measured")
    parser.add_argument("--serve-lifelines", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--serve-status", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_lifelines:
        serve_lifelines()
        return
    if args.serve_status:
        serve_status(Path(args.serve_status[0]), int(args.serve_status[1]))
        return
    _raise_file_limit()
    quick = args.quick
    workers = _sizes(args.workers or ("4,100" if quick else "4,100,250,500,1000"))
    processes = _sizes(args.processes or ("32,256" if quick else "32,1024,2048,4096,8192"))
    agents = _sizes(args.agents or ("8,64" if quick else "64,128,256,512,1024"))
    pods = _sizes(args.pods or ("40,125" if quick else "125,250,500,1000"))
    parts = [part.strip() for part in args.parts.split(",")]
    print(f"bench/scale.py on {os.cpu_count()} cores, load average "
          f"{', '.join(f'{x:.1f}' for x in os.getloadavg())} at the start", flush=True)
    verdicts: list[str] = []
    with tempfile.TemporaryDirectory(prefix="kubetrain-bench-scale-") as name:
        folder = Path(name)
        for part in parts:
            if part == "job":
                verdicts += job_part(workers, folder)
            elif part == "lifelines":
                verdicts += lifelines_part(processes, args.procs_per_pod, args.wire,
                                           args.window, args.losses, folder)
            elif part == "rendezvous":
                verdicts += rendezvous_part(agents, args.round_timeout)
            elif part == "status":
                verdicts += status_part(pods, args.pods_per_job, args.status_seconds,
                                        folder / "status")
            else:
                raise SystemExit(f"--parts: no part {part!r} (job, lifelines, rendezvous, "
                                 "status)")
    print(f"\n== goals (load average at the end "
          f"{', '.join(f'{x:.1f}' for x in os.getloadavg())})")
    for verdict in verdicts or ["no size reached a goal's size: nothing to judge"]:
        print(f"  {verdict}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    main()
