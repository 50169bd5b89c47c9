"""python -m kubetrain.trainer.own_code: restore first (beside the preflight and torchrun's
import), sync alongside, SIGTERM passed through."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from kubetrain import sdk
from kubetrain.api.manifest import parse_job
from kubetrain.api.trainingjob import PreflightPolicy, StorageSpec
from kubetrain.local.launch import free_port
from kubetrain.sdk.checkpoints import Finished, Mark, ProcessIdentity, stop_marks
from kubetrain.trainer.checkpoint_sync import CheckpointSync, commits
from kubetrain.trainer.own_code import (
    LINGER_SECONDS,
    end_lingering,
    lingering_after_finish,
    prepare,
    start_preflight,
)
from kubetrain.trainer.storage import open_storage

# The user's code: resumes from the restored folder, saves one more step, and on SIGTERM
# saves where it is and exits 143 (a plain script using the SDK, no torch needed).
_SCRIPT = """
import sys, time
from kubetrain import sdk
sdk.stop_requested()
latest = sdk.latest_checkpoint()
step = int((latest / "step.txt").read_text()) if latest else 0
print(f"resumed at {step}", flush=True)
def save(step):
    folder = sdk.checkpoint_dir() / f"step-{step}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "step.txt").write_text(str(step))
    sdk.mark_complete(folder, step)
if sys.argv[1] in ("wait", "linger"):
    print("waiting", flush=True)
    while not sdk.stop_agreed():
        time.sleep(0.05)
    save(step + 1)
    if sys.argv[1] == "linger":  # as a process whose teardown hangs: its thread never ends
        import threading
        threading.Thread(target=time.sleep, args=(600,)).start()
    sys.exit(143)
