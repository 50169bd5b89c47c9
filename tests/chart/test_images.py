"""The Dockerfiles agree with the chart and the operator: users, entrypoints, pinned bases.

Images are not built here (no container runtime in CI); what the images promise
that Python can check — the operator runs without torch — is checked directly.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kubetrain.api.manifest import parse_job
from kubetrain.operator.children import worker_pod

REPO = Path(__file__).resolve().parents[2]
IMAGES = REPO / "images"
Render = Callable[[dict[str, Any]], list[dict[str, Any]]]


def _instructions(dockerfile: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with continuation lines joined and comments dropped."""
    text = (IMAGES / dockerfile).read_text()
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    return [(m[1].upper(), m[2].strip()) for m in re.finditer(r"^(\w+)\s+(.*)$", joined, re.M)]


def _user_id(dockerfile: str) -> int:
    users = [args for instruction, args in _instructions(dockerfile) if instruction == "USER"]
    return int(users[-1].split(":")[0])


@pytest.mark.parametrize("dockerfile", ["operator.Dockerfile", "trainer.Dockerfile"])
def test_images_are_multi_stage_from_pinned_bases(dockerfile: str) -> None:
    instructions = _instructions(dockerfile)
    assert sum(1 for i, _ in instructions if i == "FROM") >= 2, "build and runtime stages"
    bases = [args.split("=", 1)[1] for instruction, args in instructions
             if instruction == "ARG" and "_IMAGE=" in args]
    assert bases, f"{dockerfile}: the base image should be a build argument with a default"
    for base in bases:
        tag = base.rsplit(":", 1)[-1]
        assert re.match(r"\d+\.\d+\.\d+", tag), f"{dockerfile}: {base} is not an exact release"
    assert _user_id(dockerfile) != 0


def _distributions() -> set[str]:
    """Every distribution pyproject.toml names, in the base install or in any extra."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    requirements = [*project["dependencies"],
                    *(r for extra in project["optional-dependencies"].values() for r in extra)]
    return {re.split(r"[\s\[<>=!~;]", r, maxsplit=1)[0].lower() for r in requirements}


@pytest.mark.parametrize(("dockerfile", "extra"), [
    ("operator.Dockerfile", "operator"),
    # The trainer's, and torchft for spec.faultTolerance's lighthouse and Manager.
    ("trainer.Dockerfile", "trainer,fault-tolerance"),
])
def test_images_install_the_wheel_with_its_extra_and_no_copied_requirements(
        dockerfile: str, extra: str) -> None:
    """pyproject.toml's extras are the one list of what each image needs: no drift."""
    runs = " ".join(args for instruction, args in _instructions(dockerfile)
                    if instruction == "RUN")
    installs = [words.split() for words in re.findall(r"pip install ([^&;|]*)", runs)]
    assert [f'"${{wheel}}[{extra}]"'] in [[w for w in words if not w.startswith("-")]
                                         for words in installs], installs
    named = {w.strip("\"'").split("[")[0].split(">")[0].split("=")[0].lower()
             for words in installs for w in words}
    assert not named & _distributions(), f"{dockerfile} lists dependencies by hand"
    assert not any("--no-deps" in words for words in installs)


def test_operator_image_user_and_entrypoint_match_the_chart(render: Render) -> None:
    pod = next(o for o in render({}) if o["kind"] == "Deployment")["spec"]["template"]["spec"]
    assert _user_id("operator.Dockerfile") == pod["securityContext"]["runAsUser"]
    entrypoints = [a for i, a in _instructions("operator.Dockerfile") if i == "ENTRYPOINT"]
    assert entrypoints == ['["kubetrain", "operator"]']


def test_trainer_image_user_matches_the_worker_pods(minimal_manifest: dict[str, Any]) -> None:
    manifest = {**minimal_manifest, "metadata": {"name": "demo", "uid": "1"}}
    pod = worker_pod(parse_job(manifest), 0, 0)
    assert _user_id("trainer.Dockerfile") == pod["spec"]["securityContext"]["runAsUser"]


def test_operator_runs_without_torch() -> None:
    """The operator image has no torch: its command must load and parse without it."""
    program = (
        "import sys; sys.modules['torch'] = None\n"  # any `import torch` now raises ImportError
        "import kubetrain.operator.command, kubetrain.operator.handlers\n"
        "from kubetrain.cli import main\n"
        "sys.argv = ['kubetrain', 'operator', '--help']\n"
        "main()\n"
    )
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "--namespace" in result.stdout
