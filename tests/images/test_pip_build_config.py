"""Image builds see this machine's pip configuration: every path it names, whatever the key.

The paths are found by their form (an absolute path or a file:// URL in any value), so a key
pip adds later is not missed; a path that does not exist is a clear error before any build.
The last test builds for real with buildah: a constraint file named in the configuration
decides what pip in the build may install.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from build_images import BuildError, build_images, build_on_python_base
from pip_build_config import PipConfigError, local_paths, write_pip_conf


def test_every_existing_path_in_any_key_is_found_and_nested_ones_once(tmp_path: Path) -> None:
    constraints = tmp_path / "constraints.txt"
    constraints.write_text("pyyaml<99\n")
    wheels = tmp_path / "wheels"
    (wheels / "more").mkdir(parents=True)
    index = tmp_path / "pypi" / "simple"
    index.mkdir(parents=True)
    sections = {
        "global": {"constraint": str(constraints), "find-links": f"{wheels} {wheels}/more",
                   "extra-index-url": f"{index.as_uri()} https://pypi.example/simple",
                   "timeout": "60", "a-key-pip-adds-later": str(tmp_path / "pypi")},
        "install": {"requirement": f"file://{constraints}"},
    }
    # the index's parent (its pages link to ../../files); the folder inside wheels/ once
    assert local_paths(sections) == sorted([str(constraints), str(wheels),
                                            str(tmp_path / "pypi")])


def test_a_path_that_does_not_exist_names_its_key(tmp_path: Path) -> None:
    gone = tmp_path / "gone.txt"
    with pytest.raises(PipConfigError, match=rf"global\.constraint = {gone}.*pip config"):
        local_paths({"global": {"constraint": str(gone), "find-links": str(tmp_path)}})


def _config_with_constraint(tmp_path: Path, constraint: str) -> Path:
    """This machine's effective pip configuration, its constraint set to CONSTRAINT."""
    (tmp_path / "constraints.txt").write_text(constraint + "\n")
    conf = tmp_path / "pip.conf"
    write_pip_conf(str(conf))
    text = [line for line in conf.read_text().splitlines()
            if not line.startswith("constraint")]
    text.insert(text.index("[global]") + 1, f"constraint = {tmp_path / 'constraints.txt'}")
    conf.write_text("\n".join(text) + "\n")
    return conf


def test_the_build_mounts_a_constraint_file_and_reports_one_that_is_gone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    conf = _config_with_constraint(tmp_path, "pyyaml<99")
    monkeypatch.setenv("PIP_CONFIG_FILE", str(conf))
    assert str(tmp_path / "constraints.txt") in write_pip_conf(str(tmp_path / "out.conf"))
    (tmp_path / "constraints.txt").unlink()
    with pytest.raises(PipConfigError, match="constraint"):
        write_pip_conf(str(tmp_path / "out.conf"))


@pytest.mark.skipif(os.geteuid() != 0, reason="buildah's chroot isolation needs root")
def test_a_build_obeys_the_constraint_file_the_pip_configuration_names(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    python_base = build_images(("operator",), log=print)["python"].archive
    dockerfile = tmp_path / "context" / "Containerfile"
    dockerfile.parent.mkdir()
    dockerfile.write_text("ARG PYTHON_IMAGE\nFROM ${PYTHON_IMAGE}\n"
                          "RUN pip install --no-deps --dry-run pyyaml\n")
    allowing = tmp_path / "allowing"
    allowing.mkdir()
    monkeypatch.setenv("PIP_CONFIG_FILE", str(_config_with_constraint(allowing, "pyyaml>=5")))
    build_on_python_base(dockerfile, python_base)

    refusing = tmp_path / "refusing"
    refusing.mkdir()
    monkeypatch.setenv("PIP_CONFIG_FILE", str(_config_with_constraint(refusing, "pyyaml<1")))
    with pytest.raises(BuildError, match=r"pyyaml"):
        build_on_python_base(dockerfile, python_base)
