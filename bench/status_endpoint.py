"""The status endpoint's cost to the operator: 500 jobs reporting every 5 s, over loopback.

The endpoint runs in a process of its own (the measured one), as it would in the operator,
and this process plays the jobs' rank 0s: each posts one report per round, the body
transformers' KubeflowCallback sends (progress, ETA, loss, learning rate, step, 7 metrics).
Rounds start --interval apart and the jobs' posts are spread evenly over each (jobs are not
in step); the endpoint's CPU over the rounds, per minute, is its CPU seconds per minute at
that rate. Two ways of connecting, as the two reporters do:
- keep-alive: one connection per job, reused (the kubeflow SDK's requests.Session);
- a connection per report: a TLS handshake each time (transformers' urllib).
The baseline, in the same run: an aiohttp HTTPS server with the same certificate and the
same timeouts that reads each body and answers 200 with no token, rate limit,
parsing or storing. The ratio is the endpoint's own logic priced against what serving
HTTPS costs anyway. Peak memory is the endpoint process's VmHWM with every job admitted
and reported, against the baseline's; the last row keeps idle connections open for
aiohttp's default 75 s instead of the endpoint's IDLE_SECONDS, which is why that is short.

    python bench/status_endpoint.py                 # --jobs 500 --rounds 3 --interval 5
"""

from __future__ import annotations

import argparse
import http.client
import json
import ssl
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import requests

from kubetrain.operator.trainer_status_endpoint import (
    HANDSHAKE_SECONDS,
    IDLE_SECONDS,
    SHUTDOWN_SECONDS,
    RateLimit,
    StatusEndpoint,
    StatusReports,
    job_token,
    status_path,
)
from kubetrain.operator.trainer_status_tls import CertificateAuthority, ServingCertificate

KEY = bytes(range(32))
NAMESPACE = "bench"


def _job(index: int) -> tuple[str, str]:
    return f"job-{index:04d}", f"uid-{index:04d}"


def _memory_kib() -> dict[str, int]:
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0])
    return fields


def write_tls_folder(folder: Path) -> None:
    """A new CA (`ca.crt`) and the serving certificate it signs for localhost (`tls.crt`,
    `tls.key`), as files in `folder` for the endpoint's process and its clients."""
    authority = CertificateAuthority.generate()
    serving = authority.issue(["localhost"], ["127.0.0.1"])
    (folder / "ca.crt").write_bytes(authority.cert_pem)
    (folder / "tls.key").touch(mode=0o600)
    (folder / "tls.key").write_bytes(serving.key_pem)
    (folder / "tls.crt").write_bytes(serving.cert_pem)


def serve(kind: str, folder: Path, jobs: int, idle_seconds: float) -> None:
    """The measured process: serve until stdin closes; answer `usage` with CPU and memory."""
    import asyncio
    import threading

    from aiohttp import web

    serving = ServingCertificate((folder / "tls.crt").read_bytes(),
                                 (folder / "tls.key").read_bytes())
    if kind == "kubetrain":
        # Rate limit off: rounds run back to back here, 12 times faster than reports come.
        reports = StatusReports(KEY, RateLimit(per_second=1e9, burst=10**9))
        for index in range(jobs):
            reports.admit(NAMESPACE, *_job(index))
        endpoint = StatusEndpoint(reports, serving.server_context(), host="127.0.0.1", port=0,
                                  idle_seconds=idle_seconds)
        endpoint.start()
        port = endpoint.port
    else:
        started = threading.Event()
        bound: list[int] = []

        async def answer(request: web.Request) -> web.Response:
            return web.Response(body=await request.read(), content_type="application/json")

        async def run() -> None:
            app = web.Application(client_max_size=64 * 1024)
            app.router.add_post("/{tail:.*}", answer)
            runner = web.AppRunner(app, access_log=None, handle_signals=False,
                                   keepalive_timeout=idle_seconds)
            await runner.setup()
            assert runner.server is not None
            server = await asyncio.get_running_loop().create_server(
                runner.server, "127.0.0.1", 0, ssl=serving.server_context(),
                ssl_handshake_timeout=HANDSHAKE_SECONDS, ssl_shutdown_timeout=SHUTDOWN_SECONDS)
            bound.append(server.sockets[0].getsockname()[1])
            started.set()
            await asyncio.Event().wait()  # until the process exits

        thread = threading.Thread(target=lambda: asyncio.run(run()), daemon=True)
        thread.start()
        started.wait()
        port = bound[0]
    print(json.dumps({"port": port}), flush=True)
    for line in sys.stdin:
        if line.strip() == "usage":
            print(json.dumps({"cpu": time.process_time(), **_memory_kib()}), flush=True)
    if kind == "kubetrain":
        endpoint.stop()


