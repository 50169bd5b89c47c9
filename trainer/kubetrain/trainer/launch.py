"""`python -m kubetrain.trainer.launch [torchrun options] JOB.yaml [trainer options]`:
torchrun for kubetrain's trainer, whose restarts in place skip the imports.

torchrun starts each training process as a new interpreter, which imports torch and
the training loop again: about 2 s of a CPU core, in every restart of the group,
while the group waits. This launcher is torchrun itself (its options, its PET_*
variables, its elastic agent and rendezvous) with its start method `forkserver`:
a fork server, forked from the agent once it has imported torch, imports the rest of
the loop while the agent meets its peers, and each training process, in every attempt,
is forked from it ready to train. The trainer runs as `python -m kubetrain.trainer
JOB.yaml [trainer options]` would.

The fork server never initialises a device or starts a thread, so forking it is
safe; its children are the agent's workers as before (the agent signals and
reaps them), a level further down the process tree. Torch-free until the fork
server runs. In a worker pod it also serves the pod's lifeline (kubetrain.trainer.lifeline)
while torchrun runs.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import io
import itertools
import logging
import multiprocessing
import multiprocessing.forkserver
import os
import socket
import sys
import traceback
from collections.abc import Sequence
from multiprocessing import connection, resource_tracker
from pathlib import Path
from typing import Any, NoReturn, cast

from kubetrain.protocol import AGENT_PID_ENV, FORK_SERVER_NAME
from kubetrain.trainer.collector import collector_paused
from kubetrain.trainer.lifeline import PodLifeline, in_a_pod

# The fork server imports this module before it forks anything (see kubetrain.trainer.preload).
PRELOAD = "kubetrain.trainer.preload"

_TRAINER = Path(__file__).with_name("__main__.py")


def prepare_fork_server(argv: Sequence[str]) -> None:
    """Set the environment the training processes need, before torch loads (OpenMP reads
    it then): whatever the fork server has when it starts, every one of them inherits."""
    os.environ[AGENT_PID_ENV] = str(os.getpid())
    os.environ["PYTHONUNBUFFERED"] = "1"  # as torchrun's `python -u`: logs as they happen
    if _processes_per_node(argv) != "1":
        # torchrun sets this default later, in the agent only; OpenMP reads it as torch loads.
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    # Where the fork server below has died, multiprocessing starts its own, which imports
    # the loop too.
    multiprocessing.set_forkserver_preload([PRELOAD])


def start_fork_server_from_here() -> None:
    """Fork this process, torch imported and no thread of its own started yet, into the
    fork server that multiprocessing's `forkserver` start method uses: it imports the rest
    of the loop, while the agent meets its peers, and forks every training process.

    multiprocessing's own fork server is a new interpreter, which imported torch a second
    time: 1.2-1.5 s of a core in every pod start (the agent's import and the server's ran
    side by side on two cores). Its state is set here as its `ensure_running` sets it (a
    listening socket, the pipe whose end tells the server that its clients are gone), and
    the server runs multiprocessing's own loop; only how it starts differs.
    """
    # Private to multiprocessing (typeshed leaves them out), as in ForkServer.ensure_running.
    server: Any = multiprocessing.forkserver._forkserver
    resource_tracker.ensure_running()
    address = cast(Any, connection).arbitrary_address("AF_UNIX")
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(address)
        os.chmod(address, 0o600)
        listener.listen()
        alive_r, alive_w = os.pipe()
        sys.stdout.flush()  # or the fork would write what is buffered again
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the fork server, until its clients are gone
            status = 1
            try:
                _become_fork_server(listener.fileno(), alive_r)
            except SystemExit:  # the server's way out: every client has gone
                status = 0
            except BaseException:  # the agent starts multiprocessing's own in its place
                traceback.print_exc()
            finally:
                os._exit(status)  # not this process's exit handlers: the agent's
        os.close(alive_r)
    server._forkserver_address = address
    server._forkserver_alive_fd = alive_w
    server._forkserver_pid = pid


def stop_fork_server() -> None:
    """Once the agent has ended, close the fork server's pipe and wait for it to end: it
    is reaped by the launcher that forked it, not adopted as an orphan, so a launch's CPU
    time (the server's and its training processes') is counted to the launch."""
    server: Any = multiprocessing.forkserver._forkserver
    # (Already reaped, or its socket already gone: nothing is left to stop, and the
    # agent's own error, if any, is what the launch ends with.)
    with contextlib.suppress(ChildProcessError, FileNotFoundError):
        server._stop()  # as multiprocessing stops its own (ForkServer._stop)


def _become_fork_server(listener: int, alive_r: int) -> None:
    """In the fork: what a new interpreter started by multiprocessing has (only `listener`
    and `alive_r` open besides the standard streams, multiprocessing's own state fresh,
    output unbuffered as under `python -u`), then multiprocessing's fork server."""
    keep = sorted({0, 1, 2, listener, alive_r})
    for low, high in itertools.pairwise([*keep, os.sysconf("SC_OPEN_MAX")]):
        os.closerange(low + 1, high)
    multiprocessing.forkserver.ForkServer.__init__(multiprocessing.forkserver._forkserver)
    resource_tracker.ResourceTracker.__init__(resource_tracker._resource_tracker)
    if sys.platform == "linux":
        Path("/proc/self/comm").write_text(FORK_SERVER_NAME)  # not the agent, in ps
    _unbuffered_output()
    multiprocessing.forkserver.main(listener, alive_r, [PRELOAD])


