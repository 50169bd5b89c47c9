"""The suite's time budget: where a run's time went, and the ceiling CI holds it to.

`make test` must stay within 20 minutes from nothing on CI's 2 cores, pytest within 15
(issue 47). This plugin (registered by tests/conftest.py) prints, at the end of every run:

- pytest's own wall time, against `CEILING_SECONDS`;
- the ten slowest items (setup, call and teardown together) and the time of each module;
- the setup time of the shared fixtures (session and module scope: a whole-loop cluster,
  a trained teacher, a torchrun launch a module's tests read), which `--durations` books to
  whichever test happened to need them first;
- for each pytest-xdist worker, the time it was busy and the time it sat idle at the end,
  waiting for the other: the cost of a schedule that does not keep both busy;
- the CPU time each module used: its tests' process (every thread of it) and the child
  processes it started and waited for (torchrun launches, CLIs, pip). On CI's two cores
  the suite is CPU-bound, so a module's CPU, not its wall time, is what it costs the others.

Every item's, module's and fixture's time, and every item's and module's CPU, also go to
pytest's cache, under the key `TIMES_KEY` (`.pytest_cache/v/kubetrain/suite-times`), so the
next cut is chosen from the whole list, not the top of it (tests/install/from-nothing.sh
keeps it beside its log).

Under `CI=true` a run whose pytest took longer than `CEILING_SECONDS` fails, naming the
modules that took the most: a test that makes the suite slower has to take the time from
somewhere else, not from the budget.
"""

from __future__ import annotations

import os
import resource
import time
from collections import defaultdict
from typing import Any

import pytest

# pytest alone on CI's 2 cores (`CI=true make test` from a clean clone). The goal is 15
# minutes (900 s). The ceiling is set from CI's own record, not from the goal, since CI's
# machines differ more than any one change does (docs/contributing.md, "The suite's budget",
# has each run): since the suite runs on three workers its runs took 1,062 s to 1,805 s from
# start to end (about 900 s to 1,535 s of pytest, which is 85 % of a run), and the widest
# spread between two CI runs of nearly the same tests is 2.1x (7c88ff1's 3,044 s and
# e824b50's 1,461 s a session later). The fastest of these runs would take about 1,900 s of
# pytest on that slow a machine; the ceiling is 1.2x that: such a machine passes, and a
# change that doubles a typical run's pytest (900-1,535 s) on an ordinary machine crosses
# it. Lower it as the suite gets faster, keeping that margin.
CEILING_SECONDS = 2300
SLOWEST = 10
MODULES = 15
FIXTURES = 10
CPU_MODULES = 5
TIMES_KEY = "kubetrain/suite-times"


