"""`kubetrain run` of own code (spec.trainer): the two test scripts under the real entry.

The scripts in tests/own_code run as a user's would: kubetrain's own-code entry around a real
torchrun agent per simulated node, checkpoints uploaded to a local checkpoint.uri and restored
before each attempt, and progress reported to the runner's status endpoint by
kubetrain.sdk.report (the plain PyTorch script) or by transformers' own KubeflowCallback (the
Trainer script). Each test reads what the run left: the exit status, the metrics log the
runner wrote, the commits under checkpoint.uri and the scripts' own `own-code step N` lines,
which count the steps a restart redid.
"""

from __future__ import annotations

import json
import math
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from kubetrain.local.launch import OWN_CODE_SYNC_SECONDS
from kubetrain.local.metrics_log import append_event, parse_lines
from kubetrain.local.own_code import ReportedGoodput
from kubetrain.local.trainer_status_endpoint import MAX_BODY_BYTES, LocalStatusEndpoint
from kubetrain.sdk.progress import Reporter
from tests.local.runs import events, finish, start_run

SCRIPTS = Path(__file__).parents[1] / "own_code"
RUN_TIMEOUT = 300


def own_code_job(name: str, script: str, *, steps: int, save_every: int, step_seconds: float,
                 replicas: int = 2) -> dict[str, Any]:
    return {
        "apiVersion": "kubetrain.io/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": name},
        "spec": {
            "trainer": {"image": "ghcr.io/me/train:1", "command": ["python", script],
                        "args": ["--steps", str(steps), "--save-every", str(save_every),
                                 "--step-seconds", str(step_seconds)]},
            "workers": {"replicas": replicas, "procsPerWorker": 1},
            "checkpoint": {"uri": "checkpoints", "keepLast": 2},
            "runPolicy": {"maxRestarts": 2, "backoffSeconds": 1,
                          "progressDeadlineSeconds": 120},
        },
    }


def trained_steps(folder: Path, name: str) -> list[int]:
    """Every step rank 0 trained, in order, whichever node it ran on."""
    steps = []
    for log in sorted((folder / "runs" / name / "logs").glob("worker-*.log")):
        steps += [int(step) for step in re.findall(r"^own-code step (\d+) ", log.read_text(),
                                                    re.MULTILINE)]
    return steps


def commits(folder: Path, name: str) -> dict[str, int]:
    root = folder / "runs" / name / "checkpoints"
    return {path.parent.parent.name: json.loads(path.read_text())["step"]
            for path in root.glob("*/.kubetrain/commit.json")}


def redone_bound(save_every: int, step_seconds: float) -> int:
    """Steps a kill may cost: a checkpoint interval, plus the steps trained while the
    newest marked folder waited for the entry's next upload pass (a folder marked but not
    yet committed is lost with its node, as on Kubernetes)."""
    return save_every + math.ceil(OWN_CODE_SYNC_SECONDS / step_seconds) + 1


def assert_resumed_from_newest_commit(logged: list[dict[str, Any]]) -> int:
    """The restart resumed from the newest commit the runner saw before the failure."""
    failure = next(i for i, e in enumerate(logged) if e["event"] == "failure")
    committed = [e["step"] for e in logged[:failure] if e["event"] == "checkpoint"]
    resumed = [e["step"] for e in logged if e["event"] == "resumed"]
    failures = [(e["class"], e["reason"]) for e in logged if e["event"] == "failure"]
    assert committed and len(resumed) == 1, (resumed, committed, failures)
    assert resumed[0] >= committed[-1], (resumed, committed)
    return int(resumed[0])


def test_reports_of_the_sdk_become_step_events_and_bad_requests_get_4xx(tmp_path: Path,
                                                                      monkeypatch: Any) -> None:
    received: list[dict[str, Any]] = []
    with LocalStatusEndpoint(tmp_path / "token", received.append) as endpoint:
        for name, value in endpoint.reporter_env().items():
            monkeypatch.setenv(name, value)
        monkeypatch.setenv("RANK", "0")
        reporter = Reporter(min_interval=0.0)
        assert reporter.report(7, total_steps=20, loss=1.25, tokens=700)
        assert reporter.report(8, total_steps=20, loss=1.5, tokens=800)

        def post(body: bytes, token: str | None) -> int:
            headers = {"Authorization": f"Bearer {token}"} if token else {}
            request = urllib.request.Request(endpoint.url, data=body, headers=headers,
                                             method="POST")
            try:
                with urllib.request.urlopen(request, timeout=5) as reply:
                    return int(reply.status)
            except urllib.error.HTTPError as error:
                return error.code

        body = json.dumps({"trainerStatus": {"metrics": [
            {"name": "current_step", "value": "9"}]}}).encode()
        assert post(body, None) == 401
        assert post(body, "another-run's-token") == 403
        assert post(b"not json", endpoint.token) == 400
        assert post(b"{" + b" " * MAX_BODY_BYTES + b"}", endpoint.token) == 413
        assert post(json.dumps({"trainerStatus": {}}).encode(), endpoint.token) == 200
    assert (tmp_path / "token").stat().st_mode & 0o077 == 0
    assert [(e["step"], e["max_steps"], e["loss"]) for e in received] == [(7, 20, 1.25),
                                                                            (8, 20, 1.5)]
    assert received[1]["tokens_per_second"] > 0
    assert endpoint.accepted == 3 and endpoint.refused == 4


