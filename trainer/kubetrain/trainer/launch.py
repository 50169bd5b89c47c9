"""`python -m kubetrain.trainer.launch [torchrun options] JOB.yaml [trainer options]`:
torchrun for kubetrain's trainer, whose restarts in place skip the imports.

torchrun starts each training process as a new interpreter, which imports torch and
the training loop again: about 2 s of a CPU core, in every restart of the group,
while the group waits. This launcher is torchrun itself (its options, its PET_*
variables, its elastic agent and rendezvous) with its start method `forkserver`:
a fork server imports the loop once, beside the agent's first rendezvous, and each
training process, in every attempt, is forked from it ready to train. The trainer
runs as `python -m kubetrain.trainer JOB.yaml [trainer options]` would.

The fork server never initialises a device or starts a thread, so forking it is
safe; its children are the agent's workers as before (the agent signals and
reaps them), a level further down the process tree.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import sys
from collections.abc import Sequence
from pathlib import Path

# The fork server imports this module before it forks anything (see kubetrain.trainer.preload).
PRELOAD = "kubetrain.trainer.preload"

# Set in each training process: the pid of the torchrun agent that started it, which
# is not its parent process here (kubetrain.trainer.distributed.stop_torchrun_agent).
AGENT_PID = "KUBETRAIN_AGENT_PID"

_TRAINER = Path(__file__).with_name("__main__.py")


def main(argv: Sequence[str] | None = None) -> None:
    from torch.distributed.run import determine_local_world_size, parse_args, run

    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    # torchrun's --run-path runs the program in the training process's own interpreter:
    # the trainer's __main__, with the job and its options as the command line.
    args.training_script_args = [args.training_script, *args.training_script_args]
    args.training_script = str(_TRAINER)
    args.run_path, args.module, args.no_python = True, False, False
    args.start_method = "forkserver"

    # Whatever the fork server has when it starts, every training process inherits.
    os.environ[AGENT_PID] = str(os.getpid())
    os.environ["PYTHONUNBUFFERED"] = "1"  # as torchrun's `python -u`: logs as they happen
    if determine_local_world_size(args.nproc_per_node) > 1:
        # torchrun's own default, which it sets later; OpenMP reads it as torch loads.
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    multiprocessing.set_forkserver_preload([PRELOAD])
    # Started now, its imports overlap the first rendezvous instead of following it.
    multiprocessing.forkserver.ensure_running()
    run(args)


if __name__ == "__main__":
    from torch.distributed.elastic.multiprocessing.errors import record

    record(main)()
