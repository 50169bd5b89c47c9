"""`kubetrain run --dry-run` and the simulated node's process handling (kubetrain.local)."""

from __future__ import annotations

import shutil
import socket
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from kubetrain.api.manifest import parse_job
from kubetrain.cli import main
from kubetrain.local.launch import AgentLaunch, free_port
from kubetrain.local.node import Node, descendants
from kubetrain.local.workspace import PREPARE_FROM_ANNOTATION, Workspace
from kubetrain.run import ensure_data
from kubetrain.trainer.prepare import TOKENIZER_NAME


@pytest.fixture
def job_file(tmp_path: Path, minimal_manifest: dict[str, Any]) -> Path:
    manifest = minimal_manifest
    manifest["spec"]["workers"] = {"replicas": 3, "minReplicas": 2, "maxReplicas": 8,
                                   "procsPerWorker": 2}
    manifest["spec"]["data"] = {"train": "data/train"}
    manifest["spec"]["checkpoint"] = {"uri": "s3://checkpoints/demo"}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(manifest))
    return path


def test_dry_run_shows_each_node_and_the_operators_pod(
        job_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--dry-run", str(job_file)]) == 0
    out = capsys.readouterr().out
    local, _, pod_text = out.partition("# on Kubernetes")
    (nnodes_row,) = [line.split() for line in local.splitlines() if line.startswith("#   --nnodes")]
    assert nnodes_row == ["#", "--nnodes", "2:3", "2:8"]  # here and in the Pod, side by side
    for index in range(3):
        assert f"# simulated node {index}" in local
    # Locally the group never grows past replicas; the pod allows up to maxReplicas.
    assert local.count("\n  --nnodes 2:3 ") == 3
    assert local.count("--nproc-per-node 2") == 3
    # torchrun's files go to the run folder here; in the Pod, to the container's /tmp.
    (log_dir_row,) = [line.split() for line in local.splitlines()
                      if line.startswith("#   --log-dir")]
    assert log_dir_row == ["#", "--log-dir", "runs/demo/logs/torchrun", "-"]
    assert "-m kubetrain.trainer.launch runs/demo/job.yaml" in local
    assert "\n  runs/demo/job.yaml \\\n  --metrics-log" in local
    pod = yaml.safe_load(pod_text.partition("\n")[2])
    assert pod["kind"] == "Pod"
    assert pod["metadata"]["name"] == "demo-worker-0"
    env = {var["name"]: var.get("value") for var in pod["spec"]["containers"][0]["env"]}
    assert env["PET_NNODES"] == "2:8"
    assert env["PET_NPROC_PER_NODE"] == "2"


def _dry_run_of_groups(job_file: Path, capsys: pytest.CaptureFixture[str], procs: int,
                       **spec: Any) -> tuple[str, list[str]]:
    """`kubetrain run --dry-run` of the job in 2 replica groups of 2 pods (with `spec` on
    top): what it shows for here, and each simulated node's part of it, each checked for
    its group's variables."""
    manifest = yaml.safe_load(job_file.read_text())
    manifest["spec"]["workers"] = {"replicas": 4, "procsPerWorker": procs}
    manifest["spec"]["faultTolerance"] = {"replicaGroups": 2}
    manifest["spec"].update(spec)
    for typed in ("data", "image", "model") if "trainer" in spec else ():
        del manifest["spec"][typed]
    job_file.write_text(yaml.safe_dump(manifest))
    assert main(["run", "--dry-run", str(job_file)]) == 0
    local = capsys.readouterr().out.partition("# on Kubernetes")[0]
    nodes = local.split("# simulated node ")[1:]
    assert len(nodes) == 4
    for index, node in enumerate(nodes):
        group = index // 2  # 2 pods a group: a torchrun group of 2 nodes
        assert f"KUBETRAIN_REPLICA_GROUP={group} " in node
        assert "TORCHFT_LIGHTHOUSE='http://127.0.0.1:<port>'" in node
        assert f"--rdzv-id 'demo-<pid>-<attempt>-group-{group}-<restart>'" in node
    return local, nodes


def test_dry_run_of_replica_groups_shows_each_groups_rendezvous_and_variables(
        job_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    local, nodes = _dry_run_of_groups(job_file, capsys, procs=2)
    assert "restarts a failed replica group alone" in local
    for index, node in enumerate(nodes):
        assert "--nnodes 2:2" in node
        assert f"--metrics-log runs/demo/metrics.group-{index // 2}.jsonl" in node


def test_dry_run_of_an_own_code_jobs_replica_groups_shows_each_groups_variables(
        job_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    local, nodes = _dry_run_of_groups(
        job_file, capsys, procs=1,
        trainer={"image": "example.com/mine:1", "command": ["train.py"]})
    assert "a failed group restarts alone" in local
    for index, node in enumerate(nodes):
        assert f"status-token-group-{index // 2}" in node, "each group reports on its own"


def test_dry_run_never_prints_credentials(
        job_file: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    secret = "wJalrXUtnFEMI-not-a-real-key"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    assert main(["run", "--dry-run", str(job_file)]) == 0
    assert secret not in capsys.readouterr().out


def test_relative_paths_live_under_the_run_folder(job_file: Path) -> None:
    manifest = yaml.safe_load(job_file.read_text())
    manifest["spec"]["model"]["init"] = "../first/checkpoints/export"
    job = parse_job(manifest)
    local = Workspace.of(job).localize(job)
    assert local.spec.data.train == str(Path("runs/demo/data/train"))
    assert local.spec.checkpoint.uri == "s3://checkpoints/demo"
    assert local.spec.model.init == str(Path("runs/demo/../first/checkpoints/export"))


def test_a_relative_distillation_teacher_lives_under_the_run_folder(job_file: Path) -> None:
    manifest = yaml.safe_load(job_file.read_text())
    manifest["spec"]["distillation"] = {"teacher": "teacher/export", "alpha": 0.3}
    job = parse_job(manifest)
    local = Workspace.of(job).localize(job).spec.distillation
    assert local is not None and local.alpha == 0.3
    assert local.teacher == str(Path("runs/demo/teacher/export"))


def test_invalid_manifest_is_reported_with_its_field(
        job_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    manifest = yaml.safe_load(job_file.read_text())
    manifest["spec"]["workers"]["minReplicas"] = 5
    manifest["spec"]["workers"]["maxReplicas"] = 8
    job_file.write_text(yaml.safe_dump(manifest))
    assert main(["run", str(job_file)]) == 2
    assert "spec.workers.minReplicas (5)" in capsys.readouterr().err


def test_missing_data_fails_before_any_worker_starts(
        job_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    manifest = yaml.safe_load(job_file.read_text())
    manifest["spec"]["metrics"] = {"port": free_port()}
    job_file.write_text(yaml.safe_dump(manifest))
    assert main(["run", str(job_file)]) == 1
    err = capsys.readouterr().err
    assert "runs/demo/data/train" in err and "kubetrain prepare" in err
    assert not (tmp_path / "runs" / "demo" / "logs").exists()


def test_a_metrics_port_in_use_is_refused(
        job_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as listener:
        listener.bind(("", 0))
        listener.listen()
        manifest = yaml.safe_load(job_file.read_text())
        manifest["spec"]["metrics"] = {"port": listener.getsockname()[1]}
        job_file.write_text(yaml.safe_dump(manifest))
        assert main(["run", str(job_file)]) == 1
    assert "already in use" in capsys.readouterr().err


def test_a_suspended_job_does_not_run(
        job_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    manifest = yaml.safe_load(job_file.read_text())
    manifest["spec"]["runPolicy"] = {"suspend": True}
    job_file.write_text(yaml.safe_dump(manifest))
    assert main(["run", str(job_file)]) == 1
    assert "suspended" in capsys.readouterr().err


def test_losing_a_node_kills_its_processes_in_their_own_sessions(tmp_path: Path) -> None:
    # Like torchrun: the agent starts its worker in a new session, which a process-group
    # kill of the agent would miss.
    agent = ("import subprocess, sys, time\n"
             "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'],"
             " start_new_session=True)\n"
             "time.sleep(60)\n")
    launch = AgentLaunch(0, [sys.executable, "-c", agent], {})
    with (tmp_path / "node.log").open("wb") as log:
        node = Node(launch, cwd=tmp_path, log=log)
        deadline = time.monotonic() + 10
        while not descendants(node.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        (worker,) = descendants(node.pid)
        node.lose()
    assert node.poll() == -9
    deadline = time.monotonic() + 5
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(worker)


def _alive(pid: int) -> bool:
    # A killed child of a dead agent is reaped by init; until then it is a zombie.
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.mark.parametrize("model_fields", ["init", "fromTeacher"])
def test_a_model_init_job_is_prepared_with_the_models_own_tokenizer(
        tmp_path: Path, minimal_manifest: dict[str, Any], prepared_corpus: Any,
        model_fields: str) -> None:
    """And a student sized from its teacher (model.fromTeacher), with the teacher's."""
    model = tmp_path / "model"  # a pretrained folder: its tokenizer is what matters here
    model.mkdir()
    shutil.copyfile(prepared_corpus.tokenizer_uri.removeprefix("file://"),
                    model / TOKENIZER_NAME)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.py").write_text("def add(a, b):\n    return a + b\n" * 50)
    manifest = minimal_manifest
    manifest["metadata"]["annotations"] = {PREPARE_FROM_ANNOTATION: str(corpus)}
    if model_fields == "init":
        manifest["spec"]["model"] = {"preset": "custom", "init": str(model)}
    else:
        manifest["spec"]["model"] = {"architecture": "ssm", "fromTeacher": True}
        manifest["spec"]["distillation"] = {"teacher": str(model)}
    manifest["spec"]["data"] = {"train": str(tmp_path / "data" / "train")}
    job = parse_job(manifest)
    assert ensure_data(job, Workspace(tmp_path / "run")) == str(corpus)
    assert (tmp_path / "data" / TOKENIZER_NAME).read_bytes() == (
        model / TOKENIZER_NAME).read_bytes()


def test_dry_run_lays_out_its_table_whatever_the_run_folder_is_named(
        job_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The side-by-side table knows where torchrun's options end from the launch itself,
    not by looking for the first word that is no option: a run folder whose name starts
    with a dash (every path after the options then does) still gets its table."""
    from kubetrain.run import dry_run

    monkeypatch.chdir(tmp_path)
    job = parse_job(yaml.safe_load(job_file.read_text()))
    workspace = Workspace(Path("-runs") / "demo")
    out = dry_run(job, workspace.localize(job), workspace)
    (program_row,) = [line for line in out.splitlines() if line.startswith("#   program")]
    assert "-m kubetrain.trainer.launch -runs/demo/job.yaml" in program_row
    (nnodes_row,) = [line.split() for line in out.splitlines() if line.startswith("#   --nnodes")]
    assert nnodes_row == ["#", "--nnodes", "2:3", "2:8"]