save(step + 1)
(sdk.checkpoint_dir() / "scratch").mkdir(exist_ok=True)  # never marked
"""


@pytest.fixture
def job_file(tmp_path: Path, s3_bucket: str, s3_endpoint: str) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({
        "apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob",
        "metadata": {"name": "mine"},
        "spec": {"trainer": {"image": "me/train:1", "command": ["python", "train.py"]},
                 "checkpoint": {"uri": f"s3://{s3_bucket}/mine", "keepLast": 2},
                 "storage": {"endpoint": s3_endpoint, "region": "us-east-1"}}}))
    (tmp_path / "train.py").write_text(_SCRIPT)
    return path


def _entry(job_file: Path, pod: Path, mode: str,
           env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    env = {**os.environ, "KUBETRAIN_CHECKPOINT_DIR": str(pod),
           "KUBETRAIN_FINAL_SYNC_SECONDS": "30", **(env or {})}
    return subprocess.Popen(
        [sys.executable, "-m", "kubetrain.trainer.own_code", str(job_file), "--",
         sys.executable, str(job_file.parent / "train.py"), mode],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        cwd=job_file.parent)  # where spec.trainer.command's train.py is


@pytest.mark.timeout(180)
def test_each_attempt_starts_from_the_last_uploaded_checkpoint(
        tmp_path: Path, job_file: Path, s3_bucket: str, s3_spec: StorageSpec) -> None:
    remote = open_storage(f"s3://{s3_bucket}/mine", s3_spec)
    for attempt in range(3):  # a fresh pod each time: nothing local survives
        run = _entry(job_file, tmp_path / f"pod-{attempt}", "once")
        out, err = run.communicate(timeout=120)
        assert run.returncode == 0, err
        assert f"resumed at {attempt}" in out
        assert "scratch was never marked complete" in err
    assert [c.step for c in commits(remote)] == [2, 3]  # keepLast 2


@pytest.mark.timeout(180)
def test_each_resume_is_reported_to_the_status_endpoint_by_worker_zeros_entry(
        tmp_path: Path, job_file: Path) -> None:
    received: list[dict[str, object]] = []

    class Endpoint(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Endpoint)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/status"
    try:
        for attempt, pod in enumerate(("mine-worker-0", "mine-worker-0", "mine-worker-1")):
            run = _entry(job_file, tmp_path / f"pod-{attempt}", "once",
                         {"KUBEFLOW_TRAINER_SERVER_URL": url, "KUBETRAIN_POD_NAME": pod})
            assert run.wait(timeout=120) == 0
    finally:
        server.shutdown()
        server.server_close()
    # The first attempt had nothing to restore; the second resumed from step 1; the third
    # from step 2, but on worker 1, whose entry leaves the report to worker 0's.
    assert [status["trainerStatus"]["metrics"]
            for status in received] == [[{"name": "resumed_step", "value": "1"}]]


@pytest.mark.timeout(180)
def test_sigterm_reaches_the_command_and_its_last_checkpoint_is_uploaded(
        tmp_path: Path, job_file: Path, s3_bucket: str, s3_spec: StorageSpec) -> None:
    run = _entry(job_file, tmp_path / "pod", "wait")
    assert run.stdout is not None
    while "waiting" not in run.stdout.readline():
        assert run.poll() is None, run.stderr.read() if run.stderr else ""
    run.send_signal(signal.SIGTERM)
    assert run.wait(timeout=120) == 143
    remote = open_storage(f"s3://{s3_bucket}/mine", s3_spec)
    assert [c.step for c in commits(remote)] == [1]


@pytest.mark.timeout(180)
def test_a_process_that_lingers_after_its_stop_checkpoint_is_ended_and_the_pod_lets_go(
        tmp_path: Path, job_file: Path, s3_bucket: str, s3_spec: StorageSpec) -> None:
    run = _entry(job_file, tmp_path / "pod", "linger")
    assert run.stdout is not None and run.stderr is not None
    while "waiting" not in run.stdout.readline():
        assert run.poll() is None, run.stderr.read()
    signalled = time.monotonic()
    run.send_signal(signal.SIGTERM)
    # The command saved and marked its stop checkpoint at once, then would have run for
    # 600 s more: it is ended LINGER_SECONDS after its mark, the checkpoint committed.
    assert run.wait(timeout=LINGER_SECONDS + 60) == 143
    released = time.monotonic() - signalled
    assert released < LINGER_SECONDS + 30, released
    assert "has not exited: ending it" in run.stderr.read()
    remote = open_storage(f"s3://{s3_bucket}/mine", s3_spec)
    assert [c.step for c in commits(remote)] == [1]


# Under torchrun: each rank prints its start, rank 0 saves and marks step 7, every rank
# marks its finish; then rank 1 exits and rank 0 hangs in its teardown (a thread that is
# not a daemon and never ends, as a process group's destructor joining its threads).
_FINISHING = """
import os, sys, threading, time
from kubetrain import sdk
rank, attempt = os.environ["RANK"], os.environ["TORCHELASTIC_RESTART_COUNT"]
# One write, line and newline together: the ranks share the pipe, and print's two writes
# (under torchrun's unbuffered output) once came out as both lines and then both newlines.
sys.stdout.write(f"rank {rank} attempt {attempt} started\\n")
sys.stdout.flush()
if rank == "0":
    folder = sdk.checkpoint_dir() / "step-7"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "step.txt").write_text("7")
    sdk.mark_complete(folder, 7)
sdk.mark_finished()
if rank == "0":
    threading.Thread(target=time.sleep, args=(600,)).start()
"""


@pytest.mark.timeout(180)
def test_a_pod_whose_processes_all_finished_exits_0_though_one_hangs_in_its_teardown(
        tmp_path: Path, job_file: Path, s3_bucket: str, s3_spec: StorageSpec) -> None:
    script = tmp_path / "finish.py"
    script.write_text(_FINISHING)
    started = time.monotonic()
    # torchrun may restart its processes in place (a pod's agent does, runPolicy.maxRestarts):
    # the one ended must not count as failed, or the whole attempt would run again.
    run = subprocess.run(
        [sys.executable, "-m", "kubetrain.trainer.own_code", str(job_file), "--",
         sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         "--max-restarts=2", "--monitor-interval=0.1", str(script)],
        env={**os.environ, "KUBETRAIN_CHECKPOINT_DIR": str(tmp_path / "pod"),
             "KUBETRAIN_FINAL_SYNC_SECONDS": "30", "OMP_NUM_THREADS": "1"},
        capture_output=True, text=True, timeout=150, cwd=tmp_path)
    took = time.monotonic() - started
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]
    assert sorted(line for line in run.stdout.splitlines() if "started" in line) == [
        "rank 0 attempt 0 started", "rank 1 attempt 0 started"], run.stdout
    assert "marked its finish (sdk.mark_finished), and rank(s) 0 still run" in run.stderr
    assert took < LINGER_SECONDS + 60, took  # not the 600 s the thread would have held it
    remote = open_storage(f"s3://{s3_bucket}/mine", s3_spec)
    assert [c.step for c in commits(remote)] == [7]  # the last checkpoint, uploaded


# Two pods of one process each: both mark their finish; the rank of the pod named by
# HANG_IN_TEARDOWN then hangs as above, the other exits.
_TWO_PODS_FINISHING = """
import os, sys, threading, time
from kubetrain import sdk
sdk.mark_finished()
if os.environ.get("HANG_IN_TEARDOWN") == "1":
    threading.Thread(target=time.sleep, args=(600,)).start()
