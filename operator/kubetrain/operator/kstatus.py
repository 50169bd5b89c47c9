"""The kstatus conditions of a TrainingJob: Ready, Reconciling and Stalled, from its phase.

Flux (`wait: true`, health checks), kpt and other tools built on kstatus read a custom
resource's state from `status.observedGeneration` and two abnormal-true conditions:
`Reconciling` True means the controller is still converging (kstatus: InProgress),
`Stalled` True means it has given up (kstatus: Failed); with neither, the resource is
Current. `Ready` is the positive summary most tools also show. For a TrainingJob:

| phase                 | Ready | Reconciling | Stalled | kstatus    |
|-----------------------|-------|-------------|---------|------------|
| none yet, Pending     | False | True        | -       | InProgress |
| Running               | True  | False       | -       | Current    |
| Restarting            | False | True        | -       | InProgress |
| Suspended             | False | False       | -       | Current    |
| Succeeded             | True  | False       | -       | Current    |
| Failed                | False | False       | True    | Failed     |

They are computed from the phase and the phase's own condition (its reason and message)
at the end of every reconcile pass, never set step by step, so they agree with the phase
at every transition. `Stalled`, like the other conditions, is absent until it first
holds; `Ready` and `Reconciling` are always there. Pure: no Kubernetes, no clock but the
pass's `now`; the phase itself is decided by `reconcile` and its steps.
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from kubetrain.api.trainingjob import Condition, TrainingJobStatus

READY, RECONCILING, STALLED = "Ready", "Reconciling", "Stalled"
KSTATUS_CONDITIONS = (READY, RECONCILING, STALLED)


def summarize(status: TrainingJobStatus, now: datetime) -> None:
    """Set Ready, Reconciling and Stalled on `status` from its phase."""
    phase = status.phase or "Pending"
    reason, message = _phase_reason(status, phase)
    _set(status, READY, phase in ("Running", "Succeeded"), reason, message, now)
    _set(status, RECONCILING, phase in ("Pending", "Restarting"), reason, message, now)
    _set(status, STALLED, phase == "Failed", reason, message, now, absent_until_true=True)


def _phase_reason(status: TrainingJobStatus, phase: str) -> tuple[str, str]:
    """Why the job is in `phase`, in its phase condition's words where it has one."""
    own = next((c for c in status.conditions if c.type == phase and c.status == "True"), None)
    if own is not None and own.reason:
        return own.reason, own.message or ""
    if phase == "Pending":
        workers = status.workers
        return "WaitingForWorkers", (f"waiting for the workers to run ({workers.ready} of "
                                     f"{workers.desired} ready)")
    return phase, f"the job is {phase}"


def _set(status: TrainingJobStatus, kind: str, value: bool, reason: str, message: str,
         now: datetime, absent_until_true: bool = False) -> None:
    """One condition, keeping its transition time when its truth did not change."""
    text: Literal["True", "False"] = "True" if value else "False"
    existing = next((c for c in status.conditions if c.type == kind), None)
    if existing is None:
        if value or not absent_until_true:
            status.conditions.append(Condition(type=kind, status=text, reason=reason,
                                               message=message, last_transition_time=now))
        return
    if existing.status != text:
        existing.last_transition_time = now
    existing.status, existing.reason, existing.message = text, reason, message
