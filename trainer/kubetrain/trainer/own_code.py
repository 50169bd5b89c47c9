"""`python -m kubetrain.trainer.own_code JOB.yaml -- COMMAND...`: own code's container entry.

Runs in each worker pod of an own-code job (spec.trainer), around torchrun and the user's
command (kubetrain.operator.own_code_container builds the line):
1. restores the newest committed checkpoint (checkpoint.uri, else checkpoint.resumeFrom)
   into KUBETRAIN_CHECKPOINT_DIR before COMMAND starts, side by side with the preflight
   and with loading torchrun's agent (`prepare`): all three are done before COMMAND starts,
   and the log's `ready` line says how long each took;
2. runs COMMAND, and beside it kubetrain.trainer.checkpoint_sync every
   KUBETRAIN_SYNC_SECONDS (10 s by default; `--sync-interval` wins);
3. passes SIGTERM and SIGINT through to COMMAND (torchrun gives them to the workers);
   a process that has saved and marked its stop checkpoint (a mark made after
   `sdk.stop_agreed()` said yes) has nothing left to do but exit: one still running
   LINGER_SECONDS after that mark is ended (SIGKILL), so that the pod lets go of its
   node within a step, a save and its upload, not after torchrun's shutdown timeout
   (TORCH_ELASTIC_SHUTDOWN_TIMEOUT, two thirds of the grace period) of waiting for a
   process that hangs in its own teardown;
   likewise, once every process of the pod has marked its finish (`sdk.mark_finished()`,
   its last call), those still running LINGER_SECONDS after the last mark are ended and
   the pod exits 0: torchrun's agent is stopped first (SIGTERM), so that it does not
   take the ended processes for failed ones and restart them;
4. once COMMAND ends, syncs until its last marked checkpoint is committed (at most
   KUBETRAIN_FINAL_SYNC_SECONDS), warns about folders never marked complete, and exits
   with COMMAND's exit status (128 + N when a signal N ended it).
A failed restore exits 1 (retried by the job's restart policy) before anything starts.
A program that does not exist (the script, or a --no-python program on no PATH) exits 127
before anything starts, as a shell does, and 127 is one of runPolicy.permanentExitCodes,
so the job fails at once.

When COMMAND is torchrun (`torchrun ...` or `python -m torch.distributed.run ...`, what the
operator and `kubetrain run` give), its agent runs in this process
(`torch.distributed.run.run`, torchrun's own code), because the torchrun program exits 1
whatever its processes exited with: the entry reads the failed processes' exit codes from
the agent's result and exits with the most telling one (a code other than 1 and signals
first, then the first to fail), so 2 and the other permanent codes reach the restart
policy. 87, 88, 89 and 90 (out of memory, collective timeout, failed preflight, GPU error)
are also written as the trainer's failure line into the termination message
(`kubetrain.trainer.metrics.record_failure`), which is where the operator and `kubetrain
run` read those classes. An uncaught exception is exit 1 (Unknown) whatever it was.

When runPolicy.preflight is enabled, the device stage of kubetrain's preflight
(`kubetrain.trainer.preflight`: a float32 matmul checked against float64) runs on each of
the pod's procsPerWorker devices before COMMAND starts: in a child process where the pod
sees a GPU, so that no device context stays in this one, else here on a thread (torch is
loaded here for torchrun's agent anyway, and a child would load it a second time); a
failure writes the PreflightFailed line naming this node and exits 89, and the operator
avoids the node. The group stage (an all-reduce, each rank's links) needs the process
group your code forms, and is the trainer's only.

torch is imported only where it is needed (the preflight, torchrun's agent, a failure
line), never by importing this module: the restore starts before torch has loaded.
"""

from __future__ import annotations

import argparse
import logging
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType
from typing import Any