"""


@pytest.mark.timeout(240)
def test_a_pod_whose_peer_was_ended_after_its_finish_is_not_held_in_torchruns_exit_barrier(
        tmp_path: Path, job_file: Path) -> None:
    """The pod that hosts the rendezvous store (worker 0) ends cleanly and waits in torchrun's
    exit barrier for the other pod's agent; that pod's rank hangs in its teardown and its
    entry ends it. The ended agent still arrives at the barrier, so worker 0's pod exits 0
    then too, not after the barrier's 300 s."""
    script = tmp_path / "finish.py"
    script.write_text(_TWO_PODS_FINISHING)
    endpoint = f"127.0.0.1:{free_port()}"

    def pod(name: str, hosts: bool) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-m", "kubetrain.trainer.own_code", str(job_file), "--",
             sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
             "--rdzv-backend=kubetrain", f"--rdzv-endpoint={endpoint}", "--rdzv-id=two-pods",
             f"--rdzv-conf=is_host={int(hosts)}", "--max-restarts=2", "--monitor-interval=0.1",
             str(script)],
            env={**os.environ, "KUBETRAIN_CHECKPOINT_DIR": str(tmp_path / name),
                 "HANG_IN_TEARDOWN": str(int(not hosts)), "OMP_NUM_THREADS": "1"},
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)

    started = time.monotonic()
    pods = {"worker-0": pod("worker-0", hosts=True), "worker-1": pod("worker-1", hosts=False)}
    ended = {}
    try:
        for name, process in pods.items():
            output = process.communicate(timeout=200)
            ended[name] = (process.returncode, time.monotonic() - started, output)
    finally:
        for process in pods.values():
            process.kill()
    for name, (code, took, (out, err)) in ended.items():
        assert code == 0, f"{name} exited {code}:\n{out}{err[-4000:]}"
        assert took < LINGER_SECONDS + 60, f"{name} took {took:.0f} s:\n{err[-4000:]}"
    assert "marked its finish (sdk.mark_finished), and rank(s)" in ended["worker-1"][2][1]


def test_processes_are_ended_after_their_finish_only_when_the_whole_pod_finished(
        tmp_path: Path) -> None:
    def process(*argv: str) -> subprocess.Popen[str]:
        return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", *argv])

    first, second = process(), process()
    try:
        identities = [ProcessIdentity.of(child.pid) for child in (first, second)]

        def finish(local_rank: int, attempt: int, at: float) -> Finished:
            return Finished(rank=local_rank, local_rank=local_rank, local_world_size=2,
                            attempt=attempt, process=identities[local_rank], time=at)

        one = [finish(0, 0, 100.0)]
        # Rank 1 has not finished (it may still be saving): nobody is ended.
        assert lingering_after_finish(one, 1000.0) == []
        both = [*one, finish(1, 0, 105.0)]
        # Both finished: ended LINGER_SECONDS after the last mark, not before.
        assert lingering_after_finish(both, 105.0 + LINGER_SECONDS - 1) == []
        assert lingering_after_finish(both, 105.0 + LINGER_SECONDS + 1) == both
        # A mark of an earlier attempt (torchrun restarted the processes since) counts for
        # nothing: rank 1 of the new attempt has not finished.
        assert lingering_after_finish([finish(0, 1, 200.0), finish(1, 0, 105.0)], 1000.0) == []
        # A process that has exited is not ended.
        second.kill()
        second.wait()
        assert lingering_after_finish(both, 1000.0) == [both[0]]
    finally:
        for child in (first, second):
            child.kill()
            child.wait()


