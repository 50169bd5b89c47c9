"""kstatus's conditions (kubetrain.operator.kstatus) through the pure reconcile, pass by pass.

`kstatus_status` is kstatus's documented computation for a custom resource, written as a
test (kubernetes-sigs/cli-utils, pkg/kstatus/status: `checkGenericProperties` and
`checkGeneration`; a resource with no rule of its own and neither condition true is
Current). It is what Flux's `wait: true` and health checks read. The tables play a job
through every transition the operator makes, feeding each written status back as the
next pass's, as the operator does, and check the conditions and what kstatus makes of
them at every step; tests/operator/test_gitops_health.py applies the same rules to the
statuses the real operator wrote.
"""

from __future__ import annotations

import itertools
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_reconcile import NOW, make_job, pod, run

from kubetrain.operator.reconcile import reject

# What kstatus makes of a TrainingJob in each phase (kubetrain.operator.kstatus's table).
EXPECTED = {None: "InProgress", "Pending": "InProgress", "Running": "Current",
            "Restarting": "InProgress", "Suspended": "Current", "Succeeded": "Current",
            "Failed": "Failed"}


def kstatus_status(obj: dict[str, Any]) -> tuple[str, str]:
    """kstatus's status of a custom resource and its message: Terminating, InProgress,
    Failed or Current."""
    meta, status = obj.get("metadata") or {}, obj.get("status") or {}
    if meta.get("deletionTimestamp"):
        return "Terminating", "Resource scheduled for deletion"
    generation, observed = meta.get("generation"), status.get("observedGeneration")
    if generation is not None and observed is not None and observed != generation:
        return "InProgress", (f"{obj.get('kind')} generation is {generation}, but latest "
                              f"observed generation is {observed}")
    for condition in status.get("conditions") or []:
        if condition["type"] == "Reconciling" and condition["status"] == "True":
            return "InProgress", condition.get("message", "")
        if condition["type"] == "Stalled" and condition["status"] == "True":
            return "Failed", condition.get("message", "")
    return "Current", "Resource is current"


def conditions(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in status.get("conditions", [])}


def check_kstatus_conditions(status: dict[str, Any], generation: int = 1) -> str:
    """The invariants at one step; returns what kstatus makes of it."""
    phase = status.get("phase")
    found = conditions(status)
    ready, reconciling = found["Ready"]["status"], found["Reconciling"]["status"]
    stalled = found.get("Stalled", {}).get("status", "False")
    assert ready == ("True" if phase in ("Running", "Succeeded") else "False"), status
    assert reconciling == ("True" if phase in (None, "Pending", "Restarting") else "False")
    assert stalled == ("True" if phase == "Failed" else "False"), status
    assert not (reconciling == "True" and stalled == "True")
    seen, message = kstatus_status({"kind": "TrainingJob", "status": status,
                                    "metadata": {"generation": generation}})
    assert seen == EXPECTED[phase], (phase, seen, status)
    if phase in ("Failed", "Restarting"):  # the phase condition's words, for `flux get`
        assert message == found[phase]["message"] and message
    return seen


@dataclass
class Step:
    what: str
    pods: tuple[Any, ...]
    phase: str
    spec: dict[str, Any] | None = None  # runPolicy fields for this pass


LIFE = [
    Step("created: no pods yet", (), "Pending"),
    Step("pods created, not running",
         (pod(0, "Pending", created_at=NOW), pod(1, "Pending", created_at=NOW)), "Pending"),
    Step("both workers run", (pod(0), pod(1)), "Running"),
    Step("worker 1 killed", (pod(0), pod(1, "Failed", exit_code=137)), "Restarting"),
    Step("backing off", (pod(0),), "Restarting"),
    Step("the replacement runs", (pod(0), pod(1, attempt=1)), "Running"),
    Step("suspended", (pod(0), pod(1, attempt=1)), "Suspended", {"suspend": True}),
    Step("suspended, pods gone", (), "Suspended", {"suspend": True}),
    Step("resumed", (), "Pending", {"suspend": False}),
    Step("running again", (pod(0, attempt=1), pod(1, attempt=1)), "Running",
         {"suspend": False}),
    Step("worker 0 done", (pod(0, "Succeeded", attempt=1, exit_code=0), pod(1, attempt=1)),
         "Succeeded"),
]