from kubetrain.api.manifest import InvalidManifest, load_job
from kubetrain.api.trainingjob import PreflightPolicy, TrainingJob
from kubetrain.pod_conventions import FINAL_SYNC_SECONDS_ENV, POD_NAME_ENV, pod_name
from kubetrain.protocol import (
    EXIT_INVALID_MANIFEST,
    EXIT_PREFLIGHT_FAILED,
    EXIT_SIGNALLED,
    REPORT_RESUMED_STEP,
    SIGNAL_EXIT_BASE,
    TRAINER_EXIT_CODES,
    is_signal_exit,
    unmarked_checkpoints_line,
)
from kubetrain.sdk.checkpoints import (
    CHECKPOINT_DIR_ENV,
    DEFAULT_CHECKPOINT_DIR,
    Finished,
    Mark,
    complete_here,
    finished_marks,
    forget_finished,
    stop_marks,
)
from kubetrain.sdk.progress import SERVER_URL_ENV, post_status
from kubetrain.trainer.checkpoint_sync import CheckpointSync, restore
from kubetrain.trainer.lifeline import where_am_i
from kubetrain.trainer.rendezvous import arrive_at_exit_barrier, register_rendezvous
from kubetrain.trainer.storage import Storage, open_storage

log = logging.getLogger("kubetrain.own_code")
ENTRY_STARTED = time.monotonic()  # as the module loads: the `ready` line counts from here

SYNC_INTERVAL_SECONDS = 10.0
# How often marked folders are uploaded: a pod lost between two passes loses the folders
# marked since the last one, so a restart may redo the steps of one pass beyond the
# checkpoint interval (docs/own-code.md). A job sets it through trainer.env.
SYNC_SECONDS_ENV = "KUBETRAIN_SYNC_SECONDS"
DEFAULT_FINAL_SYNC_SECONDS = 90.0
# How long a process may run on after marking its stop checkpoint or its finish: for what
# user code does after its last save (closing a logger, flushing its output), not for
# training.
LINGER_SECONDS = 10.0
# Between stopping torchrun's agent and ending the lingering processes: the agent's main
# thread takes the signal at its next monitoring tick (0.1 s), and from then on stops its
# processes rather than restarting them.
AGENT_STOP_SECONDS = 1.0
LINGER_CHECK_SECONDS = 0.5


def _arguments(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m kubetrain.trainer.own_code",
                                     description=(__doc__ or "").strip().splitlines()[0])
    parser.add_argument("job", help="the job's manifest (the ConfigMap's job.yaml)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ARGS...")
    parser.add_argument("--sync-interval", type=float, default=None,
                        help=f"seconds between upload passes (default: ${SYNC_SECONDS_ENV}, "
                             f"else {SYNC_INTERVAL_SECONDS:g})")
    args = parser.parse_args(argv)
    if args.sync_interval is None:
        try:
            args.sync_interval = float(os.environ.get(SYNC_SECONDS_ENV) or SYNC_INTERVAL_SECONDS)
        except ValueError:
            parser.error(f"{SYNC_SECONDS_ENV} must be a number of seconds, got "
                         f"{os.environ[SYNC_SECONDS_ENV]!r}")
    if args.sync_interval <= 0:
        parser.error(f"the sync interval must be above 0 seconds, got {args.sync_interval:g}")
    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    if not args.command:
        parser.error("give the command to run after --")
    return args


EXIT_COMMAND_NOT_FOUND = 127  # as a shell's; in DEFAULT_PERMANENT_EXIT_CODES


def missing_program(torchrun_arguments: list[str]) -> str | None:
    """What torchrun would fail to start in every process, given what follows kubetrain's
    options on its command line (TrainerSpec.torchrun_arguments): the script (a path,
    relative to the working directory) or the --no-python program, when it does not
    exist; None when it does or cannot be told (a module: importing it to find out would
    run its package's code; the user's own torchrun options: skipped, not parsed)."""
    if not torchrun_arguments or torchrun_arguments[0] in ("-m", "--module"):
        return None
    if torchrun_arguments[0] == "--no-python":
        program = torchrun_arguments[1]
        return None if shutil.which(program) else program
    if torchrun_arguments[0].startswith("-"):
        return None
    script = torchrun_arguments[0]
    return None if Path(script).is_file() else script


def agent_arguments(command: list[str]) -> list[str] | None:
    """torchrun's own arguments when `command` runs torchrun (`torchrun ARGS` or
    `PYTHON -m torch.distributed.run ARGS`), else None: a command to run as it is."""
    if command and Path(command[0]).name == "torchrun":
        return command[1:]
    if command[1:3] == ["-m", "torch.distributed.run"]:
        return command[3:]
    return None


