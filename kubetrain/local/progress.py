"""What a user of `kubetrain run` sees: a live progress bar, event lines, and the final summary.

The bar (tqdm, on stderr) shows step / max steps, the epoch, training loss,
tokens per second and the ETA; evaluations, checkpoints, resumes and restarts are printed
above it as they happen. Everything shown comes from the trainer's metrics log
(`RunHistory`); the workers' own output goes to log files so it never tears the
bar.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from tqdm import tqdm

from kubetrain.local.metrics_log import Event, RunHistory


def shown(uri: str) -> str:
    """A URI as the user should read it: a local file below the current folder as a short path."""
    if not uri.startswith("file://"):
        return uri
    path = Path(uri.removeprefix("file://"))
    return str(path.relative_to(Path.cwd())) if path.is_relative_to(Path.cwd()) else str(path)


class ProgressDisplay:
    """The progress bar of the current attempt of the worker group, and lines printed above it."""

    def __init__(self, max_steps: int | None, stream: IO[str] | None = None) -> None:
        # None until the trainer says (a job given in epochs): its `start` event carries it.
        self.max_steps = max_steps
        self.stream = stream or sys.stderr
        self.bar: tqdm | None = None

    def show(self, event: Event, history: RunHistory) -> None:
        """Reflect one metrics-log event (already folded into `history`)."""
        kind = event["event"]
        if kind == "resumed":
            self.say(f"resumed from the checkpoint at step {history.step} "
                     f"({event.get('world_size', '?')} processes)")
            self._new_bar(history)
        elif kind == "start":
            self._new_bar(history)
        elif kind == "step":
            self._advance(history)
        elif kind == "eval":
            step, val_loss = history.val_losses[-1]
            perplexity = event.get("perplexity")
            extra = f", perplexity {perplexity:.1f}" if isinstance(perplexity, int | float) else ""
            self.say(f"step {step}: validation loss {val_loss:.4f}{extra}")
        elif kind == "checkpoint":
            latest = history.checkpoints[-1]
            self.say(f"step {latest.step}: checkpoint saved to {shown(latest.uri)}")
        elif kind == "finished":
            self._advance(history)
        elif kind == "quorum":  # replica groups (spec.faultTolerance)
            self.say(f"step {event.get('step')}: {event.get('groups')} of {event.get('of')} "
                     f"replica groups in the quorum ({event.get('skipped_samples')} samples "
                     "passed over so far)")
        elif kind == "healed":
            self.say(f"step {event.get('step')}: replica group {event.get('group', '?')} "
                     "healed from a live group, no checkpoint read")

    def say(self, line: str) -> None:
        """Print a line above the bar."""
        tqdm.write(line, file=self.stream)

    def close(self) -> None:
        """Leave the current bar on screen as it is and stop updating it."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def _new_bar(self, history: RunHistory) -> None:
        # One bar per attempt: after a resume the rate and ETA start afresh from the
        # checkpoint's step instead of averaging over the restart.
        self.close()
        self.bar = tqdm(total=self.max_steps or history.max_steps, initial=history.step,
                        unit="step", file=self.stream,
                        dynamic_ncols=True, smoothing=0.1)

    def _advance(self, history: RunHistory) -> None:
        if self.bar is None:
            self._new_bar(history)
        assert self.bar is not None
        self.bar.update(max(0, history.step - self.bar.n))
        postfix = {}
        if history.epoch is not None:
            postfix["epoch"] = f"{history.epoch:.2f}"
        if history.loss is not None:
            postfix["loss"] = f"{history.loss:.4f}"
        if history.ce_loss is not None and history.kd_loss is not None:
            postfix["ce"] = f"{history.ce_loss:.4f}"
            postfix["kd"] = f"{history.kd_loss:.4f}"
        if history.tokens_per_second is not None:
            postfix["tok/s"] = f"{history.tokens_per_second:,.0f}"
        self.bar.set_postfix(postfix, refresh=True)


@dataclass(frozen=True)
class Outcome:
    """How a local run ended, for the summary."""

    succeeded: bool
    reason: str
    seconds: float
    restarts: list[str]
    """Why each group restart of this run happened, in order."""
    checkpoints_before: int
    """Checkpoints the metrics log already recorded when this run started."""
    micro_batches: list[int] = field(default_factory=list)
    """The micro-batch of the first attempt and of each out-of-memory restart."""
    oom_recovery_seconds: list[float] = field(default_factory=list)
    """From each out-of-memory failure to the next training step."""
    own_code: bool = False
    """The job ran its own code (spec.trainer): its checkpoints are not kubetrain's to try."""