def test_goodput_books_the_steps_a_resumed_attempt_trains_again_as_lost_progress(
        tmp_path: Path) -> None:
    log = tmp_path / "metrics.jsonl"
    goodput = ReportedGoodput.resumed(log)  # no log yet: a fresh job
    goodput.attempt(1000.0)
    for step, at in ((1, 1002.0), (10, 1011.0), (20, 1021.0)):
        goodput.stepped({"event": "step", "step": step, "time": at})
    # Lost at step 20; the next attempt resumes from step 15 and reports 16, 20 and 24.
    goodput.attempt(1030.0)
    for step, at in ((16, 1040.0), (20, 1044.0), (24, 1048.0)):
        goodput.stepped({"event": "step", "step": step, "time": at})
    event = goodput.event(1050.0)
    assert event["seconds"] == {"productive": 19 + 4, "lost_progress": 4, "downtime": 23}
    assert event["ratio"] == round(23 / 50, 4) and event["furthest_step"] == 24
    # The next run of the job (stopped at step 24, saved on SIGTERM) picks the totals up and
    # redoes nothing: its wait between the runs is downtime.
    append_event(log, event)
    again = ReportedGoodput.resumed(log)
    again.attempt(1060.0)
    for step, at in ((25, 1065.0), (30, 1070.0)):
        again.stepped({"event": "step", "step": step, "time": at})
    assert again.event(1070.0)["seconds"] == {"productive": 28, "lost_progress": 4,
                                              "downtime": 38}


def test_goodput_counts_every_step_between_the_restored_checkpoint_and_the_furthest_report(
        tmp_path: Path) -> None:
    # As the operator's test: attempt 1 reports 5 and 10 (1 s a step) and is lost; attempt 2
    # resumes from the commit of step 8 and reports 12, 17 and 22. Steps 9 and 10 were
    # redone, though no advance of attempt 2 covers a step attempt 1 reported.
    goodput = ReportedGoodput.resumed(tmp_path / "metrics.jsonl")
    goodput.attempt(1000.0)
    for step, at in ((5, 1005.0), (10, 1010.0)):
        goodput.stepped({"event": "step", "step": step, "time": at})
    goodput.attempt(1020.0, resumed_step=8)
    for step, at in ((12, 1030.0), (17, 1035.0), (22, 1040.0)):
        goodput.stepped({"event": "step", "step": step, "time": at})
    assert goodput.event(1040.0)["seconds"] == {"productive": 15, "lost_progress": 2,
                                                "downtime": 23}


def test_a_command_that_does_not_exist_fails_as_a_user_error_without_a_retry(
        tmp_path: Path) -> None:
    job = own_code_job("missing", str(tmp_path / "no-such-train.py"), steps=5, save_every=5,
                       step_seconds=0)
    code, output = finish(start_run(tmp_path, job), RUN_TIMEOUT)
    assert code == 1, output
    failures = [e for e in events(tmp_path, "missing") if e["event"] == "failure"]
    assert [(f["class"], f["exit_code"]) for f in failures] == [("UserError", 127)], output
    assert "is permanent" in output, output
    # Every worker's entry finds the command missing; the first to say so ends the attempt,
    # and the others may be stopped before they have (worker 0 was, once in CI).
    logs = (tmp_path / "runs" / "missing" / "logs").glob("worker-*.log")
    assert any("no-such-train.py: no such file" in log.read_text() for log in logs), output


@pytest.mark.slow
def test_plain_torch_script_resumes_from_its_uploaded_checkpoint_after_a_lost_worker(
        tmp_path: Path) -> None:
    save_every = 5
    job = own_code_job("plain", str(SCRIPTS / "plain_torch.py"), steps=40,
                       save_every=save_every, step_seconds=0.3)
    code, output = finish(start_run(tmp_path, job, "--kill-worker-at-step", "12"), RUN_TIMEOUT)
    assert code == 0, output
    logged = events(tmp_path, "plain")
    resumed = assert_resumed_from_newest_commit(logged)
    steps = trained_steps(tmp_path, "plain")
    assert resumed >= save_every and resumed % save_every == 0, output
    assert sorted(set(steps)) == list(range(1, 41)), steps
    redone = len(steps) - len(set(steps))
    restart = next(i for i in range(1, len(steps)) if steps[i] <= steps[i - 1])
    assert steps[restart] == resumed + 1 and redone == steps[restart - 1] - resumed
    assert redone <= redone_bound(save_every, 0.3), (redone, steps)
    assert [e["class"] for e in logged if e["event"] == "failure"] == ["NodeLost"]
    # The progress came from sdk.report: step events with the loss, the last one at the end.
    reported = [e for e in logged if e["event"] == "step"]
    assert reported[-1]["step"] == 40 and all("loss" in e for e in reported)
    # The steps redone past the last one reported before the kill are lost progress, not
    # goodput, in the metrics log and the summary.
    failure = next(i for i, e in enumerate(logged) if e["event"] == "failure")
    if max(e["step"] for e in logged[:failure] if e["event"] == "step") > resumed + 1:
        seconds = [e for e in logged if e["event"] == "goodput"][-1]["seconds"]
        assert 0 < seconds["lost_progress"] < seconds["productive"], seconds
        assert "lost progress" in next(line for line in output.splitlines()
                                       if line.strip().startswith("goodput")), output
    assert commits(tmp_path, "plain") == {"step-000035": 35, "step-000040": 40}  # keepLast 2


