"""`python tests/forked_torchrun.py [torchrun options] SCRIPT [script arguments]`: torchrun
for the tests' own worker scripts, whose ranks fork from a process that imported torch
once, as kubetrain.trainer.launch's ranks fork for the trainer.

Plain torchrun starts each rank as a new interpreter that imports torch: about 3 s of a
core each, which on CI's two cores every other test waits for (a 4-rank launch pays it
five times, the agent's import included). This is torchrun itself (its options, elastic
agent and rendezvous; the script run as `python SCRIPT` runs it, its folder first on
sys.path) with the trainer launcher's fork server, which imports torch and the training
loop once per launch, whatever the number of ranks.

For tests whose claim is what the script computes over several ranks (meshes, losses,
checkpoint resharding). Tests of torchrun's own restarts, exits and rendezvous keep plain
`python -m torch.distributed.run`: there, how a rank starts is part of the claim.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from kubetrain.trainer import launch
from kubetrain.trainer.collector import collector_paused


def command(*arguments: str) -> list[str]:
    """The command line that launches `arguments` (torchrun's) through this module."""
    return [sys.executable, __file__, *arguments]


def main(argv: Sequence[str]) -> None:
    launch.prepare_fork_server(argv)
    with collector_paused():
        from torch.distributed.run import parse_args, run
    args = parse_args(list(argv))
    # As `python SCRIPT` has it, for the ranks forked from the server below.
    sys.path.insert(0, str(Path(args.training_script).resolve().parent))
    launch.start_fork_server_from_here()
    args.run_path, args.module, args.no_python = True, False, False
    args.start_method = "forkserver"
    launch.format_tracebacks_without_dynamo()
    try:
        run(args)
    finally:
        launch.stop_fork_server()


if __name__ == "__main__":
    main(sys.argv[1:])
    launch.exit_without_teardown()
