"""kubetrain.sdk: torch-free import, report() over real HTTP, markers, the batch rule, SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from kubetrain import sdk
from kubetrain.sdk import checkpoints, progress


def test_importing_the_sdk_loads_neither_torch_nor_transformers() -> None:
    code = ("import sys, kubetrain.sdk; "
            "print(sorted(m for m in ('torch', 'transformers', 'boto3') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


class _Received:
    def __init__(self) -> None:
        self.requests: list[tuple[str, dict[str, str], dict[str, Any]]] = []
        self.refuse = 0  # answer this many of the next requests with 503


@pytest.fixture
def status_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[_Received]:
    """A real HTTP server standing in for the status endpoint, and the env pointing at it."""
    received = _Received()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            if received.refuse:
                received.refuse -= 1
                self.send_response(503)
                self.end_headers()
                return
            received.requests.append((self.path, dict(self.headers), json.loads(body)))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    # Polled every 50 ms, so the shutdown at the end waits that long, not 0.5 s.
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                              daemon=True)
    thread.start()
    token = tmp_path / "token"
    token.write_text("secret-token\n")
    monkeypatch.setenv(progress.SERVER_URL_ENV,
                       f"http://127.0.0.1:{server.server_address[1]}/status/job")
    monkeypatch.setenv(progress.TOKEN_ENV, str(token))
    monkeypatch.delenv("RANK", raising=False)
    try:
        yield received
    finally:
        server.shutdown()
        server.server_close()


def test_report_posts_kubeflow_trainer_status_that_the_operator_reads(
        status_server: _Received) -> None:
    from kubetrain.protocol import parse_report

    reporter = progress.Reporter(min_interval=0)
    assert reporter.report(10, total_steps=100, loss=2.5, tokens=40_960)
    assert reporter.report(20, total_steps=100, loss=2.25, tokens=81_920)
    (path, headers, first), (_, _, second) = status_server.requests
    assert path == "/status/job" and headers["Authorization"] == "Bearer secret-token"
    assert set(second) == {"trainerStatus"}
    status = second["trainerStatus"]
    assert status["progressPercentage"] == 20 and status["estimatedRemainingSeconds"] >= 0
    parsed = parse_report(json.dumps(second).encode(), datetime.now(UTC))
    assert parsed is not None
    assert (parsed.step, parsed.total_steps, parsed.loss) == (20, 100, 2.25)
    assert float(parsed.metrics["tokens_per_second"]) > 0
    assert "tokens_per_second" not in {m["name"] for m in first["trainerStatus"]["metrics"]}


def test_report_is_throttled_except_for_the_last_step(status_server: _Received) -> None:
    reporter = progress.Reporter(min_interval=3600)
    assert reporter.report(1, total_steps=3)
    assert not reporter.report(2, total_steps=3)  # within the interval
    assert reporter.report(3, total_steps=3)  # the last step always goes
    assert status_server.requests[-1][2]["trainerStatus"]["progressPercentage"] == 100


def test_a_report_after_a_failed_one_is_sent_at_once_and_arrives(
        status_server: _Received) -> None:
    reporter = progress.Reporter(min_interval=3600)
    status_server.refuse = 1
    assert not reporter.report(1, total_steps=10)  # refused: not counted as sent
    assert reporter.report(2, total_steps=10)  # within the interval, but the last one failed
    assert [r[2]["trainerStatus"]["metrics"][0] for r in status_server.requests] == [
        {"name": "current_step", "value": "2"}]
    assert not reporter.report(3, total_steps=10)  # a success: the interval applies again


def test_an_endpoint_that_keeps_failing_costs_one_post_per_interval_not_one_per_step(
        status_server: _Received) -> None:
    reporter = progress.Reporter(min_interval=3600)
    status_server.refuse = 10
    assert not reporter.report(1, total_steps=10)
    assert not reporter.report(2, total_steps=10)  # the retry, refused too
    assert not reporter.report(3, total_steps=10)  # not posted: within the interval
    assert status_server.refuse == 8 and status_server.requests == []


def test_report_sends_nothing_from_other_ranks_or_outside_a_cluster(
        status_server: _Received, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "3")
    assert not progress.Reporter(min_interval=0).report(1)
    monkeypatch.delenv("RANK")
    monkeypatch.delenv(progress.SERVER_URL_ENV)
    assert not sdk.report(1, total_steps=2, loss=1.0)
    assert status_server.requests == []


def test_report_survives_an_endpoint_that_is_gone(monkeypatch: pytest.MonkeyPatch) -> None:
    from kubetrain.local.launch import free_port

    monkeypatch.setenv(progress.SERVER_URL_ENV, f"http://127.0.0.1:{free_port()}/status")
    monkeypatch.delenv("RANK", raising=False)
    assert progress.Reporter(min_interval=0).report(1, total_steps=2) is False


def _as_rank(monkeypatch: pytest.MonkeyPatch, rank: int, world: int, local_world: int,
             group_rank: int, groups: int) -> None:
    for name, value in (("RANK", rank), ("WORLD_SIZE", world), ("LOCAL_WORLD_SIZE", local_world),
                        ("GROUP_RANK", group_rank), ("GROUP_WORLD_SIZE", groups)):
        monkeypatch.setenv(name, str(value))


def test_rank_zeros_folder_is_complete_once_rank_zero_marks_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(checkpoints.CHECKPOINT_DIR_ENV, str(tmp_path))
    older, newer, unmarked = (tmp_path / "step-10", tmp_path / "step-20", tmp_path / "step-30")
    for folder in (older, newer, unmarked):
        folder.mkdir()
    _as_rank(monkeypatch, 1, 4, 2, 0, 2)
    sdk.mark_complete(newer, 20)  # not rank 0: ignored
    assert checkpoints.ready_part(newer) is None
    _as_rank(monkeypatch, 0, 4, 2, 0, 2)
    sdk.mark_complete(older, 10)
    sdk.mark_complete(newer, 20)
    assert checkpoints.ready_part(newer) == checkpoints.Part(step=20, index=0, parts=1)
    assert sdk.latest_checkpoint() == newer  # the unmarked step-30 is not complete


def test_a_sharded_folder_is_this_pods_part_once_all_its_ranks_mark_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(checkpoints.CHECKPOINT_DIR_ENV, str(tmp_path))
    folder = tmp_path / "step-5"
    _as_rank(monkeypatch, 2, 4, 2, 1, 2)  # pod 1 of 2 holds ranks 2 and 3
    sdk.mark_complete(folder, 5, sharded=True)
    assert checkpoints.ready_part(folder) is None  # rank 3 has not marked yet
    _as_rank(monkeypatch, 3, 4, 2, 1, 2)
    sdk.mark_complete(folder, 5, sharded=True)
    assert checkpoints.ready_part(folder) == checkpoints.Part(step=5, index=1, parts=2)
    assert sdk.latest_checkpoint() is None  # half a checkpoint cannot be loaded here
    checkpoints.mark_restored(folder, 5)  # the sync completed it from the upload
    assert sdk.latest_checkpoint() == folder


@pytest.mark.parametrize(("yours", "restarts", "micro", "accumulation"), [
    (8, 0, 8, 2), (8, 1, 4, 4), (8, 2, 2, 8), (8, 3, 1, 16), (8, 9, 1, 16),
    (6, 1, 3, 4), (6, 2, 1, 12), (1, 3, 1, 2),
])
def test_out_of_memory_restarts_halve_the_scripts_micro_batch_keeping_the_global_batch(
        monkeypatch: pytest.MonkeyPatch, yours: int, restarts: int, micro: int,
        accumulation: int) -> None:
    monkeypatch.setenv("KUBETRAIN_OUT_OF_MEMORY_RESTARTS", str(restarts))
    assert sdk.micro_batch_size(yours) == micro
    assert sdk.gradient_accumulation_steps(2, yours) == accumulation
    assert micro * accumulation == yours * 2


_STOP_MARK_SCRIPT = """
import os, signal, sys, time
from pathlib import Path
from kubetrain import sdk
from kubetrain.sdk import checkpoints
root = Path(sys.argv[1])
sdk.stop_requested()
for step in (1, 2):
    if step == 2:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)
    if step == 2 and not sdk.stop_agreed():
        sys.exit(1)
    (root / f"step-{step}").mkdir()
    sdk.mark_complete(root / f"step-{step}", step, sharded=True)