class SuiteBudget:
    """The time accounting of one pytest run; see the module docstring."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.started = time.monotonic()
        self.elapsed: float | None = None
        self.items: dict[str, float] = defaultdict(float)
        self.modules: dict[str, float] = defaultdict(float)
        self.busy: dict[str, float] = defaultdict(float)
        self.last_report: dict[str, float] = {}
        self.fixtures: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = defaultdict(float)  # by module
        self.item_cpu: dict[str, float] = defaultdict(float)

    # --- on every process that runs tests (the one process without xdist) ---------------

    @pytest.hookimpl(wrapper=True)
    def pytest_fixture_setup(self, fixturedef: pytest.FixtureDef[Any],
                             request: pytest.FixtureRequest) -> Any:
        started = time.monotonic()
        try:
            return (yield)
        finally:
            if fixturedef.scope in ("session", "package", "module"):
                where = request.node.nodeid.split("::", 1)[0] or "the session"
                key = f"{fixturedef.argname} ({fixturedef.scope}, first for {where})"
                self.fixtures[key] += time.monotonic() - started

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> Any:
        started = _cpu_seconds()
        try:
            return (yield)
        finally:
            spent = _cpu_seconds() - started
            self.cpu[item.nodeid.split("::", 1)[0]] += spent
            self.item_cpu[item.nodeid] += spent

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        workeroutput = getattr(session.config, "workeroutput", None)
        if workeroutput is not None:  # an xdist worker: its times go to the controller
            workeroutput["fixture_seconds"] = dict(self.fixtures)
            workeroutput["cpu_seconds"] = dict(self.cpu)
            workeroutput["item_cpu_seconds"] = dict(self.item_cpu)
            return
        self.elapsed = time.monotonic() - self.started
        if os.environ.get("CI") == "true" and self.elapsed > CEILING_SECONDS:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    # --- on the process that reports (the controller under xdist) -----------------------

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if hasattr(self.config, "workerinput"):
            return
        node = getattr(report, "node", None)
        worker = node.gateway.id if node is not None else "main"
        self.items[report.nodeid] += report.duration
        self.modules[report.nodeid.split("::", 1)[0]] += report.duration
        self.busy[worker] += report.duration
        self.last_report[worker] = time.monotonic()

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodeready(self, node: Any) -> None:
        self.busy[node.gateway.id] += 0.0  # listed even if it is given nothing to run

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node: Any, error: Any) -> None:
        output = getattr(node, "workeroutput", {})
        for key, seconds in output.get("fixture_seconds", {}).items():
            self.fixtures[key] += seconds
        for module, seconds in output.get("cpu_seconds", {}).items():
            self.cpu[module] += seconds
        for nodeid, seconds in output.get("item_cpu_seconds", {}).items():
            self.item_cpu[nodeid] += seconds

    @pytest.hookimpl(trylast=True)  # last of the summaries: the tail CI's record keeps
    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if hasattr(self.config, "workerinput"):
            return
        elapsed = self.elapsed if self.elapsed is not None else time.monotonic() - self.started
        write = terminalreporter.write_line
        terminalreporter.write_sep("-", "where the suite's time went")
        over = elapsed > CEILING_SECONDS
        write(f"pytest: {elapsed:.0f} s ({elapsed / 60:.1f} min); ceiling on CI "
              f"{CEILING_SECONDS} s{': OVER' if over else ''}", red=over, bold=over)
        write(f"the {SLOWEST} slowest items (setup + call + teardown):")
        for nodeid, seconds in _top(self.items, SLOWEST):
            write(f"  {seconds:7.1f} s  {nodeid}")
        write(f"the {MODULES} slowest modules:")
        for module, seconds in _top(self.modules, MODULES):
            write(f"  {seconds:7.1f} s  {module}")
        if self.fixtures:
            write("shared fixtures' setup (in the items above, where first needed):")
            for key, seconds in _top(self.fixtures, FIXTURES):
                write(f"  {seconds:7.1f} s  {key}")
        if self.cpu:
            top = ", ".join(f"{module.removeprefix('tests/')} {seconds:.0f} s"
                            for module, seconds in _top(self.cpu, CPU_MODULES))
            write(f"CPU: {sum(self.cpu.values()):.0f} s in the tests' processes and the "
                  f"children they waited for; most: {top}")
        end = self.started + elapsed
        for worker in sorted(self.busy):
            idle = end - self.last_report.get(worker, self.started)
            write(f"worker {worker}: busy {self.busy[worker]:.0f} s, idle at the end "
                  f"{idle:.0f} s")
        self._keep_times(elapsed)
        if over and os.environ.get("CI") == "true":
            write(f"FAILED: pytest took {elapsed:.0f} s, over the suite's ceiling of "
                  f"{CEILING_SECONDS} s (tests/suite_budget.py): a new slow test takes its "
                  "time from somewhere else", red=True, bold=True)

    def _keep_times(self, elapsed: float) -> None:
        cache = getattr(self.config, "cache", None)  # None under -p no:cacheprovider
        if cache is None:
            return
        cache.set(TIMES_KEY, {
            "pytest_seconds": round(elapsed, 1),
            "busy_seconds": {worker: round(s, 1) for worker, s in sorted(self.busy.items())},
            "items": dict(_rounded(self.items)),
            "modules": dict(_rounded(self.modules)),
            "fixtures": dict(_rounded(self.fixtures)),
            "module_cpu_seconds": dict(_rounded(self.cpu)),
            "item_cpu_seconds": dict(_rounded(self.item_cpu)),
        })


def _cpu_seconds() -> float:
    """CPU time of this process (all its threads) and of its children waited for."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def _rounded(seconds: dict[str, float]) -> list[tuple[str, float]]:
    return [(key, round(value, 2)) for key, value in _top(seconds, len(seconds))]


def _top(seconds: dict[str, float], count: int) -> list[tuple[str, float]]:
    return sorted(seconds.items(), key=lambda item: -item[1])[:count]