def _unbuffered_output() -> None:
    """stdout and stderr as `python -u` makes them (PYTHONUNBUFFERED, set for the training
    processes, is read only as an interpreter starts, and the fork server's was this one's)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        setattr(sys, name, io.TextIOWrapper(io.FileIO(stream.fileno(), "w", closefd=False),
                                            encoding=stream.encoding, errors=stream.errors,
                                            write_through=True))


def _processes_per_node(argv: Sequence[str]) -> str:
    """torchrun's --nproc-per-node as it will read it, without importing torch."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--nproc-per-node", "--nproc_per_node",
                        default=os.environ.get("PET_NPROC_PER_NODE", "1"))
    known, _ = parser.parse_known_args(argv)
    return str(known.nproc_per_node)


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    prepare_fork_server(argv)

    # torch's import, without the collector's passes (kubetrain.trainer.collector); the
    # fork server forked below inherits the frozen objects.
    with collector_paused():
        from torch.distributed.elastic.multiprocessing.errors import record
        from torch.distributed.run import parse_args, run

        from kubetrain.trainer.rendezvous import register_rendezvous

    start_fork_server_from_here()
    register_rendezvous()  # where kubetrain is on the path but not installed: no entry point
    args = parse_args(argv)
    lifeline = _pod_lifeline(args.training_script)
    # torchrun's --run-path runs the program in the training process's own interpreter:
    # the trainer's __main__, with the job and its options as the command line.
    args.training_script_args = [args.training_script, *args.training_script_args]
    args.training_script = str(_TRAINER)
    args.run_path, args.module, args.no_python = True, False, False
    args.start_method = "forkserver"
    format_tracebacks_without_dynamo()
    try:
        record(run)(args)
    finally:
        stop_fork_server()
        if lifeline is not None:
            lifeline.close()


def _pod_lifeline(job_file: str) -> PodLifeline | None:
    """In a worker pod, the pod's lifeline (kubetrain.trainer.lifeline), served from here
    for as long as torchrun runs: the agent outlives every trainer process."""
    if not in_a_pod():
        return None
    from kubetrain.api.manifest import InvalidManifest, load_job

    try:
        port = load_job(job_file).spec.metrics.port
    except (InvalidManifest, OSError):
        return None  # the trainer says what is wrong with it
    lifeline = PodLifeline.for_this_pod(port)
    return lifeline if lifeline is not None and lifeline.start() else None


class TracebackFirst(logging.Formatter):
    """torch's log formatter, handed records whose traceback is already text.

    torch's formatter imports torch._dynamo (1.6 s of a core, half the agent's start) to
    decide whether to render a record's exception, and torchrun's agent logs one when a
    training process fails: between the group's end and its restart in place. Rendered
    here first, the traceback is the text torch's formatter would have written, and the
    agent never imports the compiler.
    """

    def __init__(self, torch_formatter: logging.Formatter) -> None:
        super().__init__()
        self.torch_formatter = torch_formatter

    def format(self, record: logging.LogRecord) -> str:
        if record.exc_info is None:
            return self.torch_formatter.format(record)
        if not record.exc_text:
            record.exc_text = self.torch_formatter.formatException(record.exc_info)
        exc_info, record.exc_info = record.exc_info, None
        try:
            return self.torch_formatter.format(record)
        finally:
            record.exc_info = exc_info


def format_tracebacks_without_dynamo() -> None:
    """Put TracebackFirst in front of the formatter of every handler torch installed."""
    for name in ("torch", "torch.distributed"):
        for handler in logging.getLogger(name).handlers:
            if handler.formatter is not None and not isinstance(handler.formatter,
                                                                TracebackFirst):
                handler.setFormatter(TracebackFirst(handler.formatter))


def exit_without_teardown() -> NoReturn:
    """End the launcher once torchrun's agent has ended well, skipping the interpreter's
    teardown.

    By then every training process has ended and been reaped, the rendezvous is closed and
    the lifeline stopped: what is left is Python unloading torch, 0.9 s of a core on a
    2-core machine, which delays the pod's end (and whoever waits on it: a finished job's
    status, a suspend letting go of its pods) for nothing. The exit handlers still run
    (multiprocessing's removes the folder of the fork server's socket, which each launch
    left in /tmp before: a workstation's `kubetrain run`s, a pod's restarts), and the
    streams are flushed. A failure still ends the normal way, its traceback printed.
    """
    atexit._run_exitfuncs()  # logging's among them, which flushes its handlers
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
    exit_without_teardown()