@dataclass(frozen=True)
class WorkerExit:
    """How one of torchrun's processes ended: its global rank and exit status (128 + N
    for signal N)."""

    rank: int
    exit_code: int
    timestamp: float = 0.0

    @property
    def telling(self) -> bool:
        """Whether the code says more than "failed": not 1 (any uncaught exception, or a
        peer's collective breaking under it) and not a signal (the agent stopping the rest)."""
        return self.exit_code != 1 and not is_signal_exit(self.exit_code)


def deciding_exit(exits: list[WorkerExit]) -> WorkerExit:
    """The process whose exit the pod exits with: a telling code before the others, then
    the first to fail, then the lowest rank."""
    return min(exits, key=lambda e: (not e.telling, e.timestamp, e.rank))


def run_torchrun(arguments: list[str]) -> tuple[int, list[WorkerExit]]:
    """torchrun's agent, here, on `arguments`: the exit status to pass on and every failed
    process's exit. torchrun's program would print the same and exit 1."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    register_rendezvous()  # in case the image's kubetrain is no installed distribution

    def stop(signum: int, frame: FrameType | None) -> None:
        # What the agent's own handler does once its processes run: until then (the
        # rendezvous), a SIGTERM ends the agent the same way.
        raise SignalException(f"signal {signum} before torchrun's processes started",
                              signal.Signals(signum))

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, stop)
    try:
        run(parse_args(arguments))
    except ChildFailedError as error:
        exits = [WorkerExit(rank, SIGNAL_EXIT_BASE - failure.exitcode if failure.exitcode < 0
                            else failure.exitcode, failure.timestamp)
                 for rank, failure in error.failures.items()]
        for worker in exits:
            log.error("rank %d exited with code %d", worker.rank, worker.exit_code)
        return deciding_exit(exits).exit_code, exits
    except SignalException as error:
        log.info("stopped by %s: torchrun's processes were given it", error.sigval.name)
        return SIGNAL_EXIT_BASE + int(error.sigval), []
    except Exception as error:  # the rendezvous timed out or closed, a bad option
        log.error("torchrun's agent failed: %s: %s", type(error).__name__, error)
        return 1, []
    finally:
        # The agent's handlers raise; from here on a signal must not cut the last upload.
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, _uploading)
    return 0, []


def _uploading(signum: int, frame: FrameType | None) -> None:
    log.info("signal %d: the command has ended, the last checkpoint is uploading", signum)


def _check_devices(policy: PreflightPolicy, count: int, answer: Any) -> None:
    """The preflight's device stage on each of `count` local devices; the verdict goes to
    `answer` (a queue): ("", []) or why and the nodes at fault."""
    import torch

    from kubetrain.trainer.preflight import Preflight, PreflightFailed

    devices = ([torch.device("cuda", index) for index in range(count)]
               if torch.cuda.is_available() else [torch.device("cpu")])
    try:
        for device in devices:
            Preflight(policy, rank=0, world_size=1, device=device, store=None).check_device()
    except PreflightFailed as error:
        answer.put((str(error), error.nodes))
        return
    answer.put(("", []))


def gpu_visible() -> bool:
    """Whether this pod sees a GPU device (NVIDIA's or AMD's device files): only then can a
    device check leave a device context behind in the process that runs it."""
    dev = Path("/dev")
    return any(dev.glob("nvidia[0-9]*")) or (dev / "kfd").exists()


def start_preflight(policy: PreflightPolicy, devices: int, in_child: bool
                    ) -> Callable[[], tuple[str, list[str]]]:
    """Start the device stage of kubetrain's preflight on this pod's `devices`, in a child
    process or on a thread here (while no other thread imports torch: torch's import is not
    thread-safe); the returned call waits for it, within the policy's timeout: ("", [])
    when it passed, else why and the node at fault."""
    import multiprocessing

    answer: Any
    if in_child:
        context = multiprocessing.get_context("spawn")
        answer = context.Queue()
        check: Any = context.Process(target=_check_devices, args=(policy, devices, answer),
                                     name="preflight", daemon=True)
    else:
        answer = queue.Queue()
        check = threading.Thread(target=_check_devices, args=(policy, devices, answer),
                                 name="preflight", daemon=True)
    check.start()
    deadline = time.monotonic() + policy.timeout_seconds

    def verdict() -> tuple[str, list[str]]:
        check.join(max(0.0, deadline - time.monotonic()))
        node = where_am_i()[1]
        if check.is_alive():
            if in_child:  # (a thread cannot be stopped: it is left behind, the entry exits)
                check.kill()
                check.join()
            return (f"preflight failed: the devices of node {node} did not finish a matmul "
                    f"within {policy.timeout_seconds}s"), [node]
        try:
            problem, nodes = answer.get(timeout=1.0)
        except Exception:  # queue.Empty: the check died before it answered
            how = f"died with exit code {check.exitcode}" if in_child else "raised"
            return f"preflight failed: the check on node {node} {how}", [node]
        return str(problem), list(nodes)

    return verdict


class Beside:
    """`call()` on a daemon thread: `result()` waits for its return value or raises its
    error. A daemon, so an entry that gives up (a failed preflight) does not wait for it."""

    def __init__(self, call: Callable[[], Any], name: str) -> None:
        self._outcome: list[Any] = []
        self.seconds = 0.0

        def run() -> None:
            started = time.monotonic()
            try:
                self._outcome.append((call(), None))
            except BaseException as error:  # re-raised by result()
                self._outcome.append((None, error))
            self.seconds = time.monotonic() - started

        self._thread = threading.Thread(target=run, name=name, daemon=True)
        self._thread.start()

    def result(self) -> Any:
        """What the call returned (its error is raised here), once it has."""
        self._thread.join()
        value, error = self._outcome[0]
        if error is not None:
            raise error
        return value


@dataclass
class Prepared:
    """What `prepare` did before COMMAND starts: the exit status to stop with (None: go
    on), the folder restored, and each stage's seconds (they ran side by side)."""

    exit_code: int | None
    restored: Path | None = None
    seconds: dict[str, float] | None = None