sdk.mark_finished()  # the script's last call, as docs/own-code.md asks
"""


def test_a_mark_made_after_the_stop_was_agreed_is_a_stop_mark_naming_its_process(
        tmp_path: Path) -> None:
    child = subprocess.run([sys.executable, "-c", _STOP_MARK_SCRIPT, str(tmp_path)],
                           capture_output=True, text=True, timeout=60,
                           env={**os.environ, checkpoints.CHECKPOINT_DIR_ENV: str(tmp_path)})
    assert child.returncode == 0, child.stderr
    (periodic,) = checkpoints.marks(tmp_path / "step-1")
    (stop,) = checkpoints.marks(tmp_path / "step-2")
    assert not periodic.stop and stop.stop
    assert checkpoints.stop_marks(tmp_path) == [stop]
    assert stop.process is not None and stop.process == periodic.process
    assert not stop.process.alive()  # the child has exited: its pid names no process now
    this = checkpoints.ProcessIdentity.of(os.getpid())
    assert this is not None and this.alive()
    # Stopped, not finished: no finish mark, so the entry ends nothing as finished.
    assert checkpoints.finished_marks(tmp_path) == []


def test_a_process_that_was_not_stopped_marks_its_finish_naming_its_rank_attempt_and_process(
        tmp_path: Path) -> None:
    script = "from kubetrain import sdk\nsdk.stop_requested()\nsdk.mark_finished()\n"
    env = {**os.environ, checkpoints.CHECKPOINT_DIR_ENV: str(tmp_path), "RANK": "3",
           "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "4",
           "TORCHELASTIC_RESTART_COUNT": "2"}
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=60)
    (finished,) = checkpoints.finished_marks(tmp_path)
    assert (finished.rank, finished.local_rank, finished.local_world_size,
            finished.attempt) == (3, 1, 2, 2)
    assert finished.process is not None and not finished.process.alive()
    checkpoints.forget_finished(tmp_path)
    assert checkpoints.finished_marks(tmp_path) == []


_STOP_SCRIPT = """
import os, signal, sys, time
from kubetrain import sdk
assert not sdk.stop_requested()
print("ready", flush=True)
deadline = time.monotonic() + 30
while not sdk.stop_requested() and time.monotonic() < deadline:
    time.sleep(0.01)
