"""`python -m kubetrain.trainer.launch [torchrun options] JOB.yaml [trainer options]`:
torchrun for kubetrain's trainer, whose restarts in place skip the imports.

torchrun starts each training process as a new interpreter, which imports torch and
the training loop again: about 2 s of a CPU core, in every restart of the group,
while the group waits. This launcher is torchrun itself (its options, its PET_*
variables, its elastic agent and rendezvous) with its start method `forkserver`:
each training process, in every attempt, is forked from a server that imported the
loop once, ready to train. The trainer runs as `python -m kubetrain.trainer JOB.yaml
[trainer options]` would.

torch is imported once per pod, not twice: the fork server is a fork of this process
made as soon as it has imported torch (multiprocessing would start it as a new
interpreter, importing torch again beside the agent: 1.8 s of a core, 30-40 % of a
small pod's start), and it imports the loop while the agent meets its peers. It never
initialises a device or starts a thread, so forking it is safe; its children are the
agent's workers as before (the agent signals and reaps them), a level further down the
process tree.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import multiprocessing.util
import os
import sys
import traceback
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO

from kubetrain.protocol import AGENT_PID_ENV

# The fork server imports this module before it forks anything (see kubetrain.trainer.preload).
PRELOAD = "kubetrain.trainer.preload"

_TRAINER = Path(__file__).with_name("__main__.py")


def prepare_environment(argv: Sequence[str]) -> None:
    """The environment the training processes need, set before torch loads: whatever the
    fork server has when it starts, every one of them inherits."""
    os.environ[AGENT_PID_ENV] = str(os.getpid())
    os.environ["PYTHONUNBUFFERED"] = "1"  # as torchrun's `python -u`: logs as they happen
    if _processes_per_node(argv) != "1":
        # torchrun sets this default later, in the agent only; OpenMP reads it as torch loads.
        os.environ.setdefault("OMP_NUM_THREADS", "1")


def start_fork_server() -> None:
    """Start multiprocessing's fork server as a fork of this process, which has imported
    torch and started no thread yet; it imports the loop (PRELOAD) on its own."""
    multiprocessing.set_forkserver_preload([PRELOAD])
    multiprocessing.resource_tracker.ensure_running()  # a new interpreter, as before
    for stream in (sys.stdout, sys.stderr):
        stream.flush()  # or the fork server's children would write it again
    with _forked_not_spawned():
        multiprocessing.forkserver.ensure_running()


@contextlib.contextmanager
def _forked_not_spawned() -> Iterator[None]:
    """multiprocessing starts its fork server with `util.spawnv_passfds(python, [python,
    ..., "-c", code], fds)`: a new interpreter that runs `code` with only `fds` open.
    Within this block the same `code` runs instead in a fork of this process, with only
    `fds` open; anything else multiprocessing starts here starts as before."""
    spawn = multiprocessing.util.spawnv_passfds

    def fork(path: Any, args: Sequence[Any], passfds: Sequence[int]) -> int:
        code = str(args[-1])
        if not code.startswith("from multiprocessing.forkserver import main"):
            return spawn(path, args, passfds)
        pid = os.fork()
        if pid == 0:
            multiprocessing.util.spawnv_passfds = spawn  # the fork's own children spawn
            _run_fork_server(code, passfds)
        return pid

    multiprocessing.util.spawnv_passfds = fork
    try:
        yield
    finally:
        multiprocessing.util.spawnv_passfds = spawn


def _run_fork_server(code: str, passfds: Sequence[int]) -> None:
    """In the fork: have what a new interpreter would (only `passfds` open, multiprocessing's
    own state fresh, output unbuffered as under `python -u`), run the server's `code`, and
    leave without this process's exit handlers."""
    status = 1
    try:
        keep = sorted({0, 1, 2, *passfds})
        for low, high in zip(keep, [*keep[1:], os.sysconf("SC_OPEN_MAX")], strict=True):
            os.closerange(low + 1, high)
        # Forked inside ForkServer.ensure_running, whose lock is held here: a training process
        # that starts a fork server of its own must find it free, as in a new interpreter.
        multiprocessing.forkserver.ForkServer.__init__(multiprocessing.forkserver._forkserver)
        multiprocessing.resource_tracker.ResourceTracker.__init__(
            multiprocessing.resource_tracker._resource_tracker)
        sys.stdout, sys.stderr = _unbuffered(sys.stdout, 1), _unbuffered(sys.stderr, 2)
        exec(code, {"__name__": "__mp_fork_server__"})  # multiprocessing's own code
        status = 0
    except SystemExit as end:  # the server's way out: every client has gone
        status = end.code if isinstance(end.code, int) else 0
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(status)


def _unbuffered(stream: TextIO | None, fd: int) -> TextIO | None:
    if stream is None:
        return None
    return io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), write_through=True,
                            encoding=getattr(stream, "encoding", None),
                            errors=getattr(stream, "errors", None))


def _processes_per_node(argv: Sequence[str]) -> str:
    """torchrun's --nproc-per-node as it will read it, without importing torch."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--nproc-per-node", "--nproc_per_node",
                        default=os.environ.get("PET_NPROC_PER_NODE", "1"))
    known, _ = parser.parse_known_args(argv)
    return str(known.nproc_per_node)


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    prepare_environment(argv)

    from torch.distributed.elastic.multiprocessing.errors import record
    from torch.distributed.run import parse_args, run

    from kubetrain.trainer.rendezvous import register_rendezvous

    start_fork_server()
    register_rendezvous()  # where kubetrain is on the path but not installed: no entry point
    args = parse_args(argv)
    # torchrun's --run-path runs the program in the training process's own interpreter:
    # the trainer's __main__, with the job and its options as the command line.
    args.training_script_args = [args.training_script, *args.training_script_args]
    args.training_script = str(_TRAINER)
    args.run_path, args.module, args.no_python = True, False, False
    args.start_method = "forkserver"
    format_tracebacks_without_dynamo()
    record(run)(args)


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


if __name__ == "__main__":
    main()
