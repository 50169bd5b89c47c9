"""Packaging promises: the operator side stays torch-free, the stdlib is never shadowed,
every command answers --help, and a command whose extra is missing names it."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

from kubetrain.cli import COMMANDS, EXTRA_MODULES

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


def test_an_own_code_pods_entry_loads_torchrun_and_the_device_check_not_fsdp() -> None:
    """What an own-code pod's entry imports before the user's command starts: torch,
    torchrun's agent and the preflight's device check, never FSDP, DTensor or sympy (the
    training loop's), which took 1.2-1.5 s of a core in every pod start while the device
    check reached them through rank_timing."""
    loaded = _python(
        "import sys, torch.distributed.run, kubetrain.trainer.own_code, "
        "kubetrain.trainer.preflight; print(sorted({m for m in sys.modules if m.startswith("
        "('torch.distributed.fsdp', 'torch.distributed.tensor', 'sympy'))}))")
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


def _distribution(requirement: str) -> str:
    """The normalized distribution name of a requirement such as `prometheus-client>=0.20`."""
    name = re.match(r"[A-Za-z0-9._-]+", requirement)
    assert name, requirement
    return re.sub(r"[-_.]+", "-", name[0]).lower()


@pytest.mark.parametrize("extra", sorted(EXTRA_MODULES))
def test_the_modules_the_cli_checks_are_those_the_extra_installs(extra: str) -> None:
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    declared = {_distribution(requirement) for requirement in extras[extra]}
    providers = packages_distributions()  # this environment has every extra installed
    checked = {_distribution(d) for module in EXTRA_MODULES[extra] for d in providers[module]}
    assert checked == declared


def _without_extras(*argv: str) -> subprocess.CompletedProcess[str]:
    """`kubetrain ARGV...` with every extra's modules made unimportable, as in a base install."""
    blocked = sorted({module for modules in EXTRA_MODULES.values() for module in modules})
    program = (f"import sys; sys.modules.update(dict.fromkeys({blocked!r}))\n"
               "from kubetrain.cli import main\n"
               f"sys.exit(main({list(argv)!r}))\n")
    return subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          cwd=REPO, timeout=60)


@pytest.mark.parametrize("command", sorted(c for c, spec in COMMANDS.items() if spec.extra))
def test_a_command_whose_extra_is_missing_says_which_to_install(command: str) -> None:
    result = _without_extras(command, "examples/quickstart.yaml")
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    extra = COMMANDS[command].extra
    assert f"kubetrain {command} needs the {extra} extra" in result.stderr
    assert f"pip install 'kubetrain[{extra}]'" in result.stderr


@pytest.mark.parametrize("command", sorted(c for c, spec in COMMANDS.items() if not spec.extra))
def test_commands_of_the_base_install_need_no_extra(command: str) -> None:
    result = _without_extras(command, "--help")
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"kubetrain {command}" in result.stdout