sys.exit(143 if sdk.stop_requested() else 1)
"""


def test_sigterm_only_sets_the_flag_once_stop_requested_was_called() -> None:
    child = subprocess.Popen([sys.executable, "-c", _STOP_SCRIPT], stdout=subprocess.PIPE,
                             text=True)
    assert child.stdout is not None and child.stdout.readline().strip() == "ready"
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=30) == 143  # the loop saw the flag and exited by itself


_AGREE_SCRIPT = """
import os, signal, sys
import torch.distributed as dist
from kubetrain import sdk
dist.init_process_group("gloo")
sdk.stop_requested()
if dist.get_rank() == 1:
    os.kill(os.getpid(), signal.SIGTERM)  # only rank 1's pod is being drained
agreed = [sdk.stop_agreed() for _ in range(2)]
# One write, so the ranks' lines never interleave (print writes the newline apart).
os.write(1, f"rank {dist.get_rank()} agreed {agreed}\\n".encode())
dist.destroy_process_group()
"""


@pytest.mark.timeout(120)
def test_stop_agreed_gives_every_rank_the_signalled_ranks_answer(tmp_path: Path) -> None:
    from kubetrain.local.launch import free_port

    script = tmp_path / "agree.py"
    script.write_text(_AGREE_SCRIPT)
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", str(script)],
        capture_output=True, text=True, timeout=110, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert sorted(line for line in out.stdout.splitlines() if "agreed" in line) == [
        "rank 0 agreed [True, True]", "rank 1 agreed [True, True]"]
