"""The base install, as a user gets it: a fresh virtual environment, `pip install .`
with no extras, and no torch anywhere.

The base dependencies are held at their declared lower bounds (a constraints file
made from pyproject.toml), as in `make lowest`, so the bare install is proven at the
oldest releases a user may have. `kubetrain validate`, `crd` and `estimate` must
work; `run` and `operator` must say which extra to install.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

from kubetrain.cli import EXTRA_MODULES

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))


def _lower_bounds() -> list[str]:
    """`name==X` for every base dependency declared as `name>=X`."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    pins = []
    for requirement in project["dependencies"]:
        bound = re.fullmatch(r"([A-Za-z0-9_.-]+)>=([0-9.]+)", requirement.replace(" ", ""))
        assert bound, f"{requirement}: a base dependency should be declared as name>=X"
        pins.append(f"{bound[1]}=={bound[2]}")
    return pins


@pytest.fixture(scope="module")
def base_install(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A venv with `pip install .` and the base dependencies at their lower bounds."""
    root = tmp_path_factory.mktemp("base-install")
    constraints = root / "lower-bounds.txt"
    constraints.write_text("\n".join(_lower_bounds()) + "\n")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    # pip's own cache and configuration (indexes) apply, as for a user.
    install = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet",
         "--disable-pip-version-check", "-c", str(constraints), str(REPO)],
        capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stderr[-3000:]
    yield venv


def _kubetrain(venv: Path, *argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    # Run outside the checkout, so only the installed package can be imported.
    return subprocess.run([str(venv / "bin" / "kubetrain"), *argv], capture_output=True,
                          text=True, cwd=cwd, timeout=120)


def _release(version: str) -> tuple[int, ...]:
    """`2.11.0` and `2.11` are the same release."""
    parts = [int(part) for part in version.split(".")]
    while parts and parts[-1] == 0:
        parts.pop()
    return tuple(parts)


def test_the_base_install_has_no_extra_and_its_lower_bounds(base_install: Path) -> None:
    modules = sorted({m for extra in EXTRA_MODULES.values() for m in extra})
    bounds = dict(pin.split("==") for pin in _lower_bounds())
    program = ("import importlib.util, importlib.metadata as md, json\n"
               f"print(json.dumps(sorted(m for m in {modules!r} if importlib.util.find_spec(m))))\n"
               f"print(json.dumps({{name: md.version(name) for name in {sorted(bounds)!r}}}))\n")
    result = subprocess.run([str(base_install / "bin" / "python"), "-c", program],
                            capture_output=True, text=True, check=True, timeout=60)
    importable, installed = map(json.loads, result.stdout.splitlines())
    assert importable == [], "the base install brings an extra's module"
    assert {name: _release(v) for name, v in installed.items()} == \
        {name: _release(v) for name, v in bounds.items()}


def test_validate_crd_and_estimate_work_without_torch(base_install: Path,
                                                      tmp_path: Path) -> None:
    validate = _kubetrain(base_install, "validate", *map(str, EXAMPLES), cwd=tmp_path)
    assert validate.returncode == 0, validate.stderr
    crd = _kubetrain(base_install, "crd", cwd=tmp_path)
    assert crd.returncode == 0, crd.stderr
    assert crd.stdout == (REPO / "crds" / "trainingjob.yaml").read_text(), \
        "the base install at its lower bounds prints another CRD than the committed one"
    estimate = _kubetrain(base_install, "estimate", str(REPO / "examples" / "quickstart.yaml"),
                          cwd=tmp_path)
    assert estimate.returncode == 0, estimate.stderr
    assert "total" in estimate.stdout


@pytest.mark.parametrize(("command", "extra"), [("run", "trainer"), ("operator", "operator")])
def test_commands_that_need_an_extra_say_which(base_install: Path, tmp_path: Path,
                                               command: str, extra: str) -> None:
    result = _kubetrain(base_install, command, str(REPO / "examples" / "quickstart.yaml"),
                        cwd=tmp_path)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert f"pip install 'kubetrain[{extra}]'" in result.stderr