def test_only_a_process_past_its_stop_mark_is_ended(tmp_path: Path) -> None:
    lingering = subprocess.Popen([sys.executable, "-c", _MARKS_AND_SLEEPS, str(tmp_path), "stop"],
                                 stdout=subprocess.PIPE, text=True)
    training = subprocess.Popen([sys.executable, "-c", _MARKS_AND_SLEEPS, str(tmp_path), "save"],
                                stdout=subprocess.PIPE, text=True)
    try:
        for child in (lingering, training):
            assert child.stdout is not None and child.stdout.readline().strip() == "marked"
        (stop,) = stop_marks(tmp_path)
        assert stop.process is not None and stop.process.pid == lingering.pid
        ended: set[Mark] = set()
        # Within the linger time nothing is ended; after it only the stop mark's process.
        assert end_lingering(tmp_path, stop.time + LINGER_SECONDS - 1, ended) == []
        assert end_lingering(tmp_path, stop.time + LINGER_SECONDS + 1, ended) == [stop]
        assert lingering.wait(timeout=10) == -signal.SIGKILL
        assert training.poll() is None  # a periodic save's mark ends nobody
        assert end_lingering(tmp_path, stop.time + 3600, ended) == []  # never twice
    finally:
        for child in (lingering, training):
            child.kill()
            child.wait()


# Marks a checkpoint folder (after agreeing to stop, with "stop") and then sleeps.
_MARKS_AND_SLEEPS = """
import os, signal, sys, time
from pathlib import Path
from kubetrain import sdk
sdk.stop_requested()
if sys.argv[2] == "stop":
    os.kill(os.getpid(), signal.SIGTERM)
    assert sdk.stop_agreed()
folder = Path(sys.argv[1]) / f"{sys.argv[2]}-5"
folder.mkdir()
sdk.mark_complete(folder, 5)
print("marked", flush=True)
time.sleep(600)
"""


def test_the_entry_module_loads_no_torch_so_the_restore_starts_first() -> None:
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys, kubetrain.trainer.own_code; "
         "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"],
        capture_output=True, text=True, timeout=120, check=True)
    assert loaded.stdout.strip() == "[]", loaded.stdout


@pytest.mark.timeout(180)
def test_the_restore_preflight_and_torchruns_import_are_done_before_the_command(
        tmp_path: Path, s3_bucket: str, s3_spec: StorageSpec,
        monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_WORLD_SIZE", "1"),
                        ("GROUP_RANK", "0"), ("GROUP_WORLD_SIZE", "2")):
        monkeypatch.setenv(name, value)  # pod 0 of 2 writes its part of a sharded save
    remote = open_storage(f"s3://{s3_bucket}/mine", s3_spec)
    shards = {f"__{rank}_0.distcp": os.urandom(2000 + rank) for rank in range(12)}
    folder = tmp_path / "old-pod" / "step-40"
    folder.mkdir(parents=True)
    for name, data in shards.items():
        (folder / name).write_bytes(data)
    sdk.mark_complete(folder, 40, sharded=True)
    monkeypatch.setenv("GROUP_RANK", "1")  # ...and pod 1, an empty part, commits it
    other = tmp_path / "other-pod" / "step-40"
    other.mkdir(parents=True)
    sdk.mark_complete(other, 40, sharded=True)
    monkeypatch.setenv("GROUP_RANK", "0")
    CheckpointSync(tmp_path / "other-pod", remote, keep_last=2).sync_once()
    CheckpointSync(tmp_path / "old-pod", remote, keep_last=2).sync_once()
    assert [c.step for c in commits(remote)] == [40]

    job = parse_job({"apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob",
                     "metadata": {"name": "mine"},
                     "spec": {"trainer": {"image": "me/train:1", "command": ["train.py"]},
                              "checkpoint": {"uri": f"s3://{s3_bucket}/mine"}}})
    pod = tmp_path / "new-pod"
    prepared = prepare(job, ["torchrun", "train.py"], pod, remote, None)
    assert prepared.exit_code is None and prepared.restored == pod / "step-40"
    assert {path.name: path.read_bytes() for path in prepared.restored.glob("*.distcp")
            } == shards
    assert prepared.seconds is not None
    assert set(prepared.seconds) == {"torchrun import", "preflight", "restore"}


@pytest.mark.timeout(120)
def test_where_a_gpu_is_visible_the_preflight_runs_in_a_child_process_and_passes() -> None:
    # The path a GPU pod takes (so that no device context stays in the entry), run on this
    # machine's devices: a spawned child that checks them and answers through a queue.
    verdict = start_preflight(PreflightPolicy(timeout_seconds=60), 1, in_child=True)
    assert verdict() == ("", [])
