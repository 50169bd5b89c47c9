"""Own code's exit codes and preflight reach the restart policy through the real entry.

Each test runs `kubetrain run` on a small own-code script, as a user would: kubetrain's entry
around a real torchrun agent, whose processes exit with the script's codes. torchrun's
program would end with 1 whatever they exited with; the entry passes the telling code on
and writes the out-of-memory class into the termination message, so the runner (the same
rules and the same termination-message parser as the operator's) classes the failure.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from kubetrain.local.metrics_log import parse_lines
from kubetrain.trainer.own_code import WorkerExit, agent_arguments, deciding_exit

RUN_TIMEOUT = 240

# Rank 1 exits with the code given; rank 0 waits to be stopped by the agent (a peer
# that did nothing wrong). With `--oom-once`, both exit 87 until the job has run out of
# memory once, and print the micro-batch kubetrain.sdk gives them.
_SCRIPT = """
import os, sys, time
from kubetrain import sdk
rank = int(os.environ["RANK"])
# One write, so the ranks' lines never interleave (print writes the newline apart).
os.write(1, f"rank {rank} micro-batch {sdk.micro_batch_size(8)}\\n".encode())
if sys.argv[1] == "--oom-once":
    sys.exit(87 if os.environ["KUBETRAIN_OUT_OF_MEMORY_RESTARTS"] == "0" else 0)
if rank == 1:
    sys.exit(int(sys.argv[1]))
time.sleep(60)
"""


def _job(name: str, script: Path, argument: str, **run_policy: Any) -> dict[str, Any]:
    return {
        "apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob",
        "metadata": {"name": name},
        "spec": {
            "trainer": {"image": "ghcr.io/me/train:1", "command": ["python", str(script)],
                        "args": [argument]},
            "workers": {"replicas": 1, "procsPerWorker": 2},
            "checkpoint": {"uri": "checkpoints"},
            "runPolicy": {"maxRestarts": 2, "backoffSeconds": 1, **run_policy},
        },
    }


def _run(folder: Path, manifest: dict[str, Any]) -> tuple[int, str, list[dict[str, Any]]]:
    (folder / "job.yaml").write_text(yaml.safe_dump(manifest))
    run = subprocess.run([sys.executable, "-m", "kubetrain", "run", "job.yaml"], cwd=folder,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         timeout=RUN_TIMEOUT)
    name = manifest["metadata"]["name"]
    logged = parse_lines((folder / "runs" / name / "metrics.jsonl").read_text())
    return run.returncode, run.stdout, logged


def _failures(logged: list[dict[str, Any]]) -> list[tuple[str, int]]:
    return [(e["class"], e["exit_code"]) for e in logged if e["event"] == "failure"]


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text(_SCRIPT)
    return path


def test_a_process_exiting_2_fails_the_job_as_a_user_error_without_a_retry(
        tmp_path: Path, script: Path) -> None:
    code, output, logged = _run(tmp_path, _job("exits-2", script, "2"))
    assert code == 1, output
    assert _failures(logged) == [("UserError", 2)], output
    assert "is permanent" in output
    assert "rank 1 exited with code 2" in (
        tmp_path / "runs" / "exits-2" / "logs" / "worker-0.log").read_text()


def test_a_retried_code_other_than_1_reaches_the_policy_as_it_was(
        tmp_path: Path, script: Path) -> None:
    code, output, logged = _run(tmp_path, _job("exits-3", script, "3", maxRestarts=1))
    assert code == 1, output
    assert _failures(logged) == [("Unknown", 3), ("Unknown", 3)], output


def test_exit_87_is_out_of_memory_and_the_next_attempt_gets_half_the_micro_batch(
        tmp_path: Path, script: Path) -> None:
    code, output, logged = _run(tmp_path, _job("oom", script, "--oom-once"))
    assert code == 0, output
    assert _failures(logged) == [("CUDAOutOfMemory", 87)], output
    worker_log = (tmp_path / "runs" / "oom" / "logs" / "worker-0.log").read_text()
    # The micro-batches each attempt's ranks printed: a rank the agent stops once its peer
    # ran out of memory may not have printed yet, so any rank's line counts for its attempt.
    attempts = worker_log.split("=== kubetrain run: attempt ")[1:]
    seen = [{line.rpartition(" ")[2] for line in attempt.splitlines()
             if line.startswith("rank ") and " micro-batch " in line} for attempt in attempts]
    assert seen == [{"8"}, {"4"}], worker_log


def test_the_preflight_runs_before_the_command_and_can_be_turned_off(
        tmp_path: Path, script: Path) -> None:
    checked = tmp_path / "checked"
    checked.mkdir()
    code, output, _ = _run(checked, _job("checked", script, "--oom-once"))
    assert code == 0, output
    log = (checked / "runs" / "checked" / "logs" / "worker-0.log").read_text()
    assert log.index("preflight: 2 device(s) passed") < log.index("rank 0 micro-batch")
    unchecked = tmp_path / "unchecked"
    unchecked.mkdir()
    code, output, _ = _run(unchecked, _job("unchecked", script, "--oom-once",
                                           preflight={"enabled": False}))
    assert code == 0, output
    assert "preflight" not in (
        unchecked / "runs" / "unchecked" / "logs" / "worker-0.log").read_text()


def test_the_pod_exits_with_the_telling_code_before_the_first_failure() -> None:
    # A peer's collective breaking (1) or the agent's SIGTERM (143) says less than the
    # code that caused them, even when it was recorded later.
    exits = [WorkerExit(0, 1, 10.0), WorkerExit(1, 143, 10.0), WorkerExit(2, 87, 11.0)]
    assert deciding_exit(exits).exit_code == 87
    assert deciding_exit([WorkerExit(1, 1, 11.0), WorkerExit(0, 1, 12.0)]).rank == 1
    assert deciding_exit([WorkerExit(1, 2, 11.0), WorkerExit(0, 3, 11.0)]).rank == 0


def test_only_torchrun_runs_in_the_entry() -> None:
    assert agent_arguments(["torchrun", "--nnodes", "1", "train.py"]) == [
        "--nnodes", "1", "train.py"]
    assert agent_arguments(["/usr/bin/python3", "-m", "torch.distributed.run", "x.py"]) == [
        "x.py"]
    assert agent_arguments(["python", "train.py", "torchrun"]) is None


def test_the_upload_interval_comes_from_kubetrain_sync_seconds_and_a_bad_one_is_refused(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from kubetrain.trainer.own_code import SYNC_INTERVAL_SECONDS, SYNC_SECONDS_ENV, _arguments

    monkeypatch.delenv(SYNC_SECONDS_ENV, raising=False)
    assert _arguments(["job.yaml", "--", "train"]).sync_interval == SYNC_INTERVAL_SECONDS
    monkeypatch.setenv(SYNC_SECONDS_ENV, "1.5")
    assert _arguments(["job.yaml", "--", "train"]).sync_interval == 1.5
    assert _arguments(["--sync-interval", "3", "job.yaml", "--", "train"]).sync_interval == 3
    for bad, said in (("soon", f"{SYNC_SECONDS_ENV} must be a number"), ("0", "above 0")):
        monkeypatch.setenv(SYNC_SECONDS_ENV, bad)
        with pytest.raises(SystemExit) as exited:
            _arguments(["job.yaml", "--", "train"])
        assert exited.value.code == 2 and said in capsys.readouterr().err
