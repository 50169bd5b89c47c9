"""spec.trainer (own code): how its command becomes torchrun's, and what the CLI says of it."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from kubetrain.api import InvalidManifest, parse_job
from kubetrain.cli import main


@pytest.fixture
def own_code_manifest(minimal_manifest: dict[str, Any]) -> dict[str, Any]:
    document = copy.deepcopy(minimal_manifest)
    for typed in ("image", "model", "data"):
        del document["spec"][typed]
    document["spec"]["trainer"] = {"image": "ghcr.io/me/train:1", "command": ["python", "t.py"]}
    return document


def _with_command(document: dict[str, Any], command: list[str],
                  args: list[str] | None = None) -> dict[str, Any]:
    document["spec"]["trainer"].update({"command": command, "args": args or []})
    return document


@pytest.mark.parametrize(("command", "args", "torchrun"), [
    (["python", "train.py"], ["--lr", "1e-4"], ["train.py", "--lr", "1e-4"]),
    (["/usr/bin/python3.12", "-u", "train.py"], [], ["train.py"]),
    (["python3", "-m", "pkg.train"], ["--x"], ["-m", "pkg.train", "--x"]),
    (["torchrun", "--log-dir=/tmp/logs", "train.py"], [], ["--log-dir=/tmp/logs", "train.py"]),
    (["python", "-m", "torch.distributed.run", "train.py"], [], ["train.py"]),
    (["/bin/train"], ["--steps", "10"], ["--no-python", "/bin/train", "--steps", "10"]),
    (["bash", "-c", "exec ./run.sh"], [], ["--no-python", "bash", "-c", "exec ./run.sh"]),
])
def test_a_command_becomes_torchruns_program(
        own_code_manifest: dict[str, Any], command: list[str], args: list[str],
        torchrun: list[str]) -> None:
    trainer = parse_job(_with_command(own_code_manifest, command, args)).spec.trainer
    assert trainer is not None and trainer.torchrun_arguments() == torchrun


@pytest.mark.parametrize(("command", "named"), [
    (["torchrun", "--nproc-per-node=8", "train.py"], "--nproc-per-node"),
    (["torchrun", "--nnodes", "2", "train.py"], "--nnodes"),
    (["python", "-m", "torch.distributed.run", "--standalone", "t.py"], "--standalone"),
    (["python", "-c", "print(1)"], "without a script"),
    (["python"], "without a script"),
])
def test_a_command_torchrun_cannot_launch_as_the_job_is_refused(
        own_code_manifest: dict[str, Any], command: list[str], named: str) -> None:
    with pytest.raises(InvalidManifest) as refused:
        parse_job(_with_command(own_code_manifest, command))
    assert "spec.trainer.command" in str(refused.value) and named in str(refused.value)


def test_an_own_code_job_has_no_data_and_runs_its_own_image(
        own_code_manifest: dict[str, Any]) -> None:
    spec = parse_job(own_code_manifest).spec
    assert spec.own_code and spec.data is None and spec.image is None
    assert spec.trainer is not None and spec.trainer.image == "ghcr.io/me/train:1"
    assert not parse_job({**own_code_manifest, "spec": {
        **{k: v for k, v in own_code_manifest["spec"].items() if k != "trainer"},
        "image": "i", "data": {"train": "s3://d"}}}).spec.own_code


def _written(tmp_path: Path, document: dict[str, Any]) -> str:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(document))
    return str(path)


def test_validate_says_what_applies_to_an_own_code_job(
        tmp_path: Path, own_code_manifest: dict[str, Any],
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", _written(tmp_path, own_code_manifest)]) == 0
    out = capsys.readouterr().out
    assert "is valid" in out and "`torchrun t.py` in ghcr.io/me/train:1" in out
    assert "applies: workers, runPolicy, checkpoint.uri" in out


def test_validate_names_both_kinds_when_a_job_sets_both(
        tmp_path: Path, own_code_manifest: dict[str, Any],
        capsys: pytest.CaptureFixture[str]) -> None:
    own_code_manifest["spec"]["data"] = {"train": "s3://datasets/train"}
    assert main(["validate", _written(tmp_path, own_code_manifest)]) == 1
    err = capsys.readouterr().err
    assert "spec.trainer: and spec.data are both set" in err


def test_estimate_says_it_cannot_size_own_code_instead_of_failing(
        tmp_path: Path, own_code_manifest: dict[str, Any],
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", _written(tmp_path, own_code_manifest)]) == 2
    captured = capsys.readouterr()
    assert "cannot size its memory" in captured.err and "Traceback" not in captured.err