@pytest.mark.slow
def test_interrupted_own_code_saves_on_sigterm_and_resumes_with_no_step_redone(
        tmp_path: Path) -> None:
    job = own_code_job("stop", str(SCRIPTS / "plain_torch.py"), steps=60, save_every=50,
                       step_seconds=0.3)
    run = start_run(tmp_path, job)
    deadline = time.monotonic() + RUN_TIMEOUT
    log = tmp_path / "runs" / "stop" / "metrics.jsonl"
    while not any(e["event"] == "step" and e["step"] >= 5
                  for e in parse_lines(log.read_text() if log.exists() else "")):
        assert run.poll() is None and time.monotonic() < deadline, run.communicate()[0]
        time.sleep(0.5)
    run.send_signal(signal.SIGINT)
    code, output = finish(run, RUN_TIMEOUT)
    assert code == 130, output
    stopped = trained_steps(tmp_path, "stop")[-1]
    assert commits(tmp_path, "stop") == {f"step-{stopped:06d}": stopped}, output
    code, output = finish(start_run(tmp_path, job), RUN_TIMEOUT)
    assert code == 0, output
    steps = trained_steps(tmp_path, "stop")
    assert [e["step"] for e in events(tmp_path, "stop") if e["event"] == "resumed"] == [stopped]
    assert len(steps) == len(set(steps)) == 60, steps  # no step trained twice


def test_active_deadline_stops_the_run_with_a_checkpoint(tmp_path: Path) -> None:
    """The runner's deadline, whatever the trainer: it stops the run as Ctrl-C does, and
    the trainer saves on SIGTERM. Own code that sleeps through its steps, so the 30 s the
    deadline needs (it counts the start: at 15 s a from-nothing run of 2026-11-29 reached
    it before the first step) are not 30 s of a core taken from the suite's other tests.
    One worker: the deadline is the runner's, whatever the group's size."""
    job = own_code_job("deadline", str(SCRIPTS / "plain_torch.py"), steps=5000,
                       save_every=5000, step_seconds=0.3, replicas=1)
    job["spec"]["runPolicy"]["activeDeadlineSeconds"] = 30
    code, output = finish(start_run(tmp_path, job), RUN_TIMEOUT)
    assert code == 1, output
    assert "running longer than 30s (spec.runPolicy.activeDeadlineSeconds)" in output, output
    stopped = trained_steps(tmp_path, "deadline")
    assert stopped and stopped[-1] < 5000, output
    assert commits(tmp_path, "deadline") == {f"step-{stopped[-1]:06d}": stopped[-1]}, output


@pytest.mark.slow
def test_transformers_trainer_reports_through_kubeflow_callback_and_resumes_after_a_kill(
        tmp_path: Path) -> None:
    save_every = 10
    job = own_code_job("hf", str(SCRIPTS / "hf_trainer.py"), steps=40,
                       save_every=save_every, step_seconds=0.3)
    code, output = finish(start_run(tmp_path, job, "--kill-worker-at-step", "12"), RUN_TIMEOUT)
    assert code == 0, output
    logged = events(tmp_path, "hf")
    reported = [e for e in logged if e["event"] == "step"]
    # transformers' KubeflowCallback, unchanged: the step in current_step, loss and rate.
    assert reported and all({"loss", "lr", "max_steps"} <= set(e) for e in reported), reported
    resumed = assert_resumed_from_newest_commit(logged)
    assert resumed > 0 and resumed % save_every == 0, output
    steps = trained_steps(tmp_path, "hf")
    assert sorted(set(steps)) == list(range(1, 41)), steps
    assert len(steps) - len(set(steps)) <= redone_bound(save_every, 0.3), steps
    assert set(commits(tmp_path, "hf").values()) == {30, 40}


def test_dry_run_shows_the_entry_around_torchrun_here_and_in_the_pod(tmp_path: Path) -> None:
    job = own_code_job("dry", "train.py", steps=5, save_every=5, step_seconds=0)
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    shown = subprocess.run([sys.executable, "-m", "kubetrain", "run", "job.yaml", "--dry-run"],
                           cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    here, _, pod = shown.stdout.partition("# on Kubernetes")
    assert here.count("-m kubetrain.trainer.own_code") == 2  # one per simulated node
    assert "runs/dry/nodes/worker-1/checkpoints" in here and "--nnodes 2:2" in here
    assert "kubetrain.trainer.own_code" in pod and "KUBETRAIN_CHECKPOINT_DIR" in pod
    assert not (tmp_path / "runs" / "dry" / "job.yaml").exists()  # nothing ran
