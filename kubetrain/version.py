"""Print the kubetrain version."""

from __future__ import annotations

import argparse
from importlib.metadata import PackageNotFoundError, version


def package_version() -> str:
    """The installed distribution's version; the chart's image tags follow it."""
    try:
        return version("kubetrain")
    except PackageNotFoundError:
        return "0.0.0+unknown"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    del parser  # no options


def run(args: argparse.Namespace) -> int:
    print(f"kubetrain {package_version()}")
    return 0
