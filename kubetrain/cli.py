"""The `kubetrain` command line: one subcommand per module.

Each subcommand lives in the module that owns its work and exposes
`add_arguments(parser)` and `run(args) -> int`; the module's docstring gives the
help text. Command modules import torch (and other heavy libraries) only inside
`run`, so `kubetrain --help` and the operator image never load it.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from types import ModuleType

COMMANDS: dict[str, str] = {
    "run": "kubetrain.local.command",
    "validate": "kubetrain.validate",
    "crd": "kubetrain.api.crd",
    "estimate": "kubetrain.trainer.estimate",
    "prepare": "kubetrain.trainer.prepare",
    "generate": "kubetrain.trainer.generate",
    "operator": "kubetrain.operator.command",
    "version": "kubetrain.version",
}


def _summary(module: ModuleType) -> str:
    return (module.__doc__ or "").strip().splitlines()[0].rstrip(".") if module.__doc__ else ""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kubetrain",
        description="Train large models on Kubernetes: the TrainingJob operator, the trainer "
        "and a local runner for the same manifests.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(module_name)
        summary = _summary(module)
        sub = commands.add_parser(
            name, help=summary, description=(module.__doc__ or "").strip(),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(sub)
        sub.set_defaults(handler=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