def play(minimal_manifest: dict, steps: list[Step]) -> list[dict[str, Any]]:
    """Each step's written status, fed back into the next, as the operator does."""
    status: dict[str, Any] | None = None
    written = []
    for index, step in enumerate(steps):
        job = make_job(minimal_manifest, status=status, backoffSeconds=10,
                       **(step.spec or {}))
        out = run(job, *step.pods, now=NOW.replace(minute=index))
        status = out.status or status
        assert status is not None and status.get("phase") == step.phase, (step.what, status)
        written.append(status)
    return written


def test_every_transition_keeps_ready_reconciling_and_stalled_true_to_the_phase(
        minimal_manifest: dict) -> None:
    seen = [check_kstatus_conditions(status) for status in play(minimal_manifest, LIFE)]
    assert seen == [EXPECTED[step.phase] for step in LIFE]


def test_a_condition_changes_its_transition_time_only_when_its_truth_changes(
        minimal_manifest: dict) -> None:
    statuses = play(minimal_manifest, LIFE)
    for before, after in itertools.pairwise(statuses):
        for kind in ("Ready", "Reconciling"):
            old, new = conditions(before)[kind], conditions(after)[kind]
            same = old["status"] == new["status"]
            assert (old["lastTransitionTime"] == new["lastTransitionTime"]) is same, (kind,
                                                                                      after)


@pytest.mark.parametrize(("what", "pods", "reason"), [
    ("a permanent exit code", (pod(0), pod(1, "Failed", exit_code=2)), "PermanentError"),
    ("restarts exhausted", (pod(0), pod(1, "Failed", exit_code=137)), "MaxRestartsExceeded"),
])
def test_a_job_failed_for_good_is_stalled_with_the_failed_conditions_words(
        minimal_manifest: dict, what: str, pods: tuple[Any, ...], reason: str) -> None:
    running = play(minimal_manifest, LIFE[:3])[-1]
    job = make_job(minimal_manifest, status={**running, "restarts": 3}, maxRestarts=3)
    status = run(job, *pods).status
    assert status is not None and status["phase"] == "Failed", what
    assert check_kstatus_conditions(status) == "Failed"
    stalled = conditions(status)["Stalled"]
    assert stalled["reason"] == reason
    assert stalled["message"] == conditions(status)["Failed"]["message"]
    # A finished job's later passes change none of them.
    again = run(make_job(minimal_manifest, status=status, maxRestarts=3), *pods).status
    assert again is None or conditions(again) == conditions(status)


def test_an_invalid_spec_stalls_until_a_new_generation_is_valid(minimal_manifest: dict) -> None:
    rejected = next(a.status for a in reject(None, 1, "spec.data.train: gs:// is not read",
                                             NOW) if hasattr(a, "status"))
    assert check_kstatus_conditions(rejected) == "Failed"
    assert conditions(rejected)["Stalled"]["reason"] == "InvalidSpec"
    fixed = run(make_job(minimal_manifest, status=rejected, generation=2)).status
    assert fixed is not None and fixed["phase"] == "Pending"
    assert check_kstatus_conditions(fixed, generation=2) == "InProgress"
    assert conditions(fixed)["Stalled"]["status"] == "False"


def test_kstatus_reads_a_spec_the_operator_has_not_seen_as_in_progress(
        minimal_manifest: dict) -> None:
    succeeded = play(minimal_manifest, LIFE)[-1]
    assert kstatus_status({"kind": "TrainingJob", "status": succeeded,
                           "metadata": {"generation": 2}})[0] == "InProgress"
