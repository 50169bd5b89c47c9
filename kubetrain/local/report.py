"""Write one self-contained HTML page with the charts of a run, from its metrics log.

RUN_DIR is the folder `kubetrain run` keeps a job in (./runs/JOB, holding
metrics.jsonl), or the metrics log itself. The page shows the training and
validation loss, the learning rate, tokens per second, the goodput ratio over
time, where the wall time went (seconds by cause, from the trainer's goodput
accounting) and the worker failures by class (the `failure` events `kubetrain run`
adds to the log; one line saying none failed when none did). Each attempt of the
worker group is its own line, so a restart that went back to a checkpoint shows as a
second line over the redone steps.

The charts are drawn with plotly (`pip install 'kubetrain[report]'`); its
JavaScript is inlined, so the file opens offline and can be mailed or attached.
`kubetrain run` writes RUN_DIR/report.html at its end when plotly is installed.
"""

from __future__ import annotations

import argparse
import html
import math
import sys
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kubetrain.local.metrics_log import Event, MetricsLogReader

REPORT_NAME = "report.html"
INSTALL_HINT = "pip install 'kubetrain[report]'"
# The causes in the order they stack, productive (goodput) first (the trainer's goodput
# ledger, kubetrain.trainer.goodput, names them), each with a colour of its own: goodput
# green, time lost to failures in reds and browns, the cost of checkpoints in blues, and
# straggling in pink and degraded steps (replica groups absent) in cyan, far from
# productive's green, which both are carved out of.
CAUSE_COLORS = {
    "productive": "#2ca02c", "data_wait": "#9467bd", "checkpoint_save": "#1f77b4",
    "checkpoint_load": "#9ecae1", "startup": "#7f7f7f", "preflight": "#c7c7c7",
    "evaluation": "#bcbd22", "lost_progress": "#ff7f0e", "downtime": "#d62728",
    "oom": "#8c564b", "straggler": "#e377c2", "degraded": "#17becf",
}
CAUSES = tuple(CAUSE_COLORS)
# For causes a newer trainer adds that this report does not know yet.
OTHER_COLORS = ("#393b79", "#bd9e39", "#637939", "#7b4173", "#843c39")
NO_FAILURES = "Worker failures: none — no worker failed in this run."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR",
                        help="a run's folder (runs/JOB, with metrics.jsonl) or a metrics log")
    parser.add_argument("-o", "--output", metavar="FILE.html",
                        help=f"where to write the page (default: RUN_DIR/{REPORT_NAME})")


def run(args: argparse.Namespace) -> int:
    path = Path(args.run_dir)
    log = path / "metrics.jsonl" if path.is_dir() else path
    if not log.exists():
        print(f"kubetrain report: {log} does not exist: give the folder `kubetrain run` keeps "
              "the job in (runs/JOB) or its metrics.jsonl", file=sys.stderr)
        return 1
    events = MetricsLogReader(log).read_new()
    if not any(event["event"] == "step" for event in events):
        print(f"kubetrain report: {log} has no training step yet: nothing to chart",
              file=sys.stderr)
        return 1
    output = Path(args.output) if args.output else log.parent / REPORT_NAME
    output.write_text(report_html(events, title=log.parent.name))
    print(f"wrote {output}")
    return 0


def _attempts(events: list[Event]) -> list[list[Event]]:
    """The events split where each attempt of the group started."""
    attempts: list[list[Event]] = [[]]
    for event in events:
        if event["event"] == "start" and any(e["event"] == "step" for e in attempts[-1]):
            attempts.append([])
        attempts[-1].append(event)
    return attempts


def _series(events: list[Event], kind: str, field: str) -> tuple[list[int], list[float]]:
    chosen = [e for e in events if e["event"] == kind and isinstance(e.get(field), int | float)]
    return [int(e["step"]) for e in chosen], [float(e[field]) for e in chosen]


def log_ticks(low: float, high: float) -> tuple[list[float], list[str]]:
    """Ticks for a log axis from `low` to `high` (both > 0): 1, 2 and 5 times each power of
    ten, only the powers when that makes more than 8, labelled as `2e-4` reads."""
    low, high = min(low, high), max(low, high)
    first, last = math.floor(math.log10(low)), math.ceil(math.log10(high))
    for mantissas in ((1, 2, 5), (1,)):
        ticks = [m * 10.0 ** exponent for exponent in range(first, last + 1)
                 for m in mantissas if low <= m * 10.0 ** exponent * (1 + 1e-9)
                 and m * 10.0 ** exponent <= high * (1 + 1e-9)]
        if len(ticks) <= 8:
            break
    if len(ticks) < 2:  # a range within one step of the 1-2-5 ladder: its ends
        ticks = sorted({low, high})
    return ticks, [_scientific(tick) for tick in ticks]


def _scientific(value: float) -> str:
    mantissa, exponent = f"{value:.1e}".split("e")
    return f"{mantissa.removesuffix('.0')}e{int(exponent)}"


def report_html(events: list[Event], *, title: str) -> str:
    """The page for a run's metrics-log events (plotly must be installed)."""
    page = report_figure(events, title=title).to_html(
        include_plotlyjs=True, full_html=True,
        config={"displaylogo": False, "responsive": True})
    return page.replace("<head>", f"<head><title>{html.escape(title)} - kubetrain</title>", 1)