def summary(job_name: str, history: RunHistory, outcome: Outcome, checkpoint_uri: str,
            logs: str) -> str:
    """The closing report of a local run, one fact per line."""
    minutes, seconds = divmod(round(outcome.seconds), 60)
    state = "succeeded" if outcome.succeeded else "stopped"
    lines = [f"{job_name} {state}: {outcome.reason} ({minutes}m {seconds:02d}s)"]

    def row(label: str, text: str) -> None:
        lines.append(f"  {label:<17}{text}")

    if history.loss is not None:
        first = f"{history.first_loss:.4f} -> " if history.first_loss is not None else ""
        row("training loss", f"{first}{history.loss:.4f} at step {history.step} "
            f"of {history.max_steps or '?'}"
            + (f" (epoch {history.epoch:.2f})" if history.epoch is not None else ""))
    if history.ce_loss is not None and history.kd_loss is not None:
        row("distillation", f"cross-entropy {history.ce_loss:.4f}, KD term "
            f"{history.kd_loss:.4f} at step {history.step}")
    if history.val_losses:
        first_val, final_val = history.val_losses[0][1], history.val_losses[-1][1]
        best = history.best_val_loss
        row("validation loss", f"first {first_val:.4f}, final {final_val:.4f}"
            + (f", best {best:.4f}" if best is not None else ""))
    if history.resumed_from:
        row("resumed from", ", ".join(f"step {step}" for step in history.resumed_from))
    if outcome.restarts:
        row("restarts", f"{len(outcome.restarts)}: " + "; ".join(outcome.restarts))
    if len(outcome.micro_batches) > 1:
        recovered = ", ".join(f"{seconds:.1f}s" for seconds in outcome.oom_recovery_seconds)
        again = f"; training again {recovered} after running out of memory" if recovered else ""
        row("micro-batch", " -> ".join(map(str, outcome.micro_batches))
            + " (halved after running out of memory; global batch unchanged; the manifest "
            "is not changed)" + again)
    written = len(history.checkpoints) - outcome.checkpoints_before
    latest = history.latest_checkpoint
    if latest is not None:
        row("checkpoints", f"{written} written by this run; latest: step {latest.step} "
            f"at {shown(latest.uri)}")
    kept = history.best_checkpoint
    if kept is not None:
        row("best checkpoint", f"step {kept.step}, validation loss {kept.val_loss:.4f}, "
            f"at {shown(kept.uri)}")
    export_uri = history.finished.get("export_uri") if history.finished else None
    if export_uri:
        export_step = history.finished.get("export_step") if history.finished else None
        weights = f"weights of step {export_step}; " if isinstance(export_step, int) else ""
        # Runs from before the event named its format exported Hugging Face Llamas only.
        exported = (history.finished or {}).get("export_format") or "Hugging Face Llama"
        row("exported model", f"{shown(str(export_uri))} ({exported}: {weights}"
            "safetensors, config, tokenizer)")
    if outcome.succeeded and latest is not None and not outcome.own_code:
        row("try it", f"kubetrain generate --checkpoint {checkpoint_uri} --prompt 'def '")
    elif not outcome.succeeded and latest is not None:
        row("continue", "run the same command again to resume from the latest checkpoint")
    if history.goodput:
        row("goodput", goodput_breakdown(history.goodput, history.checkpoint_load_tiers))
    row("logs", logs)
    return "\n".join(lines)


def goodput_breakdown(seconds: dict[str, float],
                      load_tiers: dict[str, float] | None = None) -> str:
    """`93.1% of 12m 04s productive; badput: downtime 40s, lost progress 9s, ...`; with
    `load_tiers`, checkpoint load says the tiers it loaded from: `checkpoint load 2.5s
    (memory 0.4s, s3 2.1s)`."""
    wall = sum(seconds.values())
    if wall <= 0:
        return "no time accounted yet"
    productive = seconds.get("productive", 0.0)
    badput = sorted(((value, cause) for cause, value in seconds.items()
                     if cause != "productive" and value >= 0.05), reverse=True)
    text = f"{productive / wall:.1%} of {_duration(wall)} productive"
    if badput:
        tiers = ", ".join(f"{tier} {_duration(value)}"
                          for tier, value in (load_tiers or {}).items() if value >= 0.05)

        def shown(cause: str, value: float) -> str:
            text = f"{cause.replace('_', ' ')} {_duration(value)}"
            return f"{text} ({tiers})" if cause == "checkpoint_load" and tiers else text

        text += "; badput: " + ", ".join(shown(cause, value) for value, cause in badput)
    return text


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, rest = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m" if hours else f"{minutes}m {rest:02d}s"
