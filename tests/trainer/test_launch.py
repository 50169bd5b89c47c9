"""kubetrain.trainer.launch: torchrun whose training processes fork from a server that
imported the training loop once, so that a restart in place imports nothing."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kubetrain.local.node import descendants, rank_processes
from kubetrain.protocol import FORK_SERVER_NAME


def parent_of(pid: int) -> int:
    # Field 4 of /proc/PID/stat; the command name before it may hold spaces.
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def ranks_below(agent: int) -> dict[int, int]:
    """The training processes (named kt-rank-N) below torchrun agent `agent`: pid → parent."""
    found = {}
    for pid in rank_processes(descendants(agent)):
        with contextlib.suppress(OSError):
            found[pid] = parent_of(pid)
    return found


def launch_command(launcher: Any, job: Path, *options: str) -> list[str]:
    return [sys.executable, "-m", "kubetrain.trainer.launch", "--standalone",
            "--nproc-per-node=2", *options, str(job), "--metrics-log", str(launcher.log(job))]


@pytest.fixture
def short_temporary_folder() -> Iterator[Path]:
    """A temporary folder of a short path: the fork server's socket in it must fit AF_UNIX's
    108 bytes, which a folder under pytest's tmp_path can overflow (pytest-100/popen-gw2/...
    did in a clean clone's run, and the launcher could not bind it)."""
    with tempfile.TemporaryDirectory(prefix="kt-") as folder:
        yield Path(folder)


