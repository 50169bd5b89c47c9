"""The `kubetrain` command line: one subcommand per module, imported only when invoked.

Each subcommand lives in the module that owns its work and exposes
`add_arguments(parser)` and `run(args) -> int`; the module's docstring is the
command's long help. Only the invoked command's module is imported, so
`kubetrain validate` or `kubetrain operator` never loads torch.

The base install is torch-free; a command that needs an extra
(`pip install 'kubetrain[trainer]'`) checks for it first and names it when it is
missing, instead of failing with an ImportError deep inside the command.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from collections.abc import Sequence
from typing import NamedTuple


class Command(NamedTuple):
    module: str
    summary: str
    extra: str | None = None  # the optional dependencies (pyproject.toml) the command needs


# The top-level modules each extra installs, as the code imports them; a test checks
# them against pyproject.toml's extras.
EXTRA_MODULES: dict[str, tuple[str, ...]] = {
    "operator": ("kopf", "kubernetes", "prometheus_client", "aiohttp", "cryptography"),
    "trainer": ("torch", "boto3", "tokenizers", "safetensors", "tqdm", "numpy", "blake3",
                "prometheus_client"),
    "report": ("plotly",),
    "cluster": ("kubernetes",),
    "own-code": ("boto3", "blake3"),
}

COMMANDS: dict[str, Command] = {
    "run": Command("kubetrain.run", "run a TrainingJob on this machine", "trainer"),
    "validate": Command("kubetrain.validate", "check TrainingJob manifests"),
    "prepare": Command("kubetrain.trainer.prepare", "turn a text corpus into training shards",
                       "trainer"),
    "estimate": Command("kubetrain.trainer.estimate", "estimate a job's memory per GPU"),
    "generate": Command("kubetrain.trainer.generate", "sample text from a checkpoint", "trainer"),
    "report": Command("kubetrain.local.report", "write a run's charts as one HTML page",
                      "report"),
    "logs": Command("kubetrain.logs", "print a job's worker logs, across restarts", "cluster"),
    "operator": Command("kubetrain.operator.command", "run the Kubernetes operator", "operator"),
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


def _importable(module: str) -> bool:
    """Whether `import module` would find it, found without importing it (torch is slow)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ValueError:  # sys.modules[module] is None: `import` refuses it as well
        return False


def missing_modules(extra: str) -> list[str]:
    """The modules of an extra that this environment cannot import."""
    return [module for module in EXTRA_MODULES[extra] if not _importable(module)]


def missing_extra_message(name: str) -> str | None:
    """What to install before `kubetrain NAME` can run, or None when nothing is missing."""
    extra = COMMANDS[name].extra
    missing = missing_modules(extra) if extra else []
    if not missing:
        return None
    return (f"kubetrain {name} needs the {extra} extra, which is not installed here "
            f"(missing: {', '.join(missing)}). Install it with:\n"
            f"  pip install 'kubetrain[{extra}]'")


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
    if message := missing_extra_message(top.command):
        print(message, file=sys.stderr)
        return 1
    parser, module = command_parser(top.command)
    args = parser.parse_args(top.arguments)
    try:
        return int(module.run(args) or 0)  # type: ignore[attr-defined]
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