def report_figure(events: list[Event], *, title: str) -> Any:
    """The page's charts as one plotly Figure (plotly must be installed)."""
    import plotly.graph_objects as go  # type: ignore[import-untyped]
    from plotly.subplots import make_subplots  # type: ignore[import-untyped]

    failures = Counter(str(e.get("class", "Unknown")) for e in events
                       if e["event"] == "failure")
    # Without failures the last panel would be an empty frame: one line says so instead.
    rows = 4 if failures else 3
    titles = ("Loss", "Learning rate", "Tokens per second", "Goodput over time",
              "Where the wall time went", *(("Worker failures by class",) if failures else ()))
    specs = [[{}, {}], [{}, {}], [{"colspan": 2}, None], [{"colspan": 2}, None]][:rows]
    figure = make_subplots(rows=rows, cols=2, vertical_spacing=0.32 / rows,
                           horizontal_spacing=0.08, subplot_titles=titles, specs=specs)
    rates: list[float] = []
    attempts = _attempts(events)
    for number, attempt in enumerate(attempts, start=1):
        suffix = f" (attempt {number})" if len(attempts) > 1 else ""
        steps, loss = _series(attempt, "step", "loss")
        figure.add_trace(go.Scatter(x=steps, y=loss, mode="lines", name=f"loss{suffix}"), 1, 1)
        steps, val = _series(attempt, "eval", "val_loss")
        if steps:
            figure.add_trace(go.Scatter(x=steps, y=val, mode="lines+markers",
                                        name=f"validation loss{suffix}"), 1, 1)
        steps, lr = _series(attempt, "step", "lr")
        rates += [rate for rate in lr if rate > 0]
        figure.add_trace(go.Scatter(x=steps, y=lr, mode="lines", name=f"learning rate{suffix}",
                                    hovertemplate="step %{x}: %{y:.3e}"), 1, 2)
        steps, speed = _series(attempt, "step", "tokens_per_second")
        figure.add_trace(go.Scatter(x=steps, y=speed, mode="lines",
                                    name=f"tokens/s{suffix}"), 2, 1)

    goodput = [e for e in events if e["event"] == "goodput" and isinstance(e.get("seconds"),
                                                                               dict)]
    if goodput:
        times = [datetime.fromtimestamp(float(e["time"]), UTC) for e in goodput]
        figure.add_trace(go.Scatter(x=times, y=[e["ratio"] for e in goodput], mode="lines",
                                    name="goodput ratio"), 2, 2)
        final = goodput[-1]["seconds"]
        wall = sum(float(value) for value in final.values()) or 1.0
        others = sorted(set(final) - set(CAUSES))
        colors = {**CAUSE_COLORS, **{cause: OTHER_COLORS[i % len(OTHER_COLORS)]
                                     for i, cause in enumerate(others)}}
        for cause in (*(c for c in CAUSES if c in final), *others):
            seconds = float(final.get(cause, 0.0))
            if seconds <= 0:
                continue  # a cause that cost nothing would be a legend entry with no bar
            figure.add_trace(go.Bar(
                x=[seconds], y=["wall time"], orientation="h", name=cause.replace("_", " "),
                marker={"color": colors[cause]},
                text=[f"{cause.replace('_', ' ')} {seconds:.1f}s ({seconds / wall:.1%})"],
                textposition="inside", hovertemplate="%{text}<extra></extra>"), 3, 1)
    if failures:
        classes = sorted(failures)
        figure.add_trace(go.Bar(x=classes, y=[failures[c] for c in classes],
                                name="worker failures", showlegend=False), 4, 1)
        figure.update_yaxes(title_text="failures", row=4, col=1)
    else:
        figure.add_annotation(text=NO_FAILURES, showarrow=False, xref="paper", yref="paper",
                              x=0, y=-0.07, xanchor="left", yanchor="top", font={"size": 15})
    figure.update_layout(barmode="stack", height=350 * rows, title_text=f"kubetrain run: {title}",
                         legend={"orientation": "v"}, margin={"b": 60 if failures else 110})
    figure.update_xaxes(title_text="step", row=1)
    figure.update_xaxes(title_text="step", row=2, col=1)
    figure.update_xaxes(title_text="seconds", row=3, col=1)
    # A log axis shows the warmup and the decay alike; plotly's own log ticks label the
    # minor ones with a bare digit ("3, 2, 0.001, 9 8 7"), so the ticks are chosen here.
    tickvals, ticktext = log_ticks(min(rates), max(rates)) if rates else (None, None)
    figure.update_yaxes(type="log", tickvals=tickvals, ticktext=ticktext, row=1, col=2)
    figure.update_yaxes(range=[0, 1], tickformat=".0%", row=2, col=2)
    return figure


def write_after_run(run_dir: Path) -> str:
    """What `kubetrain run` prints about the report it writes at its end."""
    try:
        import plotly  # noqa: F401
    except ImportError:
        return f"no HTML report: plotly is not installed ({INSTALL_HINT})"
    log = run_dir / "metrics.jsonl"
    events = MetricsLogReader(log).read_new()
    if not any(event["event"] == "step" for event in events):
        return "no HTML report: no training step was logged"
    output = run_dir / REPORT_NAME
    try:
        output.write_text(report_html(events, title=run_dir.name))
    except Exception as error:  # the run's outcome and exit status must not depend on it
        return f"no HTML report: {type(error).__name__}: {error}"
    return str(output)