@pytest.mark.slow
def test_a_restart_in_place_forks_its_ranks_from_the_server_that_imported_the_loop(
    tiny_job: Any, launcher: Any, short_temporary_folder: Path,
) -> None:
    """kill -9 of one rank: torchrun restarts the group in place, and the new ranks are
    forked by the same server as the first ones (a fork of the agent, made once),
    resume from the checkpoint and finish; the agent exits 0 and leaves nothing of
    multiprocessing's (the fork server's socket) in the temporary folder."""
    job = tiny_job("warm", optimization={"maxSteps": 30, "microBatchSize": 8, "warmupSteps": 5},
                   checkpoint={"everySteps": 4, "export": False})
    temporary = short_temporary_folder
    agent = subprocess.Popen(launch_command(launcher, job, "--max-restarts=1"),
                             env={**launcher.env(), "TMPDIR": str(temporary)},
                             stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not any(e["step"] >= 8 for e in launcher.events(job, "step")):
            ended = agent.poll() is not None  # then what it printed says why
            assert not ended and time.monotonic() < deadline, (
                "training never began: " + (agent.communicate()[0][-4000:] if ended else ""))
            time.sleep(0.05)
        first = ranks_below(agent.pid)
        (server,) = set(first.values())
        assert server != agent.pid and parent_of(server) == agent.pid, "no fork server"
        # The server is a fork of the agent, made once it had imported torch, not a new
        # interpreter importing torch a second time: the agent's command line, its own name.
        assert Path(f"/proc/{server}/cmdline").read_bytes() == Path(
            f"/proc/{agent.pid}/cmdline").read_bytes()
        assert Path(f"/proc/{server}/comm").read_text().strip() == FORK_SERVER_NAME
        os.kill(max(first), signal.SIGKILL)
        second: dict[int, int] = {}
        while len(second) < 2:
            assert agent.poll() is None and time.monotonic() < deadline, "no restart in place"
            second = {pid: parent for pid, parent in ranks_below(agent.pid).items()
                      if pid not in first}
            time.sleep(0.02)
        output, _ = agent.communicate(timeout=150)
    finally:
        if agent.poll() is None:
            agent.kill()
    assert agent.returncode == 0, output[-4000:]
    # The agent logged the failure it saw first with its traceback, as torch formats it:
    # the killed rank's SIGKILL, or the error its peer raised in their broken collective
    # (which of the two the agent sees first is a race).
    assert ("ProcessExitedException: process 1 terminated with signal SIGKILL" in output
            or ("ProcessRaisedException" in output and "Traceback (most recent call last)"
                in output)), output[-4000:]

    assert set(second.values()) == {server}, "the second attempt's ranks came from elsewhere"
    resumed = launcher.events(job, "resumed")
    assert len(resumed) == 1 and resumed[0]["step"] >= 4
    assert launcher.events(job, "finished")[-1]["step"] == 30
    assert not list(temporary.glob("pymp-*")), list(temporary.iterdir())


def test_a_failure_no_restart_can_cure_ends_the_launcher_without_one(
    tiny_job: Any, launcher: Any, tmp_path: Path,
) -> None:
    """Rank 1 stopped at its start fails the preflight: rank 0 asks its agent to stop (the
    launcher, named by KUBETRAIN_AGENT_PID: its parent is the fork server), and the group
    is not restarted in place although 3 restarts are allowed."""
    deadline = 4
    job = tiny_job("stalled", optimization={"maxSteps": 6},
                   runPolicy={"preflight": {"timeoutSeconds": deadline}})
    termination_log = tmp_path / "termination-log"
    termination_log.write_text("")  # the kubelet creates it in a pod
    env = {**launcher.env(), "KUBETRAIN_TERMINATION_LOG": str(termination_log)}
    agent = subprocess.Popen(
        launch_command(launcher, job, "--max-restarts=3", "--shutdown-timeout=3"),
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    stopped = launcher.worker_pid(agent.pid, 1)
    os.kill(stopped, signal.SIGSTOP)
    try:
        output, _ = agent.communicate(timeout=deadline + 90)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(stopped, signal.SIGCONT)
        agent.kill()
    assert agent.returncode != 0
    assert output.count("PreflightFailed: preflight failed") == 1, output[-4000:]
    assert "Received 15 death signal" in output, output[-4000:]
    assert 'class="PreflightFailed"' in termination_log.read_text()


# kubetrain on the path but not installed (PYTHONPATH, an image that copies the source):
# no distribution, so no `torchrun.handlers` entry point names the kubetrain backend.
WITHOUT_ENTRY_POINT = """
import importlib.metadata, runpy
found = importlib.metadata.entry_points
importlib.metadata.entry_points = lambda **select: (
    () if select.get("group") == "torchrun.handlers" else found(**select))
runpy.run_module("kubetrain.trainer.launch", run_name="__main__", alter_sys=True)
"""


def test_the_launcher_registers_the_kubetrain_rendezvous_where_no_entry_point_does(
    tiny_job: Any, launcher: Any,
) -> None:
    job = tiny_job("path-only", optimization={"maxSteps": 3, "warmupSteps": 1})
    port = launcher.free_port()
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_ENTRY_POINT, "--nnodes=1", "--nproc-per-node=2",
         "--rdzv-backend=kubetrain", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=path-only",
         str(job), "--metrics-log", str(launcher.log(job))],
        env=launcher.env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert launcher.events(job, "finished")[-1]["step"] == 3


# The fork of the launcher fails as it becomes the fork server (multiprocessing's server
# loop raises in it: a Python whose private state the fork no longer matches).
FORK_SERVER_FAILS = """
import multiprocessing.forkserver, runpy
def fails(*args, **kwargs):
    raise RuntimeError("this fork server cannot serve")
multiprocessing.forkserver.main = fails
runpy.run_module("kubetrain.trainer.launch", run_name="__main__", alter_sys=True)
"""


def test_where_the_launchers_fork_server_fails_multiprocessings_own_serves_the_ranks(
    tiny_job: Any, launcher: Any,
) -> None:
    """The fork prints why it failed and exits; the agent finds it gone when it first starts
    a rank, and multiprocessing starts its own server (a new interpreter, which imports the
    loop itself): the training runs as before."""
    job = tiny_job("fallback", optimization={"maxSteps": 3, "warmupSteps": 1})
    done = subprocess.run(
        [sys.executable, "-c", FORK_SERVER_FAILS, *launch_command(launcher, job)[3:]],
        env=launcher.env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert "RuntimeError: this fork server cannot serve" in done.stderr, done.stderr[-4000:]
    assert launcher.events(job, "finished")[-1]["step"] == 3


# The agent's formatter against torch's own, on one record with a traceback: the same
# text, and torch._dynamo imported only by torch's.
SAME_TRACEBACK = """
import logging, sys
import torch.distributed.run
from kubetrain.trainer.launch import TracebackFirst, format_tracebacks_without_dynamo
format_tracebacks_without_dynamo()
[handler] = logging.getLogger("torch").handlers
assert isinstance(handler.formatter, TracebackFirst)
try:
    raise RuntimeError("a rank failed")
except RuntimeError:
    exc_info = sys.exc_info()
def record():
    made = logging.LogRecord("torch.distributed.elastic.multiprocessing.api", logging.ERROR,
                             "api.py", 836, "failed (exitcode: %s)", (1,), exc_info)
    made.created, made.msecs = 1e9, 0.0
    return made
ours = handler.formatter.format(record())
print("dynamo before torch's formatter:", "torch._dynamo" in sys.modules)
print("same text:", ours == handler.formatter.torch_formatter.format(record()))
print(ours)
"""


def test_the_agent_logs_a_traceback_as_torch_does_without_importing_the_compiler() -> None:
    done = subprocess.run([sys.executable, "-c", SAME_TRACEBACK], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "dynamo before torch's formatter: False" in done.stdout, done.stdout
    assert "same text: True" in done.stdout, done.stdout
    assert "RuntimeError: a rank failed" in done.stdout and "failed (exitcode: 1)" in done.stdout




# A process started the way the launcher starts its ranks (from the fork server forked off
# this one) prints a line without flushing it, then sleeps: the line must reach the pipe now.
PRINTS_THEN_SLEEPS = """
import multiprocessing, sys
from kubetrain.trainer import launch
launch.prepare_fork_server([])
launch.start_fork_server_from_here()
child = multiprocessing.get_context("forkserver").Process(
    target=exec, args=("import time; print('printed'); time.sleep(60)",))
child.start()
child.join()
"""


def test_the_fork_servers_children_print_each_line_as_it_happens() -> None:
    """The fork server is a fork of the launcher, whose output a pipe made block-buffered
    (PYTHONUNBUFFERED, which the launcher sets for its ranks, is read only as an interpreter
    starts): its children's lines still reach the pipe as they print them, as a pod's log
    needs, not in one block at their exit."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONUNBUFFERED"}
    started = subprocess.Popen([sys.executable, "-c", PRINTS_THEN_SLEEPS], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               start_new_session=True)
    try:
        assert started.stdout is not None
        ready, _, _ = select.select([started.stdout], [], [], 60)
        line = started.stdout.readline() if ready else b""
        assert started.poll() is None, started.communicate()[1][-3000:]
        assert line == b"printed\n"
    finally:
        os.killpg(started.pid, signal.SIGKILL)
        started.wait()
