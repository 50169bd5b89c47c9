"""The `kubetrain` command line: one subcommand per module, imported only when invoked.

Each subcommand lives in the module that owns its work and exposes
`add_arguments(parser)` and `run(args) -> int`; the module's docstring is the
command's long help. Only the invoked command's module is imported, so
`kubetrain validate` or `kubetrain operator` never loads torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import NamedTuple


class Command(NamedTuple):
    module: str
    summary: str


COMMANDS: dict[str, Command] = {
    "run": Command("kubetrain.local.command", "run a TrainingJob on this machine"),
    "validate": Command("kubetrain.validate", "check TrainingJob manifests"),
    "prepare": Command("kubetrain.trainer.prepare", "turn a text corpus into training shards"),
    "estimate": Command("kubetrain.trainer.estimate", "estimate a job's memory per GPU"),
    "generate": Command("kubetrain.trainer.generate", "sample text from a checkpoint"),
    "operator": Command("kubetrain.operator.command", "run the Kubernetes operator"),
    "crd": Command("kubetrain.api.crd", "print the TrainingJob CustomResourceDefinition"),
    "version": Command("kubetrain.version", "print the kubetrain version"),
}


def _top_level_parser() -> argparse.ArgumentParser:
    listing = "\n".join(f"  {name:<10} {command.summary}" for name, command in COMMANDS.items())
    parser = argparse.ArgumentParser(
        prog="kubetrain",
        description="Train large models on Kubernetes: the TrainingJob operator, the trainer "
        "and a local runner for the same manifests.",
        epilog=f"commands:\n{listing}\n\n`kubetrain COMMAND --help` describes each one.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("command", choices=COMMANDS, metavar="COMMAND")
    parser.add_argument("arguments", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return parser


def command_parser(name: str) -> tuple[argparse.ArgumentParser, object]:
    """The parser of one subcommand and its module."""
    module = importlib.import_module(COMMANDS[name].module)
    parser = argparse.ArgumentParser(
        prog=f"kubetrain {name}",
        description=(module.__doc__ or COMMANDS[name].summary).strip(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    module.add_arguments(parser)
    return parser, module


def main(argv: Sequence[str] | None = None) -> int:
    top = _top_level_parser().parse_args(argv)
    parser, module = command_parser(top.command)
    args = parser.parse_args(top.arguments)
    try:
        return int(module.run(args) or 0)  # type: ignore[attr-defined]
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
