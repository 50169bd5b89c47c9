"""The suite's budget report (tests/suite_budget.py) books each module's and each item's CPU
time: its tests' own process and the child processes they waited for."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

_HERE = Path(__file__).parent

# One module burns about half a second of CPU in a child process, the other sleeps (wall
# time, no CPU): the report must tell them apart.
_BUSY = '''
import subprocess, sys

def test_burns_cpu_in_a_child():
    subprocess.run([sys.executable, "-c",
                    "import time\\nend = time.process_time() + 0.5\\n"
                    "while time.process_time() < end: pass"], check=True)
'''
_IDLE = '''
import time

def test_sleeps():
    time.sleep(0.5)
'''


def test_the_report_books_a_modules_cpu_with_its_children(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(f'''
import sys
sys.path.insert(0, {str(_HERE)!r})

def pytest_configure(config):
    from suite_budget import SuiteBudget
    config.pluginmanager.register(SuiteBudget(config), "suite-budget")
''')
    pytester.makepyfile(test_busy=_BUSY, test_idle=_IDLE)
    result = pytester.runpytest_subprocess()
    result.assert_outcomes(passed=2)
    # The report's line names the busy module first; the cache keeps every module's figure
    # unrounded (the line prints whole seconds).
    line = next(line for line in result.outlines if line.startswith("CPU: "))
    assert line.partition("most: ")[2].startswith("test_busy.py "), line
    kept = json.loads((pytester.path / ".pytest_cache/v/kubetrain/suite-times").read_text())
    booked = kept["module_cpu_seconds"]
    assert booked["test_busy.py"] >= 0.45, booked
    assert booked["test_idle.py"] < 0.2, booked
    by_item = kept["item_cpu_seconds"]
    assert by_item["test_busy.py::test_burns_cpu_in_a_child"] >= 0.45, by_item
    assert by_item["test_idle.py::test_sleeps"] < 0.2, by_item