def prepare(job: TrainingJob, command: list[str], local_dir: Path, remote: Storage,
            fallback: Storage | None) -> Prepared:
    """Everything before COMMAND starts, side by side: the restore of the newest committed
    checkpoint (I/O, on a thread, torch-free) beside the import of torchrun's agent and the
    preflight's device stage (in a child process started first where a GPU is visible, else
    on a thread once torch has loaded here). COMMAND starts only once all are done: a
    preflight that failed exits 89 (the restore is left behind), a restore that failed
    exits 1."""
    spec = job.spec
    started = time.monotonic()
    seconds: dict[str, float] = {}
    restoring = Beside(lambda: restore(local_dir, remote, fallback), "restore")
    policy, devices = spec.run_policy.preflight, spec.workers.procs_per_worker
    in_child = gpu_visible()
    checking = start_preflight(policy, devices, True) if policy.enabled and in_child else None
    if agent_arguments(command) is not None:
        import torch.distributed.run  # noqa: F401  (what run_torchrun needs, loaded meanwhile)

        seconds["torchrun import"] = time.monotonic() - started
    if policy.enabled and not in_child:
        checking = start_preflight(policy, devices, False)
    if checking is not None:
        problem, nodes = checking()
        seconds["preflight"] = time.monotonic() - started
        if problem:
            log.error("%s (exit %d)", problem, EXIT_PREFLIGHT_FAILED)
            _record_failure("PreflightFailed", problem, job.micro_batch_size, nodes=nodes)
            return Prepared(EXIT_PREFLIGHT_FAILED)
        log.info("preflight: %d device(s) passed", spec.workers.procs_per_worker)
    try:
        restored = restoring.result()
    except Exception as error:  # storage unreachable, a commit naming a lost file
        log.error("could not restore the latest checkpoint from %s: %s", remote.uri, error)
        return Prepared(1)
    seconds["restore"] = restoring.seconds
    if restored:
        log.info("restored %s", restored)
        step = complete_here(restored)
        if step is not None and report_resumed(job, step):
            log.info("reported the resume from step %d to the job's status", step)
    else:
        log.info("no checkpoint to restore: starting fresh")
    log.info("ready to start the command %.2f s after the entry began (side by side: %s)",
             time.monotonic() - ENTRY_STARTED,
             ", ".join(f"{stage} {value:.2f} s" for stage, value in seconds.items()))
    return Prepared(None, restored, seconds)


