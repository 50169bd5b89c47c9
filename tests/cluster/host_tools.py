"""What a test does when this machine lacks a tool or a facility it needs.

Outside CI it skips, saying how to get the tool. Under CI=true it fails: CI installs every
tool the suite uses (`make packages`, tests/install/debian-packages.sh), so a tool missing
there is a broken install step, which a skip would hide.
"""

from __future__ import annotations

import os
import shutil
from typing import NoReturn

import pytest

INSTALL = "make packages (tests/install/debian-packages.sh)"


def unavailable(reason: str) -> NoReturn:
    """Skip the test with `reason`, or fail it under CI=true."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI needs this: {reason}", pytrace=False)
    pytest.skip(reason)


def require_tool(command: str, package: str) -> str:
    """The path of `command`; without it, skip (fail under CI) naming its Debian package."""
    path = shutil.which(command)
    if path is None:
        unavailable(f"{command} is not installed: Debian's {package}, which {INSTALL} installs")
    return path
