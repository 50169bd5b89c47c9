"""docs/own-code.md states what the code does: every code, rate, key and time it names is read
from the code here, so a change to one without the other fails.

The page is the contract a user writes their script from (issue 51: a user who followed it
read 137 as out of memory, marked sharded saves behind a barrier nobody needed, and could not
find the endpoint's answers). Its tables are parsed as Markdown; its sentences are matched
with the number the code holds put into them.
"""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest

from kubetrain.operator.own_code_container import (
    STATUS_CA_KEY,
    STATUS_TOKEN_KEY,
    STATUS_URL_KEY,
    WORKER_SHUTDOWN_SECONDS,
)
from kubetrain.operator.trainer_status_endpoint import (
    MAX_BODY_BYTES,
    REFUSAL_REASONS,
    RateLimit,
)
from kubetrain.operator.worker_env import TERMINATION_GRACE_SECONDS
from kubetrain.protocol import (
    DEFAULT_PERMANENT_EXIT_CODES,
    EXIT_OOM_KILLED,
    EXIT_SIGNALLED,
    SIGNAL_EXIT_BASE,
    TRAINER_EXIT_CODES,
)
from kubetrain.sdk.progress import MIN_INTERVAL_SECONDS
from kubetrain.trainer.own_code import LINGER_SECONDS, SYNC_INTERVAL_SECONDS

PAGE = Path(__file__).resolve().parents[2] / "docs" / "own-code.md"


def section(heading: str) -> str:
    """The text under `## heading`, up to the next heading of the same level."""
    text = PAGE.read_text()
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else None]


def first_column(text: str) -> list[str]:
    """The first cell of every data row of the Markdown tables in `text` (a table's first
    line is its header, its second the separator)."""
    cells, table = [], []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            table.append(line.split("|")[1].strip())
        else:
            cells += table[2:]
            table = []
    return cells


def numbers(cell: str) -> set[int]:
    return {int(found) for found in re.findall(r"\b\d+\b", cell)}


def test_every_status_the_endpoint_answers_is_in_the_table_and_no_other() -> None:
    listed = set().union(*(numbers(cell) for cell in first_column(section("The status endpoint"))
                           if cell.isdigit()))
    assert listed == {200, *REFUSAL_REASONS}


def test_the_endpoints_rate_and_body_limit_are_the_codes() -> None:
    text = " ".join(section("The status endpoint").split())
    rate = RateLimit()
    assert (f"more than {rate.per_second:g} reports a second from the job, past a burst of "
            f"{rate.burst}") in text
    assert f"over {MAX_BODY_BYTES // 1024} KiB" in text
    assert f"every {MIN_INTERVAL_SECONDS:g} s from rank 0" in text


def test_the_status_secrets_keys_are_the_ones_the_pods_mount() -> None:
    keys = {cell.strip("`") for cell in first_column(section("The status endpoint"))
            if cell.startswith("`")}
    assert keys == {STATUS_URL_KEY, STATUS_TOKEN_KEY, STATUS_CA_KEY}


def test_the_exit_code_table_is_the_protocols() -> None:
    rows = first_column(section("Exit codes"))
    codes = [numbers(cell) for cell in rows]
    assert {0} in codes
    assert {EXIT_SIGNALLED} in codes and EXIT_SIGNALLED == SIGNAL_EXIT_BASE + signal.SIGTERM
    assert set(DEFAULT_PERMANENT_EXIT_CODES) in codes
    for code in TRAINER_EXIT_CODES.values():
        assert {code} in codes, f"exit {code} is missing from the table"
    # 137 has two rows: out of memory only with the OOMKilled reason, Unknown otherwise.
    oom = [cell for cell in rows if numbers(cell) == {EXIT_OOM_KILLED}]
    assert len(oom) == 2 and any("OOMKilled" in cell for cell in oom), oom
    assert EXIT_OOM_KILLED == SIGNAL_EXIT_BASE + signal.SIGKILL


@pytest.mark.parametrize(("heading", "sentence"), [
    ("SIGTERM and the grace period", f"grace period ({TERMINATION_GRACE_SECONDS} s)"),
    ("SIGTERM and the grace period",
     f"`TORCH_ELASTIC_SHUTDOWN_TIMEOUT`, {WORKER_SHUTDOWN_SECONDS} s: two thirds of the grace"),
    ("SIGTERM and the grace period", f"is still running {LINGER_SECONDS:g} s later"),
    ("Marking a save complete", f"if it is still running {LINGER_SECONDS:g} s later"),
    ("Ending the process group", f"still running {LINGER_SECONDS:g} s after the last call"),
    ("Checkpoints and resume", f"every `KUBETRAIN_SYNC_SECONDS` ({SYNC_INTERVAL_SECONDS:g} s)"),
])
def test_the_times_the_page_states_are_the_codes(heading: str, sentence: str) -> None:
    if heading in ("Marking a save complete", "Ending the process group"):  # subsections
        text = PAGE.read_text().split(f"### {heading}", 1)[1].split("\n## ", 1)[0]
    else:
        text = section(heading)
    assert sentence in " ".join(text.split())
