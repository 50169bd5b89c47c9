"""`python -m kubetrain.trainer.own_code JOB.yaml -- COMMAND...`: own code's container entry.

Runs in each worker pod of an own-code job (spec.trainer), around torchrun and the user's
command (kubetrain.operator.own_code_launch builds the line):
1. restores the newest committed checkpoint (checkpoint.uri, else checkpoint.resumeFrom)
   into KUBETRAIN_CHECKPOINT_DIR before COMMAND starts;
2. runs COMMAND, and beside it kubetrain.trainer.checkpoint_sync every few seconds;
3. passes SIGTERM and SIGINT through to COMMAND (torchrun gives them to the workers);
4. once COMMAND ends, syncs until its last marked checkpoint is committed (at most
   KUBETRAIN_FINAL_SYNC_SECONDS), warns about folders never marked complete, and exits
   with COMMAND's exit status (128 + N when a signal N ended it).
A failed restore exits 1 (retried by the job's restart policy) before anything starts.
A program that does not exist (the script, or a --no-python program on no PATH) exits 127
before anything starts, as a shell does: torchrun would end with 1 whatever its processes
exited with, and 127 is one of runPolicy.permanentExitCodes, so the job fails at once.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import FrameType

from kubetrain.api.manifest import InvalidManifest, load_job
from kubetrain.protocol import EXIT_INVALID_MANIFEST, SIGNAL_EXIT_BASE
from kubetrain.sdk.checkpoints import CHECKPOINT_DIR_ENV, DEFAULT_CHECKPOINT_DIR
from kubetrain.trainer.checkpoint_sync import CheckpointSync, restore
from kubetrain.trainer.storage import open_storage

log = logging.getLogger("kubetrain.own_code")

SYNC_INTERVAL_SECONDS = 10.0
DEFAULT_FINAL_SYNC_SECONDS = 90.0


def _arguments(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m kubetrain.trainer.own_code",
                                     description=(__doc__ or "").strip().splitlines()[0])
    parser.add_argument("job", help="the job's manifest (the ConfigMap's job.yaml)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ARGS...")
    parser.add_argument("--sync-interval", type=float, default=SYNC_INTERVAL_SECONDS)
    args = parser.parse_args(argv)
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
    remote = open_storage(spec.checkpoint.uri, spec.storage)
    fallback = (open_storage(spec.checkpoint.resume_from, spec.storage)
                if spec.checkpoint.resume_from else None)
    try:
        restored = restore(local_dir, remote, fallback)
    except Exception as error:  # storage unreachable, a commit naming a lost file
        log.error("could not restore the latest checkpoint from %s: %s", remote.uri, error)
        return 1
    if restored:
        log.info("restored %s", restored)
    else:
        log.info("no checkpoint to restore: starting fresh")

    child = subprocess.Popen(args.command)

    def forward(signum: int, frame: FrameType | None) -> None:
        child.send_signal(signum)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, forward)

    sync = CheckpointSync(local_dir, remote, spec.checkpoint.keep_last)
    stopping = threading.Event()

    def sync_alongside() -> None:
        while not stopping.wait(args.sync_interval):
            sync.sync_once()

    syncer = threading.Thread(target=sync_alongside, name="checkpoint-sync", daemon=True)
    syncer.start()
    status = child.wait()
    stopping.set()
    syncer.join()
    final_seconds = float(os.environ.get("KUBETRAIN_FINAL_SYNC_SECONDS",
                                         DEFAULT_FINAL_SYNC_SECONDS))
    report = sync.drain(time.monotonic() + final_seconds)
    for folder in report.unmarked:
        log.warning("checkpoint folder %s was never marked complete, so it was not uploaded: "
                    "call kubetrain.sdk.mark_complete(path, step) once it is written",
                    folder)
    if report.unmarked:  # the operator turns this line into a warning event on the job
        names = ",".join(Path(folder).name for folder in report.unmarked)
        try:
            Path(os.environ.get("KUBETRAIN_TERMINATION_LOG", "/dev/termination-log")).write_text(
                f'kubetrain_unmarked_checkpoints_info{{folders="{names}"}} '
                f"{len(report.unmarked)}\n")
        except OSError as error:
            log.warning("could not write the termination message: %s", error)
    for folder in report.waiting:
        log.warning("checkpoint %s was not committed within %.0f s: a pod's part is missing",
                    folder, final_seconds)
    return SIGNAL_EXIT_BASE - status if status < 0 else status


if __name__ == "__main__":
    sys.exit(main())
