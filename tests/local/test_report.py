"""`kubetrain report`: one self-contained HTML page of a run's charts, drawn in a real browser."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
from host_tools import require_tool

from kubetrain.cli import main
from kubetrain.local.metrics_log import MetricsLogReader
from kubetrain.local.report import NO_FAILURES, log_ticks, report_figure

plotly = pytest.importorskip("plotly", reason="the report extra: pip install 'kubetrain[report]'")

SECONDS = {"productive": 60.0, "data_wait": 1.0, "checkpoint_save": 2.0, "checkpoint_load": 0.5,
           "startup": 9.0, "evaluation": 3.0, "lost_progress": 4.0, "downtime": 6.0}


BROWSER = ["chromium", "--headless", "--no-sandbox", "--disable-gpu",
           "--virtual-time-budget=10000", "--window-size=1400,1150"]


def write_log(folder: Path, failed: bool = True) -> Path:
    """The metrics log of a run killed at step 14 and resumed from its step-10 checkpoint;
    with `failed` false, a clean run of the same 20 steps (as `make demo`'s)."""
    events: list[dict[str, Any]] = []
    clock = 1_800_000_000.0

    def add(kind: str, **fields: Any) -> None:
        nonlocal clock
        clock += 1.0
        events.append({"event": kind, **fields, "time": clock})

    for start, stop in ((0, 14), (10, 20)) if failed else ((0, 20),):
        if start:
            # What `kubetrain run` logs about the failure that ended the first attempt.
            add("failure", **{"class": "NodeLost"}, reason="worker 1 was lost", exit_code=-9)
            add("resumed", step=start, uri="checkpoints/step-10", world_size=2)
        add("start", step=start, world_size=2)
        for step in range(start + 1, stop + 1):
            add("step", step=step, max_steps=20, loss=8.0 - step * 0.2, lr=1e-3 * step / 20,
                grad_norm=1.0, tokens_per_second=1000.0 + step, mfu=0.0, step_time=0.1,
                data_wait_ratio=0.01)
            done = step / 20
            seconds = {cause: value * done for cause, value in SECONDS.items()}
            if not failed:  # nothing lost to a restart; a straggling rank instead
                seconds.update(lost_progress=0.0, downtime=0.0, straggler=5.0 * done)
            add("goodput", step=step, ratio=0.7 * done, seconds=seconds)
            if step % 10 == 0:
                add("eval", step=step, val_loss=7.5 - step * 0.1, perplexity=100.0)
    add("finished", step=20, reason="max_steps", best_val_loss=5.5, export_uri=None)
    log = folder / "metrics.jsonl"
    log.write_text("".join(json.dumps(event) + "\n" for event in events))
    return log


def test_report_writes_one_self_contained_page_with_every_chart(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_log(tmp_path)
    assert main(["report", str(tmp_path)]) == 0
    page = (tmp_path / "report.html").read_text()
    assert f"wrote {tmp_path / 'report.html'}" in capsys.readouterr().out
    # plotly.js is inlined: no script is fetched from anywhere.
    assert not re.search(r"<script[^>]+src=", page)
    for title in ("Loss", "Learning rate", "Tokens per second", "Goodput over time",
                  "Where the wall time went", "Worker failures by class"):
        assert f'"text":"{title}"' in page
    assert '"name":"worker failures","showlegend":false,"x":["NodeLost"],"y":[1]' in page
    for name in ("loss (attempt 1)", "loss (attempt 2)", "validation loss (attempt 2)",
                 "lost progress", "downtime", "goodput ratio"):
        assert f'"name":"{name}"' in page


def test_report_says_what_is_wrong_with_a_missing_or_empty_log(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", str(tmp_path / "nowhere")]) == 1
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text('{"event": "start", "step": 0}\n')
    assert main(["report", str(tmp_path)]) == 1
    assert "no training step yet" in capsys.readouterr().err


def test_the_page_draws_its_charts_in_headless_chromium(tmp_path: Path) -> None:
    require_tool("chromium", "chromium")
    write_log(tmp_path)
    output = tmp_path / "page.html"
    assert main(["report", str(tmp_path), "--output", str(output)]) == 0
    browser = BROWSER
    # The DOM after plotly.js ran: every trace became an SVG group.
    dom = subprocess.run([*browser, "--dump-dom", output.as_uri()], capture_output=True,
                         text=True, timeout=120, check=True).stdout
    assert len(re.findall(r'class="trace scatter', dom)) == 9  # loss, val, lr, tok/s x2 + ratio
    # One bar per cause of the wall time, and the worker failures by class.
    assert len(re.findall(r'class="trace bars"', dom)) == len(SECONDS) + 1
    screenshot = tmp_path / "report.png"
    subprocess.run([*browser, "--hide-scrollbars", f"--screenshot={screenshot}",
                    output.as_uri()], capture_output=True, timeout=120, check=True)
    assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert screenshot.stat().st_size > 50_000, "a blank page's screenshot is a few KB"


def _dom(page: Path) -> str:
    """The page's DOM after plotly.js drew it in headless chromium."""
    return subprocess.run([*BROWSER, "--dump-dom", page.as_uri()], capture_output=True,
                          text=True, timeout=120, check=True).stdout


@pytest.mark.parametrize(("low", "high", "labels"), [
    (1.5e-4, 3e-3, ["2e-4", "5e-4", "1e-3", "2e-3"]),  # warmup to 3e-3, cosine to 3e-4
    (5e-5, 1e-3, ["5e-5", "1e-4", "2e-4", "5e-4", "1e-3"]),
    (1e-8, 1.0, ["1e-8", "1e-7", "1e-6", "1e-5", "1e-4", "1e-3", "1e-2", "1e-1", "1e0"]),
    (3e-4, 3e-4, ["3e-4"]),  # a constant rate: its value
    (2.2e-4, 4.4e-4, ["2.2e-4", "4.4e-4"]),  # no 1-2-5 step inside: the ends
])
def test_learning_rate_ticks_read_as_numbers(low: float, high: float,
                                             labels: list[str]) -> None:
    values, text = log_ticks(low, high)
    assert text == labels
    assert values == sorted(values) and all(low * 0.999 <= v <= high * 1.001 for v in values)
    assert [float(label) for label in text] == pytest.approx(values)


def test_the_learning_rate_axis_shows_only_readable_ticks_in_chromium(tmp_path: Path) -> None:
    require_tool("chromium", "chromium")
    write_log(tmp_path, failed=False)
    output = tmp_path / "page.html"
    assert main(["report", str(tmp_path), "--output", str(output)]) == 0
    # The learning rate is the second subplot: its y axis's tick labels, as drawn.
    ticks = re.findall(r'class="y2tick"[^<]*<text[^>]*>([^<]*)<', _dom(output))
    assert len(ticks) >= 2, ticks
    assert all(re.fullmatch(r"\d(\.\d)?e-?\d+", tick) for tick in ticks), ticks
    assert [float(tick) for tick in ticks] == sorted(float(tick) for tick in ticks)


def test_a_run_without_failures_says_so_in_one_line_instead_of_an_empty_panel(
        tmp_path: Path) -> None:
    require_tool("chromium", "chromium")
    write_log(tmp_path, failed=False)
    output = tmp_path / "page.html"
    assert main(["report", str(tmp_path), "--output", str(output)]) == 0
    dom = _dom(output)
    assert len(re.findall(r'class="subplot x\d*y\d*"', dom)) == 5  # no sixth, empty frame
    assert "Worker failures by class" not in dom
    assert f">{NO_FAILURES}<" in dom
    # With a failure, the panel is there and the line is not.
    write_log(tmp_path)
    assert main(["report", str(tmp_path), "--output", str(output)]) == 0
    dom = _dom(output)
    assert "Worker failures by class" in dom and NO_FAILURES not in dom


def _rgb(color: str) -> tuple[int, int, int]:
    return int(color[1:3], 16), int(color[3:5], 16), int(color[5:7], 16)


def test_every_cause_of_the_wall_time_has_a_colour_far_from_the_others(
        tmp_path: Path) -> None:
    write_log(tmp_path, failed=False)
    events = MetricsLogReader(tmp_path / "metrics.jsonl").read_new()
    bars = {trace.name: trace.marker.color for trace in report_figure(events, title="t").data
            if trace.type == "bar"}
    assert {"productive", "straggler", "startup", "data wait"} <= set(bars), bars
    # Causes that cost nothing have no bar (and no legend entry).
    assert "lost progress" not in bars and "downtime" not in bars
    colors = [_rgb(color) for color in bars.values()]
    assert len(set(colors)) == len(colors), bars
    # Productive and straggler (carved out of productive) sit side by side in the bar:
    # their colours must differ at a glance, by more than half the RGB cube's diagonal.
    distance = sum((a - b) ** 2 for a, b in zip(_rgb(bars["productive"]),
                                                _rgb(bars["straggler"]), strict=True)) ** 0.5
    assert distance > 0.5 * (3 * 255 ** 2) ** 0.5, (bars["productive"], bars["straggler"])