class Server:
    """A measured endpoint process."""

    def __init__(self, kind: str, folder: Path, jobs: int, idle_seconds: float) -> None:
        self.process = subprocess.Popen(
            [sys.executable, __file__, "--serve", kind, "--folder", str(folder),
             "--jobs", str(jobs), "--server-idle", str(idle_seconds)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.process.stdout is not None
        self.port = json.loads(self.process.stdout.readline())["port"]

    def usage(self) -> dict[str, float]:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write("usage\n")
        self.process.stdin.flush()
        return dict(json.loads(self.process.stdout.readline()))

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait(timeout=30)


def _body(step: int) -> bytes:
    """What transformers' KubeflowCallback posts at a step's end."""
    metrics = {"loss": 2.3456 - step * 1e-4, "grad_norm": 1.2345, "learning_rate": 2.9e-4,
               "epoch": round(step / 1000, 2), "current_step": step, "total_steps": 10_000,
               "current_epoch": round(step / 1000, 2)}
    status = {"lastUpdatedTime": datetime.now(UTC).isoformat(),
              "progressPercentage": step // 100, "estimatedRemainingSeconds": 36_000 - step,
              "metrics": [{"name": name, "value": str(value)} for name, value in metrics.items()]}
    return json.dumps({"trainerStatus": status}).encode()


def _post(connection: http.client.HTTPSConnection, index: int, token: str, step: int) -> None:
    name, _ = _job(index)
    connection.request("POST", status_path(NAMESPACE, name), body=_body(step),
                       headers={"Authorization": f"Bearer {token}",
                                "Content-Type": "application/json"})
    response = connection.getresponse()
    response.read()
    if response.status != 200:
        raise RuntimeError(f"job {index}: HTTP {response.status}")


def measure(kind: str, keep_alive: bool, folder: Path, jobs: int, rounds: int,
            interval: float, server_idle: float) -> dict[str, Any]:
    """One endpoint under `rounds` rounds of one report per job: CPU per minute, memory."""
    context = ssl.create_default_context(cafile=str(folder / "ca.crt"))
    tokens = [job_token(KEY, NAMESPACE, *_job(index)) for index in range(jobs)]
    server = Server(kind, folder, jobs, server_idle)
    try:
        def connect() -> http.client.HTTPSConnection:
            return http.client.HTTPSConnection("127.0.0.1", server.port, context=context,
                                               timeout=30)

        sessions = [requests.Session() for _ in range(jobs)] if keep_alive else []
        walls = []
        initial = start = server.usage()
        # Round 0 warms up and is not counted.
        first = time.perf_counter()
        for step in range(rounds + 1):
            time.sleep(max(0.0, first + step * interval - time.perf_counter()))
            if step == 1:
                start = server.usage()
            began = time.perf_counter()
            for index, token in enumerate(tokens):
                time.sleep(max(0.0, began + index * interval / jobs - time.perf_counter()))
                if keep_alive:
                    # As the SDK posts: a Session, which reconnects once the server closed
                    # an idle connection.
                    name, _ = _job(index)
                    response = sessions[index].post(
                        f"https://127.0.0.1:{server.port}{status_path(NAMESPACE, name)}",
                        data=_body(step), headers={"Authorization": f"Bearer {token}",
                                                   "Content-Type": "application/json"},
                        verify=str(folder / "ca.crt"), timeout=30)
                    if response.status_code != 200:
                        raise RuntimeError(f"job {index}: HTTP {response.status_code}")
                else:
                    connection = connect()
                    _post(connection, index, token, step)
                    connection.close()
            if step:
                walls.append(time.perf_counter() - began)
        time.sleep(max(0.0, first + (rounds + 1) * interval - time.perf_counter()))
        end = server.usage()
        for session in sessions:
            session.close()
    finally:
        server.close()
    return {"cpu_per_minute": (end["cpu"] - start["cpu"]) / (rounds * interval) * 60,
            "cpu_per_report": (end["cpu"] - start["cpu"]) / (rounds * jobs),
            "wall_per_round": max(walls), "rss_start_mib": initial["VmRSS"] / 1024,
            "peak_mib": end["VmHWM"] / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=3, help="timed reports per job")
    parser.add_argument("--interval", type=float, default=5.0,
                        help="seconds between two reports of one job")
    parser.add_argument("--serve", choices=["kubetrain", "bare"], help=argparse.SUPPRESS)
    parser.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--server-idle", type=float, default=IDLE_SECONDS,
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.folder, args.jobs, args.server_idle)
        return

    with tempfile.TemporaryDirectory(prefix="kubetrain-bench-status-") as name:
        folder = Path(name)
        write_tls_folder(folder)
        print(f"{args.jobs} jobs, one report each every {args.interval:g} s "
              f"({args.jobs / args.interval:.0f} requests/s), {args.rounds} timed rounds per "
              f"row; loopback HTTPS, ECDSA P-256; idle connections closed after "
              f"{IDLE_SECONDS:g} s unless said")
        print(f"{'connections':<22}{'server':<24}{'CPU s/min':>10}{'ms/report':>11}"
              f"{'round wall':>12}{'peak MiB':>10}{'start MiB':>11}")
        results: dict[tuple[bool, str], dict[str, Any]] = {}
        rows = [(True, "bare", IDLE_SECONDS), (True, "kubetrain", IDLE_SECONDS),
                (False, "bare", IDLE_SECONDS), (False, "kubetrain", IDLE_SECONDS),
                (True, "kubetrain", 75.0)]
        for keep_alive, kind, server_idle in rows:
            result = measure(kind, keep_alive, folder, args.jobs, args.rounds, args.interval,
                             server_idle)
            label = "keep-alive (SDK)" if keep_alive else "one per report (HF)"
            server = kind if server_idle == IDLE_SECONDS else f"{kind}, kept {server_idle:g} s"
            results.setdefault((keep_alive, server), result)
            print(f"{label:<22}{server:<24}{result['cpu_per_minute']:>10.2f}"
                  f"{result['cpu_per_report'] * 1000:>11.3f}{result['wall_per_round']:>11.2f}s"
                  f"{result['peak_mib']:>10.1f}{result['rss_start_mib']:>11.1f}")
    print()
    for keep_alive, label in ((True, "keep-alive"), (False, "a connection per report")):
        ours, bare = results[keep_alive, "kubetrain"], results[keep_alive, "bare"]
        cpu_ratio = ours["cpu_per_minute"] / bare["cpu_per_minute"]
        print(f"{label}: endpoint CPU / bare HTTPS server {cpu_ratio:.2f}; peak memory "
              f"{ours['peak_mib']:.1f} MiB ({ours['peak_mib'] - ours['rss_start_mib']:+.1f} under "
              f"load), {ours['peak_mib'] / bare['peak_mib']:.2f}x the bare server's")
    kept = results[True, "kubetrain, kept 75 s"]
    print(f"idle connections kept 75 s: peak memory {kept['peak_mib']:.1f} MiB "
          f"({kept['peak_mib'] - kept['rss_start_mib']:+.1f} under load), CPU "
          f"{kept['cpu_per_minute']:.2f} s/min")


if __name__ == "__main__":
    main()
