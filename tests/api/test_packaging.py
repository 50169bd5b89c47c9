"""Packaging promises: the operator side stays torch-free, the stdlib is never shadowed,
and every command answers --help."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kubetrain.cli import COMMANDS

REPO = Path(__file__).resolve().parents[2]


def _python(code: str, *flags: str) -> str:
    result = subprocess.run([sys.executable, *flags, "-c", code], cwd=REPO, check=True,
                            capture_output=True, text=True)
    return result.stdout.strip()


@pytest.mark.parametrize("module", ["kubetrain.operator", "kubetrain.operator.command",
                                    "kubetrain.api", "kubetrain.validate", "kubetrain.cli"])
def test_operator_side_imports_no_torch(module: str) -> None:
    loaded = _python(f"import sys, {module}; print(sorted(m for m in sys.modules "
                     "if m.split('.')[0] in {'torch', 'numpy', 'boto3'}))")
    assert loaded == "[]"


@pytest.mark.parametrize("flags", [(), ("-S",)], ids=["site", "no-site"])
def test_operator_folder_does_not_shadow_the_standard_library(flags: tuple[str, ...]) -> None:
    # Run from the repository root, where a top-level operator/__init__.py would win.
    path = _python("import operator; print(operator.__file__)", *flags)
    assert Path(path).parent != REPO / "operator"
    assert not path.startswith(str(REPO))


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_has_help(command: str) -> None:
    result = subprocess.run([sys.executable, "-m", "kubetrain", command, "--help"],
                            capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert f"kubetrain {command}" in result.stdout


def test_validate_exit_code_reflects_problems(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text((REPO / "examples" / "gpu-single-node.yaml").read_text()
                   .replace("replicas: 1", "replicas: 0"))
    result = subprocess.run([sys.executable, "-m", "kubetrain", "validate", str(bad)],
                            capture_output=True, text=True)
    assert result.returncode == 1
    assert "spec.workers.replicas" in result.stderr
    good = subprocess.run([sys.executable, "-m", "kubetrain", "validate",
                           *map(str, sorted((REPO / "examples").glob("*.yaml")))],
                          capture_output=True, text=True)
    assert good.returncode == 0, good.stderr


def test_version_matches_the_distribution() -> None:
    from importlib.metadata import version

    out = subprocess.run([sys.executable, "-m", "kubetrain", "version"],
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == f"kubetrain {version('kubetrain')}"