def report_resumed(job: TrainingJob, step: int) -> bool:
    """Tell the status endpoint that this attempt resumes from the checkpoint of `step`
    (worker 0's entry only, or the one entry of a run with no pod name), so that the
    operator counts the steps the attempt redoes exactly; whether it was taken."""
    url = os.environ.get(SERVER_URL_ENV)
    pod = os.environ.get(POD_NAME_ENV)
    if not url or (pod is not None and pod != pod_name(job.metadata.name, 0)):
        return False
    return post_status(url, {"trainerStatus": {
        "lastUpdatedTime": datetime.now(UTC).isoformat(),
        "metrics": [{"name": REPORT_RESUMED_STEP, "value": str(step)}]}})


def _record_failure(failure_class: str, message: str, micro_batch_size: int,
                    nodes: list[str] | None = None) -> None:
    from kubetrain.trainer.metrics import record_failure

    record_failure(failure_class, message, micro_batch_size, nodes=nodes or ())


def end_lingering(local_dir: Path, now: float, ended: set[Mark],
                  linger_seconds: float = LINGER_SECONDS) -> list[Mark]:
    """End (SIGKILL) each process that marked its stop checkpoint in `local_dir` more than
    `linger_seconds` before `now` (time.time()) and still runs; the marks of those ended,
    which `ended` collects so that none is ended twice."""
    killed = []
    for mark in stop_marks(local_dir):
        process = mark.process
        if (mark in ended or process is None or now - mark.time < linger_seconds
                or not process.alive()):
            continue
        log.warning("rank %d (pid %d) marked its stop checkpoint (step %d) %.0f s ago and "
                    "has not exited: ending it, as it has nothing left to save", mark.rank,
                    process.pid, mark.step, now - mark.time)
        try:
            os.kill(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
        ended.add(mark)
        killed.append(mark)
    return killed


def lingering_after_finish(marks: list[Finished], now: float,
                           linger_seconds: float = LINGER_SECONDS) -> list[Finished]:
    """The processes to end because the pod's work is done: once every process of the
    latest attempt (local ranks 0 to LOCAL_WORLD_SIZE - 1) has marked its finish, those
    still running `linger_seconds` after the last mark (time.time() `now`); else none."""
    if not marks:
        return []
    attempt = max(mark.attempt for mark in marks)
    latest = [mark for mark in marks if mark.attempt == attempt]
    if {mark.local_rank for mark in latest} != set(range(latest[0].local_world_size)):
        return []
    if now - max(mark.time for mark in latest) < linger_seconds:
        return []
    return [mark for mark in latest if mark.process is not None and mark.process.alive()]


def end_finished(lingering: list[Finished]) -> None:
    """End the processes that linger after the pod's finish: first torchrun's agent, here
    (SIGTERM: it stops its processes instead of restarting them as failed), then them.
    The agent is counted in torchrun's exit barrier first, as if its processes had exited:
    the other pods' agents, whose processes did, wait there for it, worker 0's among them."""
    log.warning("every process of this pod marked its finish (sdk.mark_finished), and "
                "rank(s) %s still run %.0f s later: ending them; the pod exits 0",
                ", ".join(str(mark.rank) for mark in lingering), LINGER_SECONDS)
    arrive_at_exit_barrier()
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(AGENT_STOP_SECONDS)
    for mark in lingering:
        if mark.process is not None and mark.process.alive():
            try:
                os.kill(mark.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                continue


def write_failure(exit_code: int, micro_batch_size: int) -> None:
    """The trainer's failure line for a code that names a class only the code can see."""
    failure_class = next((name for name, code in TRAINER_EXIT_CODES.items()
                          if code == exit_code), None)
    if failure_class is not None:
        _record_failure(failure_class, f"a process of the command exited with {exit_code}",
                        micro_batch_size)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="kubetrain: %(message)s")
    args = _arguments(sys.argv[1:] if argv is None else argv)
    try:
        job = load_job(args.job)
    except (InvalidManifest, OSError) as error:
        log.error("%s", error)
        return EXIT_INVALID_MANIFEST
    spec = job.spec
    missing = (missing_program(spec.trainer.torchrun_arguments())
               if spec.trainer is not None else None)
    if missing is not None:
        log.error("%s: no such file or program: check spec.trainer.command (exit %d: the "
                  "job is not retried)", missing, EXIT_COMMAND_NOT_FOUND)
        return EXIT_COMMAND_NOT_FOUND
    local_dir = Path(os.environ.get(CHECKPOINT_DIR_ENV) or DEFAULT_CHECKPOINT_DIR)
    local_dir.mkdir(parents=True, exist_ok=True)
    forget_finished(local_dir)  # a container restarted in its pod: its processes are new
    remote = open_storage(spec.checkpoint.uri, spec.storage)
    fallback = (open_storage(spec.checkpoint.resume_from, spec.storage)
                if spec.checkpoint.resume_from else None)
    prepared = prepare(job, args.command, local_dir, remote, fallback)
    if prepared.exit_code is not None:
        return prepared.exit_code

    sync = CheckpointSync(local_dir, remote, spec.checkpoint.keep_last)
    stopping = threading.Event()

    def sync_alongside() -> None:
        while not stopping.wait(args.sync_interval):
            sync.sync_once()

    ended: set[Mark] = set()
    finished = threading.Event()

    def end_lingering_alongside() -> None:
        while not stopping.wait(LINGER_CHECK_SECONDS):
            end_lingering(local_dir, time.time(), ended)
            if not finished.is_set():
                lingering = lingering_after_finish(finished_marks(local_dir), time.time())
                if lingering:
                    finished.set()
                    end_finished(lingering)

    syncer = threading.Thread(target=sync_alongside, name="checkpoint-sync", daemon=True)
    linger = threading.Thread(target=end_lingering_alongside, name="linger", daemon=True)
    syncer.start()
    linger.start()
    status = _run(args.command)
    stopping.set()
    syncer.join()
    linger.join()
    if finished.is_set() and (status == 0 or is_signal_exit(status)):
        # Every process had finished its work; the signals were the entry's own.
        status = 0
    elif ended and status == SIGNAL_EXIT_BASE + signal.SIGKILL:
        # The command's own end, not a kill from outside: it had saved and marked its stop.
        status = EXIT_SIGNALLED
    final_seconds = float(os.environ.get(FINAL_SYNC_SECONDS_ENV,
                                         DEFAULT_FINAL_SYNC_SECONDS))
    report = sync.drain(time.monotonic() + final_seconds)
    for folder in report.unmarked:
        log.warning("checkpoint folder %s was never marked complete, so it was not uploaded: "
                    "call kubetrain.sdk.mark_complete(path, step) once it is written",
                    folder)
    if report.unmarked:  # the operator turns this line into a warning event on the job
        from kubetrain.trainer.metrics import termination_log

        names = [Path(folder).name for folder in report.unmarked]
        try:
            termination_log().write_text(unmarked_checkpoints_line(names) + "\n")
        except OSError as error:
            log.warning("could not write the termination message: %s", error)
    for folder in report.waiting:
        log.warning("checkpoint %s was not committed within %.0f s: a pod's part is missing",
                    folder, final_seconds)
    write_failure(status, job.micro_batch_size)  # first, ahead of the line above
    return status


def _run(command: list[str]) -> int:
    """COMMAND's exit status: torchrun's agent in this process, anything else as a child
    with SIGTERM and SIGINT passed through."""
    arguments = agent_arguments(command)
    if arguments is not None:
        return run_torchrun(arguments)[0]
    child = subprocess.Popen(command)

    def forward(signum: int, frame: FrameType | None) -> None:
        child.send_signal(signum)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, forward)
    status = child.wait()
    return SIGNAL_EXIT_BASE - status if status < 0 else status


if __name__ == "__main__":
    sys.exit(main())
